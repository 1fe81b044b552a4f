//! The sandbox stage: executes what a rollout's environment needs before it can be
//! scored, in the sandboxes of `streamrl-sandbox` (namespaces, seccomp, rlimits, a warm
//! pool).
//!
//! For each rollout, by its environment:
//! * nothing to run (arith, countdown, math): passed to `executed` with
//!   `exec_status = skipped`;
//! * a program to run (code: the unit-test harness around the model's function): run, and
//!   passed to `executed` with the status, exit code, output, duration and test counts;
//! * a turn that ended in a tool call (`finish_reason = tool_call`, tool environments):
//!   the call runs and a `continuations` row carries its output to the rollout stage for
//!   the next turn; the last allowed turn (`max_turns`) is passed to `executed` instead,
//!   so the trajectory is scored without an answer.
//!
//! Executions of one input run concurrently (at most `max_concurrency`). They run where
//! `executor` says: `local`, the stage's own warm pool (only started when a configured
//! environment needs a sandbox, so the arith demo runs where namespaces are not
//! available), or `gateways`, a fleet of `streamrl sandbox serve` gateways found by name
//! (see [`crate::gateways`]: least-loaded routing, retries on another gateway,
//! backpressure). Replicas share the work through the bus.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use streamrl_envs::{Environment, Execution, Mix, Problem};
use streamrl_runtime::build::{BuildContext, BuildError, BuildStage, none_or_invalid};
use streamrl_runtime::{Emitter, Input, Stage, StageError};
use streamrl_sandbox::{ExecRequest, ExecResult, ExecStatus, Pool};
use streamrl_schemas::{
    ContinuationRow, ExecutedRow, RolloutRow, SchemaId, ToolCall, ToolOutput, TopicRow, Validate, trajectory_into,
};

use crate::gateways::{Fleet, GatewayStats, GatewaysConfig};
use crate::{Invalid, now_ms, rows};

/// Configuration of the sandbox stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    /// The sandboxes: pool size, limits, read-only binds, cgroups (see
    /// `streamrl_sandbox::SandboxConfig`).
    pub pool: streamrl_sandbox::SandboxConfig,
    /// Executions in flight at once per replica.
    pub max_concurrency: usize,
    /// Where executions run: `local` (the pool above, in this process) or `gateways`
    /// (the fleet in `gateways`; `pool.limits` still caps what is asked of them).
    pub executor: Executor,
    /// The gateways, for `executor: gateways`.
    pub gateways: GatewaysConfig,
}

/// Where the sandbox stage's executions run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Executor {
    /// The stage's own warm pool.
    #[default]
    Local,
    /// A fleet of sandbox gateways ([`crate::gateways`]).
    Gateways,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            pool: streamrl_sandbox::SandboxConfig::default(),
            max_concurrency: 8,
            executor: Executor::Local,
            gateways: GatewaysConfig::default(),
        }
    }
}

impl Validate for SandboxConfig {
    fn problems(&self) -> Vec<Invalid> {
        let mut p: Vec<Invalid> = self
            .pool
            .validate()
            .err()
            .unwrap_or_default()
            .into_iter()
            .map(|e| Invalid::new("pool", e))
            .collect();
        if self.max_concurrency == 0 {
            p.push(Invalid::new("max_concurrency", "must be at least 1"));
        }
        if self.executor == Executor::Gateways {
            p.extend(self.gateways.problems());
        }
        p
    }
}

/// The sandbox stage.
#[derive(Debug)]
pub struct SandboxStage {
    cfg: SandboxConfig,
    envs: Arc<Mix>,
    pool: Option<Arc<Pool>>,
    fleet: Option<Arc<Fleet>>,
    executed: String,
    continuations: Option<String>,
    instruments: streamrl_runtime::instruments::Instruments,
}

/// Builds the stage; starts the sandbox pool when an environment needs it (a host that
/// cannot run sandboxes fails here with the reason).
impl BuildStage for SandboxStage {
    type Config = SandboxConfig;

    fn build(cfg: SandboxConfig, ctx: &BuildContext) -> Result<Self, BuildError> {
        let mut errs = cfg.problems();
        let envs = crate::require_environments(ctx).map_err(|e| errs.extend(e));
        let executed = ctx.require_output(SchemaId::Executed).map_err(|e| errs.push(e));
        none_or_invalid(errs)?;
        let envs = envs.expect("checked");
        let continuations = ctx.output(SchemaId::Continuations);
        let tools: Vec<&str> = envs
            .iter()
            .filter(|(e, _)| e.tools().is_some())
            .map(|(e, _)| e.name())
            .collect();
        if continuations.is_none() && !tools.is_empty() {
            return Err(BuildError::Invalid(vec![Invalid::whole(format!(
                "environment(s) {} use tools: the sandbox stage needs a `continuations` output",
                tools.join(", ")
            ))]));
        }
        let (pool, fleet) = match (envs.needs_sandbox(), cfg.executor) {
            (false, _) => (None, None),
            (true, Executor::Local) => (
                Some(Arc::new(
                    Pool::new(cfg.pool.clone()).map_err(|e| BuildError::setup("sandbox pool", e))?,
                )),
                None,
            ),
            (true, Executor::Gateways) => (
                None,
                Some(Arc::new(
                    Fleet::new(cfg.gateways.clone()).map_err(|e| BuildError::setup("sandbox gateways", e))?,
                )),
            ),
        };
        Ok(SandboxStage {
            cfg,
            envs,
            pool,
            fleet,
            executed: executed.expect("checked"),
            continuations,
            instruments: ctx.instruments(),
        })
    }
}

/// What a rollout needs.
enum Plan {
    /// Nothing to run (`reason`: why, when it is not the environment's normal case).
    Skip(Option<String>),
    /// Refused: cannot be executed (`reason`).
    Refuse(String),
    /// Run a program and report into `executed`.
    Run(Execution),
    /// Run a tool call and continue the trajectory.
    Tool(ToolCall, Execution),
}

fn problem_of(r: &RolloutRow) -> Problem {
    Problem {
        id: r.problem_id.clone(),
        env: r.env.clone(),
        question: r.prompt.clone(),
        answer: r.answer.clone(),
        info: r
            .info
            .as_deref()
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or_default(),
    }
}

fn plan(env: &dyn Environment, r: &RolloutRow) -> Plan {
    if r.finish_reason == "tool_call" {
        let Some(t) = env.tools() else {
            return Plan::Refuse(format!(
                "environment `{}` has no tools, but the turn ended in a tool call",
                r.env
            ));
        };
        if r.turn + 1 >= t.max_turns {
            return Plan::Skip(Some(format!(
                "max_turns ({}) reached with a tool call; no answer was given",
                t.max_turns
            )));
        }
        let Some(code) = t.parse_call(t.last_turn(&r.completion)) else {
            return Plan::Skip(Some(
                "the turn ended at the tool marker but no call could be parsed".into(),
            ));
        };
        let call = crate::tool_call(t, &r.rollout_id, r.turn, t.last_turn(&r.completion)).expect("parsed above");
        return Plan::Tool(call, t.execution(&code));
    }
    match env.execution(&problem_of(r), &r.completion) {
        Some(ex) => Plan::Run(ex),
        None => Plan::Skip(None),
    }
}

fn run(pool: &Pool, ex: &Execution) -> ExecResult {
    let mut limits = pool.config().limits;
    if let Some(ms) = ex.wall_ms {
        limits.wall_ms = ms.min(limits.wall_ms);
    }
    let req = ExecRequest::new(ex.argv.clone()).with_limits(limits);
    let files: Vec<(&str, &[u8])> = ex.files.iter().map(|(p, c)| (p.as_str(), c.as_bytes())).collect();
    pool.exec_with_files(&files, &req)
}

fn executed(
    r: RolloutRow,
    status: &str,
    result: Option<&ExecResult>,
    tests: (u32, u32),
    note: Option<String>,
) -> ExecutedRow {
    trajectory_into!(
        r,
        ExecutedRow {
            tool_outputs: vec![],
            exec_status: status.to_string(),
            exit_code: result.and_then(|x| x.exit_code),
            stdout: result.map(|x| x.stdout.clone()).unwrap_or_default(),
            stderr: match (result, note) {
                (_, Some(n)) => n,
                (Some(x), None) if x.status != ExecStatus::Ok && !x.reason.is_empty() => format!(
                    "{}{}{}",
                    x.stderr,
                    if x.stderr.is_empty() { "" } else { "\n" },
                    x.reason
                ),
                (Some(x), None) => x.stderr.clone(),
                (None, None) => String::new(),
            },
            exec_duration_ms: result.map(|x| x.wall_ms as u64).unwrap_or(0),
            tests_passed: tests.0,
            tests_total: tests.1,
            created_at: now_ms(),
        }
    )
}

/// A rollout passed through unexecuted (`skipped`), or refused with `internal_error`.
pub fn pass_through(r: RolloutRow) -> ExecutedRow {
    let refused = r.finish_reason == "tool_call";
    let note = refused.then(|| {
        format!(
            "environment `{}` has no tools, but the turn ended in a tool call",
            r.env
        )
    });
    executed(
        r,
        if refused { "internal_error" } else { "skipped" },
        None,
        (0, 0),
        note,
    )
}

#[async_trait]
impl Stage for SandboxStage {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        let rollouts = rows::<RolloutRow>(&input.batch)?;
        let mut plans = Vec::with_capacity(rollouts.len());
        for r in &rollouts {
            let env = self.envs.get(&r.env).ok_or_else(|| {
                StageError::user(format!(
                    "sample {} names environment `{}`, which is not configured",
                    r.sample_id, r.env
                ))
            })?;
            plans.push(plan(env, r));
        }
        let keys: Vec<&str> = rollouts.iter().map(|r| r.rollout_id.as_str()).collect();
        let results = self.execute(&plans, &keys).await?;
        let (mut exec_rows, mut cont_rows) = (Vec::new(), Vec::new());
        for ((r, p), res) in rollouts.into_iter().zip(plans).zip(results) {
            match p {
                Plan::Skip(note) => exec_rows.push(executed(r, "skipped", None, (0, 0), note)),
                Plan::Refuse(why) => exec_rows.push(executed(r, "internal_error", None, (0, 0), Some(why))),
                Plan::Run(ex) => {
                    let res = res.expect("ran");
                    let tests = ex.report(&res.stdout).unwrap_or((0, 0));
                    exec_rows.push(executed(r, res.status.as_str(), Some(&res), tests, None));
                }
                Plan::Tool(call, _) => cont_rows.push(self.continuation(r, call, &res.expect("ran"))),
            }
        }
        if !exec_rows.is_empty() {
            out.emit(
                self.executed.clone(),
                ExecutedRow::to_batch(&exec_rows).map_err(|e| StageError::internal(e.to_string()))?,
            );
        }
        if !cont_rows.is_empty() {
            let topic = self.continuations.clone().expect("checked at build");
            out.emit(
                topic,
                ContinuationRow::to_batch(&cont_rows).map_err(|e| StageError::internal(e.to_string()))?,
            );
        }
        Ok(())
    }
}

impl SandboxStage {
    /// Runs every plan that executes something, at most `max_concurrency` at once; each
    /// plan's result (`None`: nothing to run), its duration recorded per status.
    async fn execute(&self, plans: &[Plan], keys: &[&str]) -> Result<Vec<Option<ExecResult>>, StageError> {
        let mut results: Vec<Option<ExecResult>> = vec![None; plans.len()];
        let mut took = vec![Duration::ZERO; plans.len()];
        let sem = Arc::new(tokio::sync::Semaphore::new(self.cfg.max_concurrency));
        let mut tasks = tokio::task::JoinSet::new();
        for (i, p) in plans.iter().enumerate() {
            let ex = match p {
                Plan::Run(ex) | Plan::Tool(_, ex) => ex.clone(),
                _ => continue,
            };
            let permit = sem
                .clone()
                .acquire_owned()
                .await
                .map_err(|e| StageError::internal(e.to_string()))?;
            if let Some(fleet) = self.fleet.clone() {
                let (key, limits) = (keys[i].to_string(), self.cfg.pool.limits);
                tasks.spawn(async move {
                    let started = Instant::now();
                    let r = fleet.exec(&key, &ex, &limits).await;
                    drop(permit);
                    (i, r, started.elapsed())
                });
                continue;
            }
            let Some(pool) = self.pool.clone() else {
                results[i] = Some(ExecResult::internal_error(
                    "no sandbox pool: no configured environment needs one",
                ));
                continue;
            };
            tasks.spawn_blocking(move || {
                let started = Instant::now();
                let r = run(&pool, &ex);
                drop(permit);
                (i, r, started.elapsed())
            });
        }
        while let Some(done) = tasks.join_next().await {
            let (i, r, d) = done.map_err(|e| StageError::internal(format!("sandbox task: {e}")))?;
            results[i] = Some(r);
            took[i] = d;
        }
        for (p, (r, d)) in plans.iter().zip(results.iter().zip(&took)) {
            let status = match (p, r) {
                (Plan::Skip(_), _) => "skipped",
                (Plan::Refuse(_), _) => "internal_error",
                (_, Some(r)) => r.status.as_str(),
                (_, None) => continue,
            };
            self.instruments.sandbox_execution(status, *d);
        }
        Ok(results)
    }

    /// The gateways and what each served (`executor: gateways`), else `None`.
    pub fn gateways(&self) -> Option<Vec<GatewayStats>> {
        self.fleet.as_ref().map(|f| f.stats())
    }

    /// The trajectory `r` continued by the output of its tool `call`.
    fn continuation(&self, mut r: RolloutRow, call: ToolCall, res: &ExecResult) -> ContinuationRow {
        let env = self.envs.get(&r.env).expect("planned with it");
        let t = env.tools().expect("a tool plan");
        let output = ToolOutput {
            call_id: call.id.clone(),
            name: call.name.clone(),
            output: t.render(&res.stdout, &res.stderr, res.status.as_str()),
            status: res.status.as_str().to_string(),
        };
        r.tool_calls = vec![call];
        trajectory_into!(
            r,
            ContinuationRow {
                tool_outputs: vec![output],
                created_at: now_ms(),
            }
        )
    }
}

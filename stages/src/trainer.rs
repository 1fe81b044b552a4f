//! The trainer stage: assembles step batches from `samples`, drops stale samples, takes one
//! optimizer step per batch, writes each policy version atomically to the checkpoint store
//! and publishes it on `policy`, with per-step metrics on `metrics`.
//!
//! Version `v + 1` is trained on exactly the `groups_per_step` groups the source admitted
//! for step `v` (the mask stage sends each group whole, one message per group), so "which
//! rollouts were trained into version N" is `samples WHERE step = N - 1`. Groups of later
//! steps wait, unacknowledged, for their turn; if a group of the current step never comes
//! (`step_timeout_secs` after later ones started waiting) the step trains without it and
//! counts it missing. Groups filtered for zero reward variance arrive with no trainable
//! token: they complete the batch but are not trained on. A sample whose oldest token
//! comes from a policy older than `version − max_off_policy_steps` is dropped and counted.
//!
//! Restarts: each version is written to `checkpoints/step-NNNNNN/` (weights, tokenizer,
//! optimizer state, and `trainer_state.json` last, with the ids of the samples consumed in
//! the last `dedup_window` steps); the stage resumes from the newest complete one, skips
//! samples it already consumed (samples of steps older than the window are dropped as
//! superseded: too old to tell from a copy), and holds its inputs until the checkpoint
//! that includes them is on disk, so a crash neither loses nor repeats a sample. The
//! version it has published is recorded (`checkpoints/published`) once the bus has it; on
//! a durable bus a restarted trainer whose record is older than its newest checkpoint
//! reads the newest message of `policy` and publishes that checkpoint only if the topic
//! does not hold it yet (killed between saving and publishing), never twice (killed
//! between the bus's acknowledgement and the record).
//!
//! Lineage: with a topic of schema `trained` among its outputs, the trainer emits, with
//! each version, one row per sample it consumed for it (trained, filtered, stale) and one
//! per group of its step it stopped waiting for (timed_out, no sample id), and one row
//! per copy it dropped (duplicate, superseded) when it drops it. After
//! `max_steps` it signals the end of the run on `policy` ([`Signal::EndOfRun`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use streamrl_model::chat::ChatTemplate;
use streamrl_runtime::build::{BuildContext, BuildError, BuildStage};
use streamrl_runtime::{Emitter, Input, Stage, StageError, telemetry};
use streamrl_schemas::{Outcome, PolicyRow, SampleRow, SchemaId, Signal, TopicRow, TrainedRow, Validate};

use crate::step_metrics::{StepMetrics, name};
use crate::train::{Learner, StepReport, TrainConfig, TrainSample};
use crate::{Invalid, compute, now_ms, rows};

/// Configuration of the trainer stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerConfig {
    /// The initial policy (HF checkpoint directory), version 0.
    pub checkpoint: PathBuf,
    /// Groups per step batch (must equal the source's).
    pub groups_per_step: usize,
    /// Drop samples whose oldest token is more than this many versions old.
    pub max_off_policy_steps: u64,
    /// Stop training after this many versions (`null`: never).
    pub max_steps: Option<u64>,
    /// Keep the newest this many checkpoints...
    pub keep_last: usize,
    /// ...plus every version divisible by this (0: none).
    pub keep_every: u64,
    /// A version that drops out of the newest `keep_last` is deleted only once the version
    /// after it has existed this long, so a replica still downloading or loading it is not
    /// cut off (at most `4 × keep_last` versions are kept for this; at the last version of
    /// the run, only `keep_last`). 0: delete at once.
    pub retain_secs: f64,
    /// Train a step with the groups it has once groups of later steps have waited this
    /// long for a missing one (a lost prompt must not stall training).
    pub step_timeout_secs: u64,
    /// Loss, optimizer, learning rate and packing.
    pub train: TrainConfig,
    /// Measure held-out greedy accuracy every this many versions (and at version 0), on
    /// the first `eval_problems` eval-split problems of each environment that needs no
    /// sandbox; published as `heldout_accuracy` (mean) and `heldout/<env>` metrics. 0: off.
    pub eval_every: u64,
    /// Held-out problems per environment for `eval_every`.
    pub eval_problems: usize,
    /// Steps of sample ids remembered for deduplication (bounded memory): a sample of a
    /// step older than `version − dedup_window` is dropped as superseded.
    pub dedup_window: u64,
    /// Completion tokens at most in the held-out evaluation.
    pub eval_max_tokens: usize,
    /// Serve checkpoints over HTTP on this `host:port` (port 0: any free one), so that
    /// readers need no shared disk: `policy` rows then carry
    /// `http://…/checkpoints/<version>` (see `streamrl_stages::weights`). Unset: `file://`
    /// paths, for readers on this host or a shared volume.
    pub serve_checkpoints: Option<String>,
    /// The base URL readers reach that server at (default `http://<bound address>`;
    /// required when `serve_checkpoints` listens on an unspecified address like 0.0.0.0).
    pub checkpoint_url: Option<String>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            checkpoint: PathBuf::new(),
            groups_per_step: 4,
            max_off_policy_steps: 8,
            max_steps: None,
            keep_last: 3,
            keep_every: 0,
            retain_secs: 10.0,
            step_timeout_secs: 300,
            train: TrainConfig::default(),
            eval_every: 0,
            eval_problems: 200,
            eval_max_tokens: 16,
            dedup_window: 64,
            serve_checkpoints: None,
            checkpoint_url: None,
        }
    }
}

impl Validate for TrainerConfig {
    fn problems(&self) -> Vec<Invalid> {
        let mut p = Vec::new();
        if self.checkpoint.as_os_str().is_empty() {
            p.push(Invalid::new("checkpoint", "required (the initial policy)"));
        }
        if self.groups_per_step == 0 {
            p.push(Invalid::new("groups_per_step", "must be at least 1"));
        }
        if self.dedup_window <= self.max_off_policy_steps {
            p.push(Invalid::new(
                "dedup_window",
                format!(
                    "{} must exceed max_off_policy_steps {} (a sample young enough to train must be told apart from a copy)",
                    self.dedup_window, self.max_off_policy_steps
                ),
            ));
        }
        if self.keep_last == 0 {
            p.push(Invalid::new(
                "keep_last",
                "must be at least 1 (rollout replicas load the newest)",
            ));
        }
        if !(self.retain_secs.is_finite() && self.retain_secs >= 0.0) {
            p.push(Invalid::new(
                "retain_secs",
                format!("{} must be a number ≥ 0", self.retain_secs),
            ));
        }
        match (&self.serve_checkpoints, &self.checkpoint_url) {
            (None, Some(u)) => p.push(Invalid::new(
                "checkpoint_url",
                format!("`{u}` needs serve_checkpoints (the address to serve them on)"),
            )),
            (Some(a), url) => match a.parse::<std::net::SocketAddr>() {
                Err(e) => p.push(Invalid::new(
                    "serve_checkpoints",
                    format!("`{a}` is not a host:port address: {e}"),
                )),
                Ok(addr) if addr.ip().is_unspecified() && url.is_none() => p.push(Invalid::new(
                    "serve_checkpoints",
                    format!("`{a}` listens on every interface: set checkpoint_url to the URL readers reach it at"),
                )),
                Ok(_) => {}
            },
            (None, None) => {}
        }
        if let Some(u) = self.checkpoint_url.as_ref().filter(|u| !u.starts_with("http://")) {
            p.push(Invalid::new("checkpoint_url", format!("`{u}` must start with http://")));
        }
        p.extend(streamrl_schemas::problem::under("train", self.train.problems()));
        p
    }
}

/// What the trainer persists with each checkpoint.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct TrainerState {
    version: u64,
    /// Sample ids consumed, by admitted step, for the steps inside the dedup window.
    consumed_by_step: BTreeMap<u64, Vec<String>>,
    /// The lineage rows of this version (emitted again if it is published after a restart).
    lineage: Vec<TrainedRow>,
}

/// The trainer stage.
pub struct TrainerStage {
    cfg: TrainerConfig,
    ctx: BuildContext,
    /// The topology's environments (held-out evaluation), if it has any.
    envs: Option<std::sync::Arc<streamrl_envs::Mix>>,
    learner: Learner,
    store: PathBuf,
    policy_topic: String,
    version: u64,
    current: PolicyRow,
    /// Sample ids consumed, by admitted step (steps below the dedup watermark are pruned).
    consumed: BTreeMap<u64, HashSet<String>>,
    /// The lineage topic, when configured.
    trained_topic: Option<String>,
    /// The newest version the bus has acknowledged on `policy` (from `checkpoints/published`).
    published: Option<u64>,
    /// A version emitted on `policy` whose delivery is not yet recorded.
    publishing: Option<u64>,
    /// The lineage rows of the newest checkpoint.
    last_lineage: Vec<TrainedRow>,
    /// A version whose held-out eval is due: run at the next call (tick or step), once
    /// the version itself has gone out, so that the rollout stage loads it meanwhile.
    eval_due: Option<u64>,
    /// Groups waiting, by admitted step, then group id.
    buffer: BTreeMap<u64, BTreeMap<String, Vec<SampleRow>>>,
    /// Since when groups of a later step have been waiting on an incomplete current step.
    waiting_since: Option<std::time::Instant>,
    duplicates: u64,
    missing: u64,
    /// The chat template prompts are rendered with (held-out evaluation).
    template: ChatTemplate,
    /// The checkpoint server's socket, bound at build, served from `start`.
    ckpt_listener: Option<std::net::TcpListener>,
    /// The checkpoint server, once started.
    ckpt_server: Option<crate::weights::CheckpointServer>,
    /// Base URL of the published checkpoints (`None`: `file://` paths).
    ckpt_base: Option<String>,
    /// The trace context of each buffered group's message: a step's span links to them.
    traces: HashMap<String, String>,
    instruments: streamrl_runtime::instruments::Instruments,
}

/// Which of the stored `versions` (version, when written; ascending) to keep: the newest
/// `keep_last`, every multiple of `keep_every`, and, up to `4 × keep_last` in all, those
/// whose successor was written less than `grace_secs` before `now` (a reader may still be
/// fetching them).
fn retained(
    versions: &[(u64, std::time::SystemTime)],
    keep_last: usize,
    keep_every: u64,
    grace_secs: f64,
    now: std::time::SystemTime,
) -> Vec<u64> {
    let n = versions.len();
    let mut keep = Vec::new();
    for (i, (v, _)) in versions.iter().enumerate() {
        let newest = i + keep_last >= n;
        let milestone = keep_every > 0 && v.is_multiple_of(keep_every);
        let recent = i + 4 * keep_last >= n
            && versions.get(i + 1).is_some_and(|(_, next)| {
                now.duration_since(*next)
                    .map(|age| age.as_secs_f64() < grace_secs)
                    .unwrap_or(true)
            });
        if newest || milestone || recent {
            keep.push(*v);
        }
    }
    keep
}

/// The URI `policy` carries for `version` stored in `dir`.
fn policy_uri(base: Option<&str>, version: u64, dir: &Path) -> String {
    match base {
        Some(b) => format!("{}/checkpoints/{version}", b.trim_end_matches('/')),
        None => format!("file://{}", abs(dir).display()),
    }
}

impl std::fmt::Debug for TrainerStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainerStage").field("cfg", &self.cfg).finish()
    }
}

/// The newest complete checkpoint in a store (`step-N` with `trainer_state.json`).
pub fn latest_checkpoint(store: &Path) -> Option<(u64, PathBuf)> {
    std::fs::read_dir(store)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let v = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().join("trainer_state.json").exists().then(|| (v, e.path()))
        })
        .max_by_key(|(v, _)| *v)
}

/// What a step does with each of its samples: trained, filtered (no trainable token) or
/// dropped as stale (older than `max_off_policy_steps` versions).
struct Triage<'a> {
    /// The samples to train, as the learner takes them.
    train: Vec<TrainSample>,
    /// Each sample's outcome, for the lineage.
    outcomes: Vec<(&'a SampleRow, Outcome)>,
    /// Samples per staleness (versions behind the trainer, by a sample's oldest token).
    staleness: BTreeMap<u64, u64>,
    /// Samples dropped as stale.
    stale: u64,
    /// Samples without a trainable token.
    filtered: u64,
}

impl<'a> Triage<'a> {
    fn of(
        all: &'a [SampleRow],
        version: u64,
        max_off_policy_steps: u64,
        instruments: &streamrl_runtime::instruments::Instruments,
    ) -> Self {
        let oldest_ok = version.saturating_sub(max_off_policy_steps);
        let mut t = Triage {
            train: Vec::new(),
            outcomes: Vec::with_capacity(all.len()),
            staleness: BTreeMap::new(),
            stale: 0,
            filtered: 0,
        };
        for s in all {
            let oldest = s.completion_versions.iter().copied().min().unwrap_or(version as u32) as u64;
            *t.staleness.entry(version.saturating_sub(oldest)).or_default() += 1;
            instruments.staleness(version.saturating_sub(oldest));
            let outcome = if !s.loss_mask.iter().any(|m| *m) {
                t.filtered += 1;
                Outcome::Filtered
            } else if oldest < oldest_ok {
                t.stale += 1;
                Outcome::Stale
            } else {
                t.train.push(TrainSample {
                    prompt: s.prompt_token_ids.clone(),
                    completion: s.completion_token_ids.clone(),
                    sampler_logprobs: s.completion_logprobs.clone(),
                    loss_mask: s.loss_mask.clone(),
                    advantage: s.advantage,
                    routes: s.completion_routes.clone(),
                });
                Outcome::Trained
            };
            t.outcomes.push((s, outcome));
        }
        t
    }
}

fn abs(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Builds the stage: resumes from the newest checkpoint in `run_dir/checkpoints`, or
/// starts from `checkpoint`.
impl BuildStage for TrainerStage {
    type Config = TrainerConfig;

    fn build(cfg: TrainerConfig, ctx: &BuildContext) -> Result<Self, BuildError> {
        let policy = ctx.checked_output(&cfg, SchemaId::Policy)?;
        let envs = crate::environments(ctx)?;
        let store = ctx.run_dir.join("checkpoints");
        let ckpt_listener = match &cfg.serve_checkpoints {
            Some(a) => Some(
                std::net::TcpListener::bind(a)
                    .map_err(|e| BuildError::setup(format!("serve_checkpoints: binding {a}"), e))?,
            ),
            None => None,
        };
        let ckpt_base = match (&cfg.checkpoint_url, &ckpt_listener) {
            (Some(u), _) => Some(u.clone()),
            (None, Some(l)) => Some(format!(
                "http://{}",
                l.local_addr().map_err(|e| BuildError::setup("serve_checkpoints", e))?
            )),
            (None, None) => None,
        };
        let (dir, state) = match latest_checkpoint(&store) {
            Some((_, dir)) => {
                let path = dir.join("trainer_state.json");
                let state: TrainerState = std::fs::read(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
                    .map_err(|e| BuildError::setup(format!("resuming from {}", path.display()), e))?;
                tracing::info!(version = state.version, dir = %dir.display(), "trainer resumes");
                (dir, state)
            }
            None => (cfg.checkpoint.clone(), TrainerState::default()),
        };
        let published = std::fs::read_to_string(store.join("published"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        let learner = Learner::load(&dir, cfg.train.clone())
            .map_err(|e| BuildError::setup(format!("checkpoint {}", dir.display()), e))?;
        let sha = streamrl_model::checkpoint::weights_sha256(&dir)
            .map_err(|e| BuildError::setup(format!("checkpoint {}", dir.display()), e))?;
        let template =
            ChatTemplate::for_checkpoint(&cfg.checkpoint).map_err(|e| Invalid::new("checkpoint", e.to_string()))?;
        let current = PolicyRow {
            run_id: ctx.run_id.clone(),
            version: state.version as u32,
            step: state.version,
            uri: policy_uri(ckpt_base.as_deref(), state.version, &dir),
            sha256: sha,
            created_at: now_ms(),
        };
        let instruments = ctx.instruments();
        Ok(TrainerStage {
            ckpt_listener,
            ckpt_server: None,
            ckpt_base,
            consumed: state
                .consumed_by_step
                .into_iter()
                .map(|(k, v)| (k, v.into_iter().collect()))
                .collect(),
            trained_topic: ctx.output(SchemaId::Trained),
            published,
            publishing: None,
            last_lineage: state.lineage,
            eval_due: None,
            version: state.version,
            current,
            cfg,
            ctx: ctx.clone(),
            envs,
            learner,
            store,
            policy_topic: policy,
            buffer: BTreeMap::new(),
            waiting_since: None,
            duplicates: 0,
            missing: 0,
            template,
            traces: HashMap::new(),
            instruments,
        })
    }
}

impl TrainerStage {
    /// The policy version published last.
    pub fn version(&self) -> u64 {
        self.version
    }

    fn done(&self) -> bool {
        self.cfg.max_steps.is_some_and(|m| self.version >= m)
    }

    fn publish(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        out.emit(
            self.policy_topic.clone(),
            PolicyRow::to_batch(std::slice::from_ref(&self.current))
                .map_err(|e| StageError::internal(e.to_string()))?,
        );
        self.publishing = Some(self.version);
        if self.done() {
            // The last version: every stage of the run finishes on this.
            out.signal(self.policy_topic.clone(), Signal::EndOfRun);
        }
        Ok(())
    }

    /// The newest message of each partition of `topic`, each with its headers and, for a
    /// data message, its rows of `schema` (`None` for a signal).
    async fn newest_on(
        &self,
        topic: &str,
        schema: SchemaId,
    ) -> Result<Vec<(streamrl_schemas::Headers, Option<arrow::record_batch::RecordBatch>)>, StageError> {
        let Some(bus) = &self.ctx.bus else {
            return Ok(Vec::new());
        };
        let newest = streamrl_runtime::bus::newest(bus.0.as_ref(), topic, std::time::Duration::from_secs(60))
            .await
            .map_err(|e| StageError::external(format!("reading what `{topic}` holds: {e}")))?;
        newest
            .into_iter()
            .map(|m| {
                let bad =
                    |e: streamrl_schemas::Error| StageError::internal(format!("`{topic}` offset {}: {e}", m.offset));
                let headers = streamrl_schemas::Headers::from_wire(&m.headers).map_err(bad)?;
                let batch = match headers.signal {
                    Some(_) => None,
                    None => Some(streamrl_schemas::codec::decode(schema, &m.headers, &m.payload).map_err(bad)?),
                };
                Ok((headers, batch))
            })
            .collect()
    }

    /// The newest version the `policy` topic holds, read from the topic itself. An end of
    /// run counts as the version it closed (`max_steps`): it is sent right after it.
    async fn newest_on_policy(&self) -> Result<Option<u64>, StageError> {
        let mut best: Option<u64> = None;
        for (headers, batch) in self.newest_on(&self.policy_topic, SchemaId::Policy).await? {
            let version = match (headers.signal, batch) {
                (Some(Signal::EndOfRun), _) => self.cfg.max_steps,
                (_, Some(batch)) => rows::<PolicyRow>(&batch)?.iter().map(|r| r.step).max(),
                _ => None,
            };
            best = best.max(version);
        }
        Ok(best)
    }

    /// Whether the lineage of the newest saved version is on `trained` already (killed
    /// after it was delivered, before the version was). The trainer is the topic's only
    /// writer and sends nothing after a version's lineage until the version is delivered,
    /// so that lineage is the newest message of its partition. (With a key on `trained`,
    /// the lineage is several messages and a kill between them is not told apart.)
    async fn lineage_on_bus(&self) -> Result<bool, StageError> {
        let Some(topic) = &self.trained_topic else {
            return Ok(false);
        };
        if self.last_lineage.is_empty() {
            return Ok(false);
        }
        let consumed = [Outcome::Trained, Outcome::Filtered, Outcome::Stale, Outcome::TimedOut].map(Outcome::name);
        for (_, batch) in self.newest_on(topic, SchemaId::Trained).await? {
            let Some(batch) = batch else { continue };
            let found = rows::<TrainedRow>(&batch)?
                .iter()
                .any(|r| r.version as u64 == self.version && consumed.contains(&r.outcome.as_str()));
            if found {
                tracing::info!(
                    version = self.version,
                    "trainer: the lineage of this version is on the bus already"
                );
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Records in `checkpoints/published` that the bus holds version `v`.
    fn record_published(&mut self, v: u64) -> Result<(), StageError> {
        let path = self.store.join("published");
        let tmp = self.store.join("published.tmp");
        std::fs::create_dir_all(&self.store)
            .and_then(|()| std::fs::write(&tmp, v.to_string()))
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| StageError::internal(format!("recording published version {v} in {}: {e}", path.display())))?;
        self.published = Some(v);
        Ok(())
    }

    /// The oldest admitted step whose sample ids are still remembered.
    fn watermark(&self) -> u64 {
        self.version.saturating_sub(self.cfg.dedup_window)
    }

    /// Lineage rows for `version`: every outcome a sample meets passes here, and is counted
    /// in `streamrl.train.samples`.
    fn lineage_rows<'a>(
        &self,
        version: u64,
        rows: impl IntoIterator<Item = (&'a SampleRow, Outcome)>,
    ) -> Vec<TrainedRow> {
        let now = now_ms();
        rows.into_iter()
            .inspect(|(_, o)| self.instruments.sample(o.name()))
            .map(|(s, o)| TrainedRow {
                run_id: self.ctx.run_id.clone(),
                version: version as u32,
                step: s.step,
                group_id: s.group_id.clone(),
                sample_id: s.sample_id.clone(),
                outcome: o.name().into(),
                sample_created_at: s.created_at,
                created_at: now,
            })
            .collect()
    }

    /// Emits lineage rows (when a `trained` topic is configured).
    fn emit_lineage(&self, out: &mut Emitter, rows: &[TrainedRow]) -> Result<(), StageError> {
        if let Some(topic) = &self.trained_topic
            && !rows.is_empty()
        {
            out.emit(
                topic.clone(),
                TrainedRow::to_batch(rows).map_err(|e| StageError::internal(e.to_string()))?,
            );
        }
        Ok(())
    }

    /// Whether the current step's batch is complete, or has waited long enough.
    fn ready(&self) -> bool {
        // Groups of earlier steps that came after their step was trained ride along; they
        // do not stand in for this step's own.
        let current = self.buffer.get(&self.version).map_or(0, |g| g.len());
        if current >= self.cfg.groups_per_step {
            return true;
        }
        let later = self.buffer.range(self.version + 1..).next().is_some();
        later
            && self
                .waiting_since
                .is_some_and(|t| t.elapsed() >= std::time::Duration::from_secs(self.cfg.step_timeout_secs))
    }

    fn train_step(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        // Before the weights change (in the same call only if a tick trained two steps).
        self.run_due_eval(out);
        let (groups, linked, timed_out) = self.take_step_groups(out);
        // The step is a trace of its own, linked to every group it consumes; the version
        // it publishes (and its metrics) carry its context.
        let span = telemetry::linked_span("train-step", &self.ctx.instance(), &linked);
        let _in_step = span.enter();
        out.set_trace_context(telemetry::traceparent_for(&span, None).unwrap_or_else(telemetry::new_traceparent));
        let all: Vec<SampleRow> = groups.into_iter().flat_map(|(_, v)| v).collect();
        let triage = Triage::of(&all, self.version, self.cfg.max_off_policy_steps, &self.instruments);
        let report = if triage.train.is_empty() {
            StepReport::default()
        } else {
            let r = compute(|| self.learner.step(&triage.train))
                .map_err(|e| StageError::internal(format!("train step: {e}")))?;
            self.instruments
                .train_step(r.tokens as u64, std::time::Duration::from_secs_f64(r.seconds.max(0.0)));
            r
        };
        span.record("samples", all.len() as i64);
        span.record("trained", triage.train.len() as i64);
        span.record("tokens", report.tokens as i64);
        span.record("loss", report.loss as f64);
        self.version += 1;
        span.record("policy_version", self.version as i64);
        if self.buffer.range(self.version + 1..).next().is_some() {
            self.waiting_since = Some(std::time::Instant::now());
        }
        for s in &all {
            self.consumed.entry(s.step).or_default().insert(s.sample_id.clone());
        }
        self.last_lineage = self.lineage_rows(self.version, triage.outcomes.iter().copied());
        self.last_lineage.extend(self.timed_out_rows(self.version, timed_out));
        let watermark = self.watermark();
        self.consumed = self.consumed.split_off(&watermark);
        self.checkpoint_and_publish(out)?;
        let metrics = self.step_metrics(&all, &triage, &report);
        let mut m = metrics.rows();
        if self.cfg.eval_every > 0 && self.version.is_multiple_of(self.cfg.eval_every) {
            if self.done() {
                // The last version: the run ends with it, nothing waits for it.
                m.extend(self.heldout());
            } else {
                self.eval_due = Some(self.version);
            }
        }
        let refs: Vec<(&str, f64)> = m.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        if let Some((t, b)) = self.ctx.metrics(self.version, &refs) {
            out.emit(t, b);
        }
        tracing::debug!(stage = %self.ctx.instance(), version = self.version, loss = report.loss, reward = metrics.reward_mean,
            trained = triage.train.len(), stale = triage.stale, seconds = report.seconds, "step");
        Ok(())
    }

    /// This step's groups (and any that arrived after their own step was trained), their
    /// inputs released, and the trace contexts they carried; and the ids of the step's
    /// groups that did not come (counted missing).
    #[allow(clippy::type_complexity)]
    fn take_step_groups(&mut self, out: &mut Emitter) -> (Vec<(String, Vec<SampleRow>)>, Vec<String>, Vec<String>) {
        let step = self.version;
        let here: Vec<String> = self
            .buffer
            .get(&step)
            .map(|g| g.keys().cloned().collect())
            .unwrap_or_default();
        let timed_out = self.missing_groups(step, &here);
        self.missing += timed_out.len() as u64;
        let mut groups: Vec<(String, Vec<SampleRow>)> = Vec::new();
        let steps: Vec<u64> = self.buffer.range(..=step).map(|(s, _)| *s).collect();
        for s in steps {
            groups.extend(self.buffer.remove(&s).unwrap_or_default());
        }
        self.waiting_since = None;
        let linked: Vec<String> = groups.iter().filter_map(|(g, _)| self.traces.remove(g)).collect();
        for (g, _) in &groups {
            out.release(g.clone());
        }
        (groups, linked, timed_out)
    }

    /// The groups admitted for `step` that are not among `here` (its groups that came).
    /// The source names group `g` of the run `<run_id>-g<g>` for step `g / groups_per_step`
    /// ([`streamrl_schemas::ids`]); when the step's groups are named otherwise (rows of
    /// another run replayed into this one), the missing ones are counted with empty ids.
    fn missing_groups(&self, step: u64, here: &[String]) -> Vec<String> {
        let n = self.cfg.groups_per_step;
        if here.len() >= n {
            return Vec::new();
        }
        let admitted = streamrl_schemas::ids::step_groups(&self.ctx.run_id, step, n as u64);
        if here.iter().all(|g| admitted.contains(g)) {
            admitted.into_iter().filter(|g| !here.contains(g)).collect()
        } else {
            vec![String::new(); n - here.len()]
        }
    }

    /// Lineage rows (`timed_out`) for the groups of `version − 1`'s step it was trained
    /// without.
    fn timed_out_rows(&self, version: u64, groups: Vec<String>) -> Vec<TrainedRow> {
        let now = now_ms();
        groups
            .into_iter()
            .map(|group_id| TrainedRow {
                run_id: self.ctx.run_id.clone(),
                version: version as u32,
                step: version - 1,
                group_id,
                sample_id: String::new(),
                outcome: Outcome::TimedOut.name().into(),
                sample_created_at: 0,
                created_at: now,
            })
            .collect()
    }

    /// Saves the new version's checkpoint, then emits its lineage and (after a barrier)
    /// the version itself; old checkpoints past retention go.
    fn checkpoint_and_publish(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        let dir = self.store.join(format!("step-{:06}", self.version));
        let sha =
            compute(|| self.save(&dir)).map_err(|e| StageError::internal(format!("saving {}: {e}", dir.display())))?;
        self.current = PolicyRow {
            run_id: self.ctx.run_id.clone(),
            version: self.version as u32,
            step: self.version,
            uri: policy_uri(self.ckpt_base.as_deref(), self.version, &dir),
            sha256: sha,
            created_at: now_ms(),
        };
        self.emit_lineage(out, &self.last_lineage)?;
        // The lineage is on the bus before the version is: a version seen on `policy`
        // after a kill has its lineage on `trained`.
        out.barrier();
        self.publish(out)?;
        self.retain();
        Ok(())
    }

    /// The step's metrics from its samples, their triage and the learner's report.
    fn step_metrics(&self, all: &[SampleRow], triage: &Triage<'_>, report: &StepReport) -> StepMetrics {
        let n = all.len().max(1) as f64;
        let reward_mean = all.iter().map(|s| s.reward as f64).sum::<f64>() / n;
        let adv: Vec<f64> = all
            .iter()
            .filter(|s| s.loss_mask.iter().any(|m| *m))
            .map(|s| s.advantage as f64)
            .collect();
        let adv_mean = adv.iter().sum::<f64>() / adv.len().max(1) as f64;
        let adv_std = (adv.iter().map(|a| (a - adv_mean).powi(2)).sum::<f64>() / adv.len().max(1) as f64).sqrt();
        let len_mean = all.iter().map(|s| s.completion_token_ids.len() as f64).sum::<f64>() / n;
        StepMetrics {
            loss: report.loss as f64,
            masked_low: report.masked_low as f64,
            masked_high: report.masked_high as f64,
            mismatch_kl: report.mismatch_kl as f64,
            max_logprob_diff: report.max_logprob_diff as f64,
            clip_fraction: report.clip_fraction as f64,
            entropy: report.entropy as f64,
            grad_norm: report.grad_norm as f64,
            optimizer_step_skipped: report.skipped_nonfinite,
            lr: report.lr,
            reward_mean,
            advantage_mean: adv_mean,
            advantage_std: adv_std,
            completion_len_mean: len_mean,
            samples: all.len() as u64,
            samples_trained: triage.train.len() as u64,
            samples_dropped_stale: triage.stale,
            samples_filtered: triage.filtered,
            samples_duplicate: self.duplicates,
            groups_missing: self.missing,
            trainable_tokens: report.trainable_tokens as u64,
            micro_batches: report.micro_batches as u64,
            step_seconds: report.seconds,
            tokens_per_s: if report.seconds > 0.0 {
                report.tokens as f64 / report.seconds
            } else {
                0.0
            },
            moe_imbalance: report.moe_imbalance.map(f64::from),
            moe: report.moe.clone(),
            staleness: triage.staleness.clone(),
        }
    }

    /// The held-out eval that is due, if any: its metrics go out under its version.
    /// It runs after the call that emitted the version has delivered it: the eval takes
    /// as long as several training steps at SmolLM2's size (50 s), and run inside that
    /// call it held the new version back from the rollout stage as long.
    fn run_due_eval(&mut self, out: &mut Emitter) {
        let Some(v) = self.eval_due.take() else { return };
        debug_assert_eq!(v, self.version, "an eval is run before the next step");
        let m = self.heldout();
        let refs: Vec<(&str, f64)> = m.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        if let Some((t, b)) = self.ctx.metrics(v, &refs) {
            out.emit(t, b);
        }
    }

    /// Held-out greedy accuracy of the current weights, per environment and on average.
    fn heldout(&self) -> Vec<(String, f64)> {
        let (Some(envs), Some(tok)) = (self.envs.as_ref(), self.learner.tokenizer.as_ref()) else {
            return vec![];
        };
        let template = self.template.clone();
        let cores = self.learner.cores();
        let mut out = Vec::new();
        for (env, _) in envs.iter().filter(|(e, _)| !e.needs_sandbox()) {
            // Spread like a training step: the same bits, on the cores the rollout leaves.
            let r = compute(|| {
                streamrl_model::cores::spread(cores, || {
                    crate::eval::evaluate(
                        env,
                        self.learner.model.clone(),
                        tok,
                        &template,
                        self.cfg.eval_problems,
                        0,
                        self.cfg.eval_max_tokens,
                    )
                })
            });
            match r {
                Ok(r) => out.push((format!("{}{}", name::HELDOUT_PREFIX, env.name()), r.greedy_accuracy)),
                Err(e) => {
                    tracing::warn!(stage = %self.ctx.instance(), env = env.name(), error = %e, "held-out evaluation failed")
                }
            }
        }
        if !out.is_empty() {
            let mean = out.iter().map(|(_, v)| v).sum::<f64>() / out.len() as f64;
            out.push((name::HELDOUT_ACCURACY.into(), mean));
        }
        out
    }

    fn save(&self, dir: &Path) -> Result<String, String> {
        let sha = self.learner.save(dir).map_err(|e| e.to_string())?;
        let state = TrainerState {
            version: self.version,
            consumed_by_step: self
                .consumed
                .iter()
                .map(|(k, v)| {
                    let mut ids: Vec<String> = v.iter().cloned().collect();
                    ids.sort();
                    (*k, ids)
                })
                .collect(),
            lineage: self.last_lineage.clone(),
        };
        let tmp = dir.join("trainer_state.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&state).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, dir.join("trainer_state.json")).map_err(|e| e.to_string())?;
        Ok(sha)
    }

    fn retain(&self) {
        let Ok(entries) = std::fs::read_dir(&self.store) else {
            return;
        };
        let mut versions: Vec<(u64, PathBuf, std::time::SystemTime)> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let v = e
                    .file_name()
                    .to_string_lossy()
                    .strip_prefix("step-")?
                    .parse::<u64>()
                    .ok()?;
                let written = e.metadata().and_then(|m| m.modified()).ok()?;
                Some((v, e.path(), written))
            })
            .collect();
        versions.sort_by_key(|v| v.0);
        // The run's last version: nobody will load an older one any more.
        let grace = if self.done() { 0.0 } else { self.cfg.retain_secs };
        let written: Vec<(u64, std::time::SystemTime)> = versions.iter().map(|(v, _, t)| (*v, *t)).collect();
        let keep = retained(
            &written,
            self.cfg.keep_last,
            self.cfg.keep_every,
            grace,
            std::time::SystemTime::now(),
        );
        for (v, path, _) in versions {
            if !keep.contains(&v) {
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }
}

#[async_trait]
impl Stage for TrainerStage {
    async fn start(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        if let Some(l) = self.ckpt_listener.take() {
            let server = crate::weights::CheckpointServer::start(l, self.store.clone(), self.cfg.checkpoint.clone())
                .map_err(|e| StageError::internal(format!("serve_checkpoints: {e}")))?;
            tracing::info!(addr = %server.addr(), base = ?self.ckpt_base, "trainer: serving checkpoints over HTTP");
            self.ckpt_server = Some(server);
        }
        // Announce the version serving now (a resumed trainer's newest checkpoint), unless a
        // durable bus already has it.
        let mut unpublished = self.published.is_none_or(|p| p < self.version);
        if unpublished && self.ctx.durable_bus {
            // Killed after saving a version: whether the bus got it before the kill (and
            // `checkpoints/published` missed it) is for the topic to say.
            if let Some(v) = self.newest_on_policy().await? {
                tracing::info!(on_policy = v, saved = self.version, "trainer: newest version on policy");
                if v >= self.version {
                    self.record_published(self.version)?;
                    unpublished = false;
                }
            }
        }
        if unpublished && !(self.ctx.durable_bus && self.lineage_on_bus().await?) {
            // Killed between saving this version and its delivery: its lineage may not
            // have gone out either (it goes out before the version, never after).
            self.emit_lineage(out, &self.last_lineage)?;
            out.barrier();
        }
        if unpublished || !self.ctx.durable_bus {
            self.publish(out)?;
        } else if self.done() {
            out.signal(self.policy_topic.clone(), Signal::EndOfRun);
        }
        if self.cfg.eval_every > 0 && self.version == 0 {
            // After version 0 has gone out (the source admits nothing before it), unless
            // the run ends with it.
            self.eval_due = Some(0);
            if self.done() {
                self.run_due_eval(out);
            }
        }
        Ok(())
    }

    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        let samples = rows::<SampleRow>(&input.batch)?;
        // A sample that could never be trained fails its message (to the dead-letter
        // topic, with the reason) before any of it is buffered.
        let ctx = self.learner.context();
        for s in &samples {
            let (p, c, m) = (
                s.prompt_token_ids.len(),
                s.completion_token_ids.len(),
                s.loss_mask.len(),
            );
            let moe = crate::train::moe_shape(self.learner.model.config());
            if let Some(problem) = crate::train::sample_problem(p, c, m, ctx)
                .or_else(|| crate::train::routes_problem(&s.completion_routes, c, moe))
            {
                return Err(StageError::user(format!("sample {}: {problem}", s.sample_id)));
            }
        }
        if self.done() {
            // Past max_steps: leave the input unacknowledged for a later run to train on.
            out.hold();
            return Ok(());
        }
        let mut kept = None;
        let mut dropped = Vec::new();
        for s in samples {
            if s.step < self.watermark() {
                dropped.push((s, Outcome::Superseded));
                continue;
            }
            let pending = self
                .buffer
                .get(&s.step)
                .and_then(|g| g.get(&s.group_id))
                .is_some_and(|g| g.iter().any(|x| x.sample_id == s.sample_id));
            if pending {
                // A copy of a sample waiting for its step (a redelivery after a rebalance):
                // held with its group, so its offset is not committed before the original
                // is in a checkpoint.
                kept.get_or_insert_with(|| s.group_id.clone());
            }
            if pending || self.consumed.get(&s.step).is_some_and(|ids| ids.contains(&s.sample_id)) {
                self.duplicates += 1;
                dropped.push((s, Outcome::Duplicate));
                continue;
            }
            kept.get_or_insert_with(|| s.group_id.clone());
            self.buffer
                .entry(s.step)
                .or_default()
                .entry(s.group_id.clone())
                .or_default()
                .push(s);
        }
        // One message is one group: held under its id until the step that trains it is saved.
        if let Some(g) = kept {
            if let Some(tp) = &input.headers.traceparent {
                self.traces.insert(g.clone(), tp.clone());
            }
            out.hold_as(g);
        }
        let rows = self.lineage_rows(self.version + 1, dropped.iter().map(|(s, o)| (s, *o)));
        self.emit_lineage(out, &rows)?;
        if self.waiting_since.is_none() && self.buffer.range(self.version + 1..).next().is_some() {
            self.waiting_since = Some(std::time::Instant::now());
        }
        while !self.done() && self.ready() {
            self.train_step(out)?;
        }
        Ok(())
    }

    fn delivered(&mut self) -> Result<(), StageError> {
        match self.publishing.take() {
            Some(v) => self.record_published(v),
            None => Ok(()),
        }
    }

    fn tick_interval(&self) -> Option<std::time::Duration> {
        Some(std::time::Duration::from_secs(1))
    }

    async fn tick(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        self.run_due_eval(out);
        while !self.done() && self.ready() {
            self.train_step(out)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_serving_settings_are_checked_together() {
        let with = |serve: Option<&str>, url: Option<&str>| {
            TrainerConfig {
                checkpoint: "ckpt".into(),
                serve_checkpoints: serve.map(str::to_string),
                checkpoint_url: url.map(str::to_string),
                ..Default::default()
            }
            .problems()
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
        };
        assert_eq!(with(None, None), "");
        assert_eq!(with(Some("127.0.0.1:0"), None), "");
        assert_eq!(with(Some("0.0.0.0:8400"), Some("http://trainer:8400")), "");
        assert!(with(Some("0.0.0.0:8400"), None).contains("set checkpoint_url"));
        assert!(with(Some("trainer"), None).contains("`trainer` is not a host:port"));
        assert!(with(None, Some("http://x:1")).contains("needs serve_checkpoints"));
        assert!(with(Some("127.0.0.1:0"), Some("ftp://x")).contains("must start with http://"));
        assert_eq!(
            policy_uri(Some("http://t:1/"), 7, Path::new("/x")),
            "http://t:1/checkpoints/7"
        );
    }

    #[test]
    fn superseded_checkpoints_stay_while_readers_may_still_fetch_them() {
        use std::time::{Duration, SystemTime};
        let now = SystemTime::now();
        // Versions 1..=10, version v written (10 - v) seconds ago.
        let versions: Vec<(u64, SystemTime)> = (1..=10).map(|v| (v, now - Duration::from_secs(10 - v))).collect();
        // No grace: the newest 2, plus the multiples of 4.
        assert_eq!(retained(&versions, 2, 4, 0.0, now), [4, 8, 9, 10]);
        // A 3.5 s grace: 6 and 7 were replaced less than 3.5 s ago (by 7 and 8).
        assert_eq!(retained(&versions, 2, 0, 3.5, now), [6, 7, 8, 9, 10]);
        // Bounded: never more than 4 × keep_last, however long the grace.
        assert_eq!(retained(&versions, 2, 0, 1e9, now), [3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(retained(&versions, 1, 0, 1e9, now), [7, 8, 9, 10]);
        // A clock that went backwards counts as recent.
        let future: Vec<(u64, SystemTime)> = vec![(1, now), (2, now + Duration::from_secs(5)), (3, now)];
        assert_eq!(retained(&future, 1, 0, 1.0, now), [1, 2, 3]);
    }
}

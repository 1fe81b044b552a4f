//! The source stage: samples problems from the configured environments and emits one
//! `prompts` message per group, under admission control.
//!
//! Groups are numbered; group `g` belongs to step `g / groups_per_step`. The stage emits
//! groups of step `s` only while `s ≤ latest policy version + max_async_level`: with the
//! default 2, generation runs at most two policy versions ahead of the trainer, and with 0
//! the loop is synchronous. Emitted-but-untrained groups count (admission is by step, not
//! by finished groups), and the trainer consumes exactly `groups_per_step` groups per
//! version, so the accounting stays exact. Admission starts with the first policy version
//! seen (the newest on the topic, or the one the trainer announces when it starts). The
//! state (position, epochs, pools, open groups) is the stage's snapshot, which the runtime
//! writes after every admission is delivered, so a SIGKILLed source resumes where it was
//! and re-sends at most the groups whose delivery it had not yet recorded. On the
//! in-process memory bus, whose topics die with the process, groups of steps the trainer
//! has not trained yet are admitted again under the same ids (and the same problems).
//!
//! **Datasets** (environments with a finite train split) are read in epochs: each epoch
//! visits every train problem once, in an order shuffled per epoch (`shuffle`), and with
//! `epochs` set the source stops after the step in which the last epoch ends (the trainer
//! gets whole steps). Generated environments (arith, countdown) draw from their seed.
//!
//! **Difficulty pools** (`difficulty`, off by default; prime-rl's buffer): the source
//! reads `scored` as feedback, and when all samples of one of its groups are scored it
//! files the problem by the group's mean reward: at least `easy_threshold` → easy pool,
//! at most `hard_threshold` → hard pool, otherwise nothing (it stays in rotation). Pooled
//! problems leave fresh draws; `easy_fraction` / `hard_fraction` of groups come from the
//! easy / hard pool instead (while it holds problems), and a problem drawn from a pool
//! is filed again by its new rewards. The pools, the epoch positions and the open groups
//! are part of the snapshot, so they survive a restart.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use streamrl_envs::{Environment, Mix, Problem, Split};
use streamrl_model::Tokenizer;
use streamrl_model::chat::ChatTemplate;
use streamrl_runtime::build::{BuildContext, BuildError, BuildStage, none_or_invalid};
use streamrl_runtime::{Emitter, Input, Stage, StageError};
use streamrl_schemas::{PolicyRow, PromptRow, SchemaId, ScoredRow, TopicRow, Validate};

use crate::{Invalid, now_ms, rows};

/// Configuration of the source stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourceConfig {
    /// Checkpoint directory whose `tokenizer.json` tokenizes prompts.
    pub checkpoint: PathBuf,
    /// Samples per group (problem × group_size).
    pub group_size: u32,
    /// Groups per trainer step (the trainer's batch is groups_per_step × group_size samples).
    pub groups_per_step: u32,
    /// How many policy versions generation may run ahead of the trainer (0: synchronous).
    pub max_async_level: u64,
    /// Stop after emitting the groups of this many steps (`null`: never).
    pub max_steps: Option<u64>,
    /// Seed of the problem stream.
    pub seed: u64,
    /// Sampling temperature stamped on prompts.
    pub temperature: f32,
    /// Completion tokens at most.
    pub max_tokens: u32,
    /// Draw each group's `max_tokens` from a heavy-tailed (Pareto) distribution with this
    /// shape α, from `min_tokens` up to `max_tokens` (`null`: every group gets
    /// `max_tokens`). With `ignore_eos` at the rollout stage this makes generation lengths
    /// vary the way reasoning traces do (benchmarks, stress tests).
    pub length_tail_alpha: Option<f64>,
    /// Smallest `max_tokens` the tail draws.
    pub min_tokens: u32,
    /// Visit a dataset's train problems in a new random order each epoch (`false`: in
    /// file order).
    pub shuffle: bool,
    /// Passes over each dataset (`null`: no limit). Generated environments never run out.
    pub epochs: Option<u64>,
    /// Difficulty pools fed by the `scored` input (`null`: off).
    pub difficulty: Option<DifficultyConfig>,
}

/// Difficulty pools: problems filed as easy or hard by their last group's mean reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DifficultyConfig {
    /// A group whose mean reward is at least this files its problem as easy.
    pub easy_threshold: f32,
    /// A group whose mean reward is at most this files its problem as hard.
    pub hard_threshold: f32,
    /// Fraction of groups drawn from the easy pool while it holds problems.
    pub easy_fraction: f64,
    /// Fraction of groups drawn from the hard pool while it holds problems.
    pub hard_fraction: f64,
    /// Problems each pool keeps at most (the oldest leave first, back into rotation).
    pub capacity: usize,
}

impl Default for DifficultyConfig {
    fn default() -> Self {
        DifficultyConfig {
            easy_threshold: 1.0,
            hard_threshold: 0.0,
            easy_fraction: 0.0,
            hard_fraction: 0.0,
            capacity: 10_000,
        }
    }
}

impl DifficultyConfig {
    fn problems(&self) -> Vec<Invalid> {
        let mut p = Vec::new();
        if !(self.easy_threshold.is_finite() && self.hard_threshold.is_finite())
            || self.hard_threshold >= self.easy_threshold
        {
            p.push(Invalid::new(
                "hard_threshold",
                format!(
                    "{} must be below easy_threshold {}",
                    self.hard_threshold, self.easy_threshold
                ),
            ));
        }
        for (name, f) in [
            ("easy_fraction", self.easy_fraction),
            ("hard_fraction", self.hard_fraction),
        ] {
            if !(0.0..=1.0).contains(&f) {
                p.push(Invalid::new(name, format!("{f} must be in [0, 1]")));
            }
        }
        if self.easy_fraction + self.hard_fraction > 1.0 {
            p.push(Invalid::new(
                "easy_fraction",
                format!(
                    "{} + hard_fraction {} exceeds 1",
                    self.easy_fraction, self.hard_fraction
                ),
            ));
        }
        if self.capacity == 0 {
            p.push(Invalid::new("capacity", "must be at least 1"));
        }
        p
    }
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            checkpoint: PathBuf::new(),
            group_size: 8,
            groups_per_step: 4,
            max_async_level: 2,
            max_steps: None,
            seed: 0,
            temperature: 1.0,
            max_tokens: 16,
            length_tail_alpha: None,
            min_tokens: 4,
            shuffle: true,
            epochs: None,
            difficulty: None,
        }
    }
}

impl Validate for SourceConfig {
    fn problems(&self) -> Vec<Invalid> {
        let mut p = Vec::new();
        if self.checkpoint.as_os_str().is_empty() {
            p.push(Invalid::new(
                "checkpoint",
                "required (the directory whose tokenizer.json tokenizes prompts)",
            ));
        }
        if self.group_size < 2 {
            p.push(Invalid::new(
                "group_size",
                format!(
                    "{} must be at least 2 (advantages are relative to the group)",
                    self.group_size
                ),
            ));
        }
        if self.groups_per_step == 0 {
            p.push(Invalid::new("groups_per_step", "must be at least 1"));
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            p.push(Invalid::new(
                "temperature",
                format!("{} must be positive", self.temperature),
            ));
        }
        if self.max_tokens == 0 {
            p.push(Invalid::new("max_tokens", "must be at least 1"));
        }
        if let Some(a) = self.length_tail_alpha
            && !(a > 0.0 && a.is_finite())
        {
            p.push(Invalid::new("length_tail_alpha", format!("{a} must be positive")));
        }
        if self.min_tokens == 0 || self.min_tokens > self.max_tokens {
            p.push(Invalid::new(
                "min_tokens",
                format!("{} must be in 1..=max_tokens ({})", self.min_tokens, self.max_tokens),
            ));
        }
        if self.epochs == Some(0) {
            p.push(Invalid::new("epochs", "must be at least 1 (or null for no limit)"));
        }
        if let Some(d) = &self.difficulty {
            p.extend(streamrl_schemas::problem::under("difficulty", d.problems()));
        }
        p
    }
}

/// Groups whose feedback is this many versions behind the trainer are forgotten.
const FEEDBACK_HORIZON: u64 = 8;

/// A problem as the source drew it: enough to draw it again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Draw {
    env: String,
    seed: u64,
    problem_id: String,
}

/// An emitted group: its draw (kept so that a re-admission asks the same problem) and
/// the rewards scored so far, by sample index, until it is filed.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Open {
    draw: Draw,
    rewards: BTreeMap<u32, f32>,
    filed: bool,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct State {
    next_group: u64,
    latest_version: u64,
    /// Problems of each dataset drawn so far (all epochs).
    drawn: BTreeMap<String, u64>,
    /// The last step the source emits (set when a dataset's last epoch ends).
    last_step: Option<u64>,
    /// Emitted groups by index, until classified or forgotten.
    open: BTreeMap<u64, Open>,
    easy: VecDeque<Draw>,
    hard: VecDeque<Draw>,
}

/// Where a group's problem came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// A fresh draw from the environments.
    Fresh,
    /// The easy pool.
    Easy,
    /// The hard pool.
    Hard,
    /// The draw recorded when the group was first emitted (a re-admission).
    Again,
}

/// A dataset's visiting order for one epoch, cached.
#[derive(Debug)]
struct Order {
    epoch: u64,
    perm: Vec<u64>,
}

/// The source stage.
pub struct SourceStage {
    cfg: SourceConfig,
    ctx: BuildContext,
    envs: Arc<Mix>,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    prompts: String,
    state: State,
    /// Whether a policy version has been seen since start (admission waits for it).
    synced: bool,
    orders: BTreeMap<String, Order>,
}

impl std::fmt::Debug for SourceStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceStage").field("cfg", &self.cfg).finish()
    }
}

/// Builds the stage: loads the tokenizer, checks outputs and environments.
impl BuildStage for SourceStage {
    type Config = SourceConfig;

    fn build(cfg: SourceConfig, ctx: &BuildContext) -> Result<Self, BuildError> {
        let mut errs = cfg.problems();
        let envs = crate::require_environments(ctx).map_err(|e| errs.extend(e));
        let prompts = ctx.require_output(SchemaId::Prompts).map_err(|e| errs.push(e));
        if cfg.difficulty.is_some() && !ctx.inputs.iter().any(|(_, s)| *s == SchemaId::Scored) {
            errs.push(Invalid::new(
                "difficulty",
                format!(
                    "difficulty pools need feedback: add the topic of schema `scored` to stage `{}`'s inputs",
                    ctx.stage
                ),
            ));
        }
        let mut cfg = cfg;
        if errs.is_empty() {
            match crate::weights::initial(&cfg.checkpoint, &ctx.weights_cache(), crate::weights::INITIAL_WAIT) {
                Ok(dir) => cfg.checkpoint = dir,
                Err(e) => errs.push(Invalid::new("checkpoint", e.to_string())),
            }
        }
        let tok_path = cfg.checkpoint.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path);
        if let Err(e) = &tokenizer
            && errs.is_empty()
        {
            errs.push(Invalid::new("checkpoint", e.to_string()));
        }
        let template = ChatTemplate::for_checkpoint(&cfg.checkpoint);
        if let Err(e) = &template {
            errs.push(Invalid::new("checkpoint", e.to_string()));
        }
        none_or_invalid(errs)?;
        Ok(SourceStage {
            cfg,
            ctx: ctx.clone(),
            envs: envs.expect("checked"),
            tokenizer: tokenizer.expect("checked"),
            template: template.expect("checked"),
            prompts: prompts.expect("checked"),
            state: State::default(),
            synced: false,
            orders: BTreeMap::new(),
        })
    }
}

impl SourceStage {
    /// The problem the `i`-th draw (over all epochs) from a dataset of `n` train problems
    /// visits.
    fn dataset_seed(&mut self, env: &str, n: u64, i: u64) -> u64 {
        let epoch = i / n;
        if !self.cfg.shuffle {
            return i % n;
        }
        let order = self.orders.entry(env.to_string()).or_insert(Order {
            epoch: u64::MAX,
            perm: Vec::new(),
        });
        if order.epoch != epoch {
            let mut perm: Vec<u64> = (0..n).collect();
            let salt = env
                .bytes()
                .fold(epoch, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
            perm.shuffle(&mut StdRng::seed_from_u64(
                self.cfg.seed ^ salt.wrapping_mul(0x2545_f491_4f6c_dd1d),
            ));
            *order = Order { epoch, perm };
        }
        order.perm[(i % n) as usize]
    }

    /// A fresh problem from `env`: the next of a dataset's epoch order, or a generated one.
    fn fresh(&mut self, env: &dyn Environment, rng: &mut StdRng, g: u64) -> (Draw, Problem) {
        let name = env.name().to_string();
        let seed = match env.split_len(Split::Train) {
            Some(n) if n > 0 => {
                let n = n as u64;
                let i = *self.state.drawn.get(&name).unwrap_or(&0);
                self.state.drawn.insert(name.clone(), i + 1);
                if let Some(e) = self.cfg.epochs
                    && (i + 1) == e * n
                    && self.state.last_step.is_none()
                {
                    // The last epoch ends with this draw: finish its step, then stop.
                    self.state.last_step = Some(self.step_of(g));
                }
                self.dataset_seed(&name, n, i)
            }
            _ => rng.random(),
        };
        let problem = env.sample(Split::Train, seed);
        let draw = Draw {
            env: name,
            seed,
            problem_id: problem.id.clone(),
        };
        (draw, problem)
    }

    fn pooled(&self, id: &str) -> bool {
        self.state
            .easy
            .iter()
            .chain(&self.state.hard)
            .any(|d| d.problem_id == id)
    }

    /// What group `g` asks: the draw recorded when it was first emitted (a re-admission
    /// after a restart), a problem from a difficulty pool, or a fresh one.
    fn draw(&mut self, g: u64, rng: &mut StdRng) -> Result<(Draw, Problem, Origin), StageError> {
        let again = |d: Draw, envs: &Mix, origin: Origin| {
            let env = envs
                .get(&d.env)
                .ok_or_else(|| StageError::internal(format!("environment `{}` is no longer configured", d.env)))?;
            let problem = env.sample(Split::Train, d.seed);
            Ok((d, problem, origin))
        };
        if let Some(o) = self.state.open.get(&g) {
            return again(o.draw.clone(), &self.envs, Origin::Again);
        }
        let u_env: f64 = rng.random();
        if let Some(d) = self.cfg.difficulty.clone() {
            let u: f64 = rng.random();
            let from = if u < d.easy_fraction {
                Some(&mut self.state.easy)
            } else if u < d.easy_fraction + d.hard_fraction {
                Some(&mut self.state.hard)
            } else {
                None
            };
            if let Some(pool) = from
                && !pool.is_empty()
            {
                let i = rng.random_range(0..pool.len());
                let origin = if u < d.easy_fraction {
                    Origin::Easy
                } else {
                    Origin::Hard
                };
                let draw = pool.remove(i).expect("in range");
                return again(draw, &self.envs, origin);
            }
        }
        let envs = self.envs.clone();
        let env = envs.pick(u_env);
        // Pooled problems leave the rotation (a few redraws; generated spaces are vast).
        let mut fresh = self.fresh(env, rng, g);
        for _ in 0..16 {
            if self.state.easy.is_empty() && self.state.hard.is_empty() || !self.pooled(&fresh.0.problem_id) {
                break;
            }
            fresh = self.fresh(env, rng, g);
        }
        Ok((fresh.0, fresh.1, Origin::Fresh))
    }

    /// The id of group `g` (unique in the run).
    fn group_id(&self, g: u64) -> String {
        streamrl_schemas::ids::group_id(&self.ctx.run_id, g)
    }

    /// The index of one of this run's group ids (`None` for another run's).
    fn group_index(&self, id: &str) -> Option<u64> {
        streamrl_schemas::ids::group_index(&self.ctx.run_id, id)
    }

    /// Files a group's problem by its mean reward once all its samples are scored.
    fn feedback(&mut self, rows: &[ScoredRow]) {
        let Some(d) = self.cfg.difficulty.clone() else {
            return;
        };
        for r in rows {
            let Some(g) = self.group_index(&r.group_id) else {
                continue; // another run's rows (a replay): not ours to file
            };
            let Some(open) = self.state.open.get_mut(&g).filter(|o| !o.filed) else {
                continue;
            };
            open.rewards.insert(r.sample_index, r.reward);
            if open.rewards.len() < r.group_size as usize {
                continue;
            }
            open.filed = true;
            let mean = open.rewards.values().sum::<f32>() / open.rewards.len() as f32;
            open.rewards.clear();
            let draw = open.draw.clone();
            let pool = if mean >= d.easy_threshold {
                &mut self.state.easy
            } else if mean <= d.hard_threshold {
                &mut self.state.hard
            } else {
                continue;
            };
            pool.push_back(draw);
            if pool.len() > d.capacity {
                pool.pop_front();
            }
        }
    }

    fn step_of(&self, group: u64) -> u64 {
        group / self.cfg.groups_per_step as u64
    }

    /// The group for index `g` (deterministic in the seed, g and the source's state).
    fn group(&mut self, g: u64) -> Result<(PromptRow, Origin), StageError> {
        let mut rng = StdRng::seed_from_u64(self.cfg.seed ^ g.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let (draw, problem, from) = self.draw(g, &mut rng)?;
        let envs = self.envs.clone();
        let env = envs.get(&draw.env).expect("drawn from a configured environment");
        self.state.open.entry(g).or_insert(Open {
            draw,
            rewards: BTreeMap::new(),
            filed: false,
        });
        let prompt = crate::render_prompt(&self.template, &env.prompt(&problem))
            .map_err(|e| StageError::internal(format!("rendering the prompt of {}: {e}", problem.id)))?;
        let max_tokens = match self.cfg.length_tail_alpha {
            None => self.cfg.max_tokens,
            Some(alpha) => {
                let u: f64 = rng.random::<f64>().max(1e-12);
                let draw = self.cfg.min_tokens as f64 * u.powf(-1.0 / alpha);
                (draw.round() as u32).clamp(self.cfg.min_tokens, self.cfg.max_tokens)
            }
        };
        let ids = self
            .tokenizer
            .encode(&prompt)
            .map_err(|e| StageError::internal(format!("tokenizing the prompt of {}: {e}", problem.id)))?;
        let row = PromptRow {
            run_id: self.ctx.run_id.clone(),
            problem_id: problem.id.clone(),
            group_id: self.group_id(g),
            env: env.name().to_string(),
            step: self.step_of(g),
            group_size: self.cfg.group_size,
            prompt,
            prompt_token_ids: ids,
            answer: problem.answer.clone(),
            info: (!problem.info.is_null()).then(|| problem.info.to_string()),
            temperature: self.cfg.temperature,
            max_tokens,
            created_at: now_ms(),
        };
        Ok((row, from))
    }

    fn admit(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        let mut rows = Vec::new();
        let (mut easy, mut hard) = (0, 0);
        loop {
            let s = self.step_of(self.state.next_group);
            if s > self.state.latest_version + self.cfg.max_async_level
                || self.cfg.max_steps.is_some_and(|m| s >= m)
                || self.state.last_step.is_some_and(|m| s > m)
            {
                break;
            }
            let (row, from) = self.group(self.state.next_group)?;
            easy += (from == Origin::Easy) as u32;
            hard += (from == Origin::Hard) as u32;
            rows.push(row);
            self.state.next_group += 1;
        }
        // Groups the trainer moved far past will get no feedback that matters any more.
        let horizon = self.state.latest_version.saturating_sub(FEEDBACK_HORIZON);
        let keep_from = horizon * self.cfg.groups_per_step as u64;
        self.state.open = self.state.open.split_off(&keep_from);
        if !rows.is_empty() {
            let step = rows[0].step;
            let n = rows.len();
            out.emit(
                self.prompts.clone(),
                PromptRow::to_batch(&rows).map_err(|e| StageError::internal(e.to_string()))?,
            );
            if let Some((t, b)) = self.ctx.metrics(
                step,
                &[
                    ("groups_emitted", n as f64),
                    ("admitted_through_step", self.step_of(self.state.next_group - 1) as f64),
                    ("groups_from_easy_pool", easy as f64),
                    ("groups_from_hard_pool", hard as f64),
                    ("easy_pool_size", self.state.easy.len() as f64),
                    ("hard_pool_size", self.state.hard.len() as f64),
                ],
            ) {
                out.emit(t, b);
            }
        }
        Ok(())
    }
}

#[async_trait]
impl Stage for SourceStage {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        if input.schema == SchemaId::Scored {
            self.feedback(&rows::<ScoredRow>(&input.batch)?);
            return Ok(());
        }
        if input.schema == SchemaId::Policy {
            let Some(v) = rows::<PolicyRow>(&input.batch)?.iter().map(|p| p.version as u64).max() else {
                return Ok(());
            };
            if !self.synced && !self.ctx.durable_bus {
                // The first version seen since start is where the trainer stands. On an
                // in-process bus everything in flight died with the process, so groups
                // admitted for steps the trainer has not trained are admitted again, under
                // the same ids (the trainer skips any sample it already holds). A durable
                // bus (Kafka) still holds them: the source resumes where its state says.
                self.synced = true;
                self.state.latest_version = v;
                self.state.next_group = self.state.next_group.min(v * self.cfg.groups_per_step as u64);
            } else {
                self.synced = true;
                self.state.latest_version = self.state.latest_version.max(v);
            }
            self.admit(out)?;
        }
        Ok(())
    }

    fn tick_interval(&self) -> Option<Duration> {
        Some(Duration::from_millis(200))
    }

    async fn tick(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        if self.synced {
            self.admit(out)?;
        }
        Ok(())
    }

    fn snapshot(&self) -> Option<Vec<u8>> {
        serde_json::to_vec(&self.state).ok()
    }

    fn restore(&mut self, state: &[u8]) -> Result<(), StageError> {
        self.state = serde_json::from_slice(state)
            .map_err(|e| StageError::internal(format!("source state is not valid: {e}")))?;
        Ok(())
    }
}

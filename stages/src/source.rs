//! The source stage: samples problems from the configured environments and emits one
//! `prompts` message per group, under admission control.
//!
//! Groups are numbered; group `g` belongs to step `g / groups_per_step`. The stage emits
//! groups of step `s` only while `s ≤ latest policy version + max_async_level`: with the
//! default 2, generation runs at most two policy versions ahead of the trainer, and with 0
//! the loop is synchronous. Emitted-but-untrained groups count (admission is by step, not
//! by finished groups), and the trainer consumes exactly `groups_per_step` groups per
//! version, so the accounting stays exact. Admission starts with the first policy version
//! seen (the trainer announces its version when it starts). The position (`next_group`)
//! survives a restart (stage snapshot); after one, groups of steps the trainer has not
//! trained yet are admitted again under the same ids, since an in-process bus loses what
//! was in flight.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use streamrl_envs::{Mix, Split};
use streamrl_model::Tokenizer;
use streamrl_model::chat::ChatTemplate;
use streamrl_runtime::{Emitter, Input, Stage, StageError};
use streamrl_schemas::{PolicyRow, PromptRow, SchemaId, TopicRow};

use crate::{Ctx, now_ms, rows};

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
        }
    }
}

impl SourceConfig {
    /// Every invalid value.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.checkpoint.as_os_str().is_empty() {
            p.push("checkpoint: required (the directory whose tokenizer.json tokenizes prompts)".into());
        }
        if self.group_size < 2 {
            p.push(format!(
                "group_size {} must be at least 2 (advantages are relative to the group)",
                self.group_size
            ));
        }
        if self.groups_per_step == 0 {
            p.push("groups_per_step must be at least 1".into());
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            p.push(format!("temperature {} must be positive", self.temperature));
        }
        if self.max_tokens == 0 {
            p.push("max_tokens must be at least 1".into());
        }
        if let Some(a) = self.length_tail_alpha
            && !(a > 0.0 && a.is_finite())
        {
            p.push(format!("length_tail_alpha {a} must be positive"));
        }
        if self.min_tokens == 0 || self.min_tokens > self.max_tokens {
            p.push(format!(
                "min_tokens {} must be in 1..=max_tokens ({})",
                self.min_tokens, self.max_tokens
            ));
        }
        p
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct State {
    next_group: u64,
    latest_version: u64,
}

/// The source stage.
pub struct SourceStage {
    cfg: SourceConfig,
    ctx: Ctx,
    envs: Arc<Mix>,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    prompts: String,
    state: State,
    /// Whether a policy version has been seen since start (admission waits for it).
    synced: bool,
}

impl std::fmt::Debug for SourceStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceStage").field("cfg", &self.cfg).finish()
    }
}

impl SourceStage {
    /// Builds the stage: loads the tokenizer, checks outputs and environments.
    pub fn build(cfg: SourceConfig, ctx: Ctx) -> Result<Self, Vec<String>> {
        let mut errs = cfg.problems();
        let envs = ctx.require_envs();
        let prompts = ctx.require_output(SchemaId::Prompts);
        let tok_path = cfg.checkpoint.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path);
        if let Err(e) = &tokenizer
            && errs.is_empty()
        {
            errs.push(format!("checkpoint: {e}"));
        }
        let template = ChatTemplate::for_checkpoint(&cfg.checkpoint);
        if let Err(e) = &template {
            errs.push(format!("checkpoint: {e}"));
        }
        if let Err(e) = &envs {
            errs.extend(e.clone());
        }
        if let Err(e) = &prompts {
            errs.extend(e.clone());
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        Ok(SourceStage {
            cfg,
            ctx,
            envs: envs.expect("checked"),
            tokenizer: tokenizer.expect("checked"),
            template: template.expect("checked"),
            prompts: prompts.expect("checked"),
            state: State {
                next_group: 0,
                latest_version: 0,
            },
            synced: false,
        })
    }

    fn step_of(&self, group: u64) -> u64 {
        group / self.cfg.groups_per_step as u64
    }

    /// The group for index `g` (deterministic in seed and g).
    fn group(&self, g: u64) -> Result<PromptRow, StageError> {
        let mut rng = StdRng::seed_from_u64(self.cfg.seed ^ g.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let env = self.envs.pick(rng.random::<f64>());
        let problem = env.sample(Split::Train, rng.random());
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
        Ok(PromptRow {
            run_id: self.ctx.run_id.clone(),
            problem_id: problem.id.clone(),
            group_id: format!("{}-g{g:07}", self.ctx.run_id),
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
        })
    }

    fn admit(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        let mut rows = Vec::new();
        loop {
            let s = self.step_of(self.state.next_group);
            if s > self.state.latest_version + self.cfg.max_async_level || self.cfg.max_steps.is_some_and(|m| s >= m) {
                break;
            }
            rows.push(self.group(self.state.next_group)?);
            self.state.next_group += 1;
        }
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
        if input.schema == SchemaId::Policy {
            let Some(v) = rows::<PolicyRow>(&input.batch)?.iter().map(|p| p.version as u64).max() else {
                return Ok(());
            };
            if !self.synced {
                // The first version seen since start is where the trainer stands: groups
                // admitted for steps it has not trained may have been lost with an
                // in-process bus, so they are admitted again, under the same ids (the
                // trainer skips any sample it already holds).
                self.synced = true;
                self.state.latest_version = v;
                self.state.next_group = self.state.next_group.min(v * self.cfg.groups_per_step as u64);
            } else {
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

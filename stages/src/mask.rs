//! The mask stage: waits for each whole group, computes group-relative advantages, filters
//! groups without signal, builds loss masks, and emits trainable `samples`.
//!
//! Partitioned by `group_id`, so one replica sees all of a group. Samples are deduplicated
//! by `rollout_id` (a regenerated group after a crash brings the same ids). A group whose
//! samples do not all arrive within `group_timeout_secs` is completed with what it has
//! (counted). A group whose rewards are all equal carries no signal: with
//! `filter_zero_variance` (default) its samples go on with an all-false loss mask and
//! advantage 0 — the trainer counts the group toward its step (so admission accounting at
//! the source stays exact) but never trains on it; the rows stay queryable. Each input is
//! held under its group id and acknowledged when the group's samples are delivered.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use streamrl_runtime::build::{BuildContext, BuildError, BuildStage};
use streamrl_runtime::{Emitter, Input, Stage, StageError};
use streamrl_schemas::{SampleRow, SchemaId, ScoredRow, TopicRow, Validate};

use crate::{Invalid, now_ms, rows};

/// How advantages are computed from a group's rewards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Advantage {
    /// `r − mean(r)` (the reference default).
    Mean,
    /// `(r − mean(r)) / (std(r) + 1e-6)` (GRPO).
    MeanStd,
}

/// Configuration of the mask stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MaskConfig {
    /// Advantage estimator.
    pub advantage: Advantage,
    /// Do not train on groups whose rewards are all equal.
    pub filter_zero_variance: bool,
    /// Do not train on completions cut by `max_tokens` (`finish_reason = length`).
    pub mask_truncated: bool,
    /// Execution statuses whose samples are not trained on (the sandbox failed, not the model).
    pub drop_exec_statuses: Vec<String>,
    /// Complete a group with the samples it has after this many seconds.
    pub group_timeout_secs: u64,
}

impl Default for MaskConfig {
    fn default() -> Self {
        MaskConfig {
            advantage: Advantage::Mean,
            filter_zero_variance: true,
            mask_truncated: false,
            drop_exec_statuses: vec!["internal_error".into()],
            group_timeout_secs: 600,
        }
    }
}

impl Validate for MaskConfig {
    fn problems(&self) -> Vec<Invalid> {
        let mut p = Vec::new();
        if self.group_timeout_secs == 0 {
            p.push(Invalid::new("group_timeout_secs", "must be at least 1"));
        }
        p
    }
}

struct Pending {
    rows: BTreeMap<String, ScoredRow>,
    size: u32,
    since: Instant,
}

/// Counters the stage reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MaskCounts {
    /// Groups emitted.
    pub groups: u64,
    /// Groups without reward variance (not trained on).
    pub groups_filtered: u64,
    /// Groups completed by the timeout.
    pub groups_timed_out: u64,
    /// Samples dropped as duplicates.
    pub duplicates: u64,
    /// Samples masked for a failed execution.
    pub exec_failures: u64,
    /// Samples masked for truncation.
    pub truncated: u64,
}

/// The mask stage.
pub struct MaskStage {
    cfg: MaskConfig,
    ctx: BuildContext,
    samples: String,
    pending: HashMap<String, Pending>,
    done: HashSet<String>,
    done_order: VecDeque<String>,
    counts: MaskCounts,
}

impl std::fmt::Debug for MaskStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MaskStage").field("cfg", &self.cfg).finish()
    }
}

const DONE_MEMORY: usize = 100_000;

/// Advantages of one group's rewards.
pub fn advantages(rewards: &[f32], kind: Advantage) -> Vec<f32> {
    let n = rewards.len().max(1) as f32;
    let mean = rewards.iter().sum::<f32>() / n;
    let std = (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f32>() / n).sqrt();
    rewards
        .iter()
        .map(|r| match kind {
            Advantage::Mean => r - mean,
            Advantage::MeanStd => (r - mean) / (std + 1e-6),
        })
        .collect()
}

impl BuildStage for MaskStage {
    type Config = MaskConfig;

    fn build(cfg: MaskConfig, ctx: &BuildContext) -> Result<Self, BuildError> {
        let samples = ctx.checked_output(&cfg, SchemaId::Samples)?;
        Ok(MaskStage {
            cfg,
            ctx: ctx.clone(),
            samples,
            pending: HashMap::new(),
            done: HashSet::new(),
            done_order: VecDeque::new(),
            counts: MaskCounts::default(),
        })
    }
}

impl MaskStage {
    /// What the stage counted so far.
    pub fn counts(&self) -> MaskCounts {
        self.counts
    }

    /// The samples of a complete group.
    pub fn group_samples(&mut self, rows: Vec<ScoredRow>) -> Vec<SampleRow> {
        let rewards: Vec<f32> = rows.iter().map(|r| r.reward).collect();
        let flat = rewards.windows(2).all(|w| w[0] == w[1]);
        let filtered = self.cfg.filter_zero_variance && flat;
        if filtered {
            self.counts.groups_filtered += 1;
        }
        let adv = advantages(&rewards, self.cfg.advantage);
        let now = now_ms();
        rows.into_iter()
            .zip(adv)
            .map(|(r, a)| {
                let exec_failed = self.cfg.drop_exec_statuses.contains(&r.exec_status);
                let truncated = self.cfg.mask_truncated && r.finish_reason == "length";
                self.counts.exec_failures += exec_failed as u64;
                self.counts.truncated += truncated as u64;
                let off = filtered || exec_failed || truncated;
                let loss_mask = if off {
                    vec![false; r.completion_token_ids.len()]
                } else {
                    // Tokens the model did not generate (tool output) are already false.
                    r.loss_mask.clone()
                };
                SampleRow {
                    run_id: r.run_id,
                    problem_id: r.problem_id,
                    group_id: r.group_id,
                    rollout_id: r.rollout_id,
                    sample_id: r.sample_id,
                    env: r.env,
                    step: r.step,
                    turn: r.turn,
                    prompt_token_ids: r.prompt_token_ids,
                    completion_token_ids: r.completion_token_ids,
                    completion_logprobs: r.completion_logprobs,
                    completion_versions: r.completion_versions,
                    completion_routes: r.completion_routes,
                    loss_mask,
                    finish_reason: r.finish_reason,
                    reward: r.reward,
                    advantage: if filtered { 0.0 } else { a },
                    created_at: now,
                }
            })
            .collect()
    }

    fn complete(&mut self, gid: &str, out: &mut Emitter) -> Result<(), StageError> {
        let Some(p) = self.pending.remove(gid) else {
            return Ok(());
        };
        let samples = self.group_samples(p.rows.into_values().collect());
        self.counts.groups += 1;
        self.done.insert(gid.to_string());
        self.done_order.push_back(gid.to_string());
        if self.done_order.len() > DONE_MEMORY
            && let Some(old) = self.done_order.pop_front()
        {
            self.done.remove(&old);
        }
        out.emit(
            self.samples.clone(),
            SampleRow::to_batch(&samples).map_err(|e| StageError::internal(e.to_string()))?,
        );
        out.release(gid.to_string());
        let step = samples.first().map_or(0, |s| s.step);
        let c = self.counts;
        if let Some((t, b)) = self.ctx.metrics(
            step,
            &[
                ("groups", c.groups as f64),
                ("groups_filtered", c.groups_filtered as f64),
                ("groups_timed_out", c.groups_timed_out as f64),
                ("duplicates", c.duplicates as f64),
            ],
        ) {
            out.emit(t, b);
        }
        Ok(())
    }
}

#[async_trait]
impl Stage for MaskStage {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        let scored = rows::<ScoredRow>(&input.batch)?;
        let mut touched = Vec::new();
        for r in scored {
            if self.done.contains(&r.group_id) {
                self.counts.duplicates += 1;
                continue;
            }
            let p = self.pending.entry(r.group_id.clone()).or_insert_with(|| Pending {
                rows: BTreeMap::new(),
                size: r.group_size,
                since: Instant::now(),
            });
            if p.rows.contains_key(&r.rollout_id) {
                self.counts.duplicates += 1;
                continue;
            }
            if !touched.contains(&r.group_id) {
                touched.push(r.group_id.clone());
            }
            p.rows.insert(r.rollout_id.clone(), r);
        }
        match touched.first() {
            // Every row was a duplicate of something already handled: acknowledge it.
            None => return Ok(()),
            Some(g) => out.hold_as(g.clone()),
        }
        for g in touched {
            if self.pending.get(&g).is_some_and(|p| p.rows.len() as u32 >= p.size) {
                self.complete(&g, out)?;
            }
        }
        Ok(())
    }

    fn tick_interval(&self) -> Option<Duration> {
        Some(Duration::from_secs(1))
    }

    async fn tick(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        let limit = Duration::from_secs(self.cfg.group_timeout_secs);
        let late: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| p.since.elapsed() >= limit)
            .map(|(g, _)| g.clone())
            .collect();
        for g in late {
            self.counts.groups_timed_out += 1;
            tracing::warn!(stage = %self.ctx.instance(), group = %g, "group timed out; completing it with the samples it has");
            self.complete(&g, out)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantages_are_relative_to_the_group() {
        assert_eq!(
            advantages(&[1.0, 0.0, 0.0, 1.0], Advantage::Mean),
            vec![0.5, -0.5, -0.5, 0.5]
        );
        let a = advantages(&[1.0, 0.0, 0.0, 1.0], Advantage::MeanStd);
        assert!((a[0] - 1.0).abs() < 1e-4 && (a[1] + 1.0).abs() < 1e-4, "{a:?}");
        assert_eq!(advantages(&[0.3; 4], Advantage::Mean), vec![0.0; 4]);
    }
}

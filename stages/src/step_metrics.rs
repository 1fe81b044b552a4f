//! The trainer's per-step metrics: one struct with named fields, and the names of the
//! rows it becomes on the `metrics` topic (stage `trainer`, `step` = the version the step
//! produced). The trainer fills it; `streamrl run`'s progress lines, `streamrl report`'s
//! SQL and the benches read the rows by these names.
//!
//! ```
//! use streamrl_stages::step_metrics::{StepMetrics, name};
//! let m = StepMetrics { loss: 0.25, samples: 64, ..Default::default() };
//! let rows = m.rows();
//! assert!(rows.contains(&(name::LOSS.to_string(), 0.25)));
//! assert!(rows.contains(&(name::SAMPLES.to_string(), 64.0)));
//! ```

use std::collections::BTreeMap;

/// The metric names (the `name` column of `metrics` rows).
pub mod name {
    /// The RL loss of the step.
    pub const LOSS: &str = "loss";
    /// Fraction of trainable tokens masked for an IS ratio below the low threshold.
    pub const MASKED_LOW: &str = "masked_low";
    /// Fraction of trainable tokens masked for an IS ratio above the high threshold.
    pub const MASKED_HIGH: &str = "masked_high";
    /// KL between the sampler's and the trainer's token distributions (mismatch).
    pub const MISMATCH_KL: &str = "mismatch_kl";
    /// Largest |sampler − trainer| logprob of a trainable token.
    pub const MAX_LOGPROB_DIFF: &str = "max_logprob_diff";
    /// Fraction of tokens whose ratio was clipped.
    pub const CLIP_FRACTION: &str = "clip_fraction";
    /// Mean token entropy.
    pub const ENTROPY: &str = "entropy";
    /// Gradient norm before clipping.
    pub const GRAD_NORM: &str = "grad_norm";
    /// 1 when the optimizer step was skipped for a non-finite gradient.
    pub const OPTIMIZER_STEP_SKIPPED: &str = "optimizer_step_skipped";
    /// Learning rate of the step.
    pub const LR: &str = "lr";
    /// Mean reward of the step's samples.
    pub const REWARD_MEAN: &str = "reward_mean";
    /// Mean advantage of the trainable samples.
    pub const ADVANTAGE_MEAN: &str = "advantage_mean";
    /// Standard deviation of the trainable samples' advantages.
    pub const ADVANTAGE_STD: &str = "advantage_std";
    /// Mean completion length (tokens).
    pub const COMPLETION_LEN_MEAN: &str = "completion_len_mean";
    /// Samples the step consumed.
    pub const SAMPLES: &str = "samples";
    /// Samples trained on.
    pub const SAMPLES_TRAINED: &str = "samples_trained";
    /// Samples dropped as too stale.
    pub const SAMPLES_DROPPED_STALE: &str = "samples_dropped_stale";
    /// Samples without a trainable token.
    pub const SAMPLES_FILTERED: &str = "samples_filtered";
    /// Duplicate copies dropped so far.
    pub const SAMPLES_DUPLICATE: &str = "samples_duplicate";
    /// Groups the step was missing when it timed out.
    pub const GROUPS_MISSING: &str = "groups_missing";
    /// Trainable tokens of the step.
    pub const TRAINABLE_TOKENS: &str = "trainable_tokens";
    /// Micro-batches of the step.
    pub const MICRO_BATCHES: &str = "micro_batches";
    /// Wall time of the optimizer step.
    pub const STEP_SECONDS: &str = "step_seconds";
    /// Training tokens per second of the step.
    pub const TOKENS_PER_S: &str = "tokens_per_s";
    /// Mixture-of-experts load imbalance: the largest `(max tokens per expert − mean) /
    /// mean` over the step's MoE layers (only for MoE models).
    pub const MOE_IMBALANCE: &str = "moe_imbalance";
    /// Mixture-of-experts: the most loaded expert's tokens over the mean, the largest over
    /// the step's MoE layers (1: perfectly balanced; the progress line's `moe` figure).
    pub const MOE_MAX_LOAD: &str = "moe_max_load";
    /// Of the token routings the sampler recorded (over the MoE layers), the fraction the
    /// training forward sent to other experts than the sampler did (only for MoE models;
    /// 0 when nothing was recorded, and with `routing: replay`, which uses the record).
    pub const MOE_ROUTING_MISMATCH: &str = "moe_routing_mismatch";
    /// Of the token routings the sampler recorded, the fraction the trainer's own router
    /// would send to other experts, replayed or not: how far the two routings drift apart
    /// (equal to `moe_routing_mismatch` with `routing: recompute`).
    pub const MOE_ROUTER_DISAGREEMENT: &str = "moe_router_disagreement";
    /// Token routings the sampler recorded for the step, summed over the MoE layers.
    pub const MOE_RECORDED: &str = "moe_recorded_routes";
    /// `moe/<layer>/…`: one MoE layer's routing over the step: `load/<expert>` (the
    /// expert's share of the layer's routed tokens), `imbalance`, `router_entropy`
    /// (nats), `z_loss`, `recorded_routes` (tokens the sampler recorded routes for),
    /// `routing_mismatch` (of those, the fraction the training forward routed elsewhere)
    /// and `router_disagreement` (the fraction the trainer's router would route elsewhere).
    pub const MOE_PREFIX: &str = "moe/";
    /// `staleness_<k>`: samples `k` versions behind the trainer.
    pub const STALENESS_PREFIX: &str = "staleness_";
    /// Mean held-out greedy accuracy over the environments (every `eval_every` versions).
    pub const HELDOUT_ACCURACY: &str = "heldout_accuracy";
    /// `heldout/<env>`: one environment's held-out greedy accuracy.
    pub const HELDOUT_PREFIX: &str = "heldout/";
}

/// One optimizer step's metrics, as the trainer publishes them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepMetrics {
    /// [`name::LOSS`].
    pub loss: f64,
    /// [`name::MASKED_LOW`].
    pub masked_low: f64,
    /// [`name::MASKED_HIGH`].
    pub masked_high: f64,
    /// [`name::MISMATCH_KL`].
    pub mismatch_kl: f64,
    /// [`name::MAX_LOGPROB_DIFF`].
    pub max_logprob_diff: f64,
    /// [`name::CLIP_FRACTION`].
    pub clip_fraction: f64,
    /// [`name::ENTROPY`].
    pub entropy: f64,
    /// [`name::GRAD_NORM`].
    pub grad_norm: f64,
    /// [`name::OPTIMIZER_STEP_SKIPPED`].
    pub optimizer_step_skipped: bool,
    /// [`name::LR`].
    pub lr: f64,
    /// [`name::REWARD_MEAN`].
    pub reward_mean: f64,
    /// [`name::ADVANTAGE_MEAN`].
    pub advantage_mean: f64,
    /// [`name::ADVANTAGE_STD`].
    pub advantage_std: f64,
    /// [`name::COMPLETION_LEN_MEAN`].
    pub completion_len_mean: f64,
    /// [`name::SAMPLES`].
    pub samples: u64,
    /// [`name::SAMPLES_TRAINED`].
    pub samples_trained: u64,
    /// [`name::SAMPLES_DROPPED_STALE`].
    pub samples_dropped_stale: u64,
    /// [`name::SAMPLES_FILTERED`].
    pub samples_filtered: u64,
    /// [`name::SAMPLES_DUPLICATE`].
    pub samples_duplicate: u64,
    /// [`name::GROUPS_MISSING`].
    pub groups_missing: u64,
    /// [`name::TRAINABLE_TOKENS`].
    pub trainable_tokens: u64,
    /// [`name::MICRO_BATCHES`].
    pub micro_batches: u64,
    /// [`name::STEP_SECONDS`].
    pub step_seconds: f64,
    /// [`name::TOKENS_PER_S`].
    pub tokens_per_s: f64,
    /// [`name::MOE_IMBALANCE`] (`None`: a dense model, no row).
    pub moe_imbalance: Option<f64>,
    /// Per MoE layer ([`name::MOE_PREFIX`] and [`name::MOE_MAX_LOAD`]; empty: no rows).
    pub moe: Vec<streamrl_model::MoeStats>,
    /// Samples by versions behind the trainer ([`name::STALENESS_PREFIX`]).
    pub staleness: BTreeMap<u64, u64>,
}

impl StepMetrics {
    /// The `(name, value)` rows of the `metrics` topic, in a fixed order.
    pub fn rows(&self) -> Vec<(String, f64)> {
        let mut rows: Vec<(String, f64)> = [
            (name::LOSS, self.loss),
            (name::MASKED_LOW, self.masked_low),
            (name::MASKED_HIGH, self.masked_high),
            (name::MISMATCH_KL, self.mismatch_kl),
            (name::MAX_LOGPROB_DIFF, self.max_logprob_diff),
            (name::CLIP_FRACTION, self.clip_fraction),
            (name::ENTROPY, self.entropy),
            (name::GRAD_NORM, self.grad_norm),
            (
                name::OPTIMIZER_STEP_SKIPPED,
                if self.optimizer_step_skipped { 1.0 } else { 0.0 },
            ),
            (name::LR, self.lr),
            (name::REWARD_MEAN, self.reward_mean),
            (name::ADVANTAGE_MEAN, self.advantage_mean),
            (name::ADVANTAGE_STD, self.advantage_std),
            (name::COMPLETION_LEN_MEAN, self.completion_len_mean),
            (name::SAMPLES, self.samples as f64),
            (name::SAMPLES_TRAINED, self.samples_trained as f64),
            (name::SAMPLES_DROPPED_STALE, self.samples_dropped_stale as f64),
            (name::SAMPLES_FILTERED, self.samples_filtered as f64),
            (name::SAMPLES_DUPLICATE, self.samples_duplicate as f64),
            (name::GROUPS_MISSING, self.groups_missing as f64),
            (name::TRAINABLE_TOKENS, self.trainable_tokens as f64),
            (name::MICRO_BATCHES, self.micro_batches as f64),
            (name::STEP_SECONDS, self.step_seconds),
            (name::TOKENS_PER_S, self.tokens_per_s),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(v) = self.moe_imbalance {
            rows.push((name::MOE_IMBALANCE.to_string(), v));
        }
        if let Some(worst) = self.moe.iter().map(|m| m.max_load_ratio()).reduce(f32::max) {
            rows.push((name::MOE_MAX_LOAD.to_string(), worst as f64));
        }
        for (l, m) in self.moe.iter().enumerate() {
            let p = format!("{}{l}/", name::MOE_PREFIX);
            let total = m.tokens_per_expert.iter().sum::<usize>().max(1) as f64;
            for (e, &c) in m.tokens_per_expert.iter().enumerate() {
                rows.push((format!("{p}load/{e}"), c as f64 / total));
            }
            rows.push((format!("{p}imbalance"), m.imbalance as f64));
            rows.push((format!("{p}router_entropy"), m.router_entropy as f64));
            rows.push((format!("{p}z_loss"), m.z_loss as f64));
            rows.push((format!("{p}recorded_routes"), m.recorded as f64));
            let of_recorded = |c: usize| c as f64 / m.recorded.max(1) as f64;
            rows.push((format!("{p}routing_mismatch"), of_recorded(m.mismatched)));
            rows.push((format!("{p}router_disagreement"), of_recorded(m.disagreed)));
        }
        if !self.moe.is_empty() {
            let recorded: usize = self.moe.iter().map(|m| m.recorded).sum();
            let of_recorded = |f: fn(&streamrl_model::MoeStats) -> usize| {
                self.moe.iter().map(f).sum::<usize>() as f64 / recorded.max(1) as f64
            };
            rows.push((name::MOE_RECORDED.to_string(), recorded as f64));
            rows.push((name::MOE_ROUTING_MISMATCH.to_string(), of_recorded(|m| m.mismatched)));
            rows.push((name::MOE_ROUTER_DISAGREEMENT.to_string(), of_recorded(|m| m.disagreed)));
        }
        for (k, c) in &self.staleness {
            rows.push((format!("{}{k}", name::STALENESS_PREFIX), *c as f64));
        }
        rows
    }
}

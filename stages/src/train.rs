//! The training core shared by the trainer stage and `streamrl sft`: first-fit-decreasing
//! packing into micro-batches, gradient accumulation, the loss from ALGORITHM.md, one
//! optimizer step per batch, and checkpoints with optimizer state.

use std::path::Path;
use std::time::Instant;

use crate::Invalid;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};
use streamrl_model::config::HfConfig;
use streamrl_model::device::{DeviceSpec, Precision};
use streamrl_model::loss::{self, LossInputs, LossKind};
use streamrl_model::model::LayerMemory;
use streamrl_model::optim::{LrSchedule, Optimizer, OptimizerConfig};
use streamrl_model::{
    MoeStats, Packed, RouterCoefs, SampleRoutes, Tokenizer, Transformer, checkpoint, cores, token_logprobs_entropy,
};

/// The objective, as written in topology.yaml (`loss: {kind: masked_is, low: 0.5, ...}`):
/// the model crate's [`LossKind`], which carries its own serde form and defaults.
pub type LossConfig = LossKind;

/// How to train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// The objective.
    pub loss: LossConfig,
    /// Optimizer (AdamW or Muon+AdamW) and gradient clipping.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule over optimizer steps.
    pub lr: LrSchedule,
    /// Tokens per packed row (samples are laid end to end up to this many).
    pub pack_len: usize,
    /// Tokens per micro-batch (rows × pack_len); gradients accumulate over micro-batches.
    pub micro_batch_tokens: usize,
    /// Temperature the trainer's logprobs are computed at (must match sampling).
    pub temperature: f32,
    /// Weight of the MoE load-balance loss (0 for dense models).
    pub balance_coef: f32,
    /// Weight of the MoE router z-loss (`mean(logsumexp(router logits)²)` per layer, as
    /// ST-MoE): keeps router logits small; 0 (default) leaves it out.
    pub router_z_coef: f32,
    /// Recompute each layer in the backward instead of keeping its activations: lower
    /// peak memory for about one more forward per step (`streamrl bench train` measures
    /// both).
    pub activation_checkpointing: bool,
    /// Move the activations a step keeps for its backward to pinned host memory during
    /// the forward, on a second CUDA stream, and bring each layer's back one layer ahead
    /// of its backward (overlapped with compute): device memory for activations falls to
    /// about two layers' worth. With `activation_checkpointing`, what moves is each
    /// layer's input. CUDA devices only (`streamrl bench gpu` measures peak memory and
    /// step time with and without).
    pub activation_offloading: bool,
    /// Where the model trains: `cpu` (default), `cuda` or `cuda:N` (a build with the
    /// `cuda` feature on a machine with an NVIDIA GPU).
    pub device: DeviceSpec,
    /// Number type: `f32` (default) or `bf16`: every matrix product of the forward and
    /// backward in bf16 with f32 sums (on the CPU on its matrix units, AMX or AVX-512 BF16,
    /// with the weights kept f32; on a GPU with bf16 weights and activations). Logits,
    /// losses, norms, gradient accumulation and the optimizer's master weights and moments
    /// stay f32.
    pub dtype: Precision,
    /// CPU cores a step's matrix products may spread over while this process's other
    /// stages leave them idle (the rollout engine between decode steps, decided again
    /// before every product). 0 (default): the process decides, every core of the machine
    /// for `streamrl run` and `sft` (one process), one under `streamrl stage` (`up`,
    /// compose: the other stages' processes share the machine unseen); 1 keeps a step on
    /// its own thread.
    pub cores: usize,
    /// Mixture of experts: `replay` (default) routes each completion token of a sample to
    /// the experts the sampler chose for it (routing replay; the samples' recorded
    /// `completion_routes`), so that the trainer's logprobs are those of the policy that
    /// sampled: gradients still reach the router through its scores for those experts;
    /// tokens without recorded routes (prompts, tool output, a sampler that recorded
    /// none) are routed afresh. `recompute` routes every token afresh. The step reports
    /// the fraction of tokens with recorded routes that the forward routed elsewhere
    /// (`moe_routing_mismatch`: 0 when replaying) and that the trainer's own router would
    /// route elsewhere (`moe_router_disagreement`, replayed or not).
    /// Dense models ignore it.
    pub routing: Routing,
}

/// How a training forward routes a mixture of experts' tokens ([`TrainConfig::routing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// To the experts the sampler recorded, where it recorded them.
    #[default]
    Replay,
    /// By the trainer's own router.
    Recompute,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            loss: LossConfig::default(),
            optimizer: OptimizerConfig::default(),
            lr: LrSchedule::Constant { lr: 1e-4 },
            pack_len: 256,
            micro_batch_tokens: 4096,
            temperature: 1.0,
            balance_coef: 0.01,
            router_z_coef: 0.0,
            activation_checkpointing: false,
            activation_offloading: false,
            device: DeviceSpec::Cpu,
            dtype: Precision::F32,
            cores: 0,
            routing: Routing::Replay,
        }
    }
}

impl TrainConfig {
    /// Every invalid value.
    pub fn problems(&self) -> Vec<Invalid> {
        let mut p = Vec::new();
        if self.pack_len == 0 {
            p.push(Invalid::new("pack_len", "must be at least 1"));
        }
        if self.micro_batch_tokens < self.pack_len {
            p.push(Invalid::new(
                "micro_batch_tokens",
                format!(
                    "{} must be at least pack_len {}",
                    self.micro_batch_tokens, self.pack_len
                ),
            ));
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            p.push(Invalid::new(
                "temperature",
                format!("{} must be positive", self.temperature),
            ));
        }
        if self.activation_offloading && !self.device.is_cuda() {
            p.push(Invalid::new(
                "activation_offloading",
                format!(
                    "moves activations from a CUDA device to host memory; device is `{}` (use `device: cuda`, or leave it off)",
                    self.device
                ),
            ));
        }
        if let LossConfig::MaskedIs { low, high, .. } = self.loss
            && !(low > 0.0 && low < 1.0 && high > 1.0)
        {
            p.push(Invalid::new(
                "loss",
                format!("masked_is needs 0 < low < 1 < high, got low {low} high {high}"),
            ));
        }
        p
    }
}

/// One sample to train on.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSample {
    /// Prompt tokens (never trained on).
    pub prompt: Vec<u32>,
    /// Completion tokens.
    pub completion: Vec<u32>,
    /// Sampler logprob per completion token (ignored by SFT).
    pub sampler_logprobs: Vec<f32>,
    /// Per completion token: trainable or not.
    pub loss_mask: Vec<bool>,
    /// Advantage broadcast to every trainable token (ignored by SFT).
    pub advantage: f32,
    /// The experts the sampler routed each completion token to (per token, per layer,
    /// `top_k` ids; empty: none recorded), for routing replay ([`TrainConfig::routing`]).
    pub routes: Vec<u8>,
}

impl TrainSample {
    fn len(&self) -> usize {
        self.prompt.len() + self.completion.len()
    }
}

/// What makes a sample of `prompt` and `completion` tokens with `mask` loss-mask values
/// untrainable on a model with a context of `ctx` tokens, if anything: an empty prompt
/// (its first completion token would have no position to be predicted from), a mask that
/// is not one value per completion token, or more tokens than the context.
pub fn sample_problem(prompt: usize, completion: usize, mask: usize, ctx: usize) -> Option<String> {
    if prompt == 0 {
        Some("empty prompt (its first completion token would have no context to be predicted from)".into())
    } else if mask != completion {
        Some(format!("{mask} loss-mask values for {completion} completion tokens"))
    } else if prompt + completion > ctx {
        Some(format!(
            "{} tokens ({prompt} prompt + {completion} completion) exceed the model's context of {ctx}",
            prompt + completion
        ))
    } else {
        None
    }
}

/// What makes a sample's recorded expert routes (`routes`, for `completion` tokens)
/// unusable on a model whose MoE layers route to `top_k` of `experts` experts in each of
/// `layers` layers (`moe`: `None` for a dense model), if anything. No routes is always
/// fine.
pub fn routes_problem(routes: &[u8], completion: usize, moe: Option<(usize, usize, usize)>) -> Option<String> {
    if routes.is_empty() {
        return None;
    }
    let Some((layers, top_k, experts)) = moe else {
        return Some(format!(
            "{} recorded expert routes for a dense model (a mixture of experts sampled it?)",
            routes.len()
        ));
    };
    let want = completion * layers * top_k;
    if routes.len() != want {
        return Some(format!(
            "{} recorded expert routes for {completion} completion tokens × {layers} layers × top-{top_k} = {want}",
            routes.len()
        ));
    }
    routes
        .iter()
        .find(|&&e| e != streamrl_model::NO_ROUTE && e as usize >= experts)
        .map(|e| format!("recorded expert {e} of a model with {experts} experts"))
}

/// What one optimizer step did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    /// Optimizer steps taken so far (this one included).
    pub step: u64,
    /// Loss (token-weighted over micro-batches).
    pub loss: f32,
    /// Fraction of trainable tokens masked below `low`.
    pub masked_low: f32,
    /// Fraction masked above `high`.
    pub masked_high: f32,
    /// Mismatch KL between trainer and sampler.
    pub mismatch_kl: f32,
    /// Largest |trainer − sampler| logprob over the step's trainable tokens.
    pub max_logprob_diff: f32,
    /// Mixture-of-experts routing: the largest `(max tokens per expert − mean) / mean`
    /// over the MoE layers and micro-batches of the step (0: perfectly balanced); `None`
    /// for a dense model.
    pub moe_imbalance: Option<f32>,
    /// Mixture-of-experts routing per MoE layer over the whole step: tokens per expert
    /// summed over micro-batches, the imbalance of those sums, and the router entropy and
    /// z-loss averaged over micro-batches by their tokens, and the tokens with recorded
    /// routes and those the trainer's router differs on. Empty for a dense model.
    pub moe: Vec<MoeStats>,
    /// Clip fraction (clipped losses).
    pub clip_fraction: f32,
    /// Mean entropy of the trainer's next-token distributions on trainable tokens.
    pub entropy: f32,
    /// Gradient norm before clipping.
    pub grad_norm: f32,
    /// The loss or the gradient norm was not finite, so the optimizer step was skipped:
    /// the weights and optimizer state are as before this call.
    pub skipped_nonfinite: bool,
    /// Learning rate used.
    pub lr: f64,
    /// Samples trained.
    pub samples: usize,
    /// All tokens forwarded.
    pub tokens: usize,
    /// Trainable tokens.
    pub trainable_tokens: usize,
    /// Micro-batches.
    pub micro_batches: usize,
    /// Packed rows.
    pub rows: usize,
    /// Wall seconds.
    pub seconds: f64,
}

/// Adds one micro-batch's routing statistics (one per MoE layer) into the step's.
fn add_routing(step: &mut Vec<MoeStats>, micro: &[MoeStats]) {
    if step.is_empty() {
        step.extend(micro.iter().cloned());
        return;
    }
    for (acc, m) in step.iter_mut().zip(micro) {
        acc.merge(m);
    }
}

/// Packs sample indices first-fit-decreasing into rows of at most `cap` tokens (a longer
/// sample gets a row of its own).
pub fn pack_ffd(lens: &[usize], cap: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by(|a, b| lens[*b].cmp(&lens[*a]).then(a.cmp(b)));
    let mut rows: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in order {
        match rows.iter_mut().find(|(used, _)| used + lens[i] <= cap) {
            Some((used, r)) => {
                *used += lens[i];
                r.push(i);
            }
            None => rows.push((lens[i], vec![i])),
        }
    }
    rows.into_iter().map(|(_, r)| r).collect()
}

/// A trainable policy with its optimizer.
pub struct Learner {
    /// config.json.
    pub hf: HfConfig,
    /// Trainable variables.
    pub vars: VarMap,
    /// The model over `vars`.
    pub model: Transformer,
    /// Tokenizer saved with every checkpoint.
    pub tokenizer: Option<Tokenizer>,
    opt: Optimizer,
    cfg: TrainConfig,
}

impl Learner {
    /// Loads a checkpoint directory onto the configured device in the configured dtype,
    /// and its optimizer state when the directory has one.
    pub fn load(dir: &Path, cfg: TrainConfig) -> streamrl_model::Result<Self> {
        let device = cfg.device.open()?;
        let l = checkpoint::load_in(dir, &device, cfg.dtype)?;
        let mut opt = Optimizer::new(&l.vars, cfg.optimizer.clone())?;
        if dir.join("optimizer.json").exists() {
            opt.load(dir)?;
        }
        Ok(Learner {
            hf: l.hf,
            vars: l.vars,
            model: l.model,
            tokenizer: l.tokenizer,
            opt,
            cfg,
        })
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.opt.steps()
    }

    /// The model's context: the most tokens one sample may hold.
    pub fn context(&self) -> usize {
        self.model.config().max_positions
    }

    /// Writes the checkpoint (HF layout) and the optimizer state to `dir`; returns the
    /// weights' SHA-256.
    pub fn save(&self, dir: &Path) -> streamrl_model::Result<String> {
        let sha = checkpoint::save(dir, &self.hf, &self.vars, self.tokenizer.as_ref(), None)?;
        self.opt.save(dir)?;
        Ok(sha)
    }

    /// One optimizer step over `samples`: packed, forwarded in micro-batches with gradients
    /// accumulated, normalised by the batch's trainable tokens.
    pub fn step(&mut self, samples: &[TrainSample]) -> streamrl_model::Result<StepReport> {
        let cores = self.cores();
        cores::spread(cores, || self.step_on_cores(samples))
    }

    /// The cores this learner's work may spread over ([`TrainConfig::cores`], 0 resolved
    /// to the process's default): its steps, and whatever else the trainer computes on
    /// its weights (held-out evals) inside [`cores::spread`].
    pub fn cores(&self) -> usize {
        match self.cfg.cores {
            0 => cores::process_default(),
            n => n,
        }
    }

    /// [`Learner::step`], its products spread over the cores it was given.
    fn step_on_cores(&mut self, samples: &[TrainSample]) -> streamrl_model::Result<StepReport> {
        let t0 = Instant::now();
        let kind: LossKind = self.cfg.loss;
        check_shapes(samples, self.model.config())?;
        let total_trainable: usize = samples.iter().map(|s| s.loss_mask.iter().filter(|m| **m).count()).sum();
        let lens: Vec<usize> = samples.iter().map(TrainSample::len).collect();
        let rows = pack_ffd(&lens, self.cfg.pack_len);
        let rows_per_mb = (self.cfg.micro_batch_tokens / self.cfg.pack_len.max(1)).max(1);
        let mut report = StepReport {
            samples: samples.len(),
            tokens: lens.iter().sum(),
            trainable_tokens: total_trainable,
            rows: rows.len(),
            ..Default::default()
        };
        let mut grads: Option<GradStore> = None;
        let denom = total_trainable.max(1) as f32;
        for mb in rows.chunks(rows_per_mb) {
            report.micro_batches += 1;
            let dev = self.model.device().clone();
            let MicroBatch {
                packed,
                at,
                targets,
                sampler,
                adv,
                mask,
                spans,
            } = MicroBatch::new(samples, mb, &dev)?;
            // Recorded routes are replayed, or (recompute) compared with the trainer's.
            let packed = {
                let routes: Vec<Option<SampleRoutes>> = mb
                    .iter()
                    .flatten()
                    .map(|&i| {
                        let s = &samples[i];
                        (!s.routes.is_empty()).then_some(SampleRoutes {
                            from: s.prompt.len(),
                            ids: &s.routes,
                        })
                    })
                    .collect();
                let replay = self.cfg.routing == Routing::Replay;
                packed.with_routes(self.model.config(), &routes, replay)?
            };
            let mb_trainable: f32 = mask.iter().sum();
            if sampler.is_empty() {
                continue;
            }
            let w = mb_trainable / denom;
            let temperature = self.cfg.temperature as f64;
            let n = sampler.len();
            // The loss of this micro-batch (weighted by its share of trainable tokens).
            // The logits come only from the positions that predict a completion token;
            // logprobs and entropies from one pass over them.
            let loss_of = |logits: &Tensor| -> streamrl_model::Result<(Tensor, loss::LossMetrics, Tensor)> {
                let (lp, ent) = token_logprobs_entropy(logits, &targets, temperature)?;
                let (lp, ent) = (lp.narrow(1, 1, n)?.flatten_all()?, ent.narrow(1, 1, n)?);
                let (l, m) = loss::compute(
                    kind,
                    LossInputs {
                        logprobs: &lp,
                        sampler: &sampler,
                        advantages: &adv,
                        mask: &mask,
                        spans: &spans,
                    },
                )?;
                Ok(((l * w as f64)?, m, ent))
            };
            let coef = RouterCoefs {
                balance: self.cfg.balance_coef as f64,
                z: self.cfg.router_z_coef as f64,
            };
            let memory = LayerMemory {
                checkpoint: self.cfg.activation_checkpointing,
                offload: self.cfg.activation_offloading,
            };
            let (g, ent, m, moe) = if memory != LayerMemory::default() {
                let mut metrics = None;
                let (g, _logits, aux, _) = self.model.backward_by_layer(&packed, Some(&at), coef, memory, |lg| {
                    let (l, m, ent) = loss_of(lg)?;
                    metrics = Some((m, ent));
                    Ok(l)
                })?;
                let (m, ent) = metrics.expect("the head loss ran");
                (g, ent, m, aux.moe)
            } else {
                let (logits, aux) = self.model.forward_at(&packed, &at)?;
                let (l, m, ent) = loss_of(&logits)?;
                let g = (l + aux.router_loss(coef)?)?.backward()?;
                (g, ent, m, aux.moe)
            };
            if let Some(worst) = moe.iter().map(|s| s.imbalance).reduce(f32::max) {
                report.moe_imbalance = Some(report.moe_imbalance.map_or(worst, |w| w.max(worst)));
            }
            add_routing(&mut report.moe, &moe);
            report.add(&m, masked_mean(&ent, &mask)?, w);
            grads = Some(self.accumulate(grads, g, &dev)?);
        }
        self.apply(grads, &mut report)?;
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Adds a micro-batch's gradients to the step's; they accumulate in f32 whatever the
    /// weights' dtype.
    fn accumulate(&self, acc: Option<GradStore>, g: GradStore, dev: &Device) -> streamrl_model::Result<GradStore> {
        let widen = self.model.dtype() != DType::F32;
        let mut acc = match acc {
            None if !widen => return Ok(g),
            Some(acc) => acc,
            None => empty_grads(dev)?,
        };
        for var in self.vars.all_vars() {
            if let Some(new) = g.get(var.as_tensor()) {
                let new = new.to_dtype(DType::F32)?;
                let sum = match acc.get(var.as_tensor()) {
                    Some(old) => (old + new)?,
                    None => new,
                };
                acc.insert(var.as_tensor(), sum);
            }
        }
        Ok(acc)
    }

    /// The optimizer step on the accumulated gradients (skipped, and said so, on a
    /// non-finite loss or gradient norm); records the learning rate and step.
    fn apply(&mut self, grads: Option<GradStore>, report: &mut StepReport) -> streamrl_model::Result<()> {
        let lr = self.cfg.lr.lr(self.opt.steps());
        if !report.loss.is_finite() {
            tracing::warn!(loss = report.loss, "non-finite loss: optimizer step skipped");
            report.skipped_nonfinite = true;
        } else if let Some(g) = grads {
            let stats = self.opt.step(&g, lr)?;
            report.grad_norm = stats.grad_norm;
            if stats.skipped {
                tracing::warn!(
                    grad_norm = stats.grad_norm,
                    "non-finite gradient norm: optimizer step skipped"
                );
                report.skipped_nonfinite = true;
            }
        }
        report.lr = lr;
        report.step = self.opt.steps();
        Ok(())
    }
}

/// Every sample is trainable ([`sample_problem`]) and its recorded routes fit the model
/// ([`routes_problem`]).
fn check_shapes(samples: &[TrainSample], cfg: &streamrl_model::config::Config) -> streamrl_model::Result<()> {
    let moe = moe_shape(cfg);
    for (i, s) in samples.iter().enumerate() {
        let (p, c) = (s.prompt.len(), s.completion.len());
        if let Some(p) =
            sample_problem(p, c, s.loss_mask.len(), cfg.max_positions).or_else(|| routes_problem(&s.routes, c, moe))
        {
            return Err(streamrl_model::Error::Shape(format!("sample {i}: {p}")));
        }
    }
    Ok(())
}

/// `(layers, top_k, experts)` of a mixture of experts, as [`routes_problem`] takes it.
pub fn moe_shape(cfg: &streamrl_model::config::Config) -> Option<(usize, usize, usize)> {
    cfg.moe.as_ref().map(|m| (cfg.n_layers, m.top_k, m.n_experts))
}

/// One micro-batch: its rows of packed samples, and per completion token (in packing
/// order) the position that predicts it, its sampler logprob, advantage and mask.
struct MicroBatch {
    packed: Packed,
    /// The flat positions (row · width + column) in the packed batch whose logits the
    /// loss needs, as [`Transformer::forward_at`] takes them: for completion token `j`,
    /// the position before it at `at[j]`, then one more (a repeat of the last) so that
    /// the logits (1, n + 1, V) and `targets` line up as `token_logprobs` shifts them.
    at: Vec<u32>,
    /// `(1, n + 1)`: 0, then completion token `j` at column `j + 1`, so that column
    /// `j + 1` of the logprobs is token `j`'s under the logits at `at[j]`.
    targets: Tensor,
    sampler: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<f32>,
    /// `(first token, tokens)` of each sample's completion within the vectors above.
    spans: Vec<(usize, usize)>,
}

impl MicroBatch {
    /// Packs the rows `mb` (each a list of sample indices) of `samples`.
    fn new(samples: &[TrainSample], mb: &[Vec<usize>], dev: &Device) -> streamrl_model::Result<Self> {
        let seqs: Vec<Vec<Vec<u32>>> = mb
            .iter()
            .map(|r| {
                r.iter()
                    .map(|&i| {
                        samples[i]
                            .prompt
                            .iter()
                            .chain(&samples[i].completion)
                            .copied()
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let packed = Packed::new(&seqs, dev)?;
        let order: Vec<usize> = mb.iter().flatten().copied().collect();
        let mut at = Vec::new();
        let mut targets = vec![0u32];
        let (mut sampler, mut adv, mut mask, mut spans) = (vec![], vec![], vec![], vec![]);
        for (&i, &(row, start, _len)) in order.iter().zip(&packed.spans) {
            let s = &samples[i];
            // The completion's first token sits after the prompt (never empty:
            // `check_shapes`); the position before each token predicts it.
            let first = row * packed.width + start + s.prompt.len();
            spans.push((sampler.len(), s.completion.len()));
            for (k, &tok) in s.completion.iter().enumerate() {
                at.push((first + k - 1) as u32);
                targets.push(tok);
                sampler.push(s.sampler_logprobs.get(k).copied().unwrap_or(0.0));
                adv.push(s.advantage);
                mask.push(if s.loss_mask[k] { 1.0 } else { 0.0 });
            }
        }
        at.push(at.last().copied().unwrap_or(0));
        let n = targets.len();
        Ok(MicroBatch {
            targets: Tensor::from_vec(targets, (1, n), dev)?,
            at,
            sampler,
            adv,
            mask,
            spans,
            packed,
        })
    }
}

impl StepReport {
    /// Adds a micro-batch's loss metrics and entropy, weighted by `w` (its share of the
    /// step's trainable tokens).
    fn add(&mut self, m: &loss::LossMetrics, entropy: f32, w: f32) {
        self.loss += m.loss * w;
        self.masked_low += m.masked_low * w;
        self.masked_high += m.masked_high * w;
        self.mismatch_kl += m.mismatch_kl * w;
        self.max_logprob_diff = self.max_logprob_diff.max(m.max_abs_log_ratio);
        self.clip_fraction += m.clip_fraction * w;
        self.entropy += entropy * w;
    }
}

/// Mean of `values` (any shape) where `mask` (as many values) is 1; 0 when it is all 0.
fn masked_mean(values: &Tensor, mask: &[f32]) -> candle_core::Result<f32> {
    let v = values.flatten_all()?.to_vec1::<f32>()?;
    let n: f32 = mask.iter().sum();
    if n == 0.0 {
        return Ok(0.0);
    }
    Ok(v.iter().zip(mask).map(|(a, m)| a * m).sum::<f32>() / n)
}

/// A gradient store with no entries (candle has no public constructor for one).
fn empty_grads(dev: &Device) -> candle_core::Result<GradStore> {
    let z = Tensor::zeros((), DType::F32, dev)?;
    let mut g = z.backward()?;
    g.remove(&z);
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_routes_that_do_not_fit_the_model_are_named() {
        // 2 layers, top-2 of 8 experts: 4 ids per completion token.
        let moe = Some((2, 2, 8));
        assert_eq!(routes_problem(&[], 3, moe), None);
        assert_eq!(routes_problem(&[], 3, None), None);
        assert_eq!(routes_problem(&[0, 1, 2, 3, 255, 255, 255, 255], 2, moe), None);
        let short = routes_problem(&[0, 1, 2], 2, moe).unwrap();
        assert!(
            short.contains("3 recorded expert routes for 2 completion tokens × 2 layers × top-2 = 8"),
            "{short}"
        );
        let bad = routes_problem(&[0, 1, 9, 3], 1, moe).unwrap();
        assert!(bad.contains("recorded expert 9 of a model with 8 experts"), "{bad}");
        let dense = routes_problem(&[0, 1], 1, None).unwrap();
        assert!(dense.contains("2 recorded expert routes for a dense model"), "{dense}");
    }

    #[test]
    fn ffd_packs_longest_first_into_the_first_row_with_room() {
        let rows = pack_ffd(&[5, 9, 3, 7, 2, 12], 10);
        assert_eq!(rows, vec![vec![5], vec![1], vec![3, 2], vec![0, 4]]);
        let lens = [5, 9, 3, 7, 2, 12];
        for r in &rows {
            let used: usize = r.iter().map(|i| lens[*i]).sum();
            assert!(used <= 10 || r.len() == 1);
        }
        let mut all: Vec<usize> = rows.concat();
        all.sort();
        assert_eq!(all, (0..6).collect::<Vec<_>>());
    }

    #[test]
    fn activation_offloading_is_refused_off_cuda_with_the_other_problems() {
        let bad = TrainConfig {
            activation_offloading: true,
            pack_len: 0,
            ..Default::default()
        };
        let p: Vec<String> = bad.problems().iter().map(|p| p.to_string()).collect();
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p.iter()
                .any(|p| p.starts_with("activation_offloading:") && p.contains("device is `cpu`")),
            "{p:?}"
        );
        let on_gpu = TrainConfig {
            activation_offloading: true,
            device: DeviceSpec::Cuda(0),
            ..Default::default()
        };
        assert!(on_gpu.problems().is_empty(), "{:?}", on_gpu.problems());
    }
}

//! RL and SFT losses as pure functions of (trainer logprobs, sampler logprobs, advantages,
//! loss mask), each returning the loss and its metrics. See ALGORITHM.md.
//!
//! All inputs are flat over tokens; `spans` give each sample's `(start, len)` for the
//! sequence-level variants. Token losses are normalised by the number of trainable tokens
//! (`Σ mask`), with masked-out tokens still counted, as in the reference.

use candle_core::Tensor;

use crate::{Error, Result};

/// Which objective to optimise; in configuration files written as
/// `{kind: masked_is, low: 0.5, high: 5.0}` (missing masked-IS fields take the defaults).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LossKind {
    /// Double-sided masked importance sampling (IcePop-style; the default): tokens with
    /// ratio outside `[low, high]` are dropped, not clipped.
    MaskedIs {
        /// Lower ratio bound (INTELLECT-3: 0.5).
        #[serde(default = "default_low")]
        low: f32,
        /// Upper ratio bound (INTELLECT-3: 5.0).
        #[serde(default = "default_high")]
        high: f32,
        /// Drop a whole sample whose smallest ratio is below this.
        #[serde(default)]
        seq_low: Option<f32>,
        /// Weight of the `(log r)²` penalty (0: off).
        #[serde(default)]
        kl_tau: f32,
    },
    /// PPO/GRPO clipped surrogate; DAPO's asymmetric clip with `eps_low != eps_high`.
    Clipped {
        /// Clip below at 1 − eps_low.
        eps_low: f32,
        /// Clip above at 1 + eps_high.
        eps_high: f32,
    },
    /// GSPO: the clipped surrogate on the sequence-level ratio (geometric mean of token ratios).
    Gspo {
        /// Clip below at 1 − eps_low.
        eps_low: f32,
        /// Clip above at 1 + eps_high.
        eps_high: f32,
    },
    /// Truncated importance sampling: policy gradient weighted by a detached `min(r, cap)`.
    Tis {
        /// Truncation cap.
        cap: f32,
    },
    /// Supervised cross-entropy on trainable tokens.
    Sft,
}

fn default_low() -> f32 {
    0.5
}

fn default_high() -> f32 {
    5.0
}

impl Default for LossKind {
    fn default() -> Self {
        LossKind::MaskedIs {
            low: 0.5,
            high: 5.0,
            seq_low: None,
            kl_tau: 0.0,
        }
    }
}

/// The loss's inputs, flat over tokens.
#[derive(Debug, Clone, Copy)]
pub struct LossInputs<'a> {
    /// Trainer logprobs, 1-D (N), differentiable.
    pub logprobs: &'a Tensor,
    /// Sampler logprobs (N).
    pub sampler: &'a [f32],
    /// Per-token advantages (N).
    pub advantages: &'a [f32],
    /// Loss mask (N): 1 trainable, 0 not.
    pub mask: &'a [f32],
    /// `(start, len)` of every sample.
    pub spans: &'a [(usize, usize)],
}

/// Metrics every loss reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LossMetrics {
    /// Loss value.
    pub loss: f32,
    /// Trainable tokens (Σ mask).
    pub tokens: f32,
    /// Fraction of trainable tokens masked for a ratio below `low` (or by the sequence mask).
    pub masked_low: f32,
    /// Fraction of trainable tokens masked for a ratio above `high`.
    pub masked_high: f32,
    /// Mismatch KL between trainer and sampler, `mean(r − log r − 1)` over trainable tokens.
    pub mismatch_kl: f32,
    /// Largest |trainer − sampler| logprob over trainable tokens (clamped at
    /// [`MAX_LOG_RATIO`]): 0 up to rounding when the sampler ran the trainer's weights.
    pub max_abs_log_ratio: f32,
    /// Fraction of trainable tokens (or sequences, for GSPO) whose objective was clipped.
    pub clip_fraction: f32,
}

/// Largest log importance ratio the objective's arithmetic uses (e^20 ≈ 4.9e8); larger
/// ones are clamped in value (they are masked by every sensible `high` anyway).
pub const MAX_LOG_RATIO: f32 = 20.0;

/// Checks that every input has one value per logprob and that they are usable
/// ([`check_finite`]); returns the number of tokens.
fn check_inputs(x: &LossInputs<'_>) -> Result<usize> {
    let n = x.logprobs.dims1()?;
    for (name, len) in [
        ("sampler", x.sampler.len()),
        ("advantages", x.advantages.len()),
        ("mask", x.mask.len()),
    ] {
        if len != n {
            return Err(Error::Shape(format!(
                "loss input `{name}` has {len} values for {n} logprobs"
            )));
        }
    }
    check_finite(x)?;
    Ok(n)
}

/// Refuses inputs no loss can be finite on, naming the first bad value: NaN anywhere, an
/// infinite advantage or mask, a +∞ sampler logprob. (A −∞ sampler logprob is allowed: an
/// infinite ratio, masked or clamped.)
fn check_finite(x: &LossInputs<'_>) -> Result<()> {
    let bad = |name: &str, i: usize, v: f32| Error::Shape(format!("loss input `{name}`[{i}] is {v}"));
    for (i, v) in x.sampler.iter().enumerate() {
        if v.is_nan() || *v == f32::INFINITY {
            return Err(bad("sampler", i, *v));
        }
    }
    for (name, vals) in [("advantages", x.advantages), ("mask", x.mask)] {
        if let Some((i, v)) = vals.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(bad(name, i, *v));
        }
    }
    Ok(())
}

/// What every loss kind shares, computed once per call.
struct Prepared<'a> {
    x: LossInputs<'a>,
    /// Tokens.
    n: usize,
    dev: &'a candle_core::Device,
    /// The true importance ratio per token (decides the masks).
    r: Vec<f32>,
    /// The log-ratio the arithmetic uses: clamped to ±[`MAX_LOG_RATIO`], 0 off the mask.
    clamped: Vec<f32>,
    /// `max(Σ mask, 1)`: token losses are normalised by it.
    denom: f32,
    /// The (shifted) sampler logprobs the differentiable ratio subtracts.
    sampler: Tensor,
    /// `exp(logprobs − sampler)`, differentiable.
    ratio: Tensor,
}

impl Prepared<'_> {
    fn weights(&self, w: Vec<f32>) -> candle_core::Result<Tensor> {
        Tensor::new(w.as_slice(), self.dev)
    }
}

/// Computes `kind`'s loss. Finite for any finite inputs and for −∞ sampler logprobs,
/// however large the ratios: masks are decided on the log-ratio, and a masked token's
/// ratio never enters a product.
pub fn compute(kind: LossKind, x: LossInputs<'_>) -> Result<(Tensor, LossMetrics)> {
    if let LossKind::MaskedIs {
        low,
        high,
        seq_low: None,
        kl_tau,
    } = kind
    {
        return masked_is_fused(x, low, high, kl_tau);
    }
    compute_op_by_op(kind, x)
}

/// [`compute`] from tensor ops for every kind (the reference the fused masked-IS loss is
/// tested against).
pub fn compute_op_by_op(kind: LossKind, x: LossInputs<'_>) -> Result<(Tensor, LossMetrics)> {
    let (p, mut m) = prepare(x)?;
    let loss = match kind {
        LossKind::MaskedIs {
            low,
            high,
            seq_low,
            kl_tau,
        } => masked_is(&p, &mut m, low, high, seq_low, kl_tau)?,
        LossKind::Clipped { eps_low, eps_high } => clipped(&p, &mut m, eps_low, eps_high)?,
        LossKind::Gspo { eps_low, eps_high } => gspo(&p, &mut m, eps_low, eps_high)?,
        LossKind::Tis { cap } => tis(&p, cap)?,
        LossKind::Sft => sft(&p)?,
    };
    m.loss = loss.to_scalar::<f32>()?;
    Ok((loss, m))
}

/// The totals one pass of the double-sided masked IS loss accumulates (the CUDA kernel
/// returns the same six numbers).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MaskedIsTotals {
    /// Σ over tokens of `−keep · A · e^c + kl_tau · m · c²` (before dividing by the denominator).
    pub loss: f32,
    /// Σ mask.
    pub tokens: f32,
    /// Trainable tokens whose ratio is below `low`.
    pub low: f32,
    /// Trainable tokens whose ratio is above `high`.
    pub high: f32,
    /// Σ m · (e^c − c − 1) over trainable tokens.
    pub kl: f32,
    /// Largest |c| over trainable tokens.
    pub max_abs: f32,
}

/// The double-sided masked IS loss's parameters (without the sequence mask).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskedIs {
    /// Lower ratio bound.
    pub low: f32,
    /// Upper ratio bound.
    pub high: f32,
    /// Weight of the `(log r)²` penalty.
    pub kl_tau: f32,
}

impl MaskedIs {
    /// One token of the loss: adds its terms to `t` and returns its gradient (before
    /// dividing by the denominator). `c` is the log-ratio clamped to ±[`MAX_LOG_RATIO`]
    /// (0 off the mask); the mask is decided on the true ratio.
    #[inline]
    pub fn token(&self, lp: f32, sampler: f32, adv: f32, m: f32, t: &mut MaskedIsTotals) -> f32 {
        let MaskedIs { low, high, kl_tau } = *self;
        t.tokens += m;
        if m <= 0.0 {
            return 0.0;
        }
        let l = lp - sampler;
        let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
        let r = l.exp();
        let c = l.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO);
        let keep = if r < low {
            t.low += 1.0;
            0.0
        } else if r > high {
            t.high += 1.0;
            0.0
        } else {
            m
        };
        let e = c.exp();
        t.kl += m * (e - c - 1.0);
        t.max_abs = t.max_abs.max(c.abs());
        t.loss += -keep * adv * e + kl_tau * m * c * c;
        -keep * adv * e + 2.0 * kl_tau * m * c
    }
}

/// The metrics of a masked IS pass from its totals.
fn masked_is_metrics(t: &MaskedIsTotals) -> (f32, LossMetrics) {
    let denom = t.tokens.max(1.0);
    (
        denom,
        LossMetrics {
            loss: t.loss / denom,
            tokens: t.tokens,
            masked_low: t.low / denom,
            masked_high: t.high / denom,
            mismatch_kl: t.kl / denom,
            max_abs_log_ratio: t.max_abs,
            clip_fraction: 0.0,
        },
    )
}

/// Double-sided masked IS (without a sequence mask) as one pass over the tokens and one
/// op: the loss, its gradient and every metric together, on the CPU or, with the `cuda`
/// feature, in one CUDA kernel where the logprobs live. Equal to the op-by-op loss
/// ([`compute_op_by_op`]) in value, gradient and metrics.
pub fn masked_is_fused(x: LossInputs<'_>, low: f32, high: f32, kl_tau: f32) -> Result<(Tensor, LossMetrics)> {
    let n = check_inputs(&x)?;
    #[cfg(feature = "cuda")]
    if x.logprobs.device().is_cuda() {
        let (totals, grad) = crate::cuda::masked_is(x.logprobs, x.sampler, x.advantages, x.mask, low, high, kl_tau)?;
        let (denom, metrics) = masked_is_metrics(&totals);
        let grad = (grad / denom as f64)?;
        return Ok((attach(x.logprobs, metrics.loss, grad)?, metrics));
    }
    let lp = x.logprobs.to_vec1::<f32>()?;
    let k = MaskedIs { low, high, kl_tau };
    let mut t = MaskedIsTotals::default();
    let grad: Vec<f32> = (0..n)
        .map(|i| k.token(lp[i], x.sampler[i], x.advantages[i], x.mask[i], &mut t))
        .collect();
    let (denom, metrics) = masked_is_metrics(&t);
    let grad = Tensor::from_vec(
        grad.into_iter().map(|g| g / denom).collect::<Vec<_>>(),
        n,
        x.logprobs.device(),
    )?;
    Ok((attach(x.logprobs, metrics.loss, grad)?, metrics))
}

/// A scalar of value `value` whose gradient with respect to `logprobs` is `grad`.
fn attach(logprobs: &Tensor, value: f32, grad: Tensor) -> Result<Tensor> {
    Ok(logprobs.apply_op1(ValueWithGrad { value, grad })?)
}

/// The op [`attach`] applies: forward gives the precomputed value, backward the
/// precomputed gradient times the incoming one.
struct ValueWithGrad {
    value: f32,
    grad: Tensor,
}

impl candle_core::CustomOp1 for ValueWithGrad {
    fn name(&self) -> &'static str {
        "fused-masked-is-loss"
    }

    fn cpu_fwd(
        &self,
        _s: &candle_core::CpuStorage,
        _l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        Ok((
            candle_core::CpuStorage::F32(vec![self.value]),
            candle_core::Shape::from(()),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        crate::cuda::scalar(s, self.value)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.grad.broadcast_mul(g)?))
    }
}

/// Checks the inputs and computes what every kind shares, with the metrics every kind
/// reports (tokens, mismatch KL, largest log-ratio).
fn prepare(x: LossInputs<'_>) -> Result<(Prepared<'_>, LossMetrics)> {
    let n = check_inputs(&x)?;
    let dev = x.logprobs.device();
    let lp = x.logprobs.to_vec1::<f32>()?;
    // The true log-ratio decides the masks (a −∞ sampler logprob is an infinite ratio; a
    // −∞ trainer logprob, a zero one). Arithmetic uses `clamped`: ±MAX_LOG_RATIO at most,
    // and 0 on tokens outside the mask, so no inf or NaN can reach a product, however
    // large the ratio or however small a weight (inf × 0 is NaN).
    let log_r: Vec<f32> = lp
        .iter()
        .zip(x.sampler)
        .map(|(a, b)| {
            let l = a - b;
            if l.is_nan() { f32::NEG_INFINITY } else { l }
        })
        .collect();
    let r: Vec<f32> = log_r.iter().map(|l| l.exp()).collect();
    let clamped: Vec<f32> = log_r
        .iter()
        .zip(x.mask)
        .map(|(l, m)| {
            if *m > 0.0 {
                l.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
            } else {
                0.0
            }
        })
        .collect();
    let tokens: f32 = x.mask.iter().sum();
    let denom = tokens.max(1.0);
    let mismatch_kl = clamped
        .iter()
        .zip(x.mask)
        .filter(|(_, m)| **m > 0.0)
        .map(|(l, m)| m * (l.exp() - l - 1.0))
        .sum::<f32>()
        / denom;
    // The differentiable log-ratio: `logprobs − sampler` where that is what `clamped`
    // holds, else `logprobs − (their value − clamped)`: the same gradient (1), a finite value.
    let shift: Vec<f32> = (0..n)
        .map(|i| {
            if clamped[i] == log_r[i] {
                x.sampler[i]
            } else {
                lp[i] - clamped[i]
            }
        })
        .collect();
    let sampler = Tensor::new(shift.as_slice(), dev)?;
    let ratio = (x.logprobs - &sampler)?.exp()?;
    let max_abs_log_ratio = clamped
        .iter()
        .zip(x.mask)
        .filter(|(_, m)| **m > 0.0)
        .map(|(l, _)| l.abs())
        .fold(0.0f32, f32::max);
    let m = LossMetrics {
        tokens,
        mismatch_kl,
        max_abs_log_ratio,
        ..Default::default()
    };
    Ok((
        Prepared {
            x,
            n,
            dev,
            r,
            clamped,
            denom,
            sampler,
            ratio,
        },
        m,
    ))
}

/// Double-sided masked IS: tokens whose ratio leaves `[low, high]` (and, with `seq_low`,
/// whole samples whose smallest ratio is below it) are dropped; optional `(log r)²` penalty.
fn masked_is(
    p: &Prepared<'_>,
    m: &mut LossMetrics,
    low: f32,
    high: f32,
    seq_low: Option<f32>,
    kl_tau: f32,
) -> Result<Tensor> {
    let mut keep: Vec<f32> = p.x.mask.to_vec();
    let (mut lo, mut hi) = (0f32, 0f32);
    for (i, k) in keep.iter_mut().enumerate() {
        if p.x.mask[i] == 0.0 {
            continue;
        }
        if p.r[i] < low {
            *k = 0.0;
            lo += 1.0;
        } else if p.r[i] > high {
            *k = 0.0;
            hi += 1.0;
        }
    }
    if let Some(seq_low) = seq_low {
        for &(s, len) in p.x.spans {
            let min = (s..s + len)
                .filter(|&i| p.x.mask[i] > 0.0)
                .map(|i| p.r[i])
                .fold(f32::INFINITY, f32::min);
            if min < seq_low {
                for k in keep[s..s + len].iter_mut().filter(|k| **k > 0.0) {
                    *k = 0.0;
                    lo += 1.0;
                }
            }
        }
    }
    m.masked_low = lo / p.denom;
    m.masked_high = hi / p.denom;
    let w: Vec<f32> = (0..p.n).map(|i| -keep[i] * p.x.advantages[i] / p.denom).collect();
    let mut loss = (&p.ratio * p.weights(w)?)?.sum_all()?;
    if kl_tau > 0.0 {
        let lr = (p.x.logprobs - &p.sampler)?;
        let mw: Vec<f32> = p.x.mask.iter().map(|mm| kl_tau * mm / p.denom).collect();
        loss = (loss + (lr.sqr()? * p.weights(mw)?)?.sum_all()?)?;
    }
    Ok(loss)
}

/// The PPO/GRPO clipped surrogate (DAPO with `eps_low != eps_high`).
fn clipped(p: &Prepared<'_>, m: &mut LossMetrics, eps_low: f32, eps_high: f32) -> Result<Tensor> {
    let (mut w, mut constant, mut clipped) = (vec![0f32; p.n], 0f32, 0f32);
    for (i, wi) in w.iter_mut().enumerate() {
        if p.x.mask[i] == 0.0 {
            continue;
        }
        let a = p.x.advantages[i];
        let ri = p.clamped[i].exp();
        let c = ri.clamp(1.0 - eps_low, 1.0 + eps_high);
        if c * a < ri * a {
            // The clipped branch is the minimum: it is constant in θ.
            constant -= c * a / p.denom;
            clipped += 1.0;
        } else {
            *wi = -a / p.denom;
        }
    }
    m.clip_fraction = clipped / p.denom;
    Ok(((&p.ratio * p.weights(w)?)?.sum_all()? + constant as f64)?)
}

/// GSPO: the clipped surrogate on each sequence's geometric-mean ratio.
fn gspo(p: &Prepared<'_>, m: &mut LossMetrics, eps_low: f32, eps_high: f32) -> Result<Tensor> {
    // s_i = exp(Σ_t m·log r / Σ_t m) via a (sequences × tokens) averaging matrix.
    let seqs: Vec<&(usize, usize)> =
        p.x.spans
            .iter()
            .filter(|&&(s, l)| (s..s + l).any(|i| p.x.mask[i] > 0.0))
            .collect();
    if seqs.is_empty() {
        Ok((p.x.logprobs.sum_all()? * 0.0)?)
    } else {
        let k = seqs.len();
        let mut avg = vec![0f32; k * p.n];
        let mut adv = vec![0f32; k];
        for (j, &&(s, l)) in seqs.iter().enumerate() {
            let cnt: f32 = p.x.mask[s..s + l].iter().sum();
            for i in s..s + l {
                avg[j * p.n + i] = p.x.mask[i] / cnt;
            }
            adv[j] = (s..s + l)
                .find(|&i| p.x.mask[i] > 0.0)
                .map(|i| p.x.advantages[i])
                .unwrap_or(0.0);
        }
        let lr = (p.x.logprobs - &p.sampler)?.unsqueeze(1)?;
        let seq_log = Tensor::from_vec(avg, (k, p.n), p.dev)?.matmul(&lr)?.squeeze(1)?;
        let s = seq_log.exp()?;
        let sv = s.to_vec1::<f32>()?;
        let (mut w, mut constant, mut clipped) = (vec![0f32; k], 0f32, 0f32);
        for j in 0..k {
            let c = sv[j].clamp(1.0 - eps_low, 1.0 + eps_high);
            if c * adv[j] < sv[j] * adv[j] {
                constant -= c * adv[j] / k as f32;
                clipped += 1.0;
            } else {
                w[j] = -adv[j] / k as f32;
            }
        }
        m.clip_fraction = clipped / k as f32;
        Ok(((s * p.weights(w)?)?.sum_all()? + constant as f64)?)
    }
}

/// Truncated IS: policy gradient weighted by a detached `min(r, cap)`.
fn tis(p: &Prepared<'_>, cap: f32) -> Result<Tensor> {
    let w: Vec<f32> = (0..p.n)
        .map(|i| {
            if p.x.mask[i] > 0.0 {
                -p.x.mask[i] * p.r[i].min(cap) * p.x.advantages[i] / p.denom
            } else {
                0.0
            }
        })
        .collect();
    Ok((p.x.logprobs * p.weights(w)?)?.sum_all()?)
}

/// Supervised cross-entropy on trainable tokens.
fn sft(p: &Prepared<'_>) -> Result<Tensor> {
    let w: Vec<f32> = p.x.mask.iter().map(|mm| -mm / p.denom).collect();
    Ok((p.x.logprobs * p.weights(w)?)?.sum_all()?)
}

#[cfg(test)]
mod tests {

    #[test]
    fn loss_kinds_read_from_configuration_with_defaults() {
        let k: LossKind = serde_json::from_str(r#"{"kind": "masked_is"}"#).unwrap();
        assert_eq!(k, LossKind::default());
        let k: LossKind = serde_json::from_str(r#"{"kind": "masked_is", "high": 4.0, "seq_low": 0.1}"#).unwrap();
        assert_eq!(
            k,
            LossKind::MaskedIs {
                low: 0.5,
                high: 4.0,
                seq_low: Some(0.1),
                kl_tau: 0.0
            }
        );
        let k: LossKind = serde_json::from_str(r#"{"kind": "clipped", "eps_low": 0.2, "eps_high": 0.28}"#).unwrap();
        assert_eq!(
            k,
            LossKind::Clipped {
                eps_low: 0.2,
                eps_high: 0.28
            }
        );
        let e = serde_json::from_str::<LossKind>(r#"{"kind": "tis", "cap": 2.0, "clip": 1}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `clip`"), "{e}");
        assert!(serde_json::from_str::<LossKind>(r#"{"kind": "ppo"}"#).is_err());
    }

    use super::*;
    use candle_core::{Device, Var};

    fn run(
        kind: LossKind,
        lp: &[f32],
        mu: &[f32],
        adv: &[f32],
        mask: &[f32],
        spans: &[(usize, usize)],
    ) -> (LossMetrics, Vec<f32>) {
        let v = Var::new(lp, &Device::Cpu).unwrap();
        let (loss, m) = compute(
            kind,
            LossInputs {
                logprobs: v.as_tensor(),
                sampler: mu,
                advantages: adv,
                mask,
                spans,
            },
        )
        .unwrap();
        let g = loss.backward().unwrap();
        (m, g.get(&v).unwrap().to_vec1::<f32>().unwrap())
    }

    /// Loss, metrics and gradient of `f` on one set of inputs.
    fn eval(
        f: impl Fn(LossInputs<'_>) -> Result<(Tensor, LossMetrics)>,
        lp: &[f32],
        mu: &[f32],
        adv: &[f32],
        mask: &[f32],
    ) -> (LossMetrics, Vec<f32>) {
        let v = Var::new(lp, &Device::Cpu).unwrap();
        let spans = [(0, lp.len())];
        let inputs = LossInputs {
            logprobs: v.as_tensor(),
            sampler: mu,
            advantages: adv,
            mask,
            spans: &spans,
        };
        let (loss, m) = f(inputs).unwrap();
        assert_eq!(loss.to_scalar::<f32>().unwrap(), m.loss);
        let g = loss.backward().unwrap();
        (m, g.get(&v).unwrap().to_vec1::<f32>().unwrap())
    }

    /// The fused masked IS loss against the op-by-op one: ordinary ratios, ratios beyond
    /// both bounds and beyond the clamp, −∞ sampler logprobs, fractional and all-zero
    /// masks, with and without the KL penalty.
    #[test]
    fn fused_masked_is_equals_the_op_by_op_loss() {
        let mut seed = 7u64;
        let mut rnd = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        for case in 0..12 {
            let n = 37 + case * 5;
            let lp: Vec<f32> = (0..n).map(|_| -8.0 * rnd()).collect();
            let mu: Vec<f32> = lp
                .iter()
                .enumerate()
                .map(|(i, l)| match i % 9 {
                    0 => l + 3.0,  // ratio e^-3: below low
                    1 => l - 2.5,  // ratio e^2.5: above high
                    2 => l - 30.0, // beyond the clamp
                    3 => f32::NEG_INFINITY,
                    _ => l + 0.6 * (rnd() - 0.5),
                })
                .collect();
            let adv: Vec<f32> = (0..n).map(|_| 2.0 * rnd() - 1.0).collect();
            let mask: Vec<f32> = (0..n)
                .map(|i| match (case, i % 7) {
                    (11, _) => 0.0,
                    (_, 0) => 0.0,
                    (_, 1) if case % 2 == 1 => 0.5,
                    _ => 1.0,
                })
                .collect();
            let kl_tau = if case % 3 == 0 { 0.1 } else { 0.0 };
            let kind = LossKind::MaskedIs {
                low: 0.5,
                high: 5.0,
                seq_low: None,
                kl_tau,
            };
            let (mf, gf) = eval(|x| masked_is_fused(x, 0.5, 5.0, kl_tau), &lp, &mu, &adv, &mask);
            let (mr, gr) = eval(|x| compute_op_by_op(kind, x), &lp, &mu, &adv, &mask);
            let near = |a: f32, b: f32| (a - b).abs() <= 1e-5 * (1.0 + a.abs().max(b.abs()));
            for (what, a, b) in [
                ("loss", mf.loss, mr.loss),
                ("tokens", mf.tokens, mr.tokens),
                ("masked_low", mf.masked_low, mr.masked_low),
                ("masked_high", mf.masked_high, mr.masked_high),
                ("mismatch_kl", mf.mismatch_kl, mr.mismatch_kl),
                ("max_abs_log_ratio", mf.max_abs_log_ratio, mr.max_abs_log_ratio),
            ] {
                assert!(near(a, b), "case {case}: {what} fused {a} op-by-op {b}");
            }
            for (i, (a, b)) in gf.iter().zip(&gr).enumerate() {
                assert!(near(*a, *b), "case {case}: gradient[{i}] fused {a} op-by-op {b}");
            }
            if case == 11 {
                assert_eq!((mf.loss, mf.tokens), (0.0, 0.0));
                assert!(gf.iter().all(|g| *g == 0.0));
            } else {
                assert!(mf.masked_low > 0.0 && mf.masked_high > 0.0, "case {case}: {mf:?}");
            }
        }
    }

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-5 * (1.0 + b.abs())
    }

    #[test]
    fn masked_is_by_hand() {
        // ratios: e^0 = 1, e^ln0.4 = 0.4 (below 0.5: masked low), e^ln6 = 6 (masked high),
        // e^ln2 = 2; the 5th token is not trainable but counts in nothing.
        let mu = [0.0, 0.0, 0.0, 0.0, 0.0];
        let lp = [0.0, 0.4f32.ln(), 6f32.ln(), 2f32.ln(), 1.0];
        let adv = [1.0, 1.0, 1.0, -0.5, 3.0];
        let mask = [1.0, 1.0, 1.0, 1.0, 0.0];
        let (m, g) = run(LossKind::default(), &lp, &mu, &adv, &mask, &[(0, 5)]);
        // L = −(1·1 + 2·(−0.5)) / 4 = 0
        assert!(close(m.loss, 0.0), "{m:?}");
        assert!(close(m.masked_low, 0.25) && close(m.masked_high, 0.25));
        // ∂L/∂lp_i = −keep·r·A/4
        let want = [-0.25, 0.0, 0.0, 0.25, 0.0];
        assert!(g.iter().zip(want).all(|(a, b)| close(*a, b)), "{g:?}");
        // mismatch KL = mean(r − ln r − 1) over the 4 trainable tokens
        let kl =
            ((1.0 - 0.0 - 1.0) + (0.4 - 0.4f32.ln() - 1.0) + (6.0 - 6f32.ln() - 1.0) + (2.0 - 2f32.ln() - 1.0)) / 4.0;
        assert!(close(m.mismatch_kl, kl), "{} vs {kl}", m.mismatch_kl);
    }

    #[test]
    fn masked_is_sequence_mask_and_kl_penalty() {
        let lp = [0.0, 0.3f32.ln(), 0.0, 0.0];
        let mu = [0.0; 4];
        let adv = [1.0; 4];
        let mask = [1.0; 4];
        // Sample 0 (tokens 0-1) has min ratio 0.3 < 0.4 → dropped whole.
        let kind = LossKind::MaskedIs {
            low: 0.2,
            high: 5.0,
            seq_low: Some(0.4),
            kl_tau: 0.5,
        };
        let (m, g) = run(kind, &lp, &mu, &adv, &mask, &[(0, 2), (2, 2)]);
        // L = −(1 + 1)/4 + 0.5·(ln 0.3)²/4
        let want = -0.5 + 0.5 * 0.3f32.ln().powi(2) / 4.0;
        assert!(close(m.loss, want), "{} vs {want}", m.loss);
        assert!(close(m.masked_low, 0.5));
        // token 1: only the penalty: 2·0.5·ln0.3/4
        assert!(close(g[1], 0.3f32.ln() / 4.0), "{g:?}");
        assert!(close(g[2], -0.25) && close(g[0], 0.0), "{g:?}");
    }

    #[test]
    fn clipped_surrogate_by_hand() {
        // r = 1.5 with A = 1: clipped at 1.2 (constant); r = 0.5 with A = −1: clipped at 0.8;
        // r = 1.1 with A = 1: unclipped.
        let lp = [1.5f32.ln(), 0.5f32.ln(), 1.1f32.ln()];
        let (m, g) = run(
            LossKind::Clipped {
                eps_low: 0.2,
                eps_high: 0.2,
            },
            &lp,
            &[0.0; 3],
            &[1.0, -1.0, 1.0],
            &[1.0; 3],
            &[(0, 3)],
        );
        let want = -(1.2 - 0.8 + 1.1) / 3.0;
        assert!(close(m.loss, want), "{} vs {want}", m.loss);
        assert!(close(m.clip_fraction, 2.0 / 3.0));
        assert!(close(g[0], 0.0) && close(g[1], 0.0) && close(g[2], -1.1 / 3.0), "{g:?}");
        // DAPO's clip-higher: eps_high 0.6 lets r = 1.5 through.
        let (m, _) = run(
            LossKind::Clipped {
                eps_low: 0.2,
                eps_high: 0.6,
            },
            &lp,
            &[0.0; 3],
            &[1.0, -1.0, 1.0],
            &[1.0; 3],
            &[(0, 3)],
        );
        assert!(close(m.clip_fraction, 1.0 / 3.0));
    }

    #[test]
    fn gspo_uses_the_geometric_mean_ratio() {
        // Sample 0: token ratios 2 and 0.5 → s = 1; sample 1: ratio 1.5 (one token) → clipped to 1.2.
        let lp = [2f32.ln(), 0.5f32.ln(), 1.5f32.ln()];
        let (m, g) = run(
            LossKind::Gspo {
                eps_low: 0.2,
                eps_high: 0.2,
            },
            &lp,
            &[0.0; 3],
            &[1.0, 1.0, 2.0],
            &[1.0; 3],
            &[(0, 2), (2, 1)],
        );
        let want = -(1.0 * 1.0 + 1.2 * 2.0) / 2.0;
        assert!(close(m.loss, want), "{} vs {want}", m.loss);
        assert!(close(m.clip_fraction, 0.5));
        // ∂/∂lp_t of −s·A/2 with s = exp(mean log r): −s·A/(2·len)
        assert!(close(g[0], -0.25) && close(g[1], -0.25) && close(g[2], 0.0), "{g:?}");
    }

    #[test]
    fn tis_and_sft_by_hand() {
        let lp = [3f32.ln(), 0.5f32.ln()];
        let (m, g) = run(
            LossKind::Tis { cap: 2.0 },
            &lp,
            &[0.0; 2],
            &[1.0, 1.0],
            &[1.0, 1.0],
            &[(0, 2)],
        );
        // L = −(2·ln3 + 0.5·ln0.5)/2 ; ∂ = −min(r,2)·A/2
        assert!(close(m.loss, -(2.0 * 3f32.ln() + 0.5 * 0.5f32.ln()) / 2.0));
        assert!(close(g[0], -1.0) && close(g[1], -0.25), "{g:?}");
        let (m, g) = run(
            LossKind::Sft,
            &[-1.0, -2.0, -4.0],
            &[0.0; 3],
            &[0.0; 3],
            &[1.0, 0.0, 1.0],
            &[(0, 3)],
        );
        assert!(close(m.loss, 2.5) && close(m.tokens, 2.0));
        assert!(close(g[0], -0.5) && close(g[1], 0.0) && close(g[2], -0.5), "{g:?}");
    }

    fn every_kind() -> Vec<LossKind> {
        vec![
            LossKind::default(),
            LossKind::MaskedIs {
                low: 0.5,
                high: 5.0,
                seq_low: Some(0.1),
                kl_tau: 0.1,
            },
            LossKind::Clipped {
                eps_low: 0.2,
                eps_high: 0.28,
            },
            LossKind::Gspo {
                eps_low: 3e-4,
                eps_high: 4e-4,
            },
            LossKind::Tis { cap: 2.0 },
            LossKind::Sft,
        ]
    }

    #[test]
    fn every_kind_is_finite_for_extreme_and_infinite_ratios() {
        // log-ratios of +100 (e^100 overflows f32), −100, +∞ (a −∞ sampler logprob), each
        // on a trainable and on a masked token, next to ordinary ones, with both signs of
        // advantage.
        let lp = [-0.5, -0.5, -120.0, -120.0, -1.0, -1.0, -2.0, -0.1];
        let mu = [
            -100.5,
            -100.5,
            -20.0,
            -20.0,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            -2.1,
            -0.1,
        ];
        let mask = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0];
        for adv in [[1.0f32; 8], [-1.0; 8], [3.0, -2.0, 1.0, -1.0, 0.5, 2.0, -0.5, 1.0]] {
            for kind in every_kind() {
                let (m, g) = run(kind, &lp, &mu, &adv, &mask, &[(0, 4), (4, 4)]);
                let what = format!("{kind:?} with advantages {adv:?}");
                assert!(m.loss.is_finite(), "{what}: loss {}", m.loss);
                for (name, v) in [
                    ("masked_low", m.masked_low),
                    ("masked_high", m.masked_high),
                    ("mismatch_kl", m.mismatch_kl),
                    ("clip_fraction", m.clip_fraction),
                ] {
                    assert!(v.is_finite(), "{what}: {name} {v}");
                }
                assert!(g.iter().all(|v| v.is_finite()), "{what}: gradient {g:?}");
                for i in [1, 3, 5] {
                    assert_eq!(g[i], 0.0, "{what}: masked token {i} got gradient {}", g[i]);
                }
                if let LossKind::MaskedIs { .. } = kind {
                    // +100, +∞ above high; −100 below low: 3 of the 5 trainable tokens.
                    assert!(
                        close(m.masked_high, 2.0 / 5.0) && close(m.masked_low, 1.0 / 5.0),
                        "{what}: {m:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn ordinary_ratios_are_unchanged_by_the_guard() {
        // Within ±MAX_LOG_RATIO the objective is the textbook one: r·A on kept tokens.
        let lp = [0.3f32.ln(), 1.0f32.ln(), 3.0f32.ln()];
        let (m, g) = run(
            LossKind::Tis { cap: 10.0 },
            &lp,
            &[0.0; 3],
            &[1.0; 3],
            &[1.0; 3],
            &[(0, 3)],
        );
        assert!(close(
            m.mismatch_kl,
            ((0.3 - 0.3f32.ln() - 1.0) + 0.0 + (3.0 - 3f32.ln() - 1.0)) / 3.0
        ));
        assert!(close(g[2], -1.0), "{g:?}");
    }

    #[test]
    fn nan_and_infinite_inputs_are_named() {
        let v = Var::new(&[0f32, 0.0][..], &Device::Cpu).unwrap();
        let call = |sampler: &[f32], adv: &[f32], mask: &[f32]| {
            compute(
                LossKind::default(),
                LossInputs {
                    logprobs: v.as_tensor(),
                    sampler,
                    advantages: adv,
                    mask,
                    spans: &[(0, 2)],
                },
            )
            .unwrap_err()
            .to_string()
        };
        let e = call(&[0.0, f32::NAN], &[1.0, 1.0], &[1.0, 1.0]);
        assert!(e.contains("`sampler`[1] is NaN"), "{e}");
        let e = call(&[f32::INFINITY, 0.0], &[1.0, 1.0], &[1.0, 1.0]);
        assert!(e.contains("`sampler`[0] is inf"), "{e}");
        let e = call(&[0.0, 0.0], &[1.0, f32::NEG_INFINITY], &[1.0, 1.0]);
        assert!(e.contains("`advantages`[1] is -inf"), "{e}");
        let e = call(&[0.0, 0.0], &[1.0, 1.0], &[f32::NAN, 1.0]);
        assert!(e.contains("`mask`[0] is NaN"), "{e}");
    }

    #[test]
    fn mismatched_lengths_are_named() {
        let v = Var::new(&[0f32, 0.0][..], &Device::Cpu).unwrap();
        let e = compute(
            LossKind::Sft,
            LossInputs {
                logprobs: v.as_tensor(),
                sampler: &[0.0],
                advantages: &[0.0, 0.0],
                mask: &[1.0, 1.0],
                spans: &[],
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("sampler") && e.contains("1 values for 2"), "{e}");
    }
}

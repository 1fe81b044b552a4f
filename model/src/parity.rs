//! Parity of the fused RL kernels with their references, on any device: the selective
//! log-softmax (logprobs, entropy and the logits' gradient) against an f64 host reference,
//! the fused masked IS loss (value, metrics, gradient) against the op-by-op loss, and the
//! fused AdamW against AdamW op by op. On the CPU this checks the CPU kernels; on a CUDA
//! device (a `cuda` build) the CUDA twins. Cases include a vocabulary that is not a
//! multiple of any vector width, a 50k vocabulary, extreme and −∞ logits, all-masked
//! tokens and ratios beyond the masks and the clamp.
//!
//! ```
//! let checks = streamrl_model::parity::run(&candle_core::Device::Cpu).unwrap();
//! assert!(checks.iter().all(|c| c.ok()), "{checks:#?}");
//! ```

use candle_core::{DType, Device, Tensor, Var};

use crate::Result;
use crate::loss::{self, LossInputs, LossKind};

/// One comparison: the largest error of the values and of the gradients, relative to
/// `1 + |reference|`, and the bound they must stay under.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    /// Kernel.
    pub kernel: &'static str,
    /// Inputs.
    pub case: String,
    /// Largest relative error of the outputs.
    pub value_err: f64,
    /// Largest relative error of the gradients.
    pub grad_err: f64,
    /// The bound.
    pub tol: f64,
}

impl Check {
    /// Whether both errors are within the bound (and not NaN).
    pub fn ok(&self) -> bool {
        self.value_err <= self.tol && self.grad_err <= self.tol
    }
}

/// A deterministic pseudo-random stream in [0, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    fn normal(&mut self) -> f32 {
        let (u, v) = (self.next().max(1e-7), self.next());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}

/// Largest `|a − b| / (1 + |b|)`; NaN anywhere, or an infinity that is not matched, is
/// infinite error.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            let x = x as f64;
            if x == y {
                0.0
            } else if x.is_nan() || y.is_nan() || x.is_infinite() || y.is_infinite() {
                f64::INFINITY
            } else {
                (x - y).abs() / (1.0 + y.abs())
            }
        })
        .fold(0.0, f64::max)
}

/// Runs every check on `device`.
pub fn run(device: &Device) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    for (case, b, t, v, temp, scale, neg_inf) in [
        ("2×6 positions, V 37, T 1", 2, 6, 37, 1.0, 3.0, false),
        ("1×5, V 1000, T 0.7", 1, 5, 1000, 0.7, 3.0, false),
        ("1×4, V 50007, T 1", 1, 4, 50_007, 1.0, 3.0, false),
        ("2×3, V 129, logits ±1e3 and −∞", 2, 3, 129, 1.0, 1e3, true),
    ] {
        out.push(logprobs_check(device, case, b, t, v, temp, scale, neg_inf)?);
    }
    for case in 0..3 {
        out.push(masked_is_check(device, case)?);
    }
    out.push(adamw_check(device)?);
    Ok(out)
}

/// The selective log-softmax on `device` against an f64 host computation.
#[allow(clippy::too_many_arguments)]
fn logprobs_check(
    device: &Device,
    case: &str,
    b: usize,
    t: usize,
    v: usize,
    temp: f64,
    scale: f32,
    neg_inf: bool,
) -> Result<Check> {
    let mut rng = Lcg(v as u64 * 31 + t as u64);
    let mut logits: Vec<f32> = (0..b * t * v).map(|_| scale * rng.normal()).collect();
    let tokens: Vec<u32> = (0..b * t).map(|_| (rng.next() * v as f32) as u32 % v as u32).collect();
    if neg_inf {
        // Every third entry of every row is −∞ (never the token itself).
        for (r, row) in logits.chunks_mut(v).enumerate() {
            let keep = tokens.get(r + 1).copied().unwrap_or(0) as usize;
            for (j, x) in row.iter_mut().enumerate() {
                if j % 3 == 1 && j != keep {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
    }
    let w: Vec<f32> = (0..b * t)
        .map(|i| if i % 4 == 3 { 0.0 } else { rng.normal() })
        .collect();
    // Reference: lp, entropy and d(Σ w·lp)/dlogits in f64.
    let (mut lp_ref, mut ent_ref) = (vec![0f64; b * t], vec![0f64; b * t]);
    let mut grad_ref = vec![0f64; b * t * v];
    for r in 0..b * t {
        if r % t + 1 == t {
            continue;
        }
        let row = &logits[r * v..(r + 1) * v];
        let z: Vec<f64> = row.iter().map(|&x| x as f64 / temp).collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = z.iter().map(|&x| (x - m).exp()).sum();
        let lse = m + s.ln();
        let tok = tokens[r + 1] as usize;
        lp_ref[r + 1] = z[tok] - lse;
        ent_ref[r + 1] = -z
            .iter()
            .map(|&x| {
                let p = (x - lse).exp();
                if p > 0.0 { p * (x - lse) } else { 0.0 }
            })
            .sum::<f64>();
        let g = w[r + 1] as f64 / temp;
        for j in 0..v {
            let p = (z[j] - lse).exp();
            grad_ref[r * v + j] = g * (if j == tok { 1.0 } else { 0.0 } - p);
        }
    }
    let lx = Var::from_tensor(&Tensor::from_vec(logits, (b, t, v), device)?)?;
    let toks = Tensor::from_vec(tokens, (b, t), device)?;
    let (lp, ent) = crate::token_logprobs_entropy(lx.as_tensor(), &toks, temp)?;
    let wt = Tensor::from_vec(w, (b, t), device)?;
    let grads = (&lp * &wt)?.sum_all()?.backward()?;
    let g = grads
        .get(lx.as_tensor())
        .ok_or_else(|| crate::Error::Shape("selective log-softmax: no gradient reached the logits".into()))?;
    let host = |x: &Tensor| -> Result<Vec<f32>> { Ok(x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?) };
    let value_err = rel_err(&host(&lp)?, &lp_ref).max(rel_err(&host(&ent)?, &ent_ref));
    Ok(Check {
        kernel: "selective log-softmax + entropy",
        case: case.into(),
        value_err,
        grad_err: rel_err(&host(g)?, &grad_ref),
        tol: 1e-4,
    })
}

/// The fused masked IS loss on `device` against the op-by-op loss on the CPU.
fn masked_is_check(device: &Device, case: usize) -> Result<Check> {
    let n = [1000, 4099, 64][case];
    let mut rng = Lcg(case as u64 + 5);
    let lp: Vec<f32> = (0..n).map(|_| -6.0 * rng.next()).collect();
    let sampler: Vec<f32> = lp
        .iter()
        .enumerate()
        .map(|(i, l)| match i % 11 {
            0 => l + 2.0,
            1 => l - 3.0,
            2 => l - 40.0,
            3 => f32::NEG_INFINITY,
            _ => l + 0.5 * (rng.next() - 0.5),
        })
        .collect();
    let adv: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    let mask: Vec<f32> = (0..n)
        .map(|i| if case == 2 || i % 5 == 0 { 0.0 } else { 1.0 })
        .collect();
    let (low, high, kl_tau) = (0.5, 5.0, if case == 1 { 0.05 } else { 0.0 });
    let spans = [(0, n)];
    let run = |dev: &Device, fused: bool| -> Result<(loss::LossMetrics, Vec<f32>)> {
        let v = Var::from_tensor(&Tensor::new(lp.as_slice(), dev)?)?;
        let x = LossInputs {
            logprobs: v.as_tensor(),
            sampler: &sampler,
            advantages: &adv,
            mask: &mask,
            spans: &spans,
        };
        let (l, m) = if fused {
            loss::masked_is_fused(x, low, high, kl_tau)?
        } else {
            loss::compute_op_by_op(
                LossKind::MaskedIs {
                    low,
                    high,
                    seq_low: None,
                    kl_tau,
                },
                x,
            )?
        };
        let g = l.backward()?;
        let g = g
            .get(v.as_tensor())
            .ok_or_else(|| crate::Error::Shape("masked IS: no gradient reached the logprobs".into()))?
            .to_vec1::<f32>()?;
        Ok((m, g))
    };
    let (mf, gf) = run(device, true)?;
    let (mr, gr) = run(&Device::Cpu, false)?;
    let metrics = |m: &loss::LossMetrics| {
        vec![
            m.loss,
            m.tokens,
            m.masked_low,
            m.masked_high,
            m.mismatch_kl,
            m.max_abs_log_ratio,
        ]
    };
    let as64 = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
    Ok(Check {
        kernel: "masked IS loss",
        case: format!(
            "{n} tokens{}",
            match case {
                1 => ", KL penalty 0.05",
                2 => ", all masked",
                _ => "",
            }
        ),
        value_err: rel_err(&metrics(&mf), &as64(metrics(&mr))),
        grad_err: rel_err(&gf, &as64(gr)),
        tol: 1e-5,
    })
}

/// One fused AdamW step on `device` against AdamW op by op on the CPU (two steps, so
/// that the moments carry over).
fn adamw_check(device: &Device) -> Result<Check> {
    use crate::optim::{Optimizer, OptimizerConfig};
    let n = 3001;
    let mut rng = Lcg(11);
    let theta: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    let grads: Vec<Vec<f32>> = (0..2).map(|_| (0..n).map(|_| rng.normal()).collect()).collect();
    let step = |dev: &Device, naive: bool| -> Result<Vec<f32>> {
        let vars = candle_nn::VarMap::new();
        let w = vars.get(n, "w", candle_nn::Init::Const(0.0), DType::F32, dev)?;
        let var = vars.all_vars().into_iter().next().expect("one variable");
        var.set(&Tensor::new(theta.as_slice(), dev)?)?;
        let mut opt = Optimizer::new(
            &vars,
            OptimizerConfig {
                max_grad_norm: 0.0,
                weight_decay: 0.1,
                ..Default::default()
            },
        )?;
        if naive {
            opt.force_op_by_op()?;
        }
        for g in &grads {
            let loss = (&w * Tensor::new(g.as_slice(), dev)?)?.sum_all()?;
            opt.step(&loss.backward()?, 1e-2)?;
        }
        Ok(w.to_device(&Device::Cpu)?.to_vec1::<f32>()?)
    };
    let got = step(device, false)?;
    let want: Vec<f64> = step(&Device::Cpu, true)?.into_iter().map(f64::from).collect();
    Ok(Check {
        kernel: "AdamW",
        case: format!("{n} parameters, 2 steps, weight decay 0.1"),
        value_err: rel_err(&got, &want),
        grad_err: 0.0,
        tol: 1e-6,
    })
}

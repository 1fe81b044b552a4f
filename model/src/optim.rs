//! Optimizers: a fused in-place AdamW (numerically candle's AdamW, without its ~10
//! temporaries per parameter; on the CPU, and as a CUDA kernel with the `cuda` feature),
//! Muon (Newton–Schulz orthogonalised momentum) for 2-D hidden matrices with AdamW for the
//! rest, global gradient-norm clipping, learning-rate schedules, and optimizer state that
//! saves and restores exactly. Parameters that are not f32 (bf16) are updated through an
//! f32 master copy the optimizer keeps (and saves), with f32 moments.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor, Var};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};
use streamrl_kernels::train;

use crate::{Error, Result};

/// Which optimizer updates the 2-D hidden matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// AdamW for every parameter.
    Adamw,
    /// Muon for 2-D hidden matrices, AdamW for embeddings, head, norms and biases.
    Muon,
}

/// Optimizer hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// adamw or muon.
    pub kind: OptimizerKind,
    /// AdamW β1.
    pub beta1: f64,
    /// AdamW β2.
    pub beta2: f64,
    /// AdamW ε.
    pub eps: f64,
    /// Decoupled weight decay (both optimizers).
    pub weight_decay: f64,
    /// Muon momentum (Nesterov).
    pub muon_momentum: f64,
    /// Newton–Schulz iterations.
    pub ns_steps: usize,
    /// Global gradient-norm clip (0: off).
    pub max_grad_norm: f64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Adamw,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            muon_momentum: 0.95,
            ns_steps: 5,
            max_grad_norm: 1.0,
        }
    }
}

/// A learning-rate schedule.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LrSchedule {
    /// The same rate every step.
    Constant {
        /// Rate.
        lr: f64,
    },
    /// Linear warmup to `peak`, then cosine decay to `min` at `total` steps.
    WarmupCosine {
        /// Peak rate.
        peak: f64,
        /// Warmup steps.
        warmup: u64,
        /// Steps at which the decay ends.
        total: u64,
        /// Final rate.
        min: f64,
    },
}

impl LrSchedule {
    /// The rate for step `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine {
                peak,
                warmup,
                total,
                min,
            } => {
                if step < warmup {
                    peak * (step + 1) as f64 / warmup as f64
                } else if step >= total {
                    min
                } else {
                    let p = (step - warmup) as f64 / (total - warmup).max(1) as f64;
                    min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * p).cos())
                }
            }
        }
    }
}

/// One fused AdamW update of a contiguous f32 parameter, in place
/// (`streamrl_kernels::train::adamw`).
struct AdamWStep<'a> {
    grad: &'a [f32],
    m: Mutex<&'a mut [f32]>,
    v: Mutex<&'a mut [f32]>,
    h: train::AdamW,
}

impl InplaceOp1 for AdamWStep<'_> {
    fn name(&self) -> &'static str {
        "fused-adamw"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(data) = storage else {
            return Err(candle_core::Error::Msg("fused AdamW needs f32 parameters".into()));
        };
        if !layout.is_contiguous() {
            return Err(candle_core::Error::Msg(
                "fused AdamW needs a contiguous parameter".into(),
            ));
        }
        let theta = &mut data[layout.start_offset()..layout.start_offset() + self.grad.len()];
        let mut m = self.m.lock().map_err(|_| candle_core::Error::Msg("poisoned".into()))?;
        let mut v = self.v.lock().map_err(|_| candle_core::Error::Msg("poisoned".into()))?;
        train::adamw(theta, self.grad, &mut m, &mut v, self.h);
        Ok(())
    }
}

#[derive(Debug)]
enum State {
    /// AdamW moments on the host, updated by the fused CPU kernel (CPU parameters).
    AdamW {
        m: Vec<f32>,
        v: Vec<f32>,
    },
    /// AdamW moments on the parameter's device, updated op by op (CUDA parameters).
    AdamWOps {
        m: Tensor,
        v: Tensor,
    },
    Muon {
        momentum: Tensor,
    },
}

#[derive(Debug)]
struct Param {
    name: String,
    var: Var,
    /// The f32 master copy of a parameter that is not f32 (bf16): the update runs on it,
    /// and the parameter receives it rounded.
    master: Option<Tensor>,
    state: State,
}

impl Param {
    /// What the update runs on: the master copy, or the (f32) parameter itself.
    fn theta(&self) -> &Tensor {
        self.master.as_ref().unwrap_or(self.var.as_tensor())
    }

    /// Makes `next` (f32) the parameter's value.
    fn set(&mut self, next: Tensor) -> Result<()> {
        match &mut self.master {
            Some(m) => {
                self.var.set(&next.to_dtype(self.var.dtype())?)?;
                *m = next;
            }
            None => self.var.set(&next)?,
        }
        Ok(())
    }

    /// After an in-place update of the master copy, rounds it into the parameter.
    fn sync_from_master(&self) -> Result<()> {
        if let Some(m) = &self.master {
            self.var.set(&m.to_dtype(self.var.dtype())?)?;
        }
        Ok(())
    }

    /// One update of this parameter with gradient `g` (its AdamW hyper-parameters `h`,
    /// which carry the clip factor; Muon reads momentum and Newton–Schulz steps from
    /// `cfg`).
    fn update(&mut self, g: Tensor, h: train::AdamW, cfg: &OptimizerConfig, lr: f64) -> Result<()> {
        match &mut self.state {
            State::AdamW { m, v } => {
                crate::fused::with(&g, "gradient", |g| {
                    let op = AdamWStep {
                        grad: g,
                        m: Mutex::new(m.as_mut_slice()),
                        v: Mutex::new(v.as_mut_slice()),
                        h,
                    };
                    self.master.as_ref().unwrap_or(self.var.as_tensor()).inplace_op1(&op)
                })?;
                self.sync_from_master()
            }
            State::AdamWOps { m, v } => {
                let theta = self.master.as_ref().unwrap_or(self.var.as_tensor());
                #[cfg(feature = "cuda")]
                if theta.device().is_cuda() {
                    // The fused CUDA kernel, in place.
                    crate::cuda::adamw(theta, &g, m, v, h)?;
                    return self.sync_from_master();
                }
                let (next, nm, nv) = adamw_ops(theta, &g, m, v, h)?;
                (*m, *v) = (nm, nv);
                self.set(next)
            }
            State::Muon { momentum } => {
                let g = if h.clip != 1.0 { (g * h.clip as f64)? } else { g };
                let mu = cfg.muon_momentum;
                let buf = ((&*momentum * mu)? + &g)?;
                let nesterov = (g + (&buf * mu)?)?;
                *momentum = buf;
                let o = newton_schulz(&nesterov, cfg.ns_steps)?;
                let (r, c) = self.var.as_tensor().dims2()?;
                // Scaled to AdamW's update RMS (Moonlight), so one lr serves both.
                let scale = 0.2 * (r.max(c) as f64).sqrt();
                let next = ((self.theta() * (1.0 - lr * cfg.weight_decay))? - (o * (lr * scale))?)?;
                self.set(next)
            }
        }
    }
}

/// Σ g² in f64 of a contiguous f32 gradient, where it lies.
fn sum_sq(g: &Tensor) -> Result<f64> {
    if g.device().is_cpu() {
        crate::fused::with(g, "gradient", |v| Ok(train::sum_sq_f64(v))).map_err(Into::into)
    } else {
        Ok(g.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?)
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Parameters without a gradient this step (should be 0 for a full model).
    pub missing_grads: usize,
    /// The gradient norm was not finite (a NaN or inf gradient): no parameter and no
    /// moment was touched, and the step was not counted.
    pub skipped: bool,
}

/// AdamW or Muon+AdamW over every variable of a [`VarMap`].
#[derive(Debug)]
pub struct Optimizer {
    cfg: OptimizerConfig,
    params: Vec<Param>,
    step: u64,
}

/// Whether Muon updates this parameter: 2-D hidden matrices, not embeddings or the head.
pub fn muon_eligible(name: &str, var: &Var) -> bool {
    var.rank() == 2 && !name.contains("embed_tokens") && !name.contains("lm_head")
}

impl Optimizer {
    /// An optimizer over `vars` (sorted by name, so state files are stable).
    pub fn new(vars: &VarMap, cfg: OptimizerConfig) -> Result<Self> {
        let data = vars
            .data()
            .lock()
            .map_err(|_| Error::Shape("var map lock poisoned".into()))?;
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        let mut params = Vec::new();
        for name in names {
            let var = data[name].clone();
            let master = match var.dtype() {
                DType::F32 => None,
                DType::BF16 | DType::F16 => Some(var.to_dtype(DType::F32)?),
                other => {
                    return Err(Error::Shape(format!(
                        "parameter `{name}` is {other:?}; the optimizers train f32, bf16 and f16"
                    )));
                }
            };
            let state = if cfg.kind == OptimizerKind::Muon && muon_eligible(name, &var) {
                State::Muon {
                    momentum: var.zeros_like()?.to_dtype(DType::F32)?,
                }
            } else if var.device().is_cpu() {
                State::AdamW {
                    m: vec![0.0; var.elem_count()],
                    v: vec![0.0; var.elem_count()],
                }
            } else {
                let z = var.zeros_like()?.to_dtype(DType::F32)?;
                State::AdamWOps { m: z.clone(), v: z }
            };
            params.push(Param {
                name: name.clone(),
                var,
                master,
                state,
            });
        }
        Ok(Optimizer { cfg, params, step: 0 })
    }

    /// Runs AdamW op by op from now on, as on a device without a fused kernel: the
    /// reference the fused kernels are checked against (`crate::parity`).
    pub fn force_op_by_op(&mut self) -> Result<()> {
        for p in &mut self.params {
            if let State::AdamW { m, v } = &p.state {
                let (shape, dev) = (p.var.shape().clone(), p.var.device().clone());
                p.state = State::AdamWOps {
                    m: Tensor::from_slice(m, shape.clone(), &dev)?,
                    v: Tensor::from_slice(v, shape, &dev)?,
                };
            }
        }
        Ok(())
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Clips the global gradient norm, then updates every parameter with rate `lr`. A
    /// gradient whose norm is not finite is refused whole: nothing changes, and the
    /// returned stats say `skipped`.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<StepStats> {
        let (grads, norm) = self.gradients(grads)?;
        if !norm.is_finite() {
            return Ok(StepStats {
                grad_norm: norm as f32,
                lr,
                missing_grads: 0,
                skipped: true,
            });
        }
        self.step += 1;
        let clip = if self.cfg.max_grad_norm > 0.0 && norm > self.cfg.max_grad_norm {
            (self.cfg.max_grad_norm / (norm + 1e-6)) as f32
        } else {
            1.0
        };
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let h = train::AdamW {
            lr: lr as f32,
            decay: (1f64 - lr * self.cfg.weight_decay) as f32,
            beta1: b1 as f32,
            beta2: b2 as f32,
            scale_m: (1f64 / (1f64 - b1.powi(self.step as i32))) as f32,
            scale_v: (1f64 / (1f64 - b2.powi(self.step as i32))) as f32,
            eps: self.cfg.eps as f32,
            clip,
        };
        let mut missing = 0;
        for (p, g) in self.params.iter_mut().zip(grads) {
            match g {
                Some(g) => p.update(g, h, &self.cfg, lr)?,
                None => missing += 1,
            }
        }
        Ok(StepStats {
            grad_norm: norm as f32,
            lr,
            missing_grads: missing,
            skipped: false,
        })
    }

    /// Every parameter's gradient (f32, contiguous; `None`: it got none) and their global
    /// norm. Gradients are read where they lie (made contiguous only when they are not).
    fn gradients(&self, grads: &GradStore) -> Result<(Vec<Option<Tensor>>, f64)> {
        let mut sq = 0f64;
        let mut out = Vec::with_capacity(self.params.len());
        for p in &self.params {
            match grads.get(p.var.as_tensor()) {
                Some(g) => {
                    let g = g.to_dtype(DType::F32)?.contiguous()?;
                    sq += sum_sq(&g)?;
                    out.push(Some(g));
                }
                None => out.push(None),
            }
        }
        Ok((out, sq.sqrt()))
    }

    /// Writes `optimizer.safetensors` (moments) and `optimizer.json` (step, config) to `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for p in &self.params {
            match &p.state {
                State::AdamW { m, v } => {
                    tensors.insert(
                        format!("{}.exp_avg", p.name),
                        Tensor::from_slice(m, m.len(), &candle_core::Device::Cpu)?,
                    );
                    tensors.insert(
                        format!("{}.exp_avg_sq", p.name),
                        Tensor::from_slice(v, v.len(), &candle_core::Device::Cpu)?,
                    );
                }
                State::AdamWOps { m, v } => {
                    tensors.insert(format!("{}.exp_avg", p.name), m.flatten_all()?.to_device(&Device::Cpu)?);
                    tensors.insert(
                        format!("{}.exp_avg_sq", p.name),
                        v.flatten_all()?.to_device(&Device::Cpu)?,
                    );
                }
                State::Muon { momentum } => {
                    tensors.insert(format!("{}.momentum", p.name), momentum.to_device(&Device::Cpu)?);
                }
            }
            if let Some(m) = &p.master {
                tensors.insert(format!("{}.master", p.name), m.to_device(&Device::Cpu)?);
            }
        }
        let path = dir.join("optimizer.safetensors");
        candle_core::safetensors::save(&tensors, &path)?;
        let meta = serde_json::json!({ "step": self.step, "config": self.cfg });
        let jpath = dir.join("optimizer.json");
        std::fs::write(&jpath, serde_json::to_string_pretty(&meta).unwrap_or_default())
            .map_err(Error::io("writing", &jpath))
    }

    /// Restores what [`save`](Optimizer::save) wrote; the config must match.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let jpath = dir.join("optimizer.json");
        let text = std::fs::read_to_string(&jpath).map_err(Error::io("reading", &jpath))?;
        let meta: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: jpath.display().to_string(),
            reason: e.to_string(),
        })?;
        let saved: OptimizerConfig = serde_json::from_value(meta["config"].clone()).map_err(|e| Error::Json {
            path: jpath.display().to_string(),
            reason: e.to_string(),
        })?;
        if saved.kind != self.cfg.kind {
            return Err(Error::checkpoint(
                dir,
                format!(
                    "optimizer state is {:?} but this optimizer is {:?}",
                    saved.kind, self.cfg.kind
                ),
            ));
        }
        let path = dir.join("optimizer.safetensors");
        let tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu)?;
        let missing = |k: &str| Error::checkpoint(&path, format!("no `{k}`"));
        for p in &mut self.params {
            match &mut p.state {
                State::AdamW { m, v } => {
                    let (km, kv) = (format!("{}.exp_avg", p.name), format!("{}.exp_avg_sq", p.name));
                    *m = tensors.get(&km).ok_or_else(|| missing(&km))?.to_vec1::<f32>()?;
                    *v = tensors.get(&kv).ok_or_else(|| missing(&kv))?.to_vec1::<f32>()?;
                }
                State::AdamWOps { m, v } => {
                    let (km, kv) = (format!("{}.exp_avg", p.name), format!("{}.exp_avg_sq", p.name));
                    let shape = p.var.shape().clone();
                    let get = |k: &str| -> Result<Tensor> {
                        Ok(tensors
                            .get(k)
                            .ok_or_else(|| missing(k))?
                            .reshape(shape.clone())?
                            .to_device(p.var.device())?)
                    };
                    (*m, *v) = (get(&km)?, get(&kv)?);
                }
                State::Muon { momentum } => {
                    let k = format!("{}.momentum", p.name);
                    *momentum = tensors.get(&k).ok_or_else(|| missing(&k))?.to_device(p.var.device())?;
                }
            }
            if p.master.is_some() {
                // A bf16 run's master weights; a checkpoint of an f32 run has none, and
                // the parameter's own value is then the best master there is.
                let k = format!("{}.master", p.name);
                p.master = Some(match tensors.get(&k) {
                    Some(t) => t.to_device(p.var.device())?,
                    None => p.var.to_dtype(DType::F32)?,
                });
            }
        }
        self.step = meta["step"].as_u64().unwrap_or(0);
        Ok(())
    }
}

/// AdamW op by op (devices without the fused kernel): the same arithmetic as
/// [`train::adamw`]; returns the next parameter and moments.
fn adamw_ops(theta: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, h: train::AdamW) -> Result<(Tensor, Tensor, Tensor)> {
    let g = if h.clip != 1.0 { (g * h.clip as f64)? } else { g.clone() };
    let nm = ((m * h.beta1 as f64)? + (&g * (1.0 - h.beta1) as f64)?)?;
    let nv = ((v * h.beta2 as f64)? + (g.sqr()? * (1.0 - h.beta2) as f64)?)?;
    let m_hat = (&nm * h.scale_m as f64)?;
    let v_hat = (&nv * h.scale_v as f64)?;
    let step = ((m_hat / (v_hat.sqrt()? + h.eps as f64)?)? * h.lr as f64)?;
    let next = ((theta * h.decay as f64)? - step)?;
    Ok((next, nm, nv))
}

/// Quintic Newton–Schulz iteration towards the nearest semi-orthogonal matrix (Muon).
pub fn newton_schulz(g: &Tensor, steps: usize) -> Result<Tensor> {
    let (a, b, c) = (3.4445f64, -4.7750f64, 2.0315f64);
    let (r, cols) = g.dims2()?;
    let transposed = r > cols;
    let mut x = if transposed { g.t()?.contiguous()? } else { g.clone() };
    let norm = x.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()? as f64;
    x = (x / (norm + 1e-7))?;
    for _ in 0..steps {
        let am = x.matmul(&x.t()?)?;
        let bm = ((&am * b)? + (am.matmul(&am)? * c)?)?;
        x = ((&x * a)? + bm.matmul(&x)?)?;
    }
    Ok(if transposed { x.t()?.contiguous()? } else { x })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::Optimizer as _;

    fn quadratic_grads(vars: &VarMap, seed: f32) -> GradStore {
        // loss = Σ (w · c)² with a fixed c: gradients of every shape, deterministic.
        let data = vars.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for (i, n) in names.iter().enumerate() {
            let w = data[*n].as_tensor();
            let c = (w.ones_like().unwrap() * (seed as f64 + i as f64 * 0.1)).unwrap();
            loss = (loss + (w * c).unwrap().sqr().unwrap().sum_all().unwrap()).unwrap();
        }
        loss.backward().unwrap()
    }

    fn vars() -> VarMap {
        let vm = VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        vb.get_with_hints((4, 3), "a.weight", candle_nn::Init::Randn { mean: 0.0, stdev: 1.0 })
            .unwrap();
        vb.get_with_hints(5, "b.bias", candle_nn::Init::Randn { mean: 0.0, stdev: 1.0 })
            .unwrap();
        vm
    }

    #[test]
    fn fused_adamw_matches_candle_adamw() {
        let (ours, theirs) = (vars(), vars());
        for (n, v) in theirs.data().lock().unwrap().iter() {
            v.set(ours.data().lock().unwrap()[n].as_tensor()).unwrap();
        }
        let cfg = OptimizerConfig {
            max_grad_norm: 0.0,
            ..Default::default()
        };
        let mut a = Optimizer::new(&ours, cfg).unwrap();
        let mut b = candle_nn::AdamW::new(
            theirs.all_vars(),
            candle_nn::ParamsAdamW {
                lr: 0.01,
                ..Default::default()
            },
        )
        .unwrap();
        for s in 0..5 {
            a.step(&quadratic_grads(&ours, 1.0 + s as f32), 0.01).unwrap();
            b.step(&quadratic_grads(&theirs, 1.0 + s as f32)).unwrap();
        }
        for (n, v) in ours.data().lock().unwrap().iter() {
            let x = v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let y = theirs.data().lock().unwrap()[n]
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for (p, q) in x.iter().zip(&y) {
                assert!((p - q).abs() <= 1e-6 * (1.0 + q.abs()), "{n}: {p} vs {q}");
            }
        }
    }

    #[test]
    fn newton_schulz_orthogonalises() {
        let g = Tensor::randn(0f32, 1.0, (8, 16), &Device::Cpu).unwrap();
        let o = newton_schulz(&g, 5).unwrap();
        // Singular values land near 1 (NS5 leaves them within about [0.7, 1.2]).
        let gram = o.matmul(&o.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        for (i, row) in gram.iter().enumerate() {
            assert!((0.4..1.5).contains(&row[i]), "diag {i}: {}", row[i]);
        }
    }

    #[test]
    fn schedules() {
        let s = LrSchedule::WarmupCosine {
            peak: 1.0,
            warmup: 10,
            total: 110,
            min: 0.1,
        };
        assert!((s.lr(0) - 0.1).abs() < 1e-12 && (s.lr(9) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.55).abs() < 1e-9);
        assert_eq!(s.lr(500), 0.1);
        assert_eq!(LrSchedule::Constant { lr: 3e-4 }.lr(7), 3e-4);
    }

    #[test]
    fn clipping_reports_the_norm_and_bounds_the_update() {
        let vm = vars();
        let before: Vec<f32> = vm.data().lock().unwrap()["b.bias"].as_tensor().to_vec1().unwrap();
        let mut o = Optimizer::new(
            &vm,
            OptimizerConfig {
                max_grad_norm: 1e-3,
                weight_decay: 0.0,
                ..Default::default()
            },
        )
        .unwrap();
        let st = o.step(&quadratic_grads(&vm, 5.0), 0.1).unwrap();
        assert!(st.grad_norm > 1.0 && st.missing_grads == 0, "{st:?}");
        // Adam normalises the step, so clipping shows in the moments, not the first update size;
        // what matters: no NaN and the parameters moved.
        let after: Vec<f32> = vm.data().lock().unwrap()["b.bias"].as_tensor().to_vec1().unwrap();
        assert!(after.iter().zip(&before).all(|(a, b)| a.is_finite() && a != b));
    }

    #[test]
    fn a_non_finite_gradient_changes_nothing() {
        for muon in [false, true] {
            let vm = vars();
            let snapshot = |vm: &VarMap| -> Vec<Vec<f32>> {
                let data = vm.data().lock().unwrap();
                let mut names: Vec<&String> = data.keys().collect();
                names.sort();
                names
                    .iter()
                    .map(|n| data[*n].as_tensor().flatten_all().unwrap().to_vec1().unwrap())
                    .collect()
            };
            let cfg = OptimizerConfig {
                kind: if muon {
                    OptimizerKind::Muon
                } else {
                    OptimizerKind::Adamw
                },
                ..Default::default()
            };
            let mut o = Optimizer::new(&vm, cfg).unwrap();
            o.step(&quadratic_grads(&vm, 1.0), 0.01).unwrap();
            let before = snapshot(&vm);
            // One NaN in one gradient.
            let mut g = quadratic_grads(&vm, 1.0);
            let data = vm.data().lock().unwrap().clone();
            let bias = data["b.bias"].as_tensor();
            let mut vals: Vec<f32> = g.get(bias).unwrap().to_vec1().unwrap();
            vals[2] = f32::NAN;
            g.insert(bias, Tensor::new(vals.as_slice(), &Device::Cpu).unwrap());
            let st = o.step(&g, 0.01).unwrap();
            assert!(st.skipped && st.grad_norm.is_nan(), "muon {muon}: {st:?}");
            assert_eq!(o.steps(), 1, "a skipped step is not counted");
            assert_eq!(snapshot(&vm), before, "muon {muon}: parameters moved on a NaN gradient");
            // The next finite step proceeds from untouched moments.
            let st = o.step(&quadratic_grads(&vm, 1.0), 0.01).unwrap();
            assert!(!st.skipped && st.grad_norm.is_finite());
            assert!(snapshot(&vm).iter().flatten().all(|v| v.is_finite()));
        }
    }
}

//! The policy: a decoder-only transformer written only from differentiable candle ops
//! (candle-nn's fused softmax/rms_norm/rope have no backward), reading top to bottom.
//! Weight names mirror Hugging Face checkpoints through `vb.pp(...)`.

use std::sync::Arc;

use candle_core::{D, DType, Device, IndexOp, Module, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::config::{Config, Family, MoeConfig, RopeLayout, RouterScore};
use crate::{Error, Result};

/// `x @ w^T (+ b)` for x of any rank ≥ 2.
#[derive(Debug, Clone)]
pub struct Linear {
    pub(crate) w: Tensor,
    pub(crate) b: Option<Tensor>,
}

impl Linear {
    fn load(vb: &VarBuilder, out: usize, inp: usize, bias: bool) -> Result<Self> {
        let std = (1.0 / inp as f64).sqrt();
        let w = vb.get_with_hints((out, inp), "weight", Init::Randn { mean: 0.0, stdev: std })?;
        let b = if bias {
            Some(vb.get_with_hints(out, "bias", Init::Const(0.0))?)
        } else {
            None
        };
        Ok(Linear { w, b })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = matmul_t(x, &self.w)?;
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

impl Linear {
    /// [`Module::forward`], as one fused op (bias added after) when `fused`.
    fn apply(&self, x: &Tensor, fused: bool) -> candle_core::Result<Tensor> {
        if !fused {
            return self.forward(x);
        }
        let y = crate::fused::linear(x, &self.w)?;
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// `x @ w^T` for x of rank ≥ 2, as one 2-D gemm. (A broadcast matmul would expand `w` per
/// batch row, and its backward would then materialise and reduce one weight gradient per
/// row: several times slower.)
fn matmul_t(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let dims = x.dims();
    if dims.len() == 2 {
        return x.matmul(&w.t()?);
    }
    let inner = dims[dims.len() - 1];
    let rows = x.elem_count() / inner;
    let y = x.reshape((rows, inner))?.matmul(&w.t()?)?;
    let mut out = dims.to_vec();
    *out.last_mut().expect("rank ≥ 2") = w.dim(0)?;
    y.reshape(out)
}

/// RMSNorm from basic ops.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub(crate) w: Tensor,
    pub(crate) eps: f64,
}

impl RmsNorm {
    fn load(vb: &VarBuilder, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            w: vb.get_with_hints(dim, "weight", Init::Const(1.0))?,
            eps,
        })
    }
}

impl Module for RmsNorm {
    /// In f32 whatever the input's dtype (a bf16 mean of squares loses the small terms),
    /// scaled by the weight in the input's dtype.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let xf = x.to_dtype(DType::F32)?;
        let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
        xf.broadcast_div(&(ms + self.eps)?.sqrt()?)?
            .to_dtype(x.dtype())?
            .broadcast_mul(&self.w)
    }
}

impl RmsNorm {
    /// [`Module::forward`], as one fused op when `fused`.
    fn apply(&self, x: &Tensor, fused: bool) -> candle_core::Result<Tensor> {
        if fused {
            crate::fused::rms_norm(x, &self.w, self.eps)
        } else {
            self.forward(x)
        }
    }
}

/// Rotary position embedding tables.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    pub(crate) layout: RopeLayout,
    /// Host copies of `cos` and `sin` for the fused ops.
    pub(crate) cos_host: Arc<Vec<f32>>,
    pub(crate) sin_host: Arc<Vec<f32>>,
}

impl Rope {
    fn new(cfg: &Config, device: &Device) -> Result<Self> {
        let half = cfg.head_dim / 2;
        let inv: Vec<f32> = crate::config::RopeScaling::inv_freq(cfg.rope_scaling, cfg.rope_theta, cfg.head_dim)
            .into_iter()
            .map(|f| f as f32)
            .collect();
        let n = cfg.max_positions;
        let mut angles = Vec::with_capacity(n * half);
        for p in 0..n {
            angles.extend(inv.iter().map(|f| p as f32 * f));
        }
        let cos_host: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin_host: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let a = Tensor::from_vec(angles, (n, half), device)?;
        Ok(Rope {
            cos: a.cos()?,
            sin: a.sin()?,
            layout: cfg.rope_layout,
            cos_host: Arc::new(cos_host),
            sin_host: Arc::new(sin_host),
        })
    }

    /// x: (B, H, T, hd); positions: (B, T) u32.
    fn apply(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let (b, _h, t, hd) = x.dims4()?;
        let half = hd / 2;
        let idx = positions.flatten_all()?;
        // The tables are f32; the rotation runs in the activations' dtype.
        let cos = self
            .cos
            .index_select(&idx, 0)?
            .reshape((b, 1, t, half))?
            .to_dtype(x.dtype())?;
        let sin = self
            .sin
            .index_select(&idx, 0)?
            .reshape((b, 1, t, half))?
            .to_dtype(x.dtype())?;
        Ok(match self.layout {
            RopeLayout::HalfSplit => {
                let x1 = x.narrow(D::Minus1, 0, half)?;
                let x2 = x.narrow(D::Minus1, half, half)?;
                Tensor::cat(
                    &[
                        (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?,
                        (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?,
                    ],
                    D::Minus1,
                )?
            }
            RopeLayout::Interleaved => {
                let (b, h, t, _) = x.dims4()?;
                let xp = x.reshape((b, h, t, half, 2))?;
                let e = xp.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
                let o = xp.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?;
                let re = (e.broadcast_mul(&cos)? - o.broadcast_mul(&sin)?)?;
                let ro = (e.broadcast_mul(&sin)? + o.broadcast_mul(&cos)?)?;
                Tensor::stack(&[re, ro], D::Minus1)?.reshape((b, h, t, hd))?
            }
        })
    }
}

/// Grouped-query self-attention.
#[derive(Debug, Clone)]
pub(crate) struct Attention {
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    pub(crate) n_heads: usize,
    pub(crate) n_kv: usize,
    pub(crate) hd: usize,
}

impl Attention {
    fn load(vb: &VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, kv, hd, d) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model);
        Ok(Attention {
            q: Linear::load(&vb.pp("q_proj"), h * hd, d, cfg.qkv_bias)?,
            k: Linear::load(&vb.pp("k_proj"), kv * hd, d, cfg.qkv_bias)?,
            v: Linear::load(&vb.pp("v_proj"), kv * hd, d, cfg.qkv_bias)?,
            o: Linear::load(&vb.pp("o_proj"), d, h * hd, cfg.o_bias)?,
            q_norm: if cfg.qk_norm {
                Some(RmsNorm::load(&vb.pp("q_norm"), hd, cfg.eps)?)
            } else {
                None
            },
            k_norm: if cfg.qk_norm {
                Some(RmsNorm::load(&vb.pp("k_norm"), hd, cfg.eps)?)
            } else {
                None
            },
            n_heads: h,
            n_kv: kv,
            hd,
        })
    }

    /// The training forward (no cache) as fused ops, token-major throughout: x (B, T, d)
    /// normalised; returns `residual + attention(x)`.
    fn forward_fused(&self, x: &Tensor, f: &FusedCtx, residual: &Tensor) -> Result<Tensor> {
        // (B, T, heads · hd) throughout: no reshape or transpose nodes.
        let q = self.q.apply(x, true)?;
        let k = self.k.apply(x, true)?;
        let v = self.v.apply(x, true)?;
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            // Per head: the fused RMSNorm normalises every group of head_dim values.
            (Some(qn), Some(kn)) => (qn.apply(&q, true)?, kn.apply(&k, true)?),
            _ => (q, k),
        };
        let scale = 1.0 / (self.hd as f64).sqrt();
        let y = crate::fused::attention(
            &q,
            &k,
            &v,
            f.mask.clone(),
            self.n_heads,
            self.n_kv,
            scale,
            Some(&f.rope),
        )?;
        Ok(match &self.o.b {
            None => crate::fused::linear_residual(&y, &self.o.w, residual)?,
            Some(_) => (residual + self.o.apply(&y, true)?)?,
        })
    }

    /// x: (B, T, d); mask: additive (B|1, 1, T, S); cache: keys/values of earlier steps.
    fn forward(
        &self,
        x: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        rope: &Rope,
        cache: LayerCache<'_>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let heads = |y: Tensor, n: usize| y.reshape((b, t, n, self.hd))?.transpose(1, 2);
        let mut q = heads(self.q.forward(x)?, self.n_heads)?;
        let mut k = heads(self.k.forward(x)?, self.n_kv)?;
        let v = heads(self.v.forward(x)?, self.n_kv)?.contiguous()?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let q = rope.apply(&q.contiguous()?, positions)?;
        let k = rope.apply(&k.contiguous()?, positions)?;
        let (k, v) = match cache {
            LayerCache::None => (k, v),
            LayerCache::Batched {
                k: kc,
                v: vc,
                index,
                width,
            } => {
                kc.scatter_set(index, &k.contiguous()?, 2)?;
                vc.scatter_set(index, &v, 2)?;
                (
                    kc.narrow(2, 0, width)?.contiguous()?,
                    vc.narrow(2, 0, width)?.contiguous()?,
                )
            }
            LayerCache::Shared(c) => c.append(&k.contiguous()?, &v)?,
            LayerCache::Ragged { caches, new_lens } => {
                // Each row appends its own new positions to its own cache; rows are then
                // zero-padded to the longest and the caller's mask hides the padding.
                let k = k.contiguous()?;
                let (mut ks, mut vs) = (Vec::with_capacity(b), Vec::with_capacity(b));
                for (r, c) in caches.into_iter().enumerate() {
                    let n = new_lens[r];
                    let kr = k.narrow(0, r, 1)?.narrow(2, 0, n)?.contiguous()?;
                    let vr = v.narrow(0, r, 1)?.narrow(2, 0, n)?.contiguous()?;
                    let (kf, vf) = c.append(&kr, &vr)?;
                    ks.push(kf);
                    vs.push(vf);
                }
                let s = ks.iter().map(|t| t.dim(2)).collect::<candle_core::Result<Vec<_>>>()?;
                let max = s.iter().copied().max().unwrap_or(0);
                let pad = |ts: Vec<Tensor>| -> Result<Tensor> {
                    let ts = ts
                        .into_iter()
                        .zip(&s)
                        .map(|(t, &l)| {
                            if l == max {
                                Ok(t)
                            } else {
                                t.pad_with_zeros(2, 0, max - l)
                            }
                        })
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    Ok(Tensor::cat(&ts, 0)?)
                };
                (pad(ks)?, pad(vs)?)
            }
        };
        let rep = self.n_heads / self.n_kv;
        let expand = |y: Tensor| -> Result<Tensor> {
            if rep == 1 {
                return Ok(y);
            }
            let (b, kv, s, hd) = y.dims4()?;
            Ok(y.unsqueeze(2)?
                .expand((b, kv, rep, s, hd))?
                .reshape((b, kv * rep, s, hd))?)
        };
        let (k, v) = (expand(k)?, expand(v)?);
        let scale = 1.0 / (self.hd as f64).sqrt();
        // Scores, the (f32) mask and the softmax in f32; the products in the weights' dtype.
        let att = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?.broadcast_add(mask)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?.to_dtype(v.dtype())?;
        let y = att
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, self.n_heads * self.hd))?;
        Ok(self.o.forward(&y)?)
    }
}

/// SwiGLU feed-forward: down(silu(gate(x)) * up(x)).
#[derive(Debug, Clone)]
pub(crate) struct Mlp {
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

impl Mlp {
    fn load(vb: &VarBuilder, d: usize, ff: usize, names: [&str; 3], bias: bool) -> Result<Self> {
        Ok(Mlp {
            gate: Linear::load(&vb.pp(names[0]), ff, d, bias)?,
            up: Linear::load(&vb.pp(names[1]), ff, d, bias)?,
            down: Linear::load(&vb.pp(names[2]), d, ff, bias)?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.down
            .forward(&(self.gate.forward(x)?.silu()? * self.up.forward(x)?)?)
    }
}

impl Mlp {
    /// `residual + forward(x)` as two fused ops (SwiGLU up, then down onto the residual).
    fn forward_fused(&self, x: &Tensor, residual: &Tensor) -> candle_core::Result<Tensor> {
        if self.gate.b.is_some() || self.up.b.is_some() || self.down.b.is_some() {
            return residual + self.apply(x, true)?;
        }
        let h = crate::fused::swiglu(x, &self.gate.w, &self.up.w)?;
        crate::fused::linear_residual(&h, &self.down.w, residual)
    }

    /// [`Module::forward`], with SiLU·up as one fused op when `fused`.
    fn apply(&self, x: &Tensor, fused: bool) -> candle_core::Result<Tensor> {
        if fused {
            let h = crate::fused::silu_mul(&self.gate.apply(x, true)?, &self.up.apply(x, true)?)?;
            self.down.apply(&h, true)
        } else {
            self.forward(x)
        }
    }
}

/// Routing statistics of one MoE layer for one forward.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeStats {
    /// Tokens routed to each expert.
    pub tokens_per_expert: Vec<usize>,
    /// `(max tokens per expert − mean) / mean`.
    pub imbalance: f32,
}

/// Mixture-of-experts feed-forward: router, top-k experts per token, optional shared expert.
#[derive(Debug, Clone)]
pub(crate) struct Moe {
    pub(crate) router: Linear,
    pub(crate) experts: Vec<Mlp>,
    pub(crate) shared: Option<(Mlp, Linear)>,
    pub(crate) cfg: MoeConfig,
}

impl Moe {
    fn load(vb: &VarBuilder, d: usize, cfg: &MoeConfig, family: Family) -> Result<Self> {
        let (router_name, expert_names) = match family {
            Family::Mixtral => ("gate", ["w1", "w3", "w2"]),
            _ => ("gate", ["gate_proj", "up_proj", "down_proj"]),
        };
        let router = Linear::load(&vb.pp(router_name), cfg.n_experts, d, false)?;
        let experts = (0..cfg.n_experts)
            .map(|e| Mlp::load(&vb.pp("experts").pp(e), d, cfg.expert_ff, expert_names, false))
            .collect::<Result<Vec<_>>>()?;
        let shared = match cfg.shared_ff {
            Some(ff) => Some((
                Mlp::load(
                    &vb.pp("shared_expert"),
                    d,
                    ff,
                    ["gate_proj", "up_proj", "down_proj"],
                    false,
                )?,
                Linear::load(&vb.pp("shared_expert_gate"), 1, d, false)?,
            )),
            None => None,
        };
        Ok(Moe {
            router,
            experts,
            shared,
            cfg: cfg.clone(),
        })
    }

    /// x: (N, d) → (out (N, d), aux load-balance loss (scalar), stats).
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor, MoeStats)> {
        let (n, _d) = x.dims2()?;
        let e = self.cfg.n_experts;
        // Routing in f32 whatever the weights' dtype (the balance loss is f32).
        let logits = self.router.forward(x)?.to_dtype(DType::F32)?;
        let scores = match self.cfg.score {
            RouterScore::Softmax => candle_nn::ops::softmax(&logits, D::Minus1)?,
            RouterScore::Sigmoid => candle_nn::ops::sigmoid(&logits)?,
        };
        // Selection is discrete (no gradient); the weights of the chosen experts carry it.
        let host = scores.to_vec2::<f32>()?;
        let mut onehot = vec![0f32; n * e];
        let mut routed: Vec<Vec<u32>> = vec![Vec::new(); e];
        for (i, row) in host.iter().enumerate() {
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for &j in &order[..self.cfg.top_k] {
                onehot[i * e + j] = 1.0;
                routed[j].push(i as u32);
            }
        }
        let onehot = Tensor::from_vec(onehot, (n, e), x.device())?;
        let mut combine = (&scores * &onehot)?;
        if self.cfg.renormalize {
            combine = combine.broadcast_div(&(combine.sum_keepdim(D::Minus1)? + 1e-20)?)?;
        }
        let mut out = x.zeros_like()?;
        for (j, idx) in routed.iter().enumerate() {
            if idx.is_empty() {
                continue;
            }
            let idx_t = Tensor::new(idx.as_slice(), x.device())?;
            let xe = x.index_select(&idx_t, 0)?;
            let w = combine.index_select(&idx_t, 0)?.narrow(1, j, 1)?.to_dtype(x.dtype())?;
            let ye = self.experts[j].forward(&xe)?.broadcast_mul(&w)?;
            out = out.index_add(&idx_t, &ye, 0)?;
        }
        if let Some((mlp, gate)) = &self.shared {
            let g = candle_nn::ops::sigmoid(&gate.forward(x)?.to_dtype(DType::F32)?)?.to_dtype(x.dtype())?;
            out = (out + mlp.forward(x)?.broadcast_mul(&g)?)?;
        }
        // Switch-style balance loss: E · Σ_e f_e · P_e (f: routed fraction, P: mean score).
        let counts: Vec<usize> = routed.iter().map(Vec::len).collect();
        let total = (n * self.cfg.top_k).max(1) as f32;
        let f: Vec<f32> = counts.iter().map(|&c| c as f32 / total).collect();
        let f = Tensor::from_vec(f, e, x.device())?;
        let p = scores.mean(0)?;
        let aux = ((f * p)?.sum_all()? * (e as f64 * self.cfg.aux_loss_coef))?;
        let mean = total / e as f32;
        let max = counts.iter().copied().max().unwrap_or(0) as f32;
        let stats = MoeStats {
            imbalance: if mean > 0.0 { (max - mean) / mean } else { 0.0 },
            tokens_per_expert: counts,
        };
        Ok((out, aux, stats))
    }
}

#[derive(Debug, Clone)]
pub(crate) enum FeedForward {
    Dense(Mlp),
    Moe(Moe),
}

#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) attn_norm: RmsNorm,
    pub(crate) attn: Attention,
    pub(crate) ff_norm: RmsNorm,
    pub(crate) ff: FeedForward,
}

impl Block {
    fn load(vb: &VarBuilder, cfg: &Config) -> Result<Self> {
        let ff = match (&cfg.moe, cfg.family) {
            (Some(m), Family::Mixtral) => {
                FeedForward::Moe(Moe::load(&vb.pp("block_sparse_moe"), cfg.d_model, m, cfg.family)?)
            }
            (Some(m), _) => FeedForward::Moe(Moe::load(&vb.pp("mlp"), cfg.d_model, m, cfg.family)?),
            (None, _) => FeedForward::Dense(Mlp::load(
                &vb.pp("mlp"),
                cfg.d_model,
                cfg.d_ff,
                ["gate_proj", "up_proj", "down_proj"],
                cfg.mlp_bias,
            )?),
        };
        Ok(Block {
            attn_norm: RmsNorm::load(&vb.pp("input_layernorm"), cfg.d_model, cfg.eps)?,
            attn: Attention::load(&vb.pp("self_attn"), cfg)?,
            ff_norm: RmsNorm::load(&vb.pp("post_attention_layernorm"), cfg.d_model, cfg.eps)?,
            ff,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        rope: &Rope,
        cache: LayerCache<'_>,
        aux: &mut Vec<(Tensor, MoeStats)>,
        fused: Option<&FusedCtx>,
    ) -> Result<Tensor> {
        let on = fused.is_some();
        let a = self.attn_norm.apply(x, on)?;
        let h = match (fused, cache) {
            (Some(f), LayerCache::None) => self.attn.forward_fused(&a, f, x)?,
            (_, cache) => (x + self.attn.forward(&a, positions, mask, rope, cache)?)?,
        };
        let n = self.ff_norm.apply(&h, on)?;
        let f = match &self.ff {
            FeedForward::Dense(m) if on => return Ok(m.forward_fused(&n, &h)?),
            FeedForward::Dense(m) => m.apply(&n, on)?,
            FeedForward::Moe(m) => {
                let (b, t, d) = n.dims3()?;
                let (y, a, s) = m.forward(&n.reshape((b * t, d))?)?;
                aux.push((a, s));
                y.reshape((b, t, d))?
            }
        };
        Ok((h + f)?)
    }
}

/// Adds the weights' gradients of `from` (the backward of `root`) into `into` and drops
/// the rest, so that only weight gradients outlive a pass.
fn move_weight_grads(
    into: &mut candle_core::backprop::GradStore,
    mut from: candle_core::backprop::GradStore,
    root: &Tensor,
) -> Result<()> {
    for node in root.sorted_nodes() {
        if !node.is_variable() {
            continue;
        }
        if let Some(g) = from.remove(node) {
            let sum = match into.get(node) {
                Some(old) => (old + g)?,
                None => g,
            };
            into.insert(node, sum);
        }
    }
    Ok(())
}

/// What the fused ops of one training forward share across layers: host copies of the
/// attention mask and of the rotary tables and positions.
pub(crate) struct FusedCtx {
    mask: Arc<Vec<f32>>,
    rope: crate::fused::RopeTables,
}

/// What a training forward returns besides logits.
#[derive(Debug)]
pub struct Aux {
    /// Sum of the MoE load-balance losses (zero for dense models).
    pub balance_loss: Tensor,
    /// Routing statistics per MoE layer.
    pub moe: Vec<MoeStats>,
}

/// The decoder-only transformer.
#[derive(Debug, Clone)]
pub struct Transformer {
    pub(crate) cfg: Config,
    pub(crate) embed: Tensor,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: RmsNorm,
    pub(crate) head: Option<Linear>,
    pub(crate) rope: Rope,
    pub(crate) device: Device,
    /// Run the training forward through [`crate::fused`] (f32 on the CPU only).
    pub(crate) fused: bool,
}

impl Transformer {
    /// Builds the model, taking (or creating, with random init) every weight from `vb`.
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let m = vb.pp("model");
        let embed = m.pp("embed_tokens").get_with_hints(
            (cfg.vocab, cfg.d_model),
            "weight",
            Init::Randn { mean: 0.0, stdev: 0.02 },
        )?;
        let blocks = (0..cfg.n_layers)
            .map(|i| Block::load(&m.pp("layers").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let head = if cfg.tie_embeddings {
            None
        } else {
            Some(Linear::load(&vb.pp("lm_head"), cfg.vocab, cfg.d_model, false)?)
        };
        Ok(Transformer {
            cfg: cfg.clone(),
            embed,
            blocks,
            norm: RmsNorm::load(&m.pp("norm"), cfg.d_model, cfg.eps)?,
            head,
            rope: Rope::new(cfg, vb.device())?,
            device: vb.device().clone(),
            fused: vb.device().is_cpu() && vb.dtype() == DType::F32,
        })
    }

    /// The resolved configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The dtype the weights have (logits are f32 whatever it is).
    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// The device weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the training forward runs through the fused ops of [`crate::fused`] (on by
    /// default for f32 weights on the CPU) or op by op, as on every other device.
    pub fn fused_ops(&self) -> bool {
        self.fused
    }

    /// Turns the fused training ops on or off; on takes effect only for f32 weights on the
    /// CPU. Both paths compute the same function (the tests compare their gradients).
    pub fn set_fused_ops(&mut self, on: bool) {
        self.fused = on && self.device.is_cpu() && self.embed.dtype() == DType::F32;
    }

    /// The head over the final normalised hidden states: the LM head, or the tied
    /// embedding; fused when `fused`. Logits are f32 whatever the weights' dtype (the
    /// logprobs the losses compare come from them).
    fn logits(&self, h: &Tensor, fused: bool) -> Result<Tensor> {
        Ok(match (&self.head, fused) {
            (Some(head), on) => head.apply(h, on)?,
            (None, true) => crate::fused::linear(h, &self.embed)?,
            (None, false) => matmul_t(h, &self.embed)?,
        }
        .to_dtype(DType::F32)?)
    }

    /// The fused ops' shared state for a forward over `positions` with `mask` and no cache.
    fn fused_ctx(&self, positions: &Tensor, mask: &Tensor) -> Result<Option<FusedCtx>> {
        if !self.fused {
            return Ok(None);
        }
        Ok(Some(FusedCtx {
            mask: Arc::new(mask.flatten_all()?.to_vec1::<f32>()?),
            rope: crate::fused::RopeTables {
                cos: self.rope.cos_host.clone(),
                sin: self.rope.sin_host.clone(),
                interleaved: self.rope.layout == RopeLayout::Interleaved,
                positions: Arc::new(positions.flatten_all()?.to_vec1::<u32>()?),
            },
        }))
    }

    fn run(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        mut cache: CacheArg<'_, '_>,
    ) -> Result<(Tensor, Aux)> {
        let (b, t) = tokens.dims2()?;
        let max_pos = positions.max_all()?.to_scalar::<u32>()? as usize;
        if max_pos >= self.cfg.max_positions {
            return Err(Error::Shape(format!(
                "position {max_pos} exceeds max_position_embeddings {}",
                self.cfg.max_positions
            )));
        }
        let mut x = self
            .embed
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.d_model))?;
        let mut aux = Vec::new();
        let fx = match &cache {
            CacheArg::None => self.fused_ctx(positions, mask)?,
            _ => None,
        };
        for (i, blk) in self.blocks.iter().enumerate() {
            let c = match &mut cache {
                CacheArg::None => LayerCache::None,
                CacheArg::Batched(kv, index, width) => LayerCache::Batched {
                    k: &kv.k[i],
                    v: &kv.v[i],
                    index,
                    width: *width,
                },
                CacheArg::Shared(c) => LayerCache::Shared(&mut c.layers[i]),
                CacheArg::Ragged(cs, lens) => LayerCache::Ragged {
                    caches: cs.iter_mut().map(|c| &mut c.layers[i]).collect(),
                    new_lens: lens,
                },
            };
            x = blk.forward(&x, positions, mask, &self.rope, c, &mut aux, fx.as_ref())?;
        }
        let x = self.norm.apply(&x, fx.is_some())?;
        let logits = self.logits(&x, fx.is_some())?;
        let balance_loss = aux
            .iter()
            .try_fold(Tensor::zeros((), DType::F32, &self.device)?, |acc, (a, _)| acc + a)?;
        Ok((
            logits,
            Aux {
                balance_loss,
                moe: aux.into_iter().map(|(_, s)| s).collect(),
            },
        ))
    }

    /// Training forward and backward with activation checkpointing: only each layer's
    /// input is kept during the forward; the backward recomputes one layer at a time and
    /// backpropagates through it, so peak memory holds one layer's activations instead of
    /// all of them (at the cost of a second forward).
    ///
    /// `head_loss` turns the logits (B, T, V) into the scalar loss; each MoE layer's
    /// load-balance loss is added with weight `balance_coef`. Returns the gradients of
    /// every weight (equal to `forward` + `backward` of the same loss), the logits
    /// (detached) and the auxiliaries.
    pub fn backward_checkpointed(
        &self,
        batch: &Packed,
        balance_coef: f64,
        head_loss: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(candle_core::backprop::GradStore, Tensor, Aux)> {
        let (b, t) = batch.tokens.dims2()?;
        let max_pos = batch.positions.max_all()?.to_scalar::<u32>()? as usize;
        if max_pos >= self.cfg.max_positions {
            return Err(Error::Shape(format!(
                "position {max_pos} exceeds max_position_embeddings {}",
                self.cfg.max_positions
            )));
        }
        let x0 = self
            .embed
            .index_select(&batch.tokens.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.d_model))?;
        let fx = self.fused_ctx(&batch.positions, &batch.mask)?;
        // Forward: keep each layer's input, detached, and nothing else.
        let mut inputs = Vec::with_capacity(self.blocks.len() + 1);
        inputs.push(x0.detach());
        let mut moe = Vec::new();
        let mut balance = Tensor::zeros((), DType::F32, &self.device)?;
        for blk in &self.blocks {
            let mut aux = Vec::new();
            let x = inputs.last().expect("pushed");
            let y = blk.forward(
                x,
                &batch.positions,
                &batch.mask,
                &self.rope,
                LayerCache::None,
                &mut aux,
                fx.as_ref(),
            )?;
            for (a, st) in aux {
                balance = (balance + a.detach())?;
                moe.push(st);
            }
            inputs.push(y.detach());
        }
        let missing = |what: &str| Error::Shape(format!("activation checkpointing: no gradient reached {what}"));
        // The head: final norm, logits, loss.
        let top = candle_core::Var::from_tensor(inputs.last().expect("pushed"))?;
        let h = self.norm.apply(top.as_tensor(), fx.is_some())?;
        let logits = self.logits(&h, fx.is_some())?;
        // Only the weights' gradients are kept across the passes (a backward also leaves
        // gradients for constants such as masks and rotary tables).
        let mut grads = {
            let z = Tensor::zeros((), DType::F32, &self.device)?;
            let mut empty = z.backward()?;
            empty.remove(&z);
            empty
        };
        let loss = head_loss(&logits)?;
        let mut gh = loss.backward()?;
        let mut g = gh.remove(top.as_tensor()).ok_or_else(|| missing("the last layer"))?;
        move_weight_grads(&mut grads, gh, &loss)?;
        drop(loss);
        // Backward, one layer at a time: recompute it, push the incoming gradient through.
        for (i, blk) in self.blocks.iter().enumerate().rev() {
            let x = candle_core::Var::from_tensor(&inputs[i])?;
            let mut aux = Vec::new();
            let y = blk.forward(
                x.as_tensor(),
                &batch.positions,
                &batch.mask,
                &self.rope,
                LayerCache::None,
                &mut aux,
                fx.as_ref(),
            )?;
            let mut surrogate = (y * &g)?.sum_all()?;
            for (a, _) in &aux {
                surrogate = (surrogate + (a * balance_coef)?)?;
            }
            let mut gi = surrogate.backward()?;
            g = gi.remove(x.as_tensor()).ok_or_else(|| missing(&format!("layer {i}")))?;
            move_weight_grads(&mut grads, gi, &surrogate)?;
        }
        let surrogate = (x0 * &g)?.sum_all()?;
        let ge = surrogate.backward()?;
        move_weight_grads(&mut grads, ge, &surrogate)?;
        Ok((
            grads,
            logits.detach(),
            Aux {
                balance_loss: balance,
                moe,
            },
        ))
    }

    /// Training forward over a packed batch: logits (B, T, V) plus MoE auxiliaries.
    pub fn forward(&self, batch: &Packed) -> Result<(Tensor, Aux)> {
        self.run(&batch.tokens, &batch.positions, &batch.mask, CacheArg::None)
    }

    /// Inference forward of `tokens` (B, t) at `positions`, appending their keys and values
    /// to `cache`; `mask` is additive (B, 1, t, cached + t).
    pub fn forward_cached(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        Ok(self.run(tokens, positions, mask, CacheArg::Shared(cache))?.0)
    }

    /// Inference forward of a ragged batch: row `r` of `tokens` (B, t) holds
    /// `new_lens[r]` new tokens (right-padded to t) of a sequence whose keys and values so
    /// far are in `caches[r]`; each row's new keys and values are appended to its own
    /// cache. `mask` is additive (B, 1, t, S) with S the longest cache after appending;
    /// row r may attend only to key positions `< caches[r].len()` (after appending). This
    /// is what lets sequences of different lengths join and leave a running batch.
    pub fn forward_ragged(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        caches: &mut [&mut KvCache],
        new_lens: &[usize],
    ) -> Result<Tensor> {
        let b = tokens.dim(0)?;
        if caches.len() != b || new_lens.len() != b {
            return Err(Error::Shape(format!(
                "ragged forward of {b} rows got {} caches and {} lengths",
                caches.len(),
                new_lens.len()
            )));
        }
        Ok(self.run(tokens, positions, mask, CacheArg::Ragged(caches, new_lens))?.0)
    }

    /// Decode one token per row of the running batch whose keys and values are the rows of
    /// `kv`: row r's token sits at `positions[r]` (B, 1), its keys and values are written
    /// there in place, and attention covers the first `width` positions under the additive
    /// `mask` (B, 1, 1, width).
    pub fn forward_batched(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        kv: &BatchKv,
        width: usize,
    ) -> Result<Tensor> {
        let b = tokens.dim(0)?;
        if kv.rows != b || width > kv.cap {
            return Err(Error::Shape(format!(
                "batched decode of {b} rows (width {width}) over a cache of {} rows × {} positions",
                kv.rows, kv.cap
            )));
        }
        let index = positions
            .reshape((b, 1, 1, 1))?
            .broadcast_as((b, self.cfg.n_kv_heads, 1, self.cfg.head_dim))?
            .contiguous()?;
        Ok(self
            .run(tokens, positions, mask, CacheArg::Batched(kv, &index, width))?
            .0)
    }

    /// A preallocated key/value cache for `max_len` positions.
    pub fn new_cache(&self, max_len: usize) -> KvCache {
        KvCache {
            layers: (0..self.cfg.n_layers)
                .map(|_| candle_nn::kv_cache::KvCache::new(2, max_len))
                .collect(),
        }
    }
}

/// How one forward uses key/value caches.
enum CacheArg<'a, 'b> {
    None,
    Batched(&'a BatchKv, &'a Tensor, usize),
    Shared(&'a mut KvCache),
    Ragged(&'a mut [&'b mut KvCache], &'a [usize]),
}

/// One layer's view of [`CacheArg`].
enum LayerCache<'a> {
    None,
    /// The running batch's cache rows (B, kv, cap, hd): write the new position of every row
    /// with one scatter, attend over the first `width` positions.
    Batched {
        k: &'a Tensor,
        v: &'a Tensor,
        index: &'a Tensor,
        width: usize,
    },
    Shared(&'a mut candle_nn::kv_cache::KvCache),
    Ragged {
        caches: Vec<&'a mut candle_nn::kv_cache::KvCache>,
        new_lens: &'a [usize],
    },
}

/// Per-layer key/value caches, preallocated (grown in place, never re-concatenated).
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<candle_nn::kv_cache::KvCache>,
}

impl KvCache {
    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.current_seq_len())
    }
    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl KvCache {
    /// Keys and values of layer `i` so far, (1, kv, len, hd) each.
    fn layer(&self, i: usize) -> Result<(Tensor, Tensor)> {
        let l = &self.layers[i];
        match (l.k()?, l.v()?) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(Error::Shape(format!("layer {i} of the cache is empty"))),
        }
    }
}

/// The running batch's key/value cache: per layer one (rows, kv, cap, hd) tensor whose row r
/// belongs to the r-th running sequence. Rows join (a prefilled sequence) and leave (a
/// finished one) between steps; a decode step writes every row's new position with one
/// scatter instead of one copy per row.
#[derive(Debug, Clone, Default)]
pub struct BatchKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    rows: usize,
    cap: usize,
}

impl BatchKv {
    /// Rows (running sequences).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Positions per row.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Appends the sequences cached in `caches` as new rows, growing every row to at least
    /// `cap` positions.
    pub fn push(&mut self, caches: &[&KvCache], cap: usize) -> Result<()> {
        if caches.is_empty() {
            return Ok(());
        }
        let layers = caches[0].layers.len();
        let cap = cap.max(self.cap);
        let grow = |t: &Tensor, to: usize| -> Result<Tensor> {
            let have = t.dim(2)?;
            Ok(if have < to {
                t.pad_with_zeros(2, 0, to - have)?
            } else {
                t.clone()
            })
        };
        let (mut ks, mut vs) = (Vec::with_capacity(layers), Vec::with_capacity(layers));
        for i in 0..layers {
            let mut kparts = Vec::with_capacity(caches.len() + 1);
            let mut vparts = Vec::with_capacity(caches.len() + 1);
            if self.rows > 0 {
                kparts.push(grow(&self.k[i], cap)?);
                vparts.push(grow(&self.v[i], cap)?);
            }
            for c in caches {
                let (k, v) = c.layer(i)?;
                kparts.push(grow(&k, cap)?);
                vparts.push(grow(&v, cap)?);
            }
            ks.push(Tensor::cat(&kparts, 0)?.contiguous()?);
            vs.push(Tensor::cat(&vparts, 0)?.contiguous()?);
        }
        self.k = ks;
        self.v = vs;
        self.rows += caches.len();
        self.cap = cap;
        Ok(())
    }

    /// Keeps only the rows at `keep` (in that order).
    pub fn keep(&mut self, keep: &[u32]) -> Result<()> {
        if keep.len() == self.rows {
            return Ok(());
        }
        if keep.is_empty() {
            *self = BatchKv::default();
            return Ok(());
        }
        let dev = self.k[0].device().clone();
        let idx = Tensor::new(keep, &dev)?;
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            *t = t.index_select(&idx, 0)?.contiguous()?;
        }
        self.rows = keep.len();
        Ok(())
    }
}

/// Large negative additive mask value (not -inf: an all-masked padding row stays finite).
pub const MASKED: f32 = -1e9;

/// A packed training batch: several samples concatenated per row, positions restarting
/// per sample, attention confined to each sample.
#[derive(Debug, Clone)]
pub struct Packed {
    /// Token ids (B, T), u32.
    pub tokens: Tensor,
    /// Position ids (B, T), u32, restarting at 0 for every sample.
    pub positions: Tensor,
    /// Additive attention mask (B, 1, T, T).
    pub mask: Tensor,
    /// Row, start offset and length of every sample, in input order.
    pub spans: Vec<(usize, usize, usize)>,
    /// Columns per row.
    pub width: usize,
}

impl Packed {
    /// Packs `rows`: each row is a list of samples (token sequences) laid end to end; rows
    /// are right-padded to the longest.
    pub fn new(rows: &[Vec<Vec<u32>>], device: &Device) -> Result<Packed> {
        let width = rows
            .iter()
            .map(|r| r.iter().map(Vec::len).sum::<usize>())
            .max()
            .unwrap_or(0)
            .max(1);
        let b = rows.len().max(1);
        let mut tokens = vec![0u32; b * width];
        let mut positions = vec![0u32; b * width];
        let mut segment = vec![u32::MAX; b * width];
        let mut spans = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            let mut at = 0;
            for (s, sample) in row.iter().enumerate() {
                for (i, &tok) in sample.iter().enumerate() {
                    tokens[r * width + at + i] = tok;
                    positions[r * width + at + i] = i as u32;
                    segment[r * width + at + i] = s as u32;
                }
                spans.push((r, at, sample.len()));
                at += sample.len();
            }
        }
        let mut mask = vec![MASKED; b * width * width];
        for r in 0..b {
            for i in 0..width {
                for j in 0..=i {
                    let (si, sj) = (segment[r * width + i], segment[r * width + j]);
                    // Padding attends to itself only, so its row stays well defined.
                    if (si == sj && si != u32::MAX) || i == j {
                        mask[(r * width + i) * width + j] = 0.0;
                    }
                }
            }
        }
        Ok(Packed {
            tokens: Tensor::from_vec(tokens, (b, width), device)?,
            positions: Tensor::from_vec(positions, (b, width), device)?,
            mask: Tensor::from_vec(mask, (b, 1, width, width), device)?,
            spans,
            width,
        })
    }
}

/// Per-token logprobs at temperature `t`: `out[b, i] = log_softmax(logits[b, i-1] / t)[tokens[b, i]]`
/// for i ≥ 1; column 0 (which has no preceding logits) is 0. Differentiable.
pub fn token_logprobs(logits: &Tensor, tokens: &Tensor, temperature: f64) -> Result<Tensor> {
    if crate::fused::logprobs_supported(logits) {
        return Ok(crate::fused::token_logprobs(logits, tokens, temperature)?);
    }
    token_logprobs_unfused(logits, tokens, temperature)
}

/// [`token_logprobs`] op by op (what runs off the CPU), kept for the tests that compare.
pub fn token_logprobs_unfused(logits: &Tensor, tokens: &Tensor, temperature: f64) -> Result<Tensor> {
    let (b, t, _v) = logits.dims3()?;
    if t < 2 {
        return Ok(Tensor::zeros((b, t), DType::F32, logits.device())?);
    }
    let scaled = if temperature == 1.0 {
        logits.narrow(1, 0, t - 1)?
    } else {
        (logits.narrow(1, 0, t - 1)? / temperature)?
    };
    let lsm = candle_nn::ops::log_softmax(&scaled, D::Minus1)?;
    let next = tokens.narrow(1, 1, t - 1)?.unsqueeze(D::Minus1)?;
    let lp = lsm.gather(&next.contiguous()?, D::Minus1)?.squeeze(D::Minus1)?;
    Ok(Tensor::cat(
        &[Tensor::zeros((b, 1), DType::F32, logits.device())?, lp],
        1,
    )?)
}

/// [`token_logprobs`] and the entropy (nats) of every next-token distribution at `t`
/// `(B, T)`, aligned the same way (column 0 is 0) and not differentiated: fused in one pass
/// over the logits where the fused ops run, op by op elsewhere.
pub fn token_logprobs_entropy(logits: &Tensor, tokens: &Tensor, temperature: f64) -> Result<(Tensor, Tensor)> {
    if crate::fused::logprobs_supported(logits) {
        return Ok(crate::fused::token_logprobs_entropy(logits, tokens, temperature)?);
    }
    let lp = token_logprobs_unfused(logits, tokens, temperature)?;
    Ok((lp, entropy_unfused(logits, temperature)?))
}

/// The entropy of every next-token distribution, op by op (materialises the
/// log-softmax), aligned like [`token_logprobs`].
pub fn entropy_unfused(logits: &Tensor, temperature: f64) -> Result<Tensor> {
    let (b, t, _v) = logits.dims3()?;
    if t < 2 {
        return Ok(Tensor::zeros((b, t), DType::F32, logits.device())?);
    }
    let l = (logits.narrow(1, 0, t - 1)?.detach() / temperature)?;
    let lsm = candle_nn::ops::log_softmax(&l, D::Minus1)?;
    let ent = (lsm.exp()? * &lsm)?.sum(D::Minus1)?.neg()?;
    Ok(Tensor::cat(
        &[Tensor::zeros((b, 1), DType::F32, logits.device())?, ent],
        1,
    )?)
}

/// Mean entropy (nats) of the next-token distributions at temperature `t` over positions
/// where `mask` (B, T) is 1 (shifted like [`token_logprobs`]). Not differentiated.
pub fn masked_entropy(logits: &Tensor, mask: &Tensor, temperature: f64) -> Result<f32> {
    let (_b, t, _v) = logits.dims3()?;
    if t < 2 {
        return Ok(0.0);
    }
    let m = mask.narrow(1, 1, t - 1)?;
    let n = m.sum_all()?.to_scalar::<f32>()?;
    if n == 0.0 {
        return Ok(0.0);
    }
    let ent = entropy_unfused(logits, temperature)?.narrow(1, 1, t - 1)?;
    Ok((ent * m)?.sum_all()?.to_scalar::<f32>()? / n)
}

/// Index helper used by tests and the sampler: last-position logits of each row.
pub fn last_logits(logits: &Tensor) -> Result<Tensor> {
    let (_b, t, _v) = logits.dims3()?;
    Ok(logits.i((.., t - 1, ..))?)
}

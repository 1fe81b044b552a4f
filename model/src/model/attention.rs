//! Grouped-query self-attention, with the key/value cache variants of inference.

use super::*;

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
    pub(crate) fn load(vb: &VarBuilder, cfg: &Config) -> Result<Self> {
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
    pub(crate) fn forward_fused(&self, x: &Tensor, f: &FusedCtx, residual: &Tensor) -> Result<Tensor> {
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
            self.o.products,
        )?;
        Ok(match &self.o.b {
            None => crate::fused::linear_residual(&y, &self.o.w, residual, self.o.products)?,
            Some(_) => (residual + self.o.apply(&y, true)?)?,
        })
    }

    /// x: (B, T, d); mask: additive (B|1, 1, T, S); cache: keys/values of earlier steps.
    pub(crate) fn forward(
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
            LayerCache::Ragged { caches, new_lens } => ragged_append(caches, new_lens, &k.contiguous()?, &v)?,
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

/// Each row of `k`/`v` (B, kv, T, hd) appends its own `new_lens[r]` positions to its own
/// cache; the rows' full keys and values are then zero-padded to the longest (the
/// caller's mask hides the padding).
fn ragged_append(
    caches: Vec<&mut candle_nn::kv_cache::KvCache>,
    new_lens: &[usize],
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let b = caches.len();
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
    Ok((pad(ks)?, pad(vs)?))
}

//! The layers: linear maps, RMSNorm, rotary tables, the SwiGLU MLP.

use super::*;

/// `x @ w^T (+ b)` for x of any rank ≥ 2.
#[derive(Debug, Clone)]
pub struct Linear {
    pub(crate) w: Tensor,
    pub(crate) b: Option<Tensor>,
    /// The number type of its fused products ([`Transformer::set_products`]).
    pub(crate) products: Products,
}

impl Linear {
    pub(crate) fn load(vb: &VarBuilder, out: usize, inp: usize, bias: bool) -> Result<Self> {
        let std = (1.0 / inp as f64).sqrt();
        let w = vb.get_with_hints((out, inp), "weight", Init::Randn { mean: 0.0, stdev: std })?;
        let b = if bias {
            Some(vb.get_with_hints(out, "bias", Init::Const(0.0))?)
        } else {
            None
        };
        Ok(Linear {
            w,
            b,
            products: Products::F32,
        })
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
    pub(crate) fn apply(&self, x: &Tensor, fused: bool) -> candle_core::Result<Tensor> {
        if !fused {
            return self.forward(x);
        }
        let y = crate::fused::linear(x, &self.w, self.products)?;
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// `x @ w^T` for x of rank ≥ 2, as one 2-D gemm. (A broadcast matmul would expand `w` per
/// batch row, and its backward would then materialise and reduce one weight gradient per
/// row: several times slower.)
pub(crate) fn matmul_t(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
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
    pub(crate) fn load(vb: &VarBuilder, dim: usize, eps: f64) -> Result<Self> {
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
    pub(crate) fn apply(&self, x: &Tensor, fused: bool) -> candle_core::Result<Tensor> {
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
    pub(crate) fn new(cfg: &Config, device: &Device) -> Result<Self> {
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
    pub(crate) fn apply(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
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

/// SwiGLU feed-forward: down(silu(gate(x)) * up(x)).
#[derive(Debug, Clone)]
pub(crate) struct Mlp {
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

impl Mlp {
    pub(crate) fn load(vb: &VarBuilder, d: usize, ff: usize, names: [&str; 3], bias: bool) -> Result<Self> {
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
    pub(crate) fn forward_fused(&self, x: &Tensor, residual: &Tensor) -> candle_core::Result<Tensor> {
        if self.gate.b.is_some() || self.up.b.is_some() || self.down.b.is_some() {
            return residual + self.apply(x, true)?;
        }
        let h = crate::fused::swiglu(x, &self.gate.w, &self.up.w, self.gate.products)?;
        crate::fused::linear_residual(&h, &self.down.w, residual, self.down.products)
    }

    /// [`Module::forward`], with SiLU·up as one fused op when `fused`.
    pub(crate) fn apply(&self, x: &Tensor, fused: bool) -> candle_core::Result<Tensor> {
        if fused {
            let h = crate::fused::silu_mul(&self.gate.apply(x, true)?, &self.up.apply(x, true)?)?;
            self.down.apply(&h, true)
        } else {
            self.forward(x)
        }
    }
}

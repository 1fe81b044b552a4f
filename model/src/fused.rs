//! Fused, differentiable CPU ops for the training forward: linear layers (also onto the
//! residual stream), SwiGLU, RMSNorm, SiLU·up, packed-sequence attention with the rotary
//! embedding inside, and the log-softmax gather of per-token logprobs.
//! Each is one candle custom op with its own backward (`streamrl_kernels::train`), where the
//! op-by-op versions in `model.rs` run a chain of small element-wise ops, each allocating
//! and, in backward, each saving its inputs. They compute the same functions; the model
//! uses them for f32 weights on the CPU ([`Transformer::set_fused_ops`]), and the tests
//! compare gradients of both paths.
//!
//! [`Transformer::set_fused_ops`]: crate::Transformer::set_fused_ops
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use streamrl_model::fused;
//!
//! let x = Tensor::new(&[[3f32, 4.0]], &Device::Cpu)?;
//! let w = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
//! let y = fused::rms_norm(&x, &w, 0.0)?.to_vec2::<f32>()?;
//! let r = (12.5f32).sqrt();
//! assert!((y[0][0] - 3.0 / r).abs() < 1e-6 && (y[0][1] - 8.0 / r).abs() < 1e-6);
//! # Ok::<(), candle_core::Error>(())
//! ```

use std::sync::Arc;

use candle_core::backend::BackendStorage as _;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Shape, Storage, Tensor};
use streamrl_kernels::{cpu, train};

type CResult<T> = candle_core::Result<T>;

/// Whether the fused ops can run on `t`: f32 on the CPU.
pub fn supported(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// Whether the fused logprobs ([`token_logprobs`], [`token_logprobs_entropy`]) can run on
/// `t`: f32 on the CPU, or on a CUDA device in a build with the `cuda` feature.
pub fn logprobs_supported(t: &Tensor) -> bool {
    supported(t) || (cfg!(feature = "cuda") && t.device().is_cuda() && t.dtype() == DType::F32)
}

fn slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> CResult<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{what}: f32 input expected, got {:?}", s.dtype())
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{what}: contiguous input expected, got strides {:?}", l.stride()),
    }
}

/// Runs `f` on the contiguous f32 data of `t` (a CPU tensor).
pub(crate) fn with<R>(t: &Tensor, what: &str, f: impl FnOnce(&[f32]) -> CResult<R>) -> CResult<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(c) => f(slice(c, l, what)?),
        _ => candle_core::bail!("{what}: CPU tensor expected"),
    }
}

fn tensor(v: Vec<f32>, shape: &Shape) -> CResult<Tensor> {
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// RMSNorm of every consecutive group of `w.len()` values (the last dimension, or the heads
/// packed in it): `x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    x.contiguous()?
        .apply_op2(&w.contiguous()?, RmsNormOp { eps: eps as f32 })
}

struct RmsNormOp {
    eps: f32,
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (x, w) = (slice(s1, l1, "rms_norm x")?, slice(s2, l2, "rms_norm weight")?);
        if w.is_empty() || l1.dims().last().is_none_or(|d| d % w.len() != 0) {
            candle_core::bail!("rms_norm: input {:?} against a weight of {}", l1.dims(), w.len())
        }
        let mut out = x.to_vec();
        cpu::rms_norm_rows_in_place(&mut out, w, self.eps);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, g: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let mut dx = vec![0f32; x.elem_count()];
        let mut dw = vec![0f32; w.elem_count()];
        with(x, "rms_norm x", |xs| {
            with(w, "rms_norm weight", |ws| {
                with(&g, "rms_norm grad", |gs| {
                    train::rms_norm_backward(xs, ws, self.eps, gs, &mut dx, &mut dw);
                    Ok(())
                })
            })
        })?;
        Ok((Some(tensor(dx, x.shape())?), Some(tensor(dw, w.shape())?)))
    }
}

/// `x @ wᵀ` for `x` of any rank ≥ 2 and a weight `w` `(out, in)`, as one product whose
/// backward writes the weight's gradient `(out, in)` directly (the op-by-op transpose
/// leaves a transposed view that must be copied before the optimizer can read it).
pub fn linear(x: &Tensor, w: &Tensor) -> CResult<Tensor> {
    // One graph node, whatever the rank: candle's backward pays a zero-filled buffer and an
    // addition for every node a gradient passes through, reshapes included.
    x.contiguous()?.apply_op2(&w.contiguous()?, LinearOp)
}

/// The shape of `x @ wᵀ` for `x` `(…, inp)` and a weight `(out, inp)`.
struct Product {
    rows: usize,
    out: usize,
    inp: usize,
    /// `x`'s shape with its last dimension replaced by `out`.
    shape: Shape,
}

impl Product {
    fn of(op: &str, x: &Layout, w: &Layout) -> CResult<Product> {
        let (dims, &[out, inp]) = (x.dims(), w.dims()) else {
            candle_core::bail!("{op}: the weight {:?} must be a matrix", w.dims())
        };
        if dims.last() != Some(&inp) {
            candle_core::bail!("{op}: input {dims:?} against a weight ({out}, {inp})")
        }
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("checked non-empty") = out;
        Ok(Product {
            rows: x.shape().elem_count() / inp.max(1),
            out,
            inp,
            shape: Shape::from(shape),
        })
    }
}

struct LinearOp;

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (x, w) = (slice(s1, l1, "linear x")?, slice(s2, l2, "linear weight")?);
        let p = Product::of("linear", l1, l2)?;
        let y = cpu::gemm_new(
            cpu::View::rows(x, p.rows, p.inp),
            cpu::View::rows(w, p.out, p.inp).t(),
            1.0,
        );
        Ok((CpuStorage::F32(y), p.shape))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, g: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (out, inp) = w.dims2()?;
        let rows = x.elem_count() / inp.max(1);
        let g = g.contiguous()?;
        let (dx, dw) = with(x, "linear x", |xs| {
            with(w, "linear weight", |ws| {
                with(&g, "linear grad", |gs| {
                    let gv = cpu::View::rows(gs, rows, out);
                    Ok((
                        cpu::gemm_new(gv, cpu::View::rows(ws, out, inp), 1.0),
                        cpu::gemm_new(gv.t(), cpu::View::rows(xs, rows, inp), 1.0),
                    ))
                })
            })
        })?;
        Ok((Some(tensor(dx, x.shape())?), Some(tensor(dw, w.shape())?)))
    }
}

/// `residual + x @ wᵀ`: a [`linear`] whose product accumulates onto the residual stream, one
/// graph node instead of two.
pub fn linear_residual(x: &Tensor, w: &Tensor, residual: &Tensor) -> CResult<Tensor> {
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &residual.contiguous()?, LinearResidualOp)
}

struct LinearResidualOp;

impl CustomOp3 for LinearResidualOp {
    fn name(&self) -> &'static str {
        "fused-linear-residual"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (x, w, r) = (
            slice(s1, l1, "linear x")?,
            slice(s2, l2, "linear weight")?,
            slice(s3, l3, "residual")?,
        );
        let Product { rows, out, inp, shape } = Product::of("linear + residual", l1, l2)?;
        if l3.dims() != shape.dims() {
            candle_core::bail!(
                "linear + residual: the product {:?} against a residual {:?}",
                shape.dims(),
                l3.dims()
            )
        }
        let mut y = r.to_vec();
        cpu::gemm(
            cpu::ViewMut::rows(&mut y, rows, out),
            cpu::View::rows(x, rows, inp),
            cpu::View::rows(w, out, inp).t(),
            true,
            1.0,
        );
        Ok((CpuStorage::F32(y), l3.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _r: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = LinearOp.bwd(x, w, _res, g)?;
        Ok((dx, dw, Some(g.clone())))
    }
}

/// The up half of a SwiGLU feed-forward, `silu(x @ gateᵀ) · (x @ upᵀ)`, as one graph node;
/// the two pre-activations are kept for the backward.
pub fn swiglu(x: &Tensor, gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op3(
        &gate.contiguous()?,
        &up.contiguous()?,
        SwigluOp {
            saved: std::sync::Mutex::new(None),
        },
    )
}

struct SwigluOp {
    /// The gate and up pre-activations of the forward, `(rows, ff)` each.
    saved: std::sync::Mutex<Option<(Vec<f32>, Vec<f32>)>>,
}

impl SwigluOp {
    fn pre(x: &[f32], gate: &[f32], up: &[f32], rows: usize, inp: usize, ff: usize) -> (Vec<f32>, Vec<f32>) {
        let xv = cpu::View::rows(x, rows, inp);
        (
            cpu::gemm_new(xv, cpu::View::rows(gate, ff, inp).t(), 1.0),
            cpu::gemm_new(xv, cpu::View::rows(up, ff, inp).t(), 1.0),
        )
    }
}

impl CustomOp3 for SwigluOp {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (x, gw, uw) = (
            slice(s1, l1, "swiglu x")?,
            slice(s2, l2, "gate weight")?,
            slice(s3, l3, "up weight")?,
        );
        let Product {
            rows,
            out: ff,
            inp,
            shape,
        } = Product::of("swiglu", l1, l2)?;
        if l3.dims() != l2.dims() {
            candle_core::bail!("swiglu: gate {:?} and up {:?} differ", l2.dims(), l3.dims())
        }
        let (g, u) = Self::pre(x, gw, uw, rows, inp, ff);
        let mut h = vec![0f32; g.len()];
        cpu::silu_mul(&g, &u, &mut h);
        *self
            .saved
            .lock()
            .map_err(|_| candle_core::Error::Msg("swiglu: poisoned".into()))? = Some((g, u));
        Ok((CpuStorage::F32(h), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        gh: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (ff, inp) = gate.dims2()?;
        let rows = x.elem_count() / inp.max(1);
        let gh = gh.contiguous()?;
        let (dx, dgw, duw) = with(x, "swiglu x", |xs| {
            with(gate, "gate weight", |gw| {
                with(up, "up weight", |uw| {
                    with(&gh, "swiglu grad", |ys| {
                        let saved = self
                            .saved
                            .lock()
                            .map_err(|_| candle_core::Error::Msg("swiglu: poisoned".into()))?;
                        let recomputed;
                        let (g, u) = match &*saved {
                            Some((g, u)) => (g, u),
                            None => {
                                recomputed = Self::pre(xs, gw, uw, rows, inp, ff);
                                (&recomputed.0, &recomputed.1)
                            }
                        };
                        let mut dg = vec![0f32; g.len()];
                        let mut du = vec![0f32; u.len()];
                        train::silu_mul_backward(g, u, ys, &mut dg, &mut du);
                        let (dgv, duv) = (cpu::View::rows(&dg, rows, ff), cpu::View::rows(&du, rows, ff));
                        let mut dx = cpu::gemm_new(dgv, cpu::View::rows(gw, ff, inp), 1.0);
                        cpu::gemm(
                            cpu::ViewMut::rows(&mut dx, rows, inp),
                            duv,
                            cpu::View::rows(uw, ff, inp),
                            true,
                            1.0,
                        );
                        let xv = cpu::View::rows(xs, rows, inp);
                        Ok((dx, cpu::gemm_new(dgv.t(), xv, 1.0), cpu::gemm_new(duv.t(), xv, 1.0)))
                    })
                })
            })
        })?;
        Ok((
            Some(tensor(dx, x.shape())?),
            Some(tensor(dgw, gate.shape())?),
            Some(tensor(duw, up.shape())?),
        ))
    }
}

/// `silu(gate) · up`, element-wise.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMulOp)
}

struct SiluMulOp;

impl CustomOp2 for SiluMulOp {
    fn name(&self) -> &'static str {
        "fused-silu-mul"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (g, u) = (slice(s1, l1, "silu_mul gate")?, slice(s2, l2, "silu_mul up")?);
        if l1.dims() != l2.dims() {
            candle_core::bail!("silu_mul: gate {:?} and up {:?} differ", l1.dims(), l2.dims())
        }
        let mut out = vec![0f32; g.len()];
        cpu::silu_mul(g, u, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(&self, g: &Tensor, u: &Tensor, _res: &Tensor, gy: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let gy = gy.contiguous()?;
        let mut dg = vec![0f32; g.elem_count()];
        let mut du = vec![0f32; u.elem_count()];
        with(g, "silu_mul gate", |gs| {
            with(u, "silu_mul up", |us| {
                with(&gy, "silu_mul grad", |ys| {
                    train::silu_mul_backward(gs, us, ys, &mut dg, &mut du);
                    Ok(())
                })
            })
        })?;
        Ok((Some(tensor(dg, g.shape())?), Some(tensor(du, u.shape())?)))
    }
}

/// Host copies of the rotary tables and a batch's positions, shared by every layer's
/// [`attention`] call of one forward.
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// `cos` of every position's angles, `(max_positions, head_dim / 2)`.
    pub cos: Arc<Vec<f32>>,
    /// `sin` of the same angles.
    pub sin: Arc<Vec<f32>>,
    /// Pairs `(x[2i], x[2i+1])` instead of `(x[i], x[i + half])`.
    pub interleaved: bool,
    /// Position of every token, row-major `(batch, seq)`.
    pub positions: Arc<Vec<u32>>,
}

/// The rotary embedding of `x` `(…, heads · head_dim)` at the tables' positions (one
/// head count per op; inside [`attention`]).
struct Rotary(RopeTables, usize);

impl Rotary {
    fn run(&self, x: &[f32], dims: &[usize], inverse: bool) -> CResult<Vec<f32>> {
        let (tokens, heads) = (self.0.positions.len(), self.1);
        let hd = x.len() / (tokens * heads).max(1);
        let half = hd / 2;
        let max = self.0.positions.iter().copied().max().unwrap_or(0) as usize;
        if tokens * heads * hd != x.len() || !hd.is_multiple_of(2) || (max + 1) * half > self.0.cos.len() {
            candle_core::bail!(
                "rope: input {dims:?} for {tokens} positions (largest {max}) of {heads} heads and a table of {} values",
                self.0.cos.len()
            )
        }
        let mut out = x.to_vec();
        train::rope(
            &mut out,
            &self.0.positions,
            heads,
            hd,
            &self.0.cos,
            &self.0.sin,
            self.0.interleaved,
            inverse,
        );
        Ok(out)
    }
}

/// Attention of packed rows: `q` `(batch, seq, heads · hd)`, `k` and `v`
/// `(batch, seq, kv_heads · hd)`, `mask` additive `(batch or 1, seq, seq)` (host copy, shared
/// by every layer). With `rope`, the rotary embedding of `q` and `k` is applied inside the
/// op (and undone on their gradients in the backward). Returns `(batch, seq, heads · hd)`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Arc<Vec<f32>>,
    heads: usize,
    kv: usize,
    scale: f64,
    rope: Option<&RopeTables>,
) -> CResult<Tensor> {
    let (b, t, width) = q.dims3()?;
    let hd = width / heads.max(1);
    let op = AttentionOp {
        shape: train::AttnShape {
            batch: b,
            seq: t,
            heads,
            kv_heads: kv,
            hd,
            scale: scale as f32,
        },
        mask,
        rope: rope.map(|r| (Rotary(r.clone(), heads), Rotary(r.clone(), kv))),
    };
    op.check(q.dims(), k.dims(), v.dims())?;
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

struct AttentionOp {
    shape: train::AttnShape,
    mask: Arc<Vec<f32>>,
    /// Rotary embedding of q and of k, when applied inside.
    rope: Option<(Rotary, Rotary)>,
}

impl AttentionOp {
    fn check(&self, q: &[usize], k: &[usize], v: &[usize]) -> CResult<()> {
        let s = &self.shape;
        let kv = [s.batch, s.seq, s.kv_heads * s.hd];
        let ok = q == [s.batch, s.seq, s.heads * s.hd]
            && k == kv
            && v == kv
            && s.kv_heads > 0
            && s.heads.is_multiple_of(s.kv_heads)
            && (self.mask.len() == s.seq * s.seq || self.mask.len() == s.batch * s.seq * s.seq);
        if !ok {
            candle_core::bail!(
                "attention: q {q:?}, k {k:?}, v {v:?} and a mask of {} values do not fit together",
                self.mask.len()
            )
        }
        Ok(())
    }
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        self.check(l1.dims(), l2.dims(), l3.dims())?;
        let (q, k, v) = (
            slice(s1, l1, "attention q")?,
            slice(s2, l2, "attention k")?,
            slice(s3, l3, "attention v")?,
        );
        let mut out = vec![0f32; q.len()];
        match &self.rope {
            Some((rq, rk)) => {
                let (q, k) = (rq.run(q, l1.dims(), false)?, rk.run(k, l2.dims(), false)?);
                train::attention_forward(self.shape, &q, &k, v, &self.mask, &mut out);
            }
            None => train::attention_forward(self.shape, q, k, v, &self.mask, &mut out),
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let mut dq = vec![0f32; q.elem_count()];
        let mut dk = vec![0f32; k.elem_count()];
        let mut dv = vec![0f32; v.elem_count()];
        with(q, "attention q", |qs| {
            with(k, "attention k", |ks| {
                with(v, "attention v", |vs| {
                    with(&g, "attention grad", |gs| match &self.rope {
                        Some((rq, rk)) => {
                            let (qr, kr) = (rq.run(qs, q.dims(), false)?, rk.run(ks, k.dims(), false)?);
                            train::attention_backward(
                                self.shape, &qr, &kr, vs, &self.mask, gs, &mut dq, &mut dk, &mut dv,
                            );
                            dq = rq.run(&dq, q.dims(), true)?;
                            dk = rk.run(&dk, k.dims(), true)?;
                            Ok(())
                        }
                        None => {
                            train::attention_backward(
                                self.shape, qs, ks, vs, &self.mask, gs, &mut dq, &mut dk, &mut dv,
                            );
                            Ok(())
                        }
                    })
                })
            })
        })?;
        Ok((
            Some(tensor(dq, q.shape())?),
            Some(tensor(dk, k.shape())?),
            Some(tensor(dv, v.shape())?),
        ))
    }
}

/// Per-token logprobs `(batch, seq)` of `tokens` under `logits` `(batch, seq, vocab)` at
/// `temperature`, aligned like [`crate::token_logprobs`] (column 0 is 0), without
/// materialising the log-softmax.
pub fn token_logprobs(logits: &Tensor, tokens: &Tensor, temperature: f64) -> CResult<Tensor> {
    logprobs_op(logits, tokens, temperature, None)
}

/// [`token_logprobs`] and, from the same pass over the logits, the entropy (nats) of
/// every next-token distribution at `temperature` `(batch, seq)`, aligned the same way
/// and not differentiated. Neither materialises the log-softmax.
pub fn token_logprobs_entropy(logits: &Tensor, tokens: &Tensor, temperature: f64) -> CResult<(Tensor, Tensor)> {
    let slot = Arc::new(std::sync::Mutex::new(None));
    let lp = logprobs_op(logits, tokens, temperature, Some(slot.clone()))?;
    let entropy = slot
        .lock()
        .map_err(|_| candle_core::Error::Msg("entropy slot poisoned".into()))?
        .take()
        .ok_or_else(|| candle_core::Error::Msg("token_logprobs_entropy: the forward wrote no entropy".into()))?;
    Ok((lp, entropy))
}

/// Where the fused logprobs op leaves the entropy it computed on the way.
type EntropySlot = Arc<std::sync::Mutex<Option<Tensor>>>;

fn logprobs_op(logits: &Tensor, tokens: &Tensor, temperature: f64, entropy: Option<EntropySlot>) -> CResult<Tensor> {
    let (b, t, vocab) = logits.dims3()?;
    let toks = tokens.flatten_all()?.to_vec1::<u32>()?;
    if toks.len() != b * t {
        candle_core::bail!("token_logprobs: {} tokens for logits {:?}", toks.len(), logits.dims())
    }
    if let Some(&bad) = toks.iter().find(|&&x| x as usize >= vocab) {
        candle_core::bail!("token_logprobs: token {bad} outside the vocabulary of {vocab}")
    }
    logits.contiguous()?.apply_op1(LogprobsOp {
        tokens: toks,
        temp: temperature as f32,
        entropy,
    })
}

struct LogprobsOp {
    tokens: Vec<u32>,
    temp: f32,
    entropy: Option<EntropySlot>,
}

impl CustomOp1 for LogprobsOp {
    fn name(&self) -> &'static str {
        "fused-token-logprobs"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let &[b, t, v] = l.dims() else {
            candle_core::bail!(
                "token_logprobs: logits (batch, seq, vocab) expected, got {:?}",
                l.dims()
            )
        };
        let mut out = vec![0f32; b * t];
        let logits = slice(s, l, "logits")?;
        match &self.entropy {
            None => train::logprobs_forward(logits, &self.tokens, b, t, v, self.temp, &mut out),
            Some(slot) => {
                let mut ent = vec![0f32; b * t];
                train::logprobs_entropy_forward(logits, &self.tokens, b, t, v, self.temp, &mut out, &mut ent);
                *slot
                    .lock()
                    .map_err(|_| candle_core::Error::Msg("entropy slot poisoned".into()))? =
                    Some(tensor(ent, &Shape::from((b, t)))?);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((b, t))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> CResult<(candle_core::CudaStorage, Shape)> {
        let &[b, t, _v] = l.dims() else {
            candle_core::bail!(
                "token_logprobs: logits (batch, seq, vocab) expected, got {:?}",
                l.dims()
            )
        };
        let (lp, ent) = crate::cuda::logprobs_fwd(s, l, &self.tokens, self.temp, self.entropy.is_some())?;
        if let (Some(slot), Some(ent)) = (&self.entropy, ent) {
            *slot
                .lock()
                .map_err(|_| candle_core::Error::Msg("entropy slot poisoned".into()))? = Some(Tensor::from_storage(
                Storage::Cuda(ent),
                (b, t),
                candle_core::op::BackpropOp::none(),
                false,
            ));
        }
        Ok((lp, Shape::from((b, t))))
    }

    fn bwd(&self, logits: &Tensor, _res: &Tensor, g: &Tensor) -> CResult<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if logits.device().is_cuda() {
            return Ok(Some(crate::cuda::logprobs_bwd(logits, &self.tokens, self.temp, g)?));
        }
        let (b, t, v) = logits.dims3()?;
        let g = g.contiguous()?;
        let mut d = vec![0f32; b * t * v];
        with(logits, "logits", |ls| {
            with(&g, "logprobs grad", |gs| {
                train::logprobs_backward(ls, &self.tokens, b, t, v, self.temp, gs, &mut d);
                Ok(())
            })
        })?;
        Ok(Some(tensor(d, logits.shape())?))
    }
}

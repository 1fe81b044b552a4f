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
use streamrl_kernels::bf16::{Operand, Products};
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

/// A fused op over two contiguous f32 CPU inputs, given to candle as a [`CustomOp2`] by
/// [`Op`], which takes the inputs out of candle's storages and makes tensors of the
/// gradients.
trait Fused2: Send + Sync {
    /// The op's name in candle's graph.
    const NAME: &'static str;
    /// The inputs, as errors name them.
    const INPUTS: [&'static str; 2];
    /// The output and its shape.
    fn forward(&self, x: [&[f32]; 2], l: [&Layout; 2]) -> CResult<(Vec<f32>, Shape)>;
    /// The inputs' gradients, each the size of its input, from the output's gradient `g`.
    fn backward(&self, x: [&[f32]; 2], dims: [&[usize]; 2], g: &[f32]) -> CResult<[Vec<f32>; 2]>;
}

/// [`Fused2`] with three inputs, for a [`CustomOp3`].
trait Fused3: Send + Sync {
    /// The op's name in candle's graph.
    const NAME: &'static str;
    /// The inputs, as errors name them.
    const INPUTS: [&'static str; 3];
    /// The output and its shape.
    fn forward(&self, x: [&[f32]; 3], l: [&Layout; 3]) -> CResult<(Vec<f32>, Shape)>;
    /// The inputs' gradients from the output's gradient `g`.
    fn backward(&self, x: [&[f32]; 3], dims: [&[usize]; 3], g: &[f32]) -> CResult<[Grad; 3]>;
}

/// One input's gradient from [`Fused3::backward`].
enum Grad {
    /// Computed values, the size of the input.
    Values(Vec<f32>),
    /// The output's gradient itself (an input added to the output as it is), passed on
    /// without a copy.
    Output,
}

/// A [`Fused2`] or [`Fused3`] as a candle op.
struct Op<T>(T);

impl<T: Fused2> CustomOp2 for Op<T> {
    fn name(&self) -> &'static str {
        T::NAME
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let [n1, n2] = T::INPUTS;
        let (y, shape) = self.0.forward([slice(s1, l1, n1)?, slice(s2, l2, n2)?], [l1, l2])?;
        Ok((CpuStorage::F32(y), shape))
    }

    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let [n1, n2] = T::INPUTS;
        let [da, db] = with(a, n1, |xa| {
            with(b, n2, |xb| {
                with(&g, T::NAME, |gs| self.0.backward([xa, xb], [a.dims(), b.dims()], gs))
            })
        })?;
        Ok((Some(tensor(da, a.shape())?), Some(tensor(db, b.shape())?)))
    }
}

impl<T: Fused3> CustomOp3 for Op<T> {
    fn name(&self) -> &'static str {
        T::NAME
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
        let [n1, n2, n3] = T::INPUTS;
        let x = [slice(s1, l1, n1)?, slice(s2, l2, n2)?, slice(s3, l3, n3)?];
        let (y, shape) = self.0.forward(x, [l1, l2, l3])?;
        Ok((CpuStorage::F32(y), shape))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let [n1, n2, n3] = T::INPUTS;
        let dims = [a.dims(), b.dims(), c.dims()];
        let [da, db, dc] = with(a, n1, |xa| {
            with(b, n2, |xb| {
                with(c, n3, |xc| {
                    with(&g, T::NAME, |gs| self.0.backward([xa, xb, xc], dims, gs))
                })
            })
        })?;
        let tensor_of = |d: Grad, input: &Tensor| match d {
            Grad::Values(v) => tensor(v, input.shape()).map(Some),
            Grad::Output => Ok(Some(g.clone())),
        };
        Ok((tensor_of(da, a)?, tensor_of(db, b)?, tensor_of(dc, c)?))
    }
}

/// RMSNorm of every consecutive group of `w.len()` values (the last dimension, or the heads
/// packed in it): `x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    x.contiguous()?
        .apply_op2(&w.contiguous()?, Op(RmsNorm { eps: eps as f32 }))
}

struct RmsNorm {
    eps: f32,
}

impl Fused2 for RmsNorm {
    const NAME: &'static str = "fused-rms-norm";
    const INPUTS: [&'static str; 2] = ["rms_norm x", "rms_norm weight"];

    fn forward(&self, [x, w]: [&[f32]; 2], [l1, _]: [&Layout; 2]) -> CResult<(Vec<f32>, Shape)> {
        if w.is_empty() || l1.dims().last().is_none_or(|d| d % w.len() != 0) {
            candle_core::bail!("rms_norm: input {:?} against a weight of {}", l1.dims(), w.len())
        }
        let mut out = x.to_vec();
        cpu::rms_norm_rows_in_place(&mut out, w, self.eps);
        Ok((out, l1.shape().clone()))
    }

    fn backward(&self, [x, w]: [&[f32]; 2], _: [&[usize]; 2], g: &[f32]) -> CResult<[Vec<f32>; 2]> {
        let (mut dx, mut dw) = (vec![0f32; x.len()], vec![0f32; w.len()]);
        train::rms_norm_backward(x, w, self.eps, g, &mut dx, &mut dw);
        Ok([dx, dw])
    }
}

/// `x @ wᵀ` for `x` of any rank ≥ 2 and a weight `w` `(out, in)`, as one product whose
/// backward writes the weight's gradient `(out, in)` directly (the op-by-op transpose
/// leaves a transposed view that must be copied before the optimizer can read it). The
/// forward's and both backward products are in `p`'s number type.
pub fn linear(x: &Tensor, w: &Tensor, p: Products) -> CResult<Tensor> {
    // One graph node, whatever the rank: candle's backward pays a zero-filled buffer and an
    // addition for every node a gradient passes through, reshapes included.
    x.contiguous()?.apply_op2(&w.contiguous()?, Op(Linear(p)))
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

struct Linear(Products);

impl Fused2 for Linear {
    const NAME: &'static str = "fused-linear";
    const INPUTS: [&'static str; 2] = ["linear x", "linear weight"];

    fn forward(&self, [x, w]: [&[f32]; 2], [l1, l2]: [&Layout; 2]) -> CResult<(Vec<f32>, Shape)> {
        let p = Product::of("linear", l1, l2)?;
        let y = self.0.gemm_new(
            cpu::View::rows(x, p.rows, p.inp),
            cpu::View::rows(w, p.out, p.inp).t(),
            1.0,
        );
        Ok((y, p.shape))
    }

    fn backward(&self, [x, w]: [&[f32]; 2], [_, wd]: [&[usize]; 2], g: &[f32]) -> CResult<[Vec<f32>; 2]> {
        let &[out, inp] = wd else {
            candle_core::bail!("linear: the weight {wd:?} must be a matrix")
        };
        let rows = x.len() / inp.max(1);
        // The output gradient converted once for both products.
        let gc = self.0.convert(cpu::View::rows(g, rows, out));
        let (w, x) = (cpu::View::rows(w, out, inp), cpu::View::rows(x, rows, inp));
        Ok([
            self.0.gemm_op_new(gc.all(), Operand::F32(w), 1.0),
            self.0.gemm_op_new(gc.all().t(), Operand::F32(x), 1.0),
        ])
    }
}

/// `residual + x @ wᵀ`: a [`linear`] whose product accumulates onto the residual stream, one
/// graph node instead of two.
pub fn linear_residual(x: &Tensor, w: &Tensor, residual: &Tensor, p: Products) -> CResult<Tensor> {
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &residual.contiguous()?, Op(LinearResidual(p)))
}

struct LinearResidual(Products);

impl Fused3 for LinearResidual {
    const NAME: &'static str = "fused-linear-residual";
    const INPUTS: [&'static str; 3] = ["linear x", "linear weight", "residual"];

    fn forward(&self, [x, w, r]: [&[f32]; 3], [l1, l2, l3]: [&Layout; 3]) -> CResult<(Vec<f32>, Shape)> {
        let Product { rows, out, inp, shape } = Product::of("linear + residual", l1, l2)?;
        if l3.dims() != shape.dims() {
            candle_core::bail!(
                "linear + residual: the product {:?} against a residual {:?}",
                shape.dims(),
                l3.dims()
            )
        }
        let mut y = r.to_vec();
        self.0.gemm(
            cpu::ViewMut::rows(&mut y, rows, out),
            cpu::View::rows(x, rows, inp),
            cpu::View::rows(w, out, inp).t(),
            true,
            1.0,
        );
        Ok((y, shape))
    }

    fn backward(&self, [x, w, _]: [&[f32]; 3], [xd, wd, _]: [&[usize]; 3], g: &[f32]) -> CResult<[Grad; 3]> {
        let [dx, dw] = Linear(self.0).backward([x, w], [xd, wd], g)?;
        Ok([Grad::Values(dx), Grad::Values(dw), Grad::Output])
    }
}

/// The up half of a SwiGLU feed-forward, `silu(x @ gateᵀ) · (x @ upᵀ)`, as one graph node;
/// the two pre-activations are kept for the backward.
pub fn swiglu(x: &Tensor, gate: &Tensor, up: &Tensor, p: Products) -> CResult<Tensor> {
    let op = Swiglu {
        saved: std::sync::Mutex::new(None),
        products: p,
    };
    x.contiguous()?
        .apply_op3(&gate.contiguous()?, &up.contiguous()?, Op(op))
}

struct Swiglu {
    /// The gate and up pre-activations of the forward, `(rows, ff)` each.
    saved: std::sync::Mutex<Option<(Vec<f32>, Vec<f32>)>>,
    /// The number type of its products.
    products: Products,
}

impl Swiglu {
    fn pre(&self, x: &[f32], gate: &[f32], up: &[f32], rows: usize, inp: usize, ff: usize) -> (Vec<f32>, Vec<f32>) {
        // The input converted once for both products.
        let xc = self.products.convert(cpu::View::rows(x, rows, inp));
        let weight = |w| Operand::F32(cpu::View::rows(w, ff, inp).t());
        (
            self.products.gemm_op_new(xc.all(), weight(gate), 1.0),
            self.products.gemm_op_new(xc.all(), weight(up), 1.0),
        )
    }
}

impl Fused3 for Swiglu {
    const NAME: &'static str = "fused-swiglu";
    const INPUTS: [&'static str; 3] = ["swiglu x", "gate weight", "up weight"];

    fn forward(&self, [x, gw, uw]: [&[f32]; 3], [l1, l2, l3]: [&Layout; 3]) -> CResult<(Vec<f32>, Shape)> {
        let Product {
            rows,
            out: ff,
            inp,
            shape,
        } = Product::of("swiglu", l1, l2)?;
        if l3.dims() != l2.dims() {
            candle_core::bail!("swiglu: gate {:?} and up {:?} differ", l2.dims(), l3.dims())
        }
        let (g, u) = self.pre(x, gw, uw, rows, inp, ff);
        let mut h = vec![0f32; g.len()];
        cpu::silu_mul(&g, &u, &mut h);
        *self
            .saved
            .lock()
            .map_err(|_| candle_core::Error::Msg("swiglu: poisoned".into()))? = Some((g, u));
        Ok((h, shape))
    }

    fn backward(&self, [xs, gw, uw]: [&[f32]; 3], [_, gd, _]: [&[usize]; 3], ys: &[f32]) -> CResult<[Grad; 3]> {
        let &[ff, inp] = gd else {
            candle_core::bail!("swiglu: the gate weight {gd:?} must be a matrix")
        };
        let rows = xs.len() / inp.max(1);
        let saved = self
            .saved
            .lock()
            .map_err(|_| candle_core::Error::Msg("swiglu: poisoned".into()))?;
        let recomputed;
        let (g, u) = match &*saved {
            Some((g, u)) => (g, u),
            None => {
                recomputed = self.pre(xs, gw, uw, rows, inp, ff);
                (&recomputed.0, &recomputed.1)
            }
        };
        let mut dg = vec![0f32; g.len()];
        let mut du = vec![0f32; u.len()];
        train::silu_mul_backward(g, u, ys, &mut dg, &mut du);
        // Each gradient and the input converted once for the products that read them.
        let p = self.products;
        let (dgc, duc) = (
            p.convert(cpu::View::rows(&dg, rows, ff)),
            p.convert(cpu::View::rows(&du, rows, ff)),
        );
        let xc = p.convert(cpu::View::rows(xs, rows, inp));
        let mut dx = p.gemm_op_new(dgc.all(), Operand::F32(cpu::View::rows(gw, ff, inp)), 1.0);
        p.gemm_op(
            cpu::ViewMut::rows(&mut dx, rows, inp),
            duc.all(),
            Operand::F32(cpu::View::rows(uw, ff, inp)),
            true,
            1.0,
        );
        Ok([
            Grad::Values(dx),
            Grad::Values(p.gemm_op_new(dgc.all().t(), xc.all(), 1.0)),
            Grad::Values(p.gemm_op_new(duc.all().t(), xc.all(), 1.0)),
        ])
    }
}

/// `silu(gate) · up`, element-wise.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, Op(SiluMul))
}

struct SiluMul;

impl Fused2 for SiluMul {
    const NAME: &'static str = "fused-silu-mul";
    const INPUTS: [&'static str; 2] = ["silu_mul gate", "silu_mul up"];

    fn forward(&self, [g, u]: [&[f32]; 2], [l1, l2]: [&Layout; 2]) -> CResult<(Vec<f32>, Shape)> {
        if l1.dims() != l2.dims() {
            candle_core::bail!("silu_mul: gate {:?} and up {:?} differ", l1.dims(), l2.dims())
        }
        let mut out = vec![0f32; g.len()];
        cpu::silu_mul(g, u, &mut out);
        Ok((out, l1.shape().clone()))
    }

    fn backward(&self, [g, u]: [&[f32]; 2], _: [&[usize]; 2], gy: &[f32]) -> CResult<[Vec<f32>; 2]> {
        let (mut dg, mut du) = (vec![0f32; g.len()], vec![0f32; u.len()]);
        train::silu_mul_backward(g, u, gy, &mut dg, &mut du);
        Ok([dg, du])
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
/// Its products are in `products`' number type (see [`train::AttnShape::products`]).
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
    products: Products,
) -> CResult<Tensor> {
    let (b, t, width) = q.dims3()?;
    let hd = width / heads.max(1);
    let op = Attention {
        shape: train::AttnShape {
            batch: b,
            seq: t,
            heads,
            kv_heads: kv,
            hd,
            scale: scale as f32,
            products,
        },
        mask,
        rope: rope.map(|r| (Rotary(r.clone(), heads), Rotary(r.clone(), kv))),
    };
    op.check(q.dims(), k.dims(), v.dims())?;
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, Op(op))
}

struct Attention {
    shape: train::AttnShape,
    mask: Arc<Vec<f32>>,
    /// Rotary embedding of q and of k, when applied inside.
    rope: Option<(Rotary, Rotary)>,
}

impl Attention {
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

impl Fused3 for Attention {
    const NAME: &'static str = "fused-attention";
    const INPUTS: [&'static str; 3] = ["attention q", "attention k", "attention v"];

    fn forward(&self, [q, k, v]: [&[f32]; 3], [l1, l2, l3]: [&Layout; 3]) -> CResult<(Vec<f32>, Shape)> {
        self.check(l1.dims(), l2.dims(), l3.dims())?;
        let mut out = vec![0f32; q.len()];
        match &self.rope {
            Some((rq, rk)) => {
                let (q, k) = (rq.run(q, l1.dims(), false)?, rk.run(k, l2.dims(), false)?);
                train::attention_forward(self.shape, &q, &k, v, &self.mask, &mut out);
            }
            None => train::attention_forward(self.shape, q, k, v, &self.mask, &mut out),
        }
        Ok((out, l1.shape().clone()))
    }

    fn backward(&self, [qs, ks, vs]: [&[f32]; 3], [qd, kd, _]: [&[usize]; 3], gs: &[f32]) -> CResult<[Grad; 3]> {
        let mut dq = vec![0f32; qs.len()];
        let mut dk = vec![0f32; ks.len()];
        let mut dv = vec![0f32; vs.len()];
        match &self.rope {
            Some((rq, rk)) => {
                let (qr, kr) = (rq.run(qs, qd, false)?, rk.run(ks, kd, false)?);
                train::attention_backward(self.shape, &qr, &kr, vs, &self.mask, gs, &mut dq, &mut dk, &mut dv);
                dq = rq.run(&dq, qd, true)?;
                dk = rk.run(&dk, kd, true)?;
            }
            None => train::attention_backward(self.shape, qs, ks, vs, &self.mask, gs, &mut dq, &mut dk, &mut dv),
        }
        Ok([Grad::Values(dq), Grad::Values(dk), Grad::Values(dv)])
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

impl LogprobsOp {
    /// The kernels' view of `logits` `(batch, seq, vocab)` scoring this op's tokens.
    fn rows<'a>(&'a self, logits: &'a [f32], [batch, seq, vocab]: [usize; 3]) -> train::TokenLogits<'a> {
        train::TokenLogits {
            logits,
            tokens: &self.tokens,
            batch,
            seq,
            vocab,
            temp: self.temp,
        }
    }
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
            None => train::logprobs_forward(self.rows(logits, [b, t, v]), &mut out),
            Some(slot) => {
                let mut ent = vec![0f32; b * t];
                train::logprobs_entropy_forward(self.rows(logits, [b, t, v]), &mut out, &mut ent);
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
                train::logprobs_backward(self.rows(ls, [b, t, v]), gs, &mut d);
                Ok(())
            })
        })?;
        Ok(Some(tensor(d, logits.shape())?))
    }
}

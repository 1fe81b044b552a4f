//! Launchers of streamrl's CUDA kernels (`streamrl_kernels::RL_PTX`, from
//! `kernels/cuda/rl.cu`) on candle's CUDA device: the selective log-softmax with entropy
//! and its backward (the fused logprobs op's CUDA half), the masked IS loss, and AdamW.
//! Each computes what its CPU twin computes; `crate::parity` checks that on a GPU.
//!
//! Only with the `cuda` feature. Kernel launches are `unsafe` (the argument list must match
//! the kernel's signature, and the buffers the lengths it indexes): each says why it holds.
#![allow(unsafe_code)]

use candle_core::backend::BackendStorage as _;
use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, Layout, Result, Shape, Storage, Tensor};

use crate::loss::{MAX_LOG_RATIO, MaskedIsTotals};

/// The module name the PTX is loaded under (once per device).
const MODULE: &str = "streamrl_rl";

/// Loads kernel `name` of the RL module on `dev` (the module once per device).
macro_rules! func {
    ($dev:expr, $name:literal) => {
        $dev.get_or_load_custom_func($name, MODULE, streamrl_kernels::RL_PTX)?
    };
}

/// Threads per block for a reduction over `n` values: a multiple of 32, at most 1024.
fn threads(n: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// One block per row of `width` values (the log-softmax kernels).
fn per_row(rows: usize, width: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads(width), 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The contiguous f32 data of a CUDA storage.
fn view<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, f32>> {
    let slice = s.as_cuda_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(slice.slice(a..b)),
        None => candle_core::bail!("{what}: contiguous input expected, got strides {:?}", l.stride()),
    }
}

/// Runs `f` on the CUDA storage of `t` (contiguous f32).
fn with_cuda<R>(t: &Tensor, what: &str, f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cuda(c) => f(c, l),
        _ => candle_core::bail!("{what}: CUDA tensor expected"),
    }
}

/// Selective log-softmax forward: logprobs `(b, t)` and, with `entropy`, the entropies.
pub(crate) fn logprobs_fwd(
    s: &CudaStorage,
    l: &Layout,
    tokens: &[u32],
    temp: f32,
    entropy: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let (b, t, v) = l.shape().dims3()?;
    let dev = s.device().clone();
    let logits = view(s, l, "logits")?;
    let toks = dev.clone_htod(tokens)?;
    let lp = dev.alloc_zeros::<f32>(b * t)?;
    let ent = dev.alloc_zeros::<f32>(if entropy { b * t } else { 1 })?;
    let f = func!(dev, "token_logprobs_fwd");
    let cfg = per_row(b * t, v);
    let mut a = f.builder();
    a.arg(&logits);
    a.arg(&toks);
    a.arg(&lp);
    a.arg(&ent);
    let (with, seq, vocab, inv) = (entropy as u32, t as u32, v as u32, 1.0 / temp);
    a.arg(&with);
    a.arg(&seq);
    a.arg(&vocab);
    a.arg(&inv);
    // SAFETY: the argument list matches the kernel's signature; every buffer has the
    // length the kernel indexes (b·t·v logits, b·t tokens and outputs).
    unsafe { a.launch(cfg) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(lp, dev.clone()),
        entropy.then(|| CudaStorage::wrap_cuda_slice(ent, dev)),
    ))
}

/// Selective log-softmax backward: `dlogits` of the logits' shape.
pub(crate) fn logprobs_bwd(logits: &Tensor, tokens: &[u32], temp: f32, g: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    let g = g.contiguous()?;
    let d = with_cuda(logits, "logits", |s, l| {
        with_cuda(&g, "logprobs gradient", |gs, gl| {
            let dev = s.device().clone();
            let x = view(s, l, "logits")?;
            let gv = view(gs, gl, "logprobs gradient")?;
            let toks = dev.clone_htod(tokens)?;
            let d = dev.alloc_zeros::<f32>(b * t * v)?;
            let f = func!(dev, "token_logprobs_bwd");
            let cfg = per_row(b * t, v);
            let mut a = f.builder();
            a.arg(&x);
            a.arg(&toks);
            a.arg(&gv);
            a.arg(&d);
            let (seq, vocab, inv) = (t as u32, v as u32, 1.0 / temp);
            a.arg(&seq);
            a.arg(&vocab);
            a.arg(&inv);
            // SAFETY: as in `logprobs_fwd`; `d` has b·t·v values.
            unsafe { a.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(d, dev))
        })
    })?;
    Ok(Tensor::from_storage(
        Storage::Cuda(d),
        (b, t, v),
        BackpropOp::none(),
        false,
    ))
}

/// The masked IS loss over CUDA logprobs: the six totals and every token's gradient
/// (before dividing by the denominator), in one kernel.
pub(crate) fn masked_is(
    lp: &Tensor,
    sampler: &[f32],
    adv: &[f32],
    mask: &[f32],
    low: f32,
    high: f32,
    kl_tau: f32,
) -> Result<(MaskedIsTotals, Tensor)> {
    let n = lp.dims1()?;
    let lp = lp.contiguous()?;
    let (grad, totals) = with_cuda(&lp, "logprobs", |s, l| {
        let dev = s.device().clone();
        let x = view(s, l, "logprobs")?;
        let (mu, ad, ma) = (dev.clone_htod(sampler)?, dev.clone_htod(adv)?, dev.clone_htod(mask)?);
        let grad = dev.alloc_zeros::<f32>(n.max(1))?;
        let out = dev.alloc_zeros::<f32>(6)?;
        let f = func!(dev, "masked_is_loss");
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (threads(n), 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = f.builder();
        a.arg(&x);
        a.arg(&mu);
        a.arg(&ad);
        a.arg(&ma);
        a.arg(&grad);
        a.arg(&out);
        let nn = n as u32;
        a.arg(&nn);
        a.arg(&low);
        a.arg(&high);
        a.arg(&kl_tau);
        a.arg(&MAX_LOG_RATIO);
        // SAFETY: n values in every per-token buffer, six in `out`.
        unsafe { a.launch(cfg) }.w()?;
        let totals = dev.clone_dtoh(&out)?;
        Ok((CudaStorage::wrap_cuda_slice(grad, dev), totals))
    })?;
    let grad = Tensor::from_storage(Storage::Cuda(grad), n.max(1), BackpropOp::none(), false).narrow(0, 0, n)?;
    Ok((
        MaskedIsTotals {
            loss: totals[0],
            tokens: totals[1],
            low: totals[2],
            high: totals[3],
            kl: totals[4],
            max_abs: totals[5],
        },
        grad,
    ))
}

/// A CUDA scalar holding `value`, on the device of `like`.
pub(crate) fn scalar(like: &CudaStorage, value: f32) -> Result<(CudaStorage, Shape)> {
    let dev = like.device().clone();
    let s: CudaSlice<f32> = dev.clone_htod(&[value])?;
    Ok((CudaStorage::wrap_cuda_slice(s, dev), Shape::from(())))
}

/// One AdamW update of `theta` in place (CUDA, f32, contiguous), its moments `m` and `v`
/// updated in place too.
pub(crate) fn adamw(
    theta: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: streamrl_kernels::train::AdamW,
) -> Result<()> {
    let n = theta.elem_count();
    for (what, t) in [("gradient", g), ("first moment", m), ("second moment", v)] {
        if t.elem_count() != n || !t.is_contiguous() {
            candle_core::bail!(
                "adamw: {what} has {} values (contiguous: {}) for {n}",
                t.elem_count(),
                t.is_contiguous()
            )
        }
    }
    let launch = |ts: &CudaStorage, tl: &Layout| -> Result<()> {
        with_cuda(g, "gradient", |gs, gl| {
            with_cuda(m, "first moment", |ms, ml| {
                with_cuda(v, "second moment", |vs, vl| {
                    let dev = ts.device().clone();
                    let f = func!(dev, "adamw");
                    let cfg = LaunchConfig::for_num_elems(n as u32);
                    let mut a = f.builder();
                    let (tv, gv, mv, vv) = (
                        view(ts, tl, "theta")?,
                        view(gs, gl, "gradient")?,
                        view(ms, ml, "m")?,
                        view(vs, vl, "v")?,
                    );
                    a.arg(&tv);
                    a.arg(&gv);
                    a.arg(&mv);
                    a.arg(&vv);
                    let nn = n as u32;
                    a.arg(&nn);
                    for x in [
                        &h.lr, &h.decay, &h.beta1, &h.beta2, &h.scale_m, &h.scale_v, &h.eps, &h.clip,
                    ] {
                        a.arg(x);
                    }
                    // SAFETY: four buffers of n values. The kernel writes theta, m and v in
                    // place through views candle hands out read-only: device memory no
                    // host reference aliases, used by no other kernel meanwhile (one stream).
                    unsafe { a.launch(cfg) }.w()?;
                    Ok(())
                })
            })
        })
    };
    with_cuda(theta, "theta", launch)
}

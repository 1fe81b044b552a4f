//! CPU kernels over plain `f32` slices, the building blocks of the model's inference
//! forward (`streamrl_model::infer`): matrix products through the `gemm` crate (the
//! kernels candle calls), and row-wise loops for the rest. Row-major everywhere; every
//! function says the shapes it reads and writes.
//!
//! ```
//! use streamrl_kernels::cpu;
//!
//! // A checkpoint's (out 3, in 2) weight, transposed once to (in, out) for `matmul`.
//! let w = cpu::transpose(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0], 3, 2);
//! // y (2, 3) = x (2, 2) @ w.
//! let x = [1.0, 2.0, 3.0, 4.0];
//! let mut y = [0.0; 6];
//! cpu::matmul(&x, 2, &w, 2, 3, &mut y, false, 1);
//! assert_eq!(y, [1.0, 2.0, 3.0, 3.0, 4.0, 7.0]);
//! ```

mod attend;
pub use attend::{Cached, KEY_BLOCK, KvLayout, attend};

/// Runs `f` compiled for the widest instruction set this CPU has (AVX-512, AVX2 + FMA, or
/// the baseline), chosen at run time, so that plain loops inside it auto-vectorise to it.
/// The closure and the helpers called inside must be `#[inline(always)]` (write
/// `vectorized(#[inline(always)] || …)`) to be compiled the same way: a closure the
/// compiler keeps as a function of its own runs with the baseline's instructions.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

/// Runs `f` compiled with fused multiply-add (and AVX2) where this CPU has them, so that
/// `f32::mul_add` inside is one instruction rather than a call to the C library's `fmaf`
/// (40× slower; [`vectorized`] does not give closures FMA). Both round once, so the results
/// are the same either way. The closure and the helpers called inside must be
/// `#[inline(always)]` (write `with_fma(#[inline(always)] || …)`): a closure left out of
/// line is compiled without FMA, which made the training attention 4× slower.
#[inline(always)]
#[allow(unsafe_code)]
pub fn with_fma<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        #[target_feature(enable = "avx2,fma")]
        fn run<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        // SAFETY: the CPU has both features, checked just above.
        return unsafe { run(f) };
    }
    f()
}

/// Whether this CPU has AVX2 and fused multiply-add ([`with_fma`]'s instructions, and
/// [`weighted_sum`]'s).
#[inline(always)]
pub fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `e^x` without a branch or a library call, so that loops over it vectorise: Cody–Waite
/// range reduction and a degree-6 polynomial, within 3e-7 relative of e^x (2 ulp); 0 below
/// −87.3, and clamped to `e^88.3` above (finite).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round to nearest by the 1.5 · 2^23 trick (exact for |k| < 2^22).
    const ROUND: f32 = 12_582_912.0;
    let under = x < -87.3;
    let x = x.clamp(-87.3, 88.3);
    let rounded = x * LOG2E + ROUND;
    let k = rounded - ROUND;
    let r = x - k * LN2_HI - k * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^k from k's integer, read off `rounded`'s low bits (its bits are ROUND's plus k),
    // with wrapping integer arithmetic only: a float-to-int cast (scalar, with its
    // saturation fix-ups) or an overflow check (debug builds) kept loops over `exp` from
    // vectorising, at 2.3–4× the time.
    let k_bits = rounded.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(k_bits.wrapping_add(127) << 23);
    if under { 0.0 } else { p * scale }
}

/// The transpose of a row-major `(rows, cols)` matrix, row-major `(cols, rows)`.
pub fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(
        m.len(),
        rows * cols,
        "transpose: {} elements for {rows}×{cols}",
        m.len()
    );
    let mut t = vec![0f32; m.len()];
    // In 32 × 32 tiles, so that reads and writes both stay in cache.
    const TILE: usize = 32;
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    t[c * rows + r] = m[r * cols + c];
                }
            }
        }
    }
    t
}

/// `dst (n, out) = x (n, inp) @ w`, or `+=` when `accumulate`; `w` is `(inp, out)`
/// row-major, i.e. a checkpoint's `(out, inp)` weight [transposed](transpose) once at load
/// (10–40% faster than reading it transposed: gemm packs less). `threads > 1` splits the
/// work with rayon.
///
/// **Batch-invariant**: a row of `dst` comes out the same, to the bit, whatever `n` is and
/// whichever rows share the call (see [`gemm()`] on the lone row), so one sequence decoded
/// alone, decoded beside others, or recomputed by the training forward over all its
/// positions at once gets the same numbers.
///
/// # Panics
/// When a slice is shorter than its shape.
#[allow(clippy::too_many_arguments)]
#[allow(unsafe_code)]
pub fn matmul(
    x: &[f32],
    n: usize,
    w: &[f32],
    inp: usize,
    out: usize,
    dst: &mut [f32],
    accumulate: bool,
    threads: usize,
) {
    assert!(
        x.len() >= n * inp && w.len() >= out * inp && dst.len() >= n * out,
        "matmul: x {} (need {n}×{inp}), w {} (need {inp}×{out}), dst {} (need {n}×{out})",
        x.len(),
        w.len(),
        dst.len()
    );
    if n == 0 || out == 0 {
        return;
    }
    if inp == 0 {
        if !accumulate {
            dst[..n * out].fill(0.0);
        }
        return;
    }
    if n == 1 {
        // gemm's matrix-vector path sums in another order than its kernels for two rows
        // and more: take their order, by streaming the weight once in their depth blocks
        // (as fast as that path) where they are known, else by computing the row twice.
        match depth_block(inp) {
            Some(kc) => lone_row(&x[..inp], w, inp, out, kc, &mut dst[..out], accumulate),
            None => {
                let two = lone_row_twice(&x[..inp]);
                let mut dst2 = vec![0f32; 2 * out];
                if accumulate {
                    dst2[..out].copy_from_slice(&dst[..out]);
                    dst2[out..].copy_from_slice(&dst[..out]);
                }
                matmul(&two, 2, w, inp, out, &mut dst2, accumulate, threads);
                dst[..out].copy_from_slice(&dst2[..out]);
            }
        }
        return;
    }
    if threads <= 1 {
        // One thread asked for: the product still spreads over idle cores inside
        // `cores::spread` (the same bits), as a training step's do.
        let a = View::rows(&x[..n * inp], n, inp);
        let b = View::rows(&w[..inp * out], inp, out);
        // SAFETY: dst holds n × out elements (the assert above) with row stride `out`
        // and column stride 1, a distinct &mut borrow that overlaps neither view; the
        // views lie inside their slices; inp > 0 (returned above otherwise).
        unsafe { gemm_raw(dst.as_mut_ptr(), out, 1, a, b, accumulate, 1.0) };
        return;
    }
    let par = gemm::Parallelism::Rayon(threads);
    // SAFETY: the assert above keeps every access in bounds: dst is n × out with row
    // stride `out` and column stride 1; x is n × inp with row stride `inp`; w is inp × out
    // with row stride `out` and column stride 1. dst is a distinct &mut borrow, so it
    // overlaps neither input.
    unsafe {
        gemm::gemm(
            n,
            out,
            inp,
            dst.as_mut_ptr(),
            1,
            out as isize,
            accumulate,
            x.as_ptr(),
            1,
            inp as isize,
            w.as_ptr(),
            1,
            out as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// A strided matrix over a slice: element `(r, c)` is `data[r * rs + c * cs]`. Views of
/// one head inside a `(tokens, heads, hd)` activation, or of a transpose, cost nothing.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    /// The elements, from the view's first.
    pub data: &'a [f32],
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix.
    pub cols: usize,
    /// Distance between consecutive rows, in elements.
    pub rs: usize,
    /// Distance between consecutive columns, in elements.
    pub cs: usize,
}

impl<'a> View<'a> {
    /// A row-major `(rows, cols)` matrix starting at `data[0]`.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> Self {
        View::block(data, rows, cols, cols)
    }

    /// A `(rows, cols)` block starting at `data[0]` of a row-major matrix whose rows are
    /// `rs` elements apart.
    pub fn block(data: &'a [f32], rows: usize, cols: usize, rs: usize) -> Self {
        View {
            data,
            rows,
            cols,
            rs,
            cs: 1,
        }
    }

    /// The transpose (swaps the shape and the strides; no copy).
    pub fn t(self) -> Self {
        View {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// The mutable counterpart of [`View`], the destination of [`gemm()`].
#[derive(Debug)]
pub struct ViewMut<'a> {
    /// The elements, from the view's first.
    pub data: &'a mut [f32],
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix.
    pub cols: usize,
    /// Distance between consecutive rows, in elements.
    pub rs: usize,
    /// Distance between consecutive columns, in elements.
    pub cs: usize,
}

impl<'a> ViewMut<'a> {
    /// A row-major `(rows, cols)` matrix starting at `data[0]`.
    pub fn rows(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        ViewMut::block(data, rows, cols, cols)
    }

    /// The mutable counterpart of [`View::block`].
    pub fn block(data: &'a mut [f32], rows: usize, cols: usize, rs: usize) -> Self {
        ViewMut {
            data,
            rows,
            cols,
            rs,
            cs: 1,
        }
    }
}

/// The last element a `(rows, cols)` view with these strides touches, plus one.
pub(crate) fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// `dst = scale · a @ b`, or `dst += scale · a @ b` when `accumulate`, over strided views
/// (single-threaded).
///
/// Every row of `dst` comes out the same, to the bit, whatever the number of rows: gemm's
/// kernels for two rows and more sum each element in one order (fused multiply-adds along
/// the inner dimension, in depth blocks that depend on that dimension only), but a lone
/// row takes its matrix-vector path, which sums in another; so a lone row is computed as
/// two copies of itself.
///
/// # Panics
/// When the shapes disagree or a view reaches past its slice.
#[allow(unsafe_code)]
pub fn gemm(dst: ViewMut<'_>, a: View<'_>, b: View<'_>, accumulate: bool, scale: f32) {
    check_gemm(dst.data.len(), dst.rows, dst.cols, dst.rs, dst.cs, a, b);
    if dst.rows == 0 || dst.cols == 0 {
        return;
    }
    if a.rows == 1 && a.cols > 0 {
        let cols = dst.cols;
        let mut two = vec![0f32; 2 * cols];
        if accumulate {
            for c in 0..cols {
                two[c] = dst.data[c * dst.cs];
                two[cols + c] = two[c];
            }
        }
        let row = lone_row_twice(&(0..a.cols).map(|c| a.data[c * a.cs]).collect::<Vec<_>>());
        gemm(
            ViewMut::rows(&mut two, 2, cols),
            View::rows(&row, 2, a.cols),
            b,
            accumulate,
            scale,
        );
        for (c, &v) in two[..cols].iter().enumerate() {
            dst.data[c * dst.cs] = v;
        }
        return;
    }
    if a.cols == 0 {
        if !accumulate {
            for r in 0..dst.rows {
                for c in 0..dst.cols {
                    dst.data[r * dst.rs + c * dst.cs] = 0.0;
                }
            }
        }
        return;
    }
    // SAFETY: check_gemm keeps every access of all three views inside its slice; dst is a
    // distinct &mut borrow, so it overlaps neither input.
    unsafe { gemm_raw(dst.data.as_mut_ptr(), dst.rs, dst.cs, a, b, accumulate, scale) }
}

/// Asserts that `a @ b` fits a `(rows, cols)` destination of `len` elements with these
/// strides and that each view stays inside its slice.
pub(crate) fn check_gemm(len: usize, rows: usize, cols: usize, rs: usize, cs: usize, a: View<'_>, b: View<'_>) {
    assert!(
        a.cols == b.rows && rows == a.rows && cols == b.cols,
        "gemm: ({}×{}) @ ({}×{}) into ({rows}×{cols})",
        a.rows,
        a.cols,
        b.rows,
        b.cols
    );
    for (what, len, need) in [
        ("a", a.data.len(), extent(a.rows, a.cols, a.rs, a.cs)),
        ("b", b.data.len(), extent(b.rows, b.cols, b.rs, b.cs)),
        ("dst", len, extent(rows, cols, rs, cs)),
    ] {
        assert!(
            len >= need,
            "gemm: view {what} reaches element {need} of a slice of {len}"
        );
    }
}

/// # Safety
/// `dst` must be valid for writes (and, when `accumulate`, reads) of every element of an
/// `(a.rows, b.cols)` matrix with strides `rs`, `cs`, overlapping neither view; the views
/// must stay inside their slices; `a.cols > 0`.
#[allow(unsafe_code)]
unsafe fn gemm_raw(dst: *mut f32, rs: usize, cs: usize, a: View<'_>, b: View<'_>, accumulate: bool, scale: f32) {
    // Spread over idle cores (inside `cores::spread`) when the product is worth a hand-off
    // to the pool: gemm splits the output among threads, each element summed as alone.
    let threads = crate::cores::threads();
    if threads > 1 && a.rows * b.cols * a.cols >= 1 << 20 {
        /// The destination pointer, sent to the pool thread that runs the product while
        /// the caller waits for it.
        struct Dst(*mut f32);
        // SAFETY: the caller blocks in `install` until the product is done, and its
        // contract gives the product sole access to dst meanwhile.
        #[allow(unsafe_code)]
        unsafe impl Send for Dst {}
        let dst = Dst(dst);
        crate::cores::pool().install(move || {
            let dst = dst;
            // SAFETY: forwarded from the caller's contract; the caller waits.
            unsafe {
                gemm_call(
                    dst.0,
                    rs,
                    cs,
                    a,
                    b,
                    accumulate,
                    scale,
                    gemm::Parallelism::Rayon(threads),
                )
            }
        });
        return;
    }
    // SAFETY: forwarded from the caller's contract.
    unsafe { gemm_call(dst, rs, cs, a, b, accumulate, scale, gemm::Parallelism::None) }
}

/// [`gemm_raw`] with its parallelism chosen.
///
/// # Safety
/// As [`gemm_raw`].
#[allow(unsafe_code, clippy::too_many_arguments)]
unsafe fn gemm_call(
    dst: *mut f32,
    rs: usize,
    cs: usize,
    a: View<'_>,
    b: View<'_>,
    accumulate: bool,
    scale: f32,
    par: gemm::Parallelism,
) {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        gemm::gemm(
            a.rows,
            b.cols,
            a.cols,
            dst,
            cs as isize,
            rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            par,
        )
    }
}

/// `dst (out) = x (inp) @ w (inp, out)` (or `+=`) summed as gemm's kernels for two rows
/// and more sum every element: from zero, one fused multiply-add per term in `inp` order
/// within each depth block of `kc`, the blocks' sums added into `dst` one after another.
fn lone_row(x: &[f32], w: &[f32], inp: usize, out: usize, kc: usize, dst: &mut [f32], accumulate: bool) {
    // Columns in chunks whose sums stay in L1 while the weight streams past.
    const COLS: usize = 512;
    let mut acc = [0f32; COLS];
    with_fma(
        #[inline(always)]
        || {
            for c0 in (0..out).step_by(COLS) {
                let c1 = (c0 + COLS).min(out);
                let (acc, dst) = (&mut acc[..c1 - c0], &mut dst[c0..c1]);
                for (b, k0) in (0..inp).step_by(kc).enumerate() {
                    acc.fill(0.0);
                    for (kk, &a) in x.iter().enumerate().take((k0 + kc).min(inp)).skip(k0) {
                        for (o, &wv) in acc.iter_mut().zip(&w[kk * out + c0..kk * out + c1]) {
                            *o = a.mul_add(wv, *o);
                        }
                    }
                    if b == 0 && !accumulate {
                        dst.copy_from_slice(acc);
                    } else {
                        for (d, &a) in dst.iter_mut().zip(acc.iter()) {
                            *d += a;
                        }
                    }
                }
            }
        },
    )
}

/// The depth block of gemm's kernels (for two rows and more) for an inner dimension of
/// `inp`, found once per `inp` by asking gemm: its blocks split `inp` evenly into pieces
/// of at most a cache-derived size of 512 or more, so the candidates are `⌈inp / i⌉`, and
/// the one whose [`lone_row`] matches gemm's row to the bit on random data is it. `None`
/// when none does (a kernel that sums otherwise): the caller then computes two rows.
fn depth_block(inp: usize) -> Option<usize> {
    static FOUND: std::sync::Mutex<Vec<(usize, Option<usize>)>> = std::sync::Mutex::new(Vec::new());
    let mut found = FOUND.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&(_, kc)) = found.iter().find(|(k, _)| *k == inp) {
        return kc;
    }
    // More than 64 columns: gemm sizes blocks for small products (both sides ≤ 64) apart.
    let out = 80;
    let mut seed = 0x9e37_79b9_u32;
    let mut next = || {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (seed >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    };
    let x: Vec<f32> = (0..inp).map(|_| next()).collect();
    let w: Vec<f32> = (0..inp * out).map(|_| next()).collect();
    let mut want = vec![0f32; 2 * out];
    matmul(&lone_row_twice(&x), 2, &w, inp, out, &mut want, false, 1);
    let mut got = vec![0f32; out];
    let kc = (1..=inp.div_ceil(512)).map(|i| inp.div_ceil(i)).find(|&kc| {
        lone_row(&x, &w, inp, out, kc, &mut got, false);
        got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits())
    });
    found.push((inp, kc));
    kc
}

/// A row written twice, one copy after the other: the two-row matrix through which a lone
/// row takes gemm's batch-invariant path (see [`gemm()`]).
fn lone_row_twice(row: &[f32]) -> Vec<f32> {
    let mut two = Vec::with_capacity(2 * row.len());
    two.extend_from_slice(row);
    two.extend_from_slice(row);
    two
}

/// `scale · a @ b` into a new row-major `(a.rows, b.cols)` matrix, which gemm writes
/// without reading (no zero fill first).
///
/// # Panics
/// When the shapes disagree or a view reaches past its slice.
#[allow(unsafe_code)]
pub fn gemm_new(a: View<'_>, b: View<'_>, scale: f32) -> Vec<f32> {
    let (rows, cols) = (a.rows, b.cols);
    let n = rows * cols;
    if a.cols == 0 {
        return vec![0.0; n];
    }
    if rows == 1 {
        let mut out = vec![0.0; cols];
        gemm(ViewMut::rows(&mut out, 1, cols), a, b, false, scale);
        return out;
    }
    check_gemm(n, rows, cols, cols, 1, a, b);
    let mut out: Vec<f32> = Vec::with_capacity(n);
    if n > 0 {
        // SAFETY: the capacity holds n elements (a distinct allocation, so no overlap);
        // gemm with `accumulate: false` (beta 0, read_dst false) writes every element of
        // dst without reading it; check_gemm bounded the views.
        unsafe { gemm_raw(out.as_mut_ptr(), cols, 1, a, b, false, scale) };
    }
    // SAFETY: the n elements were all written just above.
    unsafe { out.set_len(n) };
    out
}

/// Dot product (eight partial sums, which the compiler maps onto SIMD lanes).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let split = n / 8 * 8;
    for (x, y) in a[..split].chunks_exact(8).zip(b[..split].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in a[split..].iter().zip(&b[split..]) {
        s += x * y;
    }
    s
}

/// RMSNorm of every row of `x` (rows of `w.len()`): `out = x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    vectorized(
        #[inline(always)]
        || {
            for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
                let r = (sum_sq(xr) / d as f32 + eps).sqrt();
                for ((o, v), w) in or.iter_mut().zip(xr).zip(w) {
                    *o = v / r * w;
                }
            }
        },
    )
}

/// Σ x², in sixteen partial sums (so that it vectorises).
#[inline(always)]
pub fn sum_sq(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let split = x.len() / 16 * 16;
    for c in x[..split].chunks_exact(16) {
        for l in 0..16 {
            acc[l] += c[l] * c[l];
        }
    }
    acc.iter().sum::<f32>() + x[split..].iter().map(|v| v * v).sum::<f32>()
}

/// RMSNorm of every row of `x` (rows of `w.len()`) in place.
pub fn rms_norm_rows_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    vectorized(
        #[inline(always)]
        || {
            for row in x.chunks_exact_mut(w.len()) {
                let r = (sum_sq(row) / w.len() as f32 + eps).sqrt();
                for (v, w) in row.iter_mut().zip(w) {
                    *v = *v / r * w;
                }
            }
        },
    )
}

/// RMSNorm of one row in place.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let r = (sum_sq(x) / w.len() as f32 + eps).sqrt();
    for (v, w) in x.iter_mut().zip(w) {
        *v = *v / r * w;
    }
}

/// Rotary embedding of one head's vector in place, given that position's `cos` and `sin`
/// (head_dim / 2 each). `interleaved`: pairs are `(x[2i], x[2i+1])`; otherwise
/// `(x[i], x[i + half])`.
pub fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = x.len() / 2;
    if interleaved {
        for i in 0..half {
            let (e, o) = (x[2 * i], x[2 * i + 1]);
            x[2 * i] = e * cos[i] - o * sin[i];
            x[2 * i + 1] = e * sin[i] + o * cos[i];
        }
    } else {
        let (a, b) = x.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x1 * sin[i] + x2 * cos[i];
        }
    }
}

/// Softmax of `x` in place.
#[inline(always)]
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
    let sum: f32 = x.iter().sum();
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `out[i] = silu(gate[i]) · up[i]`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    vectorized(
        #[inline(always)]
        || {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = g / (exp(-g) + 1.0) * u;
            }
        },
    )
}

/// Keys per block of [`scores_transposed`] and value columns per block of
/// [`weighted_sum`]: four AVX registers of accumulators, kept in registers across the whole
/// reduction (one load of the other operand per fused multiply-add, no store).
const BLOCK: usize = 32;

/// `s[j] = scale · Σ_d q[d] · kt[d·ld + j]` for `n = s.len()` keys stored transposed, `kt`
/// `(q.len(), ld)` with `ld ≥ n`: per key the same chain of fused multiply-adds in `d` order
/// from zero as [`attend`]'s scores, run across 32 keys at once (kept in registers).
#[inline(always)]
pub fn scores_transposed(q: &[f32], kt: &[f32], ld: usize, scale: f32, s: &mut [f32]) {
    let n = s.len();
    let full = n / BLOCK * BLOCK;
    for (b, chunk) in s[..full].chunks_exact_mut(BLOCK).enumerate() {
        let mut acc = [0f32; BLOCK];
        for (d, &qd) in q.iter().enumerate() {
            let k = &kt[d * ld + b * BLOCK..][..BLOCK];
            for l in 0..BLOCK {
                acc[l] = qd.mul_add(k[l], acc[l]);
            }
        }
        for (o, a) in chunk.iter_mut().zip(acc) {
            *o = a * scale;
        }
    }
    let tail = &mut s[full..];
    tail.fill(0.0);
    for (d, &qd) in q.iter().enumerate() {
        for (o, &kv) in tail.iter_mut().zip(&kt[d * ld + full..d * ld + n]) {
            *o = qd.mul_add(kv, *o);
        }
    }
    for o in tail.iter_mut() {
        *o *= scale;
    }
}

/// `out = Σ_j p[j] · v[j·stride ..][..out.len()]`: one fused multiply-add per term, in
/// position order, terms with `p[j] = 0` (masked positions) skipped, so that a row of
/// probabilities padded with zeros (other samples of a packed row, future positions) sums
/// exactly as its nonzero part alone. 32 columns at a time (kept in registers).
///
/// On x86-64 with AVX2 and FMA, and a width that is a multiple of 8, written with the
/// instructions themselves: the compiler kept the loop below, under its zero test, in
/// scalar registers spilled to the stack (the larger part of attention in a
/// SmolLM2-sized decode step at batch 32). Both round once per term in the same order: the same bits.
#[inline(always)]
#[allow(unsafe_code)]
pub fn weighted_sum(p: &[f32], v: &[f32], stride: usize, out: &mut [f32]) {
    let hd = out.len();
    if let Some(last) = p.len().checked_sub(1) {
        assert!(
            v.len() >= last * stride + hd,
            "weighted_sum: {} positions of width {hd} at stride {stride} need {} values, {} given",
            p.len(),
            last * stride + hd,
            v.len()
        );
    }
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && avx2_fma() {
        // SAFETY: the CPU has both features (checked just above) and every read stays
        // inside `v` (asserted above) and every write inside `out`.
        return unsafe { weighted_sum_avx2(p, v, stride, out) };
    }
    weighted_sum_portable(p, v, stride, out)
}

/// [`weighted_sum`] in eight-lane registers: 32 columns at a time, then 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
unsafe fn weighted_sum_avx2(p: &[f32], v: &[f32], stride: usize, out: &mut [f32]) {
    use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps};
    /// Columns `c..c + 8·N` of the sum, kept in `N` registers.
    #[inline(always)]
    unsafe fn block<const N: usize>(p: &[f32], v: *const f32, stride: usize, out: *mut f32) {
        // SAFETY (all below): the caller's bounds: `v` holds `p.len()` rows of `stride`
        // reaching these columns, `out` these columns.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); N];
            for (j, &pj) in p.iter().enumerate() {
                if pj == 0.0 {
                    continue;
                }
                let a = _mm256_set1_ps(pj);
                let x = v.add(j * stride);
                for (l, r) in acc.iter_mut().enumerate() {
                    *r = _mm256_fmadd_ps(a, _mm256_loadu_ps(x.add(8 * l)), *r);
                }
            }
            for (l, r) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(8 * l), *r);
            }
        }
    }
    let hd = out.len();
    let (v, o) = (v.as_ptr(), out.as_mut_ptr());
    let mut c = 0;
    // SAFETY: columns c..c + 32 (then c..c + 8) lie within `hd`, a multiple of 8.
    unsafe {
        while c + BLOCK <= hd {
            block::<{ BLOCK / 8 }>(p, v.add(c), stride, o.add(c));
            c += BLOCK;
        }
        while c < hd {
            block::<1>(p, v.add(c), stride, o.add(c));
            c += 8;
        }
    }
}

/// [`weighted_sum`] in plain loops, over values of either number type the decode cache
/// holds ([`Cached`]; `f32` here, and in [`attend`]'s per-head path).
#[inline(always)]
fn weighted_sum_portable<T: Cached>(p: &[f32], v: &[T], stride: usize, out: &mut [f32]) {
    let hd = out.len();
    let full = hd / BLOCK * BLOCK;
    for (b, chunk) in out[..full].chunks_exact_mut(BLOCK).enumerate() {
        let mut acc = [0f32; BLOCK];
        for (j, &pj) in p.iter().enumerate() {
            if pj == 0.0 {
                continue;
            }
            let x = &v[j * stride + b * BLOCK..][..BLOCK];
            for l in 0..BLOCK {
                acc[l] = pj.mul_add(x[l].load(), acc[l]);
            }
        }
        chunk.copy_from_slice(&acc);
    }
    let tail = &mut out[full..];
    tail.fill(0.0);
    for (j, &pj) in p.iter().enumerate() {
        if pj == 0.0 {
            continue;
        }
        for (o, x) in tail.iter_mut().zip(&v[j * stride + full..j * stride + hd]) {
            *o = pj.mul_add(x.load(), *o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "element {i}: {x} vs {y}");
        }
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn exp_is_within_2_ulp_of_the_library_and_saturates_at_both_ends() {
        // Every 97th f32 bit pattern from −87.3 to 88.3 (both signs), and the edges.
        let mut worst = 0f64;
        for bits in (0..0x8000_0000u32).step_by(97) {
            for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                if !(-87.3..=88.3).contains(&x) {
                    continue;
                }
                let (ours, std) = (exp(x) as f64, (x as f64).exp());
                worst = worst.max((ours - std).abs() / std);
            }
        }
        assert!(worst < 3e-7, "exp: worst relative error {worst:e}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-87.31), 0.0);
        assert_eq!(exp(0.0), 1.0);
        let top = exp(f32::INFINITY);
        assert!(
            top.is_finite() && (top as f64 / (88.3f32 as f64).exp() - 1.0).abs() < 3e-7,
            "exp(∞) = {top}"
        );
        // The vectorised form and a lone call agree to the bit.
        let xs: Vec<f32> = (0..4096).map(|i| i as f32 / 20.0 - 100.0).collect();
        let mut v = vec![0f32; xs.len()];
        vectorized(
            #[inline(always)]
            || {
                for (o, &x) in v.iter_mut().zip(&xs) {
                    *o = exp(x);
                }
            },
        );
        for (x, o) in xs.iter().zip(&v) {
            assert_eq!(o.to_bits(), std::hint::black_box(exp)(*x).to_bits(), "exp({x})");
        }
    }

    #[test]
    fn every_closure_run_with_wider_instructions_is_inlined() {
        // `with_fma` and `vectorized` give their instruction sets only to code inlined
        // into them; an out-of-line closure silently runs `fmaf` calls or baseline SSE.
        for (file, src) in [
            ("cpu.rs", include_str!("cpu.rs")),
            ("train.rs", include_str!("train.rs")),
        ] {
            for call in ["with_fma(", "vectorized("] {
                for (at, _) in src.match_indices(call) {
                    let line_start = src[..at].rfind('\n').map_or(0, |i| i + 1);
                    let line = &src[line_start..];
                    let line = &line[..line.find('\n').unwrap_or(line.len())];
                    if line.trim_start().starts_with("//") || line.contains("pub fn ") || line.contains("\"") {
                        continue;
                    }
                    let rest = &src[at + call.len()..];
                    assert!(
                        rest.trim_start().starts_with("#[inline(always)]"),
                        "{file}: `{}` passes a closure that is not #[inline(always)]",
                        line.trim()
                    );
                }
            }
        }
    }

    #[test]
    fn a_product_spread_over_idle_cores_is_the_same_bits() {
        // A training step's products spread over the cores the rollout leaves idle; the
        // sampler's logprobs must still equal the trainer's, so spreading changes no bit.
        for (m, k, n) in [(64, 576, 1536), (300, 128, 200), (5, 1536, 576)] {
            let (a, b) = (data(m * k, 1), data(k * n, 2));
            let one = gemm_new(View::rows(&a, m, k), View::rows(&b, k, n), 1.0);
            let spread = crate::cores::spread(2, || {
                // Nothing in this test binary holds a core busy.
                assert_eq!(crate::cores::threads(), 2);
                gemm_new(View::rows(&a, m, k), View::rows(&b, k, n), 1.0)
            });
            assert!(
                one.iter().zip(&spread).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m}×{k}×{n}: spread over two threads differs"
            );
            // The inference product too (a held-out eval's decode steps spread), rows
            // alone or together, accumulating or not.
            for rows in [m, 2, 1] {
                let mut base = data(rows * n, 3);
                let mut spread = base.clone();
                matmul(&a, rows, &b, k, n, &mut base, true, 1);
                crate::cores::spread(2, || matmul(&a, rows, &b, k, n, &mut spread, true, 1));
                assert!(
                    base.iter().zip(&spread).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "matmul {rows}×{k}×{n}: spread over two threads differs"
                );
            }
        }
    }

    #[test]
    fn matmul_matches_the_definition_and_accumulates() {
        for (n, out, inp) in [(1, 1, 1), (3, 5, 7), (17, 33, 64), (64, 100, 128)] {
            // w as a checkpoint stores it: (out, inp).
            let (x, w) = (data(n * inp, 1), data(out * inp, 2));
            let want: Vec<f32> = (0..n * out)
                .map(|k| (0..inp).map(|i| x[k / out * inp + i] * w[k % out * inp + i]).sum())
                .collect();
            let wt = transpose(&w, out, inp);
            let mut got = vec![f32::NAN; n * out];
            matmul(&x, n, &wt, inp, out, &mut got, false, 1);
            close(&got, &want, 1e-5);
            let mut acc = vec![1.0; n * out];
            matmul(&x, n, &wt, inp, out, &mut acc, true, 2);
            close(&acc, &want.iter().map(|v| v + 1.0).collect::<Vec<_>>(), 1e-5);
        }
    }

    #[test]
    fn a_lone_row_streams_the_weight_in_gemms_depth_blocks() {
        // Found here for a 135M model's depths (one block, two of 288, three of 512 on
        // this machine's caches); without it a lone row costs a two-row gemm (-20% decode
        // tokens/s at batch 1 at SmolLM2's size).
        for inp in [64, 576, 1536] {
            let kc = depth_block(inp).unwrap_or_else(|| panic!("no depth block matches gemm's sums for {inp}"));
            assert!(
                kc <= inp && inp.div_ceil(kc) * kc - inp < inp.div_ceil(kc),
                "{inp}: {kc}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "matmul: x 3 (need 2×2)")]
    fn matmul_refuses_short_slices() {
        matmul(&[0.0; 3], 2, &[0.0; 4], 2, 2, &mut [0.0; 4], false, 1);
    }

    #[test]
    fn strided_gemm_matches_the_definition_for_transposed_and_interleaved_views() {
        // a: head 1 of a (3 tokens, 2 heads, 4) activation; b: the transpose of a (5, 4)
        // matrix; dst: every other column of a (3, 10) buffer.
        let act = data(3 * 2 * 4, 21);
        let a = View {
            data: &act[4..],
            rows: 3,
            cols: 4,
            rs: 8,
            cs: 1,
        };
        let bm = data(5 * 4, 22);
        let b = View::rows(&bm, 5, 4).t();
        let mut buf = vec![1f32; 3 * 10];
        let want = |r: usize, c: usize| -> f32 { (0..4).map(|k| act[r * 8 + 4 + k] * bm[c * 4 + k]).sum() };
        gemm(
            ViewMut {
                data: &mut buf,
                rows: 3,
                cols: 5,
                rs: 10,
                cs: 2,
            },
            a,
            b,
            true,
            0.5,
        );
        for r in 0..3 {
            for c in 0..5 {
                let got = buf[r * 10 + 2 * c];
                let w = 1.0 + 0.5 * want(r, c);
                assert!((got - w).abs() < 1e-5, "({r}, {c}): {got} vs {w}");
                assert_eq!(buf[r * 10 + 2 * c + 1], 1.0, "the other columns are untouched");
            }
        }
    }

    #[test]
    #[should_panic(expected = "view a reaches element 22 of a slice of 20")]
    fn strided_gemm_refuses_a_view_past_its_slice() {
        let x = [0f32; 20];
        let mut d = [0f32; 9];
        gemm(
            ViewMut::rows(&mut d, 3, 3),
            View {
                data: &x,
                rows: 3,
                cols: 4,
                rs: 9,
                cs: 1,
            },
            View::rows(&x, 4, 3),
            false,
            1.0,
        );
    }

    #[test]
    fn weighted_sum_in_avx2_registers_is_the_portable_loops_bits() {
        // Widths of 32-column blocks, 8-column rest, both, and one only the loops take;
        // probabilities with zeros (masked positions), values read at a wider stride.
        let avx2 = avx2_fma();
        println!(
            "weighted_sum: AVX2 + FMA path {}",
            if avx2 { "runs" } else { "absent: loops only" }
        );
        for hd in [64, 40, 8, 6] {
            let (len, stride) = (37, hd + 24);
            let mut p = data(len, 21);
            for j in (0..len).step_by(5) {
                p[j] = 0.0;
            }
            let v = data((len - 1) * stride + hd, 22);
            let (mut got, mut want) = (vec![f32::NAN; hd], vec![f32::NAN; hd]);
            weighted_sum(&p, &v, stride, &mut got);
            weighted_sum_portable(&p, &v, stride, &mut want);
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "width {hd}"
            );
            for (c, &g) in got.iter().enumerate() {
                let exact: f64 = (0..len).map(|j| p[j] as f64 * v[j * stride + c] as f64).sum();
                assert!(
                    (g as f64 - exact).abs() < 1e-4,
                    "width {hd}, column {c}: {g} vs {exact}"
                );
            }
        }
    }

    #[test]
    fn norms_rope_and_silu_follow_their_formulas() {
        let x = [3.0, 4.0];
        let mut out = [0.0; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        close(&out, &[3.0 / r, 8.0 / r], 1e-6);
        let mut y = x;
        rms_norm_in_place(&mut y, &[1.0, 2.0], 0.0);
        close(&y, &out, 1e-6);
        // A quarter turn: (1, 0) → (0, 1) in either layout.
        let (c, s) = ([0.0], [1.0]);
        let mut v = [1.0, 0.0];
        rope(&mut v, &c, &s, true);
        close(&v, &[0.0, 1.0], 1e-6);
        let mut v = [1.0, 0.0];
        rope(&mut v, &c, &s, false);
        close(&v, &[0.0, 1.0], 1e-6);
        let mut o = [0.0; 2];
        silu_mul(&[0.0, 2.0], &[5.0, 3.0], &mut o);
        close(&o, &[0.0, 2.0 / (1.0 + (-2f32).exp()) * 3.0], 1e-6);
        let mut p = [1.0, 1.0, 1.0, 1.0];
        softmax_in_place(&mut p);
        close(&p, &[0.25; 4], 1e-6);
    }
}

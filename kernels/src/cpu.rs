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
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
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
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let r = (xr.iter().map(|v| v * v).sum::<f32>() / d as f32 + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(w) {
            *o = v / r * w;
        }
    }
}

/// RMSNorm of one row in place.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let r = (x.iter().map(|v| v * v).sum::<f32>() / w.len() as f32 + eps).sqrt();
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
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `out[i] = silu(gate[i]) · up[i]`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / ((-g).exp() + 1.0) * u;
    }
}

/// Grouped-query attention of one token over a sequence's cached keys and values.
///
/// `q` is (heads, hd); `keys` and `values` are (len, kv_heads, hd), position-major, and
/// the token attends to all `len` positions; head `h` reads kv head `h / (heads /
/// kv_heads)`. Writes `out` (heads, hd). `scores` is scratch of at least `len`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    len: usize,
    kv_heads: usize,
    hd: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let heads = q.len() / hd;
    let rep = heads / kv_heads;
    let s = &mut scores[..len];
    for head in 0..heads {
        let g = head / rep;
        let qh = &q[head * hd..(head + 1) * hd];
        for (j, sj) in s.iter_mut().enumerate() {
            *sj = dot(qh, &keys[(j * kv_heads + g) * hd..(j * kv_heads + g + 1) * hd]) * scale;
        }
        softmax_in_place(s);
        let oh = &mut out[head * hd..(head + 1) * hd];
        oh.fill(0.0);
        for (j, &p) in s.iter().enumerate() {
            let vj = &values[(j * kv_heads + g) * hd..(j * kv_heads + g + 1) * hd];
            for (o, v) in oh.iter_mut().zip(vj) {
                *o += p * v;
            }
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
    #[should_panic(expected = "matmul: x 3 (need 2×2)")]
    fn matmul_refuses_short_slices() {
        matmul(&[0.0; 3], 2, &[0.0; 4], 2, 2, &mut [0.0; 4], false, 1);
    }

    #[test]
    fn attention_matches_a_naive_softmax_over_positions() {
        let (heads, kv, hd, len) = (4, 2, 8, 5);
        let q = data(heads * hd, 3);
        let (k, v) = (data(len * kv * hd, 4), data(len * kv * hd, 5));
        let mut out = vec![0.0; heads * hd];
        attend(&q, &k, &v, len, kv, hd, 0.3, &mut [0.0; 16], &mut out);
        for h in 0..heads {
            let g = h / 2;
            let s: Vec<f32> = (0..len)
                .map(|j| (0..hd).map(|i| q[h * hd + i] * k[(j * kv + g) * hd + i]).sum::<f32>() * 0.3)
                .collect();
            let z: f32 = s.iter().map(|x| x.exp()).sum();
            for i in 0..hd {
                let want: f32 = (0..len).map(|j| s[j].exp() / z * v[(j * kv + g) * hd + i]).sum();
                assert!((out[h * hd + i] - want).abs() < 1e-5, "head {h} dim {i}");
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

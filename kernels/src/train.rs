//! CPU kernels of the training forward and backward: the pieces of a transformer step that
//! candle would otherwise run as chains of small element-wise ops, each with its own
//! temporaries (`streamrl_model::fused` wraps them as differentiable candle ops). Row-major
//! `f32` slices everywhere; activations are token-major, `(tokens, heads, head_dim)`.
//!
//! ```
//! use streamrl_kernels::train;
//!
//! // log_softmax(logits[0])[tokens[1]] for one row of two positions over a vocabulary of 2.
//! let logits = [0.0, 0.0, 5.0, 5.0];
//! let mut out = [9.0; 2];
//! let x = train::TokenLogits { logits: &logits, tokens: &[0, 1], batch: 1, seq: 2, vocab: 2, temp: 1.0 };
//! train::logprobs_forward(x, &mut out);
//! assert_eq!(out[0], 0.0);
//! assert!((out[1] - 0.5f32.ln()).abs() < 1e-6);
//! ```

use std::ops::Range;

use crate::bf16::{Converted, Operand, Products};
use crate::cores;
use crate::cpu::{self, View, ViewMut};

/// The additive mask value of a masked position (a packed row's other samples, the
/// future): not −∞, so that an all-masked padding row stays finite. Attention treats every
/// entry at or below it as masked: probability exactly 0, score not computed.
pub const MASKED: f32 = -1e9;

/// Backward of RMSNorm `y = x · r · w`, `r = 1/sqrt(mean(x²) + eps)`, over rows of
/// `w.len()`: writes `dx` and adds into `dw`.
pub fn rms_norm_backward(x: &[f32], w: &[f32], eps: f32, gy: &[f32], dx: &mut [f32], dw: &mut [f32]) {
    cpu::vectorized(
        #[inline(always)]
        || rms_norm_backward_rows(x, w, eps, gy, dx, dw),
    )
}

#[inline(always)]
fn rms_norm_backward_rows(x: &[f32], w: &[f32], eps: f32, gy: &[f32], dx: &mut [f32], dw: &mut [f32]) {
    let d = w.len();
    for ((xr, gr), dxr) in x.chunks_exact(d).zip(gy.chunks_exact(d)).zip(dx.chunks_exact_mut(d)) {
        let r = 1.0 / (cpu::sum_sq(xr) / d as f32 + eps).sqrt();
        for ((&xv, &g), dwv) in xr.iter().zip(gr).zip(dw.iter_mut()) {
            *dwv += g * xv * r;
        }
        // Σ g·w·x in sixteen partial sums, so that it vectorises.
        let mut acc = [0f32; 16];
        let split = d / 16 * 16;
        for ((xc, gc), wc) in xr[..split]
            .chunks_exact(16)
            .zip(gr[..split].chunks_exact(16))
            .zip(w[..split].chunks_exact(16))
        {
            for l in 0..16 {
                acc[l] += gc[l] * wc[l] * xc[l];
            }
        }
        let tail: f32 = (split..d).map(|i| gr[i] * w[i] * xr[i]).sum();
        let c = (acc.iter().sum::<f32>() + tail) * r * r * r / d as f32;
        for ((o, &xv), (&g, &wv)) in dxr.iter_mut().zip(xr).zip(gr.iter().zip(w)) {
            *o = g * wv * r - xv * c;
        }
    }
}

/// Rotary embedding in place of `x` `(tokens, heads, hd)`, token `i` at `positions[i]`;
/// `cos` and `sin` are tables `(max_positions, hd / 2)`. `inverse` rotates by the negative
/// angle: the backward of the rotation (which is orthogonal).
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &mut [f32],
    positions: &[u32],
    heads: usize,
    hd: usize,
    cos: &[f32],
    sin: &[f32],
    interleaved: bool,
    inverse: bool,
) {
    let half = hd / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut s = vec![0f32; half];
    for (row, &p) in x.chunks_exact_mut(heads * hd).zip(positions) {
        let p = p as usize;
        let c = &cos[p * half..(p + 1) * half];
        for (d, &v) in s.iter_mut().zip(&sin[p * half..(p + 1) * half]) {
            *d = sign * v;
        }
        for h in row.chunks_exact_mut(hd) {
            cpu::rope(h, c, &s, interleaved);
        }
    }
}

/// Backward of `y = silu(g) · u`: writes `dg` and `du`.
pub fn silu_mul_backward(g: &[f32], u: &[f32], gy: &[f32], dg: &mut [f32], du: &mut [f32]) {
    cpu::vectorized(
        #[inline(always)]
        || {
            for (((&gv, &uv), &dy), (dgv, duv)) in g.iter().zip(u).zip(gy).zip(dg.iter_mut().zip(du.iter_mut())) {
                let s = 1.0 / (1.0 + cpu::exp(-gv));
                *duv = dy * gv * s;
                *dgv = dy * uv * s * (1.0 + gv * (1.0 - s));
            }
        },
    )
}

/// The shape of an attention call: `batch` rows of `seq` tokens; `q` is
/// `(batch, seq, heads, hd)`, `k` and `v` are `(batch, seq, kv_heads, hd)`; head `h` reads
/// kv head `h / (heads / kv_heads)`; `mask` is additive `(batch or 1, seq, seq)`.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Rows.
    pub batch: usize,
    /// Tokens per row.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Head dimension.
    pub hd: usize,
    /// Score scale, usually `1/sqrt(hd)`.
    pub scale: f32,
    /// The number type of the products. [`Products::F32`] keeps the decode kernels' sums
    /// (a token's output the same bits as [`cpu::attend`] gives it); [`Products::Bf16`]
    /// computes each head's scores and weighted sums as whole-matrix bf16 products (the
    /// masked entries included, at zero weight).
    pub products: Products,
}

impl AttnShape {
    fn check(&self, q: &[f32], k: &[f32], v: &[f32], mask: &[f32]) {
        let (b, t) = (self.batch, self.seq);
        assert!(
            self.kv_heads > 0 && self.heads.is_multiple_of(self.kv_heads),
            "attention: {} heads over {} kv heads",
            self.heads,
            self.kv_heads
        );
        assert!(
            q.len() == b * t * self.heads * self.hd
                && k.len() == b * t * self.kv_heads * self.hd
                && v.len() == k.len()
                && (mask.len() == t * t || mask.len() == b * t * t),
            "attention: q {}, k {}, v {}, mask {} for {self:?}",
            q.len(),
            k.len(),
            v.len(),
            mask.len()
        );
    }

    /// This shape for one batch row, and the lengths of a row of `q` and of `k`.
    fn row(&self) -> (AttnShape, usize, usize) {
        let per = self.seq * self.hd;
        (AttnShape { batch: 1, ..*self }, per * self.heads, per * self.kv_heads)
    }

    /// Where head `h` of batch row `r` starts in a query-shaped `(batch, seq, heads, hd)`
    /// buffer, and where its kv head starts in a `(batch, seq, kv_heads, hd)` one.
    fn offsets(&self, r: usize, h: usize) -> (usize, usize) {
        let (t, hd) = (self.seq, self.hd);
        let g = h / (self.heads / self.kv_heads);
        (r * t * self.heads * hd + h * hd, r * t * self.kv_heads * hd + g * hd)
    }

    /// Rows `rows` of one head of a buffer whose row 0 starts at `at`, as a `(rows, hd)`
    /// matrix whose rows are `heads` heads apart.
    fn view<'a>(&self, data: &'a [f32], at: usize, heads: usize, rows: Range<usize>) -> View<'a> {
        let rs = heads * self.hd;
        View::block(&data[at + rows.start * rs..], rows.len(), self.hd, rs)
    }

    /// The mutable counterpart of [`AttnShape::view`].
    fn view_mut<'a>(&self, data: &'a mut [f32], at: usize, heads: usize, rows: Range<usize>) -> ViewMut<'a> {
        let rs = heads * self.hd;
        ViewMut::block(&mut data[at + rows.start * rs..], rows.len(), self.hd, rs)
    }

    /// The mask of batch row `r`, `(seq, seq)`.
    fn mask_of<'a>(&self, mask: &'a [f32], r: usize) -> &'a [f32] {
        let t = self.seq;
        if mask.len() == t * t {
            mask
        } else {
            &mask[r * t * t..(r + 1) * t * t]
        }
    }

    /// The keys each query of batch row `r` attends to: from its mask row's first entry
    /// above [`MASKED`] to its last (the whole row when none is). Entries outside are
    /// masked: their probability is exactly 0 either way, so they are not computed (a
    /// packed row's other samples, future positions).
    fn spans(&self, mask: &[f32], r: usize) -> Vec<Range<usize>> {
        let t = self.seq;
        self.mask_of(mask, r)
            .chunks_exact(t)
            .map(|row| match row.iter().position(|&a| a > MASKED) {
                Some(lo) => lo..t - row.iter().rev().position(|&a| a > MASKED).unwrap_or(0),
                None => 0..t,
            })
            .collect()
    }

    /// `p (seq, seq) = softmax(scale · q kᵀ + mask)` for head `h` of batch row `r`, 0 outside
    /// each query's span ([`AttnShape::spans`]). The scores are [`cpu::scores_transposed`]'s
    /// chains (those of a decode step, [`cpu::attend`]), not gemm's: gemm sums small
    /// products in other orders; and the softmax runs over the span alone, as a decode
    /// step's over its sample's cache.
    fn probs(&self, q: &[f32], k: &[f32], mask: &[f32], spans: &[Range<usize>], (r, h): (usize, usize), p: &mut [f32]) {
        let (t, hd) = (self.seq, self.hd);
        let (qo, ko) = self.offsets(r, h);
        // This head's keys transposed, (hd, seq): each query's scores are then rows of
        // fused multiply-adds across its keys at once.
        let mut kt = vec![0f32; hd * t];
        for j in 0..t {
            let kj = &k[ko + j * self.kv_heads * hd..][..hd];
            for (d, &x) in kj.iter().enumerate() {
                kt[d * t + j] = x;
            }
        }
        let m = self.mask_of(mask, r);
        cpu::with_fma(
            #[inline(always)]
            || {
                for (i, ((row, mrow), span)) in p.chunks_exact_mut(t).zip(m.chunks_exact(t)).zip(spans).enumerate() {
                    row[..span.start].fill(0.0);
                    row[span.end..].fill(0.0);
                    let s = &mut row[span.clone()];
                    let qi = &q[qo + i * self.heads * hd..][..hd];
                    cpu::scores_transposed(qi, &kt[span.start..], t, self.scale, s);
                    for (x, &a) in s.iter_mut().zip(&mrow[span.clone()]) {
                        *x += a;
                    }
                    cpu::softmax_in_place(s);
                }
            },
        );
    }
}

/// A batch row's `q`, `k`, `v` (and, for the backward, the output's gradient) as bf16
/// products read them: converted once for every head's products, each head's rows a dense
/// block of its own (oneDNN's fast kernels take dense matrices only). Products write
/// into dense scratch too, copied into place after ([`scatter`]).
struct Heads<'a> {
    q: Converted<'a>,
    k: Converted<'a>,
    v: Converted<'a>,
}

impl<'a> Heads<'a> {
    fn new(s: &AttnShape, q: &'a [f32], k: &'a [f32], v: &'a [f32]) -> Heads<'a> {
        let blocks = |x: &'a [f32], heads: usize| s.products.convert_blocks(View::rows(x, s.seq, heads * s.hd), s.hd);
        Heads {
            q: blocks(q, s.heads),
            k: blocks(k, s.kv_heads),
            v: blocks(v, s.kv_heads),
        }
    }

    /// [`AttnShape::probs`] for bf16 products: the scores as one product per head.
    fn probs(
        &self,
        s: &AttnShape,
        (q, k): (&[f32], &[f32]),
        mask: &[f32],
        spans: &[Range<usize>],
        h: usize,
        p: &mut [f32],
    ) {
        let t = s.seq;
        let (qo, ko) = s.offsets(0, h);
        let qh = self.q.of(s.view(q, qo, s.heads, 0..t));
        let kh = self.k.of(s.view(k, ko, s.kv_heads, 0..t));
        s.products.gemm_op(ViewMut::rows(p, t, t), qh, kh.t(), false, s.scale);
        for ((row, mrow), span) in p.chunks_exact_mut(t).zip(mask.chunks_exact(t)).zip(spans) {
            row[..span.start].fill(0.0);
            row[span.end..].fill(0.0);
            let x = &mut row[span.clone()];
            for (x, &a) in x.iter_mut().zip(&mrow[span.clone()]) {
                *x += a;
            }
            cpu::softmax_in_place(x);
        }
    }
}

/// Copies the dense `(rows, width)` matrix `src` into `dst` from element `at` on, its rows
/// `rs` apart.
fn scatter(src: &[f32], width: usize, dst: &mut [f32], at: usize, rs: usize) {
    for (i, row) in src.chunks_exact(width).enumerate() {
        dst[at + i * rs..][..width].copy_from_slice(row);
    }
}

/// Attention forward: `out (batch, seq, heads, hd) = softmax(scale · q kᵀ + mask) v` per head.
///
/// Each token's output equals, to the bit, what [`cpu::attend`] gives for it from a cache
/// of its sample's positions: the scores are the same chains of fused multiply-adds along
/// `hd`, and the weighted sum of values is [`cpu::weighted_sum`] over the same positions
/// (mask entries at or below [`MASKED`] are a packed row's other samples, or the future).
///
/// Batch rows are independent: inside [`cores::spread`] they spread over the idle cores
/// ([`cores::each`]), each computed as alone, so the output is the same at any thread count.
pub fn attention_forward(s: AttnShape, q: &[f32], k: &[f32], v: &[f32], mask: &[f32], out: &mut [f32]) {
    s.check(q, k, v, mask);
    let (row, qn, kn) = s.row();
    cores::each(out.chunks_exact_mut(qn).enumerate(), |(r, out)| {
        attention_forward_row(
            row,
            &q[r * qn..][..qn],
            &k[r * kn..][..kn],
            &v[r * kn..][..kn],
            s.mask_of(mask, r),
            out,
        );
    });
}

/// [`attention_forward`] of one batch row (`s.batch == 1`).
fn attention_forward_row(s: AttnShape, q: &[f32], k: &[f32], v: &[f32], mask: &[f32], out: &mut [f32]) {
    if s.products == Products::Bf16 {
        return attention_forward_row_bf16(s, q, k, v, mask, out);
    }
    let (t, hd) = (s.seq, s.hd);
    let stride = s.kv_heads * hd;
    let mut p = vec![0f32; t * t];
    for r in 0..s.batch {
        let spans = s.spans(mask, r);
        for h in 0..s.heads {
            s.probs(q, k, mask, &spans, (r, h), &mut p);
            let (qo, ko) = s.offsets(r, h);
            cpu::with_fma(
                #[inline(always)]
                || {
                    for (i, (pi, span)) in p.chunks_exact(t).zip(&spans).enumerate() {
                        let at = qo + i * s.heads * hd;
                        let vs = &v[ko + span.start * stride..];
                        cpu::weighted_sum(&pi[span.clone()], vs, stride, &mut out[at..at + hd]);
                    }
                },
            );
        }
    }
}

/// [`attention_forward_row`] with bf16 products ([`Heads`]).
fn attention_forward_row_bf16(s: AttnShape, q: &[f32], k: &[f32], v: &[f32], mask: &[f32], out: &mut [f32]) {
    let (t, hd) = (s.seq, s.hd);
    let heads = Heads::new(&s, q, k, v);
    let spans = s.spans(mask, 0);
    let (mut p, mut o) = (vec![0f32; t * t], vec![0f32; t * hd]);
    for h in 0..s.heads {
        heads.probs(&s, (q, k), mask, &spans, h, &mut p);
        let (qo, ko) = s.offsets(0, h);
        let vh = heads.v.of(s.view(v, ko, s.kv_heads, 0..t));
        s.products.gemm_op(
            ViewMut::rows(&mut o, t, hd),
            Operand::F32(View::rows(&p, t, t)),
            vh,
            false,
            1.0,
        );
        scatter(&o, hd, out, qo, s.heads * hd);
    }
}

/// Query rows in blocks for the backward's products, with the keys the block's rows attend
/// to: `(rows, keys)`. A block holds the rows of one packed sample (the same first key), at
/// most 64 (so a causal block computes at most 64 rows past its triangle), or a run of rows
/// that attend to themselves alone (padding).
fn blocks(spans: &[Range<usize>]) -> Vec<(Range<usize>, Range<usize>)> {
    const ROWS: usize = 64;
    let lone = |s: &Range<usize>| s.len() == 1;
    let mut out = Vec::new();
    let mut i0 = 0;
    while i0 < spans.len() {
        let mut i1 = i0 + 1;
        while i1 < spans.len()
            && i1 - i0 < ROWS
            && (spans[i1].start == spans[i0].start || (lone(&spans[i1]) && spans[i0..i1].iter().all(lone)))
        {
            i1 += 1;
        }
        let lo = spans[i0..i1].iter().map(|s| s.start).min().unwrap_or(0);
        let hi = spans[i0..i1].iter().map(|s| s.end).max().unwrap_or(0);
        out.push((i0..i1, lo..hi));
        i0 = i1;
    }
    out
}

/// Attention backward: given `dout`, writes `dq` and `dk`, `dv` (summed over the heads that
/// share a kv head). The probabilities are recomputed, not stored; the products run per
/// block of query rows over the keys they attend to (mask entries at or below [`MASKED`]
/// are skipped, as in [`attention_forward`]), so a packed row costs what its samples cost
/// apart. Batch rows spread over idle cores as in [`attention_forward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    s: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    dout: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    s.check(q, k, v, mask);
    let (row, qn, kn) = s.row();
    let rows = dq
        .chunks_exact_mut(qn)
        .zip(dk.chunks_exact_mut(kn))
        .zip(dv.chunks_exact_mut(kn));
    cores::each(rows.enumerate(), |(r, ((dq, dk), dv))| {
        let (q, k, v, dout) = (
            &q[r * qn..][..qn],
            &k[r * kn..][..kn],
            &v[r * kn..][..kn],
            &dout[r * qn..][..qn],
        );
        attention_backward_row(row, (q, k, v), s.mask_of(mask, r), dout, (dq, dk, dv));
    });
}

/// `(q, k, v)` or their gradients, of one batch row.
type Qkv<'a> = (&'a [f32], &'a [f32], &'a [f32]);
type QkvMut<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32]);

/// [`attention_backward`] of one batch row (`s.batch == 1`).
fn attention_backward_row(s: AttnShape, (q, k, v): Qkv, mask: &[f32], dout: &[f32], (dq, dk, dv): QkvMut) {
    if s.products == Products::Bf16 {
        return attention_backward_row_bf16(s, (q, k, v), mask, dout, (dq, dk, dv));
    }
    let t = s.seq;
    let (hq, hk) = (s.heads, s.kv_heads);
    dk.fill(0.0);
    dv.fill(0.0);
    let mut p = vec![0f32; t * t];
    let mut dp = vec![0f32; t * t];
    for r in 0..s.batch {
        let spans = s.spans(mask, r);
        let blocks = blocks(&spans);
        for h in 0..s.heads {
            s.probs(q, k, mask, &spans, (r, h), &mut p);
            let (qo, ko) = s.offsets(r, h);
            for (rows, keys) in &blocks {
                let (n, m) = (rows.len(), keys.len());
                let at = rows.start * t + keys.start;
                let pb = View::block(&p[at..], n, m, t);
                let doh = s.view(dout, qo, hq, rows.clone());
                let pr = s.products;
                // dv += pᵀ dout
                pr.gemm(s.view_mut(dv, ko, hk, keys.clone()), pb.t(), doh, true, 1.0);
                // dp = dout vᵀ; ds = p ∘ (dp − rowsum(p ∘ dp))
                let dpb = ViewMut::block(&mut dp[at..], n, m, t);
                pr.gemm(dpb, doh, s.view(v, ko, hk, keys.clone()).t(), false, 1.0);
                softmax_grad_rows(&p[at..], &mut dp[at..], (n, m), (t, t));
                // dq = scale · ds k; dk += scale · dsᵀ q
                let ds = View::block(&dp[at..], n, m, t);
                pr.gemm(
                    s.view_mut(dq, qo, hq, rows.clone()),
                    ds,
                    s.view(k, ko, hk, keys.clone()),
                    false,
                    s.scale,
                );
                pr.gemm(
                    s.view_mut(dk, ko, hk, keys.clone()),
                    ds.t(),
                    s.view(q, qo, hq, rows.clone()),
                    true,
                    s.scale,
                );
            }
        }
    }
}

/// `ds = p ∘ (dp − rowsum(p ∘ dp))` in place of `dp`, over `n` rows of `m`; the rows of `p`
/// and of `dp` are `rs.0` and `rs.1` elements apart.
fn softmax_grad_rows(p: &[f32], dp: &mut [f32], (n, m): (usize, usize), rs: (usize, usize)) {
    for i in 0..n {
        let pr = &p[i * rs.0..][..m];
        let dr = &mut dp[i * rs.1..][..m];
        let c: f32 = pr.iter().zip(dr.iter()).map(|(a, b)| a * b).sum();
        for (d, &pv) in dr.iter_mut().zip(pr) {
            *d = pv * (*d - c);
        }
    }
}

/// [`attention_backward_row`] with bf16 products ([`Heads`]): each kv head's `dk` and
/// `dv` summed densely over its query heads, each head's `dq` densely, then copied into
/// place.
fn attention_backward_row_bf16(s: AttnShape, (q, k, v): Qkv, mask: &[f32], dout: &[f32], (dq, dk, dv): QkvMut) {
    let (t, hd, hq, hk) = (s.seq, s.hd, s.heads, s.kv_heads);
    let pr = s.products;
    let heads = Heads::new(&s, q, k, v);
    let dc = pr.convert_blocks(View::rows(dout, t, hq * hd), hd);
    let spans = s.spans(mask, 0);
    let blocks = blocks(&spans);
    let mut p = vec![0f32; t * t];
    let mut dp = vec![0f32; t * t];
    let mut dqh = vec![0f32; t * hd];
    let (mut dkd, mut dvd) = (vec![0f32; hk * t * hd], vec![0f32; hk * t * hd]);
    for h in 0..hq {
        heads.probs(&s, (q, k), mask, &spans, h, &mut p);
        let (qo, ko) = s.offsets(0, h);
        let g = h / (hq / hk);
        let (dkg, dvg) = (&mut dkd[g * t * hd..][..t * hd], &mut dvd[g * t * hd..][..t * hd]);
        for (rows, keys) in &blocks {
            let (n, m) = (rows.len(), keys.len());
            let at = rows.start * t + keys.start;
            let pb = pr.convert(View::block(&p[at..], n, m, t).t());
            let doh = dc.of(s.view(dout, qo, hq, rows.clone()));
            // dv += pᵀ dout
            let dvb = ViewMut::rows(&mut dvg[keys.start * hd..][..m * hd], m, hd);
            pr.gemm_op(dvb, pb.all(), doh, true, 1.0);
            // dp = dout vᵀ; ds = p ∘ (dp − rowsum(p ∘ dp))
            let dpb = &mut dp[..n * m];
            let vb = heads.v.of(s.view(v, ko, hk, keys.clone()));
            pr.gemm_op(ViewMut::rows(dpb, n, m), doh, vb.t(), false, 1.0);
            softmax_grad_rows(&p[at..], dpb, (n, m), (t, m));
            // dq = scale · ds k; dk += scale · dsᵀ q (ds converted once for both)
            let ds = pr.convert(View::rows(dpb, n, m));
            let kb = heads.k.of(s.view(k, ko, hk, keys.clone()));
            let dqb = ViewMut::rows(&mut dqh[rows.start * hd..][..n * hd], n, hd);
            pr.gemm_op(dqb, ds.all(), kb, false, s.scale);
            let qb = heads.q.of(s.view(q, qo, hq, rows.clone()));
            let dkb = ViewMut::rows(&mut dkg[keys.start * hd..][..m * hd], m, hd);
            pr.gemm_op(dkb, ds.all().t(), qb, true, s.scale);
        }
        scatter(&dqh, hd, dq, qo, hq * hd);
    }
    for g in 0..hk {
        let ko = g * hd;
        scatter(&dkd[g * t * hd..][..t * hd], hd, dk, ko, hk * hd);
        scatter(&dvd[g * t * hd..][..t * hd], hd, dv, ko, hk * hd);
    }
}

/// Logits rows and the tokens they score: `logits` `(batch, seq, vocab)`, `tokens`
/// `(batch, seq)`, read at temperature `temp`. Position `i`'s token is scored by the row
/// before it.
#[derive(Debug, Clone, Copy)]
pub struct TokenLogits<'a> {
    /// `(batch, seq, vocab)`, row-major.
    pub logits: &'a [f32],
    /// `(batch, seq)`.
    pub tokens: &'a [u32],
    /// Rows.
    pub batch: usize,
    /// Positions per row.
    pub seq: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Sampling temperature.
    pub temp: f32,
}

impl<'a> TokenLogits<'a> {
    /// Checks the lengths: `batch × seq × vocab` logits, `batch × seq` tokens and `per_token`.
    fn check(&self, per_token: usize, what: &str) {
        let (b, t, v) = (self.batch, self.seq, self.vocab);
        assert!(
            self.logits.len() == b * t * v && self.tokens.len() == b * t && per_token == b * t,
            "{what}: logits {}, tokens {}, out {per_token} for {b}×{t}×{v}",
            self.logits.len(),
            self.tokens.len(),
        );
    }

    /// Batch row `b` alone.
    fn row(self, b: usize) -> TokenLogits<'a> {
        let (t, v) = (self.seq, self.vocab);
        TokenLogits {
            logits: &self.logits[b * t * v..][..t * v],
            tokens: &self.tokens[b * t..][..t],
            batch: 1,
            ..self
        }
    }

    /// The fields in declaration order, for a kernel's body.
    #[inline(always)]
    fn parts(self) -> (&'a [f32], &'a [u32], usize, usize, usize, f32) {
        (self.logits, self.tokens, self.batch, self.seq, self.vocab, self.temp)
    }
}

/// Per-token logprobs of `x.tokens` under `x.logits` at `x.temp`:
/// `out[b, i] = log_softmax(logits[b, i − 1] / temp)[tokens[b, i]]` for `i ≥ 1`, and
/// `out[b, 0] = 0`.
///
/// # Panics
/// When a token is outside the vocabulary or a slice is the wrong length.
pub fn logprobs_forward(x: TokenLogits, out: &mut [f32]) {
    x.check(out.len(), "logprobs");
    cores::each(out.chunks_exact_mut(x.seq.max(1)).enumerate(), |(b, out)| {
        cpu::vectorized(
            #[inline(always)]
            || logprobs_forward_rows(x.row(b), out, None),
        )
    });
}

/// [`logprobs_forward`] that also writes the entropy (nats) of every next-token
/// distribution at `temp`, aligned the same way (`entropy[b, 0] = 0`), in the same pass
/// over the logits: `H = ln Σ e^(z − max) − Σ e^(z − max)(z − max) / Σ e^(z − max)`.
pub fn logprobs_entropy_forward(x: TokenLogits, out: &mut [f32], entropy: &mut [f32]) {
    assert_eq!(
        entropy.len(),
        x.batch * x.seq,
        "entropy: {} values for {}×{}",
        entropy.len(),
        x.batch,
        x.seq
    );
    x.check(out.len(), "logprobs");
    let rows = out
        .chunks_exact_mut(x.seq.max(1))
        .zip(entropy.chunks_exact_mut(x.seq.max(1)));
    cores::each(rows.enumerate(), |(b, (out, entropy))| {
        cpu::vectorized(
            #[inline(always)]
            || logprobs_forward_rows(x.row(b), out, Some(entropy)),
        )
    });
}

#[inline(always)]
fn logprobs_forward_rows(x: TokenLogits, out: &mut [f32], mut entropy: Option<&mut [f32]>) {
    let (logits, tokens, batch, seq, vocab, temp) = x.parts();
    assert!(
        logits.len() == batch * seq * vocab && tokens.len() == batch * seq && out.len() == batch * seq,
        "logprobs: logits {}, tokens {}, out {} for {batch}×{seq}×{vocab}",
        logits.len(),
        tokens.len(),
        out.len()
    );
    for b in 0..batch {
        out[b * seq] = 0.0;
        if let Some(e) = entropy.as_deref_mut() {
            e[b * seq] = 0.0;
        }
        for i in 1..seq {
            let row = &logits[(b * seq + i - 1) * vocab..(b * seq + i) * vocab];
            let tok = tokens[b * seq + i] as usize;
            assert!(tok < vocab, "logprobs: token {tok} outside the vocabulary of {vocab}");
            match entropy.as_deref_mut() {
                None => {
                    let (max, lse) = log_sum_exp(row, temp);
                    out[b * seq + i] = row[tok] / temp - max - lse;
                }
                Some(e) => {
                    let (max, lse, h) = log_sum_exp_entropy(row, temp);
                    out[b * seq + i] = row[tok] / temp - max - lse;
                    e[b * seq + i] = h;
                }
            }
        }
    }
}

/// Backward of [`logprobs_forward`]: `dlogits[b, i − 1] = g[b, i] / temp · (onehot(tok) −
/// softmax(logits[b, i − 1] / temp))`; the last position of each row gets zero.
pub fn logprobs_backward(x: TokenLogits, g: &[f32], dlogits: &mut [f32]) {
    x.check(g.len(), "logprobs backward");
    assert_eq!(
        dlogits.len(),
        x.logits.len(),
        "logprobs backward: dlogits {} for logits {}",
        dlogits.len(),
        x.logits.len()
    );
    let row = x.seq * x.vocab;
    cores::each(dlogits.chunks_exact_mut(row.max(1)).enumerate(), |(b, dlogits)| {
        let g = &g[b * x.seq..][..x.seq];
        cpu::vectorized(
            #[inline(always)]
            || logprobs_backward_rows(x.row(b), g, dlogits),
        )
    });
}

#[inline(always)]
fn logprobs_backward_rows(x: TokenLogits, g: &[f32], dlogits: &mut [f32]) {
    let (logits, tokens, batch, seq, vocab, temp) = x.parts();
    assert!(
        logits.len() == batch * seq * vocab && dlogits.len() == logits.len() && g.len() == batch * seq,
        "logprobs backward: logits {}, g {}, dlogits {} for {batch}×{seq}×{vocab}",
        logits.len(),
        g.len(),
        dlogits.len()
    );
    for b in 0..batch {
        for i in 0..seq {
            let at = (b * seq + i) * vocab;
            let d = &mut dlogits[at..at + vocab];
            if i + 1 == seq || g[b * seq + i + 1] == 0.0 {
                d.fill(0.0);
                continue;
            }
            let row = &logits[at..at + vocab];
            let gi = g[b * seq + i + 1] / temp;
            let (max, lse) = log_sum_exp(row, temp);
            let shift = max + lse;
            let inv = 1.0 / temp;
            for (o, &l) in d.iter_mut().zip(row) {
                *o = -gi * cpu::exp(l * inv - shift);
            }
            d[tokens[b * seq + i + 1] as usize] += gi;
        }
    }
}

/// The two terms of a logits row's log-softmax at `temp`: `(max, lse)` with
/// `log p(i) = row[i] / temp − max − lse`, summed exactly as [`logprobs_forward`] sums
/// them, so that a logprob recorded while sampling equals the trainer's recomputation of
/// it from the same logits to the bit.
///
/// ```
/// let (max, lse) = streamrl_kernels::train::log_softmax_terms(&[0.0, 0.0], 1.0);
/// assert!((0.0 - max - lse - 0.5f32.ln()).abs() < 1e-6);
/// ```
pub fn log_softmax_terms(row: &[f32], temp: f32) -> (f32, f32) {
    cpu::vectorized(
        #[inline(always)]
        || log_sum_exp(row, temp),
    )
}

/// `(max, ln Σ exp(x/temp − max))` of a row.
#[inline(always)]
fn log_sum_exp(row: &[f32], temp: f32) -> (f32, f32) {
    let inv = 1.0 / temp;
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * inv;
    let mut acc = [0f32; 16];
    let split = row.len() / 16 * 16;
    for c in row[..split].chunks_exact(16) {
        for l in 0..16 {
            acc[l] += cpu::exp(c[l] * inv - max);
        }
    }
    let tail: f32 = row[split..].iter().map(|&v| cpu::exp(v * inv - max)).sum();
    (max, (acc.iter().sum::<f32>() + tail).ln())
}

/// `(max, ln Σ e^(z − max), entropy)` of a row's softmax at `temp` (`z = x / temp`), in
/// one pass after the max. Entries at −∞ have probability 0 and add nothing.
#[inline(always)]
fn log_sum_exp_entropy(row: &[f32], temp: f32) -> (f32, f32, f32) {
    let inv = 1.0 / temp;
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * inv;
    let (mut s, mut t) = ([0f32; 16], [0f32; 16]);
    let split = row.len() / 16 * 16;
    for c in row[..split].chunks_exact(16) {
        for l in 0..16 {
            let z = c[l] * inv - max;
            let e = cpu::exp(z);
            s[l] += e;
            // e = 0 exactly where z = −∞ (0 · −∞ would be NaN).
            t[l] += if e > 0.0 { e * z } else { 0.0 };
        }
    }
    let (mut st, mut tt) = (0f32, 0f32);
    for &v in &row[split..] {
        let z = v * inv - max;
        let e = cpu::exp(z);
        st += e;
        tt += if e > 0.0 { e * z } else { 0.0 };
    }
    let sum = s.iter().sum::<f32>() + st;
    let lse = sum.ln();
    (max, lse, lse - (t.iter().sum::<f32>() + tt) / sum)
}

/// The AdamW hyper-parameters of one update, with the bias corrections of its step.
#[derive(Debug, Clone, Copy)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// `1 − lr · weight_decay`.
    pub decay: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// `1 / (1 − beta1^step)`.
    pub scale_m: f32,
    /// `1 / (1 − beta2^step)`.
    pub scale_v: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Gradient factor (clipping; 1 otherwise).
    pub clip: f32,
}

/// One AdamW update in place, with the same f32 arithmetic in the same order as
/// `candle_nn::AdamW::step` (so both give identical parameters).
pub fn adamw(theta: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32], h: AdamW) {
    assert!(
        grad.len() == theta.len() && m.len() == theta.len() && v.len() == theta.len(),
        "adamw: parameter {}, gradient {}, moments {} and {}",
        theta.len(),
        grad.len(),
        m.len(),
        v.len()
    );
    // Runs of parameters, independent of each other, spread over idle cores.
    const RUN: usize = 1 << 15;
    let runs = theta
        .chunks_mut(RUN)
        .zip(grad.chunks(RUN))
        .zip(m.chunks_mut(RUN))
        .zip(v.chunks_mut(RUN));
    cores::each(runs, |(((theta, grad), m), v)| {
        cpu::vectorized(
            #[inline(always)]
            || {
                for (((t, &g), m), v) in theta.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
                    let g = g * h.clip;
                    let nm = *m * h.beta1 + g * (1.0 - h.beta1);
                    let nv = *v * h.beta2 + (g * g) * (1.0 - h.beta2);
                    *m = nm;
                    *v = nv;
                    let m_hat = nm * h.scale_m;
                    let v_hat = nv * h.scale_v;
                    let next = *t * h.decay;
                    *t = next - (m_hat / (v_hat.sqrt() + h.eps)) * h.lr;
                }
            },
        )
    });
}

/// Σ x² in f64 (a gradient norm's square), vectorised.
pub fn sum_sq_f64(x: &[f32]) -> f64 {
    cpu::vectorized(
        #[inline(always)]
        || {
            let mut acc = [0f64; 8];
            let split = x.len() / 8 * 8;
            for c in x[..split].chunks_exact(8) {
                for l in 0..8 {
                    acc[l] += c[l] as f64 * c[l] as f64;
                }
            }
            acc.iter().sum::<f64>() + x[split..].iter().map(|&v| v as f64 * v as f64).sum::<f64>()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows<'a>(
        logits: &'a [f32],
        tokens: &'a [u32],
        batch: usize,
        seq: usize,
        vocab: usize,
        temp: f32,
    ) -> TokenLogits<'a> {
        TokenLogits {
            logits,
            tokens,
            batch,
            seq,
            vocab,
            temp,
        }
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Central finite difference of `f` along every input element, against `analytic`.
    fn check_grad(x: &mut [f32], analytic: &[f32], mut f: impl FnMut(&[f32]) -> f64, tol: f64) {
        let eps = 1e-2f32;
        for i in 0..x.len() {
            let v = x[i];
            x[i] = v + eps;
            let up = f(x);
            x[i] = v - eps;
            let down = f(x);
            x[i] = v;
            let fd = (up - down) / (2.0 * eps as f64);
            let a = analytic[i] as f64;
            assert!(
                (fd - a).abs() <= tol * (1.0 + fd.abs()),
                "element {i}: finite difference {fd} vs analytic {a}"
            );
        }
    }

    #[test]
    fn rms_norm_backward_matches_finite_differences() {
        let (rows, d) = (3, 8);
        let mut x = data(rows * d, 1);
        let mut w = data(d, 2);
        let gy = data(rows * d, 3);
        let loss = |x: &[f32], w: &[f32]| -> f64 {
            let mut y = vec![0f32; x.len()];
            cpu::rms_norm(x, w, 1e-5, &mut y);
            y.iter().zip(&gy).map(|(a, b)| (a * b) as f64).sum()
        };
        let mut dx = vec![0f32; rows * d];
        let mut dw = vec![0f32; d];
        rms_norm_backward(&x, &w, 1e-5, &gy, &mut dx, &mut dw);
        let w0 = w.clone();
        check_grad(&mut x, &dx, |x| loss(x, &w0), 2e-2);
        let x0 = x.clone();
        check_grad(&mut w, &dw, |w| loss(&x0, w), 2e-2);
    }

    #[test]
    fn inverse_rope_undoes_rope() {
        let (t, heads, hd) = (3, 2, 8);
        let cos = data(4 * hd / 2, 4);
        let sin: Vec<f32> = cos.iter().map(|c| (1.0 - c * c).sqrt()).collect();
        for interleaved in [false, true] {
            let x0 = data(t * heads * hd, 5);
            let mut x = x0.clone();
            rope(&mut x, &[0, 3, 1], heads, hd, &cos, &sin, interleaved, false);
            assert!(x.iter().zip(&x0).any(|(a, b)| (a - b).abs() > 1e-3));
            rope(&mut x, &[0, 3, 1], heads, hd, &cos, &sin, interleaved, true);
            for (a, b) in x.iter().zip(&x0) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn silu_mul_backward_matches_finite_differences() {
        let mut g = data(16, 6);
        let mut u = data(16, 7);
        let gy = data(16, 8);
        let loss = |g: &[f32], u: &[f32]| -> f64 {
            let mut y = vec![0f32; g.len()];
            cpu::silu_mul(g, u, &mut y);
            y.iter().zip(&gy).map(|(a, b)| (a * b) as f64).sum()
        };
        let (mut dg, mut du) = (vec![0f32; 16], vec![0f32; 16]);
        silu_mul_backward(&g, &u, &gy, &mut dg, &mut du);
        let u0 = u.clone();
        check_grad(&mut g, &dg, |g| loss(g, &u0), 1e-2);
        let g0 = g.clone();
        check_grad(&mut u, &du, |u| loss(&g0, u), 1e-2);
    }

    /// Attention by its definition, one score at a time.
    fn naive_attention(s: AttnShape, q: &[f32], k: &[f32], v: &[f32], mask: &[f32]) -> Vec<f32> {
        let (t, hd, rep) = (s.seq, s.hd, s.heads / s.kv_heads);
        let mut out = vec![0f32; q.len()];
        for r in 0..s.batch {
            for h in 0..s.heads {
                let g = h / rep;
                for i in 0..t {
                    let qi = &q[((r * t + i) * s.heads + h) * hd..][..hd];
                    let mut sc: Vec<f32> = (0..t)
                        .map(|j| {
                            let kj = &k[((r * t + j) * s.kv_heads + g) * hd..][..hd];
                            let m = if mask.len() == t * t {
                                mask[i * t + j]
                            } else {
                                mask[(r * t + i) * t + j]
                            };
                            cpu::dot(qi, kj) * s.scale + m
                        })
                        .collect();
                    cpu::softmax_in_place(&mut sc);
                    for (j, p) in sc.iter().enumerate() {
                        let vj = &v[((r * t + j) * s.kv_heads + g) * hd..][..hd];
                        for (o, x) in out[((r * t + i) * s.heads + h) * hd..][..hd].iter_mut().zip(vj) {
                            *o += p * x;
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_its_definition_and_its_gradients_match_finite_differences() {
        let s = AttnShape {
            batch: 2,
            seq: 5,
            heads: 4,
            kv_heads: 2,
            hd: 4,
            scale: 0.5,
            products: Products::F32,
        };
        let mut q = data(2 * 5 * 4 * 4, 9);
        let mut k = data(2 * 5 * 2 * 4, 10);
        let mut v = data(2 * 5 * 2 * 4, 11);
        // Causal, with row 1 packing two samples (0..2 and 2..5).
        let mut mask = vec![-1e9f32; 2 * 5 * 5];
        for r in 0..2 {
            for i in 0..5 {
                for j in 0..=i {
                    if r == 0 || (i < 2) == (j < 2) {
                        mask[(r * 5 + i) * 5 + j] = 0.0;
                    }
                }
            }
        }
        let mut out = vec![0f32; q.len()];
        attention_forward(s, &q, &k, &v, &mask, &mut out);
        let want = naive_attention(s, &q, &k, &v, &mask);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let gy = data(q.len(), 12);
        let loss = |q: &[f32], k: &[f32], v: &[f32]| -> f64 {
            naive_attention(s, q, k, v, &mask)
                .iter()
                .zip(&gy)
                .map(|(a, b)| (a * b) as f64)
                .sum()
        };
        let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![1f32; k.len()], vec![1f32; v.len()]);
        attention_backward(s, &q, &k, &v, &mask, &gy, &mut dq, &mut dk, &mut dv);
        let (k0, v0) = (k.clone(), v.clone());
        check_grad(&mut q, &dq, |q| loss(q, &k0, &v0), 2e-2);
        let q0 = q.clone();
        check_grad(&mut k, &dk, |k| loss(&q0, k, &v0), 2e-2);
        let k0 = k.clone();
        check_grad(&mut v, &dv, |v| loss(&q0, &k0, v), 2e-2);
    }

    #[test]
    fn kernels_spread_over_idle_cores_give_the_same_bits() {
        // A training step spreads attention's batch rows, logprob rows and AdamW's runs of
        // parameters over the cores the rollout leaves idle; the trainer's logprobs must
        // stay the sampler's, so spreading changes no bit.
        let same = |a: &[f32], b: &[f32], what: &str| {
            assert!(
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{what}: spread over two threads differs"
            );
        };
        let spread = |f: &dyn Fn() -> Vec<Vec<f32>>| {
            crate::cores::spread(2, || {
                // Nothing in this test binary holds a core busy.
                assert_eq!(crate::cores::threads(), 2);
                f()
            })
        };
        for products in [Products::F32, Products::Bf16] {
            let (b, t, hq, hk, hd) = (5, 33, 4, 2, 8);
            let s = AttnShape {
                batch: b,
                seq: t,
                heads: hq,
                kv_heads: hk,
                hd,
                scale: 0.3,
                products,
            };
            let (q, k, v) = (
                data(b * t * hq * hd, 1),
                data(b * t * hk * hd, 2),
                data(b * t * hk * hd, 3),
            );
            let dout = data(q.len(), 4);
            let mut mask = vec![MASKED * 2.0; t * t];
            for i in 0..t {
                mask[i * t..=i * t + i].fill(0.0);
            }
            let run = || {
                let mut out = vec![0f32; q.len()];
                attention_forward(s, &q, &k, &v, &mask, &mut out);
                let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
                attention_backward(s, &q, &k, &v, &mask, &dout, &mut dq, &mut dk, &mut dv);
                vec![out, dq, dk, dv]
            };
            for (i, (a, b)) in run().iter().zip(&spread(&run)).enumerate() {
                same(a, b, &format!("attention {products:?}, output {i}"));
            }
        }
        let (b, t, vocab) = (3, 7, 300);
        let logits = data(b * t * vocab, 5);
        let tokens: Vec<u32> = (0..b * t).map(|i| (i * 37 % vocab) as u32).collect();
        let g = data(b * t, 6);
        let run = || {
            let x = rows(&logits, &tokens, b, t, vocab, 0.8);
            let (mut lp, mut lp2, mut h) = (vec![0f32; b * t], vec![0f32; b * t], vec![0f32; b * t]);
            logprobs_forward(x, &mut lp);
            logprobs_entropy_forward(x, &mut lp2, &mut h);
            let mut d = vec![0f32; logits.len()];
            logprobs_backward(x, &g, &mut d);
            vec![lp, lp2, h, d]
        };
        for (i, (a, b)) in run().iter().zip(&spread(&run)).enumerate() {
            same(a, b, &format!("logprobs, output {i}"));
        }
        let n = 3 * (1 << 15) + 17;
        let h = AdamW {
            lr: 1e-3,
            decay: 0.999,
            beta1: 0.9,
            beta2: 0.95,
            scale_m: 1.5,
            scale_v: 2.5,
            eps: 1e-8,
            clip: 0.7,
        };
        let run = || {
            let (mut theta, mut m, mut v) = (
                data(n, 7),
                data(n, 8),
                data(n, 9).iter().map(|x| x * x).collect::<Vec<f32>>(),
            );
            adamw(&mut theta, &data(n, 10), &mut m, &mut v, h);
            vec![theta, m, v]
        };
        for (i, (a, b)) in run().iter().zip(&spread(&run)).enumerate() {
            same(a, b, &format!("adamw, output {i}"));
        }
    }

    #[test]
    fn logprobs_backward_matches_finite_differences() {
        let (b, t, vocab) = (2, 3, 5);
        let mut logits = data(b * t * vocab, 13);
        let tokens = [1, 4, 0, 2, 3, 3];
        let g = data(b * t, 14);
        let temp = 0.7;
        let loss = |l: &[f32]| -> f64 {
            let mut out = vec![0f32; b * t];
            logprobs_forward(rows(l, &tokens, b, t, vocab, temp), &mut out);
            out.iter().zip(&g).map(|(a, b)| (a * b) as f64).sum()
        };
        let mut d = vec![9f32; logits.len()];
        logprobs_backward(rows(&logits, &tokens, b, t, vocab, temp), &g, &mut d);
        check_grad(&mut logits, &d, loss, 2e-2);
    }

    #[test]
    fn fast_exp_is_within_3e_7_of_e_to_the_x() {
        let mut worst = 0f64;
        for i in -8730..=8830 {
            let x = i as f32 / 100.0;
            let (a, b) = (cpu::exp(x) as f64, (x as f64).exp());
            worst = worst.max((a - b).abs() / b);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(cpu::exp(-100.0), 0.0);
        assert_eq!(cpu::exp(f32::NEG_INFINITY), 0.0);
        assert!(cpu::exp(100.0).is_finite());
    }

    #[test]
    fn adamw_follows_its_definition() {
        let mut theta = vec![1.0f32, -2.0];
        let (mut m, mut v) = (vec![0.1f32, 0.0], vec![0.01f32, 0.0]);
        let h = AdamW {
            lr: 0.1,
            decay: 0.99,
            beta1: 0.9,
            beta2: 0.999,
            scale_m: 2.0,
            scale_v: 3.0,
            eps: 1e-8,
            clip: 0.5,
        };
        adamw(&mut theta, &[0.4, -1.0], &mut m, &mut v, h);
        let g = [0.2f32, -0.5];
        for i in 0..2 {
            let nm = [0.1f32, 0.0][i] * 0.9 + g[i] * 0.1;
            let nv = [0.01f32, 0.0][i] * 0.999 + g[i] * g[i] * 0.001;
            let want = [1.0f32, -2.0][i] * 0.99 - nm * 2.0 / ((nv * 3.0).sqrt() + 1e-8) * 0.1;
            assert!(
                (theta[i] - want).abs() < 1e-5 && (m[i] - nm).abs() < 1e-6 && (v[i] - nv).abs() < 1e-8,
                "{i}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "token 7 outside the vocabulary of 5")]
    fn logprobs_refuse_a_token_outside_the_vocabulary() {
        let mut out = [0f32; 2];
        logprobs_forward(rows(&[0.0; 10], &[0, 7], 1, 2, 5, 1.0), &mut out);
    }

    /// Equal to the bit, or a panic naming the first element that differs.
    fn same_bits(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!("{what}: element {i} is {:e}, not {:e}", got[i], want[i]);
        }
    }

    #[test]
    fn a_row_of_a_product_is_the_same_whatever_rows_share_the_call() {
        // Shapes of a 135M model's projections; the 1536-deep one spans several depth blocks.
        for (inp, out) in [(576, 192), (1536, 576), (64, 3)] {
            let x = data(40 * inp, 7);
            let w = data(inp * out, 8);
            let mut all = vec![0f32; 40 * out];
            cpu::matmul(&x, 40, &w, inp, out, &mut all, false, 1);
            for (from, n) in [(0, 1), (5, 1), (3, 2), (10, 7), (0, 33)] {
                let mut part = vec![0f32; n * out];
                cpu::matmul(&x[from * inp..], n, &w, inp, out, &mut part, false, 1);
                same_bits(
                    &part,
                    &all[from * out..(from + n) * out],
                    &format!("{n} rows from {from} ({inp}×{out})"),
                );
                // Accumulating adds the product in the same blocks into what is there.
                let base = data(n * out, 9);
                let mut acc = base.clone();
                cpu::matmul(&x[from * inp..], n, &w, inp, out, &mut acc, true, 1);
                // The same rows accumulated beside at least one more (a lone row: two).
                let many = if n == 1 { 2 } else { n };
                let mut wide = [base.clone(), base[..out].to_vec()].concat();
                cpu::matmul(&x[from * inp..], many, &w, inp, out, &mut wide[..many * out], true, 1);
                same_bits(&acc, &wide[..n * out], &format!("accumulating {n} rows from {from}"));
            }
            // The strided kernel too: a lone row of a transposed view equals its row of all.
            let wt = cpu::transpose(&w, inp, out);
            let b = View::rows(&wt, out, inp).t();
            let many = cpu::gemm_new(View::rows(&x, 40, inp), b, 0.5);
            let lone = cpu::gemm_new(View::rows(&x[9 * inp..], 1, inp), b, 0.5);
            same_bits(&lone, &many[9 * out..10 * out], &format!("gemm_new, {inp}×{out}"));
        }
    }

    #[test]
    fn a_decode_step_attends_exactly_as_the_training_forward_over_a_packed_row() {
        // One packed row of two samples, block-diagonal causal mask; 40 and 70 keys take
        // the scores' and the weighted sum's blocks of 32 and their tails.
        for hd in [8, 32, 40, 64] {
            for lens in [[5usize, 12], [1, 2], [20, 3], [40, 70]] {
                attends_as_trained(hd, lens);
            }
        }
    }

    fn attends_as_trained(hd: usize, lens: [usize; 2]) {
        let (heads, kv_heads) = (4, 2);
        let t: usize = lens.iter().sum();
        let s = AttnShape {
            batch: 1,
            seq: t,
            heads,
            kv_heads,
            hd,
            scale: 0.125,
            products: Products::F32,
        };
        let (q, k, v) = (
            data(t * heads * hd, 11),
            data(t * kv_heads * hd, 12),
            data(t * kv_heads * hd, 13),
        );
        let mut mask = vec![-1e9f32; t * t];
        let mut start = 0;
        for len in lens {
            for i in start..start + len {
                mask[i * t + start..=i * t + i].fill(0.0);
            }
            start += len;
        }
        let mut out = vec![0f32; t * heads * hd];
        attention_forward(s, &q, &k, &v, &mask, &mut out);
        // The engine: each token over the cache of its own sample's positions so far.
        let (kw, qw) = (kv_heads * hd, heads * hd);
        let mut start = 0;
        for len in lens {
            for i in 0..len {
                let at = start + i;
                let kv = cpu::KvLayout::with_room(kv_heads, hd, i + 1);
                let (mut keys, mut values) = (vec![0f32; kv.size()], vec![0f32; kv.size()]);
                for j in 0..=i {
                    let (kj, vj) = (&k[(start + j) * kw..][..kw], &v[(start + j) * kw..][..kw]);
                    kv.write(&mut keys, &mut values, j, kj, vj);
                }
                let mut one = vec![0f32; qw];
                let mut scratch = vec![0.0; heads / kv_heads * t];
                cpu::attend(
                    &q[at * qw..(at + 1) * qw],
                    &keys,
                    &values,
                    kv,
                    i + 1,
                    0.125,
                    &mut scratch,
                    &mut one,
                );
                same_bits(
                    &one,
                    &out[at * qw..(at + 1) * qw],
                    &format!("token {i} of the sample at {start} (hd {hd}, lengths {lens:?})"),
                );
            }
            start += len;
        }
    }

    /// A causal mask over one row packing samples of `lens`, padded to `width` (a padding
    /// position attends to itself alone, as `Packed` builds it).
    fn packed_mask(lens: &[usize], width: usize) -> Vec<f32> {
        let mut mask = vec![MASKED; width * width];
        let mut start = 0;
        for &len in lens {
            for i in start..start + len {
                mask[i * width + start..=i * width + i].fill(0.0);
            }
            start += len;
        }
        for i in start..width {
            mask[i * width + i] = 0.0;
        }
        mask
    }

    #[test]
    fn a_packed_rows_gradients_are_its_samples_gradients_apart() {
        // Samples of 70 (two blocks of query rows) and 30 tokens, then 6 of padding.
        let (heads, kv_heads, hd, lens, width) = (4, 2, 8, [70usize, 30], 106);
        let (qw, kw) = (heads * hd, kv_heads * hd);
        let shape = |seq| AttnShape {
            batch: 1,
            seq,
            heads,
            kv_heads,
            hd,
            scale: 0.35,
            products: Products::F32,
        };
        let (q, k, v, dout) = (
            data(width * qw, 31),
            data(width * kw, 32),
            data(width * kw, 33),
            data(width * qw, 34),
        );
        let grads = |s: AttnShape, at: usize, mask: &[f32]| {
            let t = s.seq;
            let (q, k, v, dout) = (
                &q[at * qw..][..t * qw],
                &k[at * kw..][..t * kw],
                &v[at * kw..][..t * kw],
                &dout[at * qw..][..t * qw],
            );
            let (mut dq, mut dk, mut dv) = (vec![f32::NAN; t * qw], vec![f32::NAN; t * kw], vec![f32::NAN; t * kw]);
            attention_backward(s, q, k, v, mask, dout, &mut dq, &mut dk, &mut dv);
            [dq, dk, dv]
        };
        let packed = grads(shape(width), 0, &packed_mask(&lens, width));
        let mut start = 0;
        for len in lens {
            let alone = grads(shape(len), start, &packed_mask(&[len], len));
            for (name, (got, want), w) in [("dq", qw), ("dk", kw), ("dv", kw)]
                .iter()
                .zip(packed.iter().zip(&alone))
                .map(|((n, w), g)| (n, g, *w))
            {
                for (i, (a, b)) in got[start * w..(start + len) * w].iter().zip(want).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "{name}[{i}] of the sample at {start}: {a} packed, {b} alone"
                    );
                }
            }
            start += len;
        }
        // Every entry was written (the padding rows' included): none is left NaN.
        for (name, g) in ["dq", "dk", "dv"].iter().zip(&packed) {
            assert!(g.iter().all(|x| x.is_finite()), "{name} has a non-finite entry");
        }
    }

    #[test]
    fn the_samplers_log_softmax_terms_are_the_trainers() {
        let vocab = 37;
        let logits = data(3 * vocab, 21);
        let tokens = [0u32, 5, 36];
        let mut out = [0f32; 3];
        logprobs_forward(rows(&logits, &tokens, 1, 3, vocab, 0.7), &mut out);
        for i in 1..3 {
            let row = &logits[(i - 1) * vocab..i * vocab];
            let (max, lse) = log_softmax_terms(row, 0.7);
            assert_eq!((row[tokens[i] as usize] / 0.7 - max - lse).to_bits(), out[i].to_bits());
        }
    }
}

//! [`attend`](super::attend) for the query heads that share one kv head, in AVX2 registers:
//! each key block and each value row is read once for all of the group's heads instead of
//! once per head.
//!
//! Every score and every output column is the same chain of fused multiply-adds, in the
//! same order, as the per-head loops compute it (tested to the bit), so a decode step still
//! equals the training forward.

#![allow(unsafe_code)]

use std::arch::x86_64::{__m256, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps};

use super::{Cached, KEY_BLOCK};
use crate::cpu::softmax_in_place;

/// Most query heads computed together: 3 heads × 2 registers of accumulators, with their
/// broadcast query values and the keys, stay within AVX2's 16 registers.
pub(super) const MAX_HEADS: usize = 3;

/// [`attend`](super::attend) for `R` query heads (`q`, `out`: `(R, hd)`) of one kv head:
/// their scores together ([`scores`]), a softmax each, their weighted sums together
/// ([`weighted_sums`]).
///
/// # Safety
/// The CPU has AVX2 and FMA; `hd` is a multiple of 8; `kb` holds the kv head's key blocks
/// up to a multiple of [`KEY_BLOCK`] at or past `len`, `vs` its `len` value rows; `scratch`
/// holds `R · len`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn attend_heads<T: Cached, const R: usize>(
    q: &[f32],
    kb: &[T],
    vs: &[T],
    len: usize,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let hd = q.len() / R;
    assert!(kb.len() >= len.div_ceil(KEY_BLOCK) * KEY_BLOCK * hd && vs.len() >= len * hd && scratch.len() >= R * len);
    let mut rows = scratch[..R * len].chunks_exact_mut(len);
    let mut s: [&mut [f32]; R] = std::array::from_fn(|_| rows.next().expect("R rows"));
    let qs: [*const f32; R] = std::array::from_fn(|h| q[h * hd..].as_ptr());
    // SAFETY: every block read lies inside `kb` and every row written inside `s` (asserted).
    unsafe { scores(qs, kb.as_ptr(), hd, len, scale, s.each_mut().map(|r| r.as_mut_ptr())) };
    for row in s.iter_mut() {
        softmax_in_place(row);
        if T::BF16 {
            crate::bf16::round_in_place(row);
        }
    }
    let mut outs = out.chunks_exact_mut(hd);
    let o: [*mut f32; R] = std::array::from_fn(|_| outs.next().expect("R heads").as_mut_ptr());
    // SAFETY: `len` rows of `hd` inside `vs` (asserted), `R` outputs of `hd`.
    unsafe { weighted_sums(s.each_ref().map(|r| &**r), vs.as_ptr(), hd, len, o) };
}

/// `s[h][j] = scale · Σ_d q[h][d] · key_j[d]` for `j < n`, 16 keys per block, one whole
/// block at a time (the last one's lanes past `n` are not stored).
#[inline(always)]
unsafe fn scores<T: Cached, const R: usize>(
    q: [*const f32; R],
    kb: *const T,
    hd: usize,
    n: usize,
    scale: f32,
    s: [*mut f32; R],
) {
    // SAFETY (all below): the caller's bounds.
    unsafe {
        let scale = _mm256_set1_ps(scale);
        let mut j = 0;
        while j < n {
            let block = kb.add(j * hd);
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for d in 0..hd {
                let row = block.add(d * KEY_BLOCK);
                let keys = [T::load8(row), T::load8(row.add(8))];
                for h in 0..R {
                    let qd = _mm256_set1_ps(*q[h].add(d));
                    acc[h][0] = _mm256_fmadd_ps(qd, keys[0], acc[h][0]);
                    acc[h][1] = _mm256_fmadd_ps(qd, keys[1], acc[h][1]);
                }
            }
            let keep = (n - j).min(KEY_BLOCK);
            for h in 0..R {
                if keep == KEY_BLOCK {
                    _mm256_storeu_ps(s[h].add(j), _mm256_mul_ps(acc[h][0], scale));
                    _mm256_storeu_ps(s[h].add(j + 8), _mm256_mul_ps(acc[h][1], scale));
                } else {
                    let mut lanes = [0f32; KEY_BLOCK];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(acc[h][0], scale));
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), _mm256_mul_ps(acc[h][1], scale));
                    std::ptr::copy_nonoverlapping(lanes.as_ptr(), s[h].add(j), keep);
                }
            }
            j += KEY_BLOCK;
        }
    }
}

/// `out[h] = Σ_j p[h][j] · v[j·stride ..][..hd]` for `R` heads over the same values, each
/// term one fused multiply-add in position order, terms with `p[h][j] = 0` skipped for that
/// head, as [`weighted_sum`](crate::cpu::weighted_sum) sums one head.
#[inline(always)]
unsafe fn weighted_sums<T: Cached, const R: usize>(
    p: [&[f32]; R],
    v: *const T,
    hd: usize,
    n: usize,
    out: [*mut f32; R],
) {
    let mut c = 0;
    // SAFETY (all below): the caller's bounds; columns c..c + 16 (then c..c + 8) lie
    // within `hd`, a multiple of 8.
    unsafe {
        while c + 16 <= hd {
            columns::<T, R, 2>(p, v.add(c), hd, n, out.map(|o| o.add(c)));
            c += 16;
        }
        while c < hd {
            columns::<T, R, 1>(p, v.add(c), hd, n, out.map(|o| o.add(c)));
            c += 8;
        }
    }
}

/// Columns `8·B` wide of [`weighted_sums`], kept in `R × B` registers.
#[inline(always)]
unsafe fn columns<T: Cached, const R: usize, const B: usize>(
    p: [&[f32]; R],
    v: *const T,
    stride: usize,
    n: usize,
    out: [*mut f32; R],
) {
    // SAFETY: the caller's ([`weighted_sums`]).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); B]; R];
        for j in 0..n {
            let row = v.add(j * stride);
            let x: [__m256; B] = std::array::from_fn(|b| T::load8(row.add(8 * b)));
            for h in 0..R {
                let pj = *p[h].get_unchecked(j);
                if pj == 0.0 {
                    continue;
                }
                let a = _mm256_set1_ps(pj);
                for b in 0..B {
                    acc[h][b] = _mm256_fmadd_ps(a, x[b], acc[h][b]);
                }
            }
        }
        for h in 0..R {
            for (b, a) in acc[h].iter().enumerate() {
                _mm256_storeu_ps(out[h].add(8 * b), *a);
            }
        }
    }
}

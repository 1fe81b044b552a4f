//! Decode attention: one token's query heads over a sequence's cached keys and values.
//!
//! The cache is laid out for reading ([`KvLayout`]): a kv head's keys in blocks of
//! [`KEY_BLOCK`] positions, each block `(hd, 16)` and contiguous, and its values
//! position-major and contiguous. A query's scores then run over 16 positions at once from
//! one contiguous run of memory, and the weighted sum of values reads one stream. Where the
//! CPU has AVX2 the query heads that share a kv head are computed together, reading each
//! key and value once for all of them ([`avx2`]).
//!
//! The cache holds `f32` or bf16 ([`Cached`]). In bf16 attention is what a bf16 product
//! computes ([`crate::bf16::gemm`], the training forward's attention under bf16): the
//! query, the keys, the probabilities and the values rounded to bf16, sums in f32. That
//! halves the bytes a decode step reads.
//!
//! At SmolLM2's shape and batch 32 a decode step reads about 100 MB of cached keys and
//! values, read there in strided rows (keys transposed over the whole capacity, values of
//! every kv head interleaved): attention took a quarter of the step waiting for memory.
//!
//! ```
//! use streamrl_kernels::cpu::{KvLayout, attend};
//!
//! // One kv head of width 8, room for 16 positions, two positions cached.
//! let kv = KvLayout { kv_heads: 1, hd: 8, cap: 16 };
//! let (mut keys, mut values) = (vec![0.0; kv.size()], vec![0.0; kv.size()]);
//! kv.write(&mut keys, &mut values, 0, &[1.0; 8], &[1.0; 8]);
//! kv.write(&mut keys, &mut values, 1, &[0.0; 8], &[3.0; 8]);
//! // A zero query scores both positions alike: the mean of their values.
//! let mut out = [0.0; 8];
//! attend(&[0.0; 8], &keys, &values, kv, 2, 1.0, &mut [0.0; 2], &mut out);
//! assert_eq!(out, [2.0; 8]);
//! ```

use super::{softmax_in_place, weighted_sum_portable, with_fma};

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Positions per block of cached keys ([`KvLayout`]).
pub const KEY_BLOCK: usize = 16;

/// A number type the cache holds: `f32`, or bf16 as its bits (`u16`, rounded to nearest
/// even by [`crate::bf16::round`]).
pub trait Cached: Copy + Default + Send + Sync + 'static {
    /// Whether attention reads its inputs rounded to bf16 (query and probabilities too).
    const BF16: bool;
    /// `x` as stored.
    fn store(x: f32) -> Self;
    /// The stored value as an `f32`.
    fn load(self) -> f32;
    /// Eight consecutive stored values widened into an AVX register.
    ///
    /// # Safety
    /// The CPU has AVX2; `p` points at 8 readable values.
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Cached for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn store(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl Cached for u16 {
    const BF16: bool = true;
    #[inline(always)]
    fn store(x: f32) -> u16 {
        crate::bf16::round(x)
    }
    #[inline(always)]
    fn load(self) -> f32 {
        crate::bf16::widen(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::{
            __m128i, _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_slli_epi32,
        };
        // SAFETY: the caller's: 8 values of 2 bytes; a bf16 is the high half of its f32.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                p as *const __m128i,
            ))))
        }
    }
}

/// Where one layer's cached keys and values of one sequence lie.
///
/// Keys: `(kv_heads, cap / 16, hd, 16)`: dimension `d` of kv head `g` at position `j` is at
/// [`key`](Self::key)`(g, d, j)`. Values: `(kv_heads, cap, hd)`: the row of kv head `g` at
/// position `j` starts at [`value`](Self::value)`(g, j)`. `cap` is a multiple of 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub hd: usize,
    /// Positions there is room for: a multiple of [`KEY_BLOCK`].
    pub cap: usize,
}

impl KvLayout {
    /// Room for at least `positions` (rounded up to a whole block).
    pub fn with_room(kv_heads: usize, hd: usize, positions: usize) -> KvLayout {
        KvLayout {
            kv_heads,
            hd,
            cap: positions.max(1).div_ceil(KEY_BLOCK) * KEY_BLOCK,
        }
    }

    /// Values in the key buffer, and in the value buffer.
    pub fn size(&self) -> usize {
        self.kv_heads * self.hd * self.cap
    }

    /// Index of dimension `d` of kv head `g`'s key at position `j`.
    #[inline(always)]
    pub fn key(&self, g: usize, d: usize, j: usize) -> usize {
        g * self.hd * self.cap + (j / KEY_BLOCK) * self.hd * KEY_BLOCK + d * KEY_BLOCK + j % KEY_BLOCK
    }

    /// Index of the first value of kv head `g`'s row at position `j`.
    #[inline(always)]
    pub fn value(&self, g: usize, j: usize) -> usize {
        (g * self.cap + j) * self.hd
    }

    /// Stores position `pos`'s keys and values, each `(kv_heads, hd)`.
    pub fn write<T: Cached>(&self, keys: &mut [T], values: &mut [T], pos: usize, k: &[f32], v: &[f32]) {
        assert!(
            pos < self.cap && keys.len() >= self.size() && values.len() >= self.size(),
            "KvLayout::write: position {pos} of {self:?} into {} keys and {} values",
            keys.len(),
            values.len()
        );
        let hd = self.hd;
        for g in 0..self.kv_heads {
            for (d, &x) in k[g * hd..(g + 1) * hd].iter().enumerate() {
                keys[self.key(g, d, pos)] = T::store(x);
            }
            let at = self.value(g, pos);
            for (o, &x) in values[at..at + hd].iter_mut().zip(&v[g * hd..(g + 1) * hd]) {
                *o = T::store(x);
            }
        }
    }

    /// The first `len` positions of `keys` and `values`, moved to buffers laid out as `to`
    /// (the same heads, room for more).
    pub fn grow<T: Cached>(&self, to: KvLayout, keys: &[T], values: &[T], len: usize) -> (Vec<T>, Vec<T>) {
        assert!(
            to.kv_heads == self.kv_heads && to.hd == self.hd && to.cap >= self.cap && len <= self.cap,
            "KvLayout::grow: {len} positions of {self:?} into {to:?}"
        );
        let (mut k, mut v) = (vec![T::default(); to.size()], vec![T::default(); to.size()]);
        // A head's key blocks and value rows are contiguous: the used part moves at once.
        let blocks = len.div_ceil(KEY_BLOCK) * KEY_BLOCK * self.hd;
        for g in 0..self.kv_heads {
            let (from, at) = (self.key(g, 0, 0), to.key(g, 0, 0));
            k[at..at + blocks].copy_from_slice(&keys[from..from + blocks]);
            let (from, at) = (self.value(g, 0), to.value(g, 0));
            v[at..at + len * self.hd].copy_from_slice(&values[from..from + len * self.hd]);
        }
        (k, v)
    }
}

/// Grouped-query attention of one token over the first `len` cached positions of a
/// sequence, laid out as `kv` ([`KvLayout`]).
///
/// `q` is `(heads, hd)`; head `h` reads kv head `h / (heads / kv_heads)`. Writes `out`
/// `(heads, hd)`. `scratch` holds at least `heads / kv_heads` × `len` values. A bf16 cache
/// ([`Cached`]) reads the query and the probabilities rounded to bf16 too.
///
/// Sums in the training forward's order ([`crate::train::attention_forward`]), so a decode
/// step's output equals the training forward's row for that token to the bit: each score a
/// chain of fused multiply-adds along the head dimension (as
/// [`scores_transposed`](super::scores_transposed) computes it), then
/// [`softmax_in_place`], then [`weighted_sum`].
#[allow(clippy::too_many_arguments, unsafe_code)]
pub fn attend<T: Cached>(
    q: &[f32],
    keys: &[T],
    values: &[T],
    kv: KvLayout,
    len: usize,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let KvLayout { kv_heads, hd, cap } = kv;
    let heads = q.len() / hd;
    let rep = heads / kv_heads;
    assert!(
        cap.is_multiple_of(KEY_BLOCK)
            && len <= cap
            && keys.len() >= kv.size()
            && values.len() >= kv.size()
            && q.len() == heads * hd
            && out.len() == q.len()
            && heads == rep * kv_heads
            && scratch.len() >= rep * len,
        "attend: {len} positions of {kv:?} need {} keys and values ({} and {} given), a whole number of query heads per kv head ({heads} of {hd} for {kv_heads}), an output as wide as the query ({}), and scratch of {} ({} given)",
        kv.size(),
        keys.len(),
        values.len(),
        out.len(),
        rep * len,
        scratch.len()
    );
    if len == 0 {
        out.fill(0.0);
        return;
    }
    let rounded;
    let q = if T::BF16 {
        rounded = crate::bf16::rounded(q);
        &rounded[..]
    } else {
        q
    };
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && super::avx2_fma() {
        for g in 0..kv_heads {
            let kb = &keys[kv.key(g, 0, 0)..][..hd * cap];
            let vs = &values[kv.value(g, 0)..][..len * hd];
            let mut head = g * rep;
            while head < (g + 1) * rep {
                let r = ((g + 1) * rep - head).min(avx2::MAX_HEADS);
                let qs = &q[head * hd..(head + r) * hd];
                let os = &mut out[head * hd..(head + r) * hd];
                // SAFETY: the CPU has AVX2 and FMA (checked above); `kb` holds this kv
                // head's key blocks up to `cap ≥ len`, `vs` its `len` value rows, `hd` is a
                // multiple of 8, and the scratch holds `r ≤ rep` rows of `len` (asserted).
                unsafe {
                    match r {
                        3 => avx2::attend_heads::<T, 3>(qs, kb, vs, len, scale, scratch, os),
                        2 => avx2::attend_heads::<T, 2>(qs, kb, vs, len, scale, scratch, os),
                        _ => avx2::attend_heads::<T, 1>(qs, kb, vs, len, scale, scratch, os),
                    }
                }
                head += r;
            }
        }
        return;
    }
    attend_per_head(q, keys, values, kv, len, scale, scratch, out)
}

/// [`attend`] one query head at a time, in plain loops: where the CPU lacks AVX2, or `hd`
/// is not a multiple of 8.
#[allow(clippy::too_many_arguments)]
fn attend_per_head<T: Cached>(
    q: &[f32],
    keys: &[T],
    values: &[T],
    kv: KvLayout,
    len: usize,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let hd = kv.hd;
    let rep = q.len() / hd / kv.kv_heads;
    let s = &mut scratch[..len];
    with_fma(
        #[inline(always)]
        || {
            for (head, (qh, oh)) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).enumerate() {
                let g = head / rep;
                let kb = &keys[kv.key(g, 0, 0)..][..hd * kv.cap];
                scores_blocked(qh, kb, scale, s);
                softmax_in_place(s);
                if T::BF16 {
                    crate::bf16::round_in_place(s);
                }
                weighted_sum_portable(s, &values[kv.value(g, 0)..], hd, oh);
            }
        },
    )
}

/// `s[j] = scale · Σ_d q[d] · key_j[d]` for `j < s.len()` over one kv head's key blocks
/// `kb` ([`KvLayout`]): per key a chain of fused multiply-adds in `d` order from zero.
#[inline(always)]
fn scores_blocked<T: Cached>(q: &[f32], kb: &[T], scale: f32, s: &mut [f32]) {
    let hd = q.len();
    for (b, chunk) in s.chunks_mut(KEY_BLOCK).enumerate() {
        let block = &kb[b * hd * KEY_BLOCK..][..hd * KEY_BLOCK];
        let mut acc = [0f32; KEY_BLOCK];
        for (&qd, k) in q.iter().zip(block.chunks_exact(KEY_BLOCK)) {
            for l in 0..KEY_BLOCK {
                acc[l] = qd.mul_add(k[l].load(), acc[l]);
            }
        }
        for (o, a) in chunk.iter_mut().zip(acc) {
            *o = a * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// A cache of `len` positions of `k` and `v` (position-major `(len, kv_heads, hd)`).
    fn cache<T: Cached>(kv: KvLayout, k: &[f32], v: &[f32], len: usize) -> (Vec<T>, Vec<T>) {
        let w = kv.kv_heads * kv.hd;
        // Unused room holds NaN: nothing past `len` may reach a result.
        let nan = T::store(f32::NAN);
        let (mut keys, mut values) = (vec![nan; kv.size()], vec![nan; kv.size()]);
        for j in 0..len {
            kv.write(
                &mut keys,
                &mut values,
                j,
                &k[j * w..(j + 1) * w],
                &v[j * w..(j + 1) * w],
            );
        }
        (keys, values)
    }

    #[test]
    fn attention_matches_a_naive_softmax_over_positions() {
        let (heads, kv_heads, hd, len) = (4, 2, 8, 5);
        let q = data(heads * hd, 3);
        let (k, v) = (data(len * kv_heads * hd, 4), data(len * kv_heads * hd, 5));
        let kv = KvLayout::with_room(kv_heads, hd, len);
        let (keys, values) = cache::<f32>(kv, &k, &v, len);
        let mut out = vec![0.0; heads * hd];
        attend(&q, &keys, &values, kv, len, 0.3, &mut [0.0; 16], &mut out);
        for h in 0..heads {
            let g = h / 2;
            let s: Vec<f32> = (0..len)
                .map(|j| {
                    (0..hd)
                        .map(|i| q[h * hd + i] * k[(j * kv_heads + g) * hd + i])
                        .sum::<f32>()
                        * 0.3
                })
                .collect();
            let z: f32 = s.iter().map(|x| x.exp()).sum();
            for i in 0..hd {
                let want: f32 = (0..len).map(|j| s[j].exp() / z * v[(j * kv_heads + g) * hd + i]).sum();
                assert!((out[h * hd + i] - want).abs() < 1e-5, "head {h} dim {i}");
            }
        }
    }

    #[test]
    fn grouped_heads_give_each_heads_bits() {
        // The query heads of a kv head computed together (3 at a time, then the rest) equal
        // the heads computed one by one, to the bit: groups of 1 to 4 heads, widths of
        // 16-column blocks, an 8-column rest and neither, key counts around the 16-key
        // blocks, room past them, and a large scale, so that some probabilities underflow
        // to 0 (skipped terms).
        println!(
            "attend: grouped AVX2 path {}",
            if super::super::avx2_fma() {
                "runs"
            } else {
                "absent: per head only"
            }
        );
        for (rep, hd, kv_heads) in [(3, 64, 3), (1, 16, 2), (2, 24, 1), (4, 8, 2), (3, 6, 1)] {
            for len in [1usize, 7, 8, 9, 15, 16, 17, 33, 70] {
                for (room, scale) in [(len, 0.3), (len + 40, 40.0)] {
                    let heads = rep * kv_heads;
                    let kv = KvLayout::with_room(kv_heads, hd, room);
                    let q = data(heads * hd, 31);
                    let (k, v) = (data(len * kv_heads * hd, 32), data(len * kv_heads * hd, 33));
                    let what = format!(
                        "{rep} heads per kv head, hd {hd}, {len} keys in room for {}, scale {scale}",
                        kv.cap
                    );
                    same_bits::<f32>(kv, &q, &k, &v, len, scale, &format!("f32: {what}"));
                    same_bits::<u16>(kv, &q, &k, &v, len, scale, &format!("bf16: {what}"));
                }
            }
        }
    }

    /// [`attend`] and [`attend_per_head`] give the same bits from a cache of `T`.
    fn same_bits<T: Cached>(kv: KvLayout, q: &[f32], k: &[f32], v: &[f32], len: usize, scale: f32, what: &str) {
        let (keys, values) = cache::<T>(kv, k, v, len);
        let mut scratch = vec![0.0; q.len() / kv.hd / kv.kv_heads * len];
        let (mut got, mut want) = (vec![f32::NAN; q.len()], vec![f32::NAN; q.len()]);
        attend(q, &keys, &values, kv, len, scale, &mut scratch, &mut got);
        let rounded = if T::BF16 { crate::bf16::rounded(q) } else { q.to_vec() };
        attend_per_head(&rounded, &keys, &values, kv, len, scale, &mut scratch, &mut want);
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{what}"
        );
    }

    #[test]
    fn a_bf16_cache_attends_as_bf16_products_do() {
        // In bf16 the query, keys, probabilities and values are read rounded to bf16 and
        // summed in f32: against f32 attention over the same numbers, within what rounding
        // the inputs to 8 bits of mantissa moves (2⁻⁸ relative per input; a few per term).
        let (heads, kv_heads, hd, len) = (9, 3, 64, 50);
        let q = data(heads * hd, 51);
        let (k, v) = (data(len * kv_heads * hd, 52), data(len * kv_heads * hd, 53));
        let kv = KvLayout::with_room(kv_heads, hd, len);
        let (k32, v32) = cache::<f32>(kv, &k, &v, len);
        let (k16, v16) = cache::<u16>(kv, &k, &v, len);
        let mut scratch = vec![0.0; 3 * len];
        let (mut exact, mut bf16) = (vec![0.0; heads * hd], vec![0.0; heads * hd]);
        attend(&q, &k32, &v32, kv, len, 0.125, &mut scratch, &mut exact);
        attend(&q, &k16, &v16, kv, len, 0.125, &mut scratch, &mut bf16);
        let scale = exact.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = exact.iter().zip(&bf16).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst > 0.0, "bf16 attention gave f32's bits: nothing was rounded");
        assert!(
            worst < 2e-2 * scale,
            "bf16 attention {worst} from f32's (outputs up to {scale})"
        );
    }

    #[test]
    fn a_grown_cache_holds_the_same_positions() {
        let (kv_heads, hd, len) = (3, 8, 21);
        let w = kv_heads * hd;
        let (k, v) = (data(len * w, 41), data(len * w, 42));
        let small = KvLayout::with_room(kv_heads, hd, len);
        let (keys, values) = cache::<f32>(small, &k, &v, len);
        let big = KvLayout::with_room(kv_heads, hd, 70);
        let (gk, gv) = small.grow(big, &keys, &values, len);
        for g in 0..kv_heads {
            for j in 0..len {
                for d in 0..hd {
                    assert_eq!(gk[big.key(g, d, j)], k[j * w + g * hd + d]);
                    assert_eq!(gv[big.value(g, j) + d], v[j * w + g * hd + d]);
                }
            }
        }
    }
}

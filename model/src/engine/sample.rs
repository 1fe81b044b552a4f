//! Picking a token from a row of logits.

use rand::Rng;
use rand::rngs::StdRng;

use super::SamplingParams;

/// The `n` most likely tokens of a logits row (most likely first, ties by lower id) with
/// `logprob` of each.
pub fn top_n(logits: &[f32], n: usize, logprob: impl Fn(usize) -> f32) -> Vec<(u32, f32)> {
    if n == 0 || logits.is_empty() {
        return Vec::new();
    }
    let order = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let n = n.min(idx.len());
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, order);
        idx.truncate(n);
    }
    idx.sort_unstable_by(order);
    idx.into_iter().map(|i| (i as u32, logprob(i))).collect()
}

/// Picks a token from one row of logits: its logprob is under the temperature-scaled
/// distribution over the full vocabulary; top-k and top-p only restrict which tokens can
/// be drawn. Also returns the `p.logprobs` most likely tokens under that distribution.
pub(crate) fn sample(logits: &[f32], p: &SamplingParams, rng: &mut StdRng) -> (u32, f32, Vec<(u32, f32)>) {
    let t = if p.temperature > 0.0 { p.temperature } else { 1.0 };
    // The logprob as the trainer computes it (the same sums in the same order).
    let (max_t, lse) = streamrl_kernels::train::log_softmax_terms(logits, t);
    let logprob = |i: usize| logits[i] / t - max_t - lse;
    let top = top_n(logits, p.logprobs, logprob);
    if p.temperature == 0.0 {
        let (i, _) = logits.iter().enumerate().fold(
            (0, f32::NEG_INFINITY),
            |acc, (i, &l)| if l > acc.1 { (i, l) } else { acc },
        );
        return (i as u32, logprob(i), top);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|l| ((l - max) / t).exp()).collect();
    let z: f32 = e.iter().sum();
    let mut cand: Vec<(usize, f32)> = e.iter().enumerate().map(|(i, &v)| (i, v / z)).collect();
    if p.top_k > 0 || p.top_p < 1.0 {
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (n, (_, q)) in cand.iter().enumerate() {
                acc += q;
                if acc >= p.top_p {
                    keep = n + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
    }
    let total: f32 = cand.iter().map(|c| c.1).sum();
    let u: f32 = rng.random::<f32>() * total;
    let mut acc = 0.0;
    for &(i, q) in &cand {
        acc += q;
        if u < acc {
            return (i as u32, logprob(i), top);
        }
    }
    let i = cand.last().map_or(0, |c| c.0);
    (i as u32, logprob(i), top)
}

//! Batched sampling with a preallocated KV cache: left-padded prompts, per-sequence
//! positions, and the logprob of every sampled token under the temperature-scaled
//! distribution it was drawn from.

use candle_core::{D, Tensor};
use rand::{Rng, SeedableRng};

use crate::model::MASKED;
use crate::{Result, Transformer};

/// How to pick tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 means greedy (logprobs are then reported at temperature 1).
    pub temperature: f64,
    /// New tokens per sequence at most.
    pub max_tokens: usize,
    /// Stop a sequence at this token (included in the output).
    pub eos: Option<u32>,
    /// RNG seed.
    pub seed: u64,
}

/// Sampled continuations.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// New tokens per sequence (up to and including eos).
    pub tokens: Vec<Vec<u32>>,
    /// Logprob of each new token.
    pub logprobs: Vec<Vec<f32>>,
}

/// Generates continuations of every prompt in one batch.
pub fn generate(model: &Transformer, prompts: &[Vec<u32>], s: Sampling) -> Result<Generated> {
    let dev = model.device().clone();
    let b = prompts.len();
    let p = prompts.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let pads: Vec<usize> = prompts.iter().map(|q| p - q.len()).collect();
    let mut cache = model.new_cache(p + s.max_tokens);
    let (tokens, positions, mask) = left_padded(prompts, p);
    let mut logits = model.forward_cached(
        &Tensor::from_vec(tokens, (b, p), &dev)?,
        &Tensor::from_vec(positions, (b, p), &dev)?,
        &Tensor::from_vec(mask, (b, 1, p, p), &dev)?,
        &mut cache,
    )?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(s.seed);
    let mut out = Generated {
        tokens: vec![Vec::new(); b],
        logprobs: vec![Vec::new(); b],
    };
    let mut done = vec![false; b];
    for step in 0..s.max_tokens {
        let (_, t, _) = logits.dims3()?;
        let last = logits.narrow(1, t - 1, 1)?.squeeze(1)?;
        let temp = if s.temperature > 0.0 { s.temperature } else { 1.0 };
        let lsm = candle_nn::ops::log_softmax(&(last / temp)?, D::Minus1)?.to_vec2::<f32>()?;
        let mut next = vec![0u32; b];
        for r in 0..b {
            let row = &lsm[r];
            let tok = if done[r] {
                s.eos.unwrap_or(0)
            } else {
                pick(row, s.temperature, &mut rng)
            };
            next[r] = tok;
            if !done[r] {
                out.tokens[r].push(tok);
                out.logprobs[r].push(row[tok as usize]);
                done[r] = Some(tok) == s.eos;
            }
        }
        if done.iter().all(|d| *d) || step + 1 == s.max_tokens {
            break;
        }
        let total = p + step + 1;
        let pos: Vec<u32> = (0..b).map(|r| (p - pads[r] + step) as u32).collect();
        let mut m = vec![MASKED; b * total];
        for r in 0..b {
            for j in pads[r]..total {
                m[r * total + j] = 0.0;
            }
        }
        logits = model.forward_cached(
            &Tensor::from_vec(next, (b, 1), &dev)?,
            &Tensor::from_vec(pos, (b, 1), &dev)?,
            &Tensor::from_vec(m, (b, 1, 1, total), &dev)?,
            &mut cache,
        )?;
    }
    Ok(out)
}

/// Tokens, positions and the causal mask (b, 1, p, p) of `prompts` left-padded to `p`:
/// a pad attends only to itself, a token to the real tokens up to it.
fn left_padded(prompts: &[Vec<u32>], p: usize) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let b = prompts.len();
    let mut tokens = vec![0u32; b * p];
    let mut positions = vec![0u32; b * p];
    let mut mask = vec![MASKED; b * p * p];
    for (r, q) in prompts.iter().enumerate() {
        let pad = p - q.len();
        for (i, &t) in q.iter().enumerate() {
            tokens[r * p + pad + i] = t;
            positions[r * p + pad + i] = i as u32;
        }
        for i in 0..p {
            for j in 0..=i {
                if j >= pad || i == j {
                    mask[(r * p + i) * p + j] = 0.0;
                }
            }
        }
    }
    (tokens, positions, mask)
}

/// The next token from log-probabilities `row`: drawn at `temperature` > 0 (the row is
/// already scaled by it), the most likely one otherwise.
fn pick(row: &[f32], temperature: f64, rng: &mut impl Rng) -> u32 {
    if temperature > 0.0 {
        let u: f32 = rng.random();
        let mut acc = 0f32;
        for (i, l) in row.iter().enumerate() {
            acc += l.exp();
            if u < acc {
                return i as u32;
            }
        }
        (row.len() - 1) as u32
    } else {
        row.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap_or(0)
    }
}

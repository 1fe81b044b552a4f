//! Per-token logprobs and entropies from logits.

use super::*;

/// Per-token logprobs at temperature `t`: `out[b, i] = log_softmax(logits[b, i-1] / t)[tokens[b, i]]`
/// for i ≥ 1; column 0 (which has no preceding logits) is 0. Differentiable.
pub fn token_logprobs(logits: &Tensor, tokens: &Tensor, temperature: f64) -> Result<Tensor> {
    if crate::fused::logprobs_supported(logits) {
        return Ok(crate::fused::token_logprobs(logits, tokens, temperature)?);
    }
    token_logprobs_unfused(logits, tokens, temperature)
}

/// [`token_logprobs`] op by op (what runs off the CPU), kept for the tests that compare.
pub fn token_logprobs_unfused(logits: &Tensor, tokens: &Tensor, temperature: f64) -> Result<Tensor> {
    let (b, t, _v) = logits.dims3()?;
    if t < 2 {
        return Ok(Tensor::zeros((b, t), DType::F32, logits.device())?);
    }
    let scaled = if temperature == 1.0 {
        logits.narrow(1, 0, t - 1)?
    } else {
        (logits.narrow(1, 0, t - 1)? / temperature)?
    };
    let lsm = candle_nn::ops::log_softmax(&scaled, D::Minus1)?;
    let next = tokens.narrow(1, 1, t - 1)?.unsqueeze(D::Minus1)?;
    let lp = lsm.gather(&next.contiguous()?, D::Minus1)?.squeeze(D::Minus1)?;
    Ok(Tensor::cat(
        &[Tensor::zeros((b, 1), DType::F32, logits.device())?, lp],
        1,
    )?)
}

/// [`token_logprobs`] and the entropy (nats) of every next-token distribution at `t`
/// `(B, T)`, aligned the same way (column 0 is 0) and not differentiated: fused in one pass
/// over the logits where the fused ops run, op by op elsewhere.
pub fn token_logprobs_entropy(logits: &Tensor, tokens: &Tensor, temperature: f64) -> Result<(Tensor, Tensor)> {
    if crate::fused::logprobs_supported(logits) {
        return Ok(crate::fused::token_logprobs_entropy(logits, tokens, temperature)?);
    }
    let lp = token_logprobs_unfused(logits, tokens, temperature)?;
    Ok((lp, entropy_unfused(logits, temperature)?))
}

/// The entropy of every next-token distribution, op by op (materialises the
/// log-softmax), aligned like [`token_logprobs`].
pub fn entropy_unfused(logits: &Tensor, temperature: f64) -> Result<Tensor> {
    let (b, t, _v) = logits.dims3()?;
    if t < 2 {
        return Ok(Tensor::zeros((b, t), DType::F32, logits.device())?);
    }
    let l = (logits.narrow(1, 0, t - 1)?.detach() / temperature)?;
    let lsm = candle_nn::ops::log_softmax(&l, D::Minus1)?;
    let ent = (lsm.exp()? * &lsm)?.sum(D::Minus1)?.neg()?;
    Ok(Tensor::cat(
        &[Tensor::zeros((b, 1), DType::F32, logits.device())?, ent],
        1,
    )?)
}

/// Mean entropy (nats) of the next-token distributions at temperature `t` over positions
/// where `mask` (B, T) is 1 (shifted like [`token_logprobs`]). Not differentiated.
pub fn masked_entropy(logits: &Tensor, mask: &Tensor, temperature: f64) -> Result<f32> {
    let (_b, t, _v) = logits.dims3()?;
    if t < 2 {
        return Ok(0.0);
    }
    let m = mask.narrow(1, 1, t - 1)?;
    let n = m.sum_all()?.to_scalar::<f32>()?;
    if n == 0.0 {
        return Ok(0.0);
    }
    let ent = entropy_unfused(logits, temperature)?.narrow(1, 1, t - 1)?;
    Ok((ent * m)?.sum_all()?.to_scalar::<f32>()? / n)
}

/// Index helper used by tests and the sampler: last-position logits of each row.
pub fn last_logits(logits: &Tensor) -> Result<Tensor> {
    let (_b, t, _v) = logits.dims3()?;
    Ok(logits.i((.., t - 1, ..))?)
}

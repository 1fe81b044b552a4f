// streamrl's fused RL kernels for the trainer's hot path, f32 throughout. Each has a CPU
// twin in kernels/src/train.rs or model/src/loss.rs (the reference the parity checks
// compare against). Compiled to PTX by kernels/build.rs when the `cuda` feature is on;
// launched from model/src/cuda.rs through candle's CUDA device.
//
// Reductions run over one block: a warp shuffle, then the warps' partial results through
// shared memory. Every kernel is launched with a block size that is a multiple of 32
// and at most 1024.

#define FULL_MASK 0xffffffffu

// Sum over the block; every thread gets the result. `sh` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // `sh` may still be read by a previous reduction
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? sh[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Maximum over the block; every thread gets the result.
__device__ __forceinline__ float block_max(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? sh[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Selective log-softmax, forward: one block per position (b, i) of `lp` (batch, seq).
// lp[b, i] = log_softmax(logits[b, i-1] * inv_temp)[tokens[b, i]] for i >= 1, 0 at i = 0;
// with `with_entropy`, also the entropy of that distribution into `entropy`. Reads each logit row
// twice (max, then the sums); never writes a row of log-probabilities.
extern "C" __global__ void token_logprobs_fwd(const float* __restrict__ logits,
                                              const unsigned int* __restrict__ tokens,
                                              float* __restrict__ lp, float* __restrict__ entropy,
                                              unsigned int with_entropy, unsigned int seq, unsigned int vocab,
                                              float inv_temp) {
    __shared__ float sh[32];
    const unsigned int pos = blockIdx.x;
    if (pos % seq == 0) {
        if (threadIdx.x == 0) {
            lp[pos] = 0.0f;
            if (with_entropy) entropy[pos] = 0.0f;
        }
        return;
    }
    const float* row = logits + (size_t)(pos - 1) * vocab;
    float m = -INFINITY;
    for (unsigned int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, row[j] * inv_temp);
    m = block_max(m, sh);
    float s = 0.0f, t = 0.0f;
    for (unsigned int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float z = row[j] * inv_temp - m;
        const float e = expf(z);
        s += e;
        if (e > 0.0f) t += e * z;  // z = -inf where e = 0: 0 * -inf would be NaN
    }
    s = block_sum(s, sh);
    if (with_entropy) t = block_sum(t, sh);
    if (threadIdx.x == 0) {
        const float lse = logf(s);
        lp[pos] = row[tokens[pos]] * inv_temp - m - lse;
        if (with_entropy) entropy[pos] = lse - t / s;
    }
}

// Selective log-softmax, backward: one block per logits row r = (b, i).
// dlogits[r] = g[b, i+1] * inv_temp * (onehot(tokens[b, i+1]) - softmax(logits[r] * inv_temp)),
// zero for the last position of a row and where the incoming gradient is 0.
extern "C" __global__ void token_logprobs_bwd(const float* __restrict__ logits,
                                              const unsigned int* __restrict__ tokens,
                                              const float* __restrict__ g, float* __restrict__ dlogits,
                                              unsigned int seq, unsigned int vocab, float inv_temp) {
    __shared__ float sh[32];
    const unsigned int r = blockIdx.x;
    const float* row = logits + (size_t)r * vocab;
    float* d = dlogits + (size_t)r * vocab;
    const float gi = (r % seq + 1 < seq) ? g[r + 1] * inv_temp : 0.0f;
    if (gi == 0.0f) {
        for (unsigned int j = threadIdx.x; j < vocab; j += blockDim.x) d[j] = 0.0f;
        return;
    }
    float m = -INFINITY;
    for (unsigned int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, row[j] * inv_temp);
    m = block_max(m, sh);
    float s = 0.0f;
    for (unsigned int j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(row[j] * inv_temp - m);
    s = block_sum(s, sh);
    const float inv_s = 1.0f / s;
    const unsigned int tok = tokens[r + 1];
    for (unsigned int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float p = expf(row[j] * inv_temp - m) * inv_s;
        d[j] = gi * ((j == tok ? 1.0f : 0.0f) - p);
    }
}

// Double-sided masked importance sampling, one block over all n tokens. Writes every
// token's gradient before normalisation to `grad` and six totals to `out`:
// [loss, sum of mask, masked low, masked high, mismatch KL, max |clamped log-ratio|]
// (model/src/loss.rs `MaskedIs::token` is the same arithmetic, token by token).
extern "C" __global__ void masked_is_loss(const float* __restrict__ lp, const float* __restrict__ sampler,
                                          const float* __restrict__ adv, const float* __restrict__ mask,
                                          float* __restrict__ grad, float* __restrict__ out, unsigned int n,
                                          float low, float high, float kl_tau, float max_log_ratio) {
    __shared__ float sh[32];
    float loss = 0.0f, tokens = 0.0f, lo = 0.0f, hi = 0.0f, kl = 0.0f, mx = 0.0f;
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) {
        const float m = mask[i];
        tokens += m;
        if (m <= 0.0f) {
            grad[i] = 0.0f;
            continue;
        }
        float l = lp[i] - sampler[i];
        if (isnan(l)) l = -INFINITY;
        const float r = expf(l);
        const float c = fminf(fmaxf(l, -max_log_ratio), max_log_ratio);
        float keep = m;
        if (r < low) {
            keep = 0.0f;
            lo += 1.0f;
        } else if (r > high) {
            keep = 0.0f;
            hi += 1.0f;
        }
        const float e = expf(c);
        kl += m * (e - c - 1.0f);
        mx = fmaxf(mx, fabsf(c));
        loss += -keep * adv[i] * e + kl_tau * m * c * c;
        grad[i] = -keep * adv[i] * e + 2.0f * kl_tau * m * c;
    }
    loss = block_sum(loss, sh);
    tokens = block_sum(tokens, sh);
    lo = block_sum(lo, sh);
    hi = block_sum(hi, sh);
    kl = block_sum(kl, sh);
    mx = block_max(mx, sh);
    if (threadIdx.x == 0) {
        out[0] = loss;
        out[1] = tokens;
        out[2] = lo;
        out[3] = hi;
        out[4] = kl;
        out[5] = mx;
    }
}

// One AdamW update in place, element-wise, with the f32 arithmetic of the CPU kernel
// (kernels/src/train.rs `adamw`) in the same order.
extern "C" __global__ void adamw(float* __restrict__ theta, const float* __restrict__ g, float* __restrict__ m,
                                 float* __restrict__ v, unsigned int n, float lr, float decay, float beta1,
                                 float beta2, float scale_m, float scale_v, float eps, float clip) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float gi = g[i] * clip;
        const float nm = m[i] * beta1 + gi * (1.0f - beta1);
        const float nv = v[i] * beta2 + (gi * gi) * (1.0f - beta2);
        m[i] = nm;
        v[i] = nv;
        const float m_hat = nm * scale_m;
        const float v_hat = nv * scale_v;
        const float next = theta[i] * decay;
        theta[i] = next - (m_hat / (sqrtf(v_hat) + eps)) * lr;
    }
}

//! Hot numeric kernels for streamrl: a CPU reference implementation of every kernel, and
//! CUDA versions of the RL hot path (`cuda/rl.cu`: selective log-softmax with entropy and
//! its backward, the masked IS loss, AdamW) behind the `cuda` feature, compiled to PTX at
//! build time (`RL_PTX`, with the `cuda` feature) and launched by `streamrl_model` through candle's CUDA device,
//! so that every build and every test works without a GPU.
//!
//! [`cpu`] holds the CPU kernels of the inference forward (matrix products through the
//! `gemm` crate, over plain or strided views, norms, rotary embedding, grouped-query
//! attention over a cache, SwiGLU), each tested against its definition. [`train`] holds the
//! training forward's and backward's (packed-sequence attention, RMSNorm, SiLU·up and rotary
//! backward, the log-softmax gather of per-token logprobs), each backward checked against
//! finite differences. Each CUDA kernel is checked against its CPU twin by
//! `streamrl_model::parity` (on a GPU: `scripts/gpu-check.sh`).

pub mod alloc;
pub mod bf16;
pub mod cores;
pub mod cpu;
pub mod train;

/// PTX of `cuda/rl.cu` (kernels `token_logprobs_fwd`, `token_logprobs_bwd`,
/// `masked_is_loss`, `adamw`), compiled by nvcc for `CUDA_COMPUTE_CAP` (default 8.0).
#[cfg(feature = "cuda")]
pub const RL_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rl.ptx"));

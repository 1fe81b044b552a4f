//! Hot numeric kernels for streamrl: a CPU reference implementation of every kernel, and
//! CUDA versions loaded at run time (cudarc with dynamic loading, NVRTC-compiled) behind
//! the `cuda` feature, so that every build and every test works without a GPU.
//!
//! [`cpu`] holds the CPU kernels of the inference forward (matrix products through the
//! `gemm` crate, over plain or strided views, norms, rotary embedding, grouped-query
//! attention over a cache, SwiGLU), each tested against its definition. [`train`] holds the
//! training forward's and backward's (packed-sequence attention, RMSNorm, SiLU·up and rotary
//! backward, the log-softmax gather of per-token logprobs), each backward checked against
//! finite differences. CUDA versions are still to come; each GPU kernel will be tested
//! against its CPU reference.

pub mod alloc;
pub mod cpu;
pub mod train;

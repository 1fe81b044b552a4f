//! Hot numeric kernels for streamrl: a CPU reference implementation of every kernel, and
//! CUDA versions loaded at run time (cudarc with dynamic loading, NVRTC-compiled) behind
//! the `cuda` feature, so that every build and every test works without a GPU.
//!
//! [`cpu`] holds the CPU kernels of the inference forward (matrix products through the
//! `gemm` crate, norms, rotary embedding, grouped-query attention over a cache, SwiGLU),
//! each tested against its definition. Kernels for the training path (fused log-softmax
//! gather, masked importance-sampling loss, AdamW/Muon steps) and their CUDA versions are
//! still to come; each GPU kernel will be tested against its CPU reference.

pub mod cpu;

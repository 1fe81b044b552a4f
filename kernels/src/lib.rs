//! Hot numeric kernels for streamrl: a CPU reference implementation of every kernel, and
//! CUDA versions loaded at run time (cudarc with dynamic loading, NVRTC-compiled) behind
//! the `cuda` feature, so that every build and every test works without a GPU.
//!
//! The kernels themselves (fused log-softmax gather, masked importance-sampling loss,
//! AdamW/Muon steps) arrive with the model and trainer issues; this crate fixes their home
//! and the rule that each GPU kernel is tested against its CPU reference.

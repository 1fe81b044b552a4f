//! The streamrl policy: a trainable decoder-only transformer (Llama, Qwen2, Qwen3 and
//! mixture-of-experts variants) written from differentiable candle ops, its checkpoints,
//! tokenizers, RL and SFT losses, and optimizers.
//!
//! ```
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! use streamrl_model::{Packed, Transformer, config, token_logprobs};
//!
//! let cfg = config::preset("tiny", 40).unwrap().resolve().unwrap();
//! let vars = VarMap::new();
//! let model = Transformer::load(VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu), &cfg).unwrap();
//! // Two samples packed in one row: positions restart, attention stays within each.
//! let batch = Packed::new(&[vec![vec![1, 2, 3], vec![4, 5]]], &Device::Cpu).unwrap();
//! let (logits, _aux) = model.forward(&batch).unwrap();
//! assert_eq!(logits.dims(), &[1, 5, 40]);
//! let lp = token_logprobs(&logits, &batch.tokens, 1.0).unwrap();
//! assert_eq!(lp.dims(), &[1, 5]);
//! ```

pub mod chat;
pub mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
mod cuda;
pub mod device;
pub mod engine;
mod error;
pub mod fused;
pub mod generate;
pub mod gguf;
pub mod infer;
pub mod loss;
pub mod model;
pub mod offload;
pub mod openai;
pub mod optim;
pub mod parity;
pub mod tokenizer;

pub use error::{Error, Result};
pub use model::{
    Aux, BatchKv, KvCache, MoeStats, NO_ROUTE, Packed, RouterCoefs, Routes, SampleRoutes, Transformer, masked_entropy,
    token_logprobs, token_logprobs_entropy,
};
/// How a process's stages share its cores (a training step's products spread over idle ones).
pub use streamrl_kernels::cores;
pub use tokenizer::Tokenizer;

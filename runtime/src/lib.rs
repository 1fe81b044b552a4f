//! The streamrl stage runtime: the [`Stage`] trait, the [`bus`] (memory and Kafka
//! backends behind one trait, chosen by URL), the [`runner`] that owns every stage's loop,
//! the [`topology`] compiler, [`telemetry`] and its [`instruments`].
//!
//! A stage is plain code over Arrow batches; the runtime decodes, delivers, acknowledges,
//! retries and dead-letters around it:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use std::sync::Arc;
//! use streamrl_runtime::{bus, runner::{self, RunnerConfig, TopicBinding, Shutdown, StageMetrics}, FnStage};
//! use streamrl_schemas::SchemaId;
//!
//! let bus = bus::connect("memory://runtime-doc").await.unwrap();
//! for t in ["metrics", "metrics-copy", "dead_letter"] {
//!     bus.create_topic(&bus::TopicSpec::new(t, 1)).await.unwrap();
//! }
//! let mut cfg = RunnerConfig::new("copy", "dead_letter");
//! cfg.inputs.push(TopicBinding { name: "metrics".into(), schema: SchemaId::Metrics, key: None });
//! cfg.outputs.push(TopicBinding { name: "metrics-copy".into(), schema: SchemaId::Metrics, key: None });
//! let stage = FnStage(|input: streamrl_runtime::Input| Ok(vec![("metrics-copy".to_string(), input.batch)]));
//! let shutdown = Shutdown::new();
//! let task = tokio::spawn(runner::run_stage(bus.clone(), cfg, Box::new(stage), shutdown.clone(), Arc::new(StageMetrics::default())));
//! shutdown.trigger();
//! task.await.unwrap().unwrap();
//! # }
//! ```

pub mod build;
pub mod bus;
mod error;
pub mod instruments;
pub mod runner;
pub mod running;
mod stage;
pub mod telemetry;
pub mod topology;

pub use error::{Error, ErrorDomain, Result, RetryHint, StageError};
pub use stage::{Emitter, FnStage, Input, Stage};

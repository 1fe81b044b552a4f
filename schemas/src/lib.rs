//! Topic records for streamrl: one Arrow schema and one typed row per topic, the
//! Arrow IPC codec that turns a record batch into a bus payload, and the message headers
//! that travel beside it.
//!
//! Every message on a streamrl bus is one self-contained Arrow IPC stream (schema + one
//! record batch, zstd-compressed) plus [`Headers`]: the schema name and fingerprint, the
//! producer, a W3C `traceparent` and the policy version. Decoding never panics: garbage,
//! truncated payloads and payloads of another schema are typed [`Error`]s.
//!
//! ```
//! use streamrl_schemas::{codec, Headers, PolicyRow, SchemaId, TopicRow};
//!
//! let rows = vec![PolicyRow {
//!     run_id: "demo".into(),
//!     version: 3,
//!     step: 3,
//!     uri: "file:///tmp/ckpt/step-3".into(),
//!     sha256: "ab".repeat(32),
//!     created_at: 1_764_460_800_000,
//! }];
//! let batch = PolicyRow::to_batch(&rows).unwrap();
//! let payload = codec::encode(&batch, codec::Compression::Zstd).unwrap();
//! let headers = Headers::data(SchemaId::Policy, "trainer-0").with_policy_version(3);
//! let decoded = codec::decode(SchemaId::Policy, &headers.to_wire(), &payload).unwrap();
//! assert_eq!(PolicyRow::from_batch(&decoded).unwrap(), rows);
//! ```
#![warn(missing_docs)]

pub mod codec;
mod error;
pub mod fields;
mod headers;
pub mod ids;
pub mod problem;
mod rows;
mod schema;

pub use error::{Error, Result};
pub use headers::{HeaderKey, Headers, MessageKind, Signal, WireHeaders};
pub use problem::{Problem, Validate};
pub use rows::{
    ContinuationRow, DeadLetterRow, ExecutedRow, MetricRow, Outcome, PolicyRow, PromptRow, RewardComponent, RolloutRow,
    SampleRow, ScoredRow, ToolCall, ToolOutput, TopicRow, TrainedRow,
};
pub use schema::SchemaId;

/// Milliseconds since the Unix epoch, the unit of every timestamp column.
pub fn now_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

use crate::SchemaId;

/// Result with the schemas crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong turning rows into payloads and back.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The payload is not a readable Arrow IPC stream.
    #[error("payload of {len} bytes is not a valid Arrow IPC stream: {reason}")]
    Malformed {
        /// Payload length in bytes.
        len: usize,
        /// What the IPC reader reported.
        reason: String,
    },
    /// The payload ends before the stream does.
    #[error("payload of {len} bytes is truncated: {reason}")]
    Truncated {
        /// Payload length in bytes.
        len: usize,
        /// What the IPC reader reported.
        reason: String,
    },
    /// The stream holds no record batch, or more than one.
    #[error("payload must hold exactly one record batch, found {found}")]
    BatchCount {
        /// Number of batches found.
        found: usize,
    },
    /// The `streamrl-schema` header names another schema than the topic's.
    #[error("message carries schema `{found}` but topic expects `{expected}`")]
    WrongSchema {
        /// Schema the topic declares.
        expected: SchemaId,
        /// Schema named in the header.
        found: String,
    },
    /// A required header is absent.
    #[error("message has no `{0}` header")]
    MissingHeader(&'static str),
    /// A header value is not what its key requires.
    #[error("header `{key}` has invalid value {value:?}: {reason}")]
    InvalidHeader {
        /// Header key.
        key: &'static str,
        /// Value as received (lossy UTF-8).
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The fingerprint in the header differs from this build's schema.
    #[error("schema `{schema}` fingerprint mismatch: message has {found}, this build has {expected}")]
    FingerprintMismatch {
        /// Schema name.
        schema: SchemaId,
        /// Fingerprint of this build.
        expected: String,
        /// Fingerprint in the header.
        found: String,
    },
    /// The Arrow schema in the payload differs from the topic's.
    #[error("payload schema does not match `{schema}`: {differences}")]
    SchemaMismatch {
        /// Schema name.
        schema: SchemaId,
        /// Human-readable list of differing fields.
        differences: String,
    },
    /// Unknown schema name.
    #[error(
        "unknown schema `{0}` (known: prompts, rollouts, continuations, executed, scored, samples, policy, metrics, dead_letter)"
    )]
    UnknownSchema(String),
    /// Rows could not be converted to or from a record batch.
    #[error("converting `{schema}` rows: {reason}")]
    Rows {
        /// Schema name.
        schema: SchemaId,
        /// What went wrong.
        reason: String,
    },
    /// Encoding a batch failed.
    #[error("encoding a record batch of {rows} rows: {reason}")]
    Encode {
        /// Rows in the batch.
        rows: usize,
        /// What the IPC writer reported.
        reason: String,
    },
}

//! The runtime's errors: [`Error`] for buses and the runner, [`StageError`] for stage code.

use std::fmt;

/// Result with the runtime's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Failures of the bus and of the runtime itself.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The bus URL could not be understood.
    #[error("invalid bus URL `{url}`: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The URL names a backend whose cargo feature is off in this build.
    #[error(
        "bus URL `{url}` needs the `{feature}` cargo feature, which this build lacks (rebuild with `--features {feature}`)"
    )]
    FeatureNotEnabled {
        /// The URL as given.
        url: String,
        /// The missing feature.
        feature: &'static str,
    },
    /// A topic that does not exist.
    #[error("topic `{0}` does not exist on this bus (create it first; topology.yaml declares topics)")]
    UnknownTopic(String),
    /// A topic exists with another partition count.
    #[error(
        "topic `{topic}` exists with {existing} partitions but the topology declares {wanted}: \
         delete it (e.g. `kafka-topics.sh --delete --topic {topic}`, or restart an in-memory broker) \
         or set `partitions: {existing}` for it in topology.yaml"
    )]
    PartitionMismatch {
        /// Topic name.
        topic: String,
        /// Partitions it has.
        existing: u32,
        /// Partitions requested.
        wanted: u32,
    },
    /// A record too large for the bus.
    #[error("record of {size} bytes for topic `{topic}` exceeds the {limit}-byte limit")]
    RecordTooLarge {
        /// Topic name.
        topic: String,
        /// Record size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The Kafka client reported an error.
    #[error("kafka {op}: {reason}")]
    Kafka {
        /// What was being done.
        op: &'static str,
        /// What rdkafka said.
        reason: String,
    },
    /// The bus was shut down while waiting.
    #[error("bus closed while {0}")]
    Closed(&'static str),
    /// The bus did not answer in time.
    #[error("timed out after {secs} s {op}")]
    Timeout {
        /// What was being done.
        op: String,
        /// Seconds waited.
        secs: u64,
    },
    /// Encoding or decoding a message failed.
    #[error(transparent)]
    Schema(#[from] streamrl_schemas::Error),
    /// A stage failed in a way the runtime does not retry.
    #[error("stage `{stage}` failed: {source}")]
    Stage {
        /// Stage name and replica.
        stage: String,
        /// The stage's error.
        source: StageError,
    },
    /// A batch for a keyed topic lacks the key column.
    #[error("the batch has no key column `{key}`")]
    MissingKeyColumn {
        /// The topic's key column.
        key: String,
    },
    /// A key column of a type keys cannot have.
    #[error("key column `{key}` has type {data_type}; keys must be Utf8, UInt32 or UInt64")]
    KeyType {
        /// The topic's key column.
        key: String,
        /// Its type in the batch.
        data_type: String,
    },
    /// An Arrow kernel failed (splitting a batch by key).
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// Telemetry could not be set up.
    #[error("telemetry: {0}")]
    Telemetry(String),
    /// Filesystem I/O.
    #[error("{op} `{path}`: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Path involved.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Whose fault a stage error is; decides what the runtime does with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorDomain {
    /// The input is bad: the message goes to the dead-letter topic and the stage goes on.
    User,
    /// An external system failed (a server, the disk): retried with backoff if the hint
    /// allows, otherwise the stage stops without acknowledging the input.
    External,
    /// A bug in streamrl: the stage stops without acknowledging the input.
    Internal,
}

/// Whether retrying the same input can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryHint {
    /// Retrying cannot help.
    NoRetry,
    /// Retry with exponential backoff.
    WithBackoff,
}

/// An error returned by stage code.
#[derive(Debug, Clone)]
pub struct StageError {
    /// Whose fault it is.
    pub domain: ErrorDomain,
    /// Whether a retry can help.
    pub retry: RetryHint,
    /// What went wrong, naming the values involved.
    pub message: String,
}

impl StageError {
    /// The input is invalid (dead-lettered, never retried).
    pub fn user(message: impl Into<String>) -> Self {
        StageError {
            domain: ErrorDomain::User,
            retry: RetryHint::NoRetry,
            message: message.into(),
        }
    }
    /// An external system failed transiently (retried with backoff).
    pub fn transient(message: impl Into<String>) -> Self {
        StageError {
            domain: ErrorDomain::External,
            retry: RetryHint::WithBackoff,
            message: message.into(),
        }
    }
    /// An external system failed for good.
    pub fn external(message: impl Into<String>) -> Self {
        StageError {
            domain: ErrorDomain::External,
            retry: RetryHint::NoRetry,
            message: message.into(),
        }
    }
    /// A bug.
    pub fn internal(message: impl Into<String>) -> Self {
        StageError {
            domain: ErrorDomain::Internal,
            retry: RetryHint::NoRetry,
            message: message.into(),
        }
    }
}

impl fmt::Display for StageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.domain {
            ErrorDomain::User => write!(f, "invalid input: {}", self.message),
            ErrorDomain::External => write!(f, "external failure: {}", self.message),
            ErrorDomain::Internal => write!(f, "internal error (a bug in streamrl): {}", self.message),
        }
    }
}

impl std::error::Error for StageError {}

impl From<streamrl_schemas::Error> for StageError {
    fn from(e: streamrl_schemas::Error) -> Self {
        StageError::user(e.to_string())
    }
}

impl From<arrow::error::ArrowError> for StageError {
    fn from(e: arrow::error::ArrowError) -> Self {
        StageError::internal(format!("arrow: {e}"))
    }
}

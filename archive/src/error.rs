/// Result with the archive's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Archive, SQL and replay failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Filesystem I/O.
    #[error("{op} `{path}`: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Path involved.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// Writing Parquet.
    #[error("writing parquet `{path}`: {reason}")]
    Parquet {
        /// File.
        path: String,
        /// What the writer said.
        reason: String,
    },
    /// A SQL error (parse, plan or execution).
    #[error("SQL: {0}")]
    Sql(String),
    /// No archive where one was expected.
    #[error("no archive under `{0}` (expected <run_dir>/archive/<topic>/*.parquet)")]
    NoArchive(String),
    /// A topic with no stored rows.
    #[error("topic `{topic}` has no archived rows under `{dir}`")]
    EmptyTopic {
        /// Topic.
        topic: String,
        /// Archive dir.
        dir: String,
    },
    /// Stored rows do not fit the topic schema.
    #[error("stored rows of `{topic}` do not fit schema `{schema}`: {reason}")]
    Schema {
        /// Topic.
        topic: String,
        /// Schema.
        schema: String,
        /// Why.
        reason: String,
    },
    /// The bus failed.
    #[error(transparent)]
    Bus(#[from] streamrl_runtime::Error),
    /// Encoding failed.
    #[error(transparent)]
    Codec(#[from] streamrl_schemas::Error),
}

impl From<datafusion::error::DataFusionError> for Error {
    fn from(e: datafusion::error::DataFusionError) -> Self {
        Error::Sql(e.to_string())
    }
}

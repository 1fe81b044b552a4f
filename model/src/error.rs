/// Result with the model crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Model, checkpoint, tokenizer and optimizer failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed.
    #[error("tensor op: {0}")]
    Candle(#[from] candle_core::Error),
    /// The model configuration is invalid; every problem is listed.
    #[error("invalid model config: {}", .0.join("; "))]
    Config(Vec<String>),
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
    /// A JSON file could not be parsed.
    #[error("parsing `{path}`: {reason}")]
    Json {
        /// File.
        path: String,
        /// What serde said.
        reason: String,
    },
    /// A checkpoint does not fit the model.
    #[error("checkpoint `{path}`: {reason}")]
    Checkpoint {
        /// Checkpoint location.
        path: String,
        /// What does not fit.
        reason: String,
    },
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Inputs of the wrong shape or length.
    #[error("{0}")]
    Shape(String),
    /// The device asked for cannot be used (no CUDA build, no driver, no such device).
    #[error("{0}")]
    Device(String),
    /// A generation request is invalid; every problem is listed.
    #[error("invalid request: {0}")]
    Request(String),
}

impl Error {
    /// The checkpoint (or GGUF file) at `path` does not fit, for `reason`.
    pub(crate) fn checkpoint(path: &std::path::Path, reason: impl Into<String>) -> Error {
        Error::Checkpoint {
            path: path.display().to_string(),
            reason: reason.into(),
        }
    }

    pub(crate) fn io<'a>(op: &'static str, path: &'a std::path::Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
        move |source| Error::Io {
            op,
            path: path.display().to_string(),
            source,
        }
    }
}

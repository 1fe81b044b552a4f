//! [`Problem`]: one invalid value in a configuration, with the key path it is about.
//!
//! Every layer that validates configuration (the topology compiler, each stage kind's
//! config, each environment's config) reports all of its problems at once as a list of
//! these, with paths relative to the block it was given; the layer above prefixes its
//! own key ([`Problem::under`]), so what reaches the user names the full path in the
//! topology file.
//!
//! ```
//! use streamrl_schemas::Problem;
//!
//! let p = Problem::new("top_p", "1.5 is not in (0, 1]").under("stages.rollout.config");
//! assert_eq!(p.to_string(), "stages.rollout.config.top_p: 1.5 is not in (0, 1]");
//! let whole = Problem::whole("expected a mapping").under("envs.arith");
//! assert_eq!(whole.to_string(), "envs.arith: expected a mapping");
//! assert_eq!(Problem::new("[2]", "empty").under("stop").path, "stop[2]");
//! ```

use std::fmt;

/// One problem in a configuration, with the key path it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key path, e.g. `stages.reward.inputs[0]` (empty: the whole block).
    pub path: String,
    /// What is wrong, naming the values involved.
    pub message: String,
}

impl Problem {
    /// A problem with the value at `path`.
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Problem {
            path: path.into(),
            message: message.into(),
        }
    }

    /// A problem with the block as a whole (no key of its own).
    pub fn whole(message: impl Into<String>) -> Self {
        Problem::new("", message)
    }

    /// The same problem seen from the block that holds this one under `key`.
    pub fn under(mut self, key: &str) -> Self {
        self.path = join(key, &self.path);
        self
    }
}

/// A configuration that can list its own mistakes: every invalid value, with key paths
/// relative to the block it was read from (a stage's `config:`, an environment's entry).
pub trait Validate {
    /// Every problem (empty: the value is valid).
    fn problems(&self) -> Vec<Problem>;
}

/// `key` then `path`, with a dot between unless `path` is empty or an index (`[i]`).
fn join(key: &str, path: &str) -> String {
    if key.is_empty() {
        path.to_string()
    } else if path.is_empty() {
        key.to_string()
    } else if path.starts_with('[') {
        format!("{key}{path}")
    } else {
        format!("{key}.{path}")
    }
}

/// Every problem of `problems`, seen from the block that holds them under `key`.
pub fn under(key: &str, problems: impl IntoIterator<Item = Problem>) -> Vec<Problem> {
    problems.into_iter().map(|p| p.under(key)).collect()
}

/// A value that did not deserialize, at the key path where serde found it.
pub fn from_serde<E: fmt::Display>(e: serde_path_to_error::Error<E>) -> Problem {
    let path = e.path().to_string();
    // `.` is the block itself.
    let path = if path == "." { String::new() } else { path };
    Problem::new(path, e.into_inner().to_string())
}

/// Every problem on one line, separated by `; ` (for an error message).
pub fn list(problems: &[Problem]) -> String {
    problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for Problem {}

//! Saying so when a test skips what it checks, where a passing test's captured output
//! would hide it.
//!
//! [`skipped`] writes past the harness's capture (straight to the process's stderr, as
//! the chaos tables do) and, when `STREAMRL_SKIPPED` names a file, appends the line there:
//! `.ci/run` ends with the list.

use std::io::Write;

/// Reports that `test` skipped `what` because of `why`.
pub fn skipped(test: &str, what: &str, why: &str) {
    let line = format!("SKIPPED {test}: {what} ({why})");
    let _ = writeln!(std::io::stderr().lock(), "\n!!! {line} !!!\n");
    if let Some(path) = std::env::var_os("STREAMRL_SKIPPED")
        && let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path)
    {
        let _ = writeln!(f, "{line}");
    }
}

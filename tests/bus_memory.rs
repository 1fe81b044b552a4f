//! The bus conformance suite against the embedded memory bus.

mod common;
mod conformance;

use std::time::Duration;

struct Memory;

impl conformance::Backend for Memory {
    fn url(&self) -> String {
        common::unique("memory://conformance")
    }
    fn bounded_url(&self, bytes: u64) -> String {
        format!("{}?max_unconsumed_bytes={bytes}", self.url())
    }
    fn patience(&self) -> Duration {
        Duration::from_secs(10)
    }
}

conformance_suite!(Memory);

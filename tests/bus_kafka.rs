//! The bus conformance suite against a real Kafka-compatible broker (tansu, started on
//! 127.0.0.1 by the harness, or `$STREAMRL_TEST_KAFKA`).

mod common;
mod conformance;

use std::time::Duration;

struct Kafka(String);

impl Kafka {
    fn new() -> Self {
        Kafka(common::kafka_url())
    }
}

impl conformance::Backend for Kafka {
    fn url(&self) -> String {
        self.0.clone()
    }
    fn bounded_url(&self, bytes: u64) -> String {
        format!("{}?queue_kbytes={}", self.0, bytes / 1024)
    }
    fn patience(&self) -> Duration {
        // First group assignment on tansu takes ~5 s; rebalances after a member leaves
        // wait for the session timeout.
        Duration::from_secs(40)
    }
}

conformance_suite!(Kafka::new());

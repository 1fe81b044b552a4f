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

/// The same broker with producers that are not idempotent (`idempotence=false`).
struct KafkaPlain(String);

impl conformance::Backend for KafkaPlain {
    fn url(&self) -> String {
        format!("{}?idempotence=false", self.0)
    }
    fn bounded_url(&self, bytes: u64) -> String {
        format!("{}?idempotence=false&queue_kbytes={}", self.0, bytes / 1024)
    }
    fn patience(&self) -> Duration {
        Duration::from_secs(40)
    }
}

/// Without idempotence, one request in flight per broker still keeps each key in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_without_idempotence_keeps_order_within_key() {
    conformance::order_within_key(&KafkaPlain(common::kafka_url())).await;
}

#[tokio::test]
async fn bad_url_parameters_are_named() {
    let base = common::kafka_url();
    for (param, want) in [
        ("idempotence=maybe", "`idempotence=maybe` is not true or false"),
        ("static_membership=1", "`static_membership=1` is not true or false"),
        ("session_timeout_ms=soon", "`session_timeout_ms=soon` is not a number"),
        ("fetch_wait_ms=-1", "`fetch_wait_ms=-1` is not a number"),
        (
            "acks=1",
            "unknown parameter `acks` (known: queue_kbytes, session_timeout_ms, max_message_bytes, static_membership, idempotence, fetch_wait_ms)",
        ),
    ] {
        let url = format!("{base}?{param}");
        let err = match streamrl_runtime::bus::connect(&url).await {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{url}: {err}");
    }
}

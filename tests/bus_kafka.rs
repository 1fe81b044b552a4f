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

/// An idempotent producer whose client enters a fatal state (as after a broker that lost
/// its producer state; injected with librdkafka's own hook for this, made for tests)
/// re-creates its client once and sends again the records the old one failed: every
/// record is delivered and read back; the copies that may add are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_producer_recovers_from_a_fatal_error_and_loses_no_record() {
    use std::collections::BTreeMap;
    use streamrl_runtime::bus::kafka::KafkaBus;
    use streamrl_runtime::bus::{Bus, Producer, Record, TopicSpec};

    const N: u32 = 400;
    let bus = KafkaBus::connect(&common::kafka_url()).await.unwrap();
    let topic = common::unique("fatal");
    bus.create_topic(&TopicSpec::new(&topic, 2)).await.unwrap();
    let p = bus.kafka_producer("fatal-test").unwrap();
    let mut pending = Vec::new();
    for i in 0..N {
        if i == N / 2 {
            // Half the records are handed over, many still in flight.
            p.inject_fatal_error("injected by the test");
        }
        let record = Record::new(i.to_be_bytes().to_vec()).with_key(format!("k{}", i % 7));
        pending.push(p.send(&topic, record).await.unwrap());
    }
    for (i, f) in pending.into_iter().enumerate() {
        f.await.unwrap_or_else(|e| panic!("record {i} was not delivered: {e}"));
    }
    assert_eq!(p.renewals(), 1, "one fatal error, one new client");
    let resent = p.resent();
    assert!(
        resent > 0,
        "no record in flight was failed by the fatal error and sent again"
    );
    let mut c = bus.subscribe(&common::unique("fatal-reader"), &[topic]).await.unwrap();
    let mut seen: BTreeMap<u32, u32> = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while (seen.len() as u32) < N {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} of {N} records were read back",
            seen.len()
        );
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(500), c.recv()).await {
            let m = m.unwrap();
            *seen
                .entry(u32::from_be_bytes(m.payload[..4].try_into().unwrap()))
                .or_default() += 1;
            c.ack(&m.id()).unwrap();
        }
    }
    // Give copies written after the last new record a moment to arrive too.
    while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(2), c.recv()).await {
        *seen
            .entry(u32::from_be_bytes(m.payload[..4].try_into().unwrap()))
            .or_default() += 1;
    }
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), (0..N).collect::<Vec<_>>());
    let copies: u32 = seen.values().map(|n| n - 1).sum();
    let line = format!(
        "\nfatal producer error: {N} records delivered after one client re-creation; {resent} failed by it and sent again, {copies} written twice\n"
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}

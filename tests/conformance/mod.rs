//! The bus conformance suite, written once and generic over [`Bus`]; `bus_memory.rs` and
//! `bus_kafka.rs` run it against each backend with the `conformance_suite!` macro.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::record_batch::RecordBatch;
use streamrl_runtime::bus::{Bus, Consumer, Message, Record, TopicSpec, partition_for_key};
use streamrl_runtime::runner::{RunnerConfig, Shutdown, StageMetrics, TopicBinding, run_stage};
use streamrl_runtime::{FnStage, Input, StageError};
use streamrl_schemas::codec::{self, Compression};
use streamrl_schemas::{DeadLetterRow, Headers, MetricRow, SchemaId, TopicRow};

use crate::common::unique;

/// How a backend is opened for the suite.
pub trait Backend: Send + Sync {
    /// A bus with default settings.
    fn url(&self) -> String;
    /// A bus whose backpressure bound is about `bytes` (memory: unconsumed bytes per
    /// topic; Kafka: the producer's in-flight queue).
    fn bounded_url(&self, bytes: u64) -> String;
    /// How long a consumer may take to be assigned partitions (Kafka group joins are slow).
    fn patience(&self) -> Duration;
}

pub async fn open(url: &str) -> Arc<dyn Bus> {
    streamrl_runtime::bus::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"))
}

/// A bus on the backend with a new topic (named after `name`, with `partitions`), and a new
/// consumer group name.
async fn with_topic(b: &dyn Backend, name: &str, partitions: u32) -> (Arc<dyn Bus>, String, String) {
    let bus = open(&b.url()).await;
    let (topic, group) = (unique(name), unique("g"));
    bus.create_topic(&TopicSpec::new(&topic, partitions)).await.unwrap();
    (bus, topic, group)
}

fn seq_record(key: &str, seq: u64) -> Record {
    Record::new(format!("{key}:{seq}").into_bytes()).with_key(key)
}

fn parse(m: &Message) -> (String, u64) {
    let s = std::str::from_utf8(&m.payload).unwrap();
    let (k, n) = s.rsplit_once(':').unwrap();
    (k.to_string(), n.parse().unwrap())
}

async fn produce(bus: &Arc<dyn Bus>, topic: &str, records: Vec<Record>) {
    let p = bus.producer("conformance").await.unwrap();
    let mut pending = Vec::new();
    for r in records {
        pending.push(p.send(topic, r).await.unwrap());
    }
    for f in pending {
        f.await.unwrap();
    }
}

async fn recv_within(c: &mut Box<dyn Consumer>, patience: Duration) -> Option<Message> {
    tokio::time::timeout(patience, c.recv()).await.ok().map(|r| r.unwrap())
}

/// Receives (and optionally acknowledges) exactly `n` messages.
async fn take(c: &mut Box<dyn Consumer>, n: usize, ack: bool, patience: Duration) -> Vec<Message> {
    let mut out = Vec::new();
    while out.len() < n {
        let m = recv_within(c, patience)
            .await
            .unwrap_or_else(|| panic!("only {} of {n} messages arrived", out.len()));
        if ack {
            c.ack(&m.id()).unwrap();
        }
        out.push(m);
    }
    out
}

pub async fn order_within_key(b: &dyn Backend) {
    let (bus, topic, _) = with_topic(b, "order", 4).await;
    let keys = ["alpha", "beta", "gamma", "delta", "epsilon"];
    let records = (0..200u64).map(|i| seq_record(keys[i as usize % 5], i)).collect();
    produce(&bus, &topic, records).await;
    let mut c = bus.subscribe(&unique("g"), std::slice::from_ref(&topic)).await.unwrap();
    let got = take(&mut c, 200, true, b.patience()).await;
    let mut last: HashMap<String, (u64, u32)> = HashMap::new();
    for m in &got {
        let (k, n) = parse(m);
        if let Some((prev, part)) = last.get(&k) {
            assert!(n > *prev, "key {k}: {n} after {prev}");
            assert_eq!(*part, m.partition, "key {k} moved partitions");
        }
        last.insert(k, (n, m.partition));
    }
    assert_eq!(last.len(), 5);
    c.close().await.unwrap();
}

pub async fn spread_over_partitions(b: &dyn Backend) {
    let (bus, topic, _) = with_topic(b, "spread", 4).await;
    produce(
        &bus,
        &topic,
        (0..400u64)
            .map(|i| seq_record(&format!("group-{}", i % 100), i))
            .collect(),
    )
    .await;
    let mut c = bus.subscribe(&unique("g"), std::slice::from_ref(&topic)).await.unwrap();
    let got = take(&mut c, 400, true, b.patience()).await;
    let mut per_part: BTreeMap<u32, usize> = BTreeMap::new();
    for m in &got {
        let (k, _) = parse(m);
        assert_eq!(m.partition, partition_for_key(k.as_bytes(), 4), "key {k}");
        assert_eq!(m.key.as_deref(), Some(k.as_bytes()));
        *per_part.entry(m.partition).or_default() += 1;
    }
    assert_eq!(per_part.len(), 4, "every partition gets keys: {per_part:?}");
    assert!(per_part.values().all(|&n| n >= 40), "roughly even: {per_part:?}");
    c.close().await.unwrap();
}

/// A consumer running in a task, recording what it acknowledged.
struct Worker {
    stop: Shutdown,
    handle: tokio::task::JoinHandle<()>,
    seen: Arc<Mutex<Vec<u64>>>,
}

fn worker(mut c: Box<dyn Consumer>) -> Worker {
    let stop = Shutdown::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (s, st) = (seen.clone(), stop.clone());
    let handle = tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = st.wait() => break,
                m = c.recv() => {
                    let m = m.unwrap();
                    c.ack(&m.id()).unwrap();
                    s.lock().unwrap().push(parse(&m).1);
                }
            }
        }
        c.close().await.unwrap();
    });
    Worker { stop, handle, seen }
}

async fn until(patience: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + patience;
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn rebalance_join_and_leave(b: &dyn Backend) {
    let (bus, topic, group) = with_topic(b, "rebalance", 4).await;
    let key = |i: u64| format!("k{}", i % 16);
    produce(&bus, &topic, (0..100).map(|i| seq_record(&key(i), i)).collect()).await;
    let a = worker(bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap());
    until(b.patience(), "A to read the first 100", || {
        a.seen.lock().unwrap().len() >= 100
    })
    .await;

    // B joins: partitions are re-spread and both read new records.
    let bw = worker(bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap());
    let mut next = 100;
    let union = |a: &Worker, b: &Worker| -> BTreeSet<u64> {
        a.seen
            .lock()
            .unwrap()
            .iter()
            .chain(b.seen.lock().unwrap().iter())
            .copied()
            .collect()
    };
    // Keep producing until B has taken part (its assignment takes a rebalance).
    let deadline = tokio::time::Instant::now() + b.patience() * 2;
    while bw.seen.lock().unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "B never received anything after joining"
        );
        produce(
            &bus,
            &topic,
            (next..next + 16).map(|i| seq_record(&key(i), i)).collect(),
        )
        .await;
        next += 16;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let total = next;
    until(b.patience(), "every record to be read once B joined", || {
        union(&a, &bw).len() as u64 == total
    })
    .await;
    assert!(!a.seen.lock().unwrap().iter().any(|&n| n >= 100) || !bw.seen.lock().unwrap().is_empty());

    // A leaves: B takes over every partition and loses nothing.
    a.stop.trigger();
    let Worker {
        handle, seen: a_seen, ..
    } = a;
    handle.await.unwrap();
    let before_b = bw.seen.lock().unwrap().len();
    produce(
        &bus,
        &topic,
        (total..total + 64).map(|i| seq_record(&key(i), i)).collect(),
    )
    .await;
    until(b.patience() * 2, "B to read everything after A left", || {
        let s: BTreeSet<u64> = bw.seen.lock().unwrap().iter().copied().collect();
        (total..total + 64).all(|i| s.contains(&i))
    })
    .await;
    assert!(bw.seen.lock().unwrap().len() >= before_b + 64);
    let all: BTreeSet<u64> = a_seen
        .lock()
        .unwrap()
        .iter()
        .chain(bw.seen.lock().unwrap().iter())
        .copied()
        .collect();
    assert_eq!(all, (0..total + 64).collect::<BTreeSet<_>>(), "no record lost");
    bw.stop.trigger();
    bw.handle.await.unwrap();
}

/// A group reading two topics spreads each topic over its members: a second member gets
/// partitions of both (a second rollout replica once took every `continuations`
/// partition and no `prompts` one, so it generated nothing).
pub async fn every_topic_spread_over_members(b: &dyn Backend) {
    let bus = open(&b.url()).await;
    let (first, second) = (unique("spread-a"), unique("spread-b"));
    let group = unique("g");
    for t in [&first, &second] {
        bus.create_topic(&TopicSpec::new(t, 4)).await.unwrap();
    }
    let topics = [first.clone(), second.clone()];
    // Sequence numbers tell the topics apart: `first` below 1e6, `second` above.
    const SECOND: u64 = 1_000_000;
    let both = |w: &Worker| {
        let s = w.seen.lock().unwrap();
        s.iter().any(|&n| n < SECOND) && s.iter().any(|&n| n >= SECOND)
    };
    let mut next = 0;
    let batch = |next: u64, base: u64| -> Vec<Record> {
        (next..next + 16)
            .map(|i| seq_record(&format!("k{}", i % 16), base + i))
            .collect()
    };
    // A alone owns everything first; then B joins (and a rebalance moves partitions).
    let a = worker(bus.subscribe(&group, &topics).await.unwrap());
    produce(&bus, &first, batch(next, 0)).await;
    produce(&bus, &second, batch(next, SECOND)).await;
    next += 16;
    until(b.patience(), "A to read both topics", || both(&a)).await;
    let bw = worker(bus.subscribe(&group, &topics).await.unwrap());
    let deadline = tokio::time::Instant::now() + b.patience() * 3;
    while !(both(&a) && both(&bw)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "each member should read both topics: A read {:?}, B read {:?} (sequence numbers of `{second}` start at {SECOND})",
            a.seen.lock().unwrap().iter().take(8).collect::<Vec<_>>(),
            bw.seen.lock().unwrap().iter().take(8).collect::<Vec<_>>()
        );
        produce(&bus, &first, batch(next, 0)).await;
        produce(&bus, &second, batch(next, SECOND)).await;
        next += 16;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for w in [a, bw] {
        w.stop.trigger();
        w.handle.await.unwrap();
    }
}

/// A partition moves to another member and comes back: its unacknowledged records are
/// delivered again, and acknowledging the deliveries from before the move must not
/// commit past a redelivered record that has not been acknowledged (the archive once lost
/// a record that way).
pub async fn stale_ack_after_rebalance(b: &dyn Backend) {
    let (bus, topic, group) = with_topic(b, "stale-ack", 2).await;
    // Four records on each partition.
    let keys: Vec<String> = [0u32, 1]
        .iter()
        .map(|&p| {
            (0..)
                .map(|i| format!("k{i}"))
                .find(|k| partition_for_key(k.as_bytes(), 2) == p)
                .unwrap()
        })
        .collect();
    produce(
        &bus,
        &topic,
        (0..8).map(|i| seq_record(&keys[(i % 2) as usize], i)).collect(),
    )
    .await;
    let mut a = bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap();
    let first = take(&mut a, 8, false, b.patience()).await;
    // B joins; both keep polling (nothing acknowledged) until each holds one partition.
    let mut bm = bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap();
    let deadline = tokio::time::Instant::now() + b.patience() * 3;
    while a.assignment().len() != 1 || bm.assignment().len() != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no rebalance: A {:?}, B {:?}",
            a.assignment(),
            bm.assignment()
        );
        let _ = tokio::time::timeout(Duration::from_millis(100), a.recv()).await;
        let _ = tokio::time::timeout(Duration::from_millis(100), bm.recv()).await;
    }
    let moved = bm.assignment()[0].1;
    // A polls once more, so that it has acted on losing the partition.
    let _ = tokio::time::timeout(Duration::from_millis(200), a.recv()).await;
    // B leaves without acknowledging: the partition comes back to A with its 4 records.
    bm.close().await.unwrap();
    let mut again = Vec::new();
    let deadline = tokio::time::Instant::now() + b.patience() * 3;
    while again.len() < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the moved partition's records were not delivered again ({} of 4)",
            again.len()
        );
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(200), a.recv()).await
            && m.partition == moved
        {
            again.push(m);
        }
    }
    // A acknowledges every delivery from before the move, and of the redelivered copies
    // only the first.
    for m in first.iter().filter(|m| m.partition == moved) {
        a.ack(&m.id()).unwrap();
    }
    a.ack(&again[0].id()).unwrap();
    a.commit().await.unwrap();
    let stats = bus.topic_stats(&topic, std::slice::from_ref(&group)).await.unwrap();
    let committed = stats[moved as usize].committed[0].1.unwrap_or(0);
    assert_eq!(
        committed,
        again[0].offset + 1,
        "acknowledgements of deliveries from before the rebalance committed past redelivered, unprocessed records"
    );
    a.close().await.unwrap();
}

pub async fn redelivery_after_crash(b: &dyn Backend) {
    let (bus, topic, group) = with_topic(b, "crash", 2).await;
    produce(
        &bus,
        &topic,
        (0..100).map(|i| seq_record(&format!("k{}", i % 8), i)).collect(),
    )
    .await;
    let mut a = bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap();
    let got = take(&mut a, 60, false, b.patience()).await;
    // Acknowledge the first 30 delivered; the other 30 are in flight when A dies.
    let mut acked = BTreeSet::new();
    let mut unacked = BTreeSet::new();
    for (i, m) in got.iter().enumerate() {
        if i < 30 {
            a.ack(&m.id()).unwrap();
            acked.insert(parse(m).1);
        } else {
            unacked.insert(parse(m).1);
        }
    }
    a.commit().await.unwrap();
    drop(a); // a crash: no close
    let mut bc = bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap();
    let mut seen_b = BTreeSet::new();
    let everything: BTreeSet<u64> = (0..100).collect();
    while acked.union(&seen_b).copied().collect::<BTreeSet<_>>() != everything {
        let m = recv_within(&mut bc, b.patience() * 3)
            .await
            .expect("B stalled before everything was redelivered");
        bc.ack(&m.id()).unwrap();
        seen_b.insert(parse(&m).1);
    }
    assert!(
        unacked.is_subset(&seen_b),
        "every unacknowledged record is delivered again"
    );
    bc.close().await.unwrap();
}

pub async fn resume_after_restart(b: &dyn Backend) {
    let (bus, topic, group) = with_topic(b, "resume", 1).await;
    produce(&bus, &topic, (0..100).map(|i| seq_record("one-key", i)).collect()).await;
    let mut a = bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap();
    let first = take(&mut a, 30, true, b.patience()).await;
    assert_eq!(
        first.iter().map(|m| parse(m).1).collect::<Vec<_>>(),
        (0..30).collect::<Vec<_>>()
    );
    a.close().await.unwrap();
    let stats = bus.topic_stats(&topic, std::slice::from_ref(&group)).await.unwrap();
    // (End offsets are not checked here: tansu 0.6 reports the base offset of the last
    // batch + 1 as the high watermark; committed offsets are what resuming depends on.)
    assert_eq!(stats[0].committed[0].1, Some(30), "committed offset after close");
    let mut again = bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap();
    let rest = take(&mut again, 70, true, b.patience()).await;
    assert_eq!(
        rest.iter().map(|m| parse(m).1).collect::<Vec<_>>(),
        (30..100).collect::<Vec<_>>()
    );
    assert!(
        recv_within(&mut again, Duration::from_millis(500)).await.is_none(),
        "nothing is delivered twice"
    );
    again.close().await.unwrap();
}

/// `buffered_bytes` falls back to zero once the records are consumed, whether or not the
/// producer ever awaited their deliveries (Kafka: it counted a record until its delivery
/// future was polled, so a producer that awaited late showed megabytes "in flight").
pub async fn buffered_bytes_do_not_wait_for_the_delivery_futures(b: &dyn Backend) {
    let bus = open(&b.url()).await;
    let topic = unique("buffered");
    bus.create_topic(&TopicSpec::new(&topic, 2)).await.unwrap();
    let group = unique("g");
    let mut c = bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap();
    let producer = bus.producer("buffered").await.unwrap();
    let mut pending = Vec::new();
    for i in 0..8u64 {
        let mut payload = vec![0u8; 4096];
        payload[..8].copy_from_slice(&i.to_le_bytes());
        pending.push(
            producer
                .send(&topic, Record::new(payload).with_key(format!("k{i}")))
                .await
                .unwrap(),
        );
    }
    // Consume and acknowledge all eight without polling any delivery future.
    take(&mut c, 8, true, b.patience()).await;
    let until = tokio::time::Instant::now() + b.patience();
    while bus.buffered_bytes(&topic) > 0 {
        assert!(
            tokio::time::Instant::now() < until,
            "{} bytes still counted as buffered after every record was consumed",
            bus.buffered_bytes(&topic)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for f in pending {
        f.await.unwrap();
    }
}

pub async fn backpressure(b: &dyn Backend) {
    const BOUND: u64 = 256 << 10;
    const SIZE: usize = 32 << 10;
    let bus = open(&b.bounded_url(BOUND)).await;
    let topic = unique("bp");
    bus.create_topic(&TopicSpec::new(&topic, 2)).await.unwrap();
    let group = unique("g");
    let mut c = bus.subscribe(&group, std::slice::from_ref(&topic)).await.unwrap();
    let producer = bus.producer("bp").await.unwrap();
    let n = 64u64; // 2 MiB through a 256 KiB bound
    let t = topic.clone();
    let prod = tokio::spawn(async move {
        let mut pending = Vec::new();
        for i in 0..n {
            let mut payload = vec![0u8; SIZE];
            payload[..8].copy_from_slice(&i.to_le_bytes());
            pending.push(
                producer
                    .send(&t, Record::new(payload).with_key(format!("k{}", i % 4)))
                    .await
                    .unwrap(),
            );
        }
        for f in pending {
            f.await.unwrap();
        }
    });
    if bus.capabilities().blocks_on_unconsumed {
        // Nobody acknowledges yet: the producer must stall at the bound.
        let until = tokio::time::Instant::now() + Duration::from_millis(300);
        while tokio::time::Instant::now() < until {
            assert!(bus.buffered_bytes(&topic) <= BOUND + SIZE as u64 + 1024);
            tokio::task::yield_now().await;
        }
        assert!(!prod.is_finished(), "producer did not block at the bound");
        assert!(
            bus.buffered_bytes(&topic) >= BOUND - SIZE as u64 - 1024,
            "bound was filled before blocking"
        );
    }
    let mut got = BTreeSet::new();
    let mut max_seen = 0;
    while (got.len() as u64) < n {
        max_seen = max_seen.max(bus.buffered_bytes(&topic));
        let m = recv_within(&mut c, b.patience()).await.expect("consumer stalled");
        got.insert(u64::from_le_bytes(m.payload[..8].try_into().unwrap()));
        c.ack(&m.id()).unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await; // a slow consumer
    }
    prod.await.unwrap();
    assert_eq!(got, (0..n).collect::<BTreeSet<_>>());
    // Header overhead aside, the bus never held more than the bound plus one record.
    assert!(
        max_seen <= BOUND + SIZE as u64 + 4096,
        "held {max_seen} bytes with a {BOUND}-byte bound"
    );
    c.close().await.unwrap();
}

pub async fn broadcast(b: &dyn Backend) {
    let (bus, topic, _) = with_topic(b, "policy", 2).await;
    let mut subs = Vec::new();
    for _ in 0..3 {
        subs.push(bus.broadcast(&topic).await.unwrap());
    }
    let mut group = bus.subscribe(&unique("g"), std::slice::from_ref(&topic)).await.unwrap();
    // One at a time, as policy versions are published: each is its own produce request
    // (a reader's start is resolved per record batch on some brokers).
    for i in 0..20 {
        produce(&bus, &topic, vec![seq_record(&format!("v{i}"), i)]).await;
    }
    for s in subs.iter_mut() {
        let got: BTreeSet<u64> = take(s, 20, true, b.patience())
            .await
            .iter()
            .map(|m| parse(m).1)
            .collect();
        assert_eq!(got, (0..20).collect(), "every broadcast subscriber sees every message");
    }
    let got: BTreeSet<u64> = take(&mut group, 20, true, b.patience())
        .await
        .iter()
        .map(|m| parse(m).1)
        .collect();
    assert_eq!(got.len(), 20, "a group reading the same topic is unaffected");
    // A late subscriber (a restarted replica) learns the newest value of each partition
    // and never replays older history (a restarted source must not see version 0 first).
    let mut late = bus.broadcast(&topic).await.unwrap();
    let newest: BTreeSet<u64> = (0..2u32)
        .map(|p| {
            (0..20u64)
                .filter(|i| partition_for_key(format!("v{i}").as_bytes(), 2) == p)
                .max()
                .unwrap()
        })
        .collect();
    let mut seen = BTreeSet::new();
    while !newest.is_subset(&seen) {
        let m = recv_within(&mut late, b.patience())
            .await
            .expect("late broadcast reader never saw the newest message");
        let i = parse(&m).1;
        assert!(
            newest.contains(&i),
            "late broadcast reader replayed message {i}; only the newest of each partition ({newest:?}) is its business"
        );
        seen.insert(i);
    }
    // ...and then everything after it.
    produce(&bus, &topic, vec![seq_record("v-after", 20)]).await;
    let m = recv_within(&mut late, b.patience())
        .await
        .expect("late broadcast reader missed a message produced after it joined");
    assert_eq!(parse(&m).1, 20);
    late.close().await.unwrap();
    for s in subs {
        s.close().await.unwrap();
    }
    group.close().await.unwrap();
}

pub async fn large_messages_and_headers(b: &dyn Backend) {
    let bus = open(&b.url()).await;
    assert!(bus.capabilities().max_record_bytes >= 8 << 20);
    let topic = unique("large");
    bus.create_topic(&TopicSpec::new(&topic, 1)).await.unwrap();
    let payload: Vec<u8> = (0..(8usize << 20)).map(|i| (i * 31 % 251) as u8).collect();
    let headers = Headers::data(SchemaId::Rollouts, "conformance")
        .with_policy_version(12)
        .with_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        .to_wire();
    produce(
        &bus,
        &topic,
        vec![
            Record::new(payload.clone())
                .with_key("big")
                .with_headers(headers.clone()),
        ],
    )
    .await;
    let mut c = bus.subscribe(&unique("g"), std::slice::from_ref(&topic)).await.unwrap();
    let m = take(&mut c, 1, true, b.patience()).await.remove(0);
    assert_eq!(m.payload.len(), payload.len());
    assert!(m.payload[..] == payload[..], "8 MiB payload intact");
    assert_eq!(m.headers, headers, "headers mapped both ways, in order");
    assert_eq!(Headers::from_wire(&m.headers).unwrap().policy_version, Some(12));
    c.close().await.unwrap();
}

fn metrics_batch(n: usize) -> RecordBatch {
    let rows: Vec<MetricRow> = (0..n)
        .map(|i| MetricRow {
            run_id: "conf".into(),
            step: i as u64,
            stage: "test".into(),
            name: "x".into(),
            value: i as f64,
            created_at: 0,
        })
        .collect();
    MetricRow::to_batch(&rows).unwrap()
}

/// The runtime over this bus: garbage, a truncated payload, a wrong-schema payload and a
/// row the stage rejects all go to the dead-letter topic whole, with the reason; valid
/// messages around them are processed; the stage keeps running.
pub async fn dead_letter(b: &dyn Backend) {
    let bus = open(&b.url()).await;
    let (input, output, dlq) = (unique("in"), unique("out"), unique("dlq"));
    for t in [&input, &output, &dlq] {
        bus.create_topic(&TopicSpec::new(t.clone(), 1)).await.unwrap();
    }
    let stage_name = unique("stage");
    let mut cfg = RunnerConfig::new(stage_name.clone(), dlq.clone());
    cfg.inputs.push(TopicBinding {
        name: input.clone(),
        schema: SchemaId::Metrics,
        key: None,
    });
    cfg.outputs.push(TopicBinding {
        name: output.clone(),
        schema: SchemaId::Metrics,
        key: None,
    });
    let out_name = output.clone();
    let stage = FnStage(move |i: Input| {
        if i.batch.num_rows() == 13 {
            return Err(StageError::user("13 rows are unlucky"));
        }
        Ok(vec![(out_name.clone(), i.batch)])
    });
    let shutdown = Shutdown::new();
    let metrics = Arc::new(StageMetrics::default());
    let task = tokio::spawn(run_stage(
        bus.clone(),
        cfg,
        Box::new(stage),
        shutdown.clone(),
        metrics.clone(),
    ));

    let good = |n| {
        Record::new(codec::encode(&metrics_batch(n), Compression::Zstd).unwrap())
            .with_headers(Headers::data(SchemaId::Metrics, "t").to_wire())
    };
    let valid = codec::encode(&metrics_batch(4), Compression::Zstd).unwrap();
    let policy = streamrl_schemas::PolicyRow::to_batch(&[streamrl_schemas::PolicyRow {
        run_id: "r".into(),
        version: 1,
        step: 1,
        uri: "file:///x".into(),
        sha256: "00".into(),
        created_at: 0,
    }])
    .unwrap();
    let bad = vec![
        Record::new(b"definitely not arrow".to_vec())
            .with_headers(Headers::data(SchemaId::Metrics, "t").to_wire())
            .with_key("garbage"),
        Record::new(valid.slice(..valid.len() / 2)).with_headers(Headers::data(SchemaId::Metrics, "t").to_wire()),
        // Headers claim metrics, payload is a policy batch.
        Record::new(codec::encode(&policy, Compression::None).unwrap())
            .with_headers(Headers::data(SchemaId::Metrics, "t").to_wire()),
        Record::new(valid.clone()), // no headers at all
        good(13),
    ];
    let mut records = vec![good(1)];
    records.extend(bad.clone());
    records.push(good(2));
    produce(&bus, &input, records).await;

    let mut out = bus
        .subscribe(&unique("g"), std::slice::from_ref(&output))
        .await
        .unwrap();
    let outs = take(&mut out, 2, true, b.patience()).await;
    let rows: Vec<usize> = outs
        .iter()
        .map(|m| {
            codec::decode(SchemaId::Metrics, &m.headers, &m.payload)
                .unwrap()
                .num_rows()
        })
        .collect();
    assert_eq!(
        rows,
        vec![1, 2],
        "valid messages on either side of the bad ones are processed"
    );
    let mut dl = bus.subscribe(&unique("g"), std::slice::from_ref(&dlq)).await.unwrap();
    let letters = take(&mut dl, 5, true, b.patience()).await;
    let rows: Vec<DeadLetterRow> = letters
        .iter()
        .flat_map(|m| {
            DeadLetterRow::from_batch(&codec::decode(SchemaId::DeadLetter, &m.headers, &m.payload).unwrap()).unwrap()
        })
        .collect();
    for (row, original) in rows.iter().zip(&bad) {
        assert_eq!(row.topic, input);
        assert_eq!(row.payload, original.payload.to_vec(), "payload kept byte for byte");
        assert_eq!(row.key, original.key);
    }
    let reasons: Vec<&str> = rows.iter().map(|r| r.reason.as_str()).collect();
    assert!(reasons[0].contains("not a valid Arrow IPC stream"), "{reasons:?}");
    assert!(
        reasons[1].contains("truncated") || reasons[1].contains("not a valid"),
        "{reasons:?}"
    );
    assert!(
        reasons[2].contains("missing `run_id`") || reasons[2].contains("does not match"),
        "{reasons:?}"
    );
    assert!(reasons[3].contains("streamrl-schema"), "{reasons:?}");
    assert!(reasons[4].contains("13 rows are unlucky"), "{reasons:?}");
    assert_eq!(metrics.dead_lettered.load(std::sync::atomic::Ordering::Relaxed), 5);
    shutdown.trigger();
    task.await.unwrap().unwrap();
    // Everything, dead letters included, was acknowledged and committed.
    let stats = bus
        .topic_stats(&input, std::slice::from_ref(&stage_name))
        .await
        .unwrap();
    assert_eq!(stats[0].committed[0].1, Some(7));
    out.close().await.unwrap();
    dl.close().await.unwrap();
}

/// `bus::newest` reads what a topic holds now: nothing for an empty topic, the last record
/// of each non-empty partition otherwise, and leaves no group behind.
pub async fn newest_of_each_partition(b: &dyn Backend) {
    let (bus, topic, _) = with_topic(b, "newest", 3).await;
    let patience = b.patience();
    let none = streamrl_runtime::bus::newest(bus.as_ref(), &topic, patience)
        .await
        .unwrap();
    assert!(
        none.is_empty(),
        "an empty topic has no newest message, got {}",
        none.len()
    );
    // Partition 2 stays empty; 0 gets three records, 1 gets two.
    for (p, n) in [(0u32, 3u64), (1, 2)] {
        let records = (0..n)
            .map(|i| Record {
                partition: Some(p),
                ..seq_record(&format!("p{p}"), i)
            })
            .collect();
        produce(&bus, &topic, records).await;
    }
    let got = streamrl_runtime::bus::newest(bus.as_ref(), &topic, patience)
        .await
        .unwrap();
    let got: Vec<(u32, u64, u64)> = got.iter().map(|m| (m.partition, m.offset, parse(m).1)).collect();
    assert_eq!(
        got,
        vec![(0, 2, 2), (1, 1, 1)],
        "(partition, offset, payload seq) of the newest messages"
    );
    // Asking again gives the same answer: nothing was consumed for anyone.
    let again = streamrl_runtime::bus::newest(bus.as_ref(), &topic, patience)
        .await
        .unwrap();
    assert_eq!(again.len(), 2);
}

/// Generates one `#[tokio::test]` per conformance case for a backend expression.
#[macro_export]
macro_rules! conformance_suite {
    ($backend:expr) => {
        $crate::conformance_suite!(@cases $backend;
            order_within_key, spread_over_partitions, rebalance_join_and_leave, redelivery_after_crash,
            resume_after_restart, backpressure, broadcast, large_messages_and_headers, dead_letter,
            stale_ack_after_rebalance, newest_of_each_partition, every_topic_spread_over_members,
            buffered_bytes_do_not_wait_for_the_delivery_futures);
    };
    (@cases $backend:expr; $($case:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let backend = $backend;
                conformance::$case(&backend).await;
            }
        )*
    };
}

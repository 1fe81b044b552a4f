//! The stage runtime on the memory bus: retries with backoff, failures that stop a stage
//! without acknowledging, key splitting, trace propagation, signals, hold/release, and
//! snapshot/restore across a restart.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use streamrl_runtime::bus::{self, Bus, Consumer, Record, TopicSpec};
use streamrl_runtime::runner::{RunnerConfig, Shutdown, StageMetrics, TopicBinding, run_stage};
use streamrl_runtime::{Emitter, Input, Stage, StageError, telemetry};
use streamrl_schemas::codec::{self, Compression};
use streamrl_schemas::{Headers, MetricRow, SchemaId, Signal, TopicRow};

fn rows(names: &[&str]) -> RecordBatch {
    let rows: Vec<MetricRow> = names
        .iter()
        .enumerate()
        .map(|(i, n)| MetricRow {
            run_id: "rt".into(),
            step: i as u64,
            stage: "t".into(),
            name: n.to_string(),
            value: 0.0,
            created_at: 0,
        })
        .collect();
    MetricRow::to_batch(&rows).unwrap()
}

struct Rig {
    bus: Arc<dyn Bus>,
    cfg: RunnerConfig,
}

type StageTask = tokio::task::JoinHandle<streamrl_runtime::Result<()>>;

impl Rig {
    /// Runs `stage` on the rig's bus and config until `sd` triggers.
    fn spawn(&self, stage: impl Stage + 'static, sd: &Shutdown) -> StageTask {
        self.spawn_with(stage, sd, Arc::new(StageMetrics::default()))
    }

    fn spawn_with(&self, stage: impl Stage + 'static, sd: &Shutdown, metrics: Arc<StageMetrics>) -> StageTask {
        tokio::spawn(run_stage(
            self.bus.clone(),
            self.cfg.clone(),
            Box::new(stage),
            sd.clone(),
            metrics,
        ))
    }
}

async fn rig(out_key: Option<&str>) -> Rig {
    rig_of(SchemaId::Metrics, out_key).await
}

/// A stage reading `in` and writing `out` (4 partitions, split by `out_key`), both of
/// `schema`, on a memory bus of its own.
async fn rig_of(schema: SchemaId, out_key: Option<&str>) -> Rig {
    let bus = bus::connect(&common::unique("memory://runtime")).await.unwrap();
    for (t, p) in [("in", 1), ("out", 4), ("dlq", 1)] {
        bus.create_topic(&TopicSpec::new(t, p)).await.unwrap();
    }
    let mut cfg = RunnerConfig::new("stage", "dlq");
    cfg.inputs.push(TopicBinding {
        name: "in".into(),
        schema,
        key: None,
    });
    cfg.outputs.push(TopicBinding {
        name: "out".into(),
        schema,
        key: out_key.map(str::to_string),
    });
    cfg.initial_backoff = Duration::from_millis(1);
    Rig { bus, cfg }
}

async fn send(bus: &Arc<dyn Bus>, batch: &RecordBatch, traceparent: Option<&str>) {
    let mut h = Headers::data(SchemaId::Metrics, "test");
    h.traceparent = traceparent.map(str::to_string);
    let rec = Record::new(codec::encode(batch, Compression::Lz4).unwrap()).with_headers(h.to_wire());
    bus.producer("t")
        .await
        .unwrap()
        .send("in", rec)
        .await
        .unwrap()
        .await
        .unwrap();
}

async fn next(c: &mut Box<dyn Consumer>) -> streamrl_runtime::bus::Message {
    let m = tokio::time::timeout(Duration::from_secs(10), c.recv())
        .await
        .expect("no message")
        .unwrap();
    c.ack(&m.id()).unwrap();
    m
}

/// Fails `fail_times` with the given error, then forwards.
struct Flaky {
    calls: Arc<AtomicU32>,
    fail_times: u32,
    error: fn() -> StageError,
}

#[async_trait]
impl Stage for Flaky {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        // Outputs of a failed attempt must be discarded by the runtime.
        out.emit("out", input.batch.clone());
        if n < self.fail_times {
            return Err((self.error)());
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_errors_are_retried_and_outputs_are_delivered_once() {
    let r = rig(None).await;
    let calls = Arc::new(AtomicU32::new(0));
    let stage = Flaky {
        calls: calls.clone(),
        fail_times: 3,
        error: || StageError::transient("server busy"),
    };
    let (sd, m) = (Shutdown::new(), Arc::new(StageMetrics::default()));
    let task = r.spawn_with(stage, &sd, m.clone());
    let mut out = r.bus.subscribe("check", &["out".into()]).await.unwrap();
    send(&r.bus, &rows(&["a"]), None).await;
    next(&mut out).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), out.recv())
            .await
            .is_err(),
        "delivered once"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!(m.retries.load(Ordering::Relaxed), 3);
    sd.trigger();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_internal_error_stops_the_stage_and_the_input_is_redelivered() {
    let r = rig(None).await;
    let stage = Flaky {
        calls: Arc::new(AtomicU32::new(0)),
        fail_times: 1,
        error: || StageError::internal("invariant broken"),
    };
    let task = r.spawn(stage, &Shutdown::new());
    send(&r.bus, &rows(&["a"]), None).await;
    let err = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("stage-0") && err.contains("a bug in streamrl") && err.contains("invariant broken"),
        "{err}"
    );
    // Nothing was acknowledged: a restarted replica gets the input again and succeeds.
    let calls = Arc::new(AtomicU32::new(0));
    let stage = Flaky {
        calls: calls.clone(),
        fail_times: 0,
        error: || StageError::internal("x"),
    };
    let sd = Shutdown::new();
    let task = r.spawn(stage, &sd);
    let mut out = r.bus.subscribe("check", &["out".into()]).await.unwrap();
    next(&mut out).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    sd.trigger();
    task.await.unwrap().unwrap();
}

struct Forward;

#[async_trait]
impl Stage for Forward {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        out.set_policy_version(7);
        out.emit("out", input.batch);
        Ok(())
    }
    async fn signal(&mut self, _topic: &str, signal: Signal, out: &mut Emitter) -> Result<(), StageError> {
        out.signal("out", signal);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_are_split_by_key_and_carry_trace_and_version() {
    let r = rig(Some("name")).await;
    let sd = Shutdown::new();
    let task = r.spawn(Forward, &sd);
    let mut out = r.bus.subscribe("check", &["out".into()]).await.unwrap();
    let tp = telemetry::new_traceparent();
    send(&r.bus, &rows(&["g1", "g2", "g1", "g3", "g2"]), Some(&tp)).await;
    let mut by_key = std::collections::BTreeMap::new();
    for _ in 0..3 {
        let m = next(&mut out).await;
        let key = String::from_utf8(m.key.clone().unwrap()).unwrap();
        assert_eq!(m.partition, bus::partition_for_key(key.as_bytes(), 4));
        let h = Headers::from_wire(&m.headers).unwrap();
        assert_eq!(h.policy_version, Some(7));
        assert_eq!(h.producer, "stage-0");
        let (trace, _) = telemetry::parse_traceparent(h.traceparent.as_deref().unwrap()).unwrap();
        assert_eq!(
            trace,
            telemetry::parse_traceparent(&tp).unwrap().0,
            "trace id flows through the stage"
        );
        let b = codec::decode(SchemaId::Metrics, &m.headers, &m.payload).unwrap();
        let steps: Vec<u64> = MetricRow::from_batch(&b).unwrap().iter().map(|r| r.step).collect();
        by_key.insert(key, steps);
    }
    assert_eq!(format!("{by_key:?}"), r#"{"g1": [0, 2], "g2": [1, 4], "g3": [3]}"#);

    // An in-band signal reaches the stage, which forwards it.
    let h = Headers::signal(SchemaId::Metrics, "test", Signal::EndOfData);
    r.bus
        .producer("t")
        .await
        .unwrap()
        .send("in", Record::new(Vec::new()).with_headers(h.to_wire()))
        .await
        .unwrap()
        .await
        .unwrap();
    let m = next(&mut out).await;
    assert_eq!(Headers::from_wire(&m.headers).unwrap().signal, Some(Signal::EndOfData));
    sd.trigger();
    task.await.unwrap().unwrap();
}

/// Counts rows, holds inputs until every 3rd, and persists its count.
#[derive(Default)]
struct Counter {
    rows: u64,
    inputs: u64,
}

#[async_trait]
impl Stage for Counter {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        self.rows += input.batch.num_rows() as u64;
        self.inputs += 1;
        out.hold();
        if self.inputs.is_multiple_of(3) {
            out.release_held();
        }
        Ok(())
    }
    fn snapshot(&self) -> Option<Vec<u8>> {
        Some(self.rows.to_le_bytes().to_vec())
    }
    fn restore(&mut self, state: &[u8]) -> Result<(), StageError> {
        self.rows = u64::from_le_bytes(
            state
                .try_into()
                .map_err(|_| StageError::internal("state is not 8 bytes"))?,
        );
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_inputs_commit_on_release_and_state_survives_restart() {
    let mut r = rig(None).await;
    let dir = tempfile::tempdir().unwrap();
    r.cfg.state_dir = Some(dir.path().to_path_buf());
    let rows_seen = Arc::new(std::sync::Mutex::new(0u64));
    let wait_rows = |n: u64| {
        let seen = rows_seen.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while *seen.lock().unwrap() != n {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "rows seen: {} (waiting for {n})",
                    seen.lock().unwrap()
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let sd = Shutdown::new();
    let probe = Probe(Counter::default(), rows_seen.clone());
    let task = r.spawn(probe, &sd);
    for _ in 0..4 {
        send(&r.bus, &rows(&["a", "b"]), None).await;
    }
    // All four inputs processed: the first three were released (committed), the 4th is held.
    wait_rows(8).await;
    let committed = || async { r.bus.topic_stats("in", &["stage".into()]).await.unwrap()[0].committed[0].1 };
    assert_eq!(
        committed().await,
        Some(3),
        "release commits the held inputs, the 4th stays held"
    );
    sd.trigger();
    task.await.unwrap().unwrap();
    assert_eq!(
        committed().await,
        Some(3),
        "the 4th input is still held at shutdown: not committed"
    );
    // The state on disk covers exactly the committed inputs: the held 4th is not in it
    // (it will be delivered again), so a restart cannot count it twice.
    assert_eq!(
        std::fs::read(dir.path().join("stage-0.state")).unwrap(),
        6u64.to_le_bytes(),
        "state written while an input is held would count that input again after a restart"
    );

    // Restart: state restored (6 rows), the held 4th input comes again (+2), then 2 more:
    // every row counted exactly once.
    *rows_seen.lock().unwrap() = 0;
    let sd = Shutdown::new();
    let probe = Probe(Counter::default(), rows_seen.clone());
    let task = r.spawn(probe, &sd);
    send(&r.bus, &rows(&["c", "d"]), None).await;
    wait_rows(10).await;
    sd.trigger();
    task.await.unwrap().unwrap();
    // The redelivered 4th, the new 5th and ... no 6th: nothing is counted past 10.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(*rows_seen.lock().unwrap(), 10, "no input was counted twice");
}

/// Counter with its row count visible to the test.
struct Probe(Counter, Arc<std::sync::Mutex<u64>>);

#[async_trait]
impl Stage for Probe {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        self.0.process(input, out).await?;
        *self.1.lock().unwrap() = self.0.rows;
        Ok(())
    }
    fn snapshot(&self) -> Option<Vec<u8>> {
        self.0.snapshot()
    }
    fn restore(&mut self, s: &[u8]) -> Result<(), StageError> {
        self.0.restore(s)
    }
}

fn prompt(group: &str) -> streamrl_schemas::PromptRow {
    streamrl_schemas::PromptRow {
        run_id: "rt".into(),
        problem_id: format!("p-{group}"),
        group_id: group.into(),
        env: "arith".into(),
        step: 0,
        group_size: 1,
        prompt: "1+1=".into(),
        prompt_token_ids: vec![1],
        answer: None,
        info: None,
        temperature: 1.0,
        max_tokens: 4,
        created_at: 0,
    }
}

/// Keeps every prompt it gets and emits them all at its next tick, with one group it was
/// never given (as a source admits one).
#[derive(Default)]
struct EmitsOnTick {
    kept: Vec<streamrl_schemas::PromptRow>,
}

#[async_trait]
impl Stage for EmitsOnTick {
    async fn process(&mut self, input: Input, _out: &mut Emitter) -> Result<(), StageError> {
        self.kept.extend(
            streamrl_schemas::PromptRow::from_batch(&input.batch).map_err(|e| StageError::internal(e.to_string()))?,
        );
        Ok(())
    }
    fn tick_interval(&self) -> Option<Duration> {
        Some(Duration::from_millis(300))
    }
    async fn tick(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        if self.kept.len() == 3 {
            self.kept.push(prompt("new"));
            let rows = std::mem::take(&mut self.kept);
            out.emit("out", streamrl_schemas::PromptRow::to_batch(&rows).unwrap());
        }
        Ok(())
    }
}

/// Rows emitted later (from `tick` or held state) carry their own group's trace, not the
/// trace of whichever message came last; a group first seen in an output starts its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_group_keeps_its_own_trace_whenever_its_rows_are_emitted() {
    let r = rig_of(SchemaId::Prompts, Some("group_id")).await;
    let bus = r.bus.clone();
    let sd = Shutdown::new();
    let task = r.spawn(EmitsOnTick::default(), &sd);
    let mut out = bus.subscribe("check", &["out".into()]).await.unwrap();
    let producer = bus.producer("t").await.unwrap();
    let mut sent = std::collections::BTreeMap::new();
    for g in ["a", "b", "c"] {
        let tp = telemetry::new_traceparent();
        let mut h = Headers::data(SchemaId::Prompts, "test");
        h.traceparent = Some(tp.clone());
        let batch = streamrl_schemas::PromptRow::to_batch(&[prompt(g)]).unwrap();
        let rec = Record::new(codec::encode(&batch, Compression::Lz4).unwrap()).with_headers(h.to_wire());
        producer.send("in", rec).await.unwrap().await.unwrap();
        sent.insert(g.to_string(), telemetry::parse_traceparent(&tp).unwrap().0.to_string());
    }
    let mut got = std::collections::BTreeMap::new();
    for _ in 0..4 {
        let m = next(&mut out).await;
        let key = String::from_utf8(m.key.clone().unwrap()).unwrap();
        let h = Headers::from_wire(&m.headers).unwrap();
        let trace = telemetry::parse_traceparent(h.traceparent.as_deref().unwrap())
            .unwrap()
            .0
            .to_string();
        got.insert(key, trace);
    }
    for g in ["a", "b", "c"] {
        assert_eq!(got[g], sent[g], "group {g} keeps the trace of its own input");
    }
    assert!(
        !sent.values().any(|t| *t == got["new"]),
        "a group admitted here starts a trace of its own, got {}",
        got["new"]
    );
    sd.trigger();
    task.await.unwrap().unwrap();
}

/// Holds every input (never acknowledges it) and records which replica got which record.
struct Hold(String, Arc<std::sync::Mutex<Vec<(String, u32, u64)>>>);

#[async_trait]
impl Stage for Hold {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        self.1
            .lock()
            .unwrap()
            .push((self.0.clone(), input.partition, input.offset));
        out.hold();
        Ok(())
    }
}

/// Replicas run together join their group before any of them takes work: a replica that
/// joined later would take partitions whose records another replica already holds, and
/// that work would be done twice (it was: duplicate trajectories in a `streamrl run` whose
/// second rollout replica started late). One thread, so the first replica's loop runs
/// through every record it can before the second replica's task gets a turn.
#[tokio::test(flavor = "current_thread")]
async fn replicas_run_together_join_before_any_takes_work() {
    use streamrl_runtime::running::{Replica, run_replicas};
    let bus = bus::connect(&common::unique("memory://replicas")).await.unwrap();
    for (t, p) in [("in", 2), ("dlq", 1)] {
        bus.create_topic(&TopicSpec::new(t, p)).await.unwrap();
    }
    let producer = bus.producer("t").await.unwrap();
    for i in 0..16 {
        let h = Headers::data(SchemaId::Metrics, "test");
        let rec = Record::new(codec::encode(&rows(&["x"]), Compression::Lz4).unwrap())
            .with_key(format!("k{i}"))
            .with_headers(h.to_wire());
        producer.send("in", rec).await.unwrap().await.unwrap();
    }
    let stats = bus.topic_stats("in", &[]).await.unwrap();
    assert!(
        stats.iter().all(|p| p.end_offset > 0),
        "both partitions hold records: {stats:?}"
    );
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let replicas = (0..2)
        .map(|i| {
            let mut cfg = RunnerConfig::new("stage", "dlq");
            cfg.replica = i;
            cfg.inputs.push(TopicBinding {
                name: "in".into(),
                schema: SchemaId::Metrics,
                key: None,
            });
            let stage = Box::new(Hold(cfg.instance(), seen.clone())) as Box<dyn Stage>;
            Replica { cfg, stage }
        })
        .collect();
    let sd = Shutdown::new();
    let run = tokio::spawn(run_replicas(bus.clone(), replicas, sd.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while seen.lock().unwrap().len() < 16 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Time for a late joiner's redeliveries to show.
    tokio::time::sleep(Duration::from_millis(200)).await;
    sd.trigger();
    run.await.unwrap().unwrap();
    let seen = seen.lock().unwrap().clone();
    let mut records: Vec<(u32, u64)> = seen.iter().map(|(_, p, o)| (*p, *o)).collect();
    records.sort();
    records.dedup();
    assert_eq!(records.len(), 16, "every record was delivered: {seen:?}");
    assert_eq!(seen.len(), 16, "a record went to two replicas: {seen:?}");
    let by = |r: &str| seen.iter().filter(|(i, _, _)| i == r).count();
    assert!(
        by("stage-0") > 0 && by("stage-1") > 0,
        "both replicas took work: {seen:?}"
    );
}

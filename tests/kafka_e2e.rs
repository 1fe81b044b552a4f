//! streamrl against a real broker as separate processes: `streamrl stage` shuts down
//! gracefully on SIGTERM (flushes, commits, exits 0), `streamrl replay` republishes
//! archived rows, and kcat reads what streamrl wrote, with pyarrow decoding a payload.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::rollout;
use streamrl_archive::{ArchiveConfig, ArchiveWriter, Sql};
use streamrl_runtime::bus::{self, Record};
use streamrl_schemas::codec::{self, Compression};
use streamrl_schemas::{Headers, MetricRow, RolloutRow, SchemaId, ScoredRow, TopicRow};

fn metric(i: u64) -> MetricRow {
    MetricRow {
        run_id: "e2e".into(),
        step: i,
        stage: "test".into(),
        name: "m".into(),
        value: i as f64,
        created_at: 0,
    }
}

/// Waits until the stage process has created `topic`, then sends `n` one-row metric
/// messages `metric(0..n)`, each awaited.
async fn send_metrics_when_ready(bus: &std::sync::Arc<dyn bus::Bus>, topic: &str, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !bus.topics().await.unwrap().iter().any(|t| t == topic) {
        assert!(tokio::time::Instant::now() < deadline, "stage never created its topics");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let p = bus.producer("e2e").await.unwrap();
    for i in 0..n {
        let payload = codec::encode(&MetricRow::to_batch(&[metric(i)]).unwrap(), Compression::Zstd).unwrap();
        let rec = Record::new(payload)
            .with_key(format!("k{i}"))
            .with_headers(Headers::data(SchemaId::Metrics, "e2e").to_wire());
        p.send(topic, rec).await.unwrap().await.unwrap();
    }
}

/// SIGKILLs a child process (by pid: the test moves the `Child` away to wait on it) if the
/// test panics before the child is reaped, so a failed test leaves no stage running.
struct KillOnPanic(Option<u32>);

impl KillOnPanic {
    fn new(child: &std::process::Child) -> Self {
        KillOnPanic(Some(child.id()))
    }

    /// The child has been waited for: its pid may be reused, so never signal it.
    fn reaped(mut self) {
        self.0 = None;
    }
}

impl Drop for KillOnPanic {
    fn drop(&mut self) {
        if let Some(pid) = self.0.filter(|_| std::thread::panicking()) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    }
}

/// Sends SIGTERM to process `pid` (with kill(1)) and checks that it was delivered.
fn sigterm(pid: u32) {
    let sent = Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
    assert!(sent.success(), "kill -TERM {pid}: {sent}");
}

/// Offsets the archive stage `stage` (its consumer group) has committed on `topic`,
/// summed over partitions.
async fn archive_committed(bus: &std::sync::Arc<dyn bus::Bus>, stage: &str, topic: &str) -> u64 {
    let stats = bus.topic_stats(topic, &[stage.to_string()]).await.unwrap();
    stats.iter().map(|s| s.committed[0].1.unwrap_or(0)).sum()
}

/// A topology with one archive stage named `stage`. Tests in this binary share one broker,
/// and a stage's name is its consumer group: each test names its stage differently, since
/// on tansu a group whose members subscribe different topics can stall with no partitions
/// assigned (seen: three minutes without an assignment after another test's member left).
fn topology(dir: &Path, stage: &str, metrics_topic: &str, flush_rows: usize) -> PathBuf {
    let path = dir.join("topology.yaml");
    let dl = format!("{metrics_topic}-dlq");
    std::fs::write(
        &path,
        format!(
            "bus: memory://\nrun_dir: {run}\ndead_letter: {dl}\ntopics:\n  {metrics_topic}: {{ schema: metrics, partitions: 2 }}\n  {dl}: {{ schema: dead_letter }}\n\
             stages:\n  {stage}: {{ kind: archive, inputs: all, config: {{ flush_rows: {flush_rows}, flush_seconds: 3600 }} }}\n",
            run = dir.join("run").display()
        ),
    )
    .unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stage_process_flushes_and_commits_on_sigterm() {
    let url = common::kafka_url();
    let dir = tempfile::tempdir().unwrap();
    let topic = common::unique("metrics");
    let stage = "archive_sigterm";
    let topo = topology(dir.path(), stage, &topic, 4);
    let port = common::free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args([
            "stage",
            stage,
            "--bus",
            &url,
            "--metrics-port",
            &port.to_string(),
            "--topology",
        ])
        .arg(&topo)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let reaper = KillOnPanic::new(&child);
    let bus = bus::connect(&url).await.unwrap();
    send_metrics_when_ready(&bus, &topic, 10).await;
    // flush_rows 4: 8 rows reach disk and are committed; 2 stay held (unacknowledged).
    let committed = || archive_committed(&bus, stage, &topic);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while committed().await < 8 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "archive did not commit its first flushes"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Let auto-commit settle so that the held pair is observably uncommitted.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        committed().await,
        8,
        "held rows are not committed before they are on disk"
    );
    // The Prometheus endpoint: every message counted, the held pair still lagging.
    let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |metric: &str| -> u64 {
        let prefix = format!("{metric}{{stage=\"{stage}\",replica=\"0\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
            .unwrap_or_else(|| panic!("no {metric} in:\n{text}"))
    };
    assert_eq!(value("streamrl_stage_in_messages_total"), 10, "{text}");
    assert!(text.contains("# TYPE streamrl_stage_in_rows_total counter"), "{text}");
    assert!(value("streamrl_stage_input_lag") <= 2, "{text}");

    sigterm(child.id());
    let out = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(_s) = child.try_wait().unwrap() {
                return child.wait_with_output().unwrap();
            }
            assert!(std::time::Instant::now() < deadline, "stage did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
    reaper.reaped();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}:\n{stderr}", out.status);
    assert!(stderr.contains("stopped cleanly"), "{stderr}");
    assert_eq!(committed().await, 10, "the rest was flushed and committed at shutdown");
    let sql = Sql::open(&dir.path().join("run")).await.unwrap();
    let n = sql
        .query(&format!("SELECT count(*) AS n, sum(step) AS s FROM \"{topic}\""))
        .await
        .unwrap();
    let text = arrow::util::pretty::pretty_format_batches(&n).unwrap().to_string();
    assert!(text.contains("| 10 | 45 |"), "{text}");
}

/// librdkafka built by rdkafka-sys (2.12): Debian's kcat links librdkafka 2.0.2, whose
/// ApiVersions parsing fails against tansu 0.6; with the newer library it works.
fn newer_librdkafka() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let build = exe.parent()?.parent()?.join("build");
    std::fs::read_dir(build).ok()?.flatten().find_map(|e| {
        let p = e.path().join("out/src");
        p.join("librdkafka.so.1").exists().then_some(p)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_to_kafka_and_read_it_with_kcat_and_pyarrow() {
    let url = common::kafka_url();
    let dir = tempfile::tempdir().unwrap();
    let mut w = ArchiveWriter::new(dir.path(), "archive-0", ArchiveConfig::default());
    w.append(
        "rollouts",
        SchemaId::Rollouts,
        RolloutRow::to_batch(&(0..32).map(rollout).collect::<Vec<_>>()).unwrap(),
    );
    w.flush_all().unwrap();

    let target = common::unique("rollouts");
    let topo = dir.path().join("topology.yaml");
    std::fs::write(
        &topo,
        format!(
            "topics:\n  {target}: {{ schema: rollouts, partitions: 4, key: group_id }}\n  dead_letter: {{ schema: dead_letter }}\n"
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args([
            "replay",
            "--topic",
            "rollouts",
            "--where",
            "step >= 2",
            "--bus",
            &url,
            "--to",
            &target,
            "--run-dir",
        ])
        .arg(dir.path())
        .arg("--topology")
        .arg(&topo)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("replayed 16 rows of `rollouts` as 4 messages"),
        "{stdout}"
    );

    // `streamrl topics` lists the target's partitions.
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["topics", "--bus", &url, "--topology"])
        .arg(&topo)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(text.lines().filter(|l| l.starts_with(&target)).count(), 4, "{text}");
    assert!(text.contains("dead_letter") && text.contains("not created"), "{text}");

    // kcat: one line per message with partition, key and the schema header.
    let (kcat, libdir) = common::kcat();
    // The newer librdkafka first, then the libraries unpacked with kcat (libyajl, ...).
    let lib = std::env::join_paths(newer_librdkafka().into_iter().chain(libdir))
        .expect("library paths")
        .into_string()
        .expect("UTF-8 library paths");
    assert!(!lib.is_empty(), "a librdkafka for kcat");
    let brokers = url.trim_start_matches("kafka://");
    let kcat_read = |extra: &[&str], format: &str| {
        let out = Command::new(&kcat)
            .env("LD_LIBRARY_PATH", &lib)
            .args(["-b", brokers, "-C", "-t", &target, "-o", "beginning", "-e", "-q"])
            .args(extra)
            .args(["-f", format])
            .output()
            .unwrap();
        assert!(out.status.success(), "kcat: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    let listing = kcat_read(&[], "%p %k %h\n");
    let lines: Vec<String> = String::from_utf8_lossy(&listing).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 4, "{lines:?}");
    for l in &lines {
        let mut parts = l.splitn(3, ' ');
        let (p, k, h) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
        assert_eq!(
            p.parse::<u32>().unwrap(),
            bus::partition_for_key(k.as_bytes(), 4),
            "{l}"
        );
        assert!(h.contains("streamrl-schema=rollouts"), "{l}");
        assert!(
            h.contains(&format!("streamrl-fingerprint={}", SchemaId::Rollouts.fingerprint())),
            "{l}"
        );
        assert!(h.contains("traceparent=00-"), "{l}");
    }

    // The README recipe: kcat writes one raw payload, pyarrow reads it as an IPC stream.
    let first_partition = lines[0].split(' ').next().unwrap().to_string();
    let payload = kcat_read(&["-p", &first_partition, "-c", "1"], "%s");
    let (py, pythonpath) = common::python_with(&["pyarrow==26.0.1"]);
    let mut cmd = Command::new(py);
    cmd.args(["-c", "import sys, pyarrow as pa; t = pa.ipc.open_stream(sys.stdin.buffer.read()).read_all(); print(t.num_rows, t.column('group_id')[0], t.column('completion_routes')[0].as_py(), t.schema.field('completion_logprobs').type)"]);
    if let Some(p) = pythonpath {
        cmd.env("PYTHONPATH", p);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(&payload).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "pyarrow: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("4 g"), "{text}");
    assert!(
        text.contains(", 7, 0, 3, 255, 255, 255, 255] "),
        "the recorded routes: {text}"
    );
    assert!(text.trim().ends_with("list<item: float not null>"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stage_spans_are_exported_over_otlp() {
    let url = common::kafka_url();
    let dir = tempfile::tempdir().unwrap();
    let (port, received) = common::otlp::receiver();
    let topic = common::unique("metrics");
    let stage = "archive_otlp";
    let topo = topology(dir.path(), stage, &topic, 1);
    let stage_log = dir.path().join("stage.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["stage", stage, "--bus", &url, "--topology"])
        .arg(&topo)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .stderr(std::fs::File::create(&stage_log).unwrap())
        .spawn()
        .unwrap();
    let reaper = KillOnPanic::new(&child);
    let bus = bus::connect(&url).await.unwrap();
    send_metrics_when_ready(&bus, &topic, 3).await;
    // flush_rows 1: every input is committed once processed (inside its span).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    loop {
        let committed = archive_committed(&bus, stage, &topic).await;
        if committed == 3 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "archive did not process the inputs; committed {committed}; the stage's log:\n{}",
            std::fs::read_to_string(&stage_log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    sigterm(child.id());
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    reaper.reaped();
    assert!(status.success(), "stage exit {status:?}");
    // The batch exporter flushes at shutdown: one `archive` span per input, in the
    // stage's own service.
    let spans: Vec<_> = received
        .lock()
        .unwrap()
        .spans
        .iter()
        .filter(|s| s.service == format!("streamrl-{stage}") && s.name == "archive")
        .cloned()
        .collect();
    assert_eq!(spans.len(), 3, "archive spans reaching the OTLP receiver: {spans:#?}");
}

/// `streamrl bench scale` at a small size: sandbox stage processes at 1 and 2 replicas on
/// the broker, every rollout executed exactly once and passing (the bench fails itself
/// otherwise), the work spread over both replicas.
#[test]
fn bench_scale_executes_every_rollout_once_at_each_replica_count() {
    let url = common::kafka_url();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["bench", "scale", "--bus", &url, "--rollouts", "64", "--replicas", "1,2"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench scale failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("| 1 |") || l.starts_with("| 2 |"))
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    for r in &rows {
        assert!(r.contains("| yes (64 rows, 64 distinct) | 64 |"), "{r}");
    }
    // Both replicas of the second round executed some of the rollouts.
    let two = rows[1];
    let counts: Vec<u64> = two
        .split("sandbox-")
        .skip(1)
        .map(|s| {
            s.split(": ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(counts.len(), 2, "{two}");
    assert!(
        counts.iter().all(|&c| c > 0) && counts.iter().sum::<u64>() == 64,
        "{two}"
    );
}

/// One trajectory, one trace: a group's rollouts go through a sandbox stage process and a
/// reward stage process, each exporting over OTLP; the receiver decodes the protobuf, and
/// the group's `execute` span (in `streamrl-<sandbox>`) is a child of the producer's span,
/// its `score` span (in `streamrl-<reward>`) a child of the `execute` span, all in the
/// producer's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trajectory_is_one_trace_across_stage_processes() {
    let url = common::kafka_url();
    let (port, received) = common::otlp::receiver();
    let dir = tempfile::tempdir().unwrap();
    let id = common::unique("tr").replace('-', "_");
    let (rollouts, executed, scored) = (
        format!("{id}_rollouts"),
        format!("{id}_executed"),
        format!("{id}_scored"),
    );
    let (sandbox, reward) = (format!("{id}_sandbox"), format!("{id}_reward"));
    let topo = dir.path().join("topology.yaml");
    std::fs::write(
        &topo,
        format!(
            "bus: {url}\nrun_dir: {run}\ndead_letter: {id}_dlq\nenvs:\n  arith: {{ weight: 1 }}\ntopics:\n  \
             {rollouts}: {{ schema: rollouts, partitions: 2, key: group_id }}\n  \
             {executed}: {{ schema: executed, partitions: 2, key: group_id }}\n  \
             {scored}: {{ schema: scored, partitions: 2, key: group_id }}\n  {id}_dlq: {{ schema: dead_letter }}\n\
             stages:\n  {sandbox}: {{ kind: sandbox, inputs: [{rollouts}], outputs: [{executed}] }}\n  \
             {reward}: {{ kind: reward, inputs: [{executed}], outputs: [{scored}] }}\n",
            run = dir.path().join("run").display()
        ),
    )
    .unwrap();
    let bus = bus::connect(&url).await.unwrap();
    let t = streamrl_runtime::topology::Topology::load(&topo, &|_, _| vec![]).unwrap();
    streamrl_runtime::running::create_topics(&bus, &t).await.unwrap();
    let spawn = |stage: &str| {
        Command::new(env!("CARGO_BIN_EXE_streamrl"))
            .args(["stage", stage, "--topology"])
            .arg(&topo)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{port}"))
            .stderr(std::fs::File::create(dir.path().join(format!("{stage}.log"))).unwrap())
            .spawn()
            .unwrap()
    };
    let children = [spawn(&sandbox), spawn(&reward)];
    let reapers: Vec<KillOnPanic> = children.iter().map(KillOnPanic::new).collect();
    let mut reader = bus
        .subscribe(&format!("{id}_reader"), std::slice::from_ref(&scored))
        .await
        .unwrap();

    // The producer's span: a fresh trace for the group.
    let tp = streamrl_runtime::telemetry::new_traceparent();
    let (trace, root) = streamrl_runtime::telemetry::parse_traceparent(&tp).unwrap();
    let (trace, root) = (trace.to_string(), root.to_string());
    let rows: Vec<RolloutRow> = (1..4).map(rollout).collect();
    assert!(rows.iter().all(|r| r.group_id == "g0"));
    let mut h = Headers::data(SchemaId::Rollouts, "test");
    h.traceparent = Some(tp.clone());
    let rec = Record::new(codec::encode(&RolloutRow::to_batch(&rows).unwrap(), Compression::Zstd).unwrap())
        .with_key("g0")
        .with_headers(h.to_wire());
    bus.producer("test")
        .await
        .unwrap()
        .send(&rollouts, rec)
        .await
        .unwrap()
        .await
        .unwrap();
    let m = tokio::time::timeout(Duration::from_secs(180), reader.recv())
        .await
        .expect("the scored rows never arrived")
        .unwrap();
    let got = Headers::from_wire(&m.headers).unwrap().traceparent.unwrap();
    assert_eq!(streamrl_runtime::telemetry::parse_traceparent(&got).unwrap().0, trace);
    // The rows crossed two stage processes over the broker with their recorded expert
    // routes (routing replay's column) intact.
    let scored = ScoredRow::from_batch(&codec::decode(SchemaId::Scored, &m.headers, &m.payload).unwrap()).unwrap();
    let mut routes: Vec<(String, Vec<u8>)> = scored
        .into_iter()
        .map(|r| (r.rollout_id, r.completion_routes))
        .collect();
    routes.sort();
    let sent: Vec<(String, Vec<u8>)> = rows
        .iter()
        .map(|r| (r.rollout_id.clone(), r.completion_routes.clone()))
        .collect();
    assert_eq!(routes, sent);
    assert!(sent.iter().all(|(_, r)| !r.is_empty()));

    // SIGTERM: each exporter flushes at shutdown.
    for (c, reaper) in children.into_iter().zip(reapers) {
        sigterm(c.id());
        let mut c = c;
        let status = tokio::task::spawn_blocking(move || c.wait().unwrap()).await.unwrap();
        reaper.reaped();
        assert!(status.success(), "stage exit {status:?}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let find = |service: &str, name: &str| {
        received
            .lock()
            .unwrap()
            .spans
            .iter()
            .find(|s| s.trace_id == trace && s.service == service && s.name == name)
            .cloned()
    };
    let (execute, score) = loop {
        if let (Some(e), Some(s)) = (
            find(&format!("streamrl-{sandbox}"), "execute"),
            find(&format!("streamrl-{reward}"), "score"),
        ) {
            break (e, s);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no execute and score spans in trace {trace}; got {:#?}",
            received.lock().unwrap().spans
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        execute.parent_span_id, root,
        "execute is a child of the producer's span"
    );
    assert_eq!(score.parent_span_id, execute.span_id, "score is a child of execute");
    assert_eq!(execute.group_id.as_deref(), Some("g0"));
    assert_eq!(score.group_id.as_deref(), Some("g0"));
}

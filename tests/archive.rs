//! The archive end to end on the memory bus: a topology's archive stage writes Parquet
//! atomically, `streamrl query` answers SQL over it in every format, replay republishes
//! selected rows byte-equal, and pyarrow and DuckDB read the files.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::rollout;
use streamrl_archive::{ArchiveConfig, ArchiveStage, Sql};
use streamrl_runtime::bus::{self, Bus, Record};
use streamrl_runtime::runner::{Shutdown, StageMetrics, run_stage};
use streamrl_runtime::topology::Topology;
use streamrl_schemas::codec::{self, Compression};
use streamrl_schemas::{Headers, MetricRow, RolloutRow, SchemaId, TopicRow};

const TOPOLOGY: &str = r#"
bus: memory://archive-test
run_id: arch
dead_letter: dead_letter
topics:
  rollouts:    { schema: rollouts, partitions: 2, key: group_id }
  metrics:     { schema: metrics }
  dead_letter: { schema: dead_letter }
stages:
  archive: { kind: archive, inputs: all, config: { flush_rows: 7, flush_seconds: 0.2 } }
"#;

async fn publish(
    bus: &Arc<dyn Bus>,
    topic: &str,
    schema: SchemaId,
    batch: arrow::record_batch::RecordBatch,
    key: &str,
) {
    let p = bus.producer("test").await.unwrap();
    let payload = codec::encode(&batch, Compression::Zstd).unwrap();
    let rec = Record::new(payload)
        .with_key(key)
        .with_headers(Headers::data(schema, "test").to_wire());
    p.send(topic, rec).await.unwrap().await.unwrap();
}

/// Runs the archive over 40 rollouts (10 groups) and 3 metrics; returns the run dir.
async fn archived_run(dir: &Path) -> Arc<dyn Bus> {
    let yaml = TOPOLOGY.replace("archive-test", &common::unique("archive-test"));
    let mut topo = Topology::parse(&yaml, &|_, _| vec![]).unwrap();
    topo.run_dir = dir.to_path_buf();
    let bus = bus::connect(&topo.bus).await.unwrap();
    for s in topo.topic_specs() {
        bus.create_topic(&s).await.unwrap();
    }
    let cfg: ArchiveConfig = serde_yaml::from_value(topo.stages["archive"].config.clone()).unwrap();
    let stage = ArchiveStage::new(cfg, dir, "archive-0");
    let shutdown = Shutdown::new();
    let metrics = Arc::new(StageMetrics::default());
    let task = tokio::spawn(run_stage(
        bus.clone(),
        topo.runner_config("archive", 0).unwrap(),
        Box::new(stage),
        shutdown.clone(),
        metrics.clone(),
    ));
    for g in 0..10u32 {
        let rows: Vec<RolloutRow> = (g * 4..g * 4 + 4).map(rollout).collect();
        publish(
            &bus,
            "rollouts",
            SchemaId::Rollouts,
            RolloutRow::to_batch(&rows).unwrap(),
            &format!("g{g}"),
        )
        .await;
    }
    let metrics_rows: Vec<MetricRow> = (0..3)
        .map(|i| MetricRow {
            run_id: "arch".into(),
            step: i,
            stage: "trainer".into(),
            name: "loss".into(),
            value: 1.0 / (i + 1) as f64,
            created_at: 0,
        })
        .collect();
    publish(
        &bus,
        "metrics",
        SchemaId::Metrics,
        MetricRow::to_batch(&metrics_rows).unwrap(),
        "m",
    )
    .await;
    // Everything reaches disk before the archive acknowledges it: wait for the commits.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = bus.topic_stats("rollouts", &["archive".to_string()]).await.unwrap();
        let m = bus.topic_stats("metrics", &["archive".to_string()]).await.unwrap();
        let done = r.iter().chain(&m).all(|p| p.committed[0].1 == Some(p.end_offset));
        if done {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "archive never committed its inputs: {r:?} {m:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.trigger();
    task.await.unwrap().unwrap();
    bus
}

fn parquet_files(dir: &Path, topic: &str) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir.join("archive").join(topic))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_query_and_replay() {
    let dir = tempfile::tempdir().unwrap();
    let _bus = archived_run(dir.path()).await;

    // Files are complete and renamed: no temporary left, several flushes happened.
    let files = parquet_files(dir.path(), "rollouts");
    assert!(
        files.len() >= 2,
        "flush_rows: 7 over 40 rows gives several files: {files:?}"
    );
    assert!(
        files.iter().all(|f| f.extension().is_some_and(|e| e == "parquet")),
        "{files:?}"
    );

    // SQL over the archive.
    let sql = Sql::open(dir.path()).await.unwrap();
    assert_eq!(sql.tables(), ["metrics", "rollouts"]);
    let out = sql
        .query("SELECT step, count(*) AS n, sum(array_length(completion_token_ids)) AS toks FROM rollouts GROUP BY step ORDER BY step")
        .await
        .unwrap();
    let text = arrow::util::pretty::pretty_format_batches(&out).unwrap().to_string();
    let expected = "\
+------+---+------+
| step | n | toks |
+------+---+------+
| 0    | 8 | 16   |
| 1    | 8 | 16   |
| 2    | 8 | 16   |
| 3    | 8 | 16   |
| 4    | 8 | 16   |
+------+---+------+";
    assert_eq!(text, expected);

    // Every stored row comes back exactly.
    assert_eq!(stored_rollouts(&sql).await, (0..40).map(rollout).collect::<Vec<_>>());

    // Replay a selection into a fresh bus, keyed by group again.
    let (report, back) = replay_step_2(&sql).await;
    assert_eq!(report.rows, 8);
    assert_eq!(report.messages, 2, "two groups → two keyed messages");
    assert_eq!(back, (16..24).map(rollout).collect::<Vec<_>>());

    // A bad predicate is a clear SQL error, not a panic.
    let target = bus::connect(&common::unique("memory://replay")).await.unwrap();
    let e = streamrl_archive::replay(
        &sql,
        "rollouts",
        Some("no_such_column = 1"),
        SchemaId::Rollouts,
        None,
        &target,
        "rollouts",
        10,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("no_such_column"), "{e}");
    let e = sql.select("scored", None).await.unwrap_err().to_string();
    assert!(e.contains("scored"), "{e}");
}

fn conform(b: &arrow::record_batch::RecordBatch) -> arrow::record_batch::RecordBatch {
    let want = SchemaId::Rollouts.schema();
    let cols = want
        .fields()
        .iter()
        .map(|f| arrow::compute::cast(b.column_by_name(f.name()).unwrap(), f.data_type()).unwrap())
        .collect();
    arrow::record_batch::RecordBatch::try_new(want, cols).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_command_formats_and_foreign_readers() {
    let dir = tempfile::tempdir().unwrap();
    let _bus = archived_run(dir.path()).await;
    let bin = env!("CARGO_BIN_EXE_streamrl");
    let query = |fmt: &str, sql: &str| {
        let out = Command::new(bin)
            .args(["query", sql, "--format", fmt, "--run-dir"])
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let sql = "SELECT name, round(value, 3) AS v FROM metrics ORDER BY v";
    assert_eq!(
        query("table", sql).trim(),
        "+------+-------+\n| name | v     |\n+------+-------+\n| loss | 0.333 |\n| loss | 0.5   |\n| loss | 1.0   |\n+------+-------+"
    );
    assert_eq!(query("csv", sql), "name,v\nloss,0.333\nloss,0.5\nloss,1.0\n");
    assert_eq!(
        query("json", sql),
        "{\"name\":\"loss\",\"v\":0.333}\n{\"name\":\"loss\",\"v\":0.5}\n{\"name\":\"loss\",\"v\":1.0}\n"
    );
    let out = Command::new(bin)
        .args(["query", "SELEC nonsense", "--run-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("SQL"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // pyarrow and DuckDB read the archive as is.
    let (py, pythonpath) = common::python_with(&["pyarrow==26.0.1", "duckdb==2.0.1"]);
    let script = r#"
import sys, pyarrow.dataset as ds, duckdb
root = sys.argv[1]
t = ds.dataset(root + "/archive/rollouts", format="parquet").to_table()
assert t.num_rows == 40, t.num_rows
assert str(t.schema.field("completion_token_ids").type) == "list<item: uint32 not null>", t.schema.field("completion_token_ids").type
toks = sum(len(x) for x in t.column("prompt_token_ids").to_pylist())
n, steps = duckdb.sql(f"SELECT count(*), count(DISTINCT step) FROM read_parquet('{root}/archive/rollouts/*.parquet')").fetchall()[0]
calls = duckdb.sql(f"SELECT count(*) FROM read_parquet('{root}/archive/rollouts/*.parquet') WHERE len(tool_calls) > 0").fetchall()[0][0]
print(t.num_rows, toks, n, steps, calls)
"#;
    let mut cmd = Command::new(py);
    cmd.arg("-c").arg(script).arg(dir.path());
    if let Some(p) = pythonpath {
        cmd.env("PYTHONPATH", p);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "40 120 40 5 8");
}

/// The functions people type into `streamrl query` plan and run (string, unicode, regex,
/// crypto, encoding, date/time and math functions are DataFusion features of their own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn common_sql_functions_plan_and_run() {
    let dir = tempfile::tempdir().unwrap();
    let _bus = archived_run(dir.path()).await;
    let sql = Sql::open(dir.path()).await.unwrap();
    let cases: &[(&str, &str)] = &[
        ("substr(rollout_id, 1, 1)", "r"),
        ("substring(rollout_id from 1 for 1)", "r"),
        ("md5('abc')", "900150983cd24fb0d6963f7d28e17f72"),
        (
            "sha256('abc')",
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        ),
        ("upper('abc')", "ABC"),
        ("lower('ABC')", "abc"),
        ("char_length('héllo')", "5"),
        ("length('abc')", "3"),
        ("concat('a', 'b', 'c')", "abc"),
        ("'a' || 'b'", "ab"),
        ("replace('a-b', '-', '+')", "a+b"),
        ("split_part('a,b,c', ',', 2)", "b"),
        ("strpos('hello', 'l')", "3"),
        ("left('hello', 2)", "he"),
        ("right('hello', 2)", "lo"),
        ("lpad('7', 3, '0')", "007"),
        ("trim('  x  ')", "x"),
        ("reverse('abc')", "cba"),
        ("starts_with('hello', 'he')", "true"),
        ("regexp_replace('a1b2', '[0-9]', '', 'g')", "ab"),
        ("regexp_like('abc', '^a')", "true"),
        ("to_hex(255)", "ff"),
        ("encode('abc', 'base64')", "YWJj"),
        (
            "date_trunc('day', to_timestamp_millis(86400000 + 5000))",
            "1970-01-02T00:00:00",
        ),
        ("abs(-2)", "2"),
        ("round(2.5)", "3.0"),
        ("coalesce(NULL, 'x')", "x"),
    ];
    let mut failures = Vec::new();
    for (expr, want) in cases {
        let q = format!("SELECT {expr} AS v FROM rollouts ORDER BY rollout_id LIMIT 1");
        match sql.query(&q).await {
            Ok(batches) => {
                let col = batches[0].column(0);
                let got = arrow::util::display::array_value_to_string(col, 0).unwrap();
                if got != *want {
                    failures.push(format!("{expr}: got {got}, want {want}"));
                }
            }
            Err(e) => failures.push(format!("{expr}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// A query reads only the topics it names, and plans from one footer per topic: an
/// unreadable file under another topic (a crashed foreign writer, a stray copy) does not
/// stop queries of the healthy ones, and names itself when its own topic is queried.
/// (When every topic's every footer was read to open the archive, one bad file anywhere
/// failed every query.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_reads_only_the_topics_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let _bus = archived_run(dir.path()).await;
    let junk = dir.path().join("archive/junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("part-x-1-000001.parquet"), b"not parquet at all").unwrap();
    let sql = Sql::open(dir.path()).await.unwrap();
    assert!(sql.tables().iter().any(|t| t == "junk"), "{:?}", sql.tables());
    let n = sql.query("SELECT count(*) AS n FROM rollouts").await.unwrap();
    let n = arrow::util::display::array_value_to_string(n[0].column(0), 0).unwrap();
    assert_eq!(n, "40");
    let joined = sql
        .query("SELECT count(*) FROM rollouts r JOIN metrics m ON r.step = m.step")
        .await
        .unwrap();
    assert_eq!(joined[0].num_rows(), 1);
    let e = sql.query("SELECT * FROM junk").await.unwrap_err().to_string();
    assert!(
        e.contains("junk") || e.contains("parquet") || e.contains("Parquet"),
        "{e}"
    );
    // A second query on the same session reuses the registered table.
    let again = sql.query("SELECT max(step) FROM rollouts").await.unwrap();
    assert_eq!(again[0].num_rows(), 1);
    // Unknown tables are still reported with the list of known ones.
    let e = sql.query("SELECT * FROM nope").await.unwrap_err().to_string();
    assert!(e.contains("nope") && e.contains("rollouts"), "{e}");
}

/// Every archived rollout as a SQL session reads it, sorted.
async fn stored_rollouts(sql: &Sql) -> Vec<RolloutRow> {
    let mut rows: Vec<RolloutRow> = sql
        .select("rollouts", None)
        .await
        .unwrap()
        .iter()
        .flat_map(|b| RolloutRow::from_batch(&conform(b)).unwrap())
        .collect();
    rows.sort_by_key(|r| r.rollout_id[1..].parse::<u32>().unwrap());
    rows
}

/// Every archived rollout of the run in `run_dir`, sorted.
async fn all_rollouts(run_dir: &Path) -> Vec<RolloutRow> {
    stored_rollouts(&Sql::open(run_dir).await.unwrap()).await
}

/// Replays the archived rollouts of `step = 2` to a fresh bus, keyed by group again;
/// what the replay reported and the rows that arrived, sorted (each message in its key's
/// partition).
async fn replay_step_2(sql: &Sql) -> (streamrl_archive::ReplayReport, Vec<RolloutRow>) {
    let target = bus::connect(&common::unique("memory://replay")).await.unwrap();
    target.create_topic(&bus::TopicSpec::new("rollouts", 2)).await.unwrap();
    let mut c = target.subscribe("check", &["rollouts".to_string()]).await.unwrap();
    let report = streamrl_archive::replay(
        sql,
        "rollouts",
        Some("step = 2"),
        SchemaId::Rollouts,
        Some("group_id"),
        &target,
        "rollouts",
        1024,
    )
    .await
    .unwrap();
    let mut back = Vec::new();
    while back.len() < report.rows as usize {
        let m = tokio::time::timeout(Duration::from_secs(5), c.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.partition, bus::partition_for_key(m.key.as_deref().unwrap(), 2));
        let b = codec::decode(SchemaId::Rollouts, &m.headers, &m.payload).unwrap();
        back.extend(RolloutRow::from_batch(&b).unwrap());
        c.ack(&m.id()).unwrap();
    }
    back.sort_by_key(|r| r.rollout_id[1..].parse::<u32>().unwrap());
    (report, back)
}

/// What a replay of `step = 2` from the archive of `run_dir` delivers, sorted.
async fn replayed(run_dir: &Path) -> Vec<RolloutRow> {
    replay_step_2(&Sql::open(run_dir).await.unwrap()).await.1
}

/// Compaction merges a long run's small files into a few large ones: `query` and
/// `replay` give the same rows before, during (merged file renamed in, replaced files not
/// yet deleted: what a crash there leaves), and after; a crash before the rename leaves a
/// temporary file no reader sees, which the next pass removes; merged files are merged
/// again without their replaced files coming back; two writers' files are never mixed;
/// and the offsets a durable bus's redelivery check reads survive the merge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_keeps_every_row_once_and_queries_and_replays_the_same() {
    use streamrl_archive::{ArchiveWriter, CompactConfig, compact_topic, live_files};
    let dir = tempfile::tempdir().unwrap();
    let topic = dir.path().join("archive/rollouts");
    let on_disk = || {
        parquet_files(dir.path(), "rollouts")
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
            .count()
    };
    let cfg = ArchiveConfig::default();
    let bus_url = "kafka://127.0.0.1:1/compaction";
    // Two writers, a file per 2 rows: 40 small files, offsets recorded as on a durable bus.
    let mut writers = [
        ArchiveWriter::new(dir.path(), "archive-0", cfg.clone()).with_offsets_of(bus_url),
        ArchiveWriter::new(dir.path(), "archive-1", cfg.clone()).with_offsets_of(bus_url),
    ];
    let write = |writers: &mut [ArchiveWriter; 2], range: std::ops::Range<u32>| {
        for i in range.step_by(2) {
            let w = &mut writers[(i / 2 % 2) as usize];
            let b = RolloutRow::to_batch(&[rollout(i), rollout(i + 1)]).unwrap();
            w.append_at("rollouts", SchemaId::Rollouts, b, i % 4 / 2, u64::from(i));
            w.flush_all().unwrap();
            // Distinct file names: the writer names files by the millisecond.
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    write(&mut writers, 0..40);
    assert_eq!(on_disk(), 20);
    let rows = all_rollouts(dir.path()).await;
    assert_eq!(rows, (0..40).map(rollout).collect::<Vec<_>>());
    let replay_before = replayed(dir.path()).await;
    assert_eq!(replay_before, (16..24).map(rollout).collect::<Vec<_>>());

    // A pass, with a query session opened before it (its table lists the small files).
    let before_pass = Sql::open(dir.path()).await.unwrap();
    let count = "SELECT count(*) AS n FROM rollouts";
    let n =
        |b: Vec<arrow::record_batch::RecordBatch>| arrow::util::pretty::pretty_format_batches(&b).unwrap().to_string();
    let forty = n(before_pass.query(count).await.unwrap());
    assert!(forty.contains("| 40 |"), "{forty}");
    let backup = tempfile::tempdir().unwrap();
    let small = parquet_files(dir.path(), "rollouts");
    for f in &small {
        std::fs::copy(f, backup.path().join(f.file_name().unwrap())).unwrap();
    }
    let keep = CompactConfig {
        target_rows: 12,
        min_files: 3,
        ..CompactConfig::default()
    };
    let r = compact_topic(&topic, &keep).unwrap();
    assert!(r.written >= 2 && r.merged >= 6, "{r:?}");
    assert_eq!(r.deleted, r.merged, "the merged files' sources are deleted");
    assert_eq!(on_disk(), 20 - r.merged + r.written);
    assert_eq!(live_files(&topic).unwrap().len(), on_disk());
    assert_eq!(all_rollouts(dir.path()).await, rows);
    assert_eq!(replayed(dir.path()).await, replay_before);
    assert_eq!(
        n(before_pass.query(count).await.unwrap()),
        forty,
        "a session opened before the pass lists again"
    );
    // What a crash between a merged file's rename and its sources' deletion leaves: both
    // on disk. Every row still once, and the next pass deletes the sources.
    let deleted: Vec<_> = small.iter().filter(|p| !p.exists()).collect();
    assert_eq!(deleted.len(), r.merged);
    for f in &deleted {
        std::fs::copy(backup.path().join(f.file_name().unwrap()), f).unwrap();
    }
    assert_eq!(on_disk(), 20 + r.written);
    assert_eq!(
        all_rollouts(dir.path()).await,
        rows,
        "merged and replaced files both on disk"
    );
    assert_eq!(replayed(dir.path()).await, replay_before);
    let merged_first = r;
    // A crash mid-merge leaves a temporary file: no reader lists it.
    let tmp = topic.join(".compact-part-archive-0-1-000001-to-2-000002.parquet.tmp");
    std::fs::write(&tmp, b"half a parquet file").unwrap();
    assert_eq!(all_rollouts(dir.path()).await, rows);

    // Another pass holds the directory: this one waits its turn (does nothing).
    let lock = std::fs::File::open(topic.join(".compact.lock")).unwrap();
    lock.lock().unwrap();
    assert_eq!(compact_topic(&topic, &keep).unwrap(), Default::default());
    lock.unlock().unwrap();

    // More small files, then merges of merged files; the first pass's leftovers (the
    // restored sources, the temporary file) go first.
    write(&mut writers, 40..60);
    let mut rows = rows;
    rows.extend((40..60).map(rollout));
    let wide = CompactConfig {
        target_rows: 1000,
        min_files: 2,
        ..keep.clone()
    };
    let r = compact_topic(&topic, &wide).unwrap();
    assert_eq!(r.written, 2, "one file per writer: {r:?}");
    assert_eq!(r.merged, merged_first.written + 10, "{r:?}");
    assert_eq!(r.deleted, merged_first.merged + 1 + r.merged, "{r:?}");
    assert!(!tmp.exists(), "the stale temporary file is removed");
    assert_eq!(on_disk(), 2, "{:#?}", parquet_files(dir.path(), "rollouts"));
    assert_eq!(live_files(&topic).unwrap().len(), 2);
    assert_eq!(all_rollouts(dir.path()).await, rows);
    assert_eq!(replayed(dir.path()).await, replay_before);
    let out = Sql::open(dir.path())
        .await
        .unwrap()
        .query("SELECT count(*) AS n, count(DISTINCT rollout_id) AS d FROM rollouts")
        .await
        .unwrap();
    let text = arrow::util::pretty::pretty_format_batches(&out).unwrap().to_string();
    assert!(text.contains("| 60 | 60 |"), "{text}");

    // The redelivery check of a durable bus still knows every offset written.
    let mut fresh = ArchiveWriter::new(dir.path(), "archive-0", cfg).with_offsets_of(bus_url);
    assert!(fresh.is_archived("rollouts", 0, 56) && fresh.is_archived("rollouts", 1, 58));
    assert!(!fresh.is_archived("rollouts", 0, 57) && !fresh.is_archived("rollouts", 1, 59));
}

/// The archive stage compacts on its schedule while a run goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_archive_stage_compacts_on_its_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = TOPOLOGY
        .replace("archive-test", &common::unique("archive-compact"))
        .replace(
            "config: { flush_rows: 7, flush_seconds: 0.2 }",
            "config: { flush_rows: 2, flush_seconds: 0.05, compact_seconds: 0.2, compact_min_files: 3 }",
        );
    let mut topo = Topology::parse(&yaml, &|_, _| vec![]).unwrap();
    topo.run_dir = dir.path().to_path_buf();
    let bus = bus::connect(&topo.bus).await.unwrap();
    for s in topo.topic_specs() {
        bus.create_topic(&s).await.unwrap();
    }
    let cfg: ArchiveConfig = serde_yaml::from_value(topo.stages["archive"].config.clone()).unwrap();
    assert_eq!(cfg.compact_min_files, 3);
    let shutdown = Shutdown::new();
    let task = tokio::spawn(run_stage(
        bus.clone(),
        topo.runner_config("archive", 0).unwrap(),
        Box::new(ArchiveStage::new(cfg, dir.path(), "archive-0")),
        shutdown.clone(),
        Arc::new(StageMetrics::default()),
    ));
    let topic = dir.path().join("archive/rollouts");
    for g in 0..20u32 {
        let rows: Vec<RolloutRow> = (g * 2..g * 2 + 2).map(rollout).collect();
        publish(
            &bus,
            "rollouts",
            SchemaId::Rollouts,
            RolloutRow::to_batch(&rows).unwrap(),
            &format!("g{g}"),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let rows = if topic.exists() {
            all_rollouts(dir.path()).await.len()
        } else {
            0
        };
        let live = if topic.exists() {
            streamrl_archive::live_files(&topic).unwrap().len()
        } else {
            0
        };
        if rows == 40 && live <= 4 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{rows} rows in {live} live files"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.trigger();
    task.await.unwrap().unwrap();
    assert_eq!(all_rollouts(dir.path()).await, (0..40).map(rollout).collect::<Vec<_>>());
}

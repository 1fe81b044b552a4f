//! `streamrl bench scale`: the sandbox stage, the bottleneck of the `code` environment,
//! as 1, 2 and 4 replica processes (`streamrl stage sandbox`) on a Kafka broker.
//!
//! Each round gets topics of its own (a fresh consumer group, nothing left from the round
//! before), starts its replicas and waits until their group has spread the `rollouts`
//! partitions over all of them, then publishes the same workload: rollouts of `code`
//! problems whose completions are the reference solutions, so every one runs its unit
//! tests in a sandbox for real. It times the first publication to the last `executed` row,
//! and checks that every rollout was executed exactly once (rows counted per
//! `rollout_id`) and passed. Each replica executes `--concurrency` rollouts at a time (1
//! by default, so a replica is the unit that scales); on 2 cores the curve flattens once
//! the cores are full.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use streamrl_envs::{Environment, Split};
use streamrl_runtime::bus::{self, Bus, Message, Record};
use streamrl_runtime::topology::Topology;
use streamrl_schemas::codec::{self, Compression};
use streamrl_schemas::{ExecutedRow, Headers, RolloutRow, SchemaId, TopicRow};

/// Partitions of the round's topics (the most replicas that all get work).
const PARTITIONS: u32 = 8;
/// Samples per group (one message each).
const GROUP_SIZE: u32 = 4;

/// What one round measured.
struct Round {
    replicas: u32,
    secs: f64,
    executed: usize,
    distinct: usize,
    passed: usize,
    /// Per replica: rows it executed, partitions it owned.
    per_replica: BTreeMap<String, (usize, String)>,
}

/// Runs the benchmark and prints the table.
pub async fn run(bus_url: &str, rollouts: usize, replicas: &[u32], concurrency: usize) -> Result<()> {
    if !bus_url.starts_with("kafka://") {
        bail!("bench scale runs stage processes on a shared bus: --bus must be kafka://…, not `{bus_url}`");
    }
    if let Some(r) = replicas.iter().find(|&&r| r == 0 || r > PARTITIONS) {
        bail!("--replicas {r}: each round needs 1 to {PARTITIONS} replicas (the topics' partitions)");
    }
    let groups = rollouts.div_ceil(GROUP_SIZE as usize).max(1);
    let (env, _) = streamrl_stages::build_env("code", &serde_yaml::Value::Null)
        .map_err(|e| anyhow::anyhow!(streamrl_schemas::problem::list(&e)))?;
    let work = workload(env.as_ref(), groups)?;
    let bus = bus::connect(bus_url).await?;
    println!(
        "streamrl bench scale (profile: {}): {} rollouts ({groups} groups of {GROUP_SIZE}) of `code` problems with their \
         reference solutions, sandbox stage processes on {bus_url}, {concurrency} execution(s) at a time per replica, \
         {PARTITIONS} partitions",
        if cfg!(debug_assertions) { "debug" } else { "release" },
        groups * GROUP_SIZE as usize
    );
    let mut results = Vec::new();
    for &n in replicas {
        let r = round(&bus, bus_url, &work, n, concurrency).await?;
        println!("  {n} replica(s): {:.1} s", r.secs);
        results.push(r);
    }
    let base = results.first().map(|r| r.executed as f64 / r.secs).unwrap_or(1.0);
    println!();
    println!(
        "| replicas | rollouts/s | vs {} replica(s) | wall s | executed once | passed | per replica: rows (partitions) |",
        results.first().map_or(1, |r| r.replicas)
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &results {
        let rate = r.executed as f64 / r.secs;
        let once = r.executed == r.distinct && r.distinct == work.len() * GROUP_SIZE as usize;
        let per: Vec<String> = r
            .per_replica
            .iter()
            .map(|(k, (rows, parts))| format!("{k}: {rows} ({parts})"))
            .collect();
        println!(
            "| {} | {rate:.1} | {:.2}× | {:.1} | {} ({} rows, {} distinct) | {} | {} |",
            r.replicas,
            rate / base,
            r.secs,
            if once { "yes" } else { "NO" },
            r.executed,
            r.distinct,
            r.passed,
            per.join("; ")
        );
    }
    if let Some(bad) = results
        .iter()
        .find(|r| r.executed != r.distinct || r.distinct != work.len() * GROUP_SIZE as usize)
    {
        bail!(
            "with {} replica(s), {} rows for {} distinct of {} rollouts: some rollout was lost or executed twice",
            bad.replicas,
            bad.executed,
            bad.distinct,
            work.len() * GROUP_SIZE as usize
        );
    }
    Ok(())
}

/// One message per group: `GROUP_SIZE` rollouts of one problem, each completed with the
/// problem's reference solution.
fn workload(env: &dyn Environment, groups: usize) -> Result<Vec<Vec<RolloutRow>>> {
    let now = streamrl_stages::now_ms();
    (0..groups)
        .map(|g| {
            let p = env.sample(Split::Train, g as u64);
            let completion = env
                .reference_completion(&p)
                .with_context(|| format!("code problem {} has no reference solution", p.id))?;
            Ok((0..GROUP_SIZE)
                .map(|i| RolloutRow {
                    run_id: "bench-scale".into(),
                    problem_id: p.id.clone(),
                    group_id: format!("g{g}"),
                    rollout_id: format!("g{g}-{i}"),
                    sample_id: format!("g{g}-{i}-0"),
                    env: "code".into(),
                    step: 0,
                    sample_index: i,
                    group_size: GROUP_SIZE,
                    turn: 0,
                    prompt: p.question.clone(),
                    prompt_token_ids: vec![1, 2, 3],
                    completion: completion.clone(),
                    completion_token_ids: vec![4, 5],
                    completion_logprobs: vec![-0.5, -0.5],
                    completion_versions: vec![0, 0],
                    completion_routes: vec![],
                    loss_mask: vec![true, true],
                    finish_reason: "stop".into(),
                    tool_calls: vec![],
                    answer: p.answer.clone(),
                    info: Some(p.info.to_string()),
                    temperature: 1.0,
                    started_at: now,
                    finished_at: now,
                    created_at: now,
                })
                .collect())
        })
        .collect()
}

fn topology(bus_url: &str, id: &str, dir: &Path, replicas: u32, concurrency: usize) -> String {
    format!(
        r#"
bus: {bus_url}
run_id: bench-scale-{id}
run_dir: {run}
dead_letter: dead_letter-{id}
envs:
  code: {{ weight: 1 }}
topics:
  rollouts-{id}:      {{ schema: rollouts,      partitions: {PARTITIONS}, key: group_id }}
  executed-{id}:      {{ schema: executed,      partitions: {PARTITIONS}, key: group_id }}
  continuations-{id}: {{ schema: continuations, partitions: {PARTITIONS}, key: rollout_id, feedback: true }}
  dead_letter-{id}:   {{ schema: dead_letter,   partitions: 1 }}
stages:
  sandbox:
    kind: sandbox
    inputs: [rollouts-{id}]
    outputs: [executed-{id}, continuations-{id}]
    replicas: {replicas}
    config: {{ max_concurrency: {concurrency} }}
"#,
        run = dir.join("run").display(),
    )
}

/// The partitions a replica owns now, from its newest `assigned`/`revoked` log line.
fn owned(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .rfind(|l| (l.contains(" assigned ") || l.contains(" revoked ")) && l.contains("partitions="))
        .and_then(|l| l.split("partitions=").nth(1))
        .unwrap_or("")
        .trim()
        .to_string()
}

/// SIGTERMs and reaps the replicas when dropped (also when a round fails).
struct Replicas(Vec<Child>);

impl Drop for Replicas {
    fn drop(&mut self) {
        for c in &self.0 {
            crate::cli::up::signal(c.id(), rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for c in &mut self.0 {
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn round(
    bus: &Arc<dyn Bus>,
    bus_url: &str,
    work: &[Vec<RolloutRow>],
    n: u32,
    concurrency: usize,
) -> Result<Round> {
    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_string();
    let dir = std::env::temp_dir().join(format!("streamrl-bench-scale-{id}"));
    std::fs::create_dir_all(dir.join("logs"))?;
    let topo_path = dir.join("topology.yaml");
    std::fs::write(&topo_path, topology(bus_url, &id, &dir, n, concurrency))?;
    let t = Topology::load(&topo_path, &crate::stages::check_config).map_err(|e| {
        anyhow::anyhow!(
            "bench topology: {}",
            e.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
        )
    })?;
    streamrl_runtime::running::create_topics(bus, &t).await?;
    let (rollouts, executed) = (format!("rollouts-{id}"), format!("executed-{id}"));
    // Read `executed` from the start, before anything is published.
    let mut reader = bus
        .subscribe(&format!("bench-scale-reader-{id}"), std::slice::from_ref(&executed))
        .await?;

    let logs: Vec<_> = (0..n).map(|i| dir.join(format!("logs/sandbox-{i}.log"))).collect();
    let mut children = start_replicas(bus_url, &topo_path, &logs)?;
    wait_settled(&mut children, &logs).await?;

    let t0 = Instant::now();
    publish(bus, &rollouts, work).await?;
    let want = work.len() * GROUP_SIZE as usize;
    let mut tally = Tally::default();
    let deadline = Instant::now() + Duration::from_secs(600);
    while tally.per_rollout.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        let m = match tokio::time::timeout(left, reader.recv()).await {
            Ok(m) => m?,
            Err(_) => bail!(
                "only {} of {want} rollouts executed within 600 s",
                tally.per_rollout.len()
            ),
        };
        reader.ack(&m.id())?;
        tally.add(&m, false)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    // Late duplicates would arrive right behind: read on while the topic stays quiet.
    while let Ok(m) = tokio::time::timeout(Duration::from_secs(2), reader.recv()).await {
        tally.add(&m?, true)?;
    }
    let parts: Vec<String> = logs.iter().map(|l| owned(l)).collect();
    reader.close().await?;
    drop(children);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Round {
        replicas: n,
        secs,
        executed: tally.rows,
        distinct: tally.per_rollout.len(),
        passed: tally.passed,
        per_replica: (0..n)
            .map(|i| {
                let k = format!("sandbox-{i}");
                let count = tally.per_replica.get(&k).copied().unwrap_or(0);
                (k, (count, parts[i as usize].split_whitespace().count().to_string()))
            })
            .collect(),
    })
}

/// One `streamrl stage sandbox` process per log file, on the round's topology.
fn start_replicas(bus_url: &str, topo_path: &Path, logs: &[PathBuf]) -> Result<Replicas> {
    let exe = std::env::current_exe()?;
    let mut children = Replicas(Vec::new());
    for (i, log) in logs.iter().enumerate() {
        let f = std::fs::File::create(log)?;
        children.0.push(
            Command::new(&exe)
                .args([
                    "stage",
                    "sandbox",
                    "--replica",
                    &i.to_string(),
                    "--bus",
                    bus_url,
                    "--topology",
                ])
                .arg(topo_path)
                .env("STREAMRL_SET", "")
                .env("RUST_LOG", "info")
                .stdin(Stdio::null())
                .stdout(f.try_clone()?)
                .stderr(f)
                .spawn()
                .context("starting a sandbox replica")?,
        );
    }
    Ok(children)
}

/// Waits until the replicas' group has settled: every replica owns some partitions and
/// together they own all of them.
async fn wait_settled(children: &mut Replicas, logs: &[PathBuf]) -> Result<()> {
    let n = logs.len();
    let settle = Instant::now() + Duration::from_secs(120);
    loop {
        let parts: Vec<String> = logs.iter().map(|l| owned(l)).collect();
        let total: usize = parts.iter().map(|p| p.split_whitespace().count()).sum();
        if total == PARTITIONS as usize && parts.iter().all(|p| !p.is_empty()) {
            break;
        }
        for (i, c) in children.0.iter_mut().enumerate() {
            if let Some(s) = c.try_wait()? {
                bail!(
                    "sandbox replica {i} exited ({s}) before the group settled; its log: {}",
                    logs[i].display()
                );
            }
        }
        if Instant::now() > settle {
            bail!("the {n} sandbox replicas did not share the {PARTITIONS} partitions within 120 s: {parts:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Sends every group of `work` to `topic`, keyed by group, and waits for the broker.
async fn publish(bus: &Arc<dyn Bus>, topic: &str, work: &[Vec<RolloutRow>]) -> Result<()> {
    let producer = bus.producer("bench-scale").await?;
    let mut pending = Vec::new();
    for group in work {
        let payload = codec::encode(&RolloutRow::to_batch(group)?, Compression::Zstd)?;
        let rec = Record::new(payload)
            .with_key(group[0].group_id.clone())
            .with_headers(Headers::data(SchemaId::Rollouts, "bench-scale").to_wire());
        pending.push(producer.send(topic, rec).await?);
    }
    for p in pending {
        p.await?;
    }
    Ok(())
}

/// What came back on `executed`: rows, rows whose tests all passed, rows per rollout and
/// per producing replica.
#[derive(Default)]
struct Tally {
    rows: usize,
    passed: usize,
    per_rollout: HashMap<String, usize>,
    per_replica: BTreeMap<String, usize>,
}

impl Tally {
    /// Counts a message's rows (a late one, after the round's time was taken: only as
    /// rows and per rollout, to see duplicates).
    fn add(&mut self, m: &Message, late: bool) -> Result<()> {
        let h = Headers::from_wire(&m.headers)?;
        let batch = codec::decode(SchemaId::Executed, &m.headers, &m.payload)?;
        for r in ExecutedRow::from_batch(&batch)? {
            self.rows += 1;
            *self.per_rollout.entry(r.rollout_id.clone()).or_default() += 1;
            if !late {
                self.passed +=
                    usize::from(r.exec_status == "ok" && r.tests_total > 0 && r.tests_passed == r.tests_total);
                *self.per_replica.entry(h.producer.clone()).or_default() += 1;
            }
        }
        Ok(())
    }
}

//! Chaos: the whole RL loop as separate processes on a real Kafka-compatible broker
//! (tansu, started here on 127.0.0.1), supervised by `streamrl up`, while a driver
//! SIGKILLs random stage processes at random moments; then the run's invariants, checked
//! with SQL over its archive. A control run without faults comes first, on the same
//! topology, for the wall-time ratio.
//!
//! Invariants: the target step is reached; each version is published once, in order; no
//! sample is trained twice; every admitted group is trained or dropped with a recorded
//! reason; a group a step stopped waiting for is named once and consumed only by a later
//! version; every trained sample is in the archive; a source restart re-sends at most what
//! was in flight; no dead letters. The SIGKILL run uses tight limits ([`Limits::Tight`]):
//! groups held up by a kill time out, come late and are dropped as `stale` or
//! `superseded` (past a deduplication window that moves on every step), and the table
//! shows each of those paths was taken.
//!
//! The soak test runs `streamrl soak` (`STREAMRL_SOAK_MINUTES`, default 5) on an endless
//! run and asserts its verdict: no growth of any process's memory, files or threads, of
//! the lag or of the archive's files.
//!
//! The broker is tansu with its memory engine (the broker-restart test: its S3 engine,
//! with the default 6 s session timeout, `STREAMRL_RESTART_SESSION_MS`, and
//! `STREAMRL_RESTART_STEPS`, default 12). In the SIGKILL test consumers use a 1 s session
//! timeout (tansu accepts it): a SIGKILLed member's
//! partitions move after it, and tansu holds every join for half of it, so a restarted
//! replica is consuming again ~1.5 s after it starts. `STREAMRL_CHAOS_STEPS` (default
//! 700, long enough for 20 kills at the default rate), `STREAMRL_CHAOS_KILLS` (minimum
//! kills, default 20), `STREAMRL_CHAOS_EVERY_MS` (kill interval range; default
//! `3000-9000`, shortened only when the control run is too short for the minimum kills
//! to fit at that rate), `STREAMRL_CHAOS_SESSION_MS` (default 1000) and
//! `STREAMRL_CHAOS_SEED` tune it; `STREAMRL_CHAOS_KEEP=1` keeps each run's directory.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::query;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The size of a run.
#[derive(Debug, Clone, Copy)]
struct Shape {
    max_steps: u64,
    groups_per_step: u64,
    group_size: u64,
    limits: Limits,
}

/// How long the trainer waits for a step's groups, and how much it remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Limits {
    /// Long enough never to be reached: every group is trained in its own step.
    Roomy,
    /// Short: a group held up by a kill times out (the step trains without it), comes
    /// later and is dropped as
    /// `superseded` past a 3-step deduplication window, or as `stale` when its samples are
    /// more than 2 versions old (the source's async level is 2: a group on time never is).
    Tight,
}

impl Limits {
    /// The trainer's settings.
    fn settings(self) -> &'static str {
        match self {
            Limits::Roomy => "max_off_policy_steps: 1000, dedup_window: 2000, step_timeout_secs: 3600",
            Limits::Tight => "max_off_policy_steps: 2, dedup_window: 3, step_timeout_secs: 1",
        }
    }
}
/// The source's async level (bounds what is in flight when it dies).
const MAX_ASYNC_LEVEL: u64 = 2;
/// The tests of this file run one at a time (each is a whole pipeline on 2 cores).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
/// The stage kinds, each killed at least twice.
const KINDS: [&str; 7] = ["source", "rollout", "sandbox", "reward", "mask", "trainer", "archive"];

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn topology(bus: &str, shape: Shape) -> String {
    let Shape {
        max_steps,
        groups_per_step,
        group_size,
        limits,
    } = shape;
    let trainer_limits = limits.settings();
    format!(
        r#"
bus: {bus}
run_id: chaos
run_dir: run
dead_letter: dead_letter
envs:
  arith: {{ weight: 1 }}
sft: {{ out: run/sft, steps: 20, batch: 32 }}
topics:
  prompts:       {{ schema: prompts,       partitions: 2, key: group_id }}
  rollouts:      {{ schema: rollouts,      partitions: 2, key: group_id }}
  continuations: {{ schema: continuations, partitions: 2, key: rollout_id, feedback: true }}
  executed:      {{ schema: executed,      partitions: 2, key: group_id }}
  scored:        {{ schema: scored,        partitions: 2, key: group_id }}
  samples:       {{ schema: samples,       partitions: 2, key: group_id }}
  policy:        {{ schema: policy,        partitions: 1 }}
  trained:       {{ schema: trained,       partitions: 1 }}
  metrics:       {{ schema: metrics,       partitions: 1 }}
  dead_letter:   {{ schema: dead_letter,   partitions: 1 }}
stages:
  source:
    kind: source
    broadcast: [policy]
    outputs: [prompts, metrics]
    config: {{ checkpoint: run/sft, group_size: {group_size}, groups_per_step: {groups_per_step}, max_async_level: {MAX_ASYNC_LEVEL}, max_steps: {max_steps}, max_tokens: 8 }}
  rollout:
    kind: rollout
    inputs: [prompts, continuations]
    broadcast: [policy]
    outputs: [rollouts, metrics]
    replicas: 2
    config: {{ checkpoint: run/sft, max_inflight_groups: 4 }}
  sandbox: {{ kind: sandbox, inputs: [rollouts], outputs: [executed, continuations] }}
  reward: {{ kind: reward, inputs: [executed], outputs: [scored], replicas: 2 }}
  mask: {{ kind: mask, inputs: [scored], outputs: [samples, metrics], replicas: 2, config: {{ filter_zero_variance: false }} }}
  trainer:
    kind: trainer
    inputs: [samples]
    outputs: [policy, trained, metrics]
    config: {{ checkpoint: run/sft, groups_per_step: {groups_per_step}, max_steps: {max_steps}, {trainer_limits}, keep_last: 3 }}
  archive: {{ kind: archive, inputs: all, config: {{ flush_rows: 200, flush_seconds: 1 }} }}
"#
    )
}

/// Whether the run's producers may write a record twice (see [`invariants`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Copies {
    /// Idempotent producers: a copy is a broken invariant.
    Never,
    /// Producers without idempotence, across a broker restart.
    Possible,
}

/// A run's directory: removed with the run, or kept (`STREAMRL_CHAOS_KEEP`).
enum Dir {
    Temp(tempfile::TempDir),
    Kept(std::path::PathBuf),
}

impl Dir {
    fn path(&self) -> &Path {
        match self {
            Dir::Temp(t) => t.path(),
            Dir::Kept(p) => p,
        }
    }
}

/// What one run did.
struct Run {
    dir: Dir,
    wall: f64,
    kills: BTreeMap<&'static str, u32>,
    up_log: String,
}

impl Run {
    fn kills(&self) -> u32 {
        self.kills.values().sum()
    }
}

/// The run as the fault injector sees it, every 50 ms.
struct Moment<'a> {
    dir: &'a Path,
    elapsed: Duration,
    /// The version the trainer has published (and the bus acknowledged) last.
    published: Option<u64>,
}

/// Kills a random replica every so often (kinds in a shuffled order, each twice, then at
/// random), until the last version is out.
struct Killer {
    rng: StdRng,
    every_ms: (u64, u64),
    plan: Vec<&'static str>,
    next: Duration,
    kills: BTreeMap<&'static str, u32>,
}

impl Killer {
    /// Kills every 3–9 s (`STREAMRL_CHAOS_EVERY_MS` overrides), sped up as much as needed
    /// for `min_kills` (with a margin) to fit in `expected` (the fault-free run's time).
    fn new(mut rng: StdRng, min_kills: u32, expected: Duration) -> Killer {
        let every_ms = std::env::var("STREAMRL_CHAOS_EVERY_MS")
            .ok()
            .and_then(|v| v.split_once('-').map(|(a, b)| (a.parse().unwrap(), b.parse().unwrap())))
            .unwrap_or_else(|| {
                let (lo, hi) = (3000.0, 9000.0);
                let mean_needed = expected.as_secs_f64() * 1000.0 / (min_kills as f64 * 1.15);
                let scale = (mean_needed / ((lo + hi) / 2.0)).min(1.0);
                ((lo * scale) as u64, (hi * scale) as u64)
            });
        eprintln!("chaos: a SIGKILL every {}–{} ms", every_ms.0, every_ms.1);
        let mut plan: Vec<&'static str> = KINDS.iter().chain(KINDS.iter()).copied().collect();
        plan.shuffle(&mut rng);
        let first = Duration::from_millis(rng.random_range(every_ms.0..=every_ms.1) + 5000);
        Killer {
            rng,
            every_ms,
            plan,
            next: first,
            kills: BTreeMap::new(),
        }
    }

    fn at(&mut self, m: &Moment, max_steps: u64) {
        if m.published == Some(max_steps) || m.elapsed < self.next {
            return;
        }
        self.next = m.elapsed + Duration::from_millis(self.rng.random_range(self.every_ms.0..=self.every_ms.1));
        let Ok(text) = std::fs::read_to_string(m.dir.join("run/up.json")) else {
            return;
        };
        let state: serde_json::Value = serde_json::from_str(&text).unwrap();
        let running: Vec<(String, u64)> = state["replicas"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect();
        let kind_of = |instance: &str| KINDS.iter().copied().find(|k| instance.starts_with(&format!("{k}-")));
        // The planned kind if one of its replicas runs, else any running replica.
        let want = self.plan.last().copied();
        let candidates: Vec<&(String, u64)> = running
            .iter()
            .filter(|(i, _)| want.is_none_or(|w| kind_of(i) == Some(w)))
            .collect();
        let pick = if candidates.is_empty() {
            running.get(self.rng.random_range(0..running.len().max(1)))
        } else {
            Some(candidates[self.rng.random_range(0..candidates.len())])
        };
        let Some((instance, pid)) = pick else { return };
        let kind = kind_of(instance).unwrap();
        let killed = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap()
            .success();
        if killed {
            eprintln!(
                "chaos: SIGKILL {instance} (pid {pid}) at {:.1} s",
                m.elapsed.as_secs_f64()
            );
            *self.kills.entry(kind).or_default() += 1;
            if want == Some(kind) {
                self.plan.pop();
            }
        }
    }
}

/// `streamrl up` of a fresh run on `bus`, calling `faults` every 50 ms until it ends.
fn run(bus: &str, shape: Shape, mut faults: impl FnMut(&Moment)) -> Run {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("topology.yaml"), topology(bus, shape)).unwrap();
    let t0 = Instant::now();
    let mut up = spawn_up(dir.path());
    let deadline = Instant::now() + Duration::from_secs(1500);
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            // Not left running for the tests after this one (its replicas die with it).
            let _ = up.kill();
            let _ = up.wait();
            panic!(
                "the run did not finish within 25 minutes (a hang, not a slow run: the SIGKILL runs take 3-5 minutes here, the broker-restart run under one)"
            );
        }
        let published = std::fs::read_to_string(dir.path().join("run/checkpoints/published"))
            .ok()
            .and_then(|v| v.trim().parse().ok());
        faults(&Moment {
            dir: dir.path(),
            elapsed: t0.elapsed(),
            published,
        });
        std::thread::sleep(Duration::from_millis(50));
    };
    let wall = t0.elapsed().as_secs_f64();
    let out = up.wait_with_output().unwrap();
    let mut up_log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    up_log.push_str(&failed_replica_logs(dir.path(), &up_log));
    assert!(status.success(), "streamrl up failed ({status}):\n{up_log}");
    let dir = if std::env::var_os("STREAMRL_CHAOS_KEEP").is_some() {
        eprintln!("chaos: run kept in {}", dir.path().display());
        Dir::Kept(dir.keep())
    } else {
        Dir::Temp(dir)
    };
    Run {
        dir,
        wall,
        kills: BTreeMap::new(),
        up_log,
    }
}

/// The last lines of the log of each replica that `up` saw exit with an error (a replica
/// it restarted without a SIGKILL from the test has a cause worth reading in a failure).
fn failed_replica_logs(dir: &Path, up_log: &str) -> String {
    let failed: BTreeSet<&str> = up_log
        .lines()
        .filter(|l| l.contains("exited with status"))
        .filter_map(|l| l.strip_prefix("up: ")?.split_whitespace().next())
        .collect();
    log_tails(dir, failed)
}

/// The last 150 lines of the logs of `instances` (`rollout-0`, …) in the run of `dir`.
fn log_tails<'a>(dir: &Path, instances: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = String::new();
    for instance in instances {
        let path = dir.join("run/logs").join(format!("{instance}.log"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| format!("({}: {e})", path.display()));
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(150)..];
        out.push_str(&format!(
            "\n--- last {} lines of {} ---\n{}\n",
            tail.len(),
            path.display(),
            tail.join("\n")
        ));
    }
    out
}

fn number(dir: &Path, sql: &str) -> i64 {
    let v = query(dir, sql);
    v.first()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{sql}: expected one number, got {v:?}"))
}

/// (invariant, measured, holds) for a finished run. With `copies` (a producer without
/// idempotence, whose retries after a broker restart may write a record twice), a
/// byte-identical copy of a record (same `created_at`, written by the transport, not
/// re-sent by a stage) is counted and reported instead of breaking the invariants.
fn invariants(r: &Run, shape: Shape, copies: Copies) -> Vec<(String, String, bool)> {
    let max_steps = shape.max_steps;
    let d = r.dir.path();
    let mut v = Vec::new();
    let top = number(d, "SELECT max(version) FROM policy");
    v.push((
        format!("target step {max_steps} reached"),
        format!("max version {top}"),
        top == max_steps as i64,
    ));
    // Transport copies: records of a topic beyond its distinct (payload, created_at).
    let mut transport_copies = 0;
    let mut copies_of = |topic: &str, key: &str| -> i64 {
        let n = number(
            d,
            &format!(
                "SELECT count(*) - (SELECT count(*) FROM (SELECT DISTINCT {key}, created_at FROM {topic})) FROM {topic}"
            ),
        );
        transport_copies += n;
        n
    };
    let policy_copies = copies_of("policy", "version");
    let trained_copies = copies_of("trained", "version, group_id, sample_id, outcome");
    let prompt_copies = copies_of("prompts", "group_id");
    let (n, distinct) = (
        number(
            d,
            "SELECT count(*) FROM (SELECT DISTINCT version, created_at FROM policy)",
        ),
        number(d, "SELECT count(DISTINCT version) FROM policy"),
    );
    let ordered = query(
        d,
        "SELECT DISTINCT version, created_at FROM policy ORDER BY created_at, version",
    )
    .iter()
    .map(|row| row.split(',').next().unwrap().parse::<i64>().unwrap())
    .collect::<Vec<_>>()
    .windows(2)
    .all(|w| w[0] < w[1]);
    v.push((
        "each version published once, in order".into(),
        format!("{n} publications, {distinct} versions, in order: {ordered}"),
        n == distinct && distinct == max_steps as i64 + 1 && ordered,
    ));
    v.push((
        "no transport copies (idempotent producers)".into(),
        format!("{transport_copies} (policy {policy_copies}, trained {trained_copies}, prompts {prompt_copies})"),
        copies == Copies::Possible || transport_copies == 0,
    ));
    let twice = number(
        d,
        "SELECT count(*) FROM (SELECT sample_id FROM trained WHERE outcome = 'trained' \
         GROUP BY sample_id HAVING count(DISTINCT version) > 1)",
    );
    let trained = number(
        d,
        "SELECT count(DISTINCT sample_id) FROM trained WHERE outcome = 'trained'",
    );
    v.push((
        "no sample trained twice".into(),
        format!("{trained} trained, {twice} twice"),
        twice == 0 && trained > 0,
    ));
    // Exact lineage: one row per sample a version consumed, whatever was killed when.
    let rows = number(
        d,
        "SELECT count(*) FROM (SELECT DISTINCT version, sample_id, outcome, created_at FROM trained \
         WHERE outcome IN ('trained', 'filtered', 'stale'))",
    );
    let distinct_rows = number(
        d,
        "SELECT count(*) FROM (SELECT DISTINCT version, sample_id FROM trained \
         WHERE outcome IN ('trained', 'filtered', 'stale'))",
    );
    v.push((
        "lineage: each consumed sample recorded once".into(),
        format!("{rows} rows, {distinct_rows} distinct (version, sample)"),
        rows == distinct_rows,
    ));
    let admitted = number(d, "SELECT count(DISTINCT group_id) FROM prompts");
    let unaccounted = number(
        d,
        "SELECT count(DISTINCT p.group_id) FROM prompts p LEFT JOIN trained t ON t.group_id = p.group_id \
         WHERE t.group_id IS NULL",
    );
    let reasons = query(
        d,
        "SELECT outcome, count(*) FROM trained GROUP BY outcome ORDER BY outcome",
    )
    .join(" ");
    v.push((
        "every admitted group trained or dropped with a reason".into(),
        format!("{admitted} admitted, {unaccounted} unaccounted; {reasons}"),
        unaccounted == 0 && admitted == (max_steps * shape.groups_per_step) as i64,
    ));
    // A group a step stopped waiting for: named once, and consumed (if it came) only by
    // a later version than the one trained without it.
    let timed_out = number(d, "SELECT count(*) FROM trained WHERE outcome = 'timed_out'");
    let timed_out_rows = number(
        d,
        "SELECT count(*) FROM (SELECT DISTINCT group_id, created_at FROM trained WHERE outcome = 'timed_out')",
    );
    let timed_out_groups = number(
        d,
        "SELECT count(DISTINCT group_id) FROM trained WHERE outcome = 'timed_out' AND group_id <> ''",
    );
    let came_later = number(
        d,
        "SELECT count(DISTINCT t.group_id) FROM trained t JOIN trained s ON s.group_id = t.group_id \
         WHERE t.outcome = 'timed_out' AND s.outcome <> 'timed_out'",
    );
    let too_early = number(
        d,
        "SELECT count(*) FROM trained t JOIN trained s ON s.group_id = t.group_id \
         WHERE t.outcome = 'timed_out' AND s.outcome IN ('trained', 'filtered', 'stale') AND s.version <= t.version",
    );
    v.push((
        "timed-out groups named once, consumed only later".into(),
        format!(
            "{timed_out_groups} groups ({timed_out} rows), {came_later} came later, {too_early} consumed too early"
        ),
        timed_out_rows == timed_out_groups && too_early == 0,
    ));
    let missing = number(
        d,
        "SELECT count(*) FROM trained t LEFT JOIN samples s \
         ON s.sample_id = t.sample_id AND s.created_at = t.sample_created_at \
         WHERE t.outcome = 'trained' AND s.sample_id IS NULL",
    );
    v.push((
        "every trained sample (the very copy) archived".into(),
        format!("{missing} missing"),
        missing == 0,
    ));
    let resent = number(
        d,
        "SELECT count(*) - count(DISTINCT group_id) FROM (SELECT DISTINCT group_id, created_at FROM prompts)",
    );
    let source_kills = r.kills.get("source").copied().unwrap_or(0) as i64;
    let bound = source_kills * ((MAX_ASYNC_LEVEL + 1) * shape.groups_per_step) as i64;
    v.push((
        "groups re-sent after source restarts ≤ in flight".into(),
        format!("{resent} re-sent, bound {bound} ({source_kills} source kills)"),
        resent <= bound,
    ));
    let dead = if d.join("run/archive/dead_letter").exists() {
        number(d, "SELECT count(*) FROM dead_letter")
    } else {
        0
    };
    v.push(("no dead letters".into(), format!("{dead}"), dead == 0));
    v
}

/// Prints a run's title (wall time, kills) and invariant table on the process's stderr
/// itself, past libtest's output capture, so that CI logs show them for passing tests.
fn print_table(title: &str, rows: &[(String, String, bool)]) {
    use std::io::Write as _;
    let mut text = format!("\n{title}\n{:<56} {:<6} measured\n", "invariant", "holds");
    for (name, measured, ok) in rows {
        text.push_str(&format!(
            "{name:<56} {:<6} {measured}\n",
            if *ok { "yes" } else { "NO" }
        ));
    }
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

#[test]
fn rl_loop_as_processes_survives_random_sigkills() {
    let max_steps: u64 = env_or("STREAMRL_CHAOS_STEPS", 700);
    let shape = Shape {
        max_steps,
        groups_per_step: 8,
        group_size: 8,
        limits: Limits::Tight,
    };
    let min_kills: u32 = env_or("STREAMRL_CHAOS_KILLS", 20);
    let seed: u64 = env_or(
        "STREAMRL_CHAOS_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
    );
    eprintln!("chaos: seed {seed} (STREAMRL_CHAOS_SEED), {max_steps} steps, at least {min_kills} kills");
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let rng = StdRng::seed_from_u64(seed);

    // A 1 s session timeout: a SIGKILLed replica's partitions move within ~1 s.
    let session_ms: u64 = env_or("STREAMRL_CHAOS_SESSION_MS", 1000);
    let url = |b: &common::Broker| format!("{}?session_timeout_ms={session_ms}", b.url);
    let broker = common::Broker::start();
    let control = run(&url(&broker), shape, |_| {});
    drop(broker);
    let control_rows = invariants(&control, shape, Copies::Never);
    print_table(
        &format!("control run (no faults): {:.1} s", control.wall),
        &control_rows,
    );

    let broker = common::Broker::start();
    let mut killer = Killer::new(rng, min_kills, Duration::from_secs_f64(control.wall));
    let mut chaos = run(&url(&broker), shape, |m| killer.at(m, max_steps));
    drop(broker);
    chaos.kills = killer.kills;
    let mut chaos_rows = invariants(&chaos, shape, Copies::Never);
    // The paths the tight limits are there for, reached while processes died.
    let outcomes: BTreeMap<String, i64> = query(
        chaos.dir.path(),
        "SELECT outcome, count(*) FROM trained GROUP BY outcome",
    )
    .iter()
    .filter_map(|row| {
        let (k, n) = row.split_once(',')?;
        Some((k.to_string(), n.parse().ok()?))
    })
    .collect();
    let reached = |k: &str| outcomes.get(k).copied().unwrap_or(0);
    chaos_rows.push((
        "paths reached: superseded, stale, timed out".into(),
        format!(
            "superseded {}, stale {}, timed_out {}, duplicate {}",
            reached("superseded"),
            reached("stale"),
            reached("timed_out"),
            reached("duplicate")
        ),
        reached("superseded") > 0 && reached("stale") > 0 && reached("timed_out") > 0,
    ));
    let restarts = chaos.up_log.matches("restarting in").count();
    print_table(
        &format!(
            "chaos run: {:.1} s ({:.2}× the control run), {} SIGKILLs {:?}, {restarts} restarts by `up`",
            chaos.wall,
            chaos.wall / control.wall,
            chaos.kills(),
            chaos.kills
        ),
        &chaos_rows,
    );
    for (name, measured, ok) in control_rows.iter().chain(&chaos_rows) {
        assert!(ok, "invariant broken: {name}: {measured}\n{}", chaos.up_log);
    }
    // Recovery: a SIGKILL every ~6 s costs the run at most half its time again.
    let ratio = chaos.wall / control.wall;
    assert!(
        ratio <= 1.5,
        "recovery too slow: the chaos run took {ratio:.2}× the control run ({:.1} s against {:.1} s, {} SIGKILLs); goal ≤ 1.5×",
        chaos.wall,
        control.wall,
        chaos.kills()
    );
    assert!(
        chaos.kills() >= min_kills,
        "the run ended after {} kills (want {min_kills}): raise STREAMRL_CHAOS_STEPS",
        chaos.kills()
    );
    for k in KINDS {
        assert!(
            chaos.kills.get(k).copied().unwrap_or(0) >= 2,
            "{k} was killed fewer than twice: {:?}",
            chaos.kills
        );
    }
}

/// The broker keeps its log in S3 (tansu's `s3://` engine on a local S3 server) and is
/// SIGKILLed a third of the way through the run, then started again 5 s later: every
/// stage pauses and resumes (no process restarts) and the run completes with the same
/// invariants. Producers run without idempotence here (`idempotence=false`): tansu's S3
/// engine records an idempotent batch's sequence number before it writes the batch, so a
/// broker killed in between loses a batch the producer's retry is then told it already
/// has (seen as a run stalled for want of one group, once in four runs). Without
/// idempotence the retry writes it again, and a byte-identical copy is counted apart.
#[test]
fn rl_loop_as_processes_rides_out_a_broker_restart() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // A broker whose log survives a restart: tansu's S3 engine on a local S3 server.
    let s3 = common::S3::start();
    let mut broker = common::Broker::start_persistent(&s3);
    let shape = Shape {
        max_steps: env_or("STREAMRL_RESTART_STEPS", 12),
        groups_per_step: 2,
        group_size: 4,
        limits: Limits::Roomy,
    };
    // Without idempotence: tansu's S3 engine loses an acknowledged batch when it is killed
    // mid-produce under an idempotent producer (see the `idempotence` parameter in
    // runtime/src/bus/kafka.rs); a plain producer's retry writes it again instead.
    // The default session timeout (6 s): no replica dies here, so nothing gains from
    // noticing a dead one sooner, and the S3 engine answers a heartbeat slowly (one S3
    // round trip each, to a Python S3 server on 2 busy cores). With a 1 s timeout,
    // heartbeats of the ~20 group members time out, members are expelled and rejoin in
    // a rebalance storm that starves consumers: seen as a run 4x slower, and once as an
    // archive that could not drain its inputs within a minute of the run's end.
    // Fetches held 500 ms instead of 50: tansu answers each fetch with an S3 query per
    // partition, and ~20 consumers polling every 50 ms kept the S3 server (Python, on the
    // same 2 cores) at ~75% of a core: the run took 830-1150 s, 70-95 s a step.
    let url = format!(
        "{}?idempotence=false&session_timeout_ms={}&fetch_wait_ms={}",
        broker.url,
        env_or::<u64>("STREAMRL_RESTART_SESSION_MS", 6000),
        env_or::<u64>("STREAMRL_RESTART_FETCH_WAIT_MS", 500)
    );
    let mut restarted_at = None;
    // (when the broker came back, when the next version was published after it).
    let mut back: Option<(Duration, Option<Duration>)> = None;
    let r = run(&url, shape, |m| {
        if restarted_at.is_none() && m.published.is_some_and(|v| v >= shape.max_steps / 3) {
            eprintln!(
                "broker restart: SIGKILL at version {:?}, {:.1} s",
                m.published,
                m.elapsed.as_secs_f64()
            );
            broker.restart(Duration::from_secs(5));
            restarted_at = m.published;
            back = Some((m.elapsed + Duration::from_secs(5), None));
        }
        if let Some((_, next @ None)) = &mut back
            && m.published > restarted_at
        {
            *next = Some(m.elapsed);
        }
    });
    assert!(restarted_at.is_some(), "the run ended before the broker was restarted");
    let (back_at, next) = back.unwrap();
    let resumed = next.map_or("never".into(), |n| {
        format!("{:.1} s", (n.saturating_sub(back_at)).as_secs_f64())
    });
    let rows = invariants(&r, shape, Copies::Possible);
    let restarts = r.up_log.matches("restarting in").count();
    print_table(
        &format!(
            "broker restarted (5 s down) at version {}: next version {resumed} after it was back; run {:.1} s, {restarts} stage restarts by `up`",
            restarted_at.unwrap(),
            r.wall
        ),
        &rows,
    );
    for (name, measured, ok) in &rows {
        assert!(ok, "invariant broken: {name}: {measured}\n{}", r.up_log);
    }
    assert_eq!(
        restarts, 0,
        "a broker outage pauses stages, it must not kill them:\n{}",
        r.up_log
    );
}

/// A `streamrl up` started in `dir` (its output piped).
fn spawn_up(dir: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .arg("up")
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for `up` to exit (at most `within`); its status and its output.
fn wait_up(mut up: std::process::Child, within: Duration) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + within;
    while up.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = up.kill();
            let out = up.wait_with_output().unwrap();
            panic!(
                "`streamrl up` did not exit within {within:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = up.wait_with_output().unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, log)
}

/// `streamrl down` mid-run: every replica finishes its message in hand, commits and exits
/// 0 (each says so in its log), `up` exits 0 and removes `up.json`, and `down` returns
/// once the supervisor is gone (also when the supervisor's parent, as here, has not yet
/// reaped it: an exited process stays in `/proc` as a zombie until then).
#[test]
fn down_stops_every_replica_cleanly() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let broker = common::Broker::start();
    let shape = Shape {
        max_steps: 12,
        groups_per_step: 2,
        group_size: 4,
        limits: Limits::Roomy,
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("topology.yaml"), topology(&broker.url, shape)).unwrap();
    let t0 = Instant::now();
    let mut up = spawn_up(dir.path());
    let published = || {
        std::fs::read_to_string(dir.path().join("run/checkpoints/published"))
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(600);
    while published().is_none_or(|v| v < 3) {
        assert!(
            up.try_wait().unwrap().is_none(),
            "`up` ended before version 3: {:?}",
            up.wait_with_output()
        );
        assert!(
            Instant::now() < deadline,
            "version 3 was not published within 10 minutes"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let at = published().unwrap();
    let down = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .arg("down")
        .current_dir(dir.path())
        .output()
        .unwrap();
    let down_log = String::from_utf8_lossy(&down.stderr).to_string();
    if !down.status.success() {
        let _ = up.kill();
        let out = up.wait_with_output().unwrap();
        let up_log = String::from_utf8_lossy(&out.stderr).to_string();
        let mut instances: Vec<String> = std::fs::read_dir(dir.path().join("run/logs"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| Some(e.file_name().to_str()?.strip_suffix(".log")?.to_string()))
            .collect();
        instances.sort();
        let logs = log_tails(dir.path(), instances.iter().map(String::as_str));
        panic!("`streamrl down` failed: {down_log}\nup:\n{up_log}{logs}");
    }
    let (status, first_log) = wait_up(up, Duration::from_secs(120));
    assert!(status.success(), "`up` after `down` ({status}):\n{first_log}");
    let replicas = first_log
        .lines()
        .find_map(|l| {
            l.strip_prefix("up: ")?
                .split_once(" replica(s)")?
                .0
                .parse::<usize>()
                .ok()
        })
        .unwrap_or_else(|| panic!("no replica count in:\n{first_log}"));
    let stopped: Vec<&str> = first_log.lines().filter(|l| l.contains(" stopped (")).collect();
    assert_eq!(stopped.len(), replicas, "{first_log}");
    assert!(
        stopped.iter().all(|l| l.ends_with("stopped (exited with status 0)")),
        "{first_log}"
    );
    assert!(first_log.contains("up: stopped: every replica exited 0"), "{first_log}");
    assert!(
        down_log.contains(&format!("down: stopped {replicas} replica(s)")),
        "{down_log}"
    );
    assert!(
        !dir.path().join("run/up.json").exists(),
        "up.json outlived the supervisor"
    );
    for l in first_log
        .lines()
        .filter_map(|l| l.strip_prefix("up: ")?.strip_suffix(" stopped (exited with status 0)"))
    {
        let log = std::fs::read_to_string(dir.path().join("run/logs").join(format!("{l}.log"))).unwrap();
        assert!(
            log.contains("stopped cleanly"),
            "{l} did not say it stopped cleanly:\n{log}"
        );
    }
    let line = format!(
        "\n`streamrl down` at version {at}, {:.1} s into the run: {replicas} replicas exited 0\n",
        t0.elapsed().as_secs_f64()
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}

/// A replica that fails by itself right after starting (a rollout pointed at a checkpoint
/// that is not there) is restarted with a growing backoff; after 5 such failures in a row
/// `up` stops the others and exits non-zero, printing the replica's own error.
#[test]
fn up_gives_up_on_a_replica_that_keeps_failing_and_says_why() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let broker = common::Broker::start();
    let shape = Shape {
        max_steps: 2,
        groups_per_step: 2,
        group_size: 4,
        limits: Limits::Roomy,
    };
    let dir = tempfile::tempdir().unwrap();
    let yaml = topology(&broker.url, shape).replace(
        "checkpoint: run/sft, max_inflight_groups",
        "checkpoint: run/no-such-checkpoint, max_inflight_groups",
    );
    assert!(yaml.contains("run/no-such-checkpoint"), "{yaml}");
    std::fs::write(dir.path().join("topology.yaml"), yaml).unwrap();
    let (status, log) = wait_up(spawn_up(dir.path()), Duration::from_secs(300));
    assert!(!status.success(), "{log}");
    let gave_up = log
        .lines()
        .find(|l| l.contains("failed 5 times in a row"))
        .unwrap_or_else(|| panic!("no give-up line:\n{log}"));
    assert!(gave_up.starts_with("error: up: rollout-"), "{gave_up}");
    assert!(
        gave_up.contains("no-such-checkpoint"),
        "the replica's own error is printed: {gave_up}"
    );
    assert!(log.matches("restarting in").count() >= 4, "{log}");
    assert!(log.contains(" stopped ("), "the other replicas are stopped: {log}");
    assert!(!dir.path().join("run/up.json").exists());
}

/// `streamrl soak` in small (`STREAMRL_SOAK_MINUTES`, default 5): `up` of an endless run
/// with a SIGKILL of a random replica every ~30 s; every stage's resident memory, open
/// files and threads, the consumers' lag and the archive's files show no growth beyond
/// noise after the first quarter, and the soak writes its samples and plot.
#[test]
fn a_soak_with_sigkills_keeps_memory_files_threads_and_lag_flat() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let broker = common::Broker::start();
    let minutes: f64 = env_or("STREAMRL_SOAK_MINUTES", 5.0);
    let shape = Shape {
        max_steps: 1_000_000,
        groups_per_step: 8,
        group_size: 8,
        limits: Limits::Roomy,
    };
    let dir = tempfile::tempdir().unwrap();
    let url = format!("{}?session_timeout_ms=1000", broker.url);
    std::fs::write(dir.path().join("topology.yaml"), topology(&url, shape)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["soak", "--kill-every", "30", "--sample-every", "5", "--seed", "1"])
        .args(["--minutes", &minutes.to_string(), "--out", "soak"])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    let table: String = log
        .lines()
        .filter(|l| !l.starts_with("soak: SIGKILL"))
        .map(|l| format!("{l}\n"))
        .collect();
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), table.as_bytes());
    let up_log = std::fs::read_to_string(dir.path().join("soak/up.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "soak failed ({}):\n{log}\nup:\n{up_log}{}",
        out.status,
        failed_replica_logs(dir.path(), &up_log)
    );
    assert!(log.contains("soak: no growth beyond noise"), "{log}");
    let kills = log.matches("soak: SIGKILL").count();
    assert!(kills as f64 >= minutes, "{kills} SIGKILLs in {minutes} min:\n{log}");
    let csv = std::fs::read_to_string(dir.path().join("soak/soak.csv")).unwrap();
    for series in ["rss_mib/trainer", "fds/rollout", "threads/up", "lag", "archive_files"] {
        assert!(csv.contains(&format!(",{series},")), "no {series} in soak.csv");
    }
    let png = std::fs::read(dir.path().join("soak/soak.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "soak.png is not a PNG");
}

//! `streamrl soak`: `streamrl up` of a topology on a Kafka bus for a set time, with a
//! SIGKILL of a random replica every so often, sampling what a long run must keep flat:
//! each stage's resident memory, open files and threads (from `/proc`, summed over its
//! replicas, the supervisor as `up`), the consumers' total lag on the bus, and the number
//! of Parquet files of the archive's largest topic. Writes `soak.csv` (one row per sample
//! and series) and a plot (`soak.svg`, `soak.png`), prints a table with a verdict per
//! series, and exits non-zero on growth, when `up` fails, or when the run ends before the
//! time is up (raise its `max_steps` with `--set`).
//!
//! A series grows when, after the warm-up (`--warmup`, a fraction of the soak), the least
//! squares line through it rises over the judged span by more than twice the scatter of
//! the samples around that line, more than `--tolerance` of its median, and more than a
//! floor per kind (16 MiB, 8 files, 4 threads, 50 messages of lag, 16 archive files):
//! a restarted replica's memory climbing back after a kill is scatter, not a trend.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rustix::process::Signal;
use streamrl_runtime::bus::{self, Bus};
use streamrl_runtime::topology::Topology;

use crate::report::plot::Scene;

/// `streamrl soak`.
#[derive(clap::Args)]
pub struct SoakArgs {
    /// Topology file.
    #[arg(short, long, default_value = "topology.yaml")]
    topology: PathBuf,
    /// Bus URL (overrides the topology's; `up` needs kafka://).
    #[arg(long, env = "STREAMRL_BUS")]
    bus: Option<String>,
    /// How long `up` runs, in minutes.
    #[arg(long, default_value_t = 120.0)]
    minutes: f64,
    /// Mean seconds between SIGKILLs of a random replica (each wait drawn from half to
    /// one and a half times it; 0: no kills).
    #[arg(long, default_value_t = 60.0)]
    kill_every: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 10.0)]
    sample_every: f64,
    /// The first part of the soak left out of the verdicts (a fraction of it).
    #[arg(long, default_value_t = 0.25)]
    warmup: f64,
    /// Growth over the judged span below this fraction of a series' median is flat.
    #[arg(long, default_value_t = 0.10)]
    tolerance: f64,
    /// Where soak.csv, soak.svg, soak.png and up.log go [default: <run_dir>/soak].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seed of the kills' timing and victims [default: the clock].
    #[arg(long)]
    seed: Option<u64>,
}

/// One sample: seconds since the start, then value by series name.
type Sample = (f64, BTreeMap<String, f64>);

/// What a soak found about one series.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Series name (`rss_mib/<stage>`, `fds/<stage>`, `threads/<stage>`, `lag`,
    /// `archive_files`).
    pub series: String,
    /// Median over the judged span.
    pub median: f64,
    /// The fitted line's rise over the judged span.
    pub rise: f64,
    /// Scatter of the judged samples around the line (standard deviation).
    pub noise: f64,
    /// What a rise must exceed to count as growth.
    pub allowed: f64,
    /// Whether the series grows.
    pub grows: bool,
}

/// The least squares line through `pts`: (slope, intercept).
fn fit(pts: &[(f64, f64)]) -> (f64, f64) {
    let n = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (slope, my - slope * mx)
}

/// The floor a series' rise must exceed, by its kind.
fn floor(series: &str) -> f64 {
    match series.split('/').next().unwrap_or(series) {
        "rss_mib" => 16.0,
        "fds" => 8.0,
        "threads" => 4.0,
        "lag" => 50.0,
        _ => 16.0,
    }
}

/// Judges `pts` (time, value) of `series` from `from` seconds on (see the module docs);
/// `None` with fewer than 5 samples there.
pub fn judge(series: &str, pts: &[(f64, f64)], from: f64, tolerance: f64) -> Option<Verdict> {
    let judged: Vec<(f64, f64)> = pts.iter().copied().filter(|p| p.0 >= from && p.1.is_finite()).collect();
    if judged.len() < 5 {
        return None;
    }
    let (slope, intercept) = fit(&judged);
    let span = judged.last().unwrap().0 - judged[0].0;
    let rise = slope * span;
    let n = judged.len() as f64;
    let noise = (judged
        .iter()
        .map(|p| (p.1 - (intercept + slope * p.0)).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    let mut values: Vec<f64> = judged.iter().map(|p| p.1).collect();
    values.sort_by(f64::total_cmp);
    let median = values[values.len() / 2];
    let allowed = (2.0 * noise).max(tolerance * median.abs()).max(floor(series));
    Some(Verdict {
        series: series.to_string(),
        median,
        rise,
        noise,
        allowed,
        grows: rise > allowed,
    })
}

/// (resident MiB, open files, threads) of process `pid`, or `None` once it is gone.
fn process_usage(pid: u32) -> Option<(f64, f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<f64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let rss_kib = field("VmRSS:")?;
    let threads = field("Threads:")?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as f64;
    Some((rss_kib / 1024.0, fds, threads))
}

/// Parquet files under `dir`, by the topic directory (first level) that holds them.
fn parquet_files(dir: &Path) -> BTreeMap<String, usize> {
    fn walk(dir: &Path, topic: &str, out: &mut BTreeMap<String, usize>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                walk(&path, if topic.is_empty() { &name } else { topic }, out);
            } else if name.ends_with(".parquet") && !topic.is_empty() {
                *out.entry(topic.to_string()).or_default() += 1;
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, "", &mut out);
    out
}

/// The replicas `up` runs now (`stage-replica` → pid) and its own pid, from `up.json`.
fn running(run_dir: &Path) -> Option<(u32, BTreeMap<String, u32>)> {
    let text = std::fs::read_to_string(super::up::state_path(run_dir)).ok()?;
    let state: super::up::UpState = serde_json::from_str(&text).ok()?;
    Some((state.supervisor, state.replicas))
}

/// The consumers' lag summed over every topic a stage reads and every partition.
async fn total_lag(bus: &dyn Bus, t: &Topology) -> Option<f64> {
    let mut lag = 0u64;
    for name in t.topics.keys() {
        let groups = t.readers(name);
        if groups.is_empty() {
            continue;
        }
        for p in bus.topic_stats(name, &groups).await.ok()? {
            lag += groups.iter().filter_map(|g| p.lag(g)).sum::<u64>();
        }
    }
    Some(lag as f64)
}

/// One sample of everything the soak watches.
async fn sample(bus: &dyn Bus, t: &Topology) -> BTreeMap<String, f64> {
    let mut s = BTreeMap::new();
    if let Some((supervisor, replicas)) = running(&t.run_dir) {
        let procs =
            std::iter::once(("up".to_string(), supervisor)).chain(replicas.into_iter().map(|(instance, pid)| {
                let stage = instance
                    .rsplit_once('-')
                    .map_or(instance.clone(), |(s, _)| s.to_string());
                (stage, pid)
            }));
        for (stage, pid) in procs {
            if let Some((rss, fds, threads)) = process_usage(pid) {
                for (kind, v) in [("rss_mib", rss), ("fds", fds), ("threads", threads)] {
                    *s.entry(format!("{kind}/{stage}")).or_default() += v;
                    *s.entry(format!("{kind}/total")).or_default() += v;
                }
            }
        }
    }
    if let Some(lag) = total_lag(bus, t).await {
        s.insert("lag".into(), lag);
    }
    let files = parquet_files(&t.run_dir.join("archive"));
    s.insert(
        "archive_files".into(),
        files.values().copied().max().unwrap_or(0) as f64,
    );
    s
}

/// `streamrl soak`.
pub async fn run(a: SoakArgs) -> Result<()> {
    let mut t = super::load(&a.topology)?;
    if let Some(b) = &a.bus {
        t.bus = b.clone();
    }
    if a.minutes <= 0.0 || a.sample_every <= 0.0 || !(0.0..1.0).contains(&a.warmup) || a.kill_every < 0.0 {
        bail!(
            "soak: --minutes ({}) and --sample-every ({}) must be positive, --warmup ({}) in [0, 1), --kill-every ({}) not negative",
            a.minutes,
            a.sample_every,
            a.warmup,
            a.kill_every
        );
    }
    let out = a.out.clone().unwrap_or_else(|| t.run_dir.join("soak"));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let bus = bus::connect(&t.bus).await?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    });
    let mut rng = StdRng::seed_from_u64(seed);
    let log_path = out.join("up.log");
    let log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let mut up = Command::new(std::env::current_exe().context("locating the streamrl binary")?)
        .args(["up", "--topology"])
        .arg(&a.topology)
        .args(["--bus", &t.bus])
        .env("STREAMRL_SET", super::overrides().join("\n"))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting `streamrl up`")?;
    let total = Duration::from_secs_f64(a.minutes * 60.0);
    eprintln!(
        "soak: `streamrl up` of {} on {} for {:.1} min, a SIGKILL every ~{} s (seed {seed}), a sample every {} s; up's log in {}",
        a.topology.display(),
        t.bus,
        a.minutes,
        a.kill_every,
        a.sample_every,
        log_path.display()
    );
    let t0 = Instant::now();
    let next_kill = |rng: &mut StdRng, now: Duration| -> Option<Duration> {
        (a.kill_every > 0.0).then(|| now + Duration::from_secs_f64(a.kill_every * rng.random_range(0.5..1.5)))
    };
    let mut kill_at = next_kill(&mut rng, Duration::from_secs_f64(a.kill_every.min(60.0)));
    let mut sample_at = Duration::ZERO;
    let mut samples: Vec<Sample> = Vec::new();
    let mut kills = 0u32;
    let ended = loop {
        let now = t0.elapsed();
        if now >= total {
            break None;
        }
        if let Some(status) = up.try_wait()? {
            break Some(status);
        }
        if now >= sample_at {
            samples.push((now.as_secs_f64(), sample(bus.as_ref(), &t).await));
            sample_at = now + Duration::from_secs_f64(a.sample_every);
        }
        if kill_at.is_some_and(|k| now >= k) {
            if let Some((_, replicas)) = running(&t.run_dir)
                && !replicas.is_empty()
            {
                let (instance, pid) = replicas.iter().nth(rng.random_range(0..replicas.len())).unwrap();
                super::up::signal(*pid, Signal::KILL);
                kills += 1;
                eprintln!("soak: SIGKILL {instance} (pid {pid}) at {:.0} s", now.as_secs_f64());
            }
            kill_at = next_kill(&mut rng, now);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    if let Some(status) = ended {
        bail!(
            "soak: `streamrl up` ended after {:.0} s, before the soak's {:.1} min ({status}; raise the run's max_steps with --set, or see {})",
            t0.elapsed().as_secs_f64(),
            a.minutes,
            log_path.display()
        );
    }
    let stopped = stop(&mut up, &t.run_dir).await?;
    let verdicts = report(&samples, total.as_secs_f64() * a.warmup, a.tolerance);
    write_csv(&out.join("soak.csv"), &samples)?;
    let scene = plot(&samples);
    std::fs::write(out.join("soak.svg"), scene.to_svg())?;
    std::fs::write(out.join("soak.png"), scene.to_png())?;
    print_table(&verdicts, kills, samples.len(), a.minutes);
    eprintln!(
        "soak: plot in {}, samples in {}",
        out.join("soak.png").display(),
        out.join("soak.csv").display()
    );
    if !stopped.success() {
        bail!(
            "soak: `streamrl up` did not stop cleanly ({stopped}); see {}",
            log_path.display()
        );
    }
    let grown: Vec<&str> = verdicts.iter().filter(|v| v.grows).map(|v| v.series.as_str()).collect();
    if !grown.is_empty() {
        bail!("soak: growth beyond noise in {}", grown.join(", "));
    }
    eprintln!(
        "soak: no growth beyond noise in {} series over {:.1} min with {kills} SIGKILLs",
        verdicts.len(),
        a.minutes
    );
    Ok(())
}

/// `down` for the supervisor: SIGTERM, then waits for it (every replica finishes, commits
/// and exits); its exit status.
async fn stop(up: &mut Child, run_dir: &Path) -> Result<std::process::ExitStatus> {
    super::up::signal(up.id(), Signal::TERM);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = up.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            let _ = up.kill();
            let status = up.wait()?;
            let _ = std::fs::remove_file(super::up::state_path(run_dir));
            bail!("soak: `streamrl up` did not stop within 120 s of SIGTERM (killed: {status})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every series of `samples`, in name order, as (time, value) points.
fn series(samples: &[Sample]) -> BTreeMap<String, Vec<(f64, f64)>> {
    let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (t, s) in samples {
        for (k, v) in s {
            out.entry(k.clone()).or_default().push((*t, *v));
        }
    }
    out
}

/// A verdict for every series with enough samples after `from` seconds.
fn report(samples: &[Sample], from: f64, tolerance: f64) -> Vec<Verdict> {
    series(samples)
        .iter()
        .filter_map(|(name, pts)| judge(name, pts, from, tolerance))
        .collect()
}

fn write_csv(path: &Path, samples: &[Sample]) -> Result<()> {
    let mut text = String::from("seconds,series,value\n");
    for (t, s) in samples {
        for (k, v) in s {
            text.push_str(&format!("{t:.1},{k},{v}\n"));
        }
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn print_table(verdicts: &[Verdict], kills: u32, samples: usize, minutes: f64) {
    use std::io::Write as _;
    let mut text = format!(
        "\nsoak: {minutes:.1} min, {kills} SIGKILLs, {samples} samples; after the warm-up:\n{:<22} {:>10} {:>10} {:>10} {:>10}  verdict\n",
        "series", "median", "rise", "noise", "allowed"
    );
    for v in verdicts {
        text.push_str(&format!(
            "{:<22} {:>10.1} {:>10.1} {:>10.1} {:>10.1}  {}\n",
            v.series,
            v.median,
            v.rise,
            v.noise,
            v.allowed,
            if v.grows { "GROWS" } else { "flat" }
        ));
    }
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// Five charts stacked: resident memory, open files and threads of all processes, the
/// consumers' lag, and the archive's largest topic's files, against minutes.
fn plot(samples: &[Sample]) -> Scene {
    let all = series(samples);
    let minutes = |name: &str| -> Vec<(f64, f64)> {
        all.get(name)
            .map(|v| v.iter().map(|(t, y)| (t / 60.0, *y)).collect())
            .unwrap_or_default()
    };
    let charts = [
        ("resident memory, all processes (MiB) against minutes", "rss_mib/total"),
        ("open files, all processes", "fds/total"),
        ("threads, all processes", "threads/total"),
        ("consumer lag (messages)", "lag"),
        ("archive: Parquet files of the largest topic", "archive_files"),
    ];
    Scene::stacked(
        charts
            .iter()
            .map(|(title, name)| crate::report::chart(title, &vec![(name.to_string(), minutes(name))], false))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sawtooth_is_flat_and_a_ramp_grows() {
        // Memory that climbs back after each kill: scatter around a flat line.
        let saw: Vec<(f64, f64)> = (0..120)
            .map(|i| (i as f64, 500.0 + 40.0 * ((i % 12) as f64 / 12.0)))
            .collect();
        let v = judge("rss_mib/rollout", &saw, 30.0, 0.1).unwrap();
        assert!(!v.grows, "{v:?}");
        // The same with a leak of 1 MiB a sample: 90 MiB over the judged span.
        let leak: Vec<(f64, f64)> = saw.iter().map(|&(t, y)| (t, y + t)).collect();
        let v = judge("rss_mib/rollout", &leak, 30.0, 0.1).unwrap();
        assert!(v.grows, "{v:?}");
        assert!((v.rise - 89.0).abs() < 3.0, "{v:?}");
        // Small absolute wobbles stay under the floor.
        let lag: Vec<(f64, f64)> = (0..50).map(|i| (i as f64, (i / 5) as f64)).collect();
        assert!(!judge("lag", &lag, 0.0, 0.1).unwrap().grows);
        // Too few samples after the warm-up: no verdict.
        assert_eq!(judge("lag", &lag[..8], 4.0, 0.1), None);
    }

    #[test]
    fn parquet_files_are_counted_per_topic() {
        let d = tempfile::tempdir().unwrap();
        for (dir, name) in [
            ("samples/w1", "a.parquet"),
            ("samples/w1", "b.parquet"),
            ("samples", ".compact-x.tmp"),
            ("policy", "c.parquet"),
        ] {
            std::fs::create_dir_all(d.path().join(dir)).unwrap();
            std::fs::write(d.path().join(dir).join(name), b"").unwrap();
        }
        let n = parquet_files(d.path());
        assert_eq!(n.get("samples"), Some(&2));
        assert_eq!(n.get("policy"), Some(&1));
    }
}

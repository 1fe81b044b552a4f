//! `streamrl bench sandbox`: latency of one small command through the warm sandbox pool
//! against a bare fork+exec of the same command, at two concurrencies, in one process.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use streamrl_sandbox::{ExecRequest, ExecStatus, Pool, SandboxConfig};

use super::stats::{median, percentile};

struct Run {
    p50: f64,
    p99: f64,
    /// Mean latency. In a closed loop at saturation it is concurrency ÷ throughput; the
    /// p50 also depends on how evenly the scheduler shares the CPUs between commands.
    mean: f64,
    per_sec: f64,
    /// CPU time the whole machine spent per exec (user + nice + system, from /proc/stat):
    /// the cost of a command independent of how the scheduler orders 64 of them.
    cpu_ms: f64,
}

/// CPU time spent by the whole machine so far, ms (0 where /proc/stat cannot be read).
fn machine_cpu_ms() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let ticks: u64 = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .take(3)
        .filter_map(|v| v.parse::<u64>().ok())
        .sum();
    // USER_HZ is 100 on Linux.
    ticks as f64 * 10.0
}

/// The middle value (the upper one of an even count).
/// Each column's median over rounds.
fn median_run(runs: &[Run]) -> Run {
    let med = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
    Run {
        p50: med(|r| r.p50),
        mean: med(|r| r.mean),
        p99: med(|r| r.p99),
        per_sec: med(|r| r.per_sec),
        cpu_ms: med(|r| r.cpu_ms),
    }
}

/// Latencies (ms) of `n` calls of `f` at a steady concurrency of `conc`.
///
/// `conc` threads claim calls from one counter until `conc + n + conc` have been made, and
/// only the middle `n` are recorded: the first `conc` fill the machine, the last `conc`
/// keep it full while the recorded ones finish. Without them the final calls run as the
/// others drain, at falling concurrency, and a fixed count per thread rewards a scheduler
/// that shares the CPUs unevenly (threads that finish early leave the stragglers the
/// whole machine).
fn measure(n: usize, conc: usize, f: Arc<dyn Fn() -> Result<()> + Send + Sync>) -> Result<Run> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let total = conc + n + conc;
    let next = Arc::new(AtomicUsize::new(0));
    let cpu0 = machine_cpu_ms();
    let started = Instant::now();
    let handles: Vec<_> = (0..conc)
        .map(|_| {
            let (f, next) = (f.clone(), next.clone());
            std::thread::spawn(move || -> Result<Vec<f64>> {
                let mut lat = vec![];
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return Ok(lat);
                    }
                    let t = Instant::now();
                    f()?;
                    if (conc..conc + n).contains(&i) {
                        lat.push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
            })
        })
        .collect();
    let mut all = vec![];
    for h in handles {
        all.extend(h.join().map_err(|_| anyhow::anyhow!("bench thread panicked"))??);
    }
    let secs = started.elapsed().as_secs_f64();
    all.sort_by(f64::total_cmp);
    Ok(Run {
        p50: percentile(&all, 0.5),
        mean: all.iter().sum::<f64>() / all.len() as f64,
        p99: percentile(&all, 0.99),
        per_sec: total as f64 / secs,
        cpu_ms: (machine_cpu_ms() - cpu0) / total as f64,
    })
}

/// `rounds` pairs of rounds at concurrency `conc`: `argv` run bare, then in the sandbox
/// pool (refilled first); the bare rounds and the sandbox rounds.
fn alternating_rounds(
    pool: &Arc<Pool>,
    argv: &[String],
    n: usize,
    conc: usize,
    rounds: usize,
) -> Result<(Vec<Run>, Vec<Run>)> {
    let (mut bare_runs, mut sbx_runs) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let a = argv.to_vec();
        bare_runs.push(measure(
            n,
            conc,
            Arc::new(move || {
                let out = std::process::Command::new(&a[0]).args(&a[1..]).output()?;
                if out.stdout != b"1\n" {
                    bail!("bare run printed {:?}", String::from_utf8_lossy(&out.stdout));
                }
                Ok(())
            }),
        )?);
        // Let the pool refill before the sandbox half.
        while pool.ready() < pool.config().pool_size {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let (p, a) = (pool.clone(), argv.to_vec());
        sbx_runs.push(measure(
            n,
            conc,
            Arc::new(move || {
                let r = p.exec(&ExecRequest::new(a.clone()));
                if r.status != ExecStatus::Ok {
                    bail!("sandboxed run: {r:?}");
                }
                Ok(())
            }),
        )?);
    }
    Ok((bare_runs, sbx_runs))
}

pub fn run(n: usize, concurrency: Vec<usize>, pool_size: usize, python: String, rounds: usize) -> Result<()> {
    let pool = Arc::new(Pool::new(SandboxConfig {
        pool_size,
        ..SandboxConfig::default()
    })?);
    let argv = vec![python.clone(), "-c".to_string(), "print(1)".to_string()];
    let check = pool.exec(&ExecRequest::new(argv.clone()));
    if check.status != ExecStatus::Ok || check.stdout != "1\n" {
        bail!("the sandboxed command does not work: {check:?}");
    }
    println!(
        "streamrl bench sandbox: `{python} -c \"print(1)\"`, {n} execs recorded per round (at a steady concurrency), median of {rounds} alternating rounds, pool of {pool_size}"
    );
    println!(
        "{:<12} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>10} {:>11} {:>9}",
        "concurrency",
        "sbx p50 ms",
        "bare p50",
        "sbx p99 ms",
        "bare p99",
        "sbx mean",
        "bare mean",
        "sbx exec/s",
        "bare ex/s",
        "p50 +ms",
        "sbx cpu ms",
        "bare cpu"
    );
    let mut per_round = vec![];
    for conc in concurrency {
        // Alternating rounds, the median of each column: at high concurrency one round's
        // p50 is mostly the scheduler's mood on a small machine.
        let (bare_runs, sbx_runs) = alternating_rounds(&pool, &argv, n, conc, rounds)?;
        let (bare, sbx) = (median_run(&bare_runs), median_run(&sbx_runs));
        // Each round's gap against the bare round run just before it, then the median:
        // the VM's speed drifts over a run, and a pair seconds apart shares most of it.
        let gaps: Vec<f64> = sbx_runs.iter().zip(&bare_runs).map(|(s, b)| s.p50 - b.p50).collect();
        let paired_gap = median(gaps.clone());
        per_round.push(format!(
            "{conc}: {}",
            gaps.iter().map(|g| format!("{g:+.1}")).collect::<Vec<_>>().join(" ")
        ));
        println!(
            "{:<12} {:>11.2} {:>11.2} {:>11.2} {:>11.2} {:>11.2} {:>11.2} {:>11.1} {:>11.1} {:>+10.2} {:>11.2} {:>9.2}",
            conc,
            sbx.p50,
            bare.p50,
            sbx.p99,
            bare.p99,
            sbx.mean,
            bare.mean,
            sbx.per_sec,
            bare.per_sec,
            paired_gap,
            sbx.cpu_ms,
            bare.cpu_ms
        );
    }
    let s = pool.stats();
    println!(
        "pool: {} warm starts, {} cold starts (no sandbox was ready), {} start errors; goal: sandbox p50 ≤ bare p50 + 15 ms",
        s.warm_starts, s.cold_starts, s.start_errors
    );
    println!(
        "p50 +ms: the median over rounds of each sandbox round's p50 minus that of the bare round just before it (per round, by concurrency: {})",
        per_round.join("; ")
    );
    println!("cpu ms: CPU time of the whole machine per exec (from /proc/stat), bench threads included.");
    Ok(())
}

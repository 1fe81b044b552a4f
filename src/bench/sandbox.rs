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
        sbx_runs.push(measure(n, conc, pool_call(pool, argv))?);
    }
    Ok((bare_runs, sbx_runs))
}

/// One call of `argv` in the sandbox `pool`, for [`measure`]; waits for the pool to
/// refill first, so a round starts with every sandbox warm.
fn pool_call(pool: &Arc<Pool>, argv: &[String]) -> Arc<dyn Fn() -> Result<()> + Send + Sync> {
    while pool.ready() < pool.config().pool_size {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let (p, a) = (pool.clone(), argv.to_vec());
    Arc::new(move || {
        let r = p.exec(&ExecRequest::new(a.clone()));
        if r.status != ExecStatus::Ok {
            bail!("sandboxed run: {r:?}");
        }
        Ok(())
    })
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

/// Gateway processes (`streamrl sandbox serve`) for the bench, killed on drop.
struct Gateways {
    children: Vec<std::process::Child>,
    urls: Vec<String>,
}

impl Drop for Gateways {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

const BENCH_TOKEN: &str = "bench-token-0123456789abcdef";

/// `count` gateways with `pool_size` warm sandboxes each, gateway `i` pinned to core `i`
/// when `pinned`; returns once every one reports its pool full.
fn start_gateways(rt: &tokio::runtime::Runtime, count: usize, pool_size: usize, pinned: bool) -> Result<Gateways> {
    let exe = std::env::current_exe()?;
    let mut g = Gateways {
        children: Vec::new(),
        urls: Vec::new(),
    };
    for i in 0..count {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["sandbox", "serve", "--pool-size", &pool_size.to_string()])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("STREAMRL_SANDBOX_TOKEN", BENCH_TOKEN)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if pinned {
            let mut set = rustix::thread::CpuSet::new();
            set.set(i);
            // SAFETY: the closure runs in the child between fork and exec and only makes
            // the sched_setaffinity(2) system call (async-signal-safe, no allocation).
            #[allow(unsafe_code)]
            unsafe {
                use std::os::unix::process::CommandExt;
                cmd.pre_exec(move || Ok(rustix::thread::sched_setaffinity(None, &set)?));
            }
        }
        g.children.push(cmd.spawn()?);
        g.urls.push(format!("http://127.0.0.1:{port}"));
    }
    let client = reqwest::Client::new();
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    for url in &g.urls {
        loop {
            let health = rt.block_on(async {
                let r = client.get(format!("{url}/health")).send().await.ok()?;
                serde_json::from_slice::<serde_json::Value>(&r.bytes().await.ok()?).ok()
            });
            if health.is_some_and(|h| h["ready"].as_u64() == Some(pool_size as u64)) {
                break;
            }
            if Instant::now() > deadline {
                bail!("gateway {url} did not fill its pool of {pool_size} within 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    Ok(g)
}

/// One row of the gateway table: `n` executions of `argv` at `conc`, the median of
/// `rounds`, through `gateways` (or the local `pool`).
fn executor_rounds(
    rt: &Arc<tokio::runtime::Runtime>,
    target: Option<&Arc<streamrl_stages::gateways::Fleet>>,
    pool: &Arc<Pool>,
    argv: &[String],
    n: usize,
    conc: usize,
    rounds: usize,
) -> Result<Run> {
    let mut runs = Vec::new();
    for _ in 0..rounds {
        let f: Arc<dyn Fn() -> Result<()> + Send + Sync> = match target {
            Some(fleet) => {
                let (rt, fleet) = (rt.clone(), fleet.clone());
                let ex = streamrl_envs::Execution {
                    files: Vec::new(),
                    argv: argv.to_vec(),
                    wall_ms: None,
                    report_marker: None,
                };
                let limits = pool.config().limits;
                Arc::new(move || {
                    let r = rt.block_on(fleet.exec("bench", &ex, &limits));
                    if r.status != ExecStatus::Ok || r.stdout != "1\n" {
                        bail!("through the gateways: {r:?}");
                    }
                    Ok(())
                })
            }
            None => pool_call(pool, argv),
        };
        runs.push(measure(n, conc, f)?);
    }
    Ok(median_run(&runs))
}

/// The executors' table: the local pool against the sandbox stage's gateway client
/// ([`streamrl_stages::gateways::Fleet`]) over 1..N gateway processes, unpinned (the
/// overhead row, same cores as the local pool) and pinned one core each (the scaling
/// rows). Runs off any async context (it blocks on a runtime of its own).
pub fn executors(
    n: usize,
    concurrency: &[usize],
    pool_size: usize,
    python: &str,
    rounds: usize,
    executors: &[String],
    gateways: &[usize],
) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?,
    );
    let pool = Arc::new(Pool::new(SandboxConfig {
        pool_size,
        ..SandboxConfig::default()
    })?);
    let argv = vec![python.to_string(), "-c".to_string(), "print(1)".to_string()];
    let dir = tempfile::tempdir()?;
    let token = dir.path().join("token");
    std::fs::write(&token, BENCH_TOKEN)?;
    println!(
        "streamrl bench sandbox --executor {}: `{python} -c \"print(1)\"`, {n} execs recorded per round, median of {rounds} rounds; {pool_size} warm sandboxes per pool or gateway; {cores} cores",
        executors.join(",")
    );
    println!(
        "{:<9} {:>8} {:>7} {:>12} {:>9} {:>9} {:>9} {:>10}",
        "executor", "gateways", "pinned", "concurrency", "p50 ms", "p99 ms", "exec/s", "p50 +ms"
    );
    let mut local_p50 = std::collections::HashMap::new();
    let mut pinned_rate: std::collections::HashMap<(usize, usize), f64> = std::collections::HashMap::new();
    let row = |name: &str, g: &str, pinned: &str, conc: usize, r: &Run, plus: Option<f64>| {
        println!(
            "{name:<9} {g:>8} {pinned:>7} {conc:>12} {:>9.2} {:>9.2} {:>9.1} {:>10}",
            r.p50,
            r.p99,
            r.per_sec,
            plus.map_or("–".to_string(), |p| format!("{p:+.2}"))
        );
    };
    if executors.iter().any(|e| e == "local") {
        for &conc in concurrency {
            let r = executor_rounds(&rt, None, &pool, &argv, n, conc, rounds)?;
            local_p50.insert(conc, r.p50);
            row("local", "–", "–", conc, &r, None);
        }
    }
    if executors.iter().any(|e| e == "gateways") {
        let mut configs: Vec<(usize, bool)> = gateways.iter().map(|&g| (g, false)).collect();
        configs.extend(gateways.iter().filter(|&&g| g <= cores).map(|&g| (g, true)));
        for (count, pinned) in configs {
            let fleet_procs = start_gateways(&rt, count, pool_size, pinned)?;
            let cfg = streamrl_stages::gateways::GatewaysConfig {
                endpoints: fleet_procs.urls.clone(),
                token_file: Some(token.clone()),
                per_gateway: concurrency.iter().copied().max().unwrap_or(1),
                ..Default::default()
            };
            let fleet = Arc::new(
                rt.block_on(async { streamrl_stages::gateways::Fleet::new(cfg) })
                    .map_err(anyhow::Error::msg)?,
            );
            for &conc in concurrency {
                let r = executor_rounds(&rt, Some(&fleet), &pool, &argv, n, conc, rounds)?;
                let plus = (!pinned).then(|| local_p50.get(&conc).map(|l| r.p50 - l)).flatten();
                if pinned {
                    pinned_rate.insert((count, conc), r.per_sec);
                }
                row(
                    "gateways",
                    &count.to_string(),
                    if pinned { "yes" } else { "no" },
                    conc,
                    &r,
                    plus,
                );
            }
            drop(fleet_procs);
        }
    }
    println!();
    println!("p50 +ms: the row's p50 minus the local pool's at the same concurrency (same cores: unpinned).");
    println!("pinned: gateway i runs on core i alone (sched_setaffinity), its sandboxes too.");
    if let Some(&max) = gateways.iter().filter(|&&g| g <= cores && g > 1).max() {
        for &conc in concurrency {
            if let (Some(one), Some(many)) = (pinned_rate.get(&(1, conc)), pinned_rate.get(&(max, conc))) {
                println!(
                    "scaling at concurrency {conc}: {max} pinned gateways / 1 pinned gateway = {:.2}× exec/s",
                    many / one
                );
            }
        }
    }
    Ok(())
}

//! `streamrl up` and `streamrl down`: every replica of every stage as its own
//! `streamrl stage` process on a shared (Kafka) bus, supervised.
//!
//! `up` creates the topology's topics (so no client can auto-create one with the broker's
//! default partition count), runs the SFT warm start when the topology has one and its
//! output is missing, then starts one process per replica, each logging to
//! `<run_dir>/logs/<stage>-<replica>.log`. A process that exits with status 0 has seen the
//! end of the run and is not restarted; one that dies otherwise (a crash, a kill, a broker
//! it could not reach) is restarted after a backoff (0.2 s doubling to 10 s, reset once it
//! has run for 30 s; a replica SIGKILLed from outside always comes back after 0.2 s),
//! with the cause logged. `up` exits 0 once every replica has ended
//! with the run, and gives up (stopping the others) when one replica fails by itself 5
//! times in a row within seconds of starting (SIGKILLs from outside are always restarted). The current process ids are kept in
//! `<run_dir>/up.json` (`{"supervisor": pid, "replicas": {"rollout-0": pid, ...}}`).
//!
//! `down` sends SIGTERM to the supervisor recorded there, which forwards it to every
//! replica (each finishes its in-flight message, commits and exits) and waits for them.

mod replica;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustix::process::Signal;
use serde::{Deserialize, Serialize};
use streamrl_runtime::runner::Shutdown;
use streamrl_runtime::topology::Topology;

pub(crate) use replica::signal;
use replica::{Launcher, Replica};

/// `streamrl up`.
#[derive(clap::Args)]
pub struct UpArgs {
    /// Topology file.
    #[arg(short, long, default_value = "topology.yaml")]
    topology: PathBuf,
    /// Bus URL (overrides the topology's; must be shared by processes: kafka://).
    #[arg(long, env = "STREAMRL_BUS")]
    bus: Option<String>,
}

/// `streamrl down`.
#[derive(clap::Args)]
pub struct DownArgs {
    /// Topology file (its run_dir locates the running `up`).
    #[arg(short, long, default_value = "topology.yaml")]
    topology: PathBuf,
}

/// `streamrl up`: the SFT warm start when the topology has one and its output is missing,
/// then [`up`].
pub async fn run(a: UpArgs) -> Result<()> {
    let t = super::load_and_warm_start(&a.topology, a.bus)?;
    up(&t, &a.topology, &t.bus).await
}

/// `streamrl down`: [`down`] for the topology's run directory.
pub async fn stop(a: DownArgs) -> Result<()> {
    down(&super::load(&a.topology)?.run_dir).await
}

/// What `up.json` records.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct UpState {
    /// The supervisor's process id.
    pub supervisor: u32,
    /// Each replica's current process id (`stage-replica` → pid), while it runs.
    pub replicas: BTreeMap<String, u32>,
    /// Restarts so far, per replica.
    pub restarts: BTreeMap<String, u32>,
}

/// Where `up` records its processes.
pub fn state_path(run_dir: &Path) -> PathBuf {
    run_dir.join("up.json")
}

/// Runs every replica of `t` as its own process until the run ends (or a signal).
pub async fn up(t: &Topology, topology: &Path, bus_url: &str) -> Result<()> {
    if bus_url.starts_with("memory://") {
        bail!(
            "`streamrl up` runs each stage as its own process, which needs a bus they share: pass \
             --bus kafka://HOST:PORT (or use `streamrl run` for the in-process memory bus)"
        );
    }
    let bus = streamrl_runtime::bus::connect(bus_url).await?;
    streamrl_runtime::running::create_topics(&bus, t).await?;
    drop(bus);
    let launcher = Launcher {
        exe: std::env::current_exe().context("locating the streamrl binary")?,
        logs: t.run_dir.join("logs"),
        topology,
        bus_url,
    };
    std::fs::create_dir_all(&launcher.logs).with_context(|| format!("creating {}", launcher.logs.display()))?;
    let shutdown = Shutdown::new();
    shutdown.on_signals();
    let mut replicas: Vec<Replica> = t
        .stages
        .iter()
        .flat_map(|(name, d)| (0..d.replicas).map(move |r| Replica::new(name, r)))
        .collect();
    eprintln!(
        "up: {} replica(s) of {} stage(s) on {bus_url}; logs in {}",
        replicas.len(),
        t.stages.len(),
        launcher.logs.display()
    );
    let failure = supervise(&mut replicas, &launcher, &shutdown, &t.run_dir).await?;
    if failure.is_none() && replicas.iter().all(|r| r.finished) {
        eprintln!("up: every replica finished: the run is over");
        let _ = std::fs::remove_file(state_path(&t.run_dir));
        return Ok(());
    }
    // A signal (or `down`), or a replica that keeps failing: stop the rest gracefully.
    let unclean = stop_all(&mut replicas).await;
    let _ = std::fs::remove_file(state_path(&t.run_dir));
    match failure {
        Some(f) => bail!("up: {f}"),
        None if !unclean.is_empty() => bail!(
            "up: stopped, but {} replica(s) did not exit cleanly: {}",
            unclean.len(),
            unclean.join(", ")
        ),
        None => {
            eprintln!("up: stopped: every replica exited 0");
            Ok(())
        }
    }
}

/// Restarts replicas as they die until every one has finished, a signal arrives, or one
/// keeps failing (its cause returned); `up.json` follows every change.
async fn supervise(
    replicas: &mut [Replica],
    launcher: &Launcher<'_>,
    shutdown: &Shutdown,
    run_dir: &Path,
) -> Result<Option<String>> {
    while !shutdown.is_triggered() {
        let mut changed = false;
        for r in replicas.iter_mut() {
            if let Some(child) = r.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                changed = true;
                if let Err(cause) = r.exited(status, &launcher.log(r)) {
                    return Ok(Some(cause));
                }
            }
            changed |= r.start_if_due(launcher)?;
        }
        if changed {
            write_state(run_dir, replicas)?;
        }
        if replicas.iter().all(|r| r.finished) {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(None)
}

/// SIGTERM to every running replica, then waits (SIGKILL after 60 s); prints how each
/// ended and returns those that did not exit 0 (each finishes its message in hand,
/// commits and exits 0 on SIGTERM).
async fn stop_all(replicas: &mut [Replica]) -> Vec<String> {
    for r in replicas.iter() {
        if let Some(c) = &r.child {
            signal(c.id(), Signal::TERM);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut unclean = Vec::new();
    loop {
        let mut running = 0;
        for r in replicas.iter_mut() {
            let instance = r.instance();
            let Some(c) = r.child.as_mut() else { continue };
            let how = match c.try_wait() {
                Ok(Some(status)) => Some(status),
                Err(e) => {
                    unclean.push(format!("{instance} (waiting for it: {e})"));
                    r.child = None;
                    None
                }
                Ok(None) if Instant::now() > deadline => {
                    let _ = c.kill();
                    unclean.push(format!("{instance} (still running after 60 s: killed)"));
                    let _ = c.wait();
                    r.child = None;
                    None
                }
                Ok(None) => {
                    running += 1;
                    None
                }
            };
            if let Some(status) = how {
                let cause = replica::describe(status);
                eprintln!("up: {instance} stopped ({cause})");
                if !status.success() {
                    unclean.push(format!("{instance} ({cause})"));
                }
                r.child = None;
            }
        }
        if running == 0 {
            return unclean;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn write_state(run_dir: &Path, replicas: &[Replica]) -> Result<()> {
    let state = UpState {
        supervisor: std::process::id(),
        replicas: replicas
            .iter()
            .filter_map(|r| r.child.as_ref().map(|c| (r.instance(), c.id())))
            .collect(),
        restarts: replicas
            .iter()
            .map(|r| (r.instance(), r.starts.saturating_sub(1)))
            .collect(),
    };
    let path = state_path(run_dir);
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&state)?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Whether process `pid` is running: it exists and has not exited. A process that has
/// exited stays in `/proc` as a zombie until its parent reaps it (a shell does at once;
/// a parent busy elsewhere may not), and it counts as gone.
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) state ...`: comm may hold spaces and parentheses, the state follows the last `)`.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some('Z' | 'X') | None)
}

/// Stops the `up` of `run_dir`: SIGTERM to its supervisor, then waits until it is gone.
pub async fn down(run_dir: &Path) -> Result<()> {
    let path = state_path(run_dir);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "no `streamrl up` is running for {} ({} is missing)",
            run_dir.display(),
            path.display()
        )
    })?;
    let state: UpState = serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    if !alive(state.supervisor) {
        let _ = std::fs::remove_file(&path);
        bail!(
            "the supervisor recorded in {} (pid {}) is not running",
            path.display(),
            state.supervisor
        );
    }
    signal(state.supervisor, Signal::TERM);
    let deadline = Instant::now() + Duration::from_secs(90);
    while alive(state.supervisor) {
        if Instant::now() > deadline {
            bail!("the supervisor (pid {}) did not stop within 90 s", state.supervisor);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("down: stopped {} replica(s)", state.replicas.len());
    Ok(())
}

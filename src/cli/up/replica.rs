//! One supervised replica of `streamrl up`: when it is due to (re)start, how its exit is
//! judged (finished, killed from outside, failing by itself), and how its process starts.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rustix::process::{Pid, Signal};

/// Restarting a replica waits this long at first, doubling per quick failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// The longest wait before a restart.
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A replica that ran this long before dying is restarted at the first backoff again.
const HEALTHY_AFTER: Duration = Duration::from_secs(30);
/// Consecutive quick failures of one replica after which `up` gives up.
const MAX_QUICK_FAILURES: u32 = 5;
/// A failure within this long of starting counts as quick.
const QUICK: Duration = Duration::from_secs(5);

pub(super) struct Replica {
    pub(super) stage: String,
    pub(super) replica: u32,
    pub(super) child: Option<Child>,
    pub(super) started: Instant,
    pub(super) restart_at: Option<Instant>,
    pub(super) backoff: Duration,
    pub(super) quick_failures: u32,
    pub(super) starts: u32,
    pub(super) finished: bool,
}

impl Replica {
    /// Replica `replica` of `stage`, due to start now.
    pub(super) fn new(stage: &str, replica: u32) -> Self {
        Replica {
            stage: stage.to_string(),
            replica,
            child: None,
            started: Instant::now(),
            restart_at: Some(Instant::now()),
            backoff: FIRST_BACKOFF,
            quick_failures: 0,
            starts: 0,
            finished: false,
        }
    }

    pub(super) fn instance(&self) -> String {
        format!("{}-{}", self.stage, self.replica)
    }

    /// Its process ended with `status`: finished (exit 0), or due for a restart after its
    /// backoff; `Err` with the cause once it keeps failing by itself.
    pub(super) fn exited(&mut self, status: std::process::ExitStatus, log: &Path) -> Result<(), String> {
        self.child = None;
        let ran = self.started.elapsed();
        if status.success() {
            self.finished = true;
            eprintln!("up: {} finished (the run ended)", self.instance());
            return Ok(());
        }
        // Only a process that fails by itself, soon after starting, counts towards giving
        // up (a configuration or environment problem a restart will not fix) or slows its
        // own restarts down; one killed from outside (SIGKILL: an operator, the OOM
        // killer) always comes back at once.
        let killed = std::os::unix::process::ExitStatusExt::signal(&status) == Some(Signal::KILL.as_raw());
        if ran >= HEALTHY_AFTER || killed {
            self.backoff = FIRST_BACKOFF;
        }
        self.quick_failures = if ran < QUICK && !killed {
            self.quick_failures + 1
        } else {
            0
        };
        let cause = describe(status);
        if self.quick_failures >= MAX_QUICK_FAILURES {
            return Err(format!(
                "{} failed {MAX_QUICK_FAILURES} times in a row within {QUICK:?} of starting (last: {cause}{}); see {}",
                self.instance(),
                last_error(log).map(|e| format!(": {e}")).unwrap_or_default(),
                log.display()
            ));
        }
        eprintln!(
            "up: {} {cause} after {:.1} s; restarting in {:?}",
            self.instance(),
            ran.as_secs_f64(),
            self.backoff
        );
        self.restart_at = Some(Instant::now() + self.backoff);
        if !killed {
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        }
        Ok(())
    }

    /// Starts its process when it is due; whether it did.
    pub(super) fn start_if_due(&mut self, launcher: &Launcher<'_>) -> Result<bool> {
        if self.child.is_some() || self.finished || self.restart_at.is_none_or(|at| Instant::now() < at) {
            return Ok(false);
        }
        self.child = Some(launcher.spawn(self)?);
        self.starts += 1;
        self.started = Instant::now();
        self.restart_at = None;
        Ok(true)
    }
}

/// How `up` starts a replica's process: `streamrl stage` of this binary, on the same
/// topology (and `--set` overrides) and bus, its output appended to its log.
pub(super) struct Launcher<'a> {
    pub(super) exe: PathBuf,
    pub(super) logs: PathBuf,
    pub(super) topology: &'a Path,
    pub(super) bus_url: &'a str,
}

impl Launcher<'_> {
    /// The log file of a replica.
    pub(super) fn log(&self, r: &Replica) -> PathBuf {
        self.logs.join(format!("{}.log", r.instance()))
    }

    fn spawn(&self, r: &Replica) -> Result<Child> {
        let log = self.log(r);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = file.try_clone()?;
        let mut cmd = Command::new(&self.exe);
        // SAFETY: pre_exec's closure runs in the child between fork and exec; prctl(2)
        // touches no memory of the parent and allocates nothing (async-signal-safe).
        #[allow(unsafe_code)]
        unsafe {
            use std::os::unix::process::CommandExt;
            // A replica must not outlive its supervisor (killed or not): it gets SIGTERM,
            // finishes its message and commits.
            cmd.pre_exec(|| Ok(rustix::process::set_parent_process_death_signal(Some(Signal::TERM))?));
        }
        cmd.arg("stage")
            .arg(&r.stage)
            .arg("--replica")
            .arg(r.replica.to_string())
            .arg("--bus")
            .arg(self.bus_url)
            .arg("--topology")
            .arg(self.topology)
            // The same topology as this process's: its `--set` overrides too.
            .env("STREAMRL_SET", crate::cli::overrides().join("\n"))
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {}", r.instance()))
    }
}

/// The last line of a replica's log that reports an error (what `streamrl stage` printed
/// before exiting), without its timestamp and level.
fn last_error(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with("error: ") || l.contains(" ERROR "))?;
    let line = line.split_once(" ERROR ").map_or(line, |(_, rest)| rest);
    Some(line.trim().chars().take(400).collect())
}

pub(super) fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => format!("ended ({status})"),
    }
}

/// Sends `sig` to process `pid` (a child this process started and has not reaped, or the
/// supervisor named in `up.json`); one that is already gone is not an error.
pub(crate) fn signal(pid: u32, sig: Signal) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        let _ = rustix::process::kill_process(pid, sig);
    }
}

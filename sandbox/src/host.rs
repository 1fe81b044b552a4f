//! One sandbox seen from the host: its init process, its pipes and its cgroups.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::protocol::{
    ExecRequest, ExecResult, ExecStatus, InitConfig, Limits, RawExec, Request, Response, read_frame, write_frame,
};
use crate::{Error, SandboxConfig, sys};

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Cgroup v1 or v2 directories of one sandbox.
#[derive(Debug, Default)]
pub(crate) struct Cgroups {
    /// v1: one directory per controller; v2: one directory.
    dirs: Vec<PathBuf>,
    v2: bool,
    /// The memory and process limits written last (rewritten only when they change).
    applied: Option<(u64, u64)>,
    /// OOM kills counted after the last command.
    ooms: u64,
    /// The peak-memory file (v1 `memory.max_usage_in_bytes`, also reset through it; v2
    /// `memory.peak`) and the OOM-kill count (v1 `memory.oom_control`, v2
    /// `memory.events`), opened once: they are read after every command.
    peak_file: Option<std::fs::File>,
    events_file: Option<std::fs::File>,
}

/// The whole of a small cgroup file, read from its start.
fn read_from_start(f: &std::fs::File) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 4096];
    let n = f.read_at(&mut buf, 0).ok()?;
    String::from_utf8(buf[..n].to_vec()).ok()
}

impl Cgroups {
    fn create(name: &str, limits: &Limits) -> Result<Cgroups, String> {
        let root = Path::new("/sys/fs/cgroup");
        let v1_mem = root.join("memory");
        let v1_pids = root.join("pids");
        let mut cg = Cgroups::default();
        if v1_mem.join("memory.limit_in_bytes").exists() || v1_pids.join("pids.max").exists() || v1_mem.is_dir() {
            for ctl in [v1_mem, v1_pids] {
                let d = ctl.join("streamrl").join(name);
                std::fs::create_dir_all(&d).map_err(|e| format!("create cgroup {}: {e}", d.display()))?;
                cg.dirs.push(d);
            }
        } else if root.join("cgroup.controllers").exists() {
            let parent = root.join("streamrl");
            std::fs::create_dir_all(&parent).map_err(|e| format!("create cgroup {}: {e}", parent.display()))?;
            let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory +pids");
            let d = parent.join(name);
            std::fs::create_dir_all(&d).map_err(|e| format!("create cgroup {}: {e}", d.display()))?;
            cg.dirs.push(d);
            cg.v2 = true;
        } else {
            return Err("no cgroup v1 memory/pids or cgroup v2 hierarchy under /sys/fs/cgroup".into());
        }
        cg.set_limits(limits)?;
        cg.applied = Some((limits.memory_bytes, limits.processes));
        let open = |p: Option<PathBuf>, write: bool| {
            p.and_then(|p| std::fs::OpenOptions::new().read(true).write(write).open(p).ok())
        };
        cg.peak_file = open(cg.file(0, "memory.max_usage_in_bytes", "memory.peak"), !cg.v2);
        cg.events_file = open(cg.file(0, "memory.oom_control", "memory.events"), false);
        Ok(cg)
    }

    fn file(&self, v1_ctl: usize, v1: &str, v2: &str) -> Option<PathBuf> {
        if self.v2 {
            self.dirs.first().map(|d| d.join(v2))
        } else {
            self.dirs.get(v1_ctl).map(|d| d.join(v1))
        }
    }

    /// Applies a command's memory and process limits (when they differ from the ones in
    /// place) and resets the peak-memory counter.
    fn prepare(&mut self, l: &Limits) -> Result<(), String> {
        if self.applied != Some((l.memory_bytes, l.processes)) {
            self.set_limits(l)?;
            self.applied = Some((l.memory_bytes, l.processes));
        } else if !self.v2
            && let Some(f) = &self.peak_file
        {
            use std::os::unix::fs::FileExt;
            let _ = f.write_at(b"0", 0);
        }
        Ok(())
    }

    fn set_limits(&self, l: &Limits) -> Result<(), String> {
        let w = |p: Option<PathBuf>, v: String| -> Result<(), String> {
            let p = p.ok_or("no cgroup")?;
            std::fs::write(&p, &v).map_err(|e| format!("write {v} to {}: {e}", p.display()))
        };
        if self.v2 {
            w(self.file(0, "", "memory.max"), l.memory_bytes.to_string())?;
            let _ = std::fs::write(self.dirs[0].join("memory.swap.max"), "0");
        } else {
            // memory+swap must stay >= memory: it is written before (when growing) and
            // after (when shrinking). Without swap accounting the file is absent.
            let memsw = self.dirs[0].join("memory.memsw.limit_in_bytes");
            let _ = std::fs::write(&memsw, l.memory_bytes.to_string());
            w(self.file(0, "memory.limit_in_bytes", ""), l.memory_bytes.to_string())?;
            let _ = std::fs::write(&memsw, l.memory_bytes.to_string());
            let _ = std::fs::write(self.dirs[0].join("memory.max_usage_in_bytes"), "0");
        }
        w(self.file(1, "pids.max", "pids.max"), l.processes.to_string())
    }

    fn add(&self, pid: u32) -> Result<(), String> {
        for d in &self.dirs {
            std::fs::write(d.join("cgroup.procs"), pid.to_string())
                .map_err(|e| format!("move pid {pid} into {}: {e}", d.display()))?;
        }
        Ok(())
    }

    /// OOM kills so far.
    fn oom_kills(&self) -> u64 {
        self.events_file
            .as_ref()
            .and_then(read_from_start)
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("oom_kill ").and_then(|v| v.trim().parse().ok()))
            })
            .unwrap_or(0)
    }

    /// Peak memory since the last reset.
    fn peak(&self) -> u64 {
        self.peak_file
            .as_ref()
            .and_then(read_from_start)
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    fn pids(&self) -> Vec<i32> {
        self.dirs
            .iter()
            .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
            .flat_map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect::<Vec<_>>())
            .collect()
    }

    /// Kills what is left and removes the directories (retrying while tasks exit).
    fn destroy(&mut self) {
        (self.peak_file, self.events_file) = (None, None);
        for _ in 0..200 {
            for pid in self.pids() {
                let _ = sys::kill(pid);
            }
            self.dirs.retain(|d| std::fs::remove_dir(d).is_err() && d.exists());
            if self.dirs.is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// One running sandbox: a private root, process tree, network and cgroup. Commands run
/// one at a time; files under `/work` persist between them until the sandbox is dropped.
#[derive(Debug)]
pub struct Sandbox {
    id: String,
    child: Child,
    to: ChildStdin,
    from: ChildStdout,
    cgroups: Option<Cgroups>,
    max: Limits,
    broken: bool,
    uses: u32,
}

impl Sandbox {
    /// Starts a sandbox (blocking, a few milliseconds).
    pub fn start(cfg: &SandboxConfig) -> Result<Sandbox, Error> {
        let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let id = format!("sbx-{}-{n}", std::process::id());
        let (init_path, init_args) = cfg.init_command()?;
        let root = sys::geteuid() == 0;
        let init_cfg = InitConfig {
            ro_binds: cfg.ro_binds.clone(),
            work_bytes: cfg.work_bytes,
            tmp_bytes: cfg.tmp_bytes,
            run_as: root.then_some(1000),
        };
        let cgroups = match cfg.cgroups {
            crate::CgroupMode::Off => None,
            mode => match Cgroups::create(&id, &cfg.limits) {
                Ok(c) => Some(c),
                Err(e) if mode == crate::CgroupMode::Required => return Err(Error::Cgroup(e)),
                Err(_) => None,
            },
        };
        let mut child = Command::new(&init_path)
            .args(init_args)
            .arg(serde_json::to_string(&init_cfg).expect("serialisable"))
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| Error::Spawn {
                path: init_path.clone(),
                source,
            })?;
        let to = child.stdin.take().expect("piped");
        let from = child.stdout.take().expect("piped");
        let mut sb = Sandbox {
            id,
            child,
            to,
            from,
            cgroups,
            max: cfg.limits,
            broken: false,
            uses: 0,
        };
        if let Some(cg) = &sb.cgroups {
            cg.add(sb.child.id()).map_err(Error::Cgroup)?;
        }
        let mut b = [0u8; 1];
        if sb.from.read_exact(&mut b).is_err() || b[0] != b'U' {
            return Err(sb.startup_failure("before the uid map handshake"));
        }
        sb.write_id_maps(root, cfg.uid_base + (n % 10_000) as u32 * 2)?;
        if sb.to.write_all(b"M").and_then(|_| sb.to.flush()).is_err() {
            return Err(sb.startup_failure("after the uid maps"));
        }
        match read_frame::<Response>(&mut sb.from) {
            Ok((Response::Ready, _)) => Ok(sb),
            Ok((Response::Error { message }, _)) => Err(Error::Setup(message)),
            Ok((other, _)) => Err(Error::Protocol(format!("expected Ready, got {other:?}"))),
            Err(_) => Err(sb.startup_failure("during set-up")),
        }
    }

    fn startup_failure(&mut self, when: &str) -> Error {
        let _ = self.child.kill();
        let mut err = String::new();
        if let Some(e) = self.child.stderr.as_mut() {
            let _ = e.read_to_string(&mut err);
        }
        Error::Setup(format!("init exited {when}: {}", err.trim()))
    }

    fn write_id_maps(&mut self, root: bool, host_base: u32) -> Result<(), Error> {
        let pid = self.child.id();
        let (uid_map, gid_map) = if root {
            // uid 0 inside (init) and uid 1000 inside (commands) map to two host ids of
            // their own, so RLIMIT_NPROC counts this sandbox's processes only.
            let m = format!("0 {host_base} 1\n1000 {} 1\n", host_base + 1);
            (m.clone(), m)
        } else {
            let _ = std::fs::write(format!("/proc/{pid}/setgroups"), "deny");
            (format!("0 {} 1\n", sys::geteuid()), format!("0 {} 1\n", sys::getegid()))
        };
        for (file, map) in [("uid_map", uid_map), ("gid_map", gid_map)] {
            std::fs::write(format!("/proc/{pid}/{file}"), &map).map_err(|e| {
                Error::Setup(format!(
                    "write /proc/{pid}/{file} ({}): {e}",
                    map.trim().replace('\n', ", ")
                ))
            })?;
        }
        Ok(())
    }

    /// This sandbox's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    fn call(&mut self, req: &Request, blob: &[u8], deadline: Duration) -> Result<(Response, Vec<Vec<u8>>), Error> {
        if self.broken {
            return Err(Error::Protocol(format!("sandbox {} is no longer usable", self.id)));
        }
        let blobs: Vec<&[u8]> = if blob.is_empty() { vec![] } else { vec![blob] };
        if let Err(e) = write_frame(&mut self.to, req, &blobs) {
            self.broken = true;
            return Err(Error::Protocol(format!("send to sandbox {}: {e}", self.id)));
        }
        // The init enforces the command's wall clock itself; this is the backstop.
        let end = Instant::now() + deadline;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.broken = true;
                return Err(Error::Protocol(format!(
                    "sandbox {} did not answer within {deadline:?}",
                    self.id
                )));
            }
            let ready = sys::poll(
                &[(self.from.as_raw_fd(), libc::POLLIN)],
                left.as_millis().min(i32::MAX as u128) as i32,
            )
            .map_err(|e| Error::Protocol(e.to_string()))?;
            if ready[0] != 0 {
                break;
            }
        }
        read_frame(&mut self.from).map_err(|e| {
            self.broken = true;
            Error::Protocol(format!("sandbox {} stopped answering: {e}", self.id))
        })
    }

    /// Runs a command. A failure of the sandbox itself is returned as an
    /// `internal_error` result (the sandbox is then unusable), never as a panic.
    pub fn exec(&mut self, req: &ExecRequest) -> ExecResult {
        self.run(req, false)
    }

    /// Runs a command, then resets the sandbox as [`Sandbox::reset`] does, in one round
    /// trip: the way a pool hands a one-shot sandbox back ready for the next user. A
    /// failed reset leaves the command's result as it was and the sandbox unusable
    /// ([`Sandbox::is_usable`]).
    pub fn exec_then_reset(&mut self, req: &ExecRequest) -> ExecResult {
        self.run(req, true)
    }

    fn run(&mut self, req: &ExecRequest, then_reset: bool) -> ExecResult {
        let errs = req.limits.exceeding(&self.max);
        if !errs.is_empty() {
            return ExecResult::internal_error(errs.join("; "));
        }
        if let Some(cg) = &mut self.cgroups
            && let Err(e) = cg.prepare(&req.limits)
        {
            return ExecResult::internal_error(e);
        }
        let deadline = Duration::from_millis(req.limits.wall_ms) + Duration::from_secs(5);
        self.uses += 1;
        let request = if then_reset {
            Request::ExecThenReset(req.clone())
        } else {
            Request::Exec(req.clone())
        };
        match self.call(&request, &req.stdin, deadline) {
            Ok((Response::Exec(mut raw), _)) => {
                if raw.reset_error.take().is_some() {
                    self.broken = true;
                }
                let (oom, peak) = match &mut self.cgroups {
                    Some(cg) => {
                        let now = cg.oom_kills();
                        let oom = now > cg.ooms;
                        cg.ooms = now;
                        (oom, cg.peak())
                    }
                    None => (false, 0),
                };
                classify(raw, &req.limits, oom, peak)
            }
            Ok((other, _)) => ExecResult::internal_error(format!("unexpected answer {other:?}")),
            Err(e) => ExecResult::internal_error(e.to_string()),
        }
    }

    /// Commands run so far.
    pub fn uses(&self) -> u32 {
        self.uses
    }

    /// Whether the sandbox still answers (a protocol failure makes it unusable).
    pub fn is_usable(&self) -> bool {
        !self.broken
    }

    /// Makes the sandbox as new for another user: every process killed, empty `/work` and
    /// `/tmp`, System V IPC objects removed, cgroup peak reset.
    pub fn reset(&mut self) -> Result<(), Error> {
        match self.call(&Request::Reset, &[], Duration::from_secs(10))? {
            (Response::Ready, _) => Ok(()),
            (Response::Error { message }, _) => {
                self.broken = true;
                Err(Error::Setup(message))
            }
            (other, _) => Err(Error::Protocol(format!("unexpected answer {other:?}"))),
        }
    }

    /// Writes a file under `/work`.
    pub fn write_file(&mut self, path: &str, data: &[u8], mode: u32) -> Result<(), Error> {
        match self.call(
            &Request::WriteFile {
                path: path.into(),
                mode,
            },
            data,
            Duration::from_secs(10),
        )? {
            (Response::Written, _) => Ok(()),
            (Response::Error { message }, _) => Err(Error::File(message)),
            (other, _) => Err(Error::Protocol(format!("unexpected answer {other:?}"))),
        }
    }

    /// Reads a file under `/work` (at most `max_bytes`).
    pub fn read_file(&mut self, path: &str, max_bytes: u64) -> Result<Vec<u8>, Error> {
        match self.call(
            &Request::ReadFile {
                path: path.into(),
                max_bytes,
            },
            &[],
            Duration::from_secs(10),
        )? {
            (Response::File, mut blobs) => Ok(blobs.pop().unwrap_or_default()),
            (Response::Error { message }, _) => Err(Error::File(message)),
            (other, _) => Err(Error::Protocol(format!("unexpected answer {other:?}"))),
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // Killing the init's first process kills pid 1 (parent-death signal), and with it
        // every process of the namespace; the cgroup sweep catches any straggler.
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(cg) = &mut self.cgroups {
            cg.destroy();
        }
    }
}

/// Turns what the init saw plus the cgroup's facts into a status and a reason.
pub fn classify(raw: RawExec, limits: &Limits, oom_killed: bool, cgroup_peak: u64) -> ExecResult {
    let mentions_memory = {
        let e = raw.stderr.to_ascii_lowercase();
        e.contains("memoryerror")
            || e.contains("cannot allocate memory")
            || e.contains("out of memory")
            || e.contains("std::bad_alloc")
    };
    let failed = raw.exit_code != Some(0);
    let (status, reason) = if let Some(e) = &raw.spawn_error {
        (ExecStatus::NonzeroExit, e.clone())
    } else if raw.timed_out {
        (
            ExecStatus::Timeout,
            format!(
                "wall-clock limit of {} ms reached; the process tree was killed",
                limits.wall_ms
            ),
        )
    } else if let Some(stream) = &raw.output_limit {
        let cap = if stream == "stdout" {
            limits.stdout_bytes
        } else {
            limits.stderr_bytes
        };
        (
            ExecStatus::OutputLimit,
            format!("{stream} passed its cap of {cap} bytes; the process tree was killed"),
        )
    } else if oom_killed {
        (
            ExecStatus::Memory,
            format!(
                "out of memory: the sandbox's limit of {} bytes was reached",
                limits.memory_bytes
            ),
        )
    } else if raw.signal == Some(libc::SIGXCPU)
        || (raw.signal == Some(libc::SIGKILL) && raw.cpu_ms >= limits.cpu_secs * 1000)
    {
        (
            ExecStatus::Timeout,
            format!("CPU limit of {} s reached", limits.cpu_secs),
        )
    } else if failed && mentions_memory {
        (
            ExecStatus::Memory,
            format!(
                "an allocation failed (address-space limit {} bytes, memory limit {} bytes)",
                limits.address_space_bytes, limits.memory_bytes
            ),
        )
    } else if let Some(sig) = raw.signal {
        (ExecStatus::Killed, format!("killed by signal {sig}"))
    } else if failed {
        (
            ExecStatus::NonzeroExit,
            format!("exit code {}", raw.exit_code.unwrap_or(-1)),
        )
    } else {
        (ExecStatus::Ok, String::new())
    };
    ExecResult {
        status,
        reason,
        exit_code: raw.exit_code,
        signal: raw.signal,
        stdout: raw.stdout,
        stderr: raw.stderr,
        wall_ms: raw.wall_ms,
        cpu_ms: raw.cpu_ms,
        peak_memory_bytes: cgroup_peak.max(raw.max_rss_bytes),
    }
}

//! What the host and a sandbox's init process say to each other over the init's stdin and
//! stdout, and the public request/result types.
//!
//! A frame is a little-endian `u32` length and a JSON header, then a `u32` count of
//! binary blobs, each a `u32` length and its bytes (stdin, file contents).

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Limits on one command. Every field has a default; a gateway or stage may lower them
/// per request but never raise them past the pool's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Wall-clock time after which the whole process tree is killed (`timeout`).
    pub wall_ms: u64,
    /// CPU seconds (`RLIMIT_CPU`; exceeding it is a `timeout`).
    pub cpu_secs: u64,
    /// Address space per process (`RLIMIT_AS`).
    pub address_space_bytes: u64,
    /// Memory of the whole sandbox (cgroup `memory.limit_in_bytes`, where the host has the
    /// memory controller; exceeding it is `memory`).
    pub memory_bytes: u64,
    /// Largest file a process may write (`RLIMIT_FSIZE`).
    pub file_size_bytes: u64,
    /// Processes (`RLIMIT_NPROC` for the sandbox's own uid, and cgroup `pids.max`).
    pub processes: u64,
    /// Open files per process (`RLIMIT_NOFILE`).
    pub open_files: u64,
    /// Bytes of stdout kept; more is `output_limit` and the command is killed.
    pub stdout_bytes: u64,
    /// Bytes of stderr kept; more is `output_limit` and the command is killed.
    pub stderr_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            wall_ms: 10_000,
            cpu_secs: 10,
            address_space_bytes: 2 << 30,
            memory_bytes: 512 << 20,
            file_size_bytes: 16 << 20,
            processes: 64,
            open_files: 256,
            stdout_bytes: 1 << 20,
            stderr_bytes: 1 << 20,
        }
    }
}

impl Limits {
    /// Every field of `self` that exceeds `max`, named with both values (empty: within).
    pub fn exceeding(&self, max: &Limits) -> Vec<String> {
        let pairs = [
            ("wall_ms", self.wall_ms, max.wall_ms),
            ("cpu_secs", self.cpu_secs, max.cpu_secs),
            ("address_space_bytes", self.address_space_bytes, max.address_space_bytes),
            ("memory_bytes", self.memory_bytes, max.memory_bytes),
            ("file_size_bytes", self.file_size_bytes, max.file_size_bytes),
            ("processes", self.processes, max.processes),
            ("open_files", self.open_files, max.open_files),
            ("stdout_bytes", self.stdout_bytes, max.stdout_bytes),
            ("stderr_bytes", self.stderr_bytes, max.stderr_bytes),
        ];
        let mut errs: Vec<String> = pairs
            .iter()
            .filter(|(_, v, m)| v > m)
            .map(|(n, v, m)| format!("limits.{n} = {v} exceeds the maximum {m}"))
            .collect();
        errs.extend(
            pairs
                .iter()
                .filter(|(_, v, _)| *v == 0)
                .map(|(n, _, _)| format!("limits.{n} must be positive")),
        );
        errs
    }
}

/// One command to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Program and arguments; the program is looked up in `PATH` (`/usr/bin:/bin`).
    pub argv: Vec<String>,
    /// Environment (nothing of the host's is passed on).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory inside the sandbox (default `/work`).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Bytes written to the command's stdin.
    #[serde(default, skip)]
    pub stdin: Vec<u8>,
    /// Limits for this command.
    #[serde(default)]
    pub limits: Limits,
}

impl ExecRequest {
    /// A command with default limits.
    pub fn new<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> Self {
        ExecRequest {
            argv: argv.into_iter().map(Into::into).collect(),
            env: BTreeMap::new(),
            cwd: None,
            stdin: vec![],
            limits: Limits::default(),
        }
    }

    /// `python3 -c SOURCE`.
    pub fn python(source: &str) -> Self {
        ExecRequest::new(["python3", "-c", source])
    }

    /// Sets the limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets stdin.
    pub fn with_stdin(mut self, stdin: impl Into<Vec<u8>>) -> Self {
        self.stdin = stdin.into();
        self
    }
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecStatus {
    /// Exit code 0.
    Ok,
    /// Exited with another code (including 127: the program was not found).
    NonzeroExit,
    /// Ran past its wall-clock or CPU limit; the whole tree was killed.
    Timeout,
    /// Ran out of memory (cgroup OOM kill, or an allocation refused by `RLIMIT_AS`).
    Memory,
    /// Wrote more than the stdout or stderr cap; the whole tree was killed.
    OutputLimit,
    /// Killed by a signal for another reason.
    Killed,
    /// The sandbox itself failed (set-up, protocol); the command's outcome is unknown.
    InternalError,
}

impl ExecStatus {
    /// The snake_case name used in `executed.exec_status` and the gateway's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecStatus::Ok => "ok",
            ExecStatus::NonzeroExit => "nonzero_exit",
            ExecStatus::Timeout => "timeout",
            ExecStatus::Memory => "memory",
            ExecStatus::OutputLimit => "output_limit",
            ExecStatus::Killed => "killed",
            ExecStatus::InternalError => "internal_error",
        }
    }
}

/// The outcome of one command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecResult {
    /// How it ended.
    pub status: ExecStatus,
    /// Why, for every status but `ok` (e.g. "wall-clock limit of 1000 ms").
    pub reason: String,
    /// Exit code, when it exited.
    pub exit_code: Option<i32>,
    /// Signal, when one killed it.
    pub signal: Option<i32>,
    /// Captured stdout (lossy UTF-8), at most `limits.stdout_bytes`.
    pub stdout: String,
    /// Captured stderr (lossy UTF-8), at most `limits.stderr_bytes`.
    pub stderr: String,
    /// Wall-clock milliseconds from exec to exit.
    pub wall_ms: f64,
    /// CPU milliseconds (user + system) of the command and every process it started.
    pub cpu_ms: u64,
    /// Peak memory in bytes (the sandbox cgroup's peak where available, else peak RSS).
    pub peak_memory_bytes: u64,
}

impl ExecResult {
    /// A result for a sandbox that failed before or while running the command.
    pub fn internal_error(reason: impl Into<String>) -> Self {
        ExecResult {
            status: ExecStatus::InternalError,
            reason: reason.into(),
            exit_code: None,
            signal: None,
            stdout: String::new(),
            stderr: String::new(),
            wall_ms: 0.0,
            cpu_ms: 0,
            peak_memory_bytes: 0,
        }
    }
}

/// Set-up of one sandbox, passed to the init process as its argument.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitConfig {
    /// Host paths bound read-only at the same place (symlinks are recreated as symlinks).
    pub ro_binds: Vec<String>,
    /// Size of the private writable `/work` tmpfs.
    pub work_bytes: u64,
    /// Size of the private `/tmp` tmpfs.
    pub tmp_bytes: u64,
    /// The uid/gid commands run as inside (mapped by the host), or `None` to stay uid 0
    /// inside with every capability dropped (a host that is not root maps one uid).
    pub run_as: Option<u32>,
}

/// A request from the host to the init.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Run a command (stdin is the first blob).
    Exec(ExecRequest),
    /// Run a command, then reset as [`Request::Reset`] before answering: a one-shot exec
    /// whose sandbox is reused costs one round trip, and the sandbox is ready again when
    /// the answer arrives.
    ExecThenReset(ExecRequest),
    /// Write a file under `/work` (its contents are the first blob).
    WriteFile {
        /// Path relative to `/work`, or absolute under it.
        path: String,
        /// Permission bits.
        mode: u32,
    },
    /// Make the sandbox as new for the next user: kill every process, fresh empty
    /// `/work` and `/tmp`, no System V IPC objects.
    Reset,
    /// Read a file under `/work`.
    ReadFile {
        /// Path relative to `/work`, or absolute under it.
        path: String,
        /// Refuse files larger than this.
        max_bytes: u64,
    },
}

/// The init's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Response {
    /// Set-up finished; the sandbox takes requests.
    Ready,
    /// A command's raw outcome (the host adds cgroup facts and classifies it).
    Exec(RawExec),
    /// A file was written.
    Written,
    /// A file's contents (first blob).
    File,
    /// The request failed; the sandbox stays usable.
    Error {
        /// Why.
        message: String,
    },
}

/// What the init observed about one command.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RawExec {
    /// Exit code.
    pub exit_code: Option<i32>,
    /// Terminating signal.
    pub signal: Option<i32>,
    /// The wall-clock limit was reached.
    pub timed_out: bool,
    /// A stream passed its cap (`"stdout"` or `"stderr"`).
    pub output_limit: Option<String>,
    /// The program could not be started (e.g. not found).
    pub spawn_error: Option<String>,
    /// Captured stdout.
    pub stdout: String,
    /// Captured stderr.
    pub stderr: String,
    /// Wall-clock milliseconds.
    pub wall_ms: f64,
    /// CPU milliseconds of the tree.
    pub cpu_ms: u64,
    /// Peak RSS of the command in bytes.
    pub max_rss_bytes: u64,
    /// [`Request::ExecThenReset`]: why the reset after the command failed (the command's
    /// outcome stands; the sandbox is unusable).
    #[serde(default)]
    pub reset_error: Option<String>,
}

const MAX_FRAME: u32 = 512 << 20;

/// Writes one frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, header: &T, blobs: &[&[u8]]) -> io::Result<()> {
    let h = serde_json::to_vec(header).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(12 + h.len() + blobs.iter().map(|b| b.len() + 4).sum::<usize>());
    buf.extend_from_slice(&(h.len() as u32).to_le_bytes());
    buf.extend_from_slice(&h);
    buf.extend_from_slice(&(blobs.len() as u32).to_le_bytes());
    for b in blobs {
        buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
        buf.extend_from_slice(b);
    }
    w.write_all(&buf)?;
    w.flush()
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_blob(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let n = read_u32(r)?;
    if n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame part of {n} bytes exceeds {MAX_FRAME}"),
        ));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

/// Reads one frame.
pub fn read_frame<T: serde::de::DeserializeOwned>(r: &mut impl Read) -> io::Result<(T, Vec<Vec<u8>>)> {
    let h = read_blob(r)?;
    let header = serde_json::from_slice(&h)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("bad frame header: {e}")))?;
    let n = read_u32(r)?;
    if n > 16 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{n} blobs in one frame"),
        ));
    }
    let blobs = (0..n).map(|_| read_blob(r)).collect::<io::Result<_>>()?;
    Ok((header, blobs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_limits_are_checked() {
        let mut buf = vec![];
        let req = Request::Exec(ExecRequest::python("print(1)"));
        write_frame(&mut buf, &req, &[b"in"]).unwrap();
        let (back, blobs): (Request, _) = read_frame(&mut buf.as_slice()).unwrap();
        assert!(matches!(back, Request::Exec(e) if e.argv[2] == "print(1)"));
        assert_eq!(blobs, vec![b"in".to_vec()]);
        assert!(read_frame::<Request>(&mut &buf[..buf.len() - 1]).is_err());

        let max = Limits::default();
        let l = Limits {
            wall_ms: max.wall_ms + 1,
            processes: 0,
            ..max
        };
        let errs = l.exceeding(&max);
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(errs[0].contains("limits.wall_ms = 10001 exceeds the maximum 10000"));
        assert!(errs[1].contains("limits.processes must be positive"));
    }
}

/// A path the file API takes, as a path relative to `/work`: `/work/a/b`, `a/b` and
/// `./a/b` name the same file; anything else absolute (`/etc/x`, `/workshop/x`), `..`,
/// and an empty path are refused with the reason.
pub fn work_relative(p: &str) -> Result<std::path::PathBuf, String> {
    use std::path::{Component, Path};
    let path = Path::new(p);
    let rel = if path.is_absolute() {
        path.strip_prefix("/work")
            .map_err(|_| format!("`{p}` is not under /work"))?
    } else {
        path
    };
    let mut out = std::path::PathBuf::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => return Err(format!("`{p}` leaves /work (`..` is not allowed)")),
        }
    }
    if out.as_os_str().is_empty() {
        return Err(format!("`{p}` names no file under /work"));
    }
    Ok(out)
}

#[cfg(test)]
mod work_paths {
    use super::work_relative;

    #[test]
    fn prefixes_are_stripped_by_component() {
        assert_eq!(work_relative("/work/a/b").unwrap().to_str(), Some("a/b"));
        assert_eq!(work_relative("a/./b").unwrap().to_str(), Some("a/b"));
        assert_eq!(work_relative("./main.py").unwrap().to_str(), Some("main.py"));
        for bad in ["/workshop/x", "/etc/passwd", "a/../../x", "/work", "", "/work/.."] {
            assert!(work_relative(bad).is_err(), "{bad} accepted");
        }
    }
}

//! Sandboxes for model-written code and tool calls.
//!
//! Every sandbox is a process tree in its own user, mount, pid, network, IPC, UTS and
//! cgroup namespaces, set up by the small `streamrl-sandbox-init` binary:
//!
//! * **file system**: a new root on a tmpfs; `/usr` (and the `/bin`, `/lib*` links, the
//!   loader cache) bound read-only; a private writable `/work` and `/tmp` (tmpfs, size
//!   capped); a fresh `/proc` that shows only the sandbox's own processes; a `/dev` with
//!   null, zero, random and urandom. Nothing else of the host is visible.
//! * **network**: none (a loopback interface that is down);
//! * **identity**: commands run as uid 1000 inside, mapped to a host uid of their own
//!   (on a root host), with no capabilities, `no_new_privs`, and a seccomp filter that
//!   refuses [`seccomp::DENIED`] system calls and new namespaces;
//! * **limits** ([`Limits`]): rlimits on CPU seconds, address space, file size, processes
//!   and open files; cgroup memory and pids limits where the host offers them; a
//!   wall-clock timeout and stdout/stderr caps that kill the whole tree.
//!
//! A [`Pool`] keeps sandboxes warm so the common case pays no set-up cost; results carry
//! an [`ExecStatus`] (ok, nonzero_exit, timeout, memory, output_limit, killed,
//! internal_error), exit code, output, wall and CPU time and peak memory.
//!
//! ```no_run
//! use streamrl_sandbox::{ExecRequest, ExecStatus, Limits, Pool, SandboxConfig};
//!
//! let pool = Pool::new(SandboxConfig::default()).unwrap();
//! let limits = Limits { wall_ms: 500, ..Limits::default() };
//! let r = pool.exec(&ExecRequest::python("while True: pass").with_limits(limits));
//! assert_eq!(r.status, ExecStatus::Timeout);
//! ```

pub mod host;
pub mod init;
pub mod pool;
pub mod protocol;
pub mod seccomp;
mod sys;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use host::Sandbox;
pub use pool::{Pool, PoolStats};
pub use protocol::{ExecRequest, ExecResult, ExecStatus, Limits};

/// Errors of the sandbox layer (a command's own failure is an [`ExecResult`], not this).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid (every problem listed).
    #[error("invalid sandbox configuration: {}", .0.join("; "))]
    Config(Vec<String>),
    /// The init binary was not found.
    #[error("the sandbox init binary was not found (looked at {}); build it with `cargo build` or set STREAMRL_SANDBOX_INIT", .0.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))]
    InitNotFound(Vec<PathBuf>),
    /// The init binary could not be started.
    #[error("cannot start {path}: {source}")]
    Spawn {
        /// The binary.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Setting up the sandbox failed (namespaces, mounts, uid maps).
    #[error("sandbox set-up failed: {0}")]
    Setup(String),
    /// A cgroup could not be created or configured (with `cgroups: required`).
    #[error("sandbox cgroup: {0}")]
    Cgroup(String),
    /// The init process broke the protocol or stopped answering.
    #[error("sandbox protocol: {0}")]
    Protocol(String),
    /// A file could not be written or read under `/work`.
    #[error("sandbox file: {0}")]
    File(String),
}

/// Whether to put each sandbox in cgroups for memory and process limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupMode {
    /// Use cgroups when the host lets us create them; otherwise rlimits only.
    #[default]
    Auto,
    /// Fail when cgroups cannot be used.
    Required,
    /// Never use cgroups.
    Off,
}

/// Configuration of sandboxes and their pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// The init binary (`streamrl-sandbox-init`, or a binary embedding it). Default:
    /// `$STREAMRL_SANDBOX_INIT`, else the running executable when it embeds the init (the
    /// `streamrl` CLI), else `streamrl-sandbox-init` next to the running executable or one
    /// directory up (see [`SandboxConfig::init_command`]).
    pub init: Option<PathBuf>,
    /// Host paths bound read-only at the same place inside (symlinks are recreated).
    /// Paths that do not exist on the host are skipped.
    pub ro_binds: Vec<String>,
    /// Size of the writable `/work` tmpfs in bytes.
    pub work_bytes: u64,
    /// Size of the `/tmp` tmpfs in bytes.
    pub tmp_bytes: u64,
    /// Sandboxes kept ready.
    pub pool_size: usize,
    /// The default and maximum limits of a command.
    pub limits: Limits,
    /// cgroup use.
    pub cgroups: CgroupMode,
    /// First host uid of the range sandboxes map their users to (two per sandbox).
    pub uid_base: u32,
    /// One-shot commands a sandbox serves before it is replaced. Between two commands it
    /// is reset: every process killed, `/work` and `/tmp` empty as mounted (remounted when
    /// the command changed them), System V IPC objects removed. 1: a new sandbox for every
    /// command.
    pub reuse: u32,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            init: None,
            ro_binds: [
                "/usr",
                "/bin",
                "/lib",
                "/lib32",
                "/lib64",
                "/sbin",
                "/etc/ld.so.cache",
                "/etc/alternatives",
            ]
            .map(String::from)
            .to_vec(),
            work_bytes: 64 << 20,
            tmp_bytes: 16 << 20,
            pool_size: 4,
            limits: Limits::default(),
            cgroups: CgroupMode::Auto,
            uid_base: 200_000,
            reuse: 256,
        }
    }
}

impl SandboxConfig {
    /// Every problem with the configuration.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errs = vec![];
        for p in &self.ro_binds {
            let under = |d: &str| p == d || p.starts_with(&format!("{d}/"));
            if !p.starts_with('/') {
                errs.push(format!("ro_binds: `{p}` must be an absolute path"));
            } else if p == "/" || ["/tmp", "/proc", "/dev", "/work"].iter().any(|d| under(d)) || p.contains("/../") {
                errs.push(format!(
                    "ro_binds: `{p}` may not be /, or under /tmp, /proc, /dev or /work"
                ));
            }
        }
        if self.reuse == 0 {
            errs.push("reuse = 0 must be at least 1".into());
        }
        if !(1..=1024).contains(&self.pool_size) {
            errs.push(format!("pool_size = {} must be in 1..=1024", self.pool_size));
        }
        if self.work_bytes < 1 << 20 {
            errs.push(format!("work_bytes = {} must be at least 1 MiB", self.work_bytes));
        }
        if self.tmp_bytes < 1 << 20 {
            errs.push(format!("tmp_bytes = {} must be at least 1 MiB", self.tmp_bytes));
        }
        errs.extend(self.limits.exceeding(&Limits {
            wall_ms: u64::MAX,
            cpu_secs: u64::MAX,
            address_space_bytes: u64::MAX,
            memory_bytes: u64::MAX,
            file_size_bytes: u64::MAX,
            processes: u64::MAX,
            open_files: u64::MAX,
            stdout_bytes: u64::MAX,
            stderr_bytes: u64::MAX,
        }));
        if errs.is_empty() { Ok(()) } else { Err(errs) }
    }

    /// The init binary this configuration uses.
    pub fn init_path(&self) -> Result<PathBuf, Error> {
        self.init_command().map(|(p, _)| p)
    }

    /// The init this configuration runs, as a program and the arguments before the
    /// configuration: [`init`](SandboxConfig::init) when set, else `$STREAMRL_SANDBOX_INIT`,
    /// else this executable itself when it embeds the init
    /// ([`init::run_if_invoked`]), else a
    /// `streamrl-sandbox-init` next to the running executable or one directory up (test
    /// binaries live in `deps/`).
    pub fn init_command(&self) -> Result<(PathBuf, Vec<&'static str>), Error> {
        if let Some(p) = &self.init {
            return Ok((p.clone(), Vec::new()));
        }
        if let Some(p) = std::env::var_os("STREAMRL_SANDBOX_INIT") {
            return Ok((PathBuf::from(p), Vec::new()));
        }
        let exe = std::env::current_exe();
        if crate::init::embedded()
            && let Ok(exe) = &exe
        {
            return Ok((exe.clone(), vec![crate::init::SUBCOMMAND]));
        }
        let mut tried = vec![];
        if let Ok(exe) = exe {
            for dir in exe.ancestors().skip(1).take(2) {
                let p = dir.join("streamrl-sandbox-init");
                if p.is_file() {
                    return Ok((p, Vec::new()));
                }
                tried.push(p);
            }
        }
        Err(Error::InitNotFound(tried))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_reports_every_problem() {
        let cfg = SandboxConfig {
            ro_binds: vec!["usr".into(), "/tmp/x".into(), "/".into()],
            pool_size: 0,
            work_bytes: 10,
            limits: Limits {
                wall_ms: 0,
                ..Limits::default()
            },
            ..SandboxConfig::default()
        };
        let errs = cfg.validate().unwrap_err();
        assert_eq!(errs.len(), 6, "{errs:?}");
        assert!(errs[0].contains("`usr` must be an absolute path"));
        assert!(errs[3].contains("pool_size = 0"));
        assert!(errs[5].contains("limits.wall_ms must be positive"));
        assert!(SandboxConfig::default().validate().is_ok());
    }
}

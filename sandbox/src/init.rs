//! The sandbox's init process: the `streamrl-sandbox-init` binary, or any binary that
//! calls [`run_if_invoked`] first (the `streamrl` CLI does, so it ships as one file).
//!
//! 1. Started by the host with an [`InitConfig`] as its argument, it unshares user, mount,
//!    pid, network, IPC, UTS and cgroup namespaces, writes one byte to stdout and waits
//!    for one byte on stdin while the host writes its uid/gid maps.
//! 2. It forks; the child is pid 1 of the new pid namespace (and dies with its parent).
//!    It builds a new root on a tmpfs: the `ro_binds` read-only, a fresh `/proc` that
//!    shows only the sandbox's processes, a `/dev` with null, zero, random and urandom,
//!    private `/work` and `/tmp` tmpfs mounts, then `pivot_root`s into it, drops the old
//!    root and makes `/` read-only. The network namespace has only a loopback that is
//!    down. It then answers `Ready`.
//! 3. Each `Exec` forks a command that gets a process group of its own and the rlimits,
//!    drops to the unprivileged uid (or every capability), sets `no_new_privs` and
//!    execs. It inherits the seccomp filter that the init's main thread installed on
//!    itself once set-up was done (a thread of the init without it replaces scratch
//!    mounts). Init feeds stdin, captures stdout/stderr up to their caps and enforces the
//!    wall clock. When the command ends, or on a timeout or output cap, `kill(-1,
//!    SIGKILL)` removes every process left in the namespace, so nothing a command starts
//!    outlives it.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use crate::protocol::{ExecRequest, InitConfig, RawExec, Request, Response, read_frame, write_frame};
use crate::{seccomp, sys};

/// Where the new root is assembled before `pivot_root` (in the init's private mount
/// namespace, so the host's `/tmp` is untouched).
const STAGING: &str = "/tmp";

/// The hidden first argument under which a host binary (the `streamrl` CLI) acts as the
/// init: `streamrl __sandbox-init CONFIG_JSON`, so one binary is all there is to ship.
pub const SUBCOMMAND: &str = "__sandbox-init";

static EMBEDDED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Call first thing in `main` of a binary that embeds the init (before any thread is
/// started: a multi-threaded process cannot enter a new user namespace). Invoked as
/// `BINARY __sandbox-init CONFIG_JSON`, it becomes the init and never returns; otherwise
/// it records that this executable can serve as the init, and sandboxes started from
/// this process run it (see [`SandboxConfig::init_command`](crate::SandboxConfig::init_command)).
pub fn run_if_invoked() {
    if std::env::args_os().nth(1).is_some_and(|a| a == SUBCOMMAND) {
        main()
    }
    EMBEDDED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether this process's executable embeds the init ([`run_if_invoked`] ran).
pub fn embedded() -> bool {
    EMBEDDED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Entry point of the init: `streamrl-sandbox-init CONFIG_JSON`, or
/// `BINARY __sandbox-init CONFIG_JSON` from a binary that embeds it.
pub fn main() -> ! {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().is_some_and(|a| a == SUBCOMMAND) {
        args.next();
    }
    let cfg: InitConfig = match args.next().map(|a| serde_json::from_str(&a)) {
        Some(Ok(c)) => c,
        Some(Err(e)) => fail(&format!("bad init configuration: {e}")),
        None => fail("usage: streamrl-sandbox-init CONFIG_JSON (started by the sandbox pool)"),
    };
    let flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP;
    if let Err(e) = sys::unshare(flags) {
        fail(&format!(
            "unshare(user, mount, pid, net, ipc, uts, cgroup namespaces): {e}"
        ));
    }
    // Handshake: the host writes our uid/gid maps, then answers.
    let mut stdout = io::stdout().lock();
    let mut stdin = io::stdin().lock();
    let mut b = [0u8; 1];
    if stdout.write_all(b"U").and_then(|_| stdout.flush()).is_err() || stdin.read_exact(&mut b).is_err() {
        fail("host went away during the uid map handshake");
    }
    // Become the mapped root of the new namespace (the host's ids are not mapped in it).
    if let Err(e) = sys::drop_to(0, 0) {
        fail(&format!("become root of the user namespace: {e}"));
    }
    match sys::fork() {
        Err(e) => fail(&format!("fork into the pid namespace: {e}")),
        Ok(sys::Fork::Parent(pid)) => {
            let status = sys::wait_blocking(pid).unwrap_or(1);
            sys::exit_now(if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                1
            })
        }
        Ok(sys::Fork::Child) => {
            let _ = sys::kill_with_parent();
            // The mounter thread first: it must not inherit the main thread's filter.
            let mounter = match build_root(&cfg).and_then(|()| Mounter::start(&cfg)).and_then(|m| {
                ctx(sys::install_thread_seccomp(&seccomp::filter()), || {
                    "install the seccomp filter".into()
                })
                .map(|()| m)
            }) {
                Ok(m) => m,
                Err(e) => {
                    let _ = write_frame(
                        &mut stdout,
                        &Response::Error {
                            message: format!("sandbox set-up: {e}"),
                        },
                        &[],
                    );
                    sys::exit_now(1);
                }
            };
            let _ = write_frame(&mut stdout, &Response::Ready, &[]);
            serve(&cfg, &mounter, &mut stdin, &mut stdout)
        }
    }
}

fn fail(msg: &str) -> ! {
    // The host reads this on stderr when the handshake fails.
    eprintln!("streamrl-sandbox-init: {msg}");
    sys::exit_now(2)
}

fn ctx<T>(r: io::Result<T>, what: impl FnOnce() -> String) -> io::Result<T> {
    r.map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", what())))
}

/// Mounts a fresh tmpfs at `at` with mount `flags` and tmpfs `options`; an error names
/// `what` was being mounted.
fn mount_tmpfs(at: &Path, flags: libc::c_ulong, options: &str, what: &str) -> io::Result<()> {
    ctx(
        sys::mount(Some("tmpfs"), at, Some("tmpfs"), flags, Some(options)),
        || format!("mount the tmpfs of {what}"),
    )
}

fn build_root(cfg: &InitConfig) -> io::Result<()> {
    let staging = Path::new(STAGING);
    ctx(
        sys::mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE, None),
        || "make / private".into(),
    )?;
    mount_tmpfs(
        staging,
        libc::MS_NOSUID | libc::MS_NODEV,
        "size=1m,mode=0755",
        "the new root",
    )?;
    let at = |p: &str| staging.join(p.trim_start_matches('/'));
    for d in ["dev", "proc", "work", "tmp", "etc", ".old"] {
        std::fs::create_dir_all(at(d))?;
    }
    bind_host_paths(cfg, &at)?;
    ctx(
        sys::mount(
            Some("proc"),
            &at("proc"),
            Some("proc"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            None,
        ),
        || "mount /proc".into(),
    )?;
    populate_dev(&at("dev"))?;
    mount_scratch(cfg, &at("work"), &at("tmp"))?;
    let owner = cfg.run_as.unwrap_or(0);
    std::fs::write(
        at("etc/passwd"),
        format!("root:x:0:0::/:/bin/sh\nsandbox:x:{owner}:{owner}::/work:/bin/sh\n"),
    )?;
    std::fs::write(at("etc/group"), format!("root:x:0:\nsandbox:x:{owner}:\n"))?;
    enter_root(staging, &at(".old"))
}

/// The host paths of `ro_binds`, bound read-only at the same place under the new root
/// (`at`); a symlink is copied as a symlink, a path missing on the host is skipped.
fn bind_host_paths(cfg: &InitConfig, at: &dyn Fn(&str) -> PathBuf) -> io::Result<()> {
    for host in &cfg.ro_binds {
        let hp = Path::new(host);
        let Ok(meta) = std::fs::symlink_metadata(hp) else {
            continue;
        };
        let target = at(host);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if meta.file_type().is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(hp)?, &target)?;
            continue;
        }
        if meta.is_dir() {
            std::fs::create_dir_all(&target)?;
        } else {
            std::fs::write(&target, b"")?;
        }
        bind_ro(hp, &target)?;
    }
    Ok(())
}

/// A minimal `/dev` at `dev`: null, zero, random and urandom bound from the host, the
/// IPC namespace's message queues, and the fd/stdin/stdout/stderr links.
fn populate_dev(dev: &Path) -> io::Result<()> {
    mount_tmpfs(dev, libc::MS_NOSUID | libc::MS_NOEXEC, "size=64k,mode=0755", "/dev")?;
    for name in ["null", "zero", "random", "urandom"] {
        let t = dev.join(name);
        std::fs::write(&t, b"")?;
        ctx(
            sys::mount(Some(&format!("/dev/{name}")), &t, None, libc::MS_BIND, None),
            || format!("bind /dev/{name}"),
        )?;
    }
    // POSIX message queues of the sandbox's IPC namespace, listed so a reset can remove
    // them (SysV objects are found through /proc/sysvipc).
    std::fs::create_dir(dev.join("mqueue"))?;
    ctx(
        sys::mount(
            Some("mqueue"),
            &dev.join("mqueue"),
            Some("mqueue"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            None,
        ),
        || "mount /dev/mqueue".into(),
    )?;
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, dev.join(name))?;
    }
    Ok(())
}

/// Makes `staging` the root (the old one detached from `old`), read-only, with its own
/// host name.
fn enter_root(staging: &Path, old: &Path) -> io::Result<()> {
    ctx(sys::pivot_root(staging, old), || "pivot_root".into())?;
    std::env::set_current_dir("/")?;
    ctx(sys::umount2(Path::new("/.old"), libc::MNT_DETACH), || {
        "detach the old root".into()
    })?;
    std::fs::remove_dir("/.old")?;
    let root_flags = sys::locked_mount_flags(Path::new("/"))?;
    ctx(
        sys::mount(
            None,
            Path::new("/"),
            None,
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | root_flags,
            None,
        ),
        || "make / read-only".into(),
    )?;
    ctx(sys::sethostname("sandbox"), || "sethostname".into())?;
    Ok(())
}

/// Mounts the writable tmpfs file systems: `/work` (owned by the command user) and `/tmp`.
fn mount_scratch(cfg: &InitConfig, work: &Path, tmp: &Path) -> io::Result<()> {
    let owner = cfg.run_as.unwrap_or(0);
    let flags = libc::MS_NOSUID | libc::MS_NODEV;
    let w = format!("size={},mode=0755,uid={owner},gid={owner}", cfg.work_bytes);
    mount_tmpfs(work, flags, &w, "/work")?;
    let t = format!("size={},mode=1777", cfg.tmp_bytes);
    mount_tmpfs(tmp, flags, &t, "/tmp")
}

/// Makes the sandbox as new: no processes, empty `/work` and `/tmp`, no IPC objects (SysV
/// and POSIX message queues).
///
/// Scratch mounts that the last command left as they were mounted (empty, root mode and
/// owner unchanged, no extended attributes) are kept: replacing them costs two unmounts
/// and two mounts under the mount namespace's locks, most of a reset, and most commands
/// (a test run, a tool call that prints) write nothing there.
fn reset(cfg: &InitConfig, mounter: &Mounter) -> io::Result<()> {
    if !sys::kill_and_reap_all(std::time::Duration::from_secs(5)) {
        return Err(io::Error::other("processes survived SIGKILL for 5 s"));
    }
    sys::ipc_remove_all();
    mqueue_remove_all()?;
    let owner = cfg.run_as.unwrap_or(0);
    if pristine(Path::new("/work"), 0o755, owner) && pristine(Path::new("/tmp"), 0o1777, 0) {
        return Ok(());
    }
    mounter.replace_scratch()
}

/// Removes every POSIX message queue of the sandbox's IPC namespace (a queue a command
/// made would otherwise outlive the reset and be read by the next command).
fn mqueue_remove_all() -> io::Result<()> {
    for entry in ctx(std::fs::read_dir("/dev/mqueue"), || "list /dev/mqueue".into())? {
        let path = entry?.path();
        ctx(std::fs::remove_file(&path), || {
            format!("remove message queue {}", path.display())
        })?;
    }
    Ok(())
}

/// Whether the scratch mount at `dir` is as [`mount_scratch`] left it: no entries, its
/// root's mode and owner as mounted, no extended attributes.
fn pristine(dir: &Path, mode: u32, owner: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::symlink_metadata(dir) else {
        return false;
    };
    md.is_dir()
        && md.mode() & 0o7777 == mode
        && md.uid() == owner
        && md.gid() == owner
        && sys::xattr_names_len(dir).is_ok_and(|n| n == 0)
        && std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none())
}

fn bind_ro(src: &Path, target: &Path) -> io::Result<()> {
    ctx(
        sys::mount(
            Some(&src.to_string_lossy()),
            target,
            None,
            libc::MS_BIND | libc::MS_REC,
            None,
        ),
        || format!("bind {}", src.display()),
    )?;
    let locked = sys::locked_mount_flags(src)?;
    ctx(
        sys::mount(
            None,
            target,
            None,
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | locked,
            None,
        ),
        || format!("make {} read-only", src.display()),
    )
}

/// Replaces the scratch mounts for the main thread, which carries the seccomp filter
/// (`mount` and `umount2` are among what it refuses). A filter belongs to the thread that
/// installs it and is inherited by what that thread clones: with it on the main thread,
/// every command inherits it without the kernel compiling it again (~0.1 ms per
/// command), and only a reset that finds a scratch mount changed asks this unfiltered
/// thread.
struct Mounter {
    to: mpsc::Sender<()>,
    from: mpsc::Receiver<io::Result<()>>,
}

impl Mounter {
    fn start(cfg: &InitConfig) -> io::Result<Mounter> {
        let (to, asks) = mpsc::channel::<()>();
        let (done, from) = mpsc::channel();
        let cfg = cfg.clone();
        std::thread::Builder::new().name("mounter".into()).spawn(move || {
            for () in asks {
                let replaced = ["/work", "/tmp"]
                    .into_iter()
                    .try_for_each(|d| ctx(sys::umount2(Path::new(d), libc::MNT_DETACH), || format!("unmount {d}")))
                    .and_then(|()| mount_scratch(&cfg, Path::new("/work"), Path::new("/tmp")));
                if done.send(replaced).is_err() {
                    return;
                }
            }
        })?;
        Ok(Mounter { to, from })
    }

    /// Fresh `/work` and `/tmp` mounts in place of the ones there.
    fn replace_scratch(&self) -> io::Result<()> {
        self.to
            .send(())
            .ok()
            .and_then(|()| self.from.recv().ok())
            .unwrap_or_else(|| Err(io::Error::other("the mounter thread exited")))
    }
}

fn serve(cfg: &InitConfig, mounter: &Mounter, stdin: &mut impl Read, stdout: &mut impl Write) -> ! {
    loop {
        let (req, blobs): (Request, Vec<Vec<u8>>) = match read_frame(stdin) {
            Ok(r) => r,
            Err(_) => sys::exit_now(0), // the host closed the pipe: the sandbox is done
        };
        let blob = blobs.into_iter().next().unwrap_or_default();
        let (resp, out): (Response, Vec<u8>) = match req {
            Request::Exec(mut e) => {
                e.stdin = blob;
                (Response::Exec(exec(cfg, &e)), vec![])
            }
            Request::ExecThenReset(mut e) => {
                e.stdin = blob;
                let mut raw = exec(cfg, &e);
                raw.reset_error = reset(cfg, mounter).err().map(|e| format!("reset: {e}"));
                (Response::Exec(raw), vec![])
            }
            Request::WriteFile { path, mode } => {
                match work_path(&path).and_then(|p| write_file(cfg, &p, mode, &blob)) {
                    Ok(()) => (Response::Written, vec![]),
                    Err(e) => (
                        Response::Error {
                            message: format!("write {path}: {e}"),
                        },
                        vec![],
                    ),
                }
            }
            Request::Reset => match reset(cfg, mounter) {
                Ok(()) => (Response::Ready, vec![]),
                Err(e) => (
                    Response::Error {
                        message: format!("reset: {e}"),
                    },
                    vec![],
                ),
            },
            Request::ReadFile { path, max_bytes } => match work_path(&path).and_then(|p| read_file(cfg, &p, max_bytes))
            {
                Ok(data) => (Response::File, data),
                Err(e) => (
                    Response::Error {
                        message: format!("read {path}: {e}"),
                    },
                    vec![],
                ),
            },
        };
        let blobs: Vec<&[u8]> = if out.is_empty() { vec![] } else { vec![&out] };
        if write_frame(stdout, &resp, &blobs).is_err() {
            sys::exit_now(0);
        }
    }
}

/// Opens `/work/<rel>` without following any symbolic link on the way (a command may have
/// planted `/work/d -> /proc/1` or `-> /dev`): each directory is opened with
/// `O_NOFOLLOW | O_DIRECTORY` relative to the one before (created when `create`), the file
/// itself with `O_NOFOLLOW`. The caller acts with the command's credentials.
fn open_beneath(rel: &Path, flags: libc::c_int, mode: u32, create: bool) -> io::Result<std::fs::File> {
    use std::os::unix::ffi::OsStrExt;
    let names: Vec<CString> = rel
        .components()
        .map(|c| match c {
            Component::Normal(n) => CString::new(n.as_bytes())
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in the path")),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "path must stay under /work",
            )),
        })
        .collect::<io::Result<_>>()?;
    let Some((last, dirs)) = names.split_last() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "path names no file"));
    };
    let open_at = |dir: libc::c_int, name: &CString, flags: libc::c_int, mode: u32| -> io::Result<std::fs::File> {
        sys::openat(dir, name, flags | libc::O_NOFOLLOW, mode).map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::ENOTDIR) if flags & libc::O_DIRECTORY != 0 => io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "`{}` is a symbolic link or not a directory; the file API follows no link",
                    name.to_string_lossy()
                ),
            ),
            Some(libc::ELOOP) => io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "`{}` is a symbolic link, which the file API does not follow",
                    name.to_string_lossy()
                ),
            ),
            _ => e,
        })
    };
    let mut dir = open_at(
        libc::AT_FDCWD,
        &CString::new("/work").expect("no NUL"),
        libc::O_DIRECTORY | libc::O_RDONLY,
        0,
    )?;
    for name in dirs {
        let flags = libc::O_DIRECTORY | libc::O_RDONLY;
        dir = match open_at(dir.as_raw_fd(), name, flags, 0) {
            Err(e) if create && e.raw_os_error() == Some(libc::ENOENT) => {
                sys::mkdirat(dir.as_raw_fd(), name, 0o755)?;
                open_at(dir.as_raw_fd(), name, flags, 0)?
            }
            r => r?,
        };
    }
    open_at(dir.as_raw_fd(), last, flags, mode)
}

/// Runs `f` with the file-system identity of the command user (`run_as`), so uploads are
/// theirs and a download reads only what they could: the init itself is root in the
/// sandbox. Per thread (`setfsuid`), restored after.
fn as_command_user<T>(cfg: &InitConfig, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    let Some(uid) = cfg.run_as else {
        return f();
    };
    sys::set_fs_ids(uid);
    let r = f();
    sys::set_fs_ids(0);
    r
}

fn work_path(p: &str) -> io::Result<PathBuf> {
    crate::protocol::work_relative(p).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

fn write_file(cfg: &InitConfig, rel: &Path, mode: u32, data: &[u8]) -> io::Result<()> {
    as_command_user(cfg, || {
        let mut f = open_beneath(rel, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC, mode & 0o777, true)?;
        f.write_all(data)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode & 0o777))
    })
}

fn read_file(cfg: &InitConfig, rel: &Path, max: u64) -> io::Result<Vec<u8>> {
    as_command_user(cfg, || {
        let f = open_beneath(rel, libc::O_RDONLY, 0, false)?;
        let md = f.metadata()?;
        if !md.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
        }
        let len = md.len();
        if len > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("file is {len} bytes, over the limit of {max}"),
            ));
        }
        let mut v = Vec::with_capacity(len as usize);
        f.take(max).read_to_end(&mut v)?;
        Ok(v)
    })
}

/// The command's program (looked up on its `PATH`), arguments, environment, directory,
/// limits and identity, ready for [`sys::spawn`].
fn spawn_spec(cfg: &InitConfig, req: &ExecRequest) -> io::Result<sys::SpawnSpec> {
    let c = |s: &str, what: &str| {
        CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("NUL byte in {what}")))
    };
    let mut env: BTreeMap<&str, &str> = [
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("HOME", "/work"),
        ("TMPDIR", "/tmp"),
        ("LANG", "C.UTF-8"),
    ]
    .into_iter()
    .collect();
    for (k, v) in &req.env {
        env.insert(k, v);
    }
    let prog = &req.argv[0];
    let path = if prog.contains('/') {
        prog.clone()
    } else {
        env["PATH"]
            .split(':')
            .map(|d| format!("{}/{prog}", if d.is_empty() { "." } else { d }))
            .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "No such file or directory (os error 2)"))?
    };
    let l = req.limits;
    Ok(sys::SpawnSpec {
        path: c(&path, "the program")?,
        argv: req
            .argv
            .iter()
            .map(|a| c(a, "an argument"))
            .collect::<io::Result<_>>()?,
        envp: env
            .iter()
            .map(|(k, v)| c(&format!("{k}={v}"), "the environment"))
            .collect::<io::Result<_>>()?,
        cwd: c(req.cwd.as_deref().unwrap_or("/work"), "the working directory")?,
        rlimits: [
            (libc::RLIMIT_CPU, l.cpu_secs, l.cpu_secs + 1),
            (libc::RLIMIT_AS, l.address_space_bytes, l.address_space_bytes),
            (libc::RLIMIT_FSIZE, l.file_size_bytes, l.file_size_bytes),
            (libc::RLIMIT_NOFILE, l.open_files, l.open_files),
            (libc::RLIMIT_CORE, 0, 0),
        ]
        .into_iter()
        .chain(cfg.run_as.map(|_| (libc::RLIMIT_NPROC, l.processes, l.processes)))
        .collect(),
        run_as: cfg.run_as,
    })
}

/// How often the tree's CPU time is looked at.
const CPU_CHECK: std::time::Duration = std::time::Duration::from_millis(50);

fn exec(cfg: &InitConfig, req: &ExecRequest) -> RawExec {
    let started = Instant::now();
    let cpu_before = sys::children_cpu_ms();
    let mut raw = RawExec::default();
    if req.argv.is_empty() {
        raw.spawn_error = Some("argv is empty".into());
        return raw;
    }
    let l = req.limits;
    let child = match spawn_spec(cfg, req).and_then(|spec| sys::spawn(&spec)) {
        Ok(c) => c,
        Err(e) => {
            raw.exit_code = Some(127);
            raw.spawn_error = Some(format!("cannot run `{}`: {e}", req.argv[0]));
            raw.stderr = raw.spawn_error.clone().unwrap_or_default();
            return raw;
        }
    };
    let pid = child.pid;
    let pidfd = sys::pidfd_open(pid).ok();
    // EOF at once when there is nothing to write.
    let mut stdin = Feed::new(std::fs::File::from(child.stdin), !req.stdin.is_empty());
    let mut out = Capture::new(std::fs::File::from(child.stdout), l.stdout_bytes, "stdout");
    let mut err = Capture::new(std::fs::File::from(child.stderr), l.stderr_bytes, "stderr");
    let mut exit = None;
    let mut buf = vec![0u8; 64 << 10];
    let deadline = started + std::time::Duration::from_millis(l.wall_ms);
    let mut watch = Watch {
        deadline,
        next_cpu_check: started + CPU_CHECK,
        cpu_before,
        cpu_limit_ms: l.cpu_secs.saturating_mul(1000),
        tree_cpu_over: false,
    };
    while exit.is_none() || out.open || err.open {
        if exit.is_none() {
            exit = sys::try_wait(pid).ok().flatten();
            if exit.is_some() && !sys::reap_ended() {
                // Whatever the command left running dies with it, so its pipes close.
                sys::kill_all();
            }
        }
        let now = Instant::now();
        if exit.is_none() {
            watch.enforce(now, &mut raw);
        }
        // Over a limit, drain what is buffered without waiting for more.
        if (raw.output_limit.is_some() || raw.timed_out) && exit.is_some() {
            break;
        }
        // With a pidfd, poll wakes at the exit; without one, look every 2 ms.
        let exit_fd = pidfd.as_ref().filter(|_| exit.is_none()).map(|p| p.as_raw_fd());
        let cap = if exit_fd.is_some() { CPU_CHECK.as_millis() } else { 2 };
        let wait = if exit.is_some() {
            0
        } else {
            deadline.saturating_duration_since(now).as_millis().clamp(1, cap) as i32
        };
        wait_for_io(&[&out, &err], &stdin, exit_fd, wait);
        stdin.write(&req.stdin);
        for c in [&mut out, &mut err] {
            if c.read(&mut buf) && raw.output_limit.is_none() {
                raw.output_limit = Some(c.name.to_string());
                sys::kill_all();
            }
        }
    }
    // Nothing the command started outlives it (zombies included, so a reused sandbox
    // starts empty).
    sys::kill_and_reap_all(std::time::Duration::from_secs(2));
    let exit = exit.expect("loop ends after the exit");
    raw.exit_code = exit.code;
    raw.signal = exit.signal;
    raw.stdout = String::from_utf8_lossy(&out.data).into_owned();
    raw.stderr = String::from_utf8_lossy(&err.data).into_owned();
    raw.wall_ms = started.elapsed().as_secs_f64() * 1e3;
    raw.cpu_ms = sys::children_cpu_ms().saturating_sub(cpu_before).max(exit.cpu_ms);
    raw.max_rss_bytes = exit.max_rss_bytes;
    raw
}

/// Waits up to `wait` ms until an open output has data, stdin has room, or the command
/// exits (its pidfd is readable).
fn wait_for_io(outputs: &[&Capture], stdin: &Feed, exit_fd: Option<std::os::fd::RawFd>, wait: i32) {
    let mut fds: Vec<_> = outputs
        .iter()
        .filter(|c| c.open)
        .map(|c| (c.file.as_raw_fd(), libc::POLLIN))
        .collect();
    fds.extend(stdin.fd().map(|fd| (fd, libc::POLLOUT)));
    fds.extend(exit_fd.map(|fd| (fd, libc::POLLIN)));
    if fds.is_empty() {
        std::thread::sleep(std::time::Duration::from_millis(wait as u64));
    } else {
        let _ = sys::poll(&fds, wait);
    }
}

/// The wall-clock and tree-CPU limits of a running command.
struct Watch {
    deadline: Instant,
    next_cpu_check: Instant,
    cpu_before: u64,
    cpu_limit_ms: u64,
    tree_cpu_over: bool,
}

impl Watch {
    /// Kills the tree once the command is past its wall-clock deadline (recorded as timed
    /// out) or its tree's CPU time.
    fn enforce(&mut self, now: Instant, raw: &mut RawExec) {
        if now >= self.deadline && !raw.timed_out {
            raw.timed_out = true;
            sys::kill_all();
        }
        // `RLIMIT_CPU` binds each process; the limit is on the tree (six busy children
        // must not get six times the CPU). Killed with SIGKILL over it, which the host
        // reports as the CPU limit.
        if !self.tree_cpu_over && now >= self.next_cpu_check {
            self.next_cpu_check = now + CPU_CHECK;
            if sys::tree_cpu_ms().saturating_sub(self.cpu_before) >= self.cpu_limit_ms {
                self.tree_cpu_over = true;
                sys::kill_all();
            }
        }
    }
}

/// The command's stdin (non-blocking) and how much of the request's input it has taken.
struct Feed {
    file: Option<std::fs::File>,
    written: usize,
}

impl Feed {
    fn new(file: std::fs::File, anything: bool) -> Self {
        let _ = sys::set_nonblocking(file.as_raw_fd());
        Feed {
            file: anything.then_some(file),
            written: 0,
        }
    }

    /// The pipe to poll for room, while there is something left to write.
    fn fd(&self) -> Option<std::os::fd::RawFd> {
        self.file.as_ref().map(|f| f.as_raw_fd())
    }

    /// Writes what the pipe takes of the rest of `input`; closes it at the end (EOF) or
    /// when the command stopped reading.
    fn write(&mut self, input: &[u8]) {
        let Some(f) = &mut self.file else { return };
        match f.write(&input[self.written..]) {
            Ok(n) => {
                self.written += n;
                if self.written >= input.len() {
                    self.file = None;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => self.file = None,
        }
    }
}

/// One output stream of the command (non-blocking), kept up to its cap.
struct Capture {
    file: std::fs::File,
    open: bool,
    data: Vec<u8>,
    cap: usize,
    name: &'static str,
}

impl Capture {
    fn new(file: std::fs::File, cap: u64, name: &'static str) -> Self {
        let _ = sys::set_nonblocking(file.as_raw_fd());
        Capture {
            file,
            open: true,
            data: Vec::new(),
            cap: cap as usize,
            name,
        }
    }

    /// Reads everything available now (closed at EOF); whether the stream went past its
    /// cap (what is past it is dropped).
    fn read(&mut self, buf: &mut [u8]) -> bool {
        let mut over = false;
        while self.open {
            match self.file.read(buf) {
                Ok(0) => self.open = false,
                Ok(n) => {
                    let room = self.cap.saturating_sub(self.data.len());
                    self.data.extend_from_slice(&buf[..n.min(room)]);
                    over |= n > room;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => self.open = false,
            }
        }
        over
    }
}

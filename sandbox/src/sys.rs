//! The only module with `unsafe`: thin, checked wrappers over the Linux system calls the
//! sandbox needs (namespaces, mounts, rlimits, seccomp, signals, poll). Every wrapper
//! turns a `-1` into the `errno` as an [`std::io::Error`].
//!
//! Calls go through `rustix`'s safe wrappers wherever it has one (pivot_root, unmount,
//! statvfs, listxattr, sethostname, the parent-death signal, uid/gid/groups, kill of one
//! pid, pidfd_open, pipes, no_new_privs, ids, clock ticks). `unsafe` stays only where it
//! has none or where its wrapper would change what is called, each with a SAFETY note:
//! `unshare` (rustix's is unsafe too), `fork` and `clone` with the child's pre-exec steps,
//! `mount` with a null source or type (rustix's `mount` always passes both), `kill(-1)`,
//! `wait4` and `getrusage` (resource usage), `poll` and `fcntl` on raw descriptors,
//! `_exit`, capability sets by number, System V IPC, and the seccomp program itself
//! (hand-written in [`crate::seccomp`]: its binary search over syscall numbers is
//! measured and tested there).
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))
}

/// `unshare(2)`.
pub fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: plain system call with an integer argument.
    check(unsafe { libc::unshare(flags) }).map(|_| ())
}

/// `fork(2)`. Only called by the init process, which is single-threaded.
pub enum Fork {
    /// In the parent: the child's pid.
    Parent(libc::pid_t),
    /// In the child.
    Child,
}

/// `fork(2)`; the caller must be single-threaded.
pub fn fork() -> io::Result<Fork> {
    // SAFETY: the init process is single-threaded, so the child inherits no locks held by
    // other threads.
    match check(unsafe { libc::fork() })? {
        0 => Ok(Fork::Child),
        pid => Ok(Fork::Parent(pid)),
    }
}

/// `mount(2)`.
pub fn mount(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let src = src.map(|s| CString::new(s).expect("no NUL"));
    let fstype = fstype.map(|s| CString::new(s).expect("no NUL"));
    let data = data.map(|s| CString::new(s).expect("no NUL"));
    let target = cstr(target)?;
    // SAFETY: all pointers are valid NUL-terminated strings or null, alive for the call.
    check(unsafe {
        libc::mount(
            src.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            target.as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            data.as_ref().map_or(std::ptr::null(), |s| s.as_ptr().cast()),
        )
    })
    .map(|_| ())
}

/// `umount2(2)`.
pub fn umount2(target: &Path, flags: libc::c_int) -> io::Result<()> {
    Ok(rustix::mount::unmount(
        target,
        rustix::mount::UnmountFlags::from_bits_retain(flags as u32),
    )?)
}

/// The size of the list of extended attribute names of `path` (`llistxattr(2)`, not
/// following a final symlink): 0 when it has none.
pub fn xattr_names_len(path: &Path) -> io::Result<usize> {
    Ok(rustix::fs::llistxattr_query(path)?)
}

/// `pivot_root(2)`.
pub fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    Ok(rustix::process::pivot_root(new_root, put_old)?)
}

/// The mount flags (`ST_*` as `MS_*`) of the file system holding `path`, which a
/// read-only bind remount inside a user namespace must keep.
pub fn locked_mount_flags(path: &Path) -> io::Result<libc::c_ulong> {
    let st = rustix::fs::statvfs(path)?;
    let f_flag = st.f_flag.bits();
    let mut flags = 0;
    for (st_flag, ms_flag) in [
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if f_flag & st_flag != 0 {
            flags |= ms_flag;
        }
    }
    Ok(flags)
}

/// `sethostname(2)`.
pub fn sethostname(name: &str) -> io::Result<()> {
    Ok(rustix::system::sethostname(name.as_bytes())?)
}

/// `prctl(PR_SET_PDEATHSIG, SIGKILL)`: this process is killed when its parent dies.
pub fn kill_with_parent() -> io::Result<()> {
    Ok(rustix::process::set_parent_process_death_signal(Some(
        rustix::process::Signal::KILL,
    ))?)
}

/// Drops to `uid`/`gid` with no supplementary groups. The system calls act on the calling
/// thread only (as the raw calls do; glibc's wrappers would signal every thread): the
/// callers are single-threaded (the sandbox's init after `unshare`).
pub fn drop_to(uid: libc::uid_t, gid: libc::gid_t) -> io::Result<()> {
    use rustix::process::{Gid, Uid};
    let (uid, gid) = (Uid::from_raw(uid), Gid::from_raw(gid));
    rustix::thread::set_thread_groups(&[])?;
    rustix::thread::set_thread_res_gid(gid, gid, gid)?;
    rustix::thread::set_thread_res_uid(uid, uid, uid)?;
    Ok(())
}

/// Clears every capability set of the calling thread (effective, permitted, inheritable)
/// and the bounding set, for a process that stays uid 0 inside its user namespace.
pub fn drop_all_capabilities() -> io::Result<()> {
    for cap in 0..64 {
        // SAFETY: integer arguments; EINVAL past the last capability ends the loop.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } == -1 {
            break;
        }
    }
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut h = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let d = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset takes a header and two data structs (version 3 layout).
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr()) };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `kill(pid, SIGKILL)` for one process.
pub fn kill(pid: libc::pid_t) -> io::Result<()> {
    let pid = rustix::process::Pid::from_raw(pid)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("pid {pid} names no one process")))?;
    Ok(rustix::process::kill_process(pid, rustix::process::Signal::KILL)?)
}

/// `kill(-1, SIGKILL)`: every process this one may signal (in a pid namespace's init:
/// every other process of the namespace).
pub fn kill_all() {
    // SAFETY: integer arguments (rustix has no wrapper for pid -1).
    unsafe { libc::kill(-1, libc::SIGKILL) };
}

/// How a child ended, with its resource usage.
#[derive(Debug, Clone, Copy)]
pub struct Exit {
    /// Exit code, when it exited.
    pub code: Option<i32>,
    /// Signal, when a signal killed it.
    pub signal: Option<i32>,
    /// User + system CPU time in milliseconds.
    pub cpu_ms: u64,
    /// Peak resident set size in bytes.
    pub max_rss_bytes: u64,
}

fn tv_ms(tv: libc::timeval) -> u64 {
    tv.tv_sec as u64 * 1000 + tv.tv_usec as u64 / 1000
}

/// `wait4(pid, WNOHANG)`: `None` while it runs.
pub fn try_wait(pid: libc::pid_t) -> io::Result<Option<Exit>> {
    let mut status = 0;
    // SAFETY: out-pointers to live locals.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = check(unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) })?;
    if r == 0 {
        return Ok(None);
    }
    Ok(Some(Exit {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
        cpu_ms: tv_ms(ru.ru_utime) + tv_ms(ru.ru_stime),
        max_rss_bytes: ru.ru_maxrss as u64 * 1024,
    }))
}

/// Blocking `waitpid(pid)`; returns the raw status.
pub fn wait_blocking(pid: libc::pid_t) -> io::Result<libc::c_int> {
    let mut status = 0;
    loop {
        // SAFETY: out-pointer to a live local.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(status);
    }
}

/// CPU milliseconds of all reaped children of this process.
pub fn children_cpu_ms() -> u64 {
    // SAFETY: out-pointer to a live zeroed struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    tv_ms(ru.ru_utime) + tv_ms(ru.ru_stime)
}

/// CPU time of the whole process tree under this pid namespace's init, in ms: everything
/// reaped so far ([`children_cpu_ms`]) plus every live process's own and waited-for
/// children's time from `/proc/PID/stat` (pid 1, the init itself, aside). For a limit on
/// the tree: `RLIMIT_CPU` counts per process.
pub fn tree_cpu_ms() -> u64 {
    let hz = rustix::param::clock_ticks_per_second().max(1);
    let mut ticks = 0u64;
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let name = e.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if pid == 1 {
                continue;
            }
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // Fields after the command name: state is field 3, utime 14 ... cstime 17.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            ticks += rest
                .split_whitespace()
                .skip(11)
                .take(4)
                .filter_map(|f| f.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    children_cpu_ms() + ticks * 1000 / hz
}

/// `poll(2)` on `(fd, events)`; returns the `revents` per fd.
pub fn poll(fds: &[(RawFd, i16)], timeout_ms: i32) -> io::Result<Vec<i16>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events)| libc::pollfd { fd, events, revents: 0 })
        .collect();
    loop {
        // SAFETY: pointer and length of a live pollfd vector.
        let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(p.iter().map(|p| p.revents).collect());
    }
}

/// Sets `O_NONBLOCK` on a file descriptor.
pub fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd the caller owns.
    let flags = check(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    check(unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) }).map(|_| ())
}

/// The effective uid of this process.
pub fn geteuid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The effective gid of this process.
pub fn getegid() -> u32 {
    rustix::process::getegid().as_raw()
}

/// Exits at once without running destructors (the child half of a fork).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns.
    unsafe { libc::_exit(code) }
}

/// `pidfd_open(2)`: a file descriptor that polls readable when `pid` exits.
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<std::os::fd::OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("pid {pid} names no one process")))?;
    Ok(rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?)
}

/// Whether the calling process's IPC namespace holds any System V shared-memory segment,
/// semaphore set or message queue (three `*_INFO` calls, no file reads).
fn ipc_in_use() -> bool {
    // SAFETY: each call writes at most the struct it is given (SHM_INFO writes a
    // `struct shm_info`, which is smaller than the `shmid_ds` buffer passed).
    unsafe {
        let mut shm: libc::shmid_ds = std::mem::zeroed();
        // A failed query counts as in use: the listing then decides.
        let shm_used = libc::shmctl(0, SHM_INFO, &mut shm) == -1 || {
            // struct shm_info starts with `int used_ids`.
            let used_ids = *(&shm as *const libc::shmid_ds).cast::<libc::c_int>();
            used_ids > 0
        };
        let mut sem: libc::seminfo = std::mem::zeroed();
        let sem_used = libc::semctl(0, 0, libc::SEM_INFO, &mut sem as *mut libc::seminfo) == -1 || sem.semusz > 0;
        let mut msg: libc::msginfo = std::mem::zeroed();
        let msg_used =
            libc::msgctl(0, libc::MSG_INFO, (&mut msg as *mut libc::msginfo).cast()) == -1 || msg.msgpool > 0;
        shm_used || sem_used || msg_used
    }
}

/// `SHM_INFO` (linux/shm.h; not exported by the libc crate).
const SHM_INFO: libc::c_int = 14;

/// Removes every System V shared-memory segment, semaphore set and message queue of the
/// calling process's IPC namespace (as listed in `/proc/sysvipc`, read only when the
/// namespace holds any).
pub fn ipc_remove_all() {
    if !ipc_in_use() {
        return;
    }
    for (file, kind) in [("shm", 0), ("sem", 1), ("msg", 2)] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/sysvipc/{file}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            // Columns: key, id, ...
            let Some(id) = line
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse::<libc::c_int>().ok())
            else {
                continue;
            };
            // SAFETY: IPC_RMID takes no buffer (null is allowed).
            unsafe {
                match kind {
                    0 => libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()),
                    1 => libc::semctl(id, 0, libc::IPC_RMID),
                    _ => libc::msgctl(id, libc::IPC_RMID, std::ptr::null_mut()),
                };
            }
        }
    }
}

/// Reaps every child that has ended; true when none is left at all. For the pid 1 of a
/// pid namespace that means the namespace holds no other process: every process in it
/// descends from pid 1, and orphans are handed to it.
pub fn reap_ended() -> bool {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with an out-pointer to a live local.
        let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if r > 0 {
            continue;
        }
        if r == -1 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return r == -1; // ECHILD: nothing left; 0: some still run
    }
}

/// Kills every other process of the pid namespace (the caller is its pid 1) and reaps
/// them all, waiting up to `limit` for the last to die. False if some survived. Sends
/// nothing when every process has already ended (`kill(-1)` walks the host's whole
/// process list).
pub fn kill_and_reap_all(limit: std::time::Duration) -> bool {
    let end = std::time::Instant::now() + limit;
    let mut killed = false;
    while !reap_ended() {
        if killed {
            if std::time::Instant::now() >= end {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        kill_all();
        killed = true;
    }
    true
}

/// What the child does between `clone` and `execve` (see [`spawn`]).
pub struct SpawnSpec {
    /// The program (already looked up on `PATH`).
    pub path: CString,
    /// Its arguments, `argv[0]` first.
    pub argv: Vec<CString>,
    /// Its whole environment, `KEY=VALUE`.
    pub envp: Vec<CString>,
    /// Its working directory.
    pub cwd: CString,
    /// `(resource, soft, hard)` limits.
    pub rlimits: Vec<(libc::__rlimit_resource_t, u64, u64)>,
    /// Drop to this uid/gid; `None`: stay uid 0 and drop every capability.
    pub run_as: Option<libc::uid_t>,
}

/// A spawned child and the host ends of its standard streams.
pub struct Spawned {
    /// Its pid.
    pub pid: libc::pid_t,
    /// Write end of its stdin.
    pub stdin: std::os::fd::OwnedFd,
    /// Read end of its stdout.
    pub stdout: std::os::fd::OwnedFd,
    /// Read end of its stderr.
    pub stderr: std::os::fd::OwnedFd,
}

/// The steps of the child, in order; a failing step is reported by its index.
const SPAWN_STEPS: [&str; 7] = [
    "set up stdio",
    "chdir",
    "setpgid",
    "setrlimit",
    "drop privileges",
    "no_new_privs",
    "exec",
];

struct ChildArgs<'a> {
    spec: &'a SpawnSpec,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    /// Child ends: stdin read, stdout write, stderr write.
    fds: [RawFd; 3],
    /// Set by a child whose step failed: `(step + 1) << 32 | errno`. The parent reads it
    /// once the child has exec'd or exited (it is suspended until then).
    report: std::sync::atomic::AtomicU64,
}

fn pipe() -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    Ok(rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?)
}

/// Installs a seccomp filter on the calling thread only (no `TSYNC`): what that thread
/// clones from now on inherits it, the process's other threads stay unfiltered. Also sets
/// `no_new_privs` on the thread (inherited likewise). The kernel compiles the program
/// and runs it once per system call number here (its action cache), ~0.1 ms, which is
/// why a filter is installed once and inherited rather than installed per command.
pub fn install_thread_seccomp(filter: &[libc::sock_filter]) -> io::Result<()> {
    let prog = libc::sock_fprog {
        len: u16::try_from(filter.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "seccomp program too long"))?,
        filter: filter.as_ptr().cast_mut(),
    };
    rustix::thread::set_no_new_privs(true)?;
    // SAFETY: prctl with integer arguments and a pointer to a live program (rustix has no
    // seccomp wrapper).
    check(unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER as libc::c_ulong,
            &prog as *const libc::sock_fprog as libc::c_ulong,
            0,
            0,
        )
    })
    .map(|_| ())
}

/// Starts `spec` the way `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)`, so the
/// child borrows this process's memory until it execs instead of copying its page tables
/// (a `fork` of the init costs about as much as the rest of an exec). The child runs only
/// raw system calls: stdio onto pipes, chdir, a process group of its own, rlimits, the
/// unprivileged ids (or no capabilities), `no_new_privs`, `execve`. The child inherits
/// the calling thread's seccomp filter (see [`install_thread_seccomp`]).
/// A step that fails is written to memory the parent reads when it resumes (as glibc's
/// `posix_spawn` does) and the child exits with 127.
pub fn spawn(spec: &SpawnSpec) -> io::Result<Spawned> {
    use std::os::fd::AsRawFd;
    let (in_r, in_w) = pipe()?;
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    let nul_terminated = |v: &[CString]| -> Vec<*const libc::c_char> {
        v.iter()
            .map(|s| s.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    };
    let args = ChildArgs {
        spec,
        argv: nul_terminated(&spec.argv),
        envp: nul_terminated(&spec.envp),
        fds: [in_r.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
        report: std::sync::atomic::AtomicU64::new(0),
    };
    // Uninitialised: the child only pushes onto it (no zero fill of 256 KiB per command).
    let mut stack: Vec<std::mem::MaybeUninit<u8>> = Vec::with_capacity(256 << 10);
    let stack_len = stack.capacity();
    // The stack grows down from its 16-byte-aligned end.
    let top = (stack.as_mut_ptr() as usize + stack_len) & !15;
    // Signals stay blocked across the clone so that no handler of ours runs on the
    // borrowed memory; the child unblocks them just before it execs.
    // SAFETY: sigset out-pointers to live locals.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
    }
    // SAFETY: `child` only reads `args` (alive until clone returns: with CLONE_VFORK this
    // thread is suspended until the child has exec'd or exited) and makes raw system
    // calls; it runs on `stack`, which outlives it for the same reason.
    let pid = unsafe {
        libc::clone(
            child,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &args as *const ChildArgs as *mut libc::c_void,
        )
    };
    let clone_err = io::Error::last_os_error();
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    drop(stack);
    if pid == -1 {
        return Err(clone_err);
    }
    drop((in_r, out_w, err_w));
    let report = args.report.load(std::sync::atomic::Ordering::Acquire);
    if report != 0 {
        let _ = wait_blocking(pid);
        let step = SPAWN_STEPS.get((report >> 32) as usize - 1).copied().unwrap_or("spawn");
        let e = io::Error::from_raw_os_error(report as u32 as i32);
        return Err(if step == "exec" {
            e
        } else {
            io::Error::new(e.kind(), format!("{step}: {e}"))
        });
    }
    Ok(Spawned {
        pid,
        stdin: in_w,
        stdout: out_r,
        stderr: err_r,
    })
}

/// The child half of [`spawn`]: raw system calls only (it shares the parent's memory).
extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` the parent keeps alive while this runs.
    let a = unsafe { &*(arg as *const ChildArgs) };
    let s = a.spec;
    let [stdin, stdout, stderr] = a.fds;
    let fail = |step: u64| -> libc::c_int {
        // SAFETY: errno location of this thread; _exit.
        unsafe {
            let errno = *libc::__errno_location() as u32 as u64;
            a.report
                .store((step + 1) << 32 | errno, std::sync::atomic::Ordering::Release);
            libc::_exit(127)
        }
    };
    // SAFETY (every call below): system calls on integers and on pointers into the
    // parent's live, immutable data.
    unsafe {
        for (fd, to) in [(stdin, 0), (stdout, 1), (stderr, 2)] {
            if libc::dup2(fd, to) == -1 {
                return fail(0);
            }
        }
        if libc::chdir(s.cwd.as_ptr()) == -1 {
            return fail(1);
        }
        // A process group of its own, in the session of the process that started the
        // sandbox, as a bare fork+exec would be. A session per command (or per sandbox)
        // would put each in a scheduler autogroup of its own, and under load the host's
        // threads that serve them, all in one group, would get one group's share. No
        // terminal is reachable from inside: the only descriptors are pipes and `/dev`
        // holds null, zero, random and urandom.
        if libc::setpgid(0, 0) == -1 {
            return fail(2);
        }
        for &(res, soft, hard) in &s.rlimits {
            let lim = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            if libc::setrlimit(res, &lim) == -1 {
                return fail(3);
            }
        }
        match s.run_as {
            // Raw system calls: glibc's set*id wrappers would signal the threads of the
            // process whose memory this child borrows.
            Some(id) => {
                if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) == -1
                    || libc::syscall(libc::SYS_setresgid, id, id, id) == -1
                    || libc::syscall(libc::SYS_setresuid, id, id, id) == -1
                {
                    return fail(4);
                }
            }
            None => {
                if drop_all_capabilities().is_err() {
                    return fail(4);
                }
            }
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == -1 {
            return fail(5);
        }
        // Default handling of every signal for the command: ignored dispositions would
        // survive the exec (the init ignores SIGPIPE, as Rust programs do, and may have
        // inherited more), and nothing blocked. Raw rt_sigaction: glibc's wrapper refuses
        // its internal real-time signals. A zeroed kernel sigaction is SIG_DFL.
        let dfl = [0u64; 4];
        for sig in 1..=64 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::syscall(libc::SYS_rt_sigaction, sig, dfl.as_ptr(), std::ptr::null::<u64>(), 8);
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::execve(s.path.as_ptr(), a.argv.as_ptr(), a.envp.as_ptr());
    }
    fail(6)
}

/// `openat(dir, name, flags | O_CLOEXEC, mode)` as an owned file.
pub fn openat(dir: RawFd, name: &std::ffi::CStr, flags: libc::c_int, mode: u32) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: `name` is NUL-terminated; the descriptor returned is fresh and owned by the File.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// `mkdirat(dir, name, mode)`.
pub fn mkdirat(dir: RawFd, name: &std::ffi::CStr, mode: u32) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated.
    if unsafe { libc::mkdirat(dir, name.as_ptr(), mode) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets this thread's file-system uid and gid (`setfsuid`, `setfsgid`).
pub fn set_fs_ids(id: u32) {
    // SAFETY: changes only the calling thread's file-system ids.
    // Group first on the way down, user first on the way back to root (a non-zero fsuid
    // has no file capabilities).
    unsafe {
        if id == 0 {
            libc::setfsuid(id);
            libc::setfsgid(id);
        } else {
            libc::setfsgid(id);
            libc::setfsuid(id);
        }
    }
}

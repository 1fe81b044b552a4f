//! The only module with `unsafe`: thin, checked wrappers over the Linux system calls the
//! sandbox needs (namespaces, mounts, rlimits, seccomp, signals, poll). Every wrapper
//! turns a `-1` into the `errno` as an [`std::io::Error`].
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
    let t = cstr(target)?;
    // SAFETY: valid C string.
    check(unsafe { libc::umount2(t.as_ptr(), flags) }).map(|_| ())
}

/// `pivot_root(2)`.
pub fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    let (a, b) = (cstr(new_root)?, cstr(put_old)?);
    // SAFETY: valid C strings; the syscall takes two paths.
    let r = unsafe { libc::syscall(libc::SYS_pivot_root, a.as_ptr(), b.as_ptr()) };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The mount flags (`ST_*` as `MS_*`) of the file system holding `path`, which a
/// read-only bind remount inside a user namespace must keep.
pub fn locked_mount_flags(path: &Path) -> io::Result<libc::c_ulong> {
    let p = cstr(path)?;
    // SAFETY: statvfs writes into the zeroed struct we own.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    check(unsafe { libc::statvfs(p.as_ptr(), &mut st) })?;
    let mut flags = 0;
    for (st_flag, ms_flag) in [
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if st.f_flag & st_flag != 0 {
            flags |= ms_flag;
        }
    }
    Ok(flags)
}

/// `sethostname(2)`.
pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: pointer and length of a live byte slice.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).map(|_| ())
}

/// `setrlimit(2)` with soft = hard = `value`.
pub fn setrlimit(resource: libc::__rlimit_resource_t, value: u64) -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: pointer to a live struct.
    check(unsafe { libc::setrlimit(resource, &lim) }).map(|_| ())
}

/// `setrlimit(2)` with separate soft and hard values.
pub fn setrlimit2(resource: libc::__rlimit_resource_t, soft: u64, hard: u64) -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: pointer to a live struct.
    check(unsafe { libc::setrlimit(resource, &lim) }).map(|_| ())
}

/// `prctl(PR_SET_PDEATHSIG, sig)`.
pub fn set_parent_death_signal(sig: libc::c_int) -> io::Result<()> {
    // SAFETY: integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong, 0, 0, 0) }).map(|_| ())
}

/// `prctl(PR_SET_NO_NEW_PRIVS, 1)`.
pub fn set_no_new_privs() -> io::Result<()> {
    // SAFETY: integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }).map(|_| ())
}

/// Installs a classic-BPF seccomp filter on the calling thread.
pub fn seccomp_install(filter: &[libc::sock_filter]) -> io::Result<()> {
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: prog points at a live filter array of the stated length.
    check(unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER as libc::c_ulong,
            &prog as *const _ as libc::c_ulong,
            0,
            0,
        )
    })
    .map(|_| ())
}

/// Drops to `uid`/`gid` with no supplementary groups.
pub fn drop_to(uid: libc::uid_t, gid: libc::gid_t) -> io::Result<()> {
    // SAFETY: integer arguments; setgroups with 0 entries ignores the pointer.
    check(unsafe { libc::setgroups(0, std::ptr::null()) })?;
    check(unsafe { libc::setresgid(gid, gid, gid) })?;
    check(unsafe { libc::setresuid(uid, uid, uid) })?;
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

/// `setsid(2)`.
pub fn setsid() -> io::Result<()> {
    // SAFETY: no arguments.
    check(unsafe { libc::setsid() }).map(|_| ())
}

/// `kill(2)`.
pub fn kill(pid: libc::pid_t, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: integer arguments.
    check(unsafe { libc::kill(pid, sig) }).map(|_| ())
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

/// Adds a hook to a [`std::process::Command`] that runs in the child between fork and
/// exec. The hook must only make async-signal-safe calls (the callers here use raw
/// system calls and no allocation).
pub fn pre_exec(cmd: &mut std::process::Command, f: impl FnMut() -> io::Result<()> + Send + Sync + 'static) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the hooks passed here only call the system-call wrappers of this module.
    unsafe {
        cmd.pre_exec(f);
    }
}

/// The effective uid of this process.
pub fn geteuid() -> u32 {
    // SAFETY: no arguments.
    unsafe { libc::geteuid() }
}

/// The effective gid of this process.
pub fn getegid() -> u32 {
    // SAFETY: no arguments.
    unsafe { libc::getegid() }
}

/// Exits at once without running destructors (the child half of a fork).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns.
    unsafe { libc::_exit(code) }
}

/// `pidfd_open(2)`: a file descriptor that polls readable when `pid` exits.
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: integer arguments; on success the kernel hands us a new fd we then own.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(r as RawFd) })
    }
}

/// Removes every System V shared-memory segment, semaphore set and message queue of the
/// calling process's IPC namespace (as listed in `/proc/sysvipc`).
pub fn ipc_remove_all() {
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

/// Kills every other process of the pid namespace (the caller is its pid 1) and reaps
/// them all, waiting up to `limit` for the last to die. False if some survived.
pub fn kill_and_reap_all(limit: std::time::Duration) -> bool {
    let end = std::time::Instant::now() + limit;
    // SAFETY: kill and waitpid with integer arguments and a live out-pointer.
    unsafe { libc::kill(-1, libc::SIGKILL) };
    loop {
        let mut status = 0;
        let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if r > 0 {
            continue;
        }
        if r == -1 {
            return true; // ECHILD: nothing left
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        unsafe { libc::kill(-1, libc::SIGKILL) };
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

//! The escape and abuse suite: each case really tries to get out of, or take down, the
//! sandbox, and asserts containment, a clear status, and a host that is unaffected
//! afterwards (no process of the sandbox's users left, its cgroup gone, the pool still
//! serving).

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use streamrl_sandbox::{ExecRequest, ExecResult, ExecStatus, Limits, Pool, SandboxConfig};

/// Each test maps its sandboxes into its own host uid range, so leftovers are its own.
fn pool(slot: u32) -> Pool {
    let cfg = SandboxConfig {
        init: Some(env!("CARGO_BIN_EXE_streamrl-sandbox-init").into()),
        pool_size: 1,
        uid_base: 400_000 + slot * 20_000,
        ..SandboxConfig::default()
    };
    Pool::new(cfg).expect("sandboxes run on this host")
}

/// Host processes whose real uid is in the pool's range.
fn leftovers(pool: &Pool) -> Vec<String> {
    let base = pool.config().uid_base;
    let mut found = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let uid: u32 = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse().ok())
            .unwrap_or(0);
        // Odd offsets are the users commands run as; even ones are each sandbox's init.
        if (base..base + 20_000).contains(&uid) && (uid - base) % 2 == 1 {
            let cmd = std::fs::read_to_string(e.path().join("cmdline")).unwrap_or_default();
            found.push(format!(
                "pid {} uid {uid}: {}",
                e.file_name().to_string_lossy(),
                cmd.replace('\0', " ")
            ));
        }
    }
    found
}

/// The host is unaffected: nothing of the sandbox's commands runs on, the pool still
/// serves, and processes can still be started.
fn assert_host_clean(pool: &Pool) {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let left = leftovers(pool);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < end, "processes of the sandbox survived: {left:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        Command::new("true").status().unwrap().success(),
        "the host can start processes"
    );
    let r = pool.exec(&ExecRequest::python("print('still serving')"));
    assert_eq!(r.stdout, "still serving\n", "the pool serves after the attack: {r:?}");
}

fn run(pool: &Pool, source: &str, limits: Limits) -> ExecResult {
    pool.exec(&ExecRequest::python(source).with_limits(limits))
}

/// `f()`, which must return within `limit`: a sandbox limit that fired late is a failure.
fn within<R>(limit: Duration, f: impl FnOnce() -> R) -> R {
    let started = Instant::now();
    let r = f();
    assert!(started.elapsed() < limit, "took {:?}", started.elapsed());
    r
}

#[test]
fn cannot_read_host_files() {
    let pool = pool(0);
    let repo_file = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    assert!(std::path::Path::new(repo_file).exists() && std::path::Path::new("/etc/shadow").exists());
    let src = format!(
        r#"
import os
for p in ["/etc/shadow", "/etc/hostname", {repo_file:?}, "/root", "/home", "/var/log", "/proc/1/root/etc/shadow", "/sys/kernel"]:
    try:
        if os.path.isdir(p):
            print(p, "LISTED", os.listdir(p))
        else:
            print(p, "READ", open(p).read()[:20])
    except OSError as e:
        print(p, "DENIED", type(e).__name__)
print("root:", sorted(os.listdir("/")))
"#
    );
    let r = run(&pool, &src, Limits::default());
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    for line in r.stdout.lines().filter(|l| !l.starts_with("root:")) {
        assert!(
            line.contains(" DENIED "),
            "a host file or directory was visible: {line}"
        );
    }
    // The root holds the read-only system directories and the sandbox's own, nothing else
    // (which of bin, lib, lib32, lib64 and sbin exist depends on the host).
    let root = r.stdout.lines().find_map(|l| l.strip_prefix("root: ")).unwrap();
    let names: Vec<&str> = root
        .trim_matches(['[', ']'])
        .split(", ")
        .map(|n| n.trim_matches('\''))
        .collect();
    for must in ["dev", "etc", "proc", "tmp", "usr", "work"] {
        assert!(names.contains(&must), "{must} missing from {root}");
    }
    let allowed = [
        "bin", "dev", "etc", "lib", "lib32", "lib64", "proc", "sbin", "tmp", "usr", "work",
    ];
    assert!(
        names.iter().all(|n| allowed.contains(n)),
        "unexpected entries in / : {root}"
    );
    assert_host_clean(&pool);
}

#[test]
fn cannot_write_outside_the_work_dir() {
    let pool = pool(1);
    let marker = format!("streamrl-escape-{}", std::process::id());
    let src = format!(
        r#"
import os
for p in ["/usr/{marker}", "/etc/{marker}", "/{marker}", "/bin/{marker}", "/proc/{marker}", "/dev/{marker}"]:
    try:
        open(p, "w").write("x")
        print(p, "WROTE")
    except OSError as e:
        print(p, "DENIED", type(e).__name__)
open("/work/ok", "w").write("fine")
open("/tmp/{marker}", "w").write("private tmp")
try:
    open("/work/big", "wb").write(b"x" * (64 << 20))
    print("big WROTE")
except OSError as e:
    print("big DENIED", e.errno)
"#
    );
    let r = run(&pool, &src, Limits::default());
    // Writing past RLIMIT_FSIZE raises SIGXFSZ, which Python ignores, so it is an OSError.
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    assert_eq!(r.stdout.matches(" DENIED ").count(), 7, "{}", r.stdout);
    assert!(!r.stdout.contains("WROTE"), "{}", r.stdout);
    for p in [
        format!("/usr/{marker}"),
        format!("/etc/{marker}"),
        format!("/{marker}"),
        format!("/tmp/{marker}"),
    ] {
        assert!(!std::path::Path::new(&p).exists(), "{p} appeared on the host");
    }
    assert_host_clean(&pool);
}

#[test]
fn cannot_reach_a_tcp_listener_on_the_host() {
    let pool = pool(2);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let src = format!(
        r#"
import socket
for host in ["127.0.0.1", "10.0.2.2", "8.8.8.8"]:
    try:
        socket.create_connection((host, {port}), timeout=2)
        print(host, "CONNECTED")
    except OSError as e:
        print(host, "DENIED", e.errno)
import os
print("interfaces:", sorted(os.listdir("/sys/class/net")) if os.path.exists("/sys/class/net") else "none")
"#
    );
    let r = run(&pool, &src, Limits::default());
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    assert_eq!(r.stdout.matches(" DENIED ").count(), 3, "{}", r.stdout);
    assert!(
        listener
            .accept()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "the listener saw a connection"
    );
    assert_host_clean(&pool);
}

#[test]
fn a_fork_bomb_is_contained() {
    let pool = pool(3);
    let limits = Limits {
        wall_ms: 3000,
        ..Limits::default()
    };
    let r = within(Duration::from_secs(10), || {
        run(
            &pool,
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            limits,
        )
    });
    assert!(matches!(r.status, ExecStatus::Timeout | ExecStatus::Killed), "{r:?}");
    // The classic shell bomb runs in the background while the shell waits.
    let bash = pool.exec(&ExecRequest::new(["bash", "-c", ":(){ :|:& };: ; sleep 60"]).with_limits(limits));
    assert_eq!(bash.status, ExecStatus::Timeout, "{bash:?}");
    assert_host_clean(&pool);
}

#[test]
fn a_memory_bomb_is_stopped_with_status_memory() {
    let pool = pool(4);
    // Growing past the sandbox's memory limit (cgroup OOM kill where the host has the
    // controller, else the address-space limit).
    let limits = Limits {
        memory_bytes: 256 << 20,
        address_space_bytes: 1 << 30,
        ..Limits::default()
    };
    let r = run(&pool, "x = []\nwhile True:\n    x.append(bytearray(10**7))\n", limits);
    assert_eq!(r.status, ExecStatus::Memory, "{r:?}");
    assert!(r.reason.contains("memory") || r.reason.contains("allocation"), "{r:?}");
    // One huge allocation is refused by RLIMIT_AS.
    let r = run(&pool, "bytearray(10**12)", limits);
    assert_eq!(r.status, ExecStatus::Memory, "{r:?}");
    assert!(r.stderr.contains("MemoryError"), "{r:?}");
    assert_host_clean(&pool);
}

#[test]
fn an_infinite_cpu_loop_hits_the_cpu_limit_and_sleeping_forever_the_wall_clock() {
    let pool = pool(5);
    let r = run(
        &pool,
        "while True: pass",
        Limits {
            cpu_secs: 1,
            wall_ms: 10_000,
            ..Limits::default()
        },
    );
    assert_eq!(r.status, ExecStatus::Timeout, "{r:?}");
    assert!(r.reason.contains("CPU limit of 1 s"), "{r:?}");
    assert!(r.cpu_ms >= 900 && r.wall_ms < 5000.0, "{r:?}");

    // The limit is on the tree: six busy children share one second, not one each.
    let r = run(
        &pool,
        "import os\nfor _ in range(6):\n    if os.fork() == 0:\n        while True: pass\nos.wait()",
        Limits {
            cpu_secs: 1,
            wall_ms: 10_000,
            ..Limits::default()
        },
    );
    assert_eq!(r.status, ExecStatus::Timeout, "{r:?}");
    assert!(r.reason.contains("CPU limit of 1 s"), "{r:?}");
    assert!(
        r.cpu_ms >= 900 && r.cpu_ms < 2_500,
        "the tree used {} ms of CPU: {r:?}",
        r.cpu_ms
    );

    let r = within(Duration::from_secs(3), || {
        pool.exec(&ExecRequest::new(["sleep", "infinity"]).with_limits(Limits {
            wall_ms: 500,
            ..Limits::default()
        }))
    });
    assert_eq!(r.status, ExecStatus::Timeout, "{r:?}");
    assert!(r.reason.contains("wall-clock limit of 500 ms"), "{r:?}");
    // A background process that would outlive its parent dies with it.
    let r = pool.exec(&ExecRequest::new(["bash", "-c", "sleep 1000 & echo started"]));
    assert_eq!((r.status, r.stdout.as_str()), (ExecStatus::Ok, "started\n"), "{r:?}");
    assert_host_clean(&pool);
}

#[test]
fn a_gibibyte_of_output_is_cut_at_the_cap() {
    let pool = pool(6);
    let limits = Limits {
        stdout_bytes: 1 << 20,
        ..Limits::default()
    };
    let r = run(
        &pool,
        "import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)\n",
        limits,
    );
    assert_eq!(r.status, ExecStatus::OutputLimit, "{r:?}");
    assert_eq!(r.stdout.len(), 1 << 20);
    assert!(
        r.reason.contains("stdout passed its cap of 1048576 bytes"),
        "{}",
        r.reason
    );
    let r = run(
        &pool,
        "import sys\nwhile True:\n    sys.stderr.write('e' * 65536)\n",
        limits,
    );
    assert_eq!(r.status, ExecStatus::OutputLimit, "{}", r.reason);
    assert_host_clean(&pool);
}

#[test]
fn kill_minus_one_reaches_only_the_sandbox() {
    let pool = pool(7);
    let mut canary = Command::new("sleep").arg("30").spawn().unwrap();
    let mut s = pool.take().unwrap();
    let r = s.exec(&ExecRequest::new([
        "bash",
        "-c",
        "sleep 100 & kill -9 -1; echo survived",
    ]));
    assert!(matches!(r.status, ExecStatus::Ok | ExecStatus::Killed), "{r:?}");
    assert!(
        canary.try_wait().unwrap().is_none(),
        "kill -9 -1 in the sandbox killed a host process"
    );
    let again = s.exec(&ExecRequest::python("print('init survived')"));
    assert_eq!(again.stdout, "init survived\n", "{again:?}");
    drop(s);
    canary.kill().unwrap();
    canary.wait().unwrap();
    assert_host_clean(&pool);
}

#[test]
fn proc_shows_only_the_sandbox() {
    let pool = pool(8);
    let mut canary = Command::new("sleep").arg("31.4159").spawn().unwrap();
    let src = format!(
        r#"
import os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("pids", pids)
for p in pids:
    try:
        print(p, open(f"/proc/{{p}}/cmdline").read().replace("\0", " "))
    except OSError as e:
        print(p, "DENIED", type(e).__name__)
try:
    print("host", open("/proc/{}/environ").read())
except OSError as e:
    print("host DENIED", type(e).__name__)
"#,
        canary.id()
    );
    let r = run(&pool, &src, Limits::default());
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    assert!(
        !r.stdout.contains("31.4159"),
        "a host process was visible: {}",
        r.stdout
    );
    let pids = r.stdout.lines().next().unwrap();
    assert!(pids.split(',').count() <= 3, "more than init and the command: {pids}");
    canary.kill().unwrap();
    canary.wait().unwrap();
    assert_host_clean(&pool);
}

#[test]
fn privileged_system_calls_are_refused() {
    let pool = pool(9);
    let src = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, f):
    r = f()
    print(name, "ALLOWED" if r == 0 else f"DENIED errno={ctypes.get_errno()}")
attempt("mount", lambda: libc.mount(b"none", b"/work", b"tmpfs", 0, None))
attempt("unshare", lambda: libc.unshare(0x10000000))
attempt("ptrace", lambda: libc.ptrace(0, 0, None, None))
attempt("chroot", lambda: libc.chroot(b"/work"))
attempt("setuid0", lambda: libc.setuid(0))
attempt("reboot", lambda: libc.reboot(0x4321fedc))
attempt("bpf", lambda: libc.syscall(321, 0, None, 0))
"#;
    let r = run(&pool, src, Limits::default());
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    assert_eq!(r.stdout.matches("DENIED errno=1").count(), 7, "{}", r.stdout);
    assert_host_clean(&pool);
}

/// The session file API is aimed through links a command planted: at the init's own
/// `/proc` entries (its memory map names host paths) and at `/dev` (an upload would create
/// a file there as the sandbox's root). No link is followed, on any component; uploads
/// belong to the command's user; paths outside /work are refused, by component.
#[test]
fn the_file_api_follows_no_planted_link() {
    let pool = pool(10);
    let mut s = pool.take().unwrap();
    let r = s.exec(&ExecRequest::python(
        "import os\n\
         os.symlink('/proc/1', 'p')\n\
         os.symlink('/dev', 'd')\n\
         os.symlink('/etc', 'e')\n\
         os.makedirs('real/sub')\n\
         os.symlink('/proc/1/maps', 'real/maps')\n",
    ));
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    for path in ["p/maps", "/work/p/environ", "real/maps", "e/passwd"] {
        let e = s.read_file(path, 1 << 20);
        assert!(
            e.is_err(),
            "download of {path} followed a link: {:?}",
            e.map(|d| String::from_utf8_lossy(&d).into_owned())
        );
    }
    for path in ["d/planted", "p/planted", "e/planted"] {
        let e = s.write_file(path, b"x", 0o644).expect_err(path).to_string();
        assert!(e.contains("symbolic link"), "{path}: {e}");
    }
    let r = s.exec(&ExecRequest::new([
        "sh",
        "-c",
        "ls /dev; test ! -e /dev/planted && echo clean",
    ]));
    assert!(r.stdout.ends_with("clean\n"), "an upload landed in /dev: {r:?}");
    // Paths outside /work, by component: /workshop is not /work.
    for path in ["/workshop/x", "/etc/passwd", "../x"] {
        assert!(s.write_file(path, b"x", 0o644).is_err(), "{path} accepted");
    }
    // Uploads are the command user's: the command may rewrite them.
    s.write_file("real/sub/mine.txt", b"upload", 0o644).unwrap();
    let r = s.exec(&ExecRequest::python(
        "open('real/sub/mine.txt', 'a').write(' and more'); print(open('real/sub/mine.txt').read())",
    ));
    assert_eq!(r.stdout, "upload and more\n", "{r:?}");
    assert_eq!(s.read_file("real/sub/mine.txt", 100).unwrap(), b"upload and more");
    drop(s);
    assert_host_clean(&pool);
}

//! The sandbox runs commands and reports what they did.

use streamrl_sandbox::{ExecRequest, ExecStatus, Limits, Pool, SandboxConfig};

fn pool() -> Pool {
    pool_of(2, SandboxConfig::default().reuse)
}

/// `size` warm sandboxes, each reused for up to `reuse` commands.
fn pool_of(size: usize, reuse: u32) -> Pool {
    let cfg = SandboxConfig {
        init: Some(env!("CARGO_BIN_EXE_streamrl-sandbox-init").into()),
        pool_size: size,
        reuse,
        ..SandboxConfig::default()
    };
    Pool::new(cfg).expect("sandboxes run on this host")
}

#[test]
fn runs_python_with_stdin_files_and_statuses() {
    let pool = pool();
    let r = pool.exec(&ExecRequest::python("print(6 * 7)"));
    assert_eq!(
        (r.status, r.stdout.as_str(), r.exit_code),
        (ExecStatus::Ok, "42\n", Some(0)),
        "{r:?}"
    );
    assert!(r.wall_ms > 0.0 && r.peak_memory_bytes > 0, "{r:?}");

    let r = pool.exec(&ExecRequest::python("import sys; print(sys.stdin.read().upper())").with_stdin("abc"));
    assert_eq!(r.stdout, "ABC\n", "{r:?}");

    let r = pool.exec(&ExecRequest::python("import sys; sys.exit(3)"));
    assert_eq!((r.status, r.exit_code), (ExecStatus::NonzeroExit, Some(3)), "{r:?}");
    assert_eq!(r.reason, "exit code 3");

    let r = pool.exec(&ExecRequest::new(["no-such-program"]));
    assert_eq!((r.status, r.exit_code), (ExecStatus::NonzeroExit, Some(127)), "{r:?}");
    assert!(r.reason.contains("cannot run `no-such-program`"), "{r:?}");

    let r = pool.exec(&ExecRequest::python("import os, pwd; print(os.getuid(), os.getcwd(), open('/etc/hostname').read() if os.path.exists('/etc/hostname') else os.uname().nodename)"));
    assert_eq!(r.stdout, "1000 /work sandbox\n", "{r:?}");

    let too_much = Limits {
        wall_ms: 1 << 40,
        ..Limits::default()
    };
    let r = pool.exec(&ExecRequest::python("print(1)").with_limits(too_much));
    assert_eq!(r.status, ExecStatus::InternalError);
    assert!(
        r.reason
            .contains("limits.wall_ms = 1099511627776 exceeds the maximum 10000"),
        "{r:?}"
    );
}

#[test]
fn a_session_keeps_files_between_commands_and_confines_file_paths() {
    let pool = pool();
    let mut s = pool.take().unwrap();
    s.write_file("sol/main.py", b"print('hi from a file')", 0o644).unwrap();
    let r = s.exec(&ExecRequest::new(["python3", "sol/main.py"]));
    assert_eq!(r.stdout, "hi from a file\n", "{r:?}");
    let r = s.exec(&ExecRequest::python(
        "open('out.txt','w').write('x' * 10); import os; os.symlink('/etc/passwd', 'link')",
    ));
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    assert_eq!(s.read_file("/work/out.txt", 100).unwrap(), b"xxxxxxxxxx");
    let e = s.read_file("out.txt", 5).unwrap_err().to_string();
    assert!(e.contains("over the limit of 5"), "{e}");
    let e = s.read_file("../etc/passwd", 100).unwrap_err().to_string();
    assert!(e.contains("leaves /work"), "{e}");
    assert!(
        s.read_file("link", 1000).is_err(),
        "a download does not follow a symlink"
    );
}

#[test]
fn a_reused_sandbox_keeps_nothing_of_the_previous_command() {
    let pool = pool_of(1, 100);
    let leave = r#"
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(4242, 4096, 0o1666) >= 0, ctypes.get_errno()
open("/work/left.txt", "w").write("secret")
open("/tmp/left.txt", "w").write("secret")
subprocess.Popen(["sleep", "1000"])
print(os.getpid())
"#;
    let r = pool.exec(&ExecRequest::python(leave));
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    // The same sandbox serves the next command (a pool of one, reused).
    let mut seen = None;
    for _ in 0..100 {
        if pool.stats().reused >= 1 {
            seen = Some(());
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(seen.is_some(), "the sandbox was not reused: {:?}", pool.stats());
    let look = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print(libc.shmget(4242, 0, 0), os.path.exists("/work/left.txt"), os.path.exists("/tmp/left.txt"),
      sorted(open(f"/proc/{p}/cmdline").read() for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid()) and p != "1"))
"#;
    let r = pool.exec(&ExecRequest::python(look));
    assert_eq!(r.stdout, "-1 False False []\n", "{r:?}");
    assert_eq!(pool.stats().cold_starts, 0, "{:?}", pool.stats());
}

/// Each kind of System V IPC object, left alone by a command, is gone for the next one
/// after a reset, standalone or in the command's round trip (the reset looks up each
/// kind's count before it lists and removes them).
#[test]
fn every_kind_of_ipc_object_is_removed_by_a_reset() {
    let pool = pool_of(1, 100);
    let mut sandbox = pool.take().expect("a sandbox");
    for (kind, make, find) in [
        ("shm", "libc.shmget(4242, 4096, 0o1666)", "libc.shmget(4242, 0, 0)"),
        ("sem", "libc.semget(4243, 1, 0o1666)", "libc.semget(4243, 0, 0)"),
        ("msg", "libc.msgget(4244, 0o1666)", "libc.msgget(4244, 0)"),
        (
            "POSIX mqueue",
            "libc.mq_open(b'/leak', os.O_CREAT | os.O_RDWR, 0o666, None)",
            "libc.mq_open(b'/leak', os.O_RDONLY)",
        ),
    ] {
        let src =
            |call: &str| format!("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nprint({call} >= 0)\n");
        let made = sandbox.exec(&ExecRequest::python(&src(make)));
        assert_eq!(made.stdout, "True\n", "{kind}: {made:?}");
        let kept = sandbox.exec(&ExecRequest::python(&src(find)));
        assert_eq!(kept.stdout, "True\n", "{kind} is kept without a reset: {kept:?}");
        sandbox.reset().expect("reset");
        let found = sandbox.exec(&ExecRequest::python(&src(find)));
        assert_eq!(found.stdout, "False\n", "{kind} outlived the reset: {found:?}");
        // The same through the reset that follows a command in its round trip.
        let made = sandbox.exec_then_reset(&ExecRequest::python(&src(make)));
        assert_eq!(made.stdout, "True\n", "{kind}: {made:?}");
        assert!(sandbox.is_usable());
        let found = sandbox.exec(&ExecRequest::python(&src(find)));
        assert_eq!(found.stdout, "False\n", "{kind} outlived exec_then_reset: {found:?}");
    }
}

/// A reset keeps scratch mounts the last command left untouched (the same mount, no
/// remount) and replaces the ones it changed, contents or root alike. A kept mount shows
/// through the modification time a command set on /work (which the check ignores).
#[test]
fn a_reset_replaces_only_scratch_mounts_that_were_changed() {
    let pool = pool_of(1, 100);
    let mut used = 0;
    // Prints /work's mtime and mode, /tmp's mode, and what both hold; then runs `then`.
    let mut probe = |then: &str| -> String {
        // Each command after the first runs in the same sandbox, reset.
        for _ in 0..200 {
            if pool.stats().reused >= used {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(
            pool.stats().reused >= used,
            "the sandbox was not reused: {:?}",
            pool.stats()
        );
        used += 1;
        let code = format!(
            r#"
import os
w, t = os.stat("/work"), os.stat("/tmp")
print(int(w.st_mtime), oct(w.st_mode & 0o7777), oct(t.st_mode & 0o7777), os.listdir("/work"), os.listdir("/tmp"))
{then}
"#
        );
        let r = pool.exec(&ExecRequest::python(&code));
        assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
        r.stdout.trim().to_string()
    };
    probe("os.utime('/work', (1234, 1234))");
    assert_eq!(
        probe("open('/work/f', 'w').write('x'); os.remove('/work/f'); os.utime('/work', (1234, 1234))"),
        "1234 0o755 0o1777 [] []",
        "kept"
    );
    assert_eq!(
        probe("os.utime('/work', (1234, 1234)); open('/work/left', 'w').write('secret')"),
        "1234 0o755 0o1777 [] []",
        "a file created and removed leaves the mount as it was"
    );
    let fresh = probe("os.utime('/work', (1234, 1234)); os.chmod('/work', 0o700)");
    assert!(
        fresh.ends_with(" 0o755 0o1777 [] []") && !fresh.starts_with("1234 "),
        "a file left in /work: fresh mounts, got {fresh}"
    );
    let fresh = probe("os.utime('/work', (1234, 1234)); open('/tmp/left', 'w').write('secret')");
    assert!(
        fresh.ends_with(" 0o755 0o1777 [] []") && !fresh.starts_with("1234 "),
        "a changed /work root: fresh mounts, got {fresh}"
    );
    let fresh = probe("");
    assert!(
        fresh.ends_with(" 0o755 0o1777 [] []") && !fresh.starts_with("1234 "),
        "a file left in /tmp: fresh mounts, got {fresh}"
    );
}

/// What a command starts with, read from its own /proc status: nothing blocked or ignored
/// (the init's SIGPIPE disposition is not inherited), no_new_privs, a seccomp filter, no
/// capabilities, the rlimits asked for, and the environment and directory given.
#[test]
fn a_command_starts_with_default_signals_no_privileges_and_its_limits() {
    let pool = pool();
    let mut req = ExecRequest::new([
        "sh",
        "-c",
        "grep -E '^(SigBlk|SigIgn|NoNewPrivs|Seccomp|CapEff|CapPrm):' /proc/self/status; \
         ulimit -n; ulimit -t; echo \"$FOO $HOME $PATH\"; pwd",
    ]);
    req.env.insert("FOO".into(), "bar".into());
    req.cwd = Some("/tmp".into());
    req.limits.open_files = 77;
    req.limits.cpu_secs = 9;
    let r = pool.exec(&req);
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    for want in [
        "SigBlk:\t0000000000000000",
        "SigIgn:\t0000000000000000",
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
        "CapEff:\t0000000000000000",
        "CapPrm:\t0000000000000000",
        "\n77\n9\n",
        "bar /work /usr/local/bin:/usr/bin:/bin",
        "\n/tmp\n",
    ] {
        assert!(r.stdout.contains(want), "{want:?} missing from:\n{}", r.stdout);
    }
    // A working directory that does not exist is the command's failure, named.
    req.cwd = Some("/nope".into());
    let r = pool.exec(&req);
    assert_eq!((r.status, r.exit_code), (ExecStatus::NonzeroExit, Some(127)), "{r:?}");
    assert!(r.reason.contains("chdir"), "{r:?}");
}

//! The seccomp filter every sandboxed command runs under: a deny list of system calls that
//! a program under test never needs and that would let it reach the kernel's most
//! dangerous surfaces (tracing, mounting, kernel modules, kexec, BPF, new namespaces, key
//! rings, ...). Denied calls fail with `EPERM`; `clone3` fails with `ENOSYS` so the C
//! library falls back to `clone`, whose flags are checked; a foreign architecture (or
//! the x32 ABI) kills the process.

/// System calls that fail with `EPERM` inside a sandbox, by name (for docs and tests).
pub const DENIED: &[(&str, libc::c_long)] = &[
    ("ptrace", libc::SYS_ptrace),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("chroot", libc::SYS_chroot),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("unshare", libc::SYS_unshare),
    ("setns", libc::SYS_setns),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("reboot", libc::SYS_reboot),
    ("acct", libc::SYS_acct),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("adjtimex", libc::SYS_adjtimex),
    ("syslog", libc::SYS_syslog),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("quotactl", libc::SYS_quotactl),
    ("fanotify_init", libc::SYS_fanotify_init),
    ("kcmp", libc::SYS_kcmp),
    ("vhangup", libc::SYS_vhangup),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("open_tree", libc::SYS_open_tree),
    ("move_mount", libc::SYS_move_mount),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("mount_setattr", libc::SYS_mount_setattr),
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
];

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E; // AUDIT_ARCH_X86_64
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7; // AUDIT_ARCH_AARCH64

const RET_ALLOW: u32 = 0x7fff_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;

/// `clone` flags that would create namespaces: refused like `unshare`.
const CLONE_NS_FLAGS: u32 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWCGROUP) as u32;

fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u32, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    }
}

/// What the filter does with one system call number.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Action {
    /// Fail with this errno.
    Errno(u32),
    /// `clone`: fail with `EPERM` when the flags (first argument) ask for a namespace.
    CloneFlags,
}

/// Every system call the filter does not simply allow, sorted by number.
fn rules() -> Vec<(u32, Action)> {
    let mut r: Vec<(u32, Action)> = DENIED
        .iter()
        .map(|&(_, nr)| (nr as u32, Action::Errno(libc::EPERM as u32)))
        .chain([
            (libc::SYS_clone3 as u32, Action::Errno(libc::ENOSYS as u32)),
            (libc::SYS_clone as u32, Action::CloneFlags),
        ])
        .collect();
    r.sort_by_key(|&(nr, _)| nr);
    r
}

/// Rules tested one after another below this many; above, the range is halved.
const LINEAR: usize = 4;

/// The filter program (classic BPF over `struct seccomp_data`).
///
/// The rules form a binary search over the system call number (`JGE` splits, short
/// `JEQ` runs at the leaves), so an allowed call passes about ten instructions instead
/// of one comparison per denied call. The kernel also runs the program once per system
/// call number when it is installed, to find the calls it may then allow without running
/// it (its seccomp action cache): with a linear list that alone cost ~0.1 ms per command.
pub fn filter() -> Vec<libc::sock_filter> {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W};
    let ld = BPF_LD | BPF_W | BPF_ABS;
    let ret = BPF_RET | BPF_K;
    let mut f = vec![
        // seccomp_data: nr at 0, arch at 4, args at 16.
        stmt(ld, 4),
        jump(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH, 1, 0),
        stmt(ret, RET_KILL_PROCESS),
        stmt(ld, 0),
    ];
    #[cfg(target_arch = "x86_64")]
    {
        // The x32 ABI sets bit 30 of the number: not allowed at all.
        f.push(jump(BPF_JMP | BPF_JGE | BPF_K, 0x4000_0000, 0, 1));
        f.push(stmt(ret, RET_KILL_PROCESS));
    }
    f.extend(search(&rules()));
    f
}

/// The search over `rules` (sorted), entered with the number in the accumulator; every
/// path ends in a return.
fn search(rules: &[(u32, Action)]) -> Vec<libc::sock_filter> {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, BPF_W};
    let ret = BPF_RET | BPF_K;
    if rules.len() <= LINEAR {
        let mut f = vec![];
        for &(nr, action) in rules {
            match action {
                Action::Errno(errno) => {
                    f.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 1));
                    f.push(stmt(ret, RET_ERRNO | errno));
                }
                Action::CloneFlags => {
                    f.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 4));
                    f.push(stmt(BPF_LD | BPF_W | BPF_ABS, 16));
                    f.push(jump(BPF_JMP | BPF_JSET | BPF_K, CLONE_NS_FLAGS, 0, 1));
                    f.push(stmt(ret, RET_ERRNO | libc::EPERM as u32));
                    f.push(stmt(ret, RET_ALLOW));
                }
            }
        }
        f.push(stmt(ret, RET_ALLOW));
        return f;
    }
    let mid = rules.len() / 2;
    let (below, rest) = (search(&rules[..mid]), search(&rules[mid..]));
    let skip = u8::try_from(below.len()).expect("a BPF jump reaches at most 255 instructions");
    let mut f = vec![jump(BPF_JMP | BPF_JGE | BPF_K, rules[mid].0, skip, 0)];
    f.extend(below);
    f.extend(rest);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the program the way the kernel does, on one system call: its return value and
    /// the instructions it passed.
    fn run_counted(f: &[libc::sock_filter], arch: u32, nr: u32, arg0: u64) -> (u32, usize) {
        let data = |off: u32| match off {
            0 => nr,
            4 => arch,
            16 => arg0 as u32,
            20 => (arg0 >> 32) as u32,
            _ => panic!("load at {off}"),
        };
        let (mut pc, mut a) = (0usize, 0u32);
        for steps in 1.. {
            let i = f[pc];
            let code = i.code as u32;
            pc += 1;
            match code {
                c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => a = data(i.k),
                c if c == libc::BPF_RET | libc::BPF_K => return (i.k, steps),
                c if c & 0x07 == libc::BPF_JMP => {
                    let taken = match code & 0xf0 {
                        op if op == libc::BPF_JEQ => a == i.k,
                        op if op == libc::BPF_JGE => a >= i.k,
                        op if op == libc::BPF_JSET => a & i.k != 0,
                        op => panic!("jump op {op:#x}"),
                    };
                    pc += if taken { i.jt } else { i.jf } as usize;
                }
                c => panic!("instruction {c:#x}"),
            }
        }
        unreachable!()
    }

    fn run(f: &[libc::sock_filter], arch: u32, nr: u32, arg0: u64) -> u32 {
        run_counted(f, arch, nr, arg0).0
    }

    #[test]
    fn the_search_gives_every_system_call_its_action() {
        let f = filter();
        assert!(f.len() < 4096, "BPF programs are limited to 4096 instructions");
        let eperm = RET_ERRNO | libc::EPERM as u32;
        for nr in 0..1024u32 {
            let expected = if DENIED.iter().any(|&(_, d)| d as u32 == nr) {
                eperm
            } else if nr == libc::SYS_clone3 as u32 {
                RET_ERRNO | libc::ENOSYS as u32
            } else {
                RET_ALLOW
            };
            assert_eq!(run(&f, AUDIT_ARCH, nr, 0), expected, "system call {nr}");
        }
        let clone = libc::SYS_clone as u32;
        assert_eq!(run(&f, AUDIT_ARCH, clone, libc::SIGCHLD as u64), RET_ALLOW);
        for flag in [
            libc::CLONE_NEWUSER,
            libc::CLONE_NEWNS,
            libc::CLONE_NEWPID,
            libc::CLONE_NEWNET,
        ] {
            assert_eq!(run(&f, AUDIT_ARCH, clone, (flag | libc::SIGCHLD) as u64), eperm);
        }
        assert_eq!(run(&f, 0x4000_0003, 0, 0), RET_KILL_PROCESS, "a foreign architecture");
        #[cfg(target_arch = "x86_64")]
        assert_eq!(run(&f, AUDIT_ARCH, 0x4000_0000, 0), RET_KILL_PROCESS, "the x32 ABI");
    }

    #[test]
    fn an_allowed_call_passes_few_instructions() {
        // A linear list would pass two instructions per rule (~100); the search passes
        // the checks of arch and x32, ~log2(rules / LINEAR) splits and one short run.
        let f = filter();
        let most = (0..512u32)
            .filter(|&nr| rules().iter().all(|&(r, _)| r != nr))
            .map(|nr| run_counted(&f, AUDIT_ARCH, nr, 0).1)
            .max()
            .unwrap();
        assert!(
            most <= 20,
            "an allowed call passes {most} instructions ({} rules)",
            rules().len()
        );
    }
}

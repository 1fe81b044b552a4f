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

/// The filter program (classic BPF over `struct seccomp_data`).
pub fn filter() -> Vec<libc::sock_filter> {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, BPF_W};
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
    for &(_, nr) in DENIED {
        f.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr as u32, 0, 1));
        f.push(stmt(ret, RET_ERRNO | libc::EPERM as u32));
    }
    f.push(jump(BPF_JMP | BPF_JEQ | BPF_K, libc::SYS_clone3 as u32, 0, 1));
    f.push(stmt(ret, RET_ERRNO | libc::ENOSYS as u32));
    // clone: refuse namespace flags in its first argument (x86_64 and aarch64 alike).
    f.push(jump(BPF_JMP | BPF_JEQ | BPF_K, libc::SYS_clone as u32, 0, 3));
    f.push(stmt(ld, 16));
    f.push(jump(BPF_JMP | BPF_JSET | BPF_K, CLONE_NS_FLAGS, 0, 1));
    f.push(stmt(ret, RET_ERRNO | libc::EPERM as u32));
    f.push(stmt(ret, RET_ALLOW));
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_denied_call_has_its_return_and_the_program_ends_in_allow() {
        let f = filter();
        assert!(f.len() < 4096, "BPF programs are limited to 4096 instructions");
        assert_eq!(f.last().unwrap().k, RET_ALLOW);
        for &(name, nr) in DENIED {
            let i = f
                .iter()
                .position(|s| s.code == (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16 && s.k == nr as u32);
            let i = i.unwrap_or_else(|| panic!("{name} missing"));
            assert_eq!(f[i + 1].k, RET_ERRNO | libc::EPERM as u32, "{name}");
        }
    }
}

//! Allocator settings for processes that train.
//!
//! A training step allocates and frees the same large activation and gradient buffers
//! every step. glibc's malloc hands blocks above its mmap threshold back to the kernel on
//! free (and trims the heap top past its trim threshold), so the next step faults every
//! page in again: zeroed by the kernel and charged to the memory cgroup. On this machine
//! that was 10–20% of a small model's step (perf: `exc_page_fault`, `clear_page_erms`,
//! `memcg1_commit_charge`). [`retain_freed_memory`] keeps freed blocks for reuse.

/// Raises glibc malloc's mmap threshold to its maximum (32 MiB) and its trim threshold to
/// 1 GiB, so that freed buffers below 32 MiB are reused instead of returned to the kernel.
/// Returns whether the settings took (always false off glibc). Call it once, early.
#[allow(unsafe_code)]
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes malloc's tuning parameters; it is thread-safe in
        // glibc (it takes the arena locks) and has no memory-safety preconditions.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn the_settings_take_on_glibc() {
        assert!(super::retain_freed_memory());
    }
}

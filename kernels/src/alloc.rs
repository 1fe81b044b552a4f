//! Allocator settings for processes that train.
//!
//! A training step allocates and frees the same large activation and gradient buffers
//! every step. glibc's malloc hands blocks above its mmap threshold back to the kernel on
//! free (and trims the heap top past its trim threshold), so the next step faults every
//! page in again: zeroed by the kernel and charged to the memory cgroup. On this machine
//! that was 10–20% of a small model's step (perf: `exc_page_fault`, `clear_page_erms`,
//! `memcg1_commit_charge`). [`retain_freed_memory`] keeps freed blocks for reuse.
//!
//! Blocks above 32 MiB (a SmolLM2-sized step's logits, its vocabulary weights' gradients:
//! about 0.7 GB a step) are mmap'd by malloc whatever the threshold. [`HugePages`] asks
//! the kernel to back those with transparent huge pages, so the next step faults them in
//! 2 MiB at a time instead of 4 KiB (where THP is `madvise`, the common default).

/// Raises glibc malloc's mmap threshold to its maximum (32 MiB) and turns heap trimming
/// off, so that freed buffers below 32 MiB are reused instead of returned to the kernel.
/// (A trim threshold of 1 GiB was not enough: a SmolLM2-sized step of 8×256 tokens frees
/// more than that at the heap's top now and then; it was trimmed, and the next step faulted
/// it in again, 9.7 s against 6.9 s.) The process keeps its peak heap, which a process that
/// trains or decodes step after step needs again anyway. Returns whether the settings
/// took (always false off glibc). Call it once, early.
#[allow(unsafe_code)]
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes malloc's tuning parameters; it is thread-safe in
        // glibc (it takes the arena locks) and has no memory-safety preconditions.
        unsafe {
            // A trim threshold of -1 turns trimming off (mallopt(3)).
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, -1) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// The system allocator, with allocations of 32 MiB and more advised for transparent huge
/// pages (`madvise(MADV_HUGEPAGE)` over their whole 2 MiB-aligned extents). For a
/// process's `#[global_allocator]`.
pub struct HugePages;

/// Allocations at least this large are advised.
const HUGE: usize = 32 << 20;

impl HugePages {
    #[allow(unsafe_code)]
    fn advise(p: *mut u8, size: usize) {
        #[cfg(target_os = "linux")]
        if !p.is_null() && size >= HUGE {
            const H: usize = 2 << 20;
            let start = (p as usize).next_multiple_of(H);
            let end = (p as usize + size) & !(H - 1);
            if end > start {
                // SAFETY: advice over pages inside an allocation just made; it changes
                // how they are backed, not their contents or validity.
                unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
            }
        }
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; the advice only
// changes how the pages of a block are backed.
#[allow(unsafe_code)]
unsafe impl std::alloc::GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded.
        let p = unsafe { std::alloc::System.alloc(layout) };
        Self::advise(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded.
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        Self::advise(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: forwarded.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded.
        let p = unsafe { std::alloc::System.realloc(ptr, layout, new_size) };
        Self::advise(p, new_size);
        p
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

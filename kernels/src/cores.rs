//! Sharing a process's cores between its stages. `streamrl run` puts the rollout engine
//! and the trainer in one process; each computes on one thread, and with the asynchronous
//! level's bound one often waits for the other (at SmolLM2-135M's size the rollout stage's
//! thread was busy 7% of a trainer step: one of two cores idle). Work that runs on one
//! thread and may compete for a core says so while it computes ([`busy`]: the engine's
//! decode steps, a weight load); a training step, and the trainer's held-out eval, let
//! their matrix products (`cpu::gemm`'s and one-thread `cpu::matmul`'s) spread over the
//! cores nobody else is using ([`spread`]), decided again before every product, so a
//! decode step that starts takes its core back at the next product.
//!
//! ```
//! use streamrl_kernels::cores;
//!
//! // Outside `spread`, products run on the calling thread alone.
//! assert_eq!(cores::threads(), 1);
//! cores::spread(2, || {
//!     // Its own busy work (a held-out eval's decode steps) does not count.
//!     let _own = cores::busy();
//!     assert_eq!(cores::threads(), 2);
//! });
//! // Another thread decoding: one core left to spread over.
//! let (taken, release) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
//! std::thread::scope(|s| {
//!     s.spawn(|| {
//!         let _busy = cores::busy();
//!         taken.wait();
//!         release.wait();
//!     });
//!     taken.wait();
//!     cores::spread(2, || assert_eq!(cores::threads(), 1));
//!     release.wait();
//! });
//! ```

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Threads of this process computing on a core of their own right now ([`busy`]).
static BUSY: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The cores this thread's products may spread over (1: none; set by [`spread`]).
    static SPREAD: Cell<usize> = const { Cell::new(1) };
}

/// Marks the calling thread as computing on a core until the guard drops. Inside
/// [`spread`] it marks nothing: that thread's work already takes its cores from what the
/// others leave (a trainer's held-out eval decodes with the engine that marks its steps
/// busy, and must not count itself out of its own spread).
#[must_use = "the core counts as busy only while the guard lives"]
pub fn busy() -> Busy {
    let counted = SPREAD.with(Cell::get) <= 1;
    if counted {
        BUSY.fetch_add(1, Ordering::AcqRel);
    }
    Busy(counted)
}

/// A core in use; see [`busy`].
#[derive(Debug)]
pub struct Busy(bool);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0 {
            BUSY.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Runs `f` with this thread's matrix products spread over up to `cores` cores (the
/// calling thread's own included), as many as [`busy`] work elsewhere leaves free.
pub fn spread<R>(cores: usize, f: impl FnOnce() -> R) -> R {
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            SPREAD.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SPREAD.with(|s| s.replace(cores.max(1))));
    f()
}

/// Threads the next product on this thread may use: 1 outside [`spread`]; inside, its
/// cores less those [`busy`] elsewhere, at least 1.
pub fn threads() -> usize {
    let cores = SPREAD.with(Cell::get);
    if cores <= 1 {
        return 1;
    }
    cores.saturating_sub(BUSY.load(Ordering::Acquire)).clamp(1, cores)
}

/// Runs `f` on every item, spread over [`threads`] threads of the spread pool (the
/// calling thread waits), or on the calling thread alone, in order, outside [`spread`] or
/// when other work leaves one core. Items are handed out one at a time as threads come
/// free, so unequal items balance. Each item is computed as it would be alone: a kernel that
/// splits its output into independent items (a batch row, a run of parameters) gives the
/// same bits at any thread count.
///
/// ```
/// use streamrl_kernels::cores;
///
/// let mut rows = vec![0u64; 6];
/// cores::spread(2, || cores::each(rows.chunks_mut(2).enumerate(), |(i, row)| row.fill(i as u64)));
/// assert_eq!(rows, [0, 0, 1, 1, 2, 2]);
/// ```
pub fn each<I>(items: I, f: impl Fn(I::Item) + Sync)
where
    I: IntoIterator,
    I::IntoIter: Send,
    I::Item: Send,
{
    let items = items.into_iter();
    let threads = threads();
    // A lone item (a decode step of one sequence) gains nothing from waking the pool.
    if threads <= 1 || items.size_hint().1.is_some_and(|n| n <= 1) {
        items.for_each(f);
        return;
    }
    let queue = Mutex::new(items);
    let work = || {
        loop {
            // The lock is held only to take the next item, not while computing it.
            let next = queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).next();
            match next {
                Some(item) => f(item),
                None => break,
            }
        }
    };
    pool().install(|| {
        rayon::scope(|s| {
            for _ in 1..threads {
                s.spawn(|_| work());
            }
            work();
        })
    });
}

/// The cores of this machine.
pub fn available() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// What [`process_default`] returns when set (0: not set).
static DEFAULT: AtomicUsize = AtomicUsize::new(0);

/// Sets [`process_default`]: e.g. 1 in a process that runs one stage beside other stage
/// processes on the same machine, whose busy cores this process cannot see.
pub fn set_process_default(cores: usize) {
    DEFAULT.store(cores, Ordering::Release);
}

/// The cores a step spreads over when its configuration leaves it to the process: as set
/// by [`set_process_default`], else every core of the machine ([`available`]).
pub fn process_default() -> usize {
    match DEFAULT.load(Ordering::Acquire) {
        0 => available(),
        n => n,
    }
}

/// The pool spread products run on: one thread per core, built on first use (apart from
/// rayon's global pool, which `RAYON_NUM_THREADS=1` keeps at one thread for candle).
pub(crate) fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(available().max(2))
            .thread_name(|i| format!("spread-{i}"))
            .build()
            .expect("a thread pool for spread products")
    })
}

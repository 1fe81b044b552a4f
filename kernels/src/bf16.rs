//! bf16 matrix products with f32 accumulation on the CPU's matrix units: AMX tiles where
//! the CPU has them, else AVX-512 BF16 dot products, through oneDNN's matmul primitive
//! (Intel's library for exactly this; its JIT picks the tile or vector kernels and asks
//! Linux for the AMX tile state itself). oneDNN is loaded at run time, never linked, so a
//! build and every command work without it: where it is absent, or the CPU has neither
//! unit, [`gemm`] computes in f32 ([`cpu::gemm`]) and [`path`] says so.
//!
//! oneDNN serves the f32 products too ([`gemm_f32`], which `Products::F32` and the f32
//! decode run): its f32 matmul is about 3× the `gemm` crate's on AVX-512 CPUs, and it
//! keeps the property the sampler and trainer rely on, a row's sums the same bits
//! whatever rows share its call (tested on every path).
//!
//! Where oneDNN is looked for, first found wins: the file `STREAMRL_ONEDNN` names (or
//! `libdnnl.so.2` in the directory it names); the system's `libdnnl.so.2` (Debian's
//! `libdnnl2`); `libdnnl.so.2` under `$STREAMRL_TOOLS_DIR/onednn` or
//! `target/test-tools/onednn`, where `scripts/onednn.sh` unpacks Debian's package without
//! root. oneDNN 2.x only (its C API changed in 3.0).
//!
//! Inputs are rounded to bf16 (round to nearest even) as they are read; products sum in
//! f32. So a bf16 product equals, up to the order of f32 additions, the f32 product of the
//! rounded inputs, which is what the tests check on every path. `STREAMRL_BF16=f32` forces
//! the fallback, `STREAMRL_BF16=avx512` caps oneDNN below AMX (to compare the two paths on
//! a CPU that has both).
//!
//! ```
//! use streamrl_kernels::{bf16, cpu};
//!
//! // (2, 2) @ (2, 2), in whichever path this machine has; these values are exact in bf16.
//! let (a, b) = ([1.0f32, 2.0, 3.0, 4.0], [1.0f32, 0.5, -1.0, 2.0]);
//! let mut y = [0f32; 4];
//! bf16::gemm(cpu::ViewMut::rows(&mut y, 2, 2), cpu::View::rows(&a, 2, 2), cpu::View::rows(&b, 2, 2), false, 1.0);
//! assert_eq!(y, [-1.0, 4.5, -1.0, 9.5]);
//! println!("{}", bf16::describe()); // e.g. "bf16 products: AVX-512 BF16 (oneDNN 2.6.3, …)"
//! ```

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::fmt;
use std::path::{Path as FsPath, PathBuf};
use std::sync::OnceLock;

use crate::cpu::{self, View, ViewMut};

/// Which units a bf16 product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// AMX tiles (`tdpbf16ps`), through oneDNN.
    Amx,
    /// AVX-512 BF16 dot products (`vdpbf16ps`), through oneDNN.
    Avx512Bf16,
    /// f32 products ([`cpu::gemm`]): no oneDNN, or no bf16 unit on this CPU.
    F32,
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Path::Amx => "AMX tiles",
            Path::Avx512Bf16 => "AVX-512 BF16",
            Path::F32 => "f32 fallback",
        })
    }
}

/// The path bf16 products take in this process (decided once, at the first call).
pub fn path() -> Path {
    backend().path
}

/// One line saying which path bf16 products take and why, for logs and bench tables.
pub fn describe() -> String {
    let b = backend();
    let f32 = if b.f32_on_onednn {
        "oneDNN"
    } else if b.lib.is_some() {
        "the gemm crate (oneDNN's f32 kernels below AVX-512 give a row other bits alone than among others)"
    } else {
        "the gemm crate"
    };
    format!("bf16 products: {} ({}); f32 products: {f32}", b.path, b.why)
}

/// The number type of a model's matrix products on the CPU: f32 throughout, or bf16
/// inputs with f32 sums ([`gemm`]). Everything else (weights as the optimizer holds them,
/// norms, softmax, logprobs, the loss) stays f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Products {
    /// [`gemm_f32`].
    #[default]
    F32,
    /// [`gemm`].
    Bf16,
}

impl Products {
    /// `dst (+)= scale · a @ b` in this number type.
    pub fn gemm(self, dst: ViewMut<'_>, a: View<'_>, b: View<'_>, accumulate: bool, scale: f32) {
        match self {
            Products::F32 => gemm_f32(dst, a, b, accumulate, scale, 1),
            Products::Bf16 => gemm(dst, a, b, accumulate, scale),
        }
    }

    /// [`Products::gemm`] into a new `(a.rows, b.cols)` matrix.
    pub fn gemm_new(self, a: View<'_>, b: View<'_>, scale: f32) -> Vec<f32> {
        let mut y = vec![0f32; a.rows * b.cols];
        self.gemm(ViewMut::rows(&mut y, a.rows, b.cols), a, b, false, scale);
        y
    }
}

/// Makes oneDNN's OpenMP threads spin only briefly between products, then sleep
/// (`GOMP_SPINCOUNT=30000`, unless the environment sets `GOMP_SPINCOUNT` or
/// `OMP_WAIT_POLICY`). libgomp's default spins a worker for up to 300 000 rounds after
/// each parallel region: between a training step's products that worker fights the
/// threads that run the rest of the step (attention, norms, the rollout engine in the same
/// process) for the same cores (on 2 cores a bf16 step on two threads took 1.3× as long
/// as on one). Never spinning (`OMP_WAIT_POLICY=PASSIVE`) costs a wake-up per product
/// instead: on 2 cores at SmolLM2's shape a batch-32 decode step took 52–54 ms passive,
/// 44 ms with 30 000 rounds, 51 ms with 3 000, and a bf16 training step at 4×128 on two
/// threads 1956 ms passive, 1701 ms with 30 000. libgomp reads the variable once, when
/// oneDNN loads it. [`wait_policy_set_here`] says whether it set the variable.
///
/// # Safety
/// Sets an environment variable: call it before any other thread of the process exists
/// (first thing in `main`).
#[allow(unsafe_code)]
pub unsafe fn sleep_between_products() {
    if std::env::var_os("OMP_WAIT_POLICY").is_none() && std::env::var_os(SPIN_VARIABLE).is_none() {
        // SAFETY: the caller's contract: no other thread reads the environment now.
        unsafe { std::env::set_var(SPIN_VARIABLE, "30000") };
        WAIT_SET_HERE.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The variable [`sleep_between_products`] sets.
pub const SPIN_VARIABLE: &str = "GOMP_SPINCOUNT";

static WAIT_SET_HERE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`sleep_between_products`] set [`SPIN_VARIABLE`] in this process (and not the
/// user): a baseline run as a child process (PyTorch) is then started without it, with
/// its library's own default.
pub fn wait_policy_set_here() -> bool {
    WAIT_SET_HERE.load(std::sync::atomic::Ordering::Relaxed)
}

/// `x` rounded to the nearest bf16 (ties to even), as the upper 16 bits of an f32. NaN
/// stays NaN.
#[inline(always)]
pub fn round(x: f32) -> u16 {
    let u = x.to_bits();
    // Wrapping (it cannot wrap below NaN's bit patterns, which are answered apart): an
    // overflow check (debug builds) kept conversion loops from vectorising.
    let rounded = (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16;
    if u & 0x7fff_ffff > 0x7f80_0000 {
        0x7fc0 | (u >> 16) as u16 & 0x8000
    } else {
        rounded
    }
}

/// The f32 value of a bf16.
#[inline(always)]
pub fn widen(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `x` rounded to bf16 and back: what a bf16 product reads for `x`.
pub fn rounded(x: &[f32]) -> Vec<f32> {
    let mut v = x.to_vec();
    round_in_place(&mut v);
    v
}

/// [`rounded`] in place.
#[inline(always)]
pub fn round_in_place(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = widen(round(*v));
    }
}

/// `dst = scale · a @ b`, or `dst += scale · a @ b` when `accumulate`, with `a` and `b`
/// rounded to bf16 and the products summed in f32, on the units [`path`] names (in f32 on
/// the fallback). Shapes and strides as [`cpu::gemm`]'s.
///
/// # Panics
/// When the shapes disagree or a view reaches past its slice, or when oneDNN refuses a
/// product it was set up for (a bug: the message names the shapes and oneDNN's status).
pub fn gemm(dst: ViewMut<'_>, a: View<'_>, b: View<'_>, accumulate: bool, scale: f32) {
    product(dst, a, Rhs::View(b), accumulate, scale, 1)
}

/// `dst (+)= scale · a @ b` in f32, on `threads` threads (or the cores
/// [`crate::cores::spread`] gives, when more): oneDNN's f32 matmul where oneDNN is loaded
/// for a right-hand matrix of at least 65 536 elements (it reads the views in place, at
/// about 3× the `gemm` crate's speed on AVX-512 CPUs), else [`cpu::matmul`] for a dense
/// `b` and [`cpu::gemm`] for any other. Both sum each
/// output in the same order whatever the number of rows, so a row's result is the same
/// bits alone or among others (what makes a sampler's f32 logprobs the trainer's); the
/// tests check it on whichever path runs.
///
/// # Panics
/// When the shapes disagree or a view reaches past its slice ([`cpu::gemm`]'s check).
pub fn gemm_f32(dst: ViewMut<'_>, a: View<'_>, b: View<'_>, accumulate: bool, scale: f32, threads: usize) {
    cpu::check_gemm(dst.data.len(), dst.rows, dst.cols, dst.rs, dst.cs, a, b);
    let (m, k, n) = (a.rows, a.cols, b.cols);
    // The choice hangs on the right-hand matrix's size alone, never on the rows: a row
    // must take the same path whoever shares its call. Small products (attention's per
    // head) stay on the `gemm` crate, where a primitive per shape would not pay.
    let lib = match backend().f32_lib() {
        Some(lib) if m > 0 && n > 0 && k > 0 && dst.cs == 1 && k * n >= 1 << 16 => lib,
        _ if b.cs == 1 && b.rs == n && dst.cs == 1 && dst.rs == n && a.cs == 1 && a.rs == k && scale == 1.0 => {
            return cpu::matmul(a.data, m, b.data, k, n, dst.data, accumulate, threads);
        }
        _ => return cpu::gemm(dst, a, b, accumulate, scale),
    };
    let key = Key {
        m,
        k,
        n,
        dtype: DNNL_F32,
        a: [a.rs, a.cs],
        b: [b.rs, b.cs],
        dst_rs: dst.rs,
        packed: 0,
        accumulate,
        scale: scale.to_bits(),
        threads: product_threads(m, n, k, threads),
    };
    SCRATCH.with(|s| {
        let prims = &mut s.borrow_mut().prims;
        run_cached(
            lib,
            prims,
            key,
            None,
            a.data.as_ptr().cast(),
            b.data.as_ptr().cast(),
            dst.data.as_mut_ptr(),
        );
    });
}

/// [`gemm`] into a new `(a.rows, b.cols)` matrix.
pub fn gemm_new(a: View<'_>, b: View<'_>, scale: f32) -> Vec<f32> {
    let mut y = vec![0f32; a.rows * b.cols];
    gemm(ViewMut::rows(&mut y, a.rows, b.cols), a, b, false, scale);
    y
}

/// A right-hand matrix converted to bf16 once (a weight, for every product of one policy
/// version), in the memory order it had, and reordered once more into the blocked layout
/// oneDNN's kernels read (packed: otherwise every product repacks it, which costs as much
/// as the product itself for the few rows of a decode step; measured 2.4–2.8× at 1 row,
/// 1.2–1.5× at 32; the plain copy is then dropped). On the fallback path it keeps the f32
/// values.
#[derive(Debug, Clone)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    order: Order,
    bf16: Vec<u16>,
    f32: Vec<f32>,
    packed: Option<std::sync::Arc<Packed>>,
}

impl Matrix {
    /// `v` converted and packed (or, on the fallback path, copied dense by rows).
    pub fn new(v: View<'_>) -> Matrix {
        let (rows, cols) = (v.rows, v.cols);
        let Some(lib) = backend().bf16_lib() else {
            let mut f = Vec::with_capacity(rows * cols);
            for r in 0..rows {
                f.extend((0..cols).map(|c| v.data[r * v.rs + c * v.cs]));
            }
            return Matrix {
                rows,
                cols,
                order: Order::Rows,
                bf16: Vec::new(),
                f32: f,
                packed: None,
            };
        };
        let mut bf16 = Vec::new();
        let order = convert(v, &mut bf16);
        // A layout oneDNN cannot pack, or will not read at every row count, stays plain.
        let packed = (rows > 0 && cols > 0)
            .then(|| lib.pack(rows, cols, order, &bf16).ok())
            .flatten()
            .map(std::sync::Arc::new);
        if packed.is_some() {
            // Products read the packed copy only: the plain one would double the memory.
            bf16 = Vec::new();
        }
        Matrix {
            rows,
            cols,
            order,
            bf16,
            f32: Vec::new(),
            packed,
        }
    }

    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of the matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Whether products read it in oneDNN's blocked layout.
    pub fn is_packed(&self) -> bool {
        self.packed.is_some()
    }
}

/// A matrix in the blocked layout oneDNN chose for it: the data, and its memory
/// descriptor, which lives inside the primitive descriptor that chose it (kept alive).
#[derive(Debug)]
struct Packed {
    chooser: Handle,
    md: *const c_void,
    data: Vec<u8>,
}

// SAFETY: the handle and the descriptor are read only, after creation; oneDNN's primitive
// descriptors may be queried and used from any thread.
#[allow(unsafe_code)]
unsafe impl Send for Packed {}
#[allow(unsafe_code)]
unsafe impl Sync for Packed {}

impl Drop for Packed {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if let Some(lib) = &backend().lib {
            // SAFETY: the primitive descriptor this value created and owns alone.
            unsafe { (lib.destroy[PD])(self.chooser) };
        }
    }
}

/// [`gemm`] with a right-hand matrix converted beforehand, on `threads` threads (or the
/// cores [`crate::cores::spread`] gives, when more).
pub fn gemm_prepared(dst: ViewMut<'_>, a: View<'_>, b: &Matrix, accumulate: bool, scale: f32, threads: usize) {
    product(dst, a, Rhs::Prepared(b), accumulate, scale, threads)
}

/// The right-hand side of a product: a view converted per call, or converted beforehand.
#[derive(Clone, Copy)]
enum Rhs<'a> {
    View(View<'a>),
    Prepared(&'a Matrix),
}

/// The product on the process's path; `threads` at least (more inside `cores::spread`).
fn product(dst: ViewMut<'_>, a: View<'_>, b: Rhs<'_>, accumulate: bool, scale: f32, threads: usize) {
    let lib = match (backend().bf16_lib(), b) {
        (Some(lib), _) => lib,
        (None, Rhs::View(b)) => return cpu::gemm(dst, a, b, accumulate, scale),
        (None, Rhs::Prepared(p)) => {
            return cpu::gemm(dst, a, View::rows(&p.f32, p.rows, p.cols), accumulate, scale);
        }
    };
    let (brows, n) = match b {
        Rhs::View(v) => (v.rows, v.cols),
        Rhs::Prepared(p) => (p.rows, p.cols),
    };
    let (m, k) = (a.rows, a.cols);
    assert!(
        brows == k && dst.rows == m && dst.cols == n,
        "bf16 gemm: ({m}×{k}) @ ({brows}×{n}) into ({}×{})",
        dst.rows,
        dst.cols
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 || dst.cs != 1 {
        // Nothing to multiply (zeros or nothing added), or a destination oneDNN cannot
        // write: neither happens in the model's products.
        let Rhs::View(b) = b else {
            panic!("bf16 gemm: a prepared ({k}×{n}) matrix with an empty inner dimension or into a strided destination")
        };
        return cpu::gemm(dst, a, b, accumulate, scale);
    }
    let end = (m - 1) * dst.rs + n;
    assert!(
        dst.data.len() >= end,
        "bf16 gemm: destination reaches element {end} of {}",
        dst.data.len()
    );
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let Scratch {
            a: abuf,
            b: bbuf,
            prims,
        } = &mut *s;
        let la = convert(a, abuf);
        let (lb, bptr, packed) = match b {
            Rhs::View(v) => (convert(v, bbuf), bbuf.as_ptr(), None),
            Rhs::Prepared(p) => match &p.packed {
                Some(pk) => (p.order, pk.data.as_ptr().cast::<u16>(), Some(&**pk)),
                None => (p.order, p.bf16.as_ptr(), None),
            },
        };
        let key = Key {
            m,
            k,
            n,
            dtype: DNNL_BF16,
            a: strides(la, m, k),
            b: strides(lb, k, n),
            dst_rs: dst.rs,
            packed: packed.map_or(0, |pk| pk.md as usize),
            accumulate,
            scale: scale.to_bits(),
            threads: product_threads(m, n, k, threads),
        };
        run_cached(
            lib,
            prims,
            key,
            packed.map(|pk| pk.md),
            abuf.as_ptr(),
            bptr,
            dst.data.as_mut_ptr(),
        );
    });
}

/// The threads a `(m×k) @ (k×n)` product runs on: the calling thread alone below a
/// million multiply-adds (waking a sleeping worker costs more than it saves), else
/// `threads` or the cores [`crate::cores::spread`] gives, when more.
fn product_threads(m: usize, n: usize, k: usize, threads: usize) -> usize {
    if m * n * k < 1 << 20 {
        1
    } else {
        threads.max(crate::cores::threads())
    }
}

/// Runs `key`'s product on these buffers with the calling thread's cached primitive for
/// it (made on first use; the cache is emptied when it holds 256).
fn run_cached(
    lib: &Lib,
    prims: &mut HashMap<Key, Product>,
    key: Key,
    packed: Option<*const c_void>,
    a: *const u16,
    b: *const u16,
    dst: *mut f32,
) {
    let Key { m, k, n, .. } = key;
    lib.set_threads(key.threads);
    if !prims.contains_key(&key) {
        if prims.len() >= 256 {
            prims.clear();
        }
        let p = lib
            .product(&key, packed)
            .unwrap_or_else(|e| panic!("oneDNN gemm ({m}×{k}) @ ({k}×{n}): {e}"));
        prims.insert(key, p);
    }
    lib.run(&prims[&key], a, b, dst)
        .unwrap_or_else(|e| panic!("oneDNN gemm ({m}×{k}) @ ({k}×{n}): {e}"));
}

/// How a matrix lies in its converted buffer: row-major, or column-major (a transposed
/// view converted in its own memory order, which oneDNN reads through strides).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Order {
    Rows,
    Cols,
}

/// Converts `v` to bf16 into `buf` in one pass over its memory, keeping its order where it
/// is dense by rows or by columns (a weight read transposed stays as it lies), else by rows.
fn convert(v: View<'_>, buf: &mut Vec<u16>) -> Order {
    let len = v.rows * v.cols;
    // Every element is written below: growing without zeroing would do, but a resize of
    // a reused buffer only zeroes what it has not held before.
    buf.resize(len, 0);
    // Rows dense, or columns dense, one after another or spaced apart (a slice of a wider
    // matrix): one vectorised run per row (column), or one for the whole matrix when they
    // are contiguous, kept in that order. Any other layout is read element by element, by
    // rows.
    let (line, step, order) = if v.cs == 1 {
        (v.cols, v.rs, Order::Rows)
    } else if v.rs == 1 {
        (v.rows, v.cs, Order::Cols)
    } else {
        for (r, row) in buf.chunks_exact_mut(v.cols).enumerate() {
            for (c, d) in row.iter_mut().enumerate() {
                *d = round(v.data[r * v.rs + c * v.cs]);
            }
        }
        return Order::Rows;
    };
    let (line, step) = if step == line { (len, len) } else { (line, step) };
    if line == 0 {
        return order;
    }
    let data = v.data;
    // Slices per run, not indexing per element: an overflow-checked multiply per element
    // (debug builds) kept this loop scalar.
    cpu::vectorized(
        #[inline(always)]
        || {
            for (i, dst) in buf.chunks_exact_mut(line).enumerate() {
                for (d, &x) in dst.iter_mut().zip(&data[i * step..i * step + line]) {
                    *d = round(x);
                }
            }
        },
    );
    order
}

/// The strides of a `(rows, cols)` matrix lying in `o`.
fn strides(o: Order, rows: usize, cols: usize) -> [usize; 2] {
    match o {
        Order::Rows => [cols, 1],
        Order::Cols => [1, rows],
    }
}

/// What a cached primitive was made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    m: usize,
    k: usize,
    n: usize,
    /// The inputs' number type (`DNNL_BF16`, or `DNNL_F32` for [`gemm_f32`]).
    dtype: c_int,
    /// The inputs' strides, in elements.
    a: [usize; 2],
    b: [usize; 2],
    dst_rs: usize,
    /// The packed layout's descriptor (its address), 0 for a plain one.
    packed: usize,
    accumulate: bool,
    scale: u32,
    /// oneDNN plans a product's split among threads when it makes the primitive.
    threads: usize,
}

/// A thread's conversion buffers and the primitives it made (oneDNN's are made per shape).
#[derive(Default)]
struct Scratch {
    a: Vec<u16>,
    b: Vec<u16>,
    prims: HashMap<Key, Product>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The process's choice: a loaded oneDNN and the path bf16 products take, or the fallback
/// and why; and whether f32 products run on oneDNN too.
struct Backend {
    path: Path,
    why: String,
    /// oneDNN, where it loaded (for f32 products even on a CPU without bf16 units).
    lib: Option<Lib>,
    /// Whether oneDNN offers a real (not reference) f32 matmul here; `false` leaves f32
    /// products to the `gemm` crate.
    f32_on_onednn: bool,
}

impl Backend {
    /// oneDNN, where bf16 products run on it.
    fn bf16_lib(&self) -> Option<&Lib> {
        self.lib.as_ref().filter(|_| self.path != Path::F32)
    }

    /// oneDNN, where f32 products run on it.
    fn f32_lib(&self) -> Option<&Lib> {
        self.lib.as_ref().filter(|_| self.f32_on_onednn)
    }
}

fn backend() -> &'static Backend {
    static B: OnceLock<Backend> = OnceLock::new();
    B.get_or_init(choose)
}

#[allow(unsafe_code)]
fn choose() -> Backend {
    let fallback = |why: String| Backend {
        path: Path::F32,
        why,
        lib: None,
        f32_on_onednn: false,
    };
    let forced = std::env::var("STREAMRL_BF16").unwrap_or_default();
    match forced.as_str() {
        "" | "auto" | "avx512" => {}
        "f32" => return fallback("STREAMRL_BF16=f32".into()),
        other => return fallback(format!("STREAMRL_BF16=`{other}` is not one of auto, avx512, f32")),
    }
    let candidates = candidates();
    let Some((lib, file)) = candidates
        .iter()
        .find_map(|c| Lib::open(c).ok().map(|l| (l, c.clone())))
    else {
        let tried: Vec<String> = candidates.iter().map(|c| c.display().to_string()).collect();
        return fallback(format!(
            "oneDNN 2.x not found; tried {}; scripts/onednn.sh fetches it",
            tried.join(", ")
        ));
    };
    if forced == "avx512" {
        // SAFETY: a plain setter of oneDNN's, called before its first primitive.
        unsafe { (lib.set_max_cpu_isa)(ISA_AVX512_BF16) };
    }
    // SAFETY: a plain getter of oneDNN's.
    let isa = unsafe { (lib.effective_cpu_isa)() };
    let found = format!("oneDNN {} from {}", lib.version, file.display());
    let (path, why) = if isa & ISA_AMX == ISA_AMX {
        (Path::Amx, found)
    } else if isa & ISA_AVX512_BF16 == ISA_AVX512_BF16 {
        (Path::Avx512Bf16, found)
    } else {
        (
            Path::F32,
            format!(
                "this CPU has neither AMX nor AVX-512 BF16 (oneDNN ISA {isa:#x}; its bf16 kernels would emulate); {found}"
            ),
        )
    };
    // f32 products on oneDNN where its kernels are AVX-512 ones: those give a row the same
    // bits whatever rows share its call (checked by the tests); its AVX2 kernels do not
    // (measured: a lone row differs from the same row among 9 at SmolLM2's 576×1536), and
    // a sampler's f32 logprobs must be the trainer's. A descriptor only: a `Product` would
    // look the backend up again when dropped.
    let f32_on_onednn = isa & ISA_AVX512_CORE == ISA_AVX512_CORE
        && (|| -> Result<(), String> {
            let mds = [
                lib.md(16, 16, DNNL_F32, [16, 1])?,
                lib.md(16, 16, DNNL_F32, [16, 1])?,
                lib.md(16, 16, DNNL_F32, [16, 1])?,
            ];
            let pd = lib.matmul_pd(mds.each_ref().map(|d| d.0.as_ptr().cast()), std::ptr::null_mut())?;
            // SAFETY: created just above, used no more.
            unsafe { (lib.destroy[PD])(pd) };
            Ok(())
        })()
        .is_ok();
    Backend {
        path,
        why,
        lib: Some(lib),
        f32_on_onednn,
    }
}

/// The files oneDNN is looked for in, in order (a bare name is the dynamic loader's search).
fn candidates() -> Vec<PathBuf> {
    let mut c = Vec::new();
    if let Some(p) = std::env::var_os("STREAMRL_ONEDNN").map(PathBuf::from) {
        c.push(if p.is_dir() { p.join(SONAME) } else { p });
    }
    c.push(PathBuf::from(SONAME));
    let tools = std::env::var_os("STREAMRL_TOOLS_DIR")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            FsPath::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .map(|w| w.join("target/test-tools")),
        );
    for t in tools {
        c.push(t.join("onednn").join(LIBDIR).join(SONAME));
    }
    c
}

const SONAME: &str = "libdnnl.so.2";
/// Where Debian's packages put their libraries, under the directory they are unpacked in.
const LIBDIR: &str = "usr/lib/x86_64-linux-gnu";
const ISA_AVX512_CORE: c_int = 0x27;
const ISA_AVX512_BF16: c_int = 0xe7;
const ISA_AMX: c_int = 0x3e7;
const DNNL_CPU: c_int = 1;
const DNNL_BF16: c_int = 2;
const DNNL_F32: c_int = 3;
const STREAM_IN_ORDER: u32 = 1;
const QUERY_IMPL_INFO_STR: c_int = 8;
const QUERY_WEIGHTS_MD: c_int = 131;
const FORMAT_TAG_ANY: c_int = 1;
const ARG_SRC: c_int = 1;
const ARG_DST: c_int = 17;
const ARG_WEIGHTS: c_int = 33;
/// Indices into [`Lib::destroy`].
const PRIMITIVE: usize = 0;
const STREAM: usize = 1;
const MEMORY: usize = 2;
const PD: usize = 3;
const ATTR: usize = 4;
const POST_OPS: usize = 5;

type Handle = *mut c_void;
type Status = c_int;

/// `dnnl_memory_desc_t` and `dnnl_matmul_desc_t` are structs in oneDNN 2.x (696 and 2800
/// bytes in 2.6) that the API fills and reads through pointers only: room enough for both.
#[repr(C, align(64))]
struct Desc([u8; 8192]);

impl Desc {
    fn new() -> Box<Desc> {
        Box::new(Desc([0; 8192]))
    }
    fn ptr(&mut self) -> *mut c_void {
        self.0.as_mut_ptr().cast()
    }
}

#[repr(C)]
struct ExecArg {
    arg: c_int,
    memory: Handle,
}

#[repr(C)]
struct Version {
    major: c_int,
    minor: c_int,
    patch: c_int,
}

/// oneDNN's entry points, resolved once from the loaded library.
struct Lib {
    version: String,
    engine: Handle,
    effective_cpu_isa: unsafe extern "C" fn() -> c_int,
    set_max_cpu_isa: unsafe extern "C" fn(c_int) -> Status,
    stream_create: unsafe extern "C" fn(*mut Handle, Handle, u32) -> Status,
    md_init: unsafe extern "C" fn(*mut c_void, c_int, *const i64, c_int, *const i64) -> Status,
    md_init_by_tag: unsafe extern "C" fn(*mut c_void, c_int, *const i64, c_int, c_int) -> Status,
    md_get_size: unsafe extern "C" fn(*const c_void) -> usize,
    pd_query_md: unsafe extern "C" fn(Handle, c_int, c_int) -> *const c_void,
    reorder_pd_create:
        unsafe extern "C" fn(*mut Handle, *const c_void, Handle, *const c_void, Handle, Handle) -> Status,
    matmul_desc_init:
        unsafe extern "C" fn(*mut c_void, *const c_void, *const c_void, *const c_void, *const c_void) -> Status,
    attr_create: unsafe extern "C" fn(*mut Handle) -> Status,
    attr_set_output_scales: unsafe extern "C" fn(Handle, i64, c_int, *const f32) -> Status,
    attr_set_post_ops: unsafe extern "C" fn(Handle, Handle) -> Status,
    post_ops_create: unsafe extern "C" fn(*mut Handle) -> Status,
    post_ops_append_sum: unsafe extern "C" fn(Handle, f32) -> Status,
    pd_create: unsafe extern "C" fn(*mut Handle, *const c_void, Handle, Handle, Handle) -> Status,
    pd_query: unsafe extern "C" fn(Handle, c_int, c_int, *mut c_void) -> Status,
    primitive_create: unsafe extern "C" fn(*mut Handle, Handle) -> Status,
    memory_create: unsafe extern "C" fn(*mut Handle, *const c_void, Handle, *mut c_void) -> Status,
    memory_set_data_handle: unsafe extern "C" fn(Handle, *mut c_void) -> Status,
    execute: unsafe extern "C" fn(Handle, Handle, c_int, *const ExecArg) -> Status,
    stream_wait: unsafe extern "C" fn(Handle) -> Status,
    /// `dnnl_primitive_destroy`, `dnnl_stream_destroy`, `dnnl_memory_destroy`,
    /// `dnnl_primitive_desc_destroy`, `dnnl_primitive_attr_destroy`, `dnnl_post_ops_destroy`
    /// (each takes its object and returns a status).
    destroy: [unsafe extern "C" fn(Handle) -> Status; 6],
    /// libgomp's, which oneDNN's Debian build runs its threads on.
    omp_set_num_threads: Option<unsafe extern "C" fn(c_int)>,
}

// SAFETY: the engine handle is only read after creation; oneDNN engines are thread-safe, and
// everything else here is a function pointer.
#[allow(unsafe_code)]
unsafe impl Send for Lib {}
#[allow(unsafe_code)]
unsafe impl Sync for Lib {}

/// A primitive made for one [`Key`], with its three memory objects (the data handles are
/// set per call) and a stream, all used by the thread that made them only.
struct Product {
    prim: Handle,
    stream: Handle,
    mem: [Handle; 3],
}

impl Drop for Product {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if let Some(lib) = &backend().lib {
            // SAFETY: objects this product created and owns alone; null handles are
            // accepted by oneDNN's destroy functions.
            unsafe {
                (lib.destroy[PRIMITIVE])(self.prim);
                (lib.destroy[STREAM])(self.stream);
                for m in self.mem {
                    (lib.destroy[MEMORY])(m);
                }
            }
        }
    }
}

fn check(status: Status, what: &str) -> Result<(), String> {
    if status == 0 {
        Ok(())
    } else {
        Err(format!("oneDNN {what} failed with status {status}"))
    }
}

/// A symbol's address as the function pointer type `F`.
///
/// # Safety
/// `p` must be a function whose C signature `F` spells.
#[allow(unsafe_code)]
unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller's contract; the sizes agree (checked above).
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

#[allow(unsafe_code)]
impl Lib {
    fn open(file: &FsPath) -> Result<Lib, String> {
        let dl = |f: &FsPath| -> Result<Handle, String> {
            let c = CString::new(f.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
            // SAFETY: dlopen with a NUL-terminated path; a null result is handled.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if h.is_null() {
                // SAFETY: dlerror returns a static NUL-terminated string or null.
                let e = unsafe { libc::dlerror() };
                let msg = if e.is_null() {
                    "unknown error".into()
                } else {
                    unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
                };
                return Err(format!("{}: {msg}", f.display()));
            }
            Ok(h)
        };
        // Debian's oneDNN needs libOpenCL.so.1 (its GPU runtime, unused here); an unpacked
        // copy beside it is loaded first so the loader finds it by its soname.
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            let ocl = dir.join("libOpenCL.so.1");
            if ocl.exists() {
                dl(&ocl)?;
            }
        }
        let h = dl(file)?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: a NUL-terminated symbol name looked up in a loaded library.
                let p = unsafe { libc::dlsym(h, concat!($name, "\0").as_ptr().cast::<c_char>()) };
                if p.is_null() {
                    return Err(format!("{}: no symbol {}", file.display(), $name));
                }
                // SAFETY: the symbol is oneDNN 2.x's function of that name, whose C
                // signature the field's type spells.
                unsafe { fn_ptr(p) }
            }};
        }
        let version: unsafe extern "C" fn() -> *const Version = sym!("dnnl_version");
        // SAFETY: dnnl_version returns a pointer to a static struct.
        let v = unsafe { &*version() };
        if v.major != 2 {
            return Err(format!(
                "{}: oneDNN {}.{}.{}; streamrl speaks the 2.x C API",
                file.display(),
                v.major,
                v.minor,
                v.patch
            ));
        }
        let engine_create: unsafe extern "C" fn(*mut Handle, c_int, usize) -> Status = sym!("dnnl_engine_create");
        let mut engine = std::ptr::null_mut();
        // SAFETY: creates a CPU engine into a local handle.
        check(unsafe { engine_create(&mut engine, DNNL_CPU, 0) }, "engine_create")?;
        // SAFETY: looked up in the loaded library's dependency tree; absent is fine.
        let omp = unsafe { libc::dlsym(h, c"omp_set_num_threads".as_ptr()) };
        Ok(Lib {
            version: format!("{}.{}.{}", v.major, v.minor, v.patch),
            engine,
            effective_cpu_isa: sym!("dnnl_get_effective_cpu_isa"),
            set_max_cpu_isa: sym!("dnnl_set_max_cpu_isa"),
            stream_create: sym!("dnnl_stream_create"),
            md_init: sym!("dnnl_memory_desc_init_by_strides"),
            md_init_by_tag: sym!("dnnl_memory_desc_init_by_tag"),
            md_get_size: sym!("dnnl_memory_desc_get_size"),
            pd_query_md: sym!("dnnl_primitive_desc_query_md"),
            reorder_pd_create: sym!("dnnl_reorder_primitive_desc_create"),
            matmul_desc_init: sym!("dnnl_matmul_desc_init"),
            attr_create: sym!("dnnl_primitive_attr_create"),
            attr_set_output_scales: sym!("dnnl_primitive_attr_set_output_scales"),
            attr_set_post_ops: sym!("dnnl_primitive_attr_set_post_ops"),
            post_ops_create: sym!("dnnl_post_ops_create"),
            post_ops_append_sum: sym!("dnnl_post_ops_append_sum"),
            pd_create: sym!("dnnl_primitive_desc_create"),
            pd_query: sym!("dnnl_primitive_desc_query"),
            primitive_create: sym!("dnnl_primitive_create"),
            memory_create: sym!("dnnl_memory_create"),
            memory_set_data_handle: sym!("dnnl_memory_set_data_handle"),
            execute: sym!("dnnl_primitive_execute"),
            stream_wait: sym!("dnnl_stream_wait"),
            destroy: [
                sym!("dnnl_primitive_destroy"),
                sym!("dnnl_stream_destroy"),
                sym!("dnnl_memory_destroy"),
                sym!("dnnl_primitive_desc_destroy"),
                sym!("dnnl_primitive_attr_destroy"),
                sym!("dnnl_post_ops_destroy"),
            ],
            omp_set_num_threads: (!omp.is_null())
                // SAFETY: libgomp's `void omp_set_num_threads(int)`.
                .then(|| unsafe { fn_ptr::<unsafe extern "C" fn(c_int)>(omp) }),
        })
    }

    /// A memory descriptor for a `(rows, cols)` matrix of `dtype` with these strides.
    fn md(&self, rows: usize, cols: usize, dtype: c_int, strides: [usize; 2]) -> Result<Box<Desc>, String> {
        let mut d = Desc::new();
        let dims = [rows as i64, cols as i64];
        let st = [strides[0] as i64, strides[1] as i64];
        // SAFETY: d has room for a dnnl_memory_desc_t; dims and strides hold 2 values.
        check(
            unsafe { (self.md_init)(d.ptr(), 2, dims.as_ptr(), dtype, st.as_ptr()) },
            "memory_desc_init",
        )?;
        Ok(d)
    }

    /// The primitive for `key`'s product, its weights in the layout `packed` describes
    /// (else plain), refused unless oneDNN picked a real kernel.
    fn product(&self, key: &Key, packed: Option<*const c_void>) -> Result<Product, String> {
        let Key { m, k, n, .. } = *key;
        let mut a = self.md(m, k, key.dtype, key.a)?;
        let mut plain = self.md(k, n, key.dtype, key.b)?;
        let b = packed.unwrap_or(plain.ptr());
        let mut c = self.md(m, n, DNNL_F32, [key.dst_rs, 1])?;
        let mut attr = std::ptr::null_mut();
        // SAFETY: attribute and post-op objects created into local handles and configured.
        unsafe {
            check((self.attr_create)(&mut attr), "primitive_attr_create")?;
            if key.scale != 1f32.to_bits() {
                let s = f32::from_bits(key.scale);
                check((self.attr_set_output_scales)(attr, 1, 0, &s), "set_output_scales")?;
            }
            if key.accumulate {
                let mut po = std::ptr::null_mut();
                check((self.post_ops_create)(&mut po), "post_ops_create")?;
                check((self.post_ops_append_sum)(po, 1.0), "post_ops_append_sum")?;
                let set = (self.attr_set_post_ops)(attr, po);
                (self.destroy[POST_OPS])(po);
                check(set, "set_post_ops")?;
            }
        }
        let pd = self.matmul_pd([a.ptr(), b, c.ptr()], attr);
        // SAFETY: attr was created above; the descriptor kept a copy.
        unsafe { (self.destroy[ATTR])(attr) };
        let pd = pd?;
        let made = self.instantiate(pd, [a.ptr(), b, c.ptr()]);
        // SAFETY: pd was created above; the primitive keeps what it needs of it.
        unsafe { (self.destroy[PD])(pd) };
        made
    }

    /// A matmul primitive descriptor over these memory descriptors (source, weights,
    /// destination; no bias), refused unless oneDNN picked a real kernel.
    fn matmul_pd(&self, [a, b, c]: [*const c_void; 3], attr: Handle) -> Result<Handle, String> {
        let mut desc = Desc::new();
        // SAFETY: the caller's descriptors are initialised; no bias.
        check(
            unsafe { (self.matmul_desc_init)(desc.ptr(), a, b, std::ptr::null(), c) },
            "matmul_desc_init",
        )?;
        let mut pd = std::ptr::null_mut();
        // SAFETY: a matmul descriptor made above, the process's engine.
        check(
            unsafe { (self.pd_create)(&mut pd, desc.ptr(), attr, self.engine, std::ptr::null_mut()) },
            "primitive_desc_create",
        )?;
        let mut impl_name: *const c_char = std::ptr::null();
        // SAFETY: the query writes a pointer to a string owned by pd.
        let queried = unsafe {
            (self.pd_query)(
                pd,
                QUERY_IMPL_INFO_STR,
                0,
                (&mut impl_name as *mut *const c_char).cast(),
            )
        };
        // SAFETY: a NUL-terminated string owned by pd, which lives until destroyed below.
        let name = (queried == 0).then(|| unsafe { CStr::from_ptr(impl_name) }.to_string_lossy().into_owned());
        match name {
            Some(name) if !name.starts_with("ref") => Ok(pd),
            other => {
                // SAFETY: pd was created above and is used no more.
                unsafe { (self.destroy[PD])(pd) };
                Err(format!(
                    "oneDNN offers only its reference kernel for this product ({})",
                    other.unwrap_or_else(|| "unnamed".into())
                ))
            }
        }
    }

    /// The primitive, stream and memories for a primitive descriptor whose memory
    /// descriptors are `mds` (source, weights, destination).
    fn instantiate(&self, pd: Handle, mds: [*const c_void; 3]) -> Result<Product, String> {
        let mut prim = std::ptr::null_mut();
        let mut stream = std::ptr::null_mut();
        let mut mem = [std::ptr::null_mut(); 3];
        // SAFETY: primitive, stream and memory objects created into local handles from the
        // descriptors given; the memories get their data handles per call.
        unsafe {
            check((self.primitive_create)(&mut prim, pd), "primitive_create")?;
            check(
                (self.stream_create)(&mut stream, self.engine, STREAM_IN_ORDER),
                "stream_create",
            )?;
            for (h, d) in mem.iter_mut().zip(mds) {
                check(
                    (self.memory_create)(h, d, self.engine, std::ptr::null_mut()),
                    "memory_create",
                )?;
            }
        }
        Ok(Product { prim, stream, mem })
    }

    /// `data`, a `(rows, cols)` bf16 matrix lying in `order`, reordered into the layout
    /// oneDNN's kernels read for it as a product's right-hand side: chosen for 32 rows on
    /// the left, and refused unless it also serves 1, 8, 256 and 2048 rows.
    fn pack(&self, rows: usize, cols: usize, order: Order, data: &[u16]) -> Result<Packed, String> {
        let (k, n) = (rows, cols);
        let mut any = Desc::new();
        let dims = [k as i64, n as i64];
        // SAFETY: room for a descriptor; dims holds 2 values.
        check(
            unsafe { (self.md_init_by_tag)(any.ptr(), 2, dims.as_ptr(), DNNL_BF16, FORMAT_TAG_ANY) },
            "memory_desc_init_by_tag",
        )?;
        let layout_for = |m: usize, b: *const c_void| -> Result<Handle, String> {
            let mut a = self.md(m, k, DNNL_BF16, [k, 1])?;
            let mut c = self.md(m, n, DNNL_F32, [n, 1])?;
            self.matmul_pd([a.ptr(), b, c.ptr()], std::ptr::null_mut())
        };
        let chooser = layout_for(32, any.ptr())?;
        let mut packed = Packed {
            chooser,
            // SAFETY: a descriptor owned by `chooser`, which `Packed` keeps alive.
            md: unsafe { (self.pd_query_md)(chooser, QUERY_WEIGHTS_MD, 0) },
            data: Vec::new(),
        };
        if packed.md.is_null() {
            return Err("oneDNN named no weights layout".into());
        }
        for m in [1, 8, 256, 2048] {
            let pd = layout_for(m, packed.md)?;
            // SAFETY: created just above, used no more.
            unsafe { (self.destroy[PD])(pd) };
        }
        // SAFETY: a descriptor oneDNN made.
        let size = unsafe { (self.md_get_size)(packed.md) };
        let mut out = vec![0u8; size];
        let mut src = self.md(k, n, DNNL_BF16, strides(order, k, n))?;
        let (mut rpd, mut prim, mut stream) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        let mut mem = [std::ptr::null_mut(); 2];
        // SAFETY: a reorder between two descriptors of the same (k, n) matrix on the
        // process's engine, run once from `data` (k·n values, as `src` says) into `out`
        // (the size the packed descriptor asks for); every object is destroyed after.
        let ran = unsafe {
            (|| {
                check(
                    (self.reorder_pd_create)(
                        &mut rpd,
                        src.ptr(),
                        self.engine,
                        packed.md,
                        self.engine,
                        std::ptr::null_mut(),
                    ),
                    "reorder_primitive_desc_create",
                )?;
                check((self.primitive_create)(&mut prim, rpd), "primitive_create")?;
                check(
                    (self.stream_create)(&mut stream, self.engine, STREAM_IN_ORDER),
                    "stream_create",
                )?;
                check(
                    (self.memory_create)(&mut mem[0], src.ptr(), self.engine, data.as_ptr() as *mut c_void),
                    "memory_create",
                )?;
                check(
                    (self.memory_create)(&mut mem[1], packed.md, self.engine, out.as_mut_ptr().cast()),
                    "memory_create",
                )?;
                let args = [
                    ExecArg {
                        arg: ARG_SRC,
                        memory: mem[0],
                    },
                    ExecArg {
                        arg: ARG_DST,
                        memory: mem[1],
                    },
                ];
                check((self.execute)(prim, stream, 2, args.as_ptr()), "reorder")?;
                check((self.stream_wait)(stream), "stream_wait")
            })()
        };
        // SAFETY: objects created above (null where creation did not get that far, which
        // oneDNN's destroy functions accept).
        unsafe {
            (self.destroy[PD])(rpd);
            (self.destroy[PRIMITIVE])(prim);
            (self.destroy[STREAM])(stream);
            mem.iter().for_each(|&m| {
                (self.destroy[MEMORY])(m);
            });
        }
        ran?;
        packed.data = out;
        Ok(packed)
    }

    /// The OpenMP threads the calling thread's next products (and primitives) use.
    fn set_threads(&self, threads: usize) {
        if let Some(set) = self.omp_set_num_threads {
            // SAFETY: libgomp's setter of the calling thread's team size.
            unsafe { set(threads.max(1) as c_int) };
        }
    }

    /// Runs `p` on these buffers (the shapes and threads it was made for).
    fn run(&self, p: &Product, a: *const u16, b: *const u16, c: *mut f32) -> Result<(), String> {
        // SAFETY: the buffers hold the matrices the primitive was made for (the caller
        // converted them for this key); oneDNN reads a and b and writes c during execute,
        // which waits for completion before returning.
        unsafe {
            check(
                (self.memory_set_data_handle)(p.mem[0], a as *mut c_void),
                "memory_set_data_handle",
            )?;
            check(
                (self.memory_set_data_handle)(p.mem[1], b as *mut c_void),
                "memory_set_data_handle",
            )?;
            check(
                (self.memory_set_data_handle)(p.mem[2], c.cast()),
                "memory_set_data_handle",
            )?;
            let args = [
                ExecArg {
                    arg: ARG_SRC,
                    memory: p.mem[0],
                },
                ExecArg {
                    arg: ARG_WEIGHTS,
                    memory: p.mem[1],
                },
                ExecArg {
                    arg: ARG_DST,
                    memory: p.mem[2],
                },
            ];
            check((self.execute)(p.prim, p.stream, 3, args.as_ptr()), "primitive_execute")?;
            check((self.stream_wait)(p.stream), "stream_wait")
        }
    }
}

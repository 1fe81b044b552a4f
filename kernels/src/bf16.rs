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
//! `libdnnl.so.3` in the directory it names); the system's `libdnnl.so.3`;
//! `libdnnl.so.3` under `$STREAMRL_TOOLS_DIR/onednn` or `target/test-tools/onednn`,
//! where `scripts/onednn.sh` unpacks Intel's `onednn-cpu-gomp` wheel (oneDNN 3.2 on GNU
//! OpenMP, from PyPI) without root. oneDNN 3.x only: its C API is not 2.x's, and its
//! matmul kernels on AMX run the model's large products about twice as fast as 2.6's.
//!
//! oneDNN's fast kernels take dense matrices only (a view whose rows are further apart
//! than its columns, or a strided destination, runs on a generic kernel at a tenth of
//! the speed): [`Products::convert_blocks`] lays each head of an activation out densely,
//! once for all the products that read it.
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
//! println!("{}", bf16::describe()); // e.g. "bf16 products: AMX tiles (oneDNN 3.2.0 from …); …"
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

    /// [`Products::gemm`] of operands that may have been converted beforehand
    /// ([`Products::convert`]): the same product, the same bits, without converting a
    /// matrix again for every product that reads it.
    pub fn gemm_op(self, dst: ViewMut<'_>, a: Operand<'_>, b: Operand<'_>, accumulate: bool, scale: f32) {
        match (self, a, b) {
            (Products::F32, Operand::F32(a), Operand::F32(b)) => gemm_f32(dst, a, b, accumulate, scale, 1),
            (Products::F32, ..) => panic!("f32 products of bf16 operands: convert with Products::F32, which keeps f32"),
            (Products::Bf16, a, b) => product(dst, a, Rhs::Op(b), accumulate, scale, 1),
        }
    }

    /// [`Products::gemm_op`] into a new `(a.rows, b.cols)` matrix.
    pub fn gemm_op_new(self, a: Operand<'_>, b: Operand<'_>, scale: f32) -> Vec<f32> {
        let (m, n) = (a.rows(), b.cols());
        let mut y = vec![0f32; m * n];
        self.gemm_op(ViewMut::rows(&mut y, m, n), a, b, false, scale);
        y
    }

    /// `v` as several products of this number type read it: converted to bf16 once where
    /// they run on oneDNN, the f32 values as they are otherwise (f32 products, the f32
    /// fallback). Its [`Converted::of`] gives the operand of `v` or of a part of it.
    pub fn convert(self, v: View<'_>) -> Converted<'_> {
        let mut order = Order::Rows;
        let bits = self.converts().then(|| {
            let mut buf = Vec::new();
            order = convert(v, &mut buf);
            buf
        });
        Converted {
            src: v,
            bits,
            order,
            width: v.cols,
        }
    }

    /// [`Products::convert`] of a matrix whose columns fall in blocks of `width` (the
    /// heads of a `(tokens, heads, hd)` activation), each block stored apart, dense: so
    /// that every head's rows are a dense matrix of their own (oneDNN's fast kernels take
    /// dense matrices only; a head read in place, its rows `heads · hd` apart, ran on a
    /// generic kernel at a tenth of the speed).
    ///
    /// # Panics
    /// When `width` does not divide the columns or the view's columns are not adjacent.
    pub fn convert_blocks(self, v: View<'_>, width: usize) -> Converted<'_> {
        assert!(
            width > 0 && v.cols.is_multiple_of(width) && (v.cs == 1 || v.cols <= 1),
            "convert_blocks: ({}×{}) columns {} apart in blocks of {width}",
            v.rows,
            v.cols,
            v.cs
        );
        let bits = self.converts().then(|| {
            let (rows, blocks, len) = (v.rows, v.cols / width, v.rows * v.cols);
            let mut buf = Vec::with_capacity(len);
            let out = &mut buf.spare_capacity_mut()[..len];
            cpu::vectorized(
                #[inline(always)]
                || {
                    for (g, block) in out.chunks_exact_mut((rows * width).max(1)).take(blocks).enumerate() {
                        for (r, dst) in block.chunks_exact_mut(width).enumerate() {
                            for (d, &x) in dst.iter_mut().zip(&v.data[r * v.rs + g * width..][..width]) {
                                d.write(round(x));
                            }
                        }
                    }
                },
            );
            // SAFETY: `blocks` blocks of `rows` rows of `width`: all `len` elements written.
            #[allow(unsafe_code)]
            unsafe {
                buf.set_len(len)
            };
            buf
        });
        Converted {
            src: v,
            bits,
            order: Order::Rows,
            width,
        }
    }

    /// Whether [`Products::convert`] converts (bf16 products on oneDNN).
    fn converts(self) -> bool {
        self == Products::Bf16 && backend().bf16_lib().is_some()
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

/// A product's operand: f32 values, rounded to bf16 as the product reads them, or bf16
/// bits converted beforehand ([`Products::convert`]).
#[derive(Debug, Clone, Copy)]
pub enum Operand<'a> {
    /// Converted by the product that reads it.
    F32(View<'a>),
    /// Converted beforehand.
    Bf16(Bits<'a>),
}

impl Operand<'_> {
    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        match self {
            Operand::F32(v) => v.rows,
            Operand::Bf16(b) => b.rows,
        }
    }

    /// Columns of the matrix.
    pub fn cols(&self) -> usize {
        match self {
            Operand::F32(v) => v.cols,
            Operand::Bf16(b) => b.cols,
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        match self {
            Operand::F32(v) => Operand::F32(v.t()),
            Operand::Bf16(b) => Operand::Bf16(Bits {
                rows: b.cols,
                cols: b.rows,
                rs: b.cs,
                cs: b.rs,
                ..b
            }),
        }
    }
}

/// A strided matrix of bf16 bits: element `(r, c)` is `data[r * rs + c * cs]`, as
/// [`View`]'s.
#[derive(Debug, Clone, Copy)]
pub struct Bits<'a> {
    data: &'a [u16],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// A matrix converted once for the products that read it or parts of it
/// ([`Products::convert`]).
#[derive(Debug)]
pub struct Converted<'a> {
    /// The f32 matrix.
    src: View<'a>,
    /// Its bf16 bits, dense in `order`, or (`width` below the columns) row-major blocks
    /// of `width` columns one after another; `None` where products read f32.
    bits: Option<Vec<u16>>,
    order: Order,
    width: usize,
}

impl<'a> Converted<'a> {
    /// The operand of `v`, a view of the converted matrix or of a part of it (its rows
    /// and columns one or a whole row of the matrix apart, as those of a head's block of a
    /// `(tokens, heads, hd)` activation or its transpose).
    ///
    /// # Panics
    /// When `v` lies outside the converted matrix or steps through it otherwise.
    pub fn of<'b>(&'b self, v: View<'b>) -> Operand<'b> {
        let Some(bits) = &self.bits else {
            return Operand::F32(v);
        };
        assert!(
            self.order == Order::Rows && self.src.cs == 1,
            "converted matrix: parts of a matrix converted by columns"
        );
        let (rs, rows, width) = (self.src.rs.max(1), self.src.rows, self.width.max(1));
        let base = self.src.data.as_ptr() as usize;
        let ptr = v.data.as_ptr() as usize;
        let at = ptr.wrapping_sub(base) / size_of::<f32>();
        let (r, c) = (at / rs, at % rs);
        let (g, c) = (c / width, c % width);
        // Each axis steps along the matrix's rows (1) or down its columns (`rs`).
        let (mut last_r, mut last_c) = (r, c);
        let mut map = |stride: usize, len: usize| {
            if len <= 1 {
                0
            } else if stride == 1 {
                last_c += len - 1;
                1
            } else if stride == rs {
                last_r += len - 1;
                width
            } else {
                panic!("converted matrix: a view stepping {stride} elements where its rows are {rs} apart")
            }
        };
        let (brs, bcs) = (map(v.rs, v.rows), map(v.cs, v.cols));
        let empty = v.rows == 0 || v.cols == 0;
        assert!(
            empty || (ptr >= base && last_r < rows && last_c < width && g * width < self.src.cols),
            "converted matrix ({rows}×{} in blocks of {width}): a ({}×{}) view at element {at} reaches past its block",
            self.src.cols,
            v.rows,
            v.cols
        );
        let b = Bits {
            data: if empty {
                &[]
            } else {
                &bits[g * rows * width + r * width + c..]
            },
            rows: v.rows,
            cols: v.cols,
            rs: brs,
            cs: bcs,
        };
        Operand::Bf16(b)
    }

    /// The whole matrix as an operand.
    ///
    /// # Panics
    /// For a matrix converted in blocks ([`Products::convert_blocks`]).
    pub fn all(&self) -> Operand<'_> {
        let Some(bits) = &self.bits else {
            return Operand::F32(self.src);
        };
        let (rows, cols) = (self.src.rows, self.src.cols);
        assert!(
            self.width == cols,
            "converted matrix: the whole of a matrix converted in blocks"
        );
        let [rs, cs] = strides(self.order, rows, cols);
        Operand::Bf16(Bits {
            data: bits,
            rows,
            cols,
            rs,
            cs,
        })
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
    product(dst, Operand::F32(a), Rhs::Op(Operand::F32(b)), accumulate, scale, 1)
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
    let ran = SCRATCH.with(|s| {
        let prims = &mut s.borrow_mut().prims;
        run_cached(
            lib,
            prims,
            key,
            None,
            a.data.as_ptr().cast(),
            b.data.as_ptr().cast(),
            dst.data.as_mut_ptr(),
        )
    });
    if !ran {
        cpu::gemm(dst, a, b, accumulate, scale);
    }
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
    product(dst, Operand::F32(a), Rhs::Prepared(b), accumulate, scale, threads)
}

/// The right-hand side of a product: an operand, or a matrix prepared beforehand.
#[derive(Clone, Copy)]
enum Rhs<'a> {
    Op(Operand<'a>),
    Prepared(&'a Matrix),
}

/// `b`'s values in f32, row-major: what the f32 fallback multiplies.
fn widened(b: Bits<'_>) -> Vec<f32> {
    let mut out = Vec::with_capacity(b.rows * b.cols);
    for r in 0..b.rows {
        out.extend((0..b.cols).map(|c| widen(b.data[r * b.rs + c * b.cs])));
    }
    out
}

/// `op` as an f32 view, widened into `buf` when it holds bf16 bits.
fn as_f32<'a>(op: Operand<'a>, buf: &'a mut Vec<f32>) -> View<'a> {
    match op {
        Operand::F32(v) => v,
        Operand::Bf16(b) => {
            *buf = widened(b);
            View::rows(buf, b.rows, b.cols)
        }
    }
}

/// `op`'s bits as they lie, or its f32 values converted into `buf`.
fn bits_of<'a>(op: Operand<'a>, buf: &'a mut Vec<u16>) -> Bits<'a> {
    match op {
        Operand::F32(v) => {
            let [rs, cs] = strides(convert(v, buf), v.rows, v.cols);
            Bits {
                data: buf,
                rows: v.rows,
                cols: v.cols,
                rs,
                cs,
            }
        }
        Operand::Bf16(x) => x,
    }
}

/// The product on the process's path; `threads` at least (more inside `cores::spread`).
fn product(dst: ViewMut<'_>, a: Operand<'_>, b: Rhs<'_>, accumulate: bool, scale: f32, threads: usize) {
    let (mut wa, mut wb) = (Vec::new(), Vec::new());
    let lib = match (backend().bf16_lib(), b) {
        (Some(lib), _) => lib,
        // Bits only exist where oneDNN runs the products; widened, for completeness.
        (None, Rhs::Op(b)) => return cpu::gemm(dst, as_f32(a, &mut wa), as_f32(b, &mut wb), accumulate, scale),
        (None, Rhs::Prepared(p)) => {
            let b = View::rows(&p.f32, p.rows, p.cols);
            return cpu::gemm(dst, as_f32(a, &mut wa), b, accumulate, scale);
        }
    };
    let (brows, n) = match b {
        Rhs::Op(v) => (v.rows(), v.cols()),
        Rhs::Prepared(p) => (p.rows, p.cols),
    };
    let (m, k) = (a.rows(), a.cols());
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
        let Rhs::Op(b) = b else {
            panic!("bf16 gemm: a prepared ({k}×{n}) matrix with an empty inner dimension or into a strided destination")
        };
        return cpu::gemm(dst, as_f32(a, &mut wa), as_f32(b, &mut wb), accumulate, scale);
    }
    let end = (m - 1) * dst.rs + n;
    assert!(
        dst.data.len() >= end,
        "bf16 gemm: destination reaches element {end} of {}",
        dst.data.len()
    );
    for op in [Some(a), if let Rhs::Op(b) = b { Some(b) } else { None }]
        .into_iter()
        .flatten()
    {
        if let Operand::Bf16(x) = op {
            let need = cpu::extent(x.rows, x.cols, x.rs, x.cs);
            assert!(
                need <= x.data.len(),
                "bf16 gemm: an operand reaches element {need} of {}",
                x.data.len()
            );
        }
    }
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let Scratch {
            a: abuf,
            b: bbuf,
            prims,
        } = &mut *s;
        let ab = bits_of(a, abuf);
        // The right-hand side as bits, or (packed) oneDNN's blocked layout of it.
        let (bb, packed) = match b {
            Rhs::Op(v) => (bits_of(v, bbuf), None),
            Rhs::Prepared(p) => {
                let [rs, cs] = strides(p.order, k, n);
                let plain = Bits {
                    data: &p.bf16,
                    rows: k,
                    cols: n,
                    rs,
                    cs,
                };
                (plain, p.packed.as_deref())
            }
        };
        let bptr = packed.map_or(bb.data.as_ptr(), |pk| pk.data.as_ptr().cast::<u16>());
        let key = Key {
            m,
            k,
            n,
            dtype: DNNL_BF16,
            a: [ab.rs, ab.cs],
            b: [bb.rs, bb.cs],
            dst_rs: dst.rs,
            packed: packed.map_or(0, |pk| pk.md as usize),
            accumulate,
            scale: scale.to_bits(),
            threads: product_threads(m, n, k, threads),
        };
        if !run_cached(
            lib,
            prims,
            key,
            packed.map(|pk| pk.md),
            ab.data.as_ptr(),
            bptr,
            dst.data.as_mut_ptr(),
        ) {
            // A shape oneDNN has no real kernel for: the f32 product of the rounded inputs,
            // which is what a bf16 product is (up to the order of its sums).
            assert!(
                packed.is_none(),
                "bf16 gemm: no kernel for a packed ({k}×{n}) matrix at {m} rows"
            );
            let (wa, wb) = (widened(ab), widened(bb));
            cpu::gemm(dst, View::rows(&wa, m, k), View::rows(&wb, k, n), accumulate, scale);
        }
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
/// it (made on first use; the cache is emptied when it holds 256). `Ok(false)`: oneDNN
/// offers only its reference kernel for this shape (a product with an inner dimension of
/// 1, say), and nothing ran.
fn run_cached(
    lib: &Lib,
    prims: &mut HashMap<Key, Option<Product>>,
    key: Key,
    packed: Option<*const c_void>,
    a: *const u16,
    b: *const u16,
    dst: *mut f32,
) -> bool {
    let Key { m, k, n, .. } = key;
    lib.set_threads(key.threads);
    if !prims.contains_key(&key) {
        if prims.len() >= 256 {
            prims.clear();
        }
        let p = match lib.product(&key, packed) {
            Ok(p) => Some(p),
            Err(e) if e.contains(REFERENCE_ONLY) => None,
            Err(e) => panic!("oneDNN gemm ({m}×{k}) @ ({k}×{n}): {e}"),
        };
        prims.insert(key, p);
    }
    let Some(p) = &prims[&key] else {
        return false;
    };
    lib.run(p, a, b, dst)
        .unwrap_or_else(|e| panic!("oneDNN gemm ({m}×{k}) @ ({k}×{n}): {e}"));
    true
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
    // Every element is written below, into spare capacity: no zero-filling first (for a
    // new buffer, as `Products::convert` makes, that was 5% of a training step).
    buf.clear();
    buf.reserve(len);
    let out = &mut buf.spare_capacity_mut()[..len];
    // Rows dense, or columns dense, one after another or spaced apart (a slice of a wider
    // matrix): one vectorised run per row (column), or one for the whole matrix when they
    // are contiguous, kept in that order. Any other layout is read element by element, by
    // rows.
    let (line, step, order) = if v.cs == 1 {
        (v.cols, v.rs, Order::Rows)
    } else if v.rs == 1 {
        (v.rows, v.cs, Order::Cols)
    } else {
        for (r, row) in out.chunks_exact_mut(v.cols).enumerate() {
            for (c, d) in row.iter_mut().enumerate() {
                d.write(round(v.data[r * v.rs + c * v.cs]));
            }
        }
        // SAFETY: the loop above wrote all `len` elements.
        #[allow(unsafe_code)]
        unsafe {
            buf.set_len(len)
        };
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
            for (i, dst) in out.chunks_exact_mut(line).enumerate() {
                for (d, &x) in dst.iter_mut().zip(&data[i * step..i * step + line]) {
                    d.write(round(x));
                }
            }
        },
    );
    // SAFETY: the runs above, `len / line` of `line` elements, wrote all `len` elements.
    #[allow(unsafe_code)]
    unsafe {
        buf.set_len(len)
    };
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
    prims: HashMap<Key, Option<Product>>,
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
            "oneDNN 3.x not found; tried {}; scripts/onednn.sh fetches it",
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
            let pd = lib.matmul_pd(mds.each_ref().map(|d| d.ptr()), std::ptr::null_mut())?;
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

const SONAME: &str = "libdnnl.so.3";
/// Where `scripts/onednn.sh` puts the library, under the directory it unpacks into.
const LIBDIR: &str = "lib";
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
const ARG_ATTR_SCALES: c_int = 4096;
/// What [`Lib::matmul_pd`]'s error says when oneDNN has no real kernel for a product.
const REFERENCE_ONLY: &str = "oneDNN offers only its reference kernel";
/// Indices into [`Lib::destroy`].
const PRIMITIVE: usize = 0;
const STREAM: usize = 1;
const MEMORY: usize = 2;
const PD: usize = 3;
const ATTR: usize = 4;
const POST_OPS: usize = 5;

type Handle = *mut c_void;
type Status = c_int;

/// A memory descriptor (`dnnl_memory_desc_t`, an object in oneDNN 3.x), destroyed on drop.
struct Md<'l> {
    lib: &'l Lib,
    handle: Handle,
}

impl Md<'_> {
    fn ptr(&self) -> *const c_void {
        self.handle
    }
}

impl Drop for Md<'_> {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: a descriptor this value created and owns alone.
        unsafe { (self.lib.md_destroy)(self.handle) };
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
    md_create: unsafe extern "C" fn(*mut Handle, c_int, *const i64, c_int, *const i64) -> Status,
    md_create_by_tag: unsafe extern "C" fn(*mut Handle, c_int, *const i64, c_int, c_int) -> Status,
    md_destroy: unsafe extern "C" fn(Handle) -> Status,
    md_get_size: unsafe extern "C" fn(*const c_void) -> usize,
    pd_query_md: unsafe extern "C" fn(Handle, c_int, c_int) -> *const c_void,
    reorder_pd_create:
        unsafe extern "C" fn(*mut Handle, *const c_void, Handle, *const c_void, Handle, Handle) -> Status,
    matmul_pd_create: unsafe extern "C" fn(
        *mut Handle,
        Handle,
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        Handle,
    ) -> Status,
    attr_create: unsafe extern "C" fn(*mut Handle) -> Status,
    attr_set_scales_mask: unsafe extern "C" fn(Handle, c_int, c_int) -> Status,
    attr_set_post_ops: unsafe extern "C" fn(Handle, Handle) -> Status,
    post_ops_create: unsafe extern "C" fn(*mut Handle) -> Status,
    post_ops_append_sum: unsafe extern "C" fn(Handle, f32, i32, c_int) -> Status,
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
    /// The scale's memory (over `scale`), null for a product of scale 1.
    scale_mem: Handle,
    scale: Box<f32>,
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
                for m in self.mem.into_iter().chain([self.scale_mem]) {
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
        let h = dl(file)?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: a NUL-terminated symbol name looked up in a loaded library.
                let p = unsafe { libc::dlsym(h, concat!($name, "\0").as_ptr().cast::<c_char>()) };
                if p.is_null() {
                    return Err(format!("{}: no symbol {}", file.display(), $name));
                }
                // SAFETY: the symbol is oneDNN 3.x's function of that name, whose C
                // signature the field's type spells.
                unsafe { fn_ptr(p) }
            }};
        }
        let version: unsafe extern "C" fn() -> *const Version = sym!("dnnl_version");
        // SAFETY: dnnl_version returns a pointer to a static struct.
        let v = unsafe { &*version() };
        if v.major != 3 {
            return Err(format!(
                "{}: oneDNN {}.{}.{}; streamrl speaks the 3.x C API",
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
            md_create: sym!("dnnl_memory_desc_create_with_strides"),
            md_create_by_tag: sym!("dnnl_memory_desc_create_with_tag"),
            md_destroy: sym!("dnnl_memory_desc_destroy"),
            md_get_size: sym!("dnnl_memory_desc_get_size"),
            pd_query_md: sym!("dnnl_primitive_desc_query_md"),
            reorder_pd_create: sym!("dnnl_reorder_primitive_desc_create"),
            matmul_pd_create: sym!("dnnl_matmul_primitive_desc_create"),
            attr_create: sym!("dnnl_primitive_attr_create"),
            attr_set_scales_mask: sym!("dnnl_primitive_attr_set_scales_mask"),
            attr_set_post_ops: sym!("dnnl_primitive_attr_set_post_ops"),
            post_ops_create: sym!("dnnl_post_ops_create"),
            post_ops_append_sum: sym!("dnnl_post_ops_append_sum"),
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
    fn md(&self, rows: usize, cols: usize, dtype: c_int, strides: [usize; 2]) -> Result<Md<'_>, String> {
        let mut handle = std::ptr::null_mut();
        let dims = [rows as i64, cols as i64];
        let st = [strides[0] as i64, strides[1] as i64];
        // SAFETY: creates a descriptor into a local handle; dims and strides hold 2 values.
        check(
            unsafe { (self.md_create)(&mut handle, 2, dims.as_ptr(), dtype, st.as_ptr()) },
            "memory_desc_create_with_strides",
        )?;
        Ok(Md { lib: self, handle })
    }

    /// The primitive for `key`'s product, its weights in the layout `packed` describes
    /// (else plain), refused unless oneDNN picked a real kernel.
    fn product(&self, key: &Key, packed: Option<*const c_void>) -> Result<Product, String> {
        let Key { m, k, n, .. } = *key;
        let a = self.md(m, k, key.dtype, key.a)?;
        let plain = self.md(k, n, key.dtype, key.b)?;
        let b = packed.unwrap_or(plain.ptr());
        let c = self.md(m, n, DNNL_F32, [key.dst_rs, 1])?;
        let scaled = key.scale != 1f32.to_bits();
        let mut attr = std::ptr::null_mut();
        // SAFETY: attribute and post-op objects created into local handles and configured.
        unsafe {
            check((self.attr_create)(&mut attr), "primitive_attr_create")?;
            if scaled {
                // One scale for the whole source, given at execution: a scaled product.
                check((self.attr_set_scales_mask)(attr, ARG_SRC, 0), "set_scales_mask")?;
            }
            if key.accumulate {
                let mut po = std::ptr::null_mut();
                check((self.post_ops_create)(&mut po), "post_ops_create")?;
                check((self.post_ops_append_sum)(po, 1.0, 0, 0), "post_ops_append_sum")?;
                let set = (self.attr_set_post_ops)(attr, po);
                (self.destroy[POST_OPS])(po);
                check(set, "set_post_ops")?;
            }
        }
        let pd = self.matmul_pd([a.ptr(), b, c.ptr()], attr);
        // SAFETY: attr was created above; the descriptor kept a copy.
        unsafe { (self.destroy[ATTR])(attr) };
        let pd = pd?;
        let made = self.instantiate(pd, [a.ptr(), b, c.ptr()]).and_then(|mut p| {
            if scaled {
                *p.scale = f32::from_bits(key.scale);
                let mut one = Md {
                    lib: self,
                    handle: std::ptr::null_mut(),
                };
                // SAFETY: creates a one-element f32 descriptor into a local handle.
                check(
                    unsafe { (self.md_create)(&mut one.handle, 1, [1i64].as_ptr(), DNNL_F32, [1i64].as_ptr()) },
                    "memory_desc_create_with_strides",
                )?;
                // SAFETY: a memory over the product's own boxed scale, which lives as long.
                check(
                    unsafe {
                        (self.memory_create)(
                            &mut p.scale_mem,
                            one.ptr(),
                            self.engine,
                            (&mut *p.scale as *mut f32).cast(),
                        )
                    },
                    "memory_create",
                )?;
            }
            Ok(p)
        });
        // SAFETY: pd was created above; the primitive keeps what it needs of it.
        unsafe { (self.destroy[PD])(pd) };
        made
    }

    /// A matmul primitive descriptor over these memory descriptors (source, weights,
    /// destination; no bias), refused unless oneDNN picked a real kernel.
    fn matmul_pd(&self, [a, b, c]: [*const c_void; 3], attr: Handle) -> Result<Handle, String> {
        let mut pd = std::ptr::null_mut();
        // SAFETY: the caller's descriptors are made; no bias; the process's engine.
        check(
            unsafe { (self.matmul_pd_create)(&mut pd, self.engine, a, b, std::ptr::null(), c, attr) },
            "matmul_primitive_desc_create",
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
                    "{REFERENCE_ONLY} for this product ({})",
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
        Ok(Product {
            prim,
            stream,
            mem,
            scale_mem: std::ptr::null_mut(),
            scale: Box::new(1.0),
        })
    }

    /// `data`, a `(rows, cols)` bf16 matrix lying in `order`, reordered into the layout
    /// oneDNN's kernels read for it as a product's right-hand side: chosen for 32 rows on
    /// the left, and refused unless it also serves 1, 8, 256 and 2048 rows.
    fn pack(&self, rows: usize, cols: usize, order: Order, data: &[u16]) -> Result<Packed, String> {
        let (k, n) = (rows, cols);
        let mut any = Md {
            lib: self,
            handle: std::ptr::null_mut(),
        };
        let dims = [k as i64, n as i64];
        // SAFETY: creates a descriptor into a local handle; dims holds 2 values.
        check(
            unsafe { (self.md_create_by_tag)(&mut any.handle, 2, dims.as_ptr(), DNNL_BF16, FORMAT_TAG_ANY) },
            "memory_desc_create_with_tag",
        )?;
        let layout_for = |m: usize, b: *const c_void| -> Result<Handle, String> {
            let a = self.md(m, k, DNNL_BF16, [k, 1])?;
            let c = self.md(m, n, DNNL_F32, [n, 1])?;
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
        let src = self.md(k, n, DNNL_BF16, strides(order, k, n))?;
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
                ExecArg {
                    arg: ARG_ATTR_SCALES | ARG_SRC,
                    memory: p.scale_mem,
                },
            ];
            let n = if p.scale_mem.is_null() { 3 } else { 4 };
            check((self.execute)(p.prim, p.stream, n, args.as_ptr()), "primitive_execute")?;
            check((self.stream_wait)(p.stream), "stream_wait")
        }
    }
}

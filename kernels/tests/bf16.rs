//! The bf16 products against their definition (the f32 product of the inputs rounded to
//! bf16) on the path this machine takes, and every path this CPU has against the others on
//! the same inputs. oneDNN is fetched first (`scripts/onednn.sh`), so on a CPU with AMX or
//! AVX-512 BF16 the matrix units really run; each test writes the path it ran to stderr.

#[path = "../../tests/common/skip.rs"]
mod skip;

use std::io::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Once;

use streamrl_kernels::bf16::{self, Path};
use streamrl_kernels::cpu::{self, View, ViewMut};

/// Fetches oneDNN where the loader looks for it (once per test process).
fn fetch_onednn() {
    static F: Once = Once::new();
    F.call_once(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = Command::new("bash")
            .arg(root.join("scripts/onednn.sh"))
            .current_dir(&root)
            .output()
            .expect("running scripts/onednn.sh");
        assert!(
            out.status.success(),
            "scripts/onednn.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
}

/// What this CPU's flags say the path must be once oneDNN is there.
fn expected_path() -> Path {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let has = |f: &str| flags.contains(&f);
    match std::env::var("STREAMRL_BF16").as_deref() {
        Ok("f32") => return Path::F32,
        Ok("avx512") if has("avx512_bf16") => return Path::Avx512Bf16,
        _ => {}
    }
    if has("amx_bf16") && has("amx_tile") {
        Path::Amx
    } else if has("avx512_bf16") {
        Path::Avx512Bf16
    } else {
        Path::F32
    }
}

/// Written past the test harness's capture, so the CI log shows which path ran.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Deterministic values in [-1, 1) (a 64-bit LCG), with a spread of magnitudes.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if i % 7 == 0 { u * 8.0 } else { u }
        })
        .collect()
}

/// One product case: `(m × k) @ (k × n)`, `a` read transposed or not, `b` likewise.
struct Case {
    m: usize,
    k: usize,
    n: usize,
    at: bool,
    bt: bool,
    accumulate: bool,
    scale: f32,
}

const CASES: &[Case] = &[
    Case {
        m: 1,
        k: 576,
        n: 1536,
        at: false,
        bt: true,
        accumulate: false,
        scale: 1.0,
    },
    Case {
        m: 7,
        k: 33,
        n: 65,
        at: false,
        bt: false,
        accumulate: false,
        scale: 1.0,
    },
    Case {
        m: 64,
        k: 576,
        n: 192,
        at: false,
        bt: true,
        accumulate: true,
        scale: 1.0,
    },
    Case {
        m: 96,
        k: 128,
        n: 576,
        at: true,
        bt: false,
        accumulate: false,
        scale: 0.125,
    },
    Case {
        m: 130,
        k: 257,
        n: 31,
        at: true,
        bt: true,
        accumulate: true,
        scale: -2.0,
    },
];

/// The product of `c` on the process's path; what it must equal there (the f32 product of
/// the inputs rounded to bf16 on a bf16 path, of the inputs themselves on the fallback);
/// and the f32 product of the inputs themselves.
fn run_case(c: &Case, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let a = values(c.m * c.k, seed);
    let b = values(c.k * c.n, seed + 1);
    let init = values(c.m * c.n, seed + 2);
    let view = |d: &[f32], rows, cols, t: bool| -> Vec<f32> {
        // Stored so that the view below reads it as (rows, cols).
        if t { cpu::transpose(d, rows, cols) } else { d.to_vec() }
    };
    let (sa, sb) = (view(&a, c.m, c.k, c.at), view(&b, c.k, c.n, c.bt));
    fn mk(d: &[f32], rows: usize, cols: usize, t: bool) -> View<'_> {
        if t {
            View::rows(d, cols, rows).t()
        } else {
            View::rows(d, rows, cols)
        }
    }
    let mut got = init.clone();
    bf16::gemm(
        ViewMut::rows(&mut got, c.m, c.n),
        mk(&sa, c.m, c.k, c.at),
        mk(&sb, c.k, c.n, c.bt),
        c.accumulate,
        c.scale,
    );
    let f32_product = |a: &[f32], b: &[f32]| {
        let mut y = init.clone();
        let (a, b) = (mk(a, c.m, c.k, c.at), mk(b, c.k, c.n, c.bt));
        cpu::gemm(ViewMut::rows(&mut y, c.m, c.n), a, b, c.accumulate, c.scale);
        y
    };
    let exact = f32_product(&sa, &sb);
    let want = if bf16::path() == Path::F32 {
        exact.clone()
    } else {
        f32_product(&bf16::rounded(&sa), &bf16::rounded(&sb))
    };
    (got, want, exact)
}

/// Largest |got − want| over the scale of the terms summed (Σ|a||b|, bounded by k · 64).
fn worst(got: &[f32], want: &[f32], k: usize) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (k as f32 * 64.0))
        .fold(0.0, f32::max)
}

#[test]
fn products_equal_the_f32_product_of_the_rounded_inputs_on_this_cpus_path() {
    fetch_onednn();
    let path = bf16::path();
    say(&format!("bf16 test: {}", bf16::describe()));
    assert_eq!(path, expected_path(), "{}", bf16::describe());
    for (i, c) in CASES.iter().enumerate() {
        let (got, want, _) = run_case(c, i as u64 * 10);
        // Only the order of f32 additions differs: a few ulps of the terms' scale.
        let w = worst(&got, &want, c.k);
        assert!(w < 1e-6, "case {i} ({}×{}×{}) on {path}: error {w:e}", c.m, c.k, c.n);
    }
}

#[test]
fn bf16_products_are_within_bf16_rounding_of_f32() {
    fetch_onednn();
    let c = &CASES[2];
    let (got, _, exact) = run_case(c, 99);
    let w = worst(&got, &exact, c.k);
    // Each input carries 2^-9 relative rounding: the error is a few 2^-9 of the terms'
    // scale at worst, and far more than f32's (or the inputs were not rounded at all).
    assert!(w < 4.0 * 2f32.powi(-9), "error {w:e} on {}", bf16::path());
    if bf16::path() != Path::F32 {
        assert!(
            w > 1e-6,
            "a bf16 product as exact as f32 ({w:e}): the inputs were not rounded"
        );
    }
}

#[test]
fn rounding_is_to_nearest_even_and_keeps_nan() {
    assert_eq!(bf16::round(1.0), 0x3f80);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa (1).
    assert_eq!(bf16::round(1.0 + 2f32.powi(-8)), 0x3f80);
    assert_eq!(bf16::round(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    assert!(bf16::widen(bf16::round(f32::NAN)).is_nan());
    assert!(bf16::widen(bf16::round(f32::from_bits(0x7f80_0001))).is_nan());
    assert_eq!(bf16::widen(bf16::round(f32::INFINITY)), f32::INFINITY);
    assert_eq!(bf16::widen(bf16::round(-0.0)).to_bits(), (-0.0f32).to_bits());
}

/// Run by [`every_path_this_cpu_has_gives_the_same_products`] in a child process with
/// `STREAMRL_BF16` set: writes its products to `STREAMRL_BF16_OUT`. Alone, it checks them.
#[test]
fn child_writes_products() {
    fetch_onednn();
    let mut all = Vec::new();
    for (i, c) in CASES.iter().enumerate() {
        let (got, want, _) = run_case(c, i as u64 * 10);
        assert!(worst(&got, &want, c.k) < 1e-6);
        all.extend(got);
    }
    if let Some(out) = std::env::var_os("STREAMRL_BF16_OUT") {
        let bytes: Vec<u8> = all.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(out, bytes).unwrap();
        std::fs::write(
            format!("{}.path", std::env::var("STREAMRL_BF16_OUT").unwrap()),
            bf16::path().to_string(),
        )
        .unwrap();
    }
}

#[test]
fn every_path_this_cpu_has_gives_the_same_products() {
    fetch_onednn();
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut runs = Vec::new();
    for forced in ["auto", "avx512", "f32"] {
        let out = dir.path().join(forced);
        let child = Command::new(&exe)
            .args(["--exact", "child_writes_products", "--test-threads=1"])
            .env("STREAMRL_BF16", forced)
            .env("STREAMRL_BF16_OUT", &out)
            .output()
            .unwrap();
        assert!(
            child.status.success(),
            "child with STREAMRL_BF16={forced} failed: {}{}",
            String::from_utf8_lossy(&child.stdout),
            String::from_utf8_lossy(&child.stderr)
        );
        let bytes = std::fs::read(&out).unwrap();
        let vals: Vec<f32> = bytes
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let path = std::fs::read_to_string(format!("{}.path", out.display())).unwrap();
        runs.push((forced, path, vals));
    }
    let paths: Vec<String> = runs.iter().map(|(f, p, _)| format!("STREAMRL_BF16={f}: {p}")).collect();
    say(&format!("bf16 paths compared: {}", paths.join("; ")));
    if expected_path() == Path::F32 {
        skip::skipped(
            "every_path_this_cpu_has_gives_the_same_products",
            "a bf16 path (AMX or AVX-512 BF16) against the f32 fallback",
            "this CPU has neither",
        );
    }
    assert_eq!(runs[2].1, Path::F32.to_string());
    let want = expected_path().to_string();
    assert_eq!(runs[0].1, want, "the default path");
    for (forced, path, vals) in &runs[1..] {
        let w = worst(vals, &runs[0].2, 1024);
        // Two bf16 paths differ in the order of f32 additions only; the f32 fallback by the
        // inputs' rounding.
        let f32_path = Path::F32.to_string();
        let bound = if *path == runs[0].1 || (*path != f32_path && want != f32_path) {
            1e-6
        } else {
            4.0 * 2f32.powi(-9)
        };
        assert!(
            w < bound,
            "STREAMRL_BF16={forced} ({path}) against the default ({want}): {w:e}"
        );
    }
}

/// A weight converted once ([`bf16::Matrix`], packed into oneDNN's blocked layout on a
/// bf16 path) gives the products a weight converted per call gives, at every row count a
/// decode step or a prefill has.
#[test]
fn prepared_weights_give_the_products_of_converting_per_call() {
    fetch_onednn();
    let (k, n) = (192, 320);
    // A checkpoint's (out, in) weight, read transposed as the inference kernels read it.
    let w = values(n * k, 7);
    let wt = View::rows(&w, n, k).t();
    let prepared = bf16::Matrix::new(wt);
    assert_eq!((prepared.rows(), prepared.cols()), (k, n));
    assert_eq!(prepared.is_packed(), bf16::path() != Path::F32, "{}", bf16::describe());
    for m in [1, 7, 32, 300] {
        let x = values(m * k, m as u64);
        let init = values(m * n, 3);
        for accumulate in [false, true] {
            let (mut got, mut want) = (init.clone(), init.clone());
            bf16::gemm_prepared(
                ViewMut::rows(&mut got, m, n),
                View::rows(&x, m, k),
                &prepared,
                accumulate,
                1.0,
                1,
            );
            bf16::gemm(
                ViewMut::rows(&mut want, m, n),
                View::rows(&x, m, k),
                wt,
                accumulate,
                1.0,
            );
            let w = worst(&got, &want, k);
            assert!(w < 1e-6, "{m} rows (accumulate {accumulate}): {w:e}");
        }
    }
}

#[test]
fn spaced_views_give_the_products_of_compact_copies() {
    // Blocks of wider matrices (rows or, transposed, columns spaced apart: q/k/v slices of
    // a fused projection) are converted run by run; the products must be those of the
    // same values stored compactly, to the bit, on whichever path this CPU takes.
    fetch_onednn();
    let (m, k, n, wide) = (37, 70, 45, 101);
    let a_wide = values(m * wide, 7);
    let b_wide = values(k * wide, 8);
    let a = View::block(&a_wide, m, k, wide);
    let b_t = View::block(&b_wide, n, k, wide).t(); // (k, n) with its columns spaced
    let compact_a: Vec<f32> = (0..m).flat_map(|r| a_wide[r * wide..r * wide + k].to_vec()).collect();
    let compact_bt: Vec<f32> = (0..n).flat_map(|r| b_wide[r * wide..r * wide + k].to_vec()).collect();
    let mut got = vec![0f32; m * n];
    bf16::gemm(ViewMut::rows(&mut got, m, n), a, b_t, false, 1.0);
    let mut want = vec![0f32; m * n];
    bf16::gemm(
        ViewMut::rows(&mut want, m, n),
        View::rows(&compact_a, m, k),
        View::rows(&compact_bt, n, k).t(),
        false,
        1.0,
    );
    assert_eq!(got, want, "{}", bf16::describe());
}

/// f32 products ([`bf16::gemm_f32`], what `Products::F32` and the f32 decode run) sum each
/// output in one order whatever shares the call: a row decoded alone or among a few
/// (weights transposed once into dense rows) gives the bits the training forward gives it
/// among many (reading the checkpoint's weight transposed), on one thread or two; so the
/// sampler's f32 logprobs are the trainer's. On oneDNN's f32 matmul where it is loaded,
/// on the `gemm` crate below its size threshold or without it; and they are the f32
/// product (against [`cpu::gemm`]).
#[test]
fn f32_products_are_the_same_bits_at_any_row_count_and_thread_count() {
    fetch_onednn();
    let described = bf16::describe();
    say(&format!("f32 products test: {described}"));
    if expected_path() != Path::F32 {
        // oneDNN is there (fetched above): f32 products must run on it.
        assert!(described.ends_with("f32 products: oneDNN"), "{described}");
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // SmolLM2's projections (576 wide, 192 for its key/value heads, 1536 for the MLP), an
    // odd width, and one below the oneDNN threshold (the gemm crate).
    for (k, n) in [(576, 1536), (1536, 576), (576, 192), (200, 333), (64, 96)] {
        let rows = 300;
        let x = values(rows * k, (k * n) as u64);
        let w = values(n * k, 7);
        // The weight as a checkpoint holds it, (n, k), read transposed by training, and
        // transposed once into (k, n) rows by decode.
        let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
        let (train, decode) = (View::rows(&w, n, k).t(), View::rows(&wt, k, n));
        let product = |b: View<'_>, from: usize, m: usize, acc: Option<&[f32]>, threads: usize| {
            let mut y = acc.map_or_else(|| vec![0f32; m * n], <[f32]>::to_vec);
            let run = || {
                let a = View::rows(&x[from * k..(from + m) * k], m, k);
                bf16::gemm_f32(ViewMut::rows(&mut y, m, n), a, b, acc.is_some(), 1.0, threads);
            };
            streamrl_kernels::cores::spread(threads, run);
            y
        };
        let all = product(train, 0, rows, None, 1);
        let mut want = vec![0f32; rows * n];
        cpu::gemm(
            ViewMut::rows(&mut want, rows, n),
            View::rows(&x, rows, k),
            train,
            false,
            1.0,
        );
        let err = worst(&all, &want, k);
        assert!(err < 1e-6, "({k}×{n}) against the gemm crate: {err:e}");
        assert_eq!(
            bits(&product(train, 0, rows, None, 2)),
            bits(&all),
            "({k}×{n}) on 2 threads"
        );
        for (from, m) in [(9, 1), (40, 2), (100, 7), (250, 33)] {
            let want = &all[from * n..(from + m) * n];
            for threads in [1, 2] {
                let got = product(decode, from, m, None, threads);
                assert_eq!(
                    bits(&got),
                    bits(want),
                    "{m} rows from {from} ({k}×{n}), {threads} threads"
                );
            }
            // Accumulating adds the same sums onto what is there.
            let base = values(m * n, 3);
            let mut full = vec![0f32; rows * n];
            full[from * n..(from + m) * n].copy_from_slice(&base);
            let summed = product(train, 0, rows, Some(&full), 1);
            assert_eq!(
                bits(&product(decode, from, m, Some(&base), 1)),
                bits(&summed[from * n..(from + m) * n]),
                "accumulating {m} rows from {from} ({k}×{n})"
            );
        }
    }
}

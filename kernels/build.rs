//! With the `cuda` feature: compiles `cuda/rl.cu` to PTX with nvcc (the CUDA toolkit, or
//! the `nvidia-cuda-nvcc` wheels, found through `CUDA_ROOT`, `CUDA_PATH`, `CUDA_HOME` or
//! `PATH`), and points the linker at the CUDA runtime library that candle's kernels link
//! (`libcudart`; the wheels ship it without the unversioned `libcudart.so` name, so a
//! link named that way is made in `OUT_DIR`). Without the feature it does nothing.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=cuda/rl.cu");
    for v in ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME", "CUDA_COMPUTE_CAP", "PATH"] {
        println!("cargo::rerun-if-env-changed={v}");
    }
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let roots: Vec<PathBuf> = ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"]
        .iter()
        .filter_map(|v| env::var_os(v).map(PathBuf::from))
        .chain([PathBuf::from("/usr/local/cuda")])
        .collect();
    let nvcc = roots
        .iter()
        .map(|r| r.join("bin/nvcc"))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    // PTX for compute capability 8.0 by default (A100 and newer JIT it at load);
    // CUDA_COMPUTE_CAP=90 targets Hopper (H100/H200) directly.
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let ptx = out.join("rl.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&ptx)
        .arg("cuda/rl.cu")
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("streamrl-kernels: `{} --ptx cuda/rl.cu` failed ({s})", nvcc.display()),
        Err(e) => panic!(
            "streamrl-kernels: the `cuda` feature needs nvcc, and `{}` could not run ({e}). Install the CUDA \
             toolkit, or `pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-crt nvidia-nvvm \
             nvidia-cuda-cccl` and set CUDA_ROOT to their `nvidia/cu13` directory (README, \"GPU\")",
            nvcc.display()
        ),
    }
    // The runtime library candle-kernels links with `-lcudart`.
    for r in &roots {
        for lib in ["lib64", "lib", "targets/x86_64-linux/lib"] {
            let dir = r.join(lib);
            if dir.join("libcudart.so").exists() {
                println!("cargo::rustc-link-search=native={}", dir.display());
                return;
            }
            if let Some(versioned) = versioned(&dir, "libcudart.so.") {
                let link_dir = out.join("cudart");
                std::fs::create_dir_all(&link_dir).expect("creating OUT_DIR/cudart");
                let link = link_dir.join("libcudart.so");
                let _ = std::fs::remove_file(&link);
                std::os::unix::fs::symlink(&versioned, &link).expect("linking libcudart.so");
                println!("cargo::rustc-link-search=native={}", link_dir.display());
                return;
            }
        }
    }
}

/// The first file in `dir` whose name starts with `prefix` followed by a version number.
fn versioned(dir: &Path, prefix: &str) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix(prefix))
                .is_some_and(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
        })
        .collect();
    found.sort();
    found.into_iter().next()
}

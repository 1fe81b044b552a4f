//! oneDNN for the tests of bf16 products: fetched where `streamrl_kernels::bf16` looks for
//! it (`scripts/onednn.sh`), so the products run on this CPU's matrix units where it has
//! them, not on the f32 fallback; the path taken is written past the test harness's
//! capture, for the CI log.

use std::io::Write as _;

/// Fetches oneDNN (once per test process) and says which path bf16 products take.
pub fn fetch() {
    static F: std::sync::Once = std::sync::Once::new();
    F.call_once(|| {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = std::process::Command::new("bash")
            .arg(root.join("scripts/onednn.sh"))
            .current_dir(&root)
            .output()
            .expect("running scripts/onednn.sh");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let _ = writeln!(std::io::stderr(), "{}", streamrl_kernels::bf16::describe());
    });
}

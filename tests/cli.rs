//! The `streamrl` command line: validate, graph, run, stage.

use std::process::Command;

fn streamrl(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run streamrl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `.yaml` files of a folder of the repository, as sorted paths relative to its root.
fn yaml_files(folder: &str) -> Vec<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(folder);
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| format!("{folder}/{}", p.file_name().unwrap().to_str().unwrap()))
        .collect();
    files.sort();
    files
}

/// Every topology under `tests/fixtures/topologies/`: `validate` reports exactly the
/// problems its header lists (`# expect: KEY.PATH: text the message contains`), in one
/// run, or accepts it when it lists none. A new case is a new file.
#[test]
fn validate_reports_exactly_what_each_fixture_expects() {
    let files = yaml_files("tests/fixtures/topologies");
    assert!(files.len() >= 2, "no fixtures in tests/fixtures/topologies");
    for rel in &files {
        let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap();
        let expected: Vec<(&str, &str)> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# expect: "))
            .map(|e| {
                let (path, what) = e.split_once(": ").expect("`# expect: KEY.PATH: text`");
                (path, what)
            })
            .collect();
        let (ok, out, err) = streamrl(&["validate", "--topology", rel]);
        if expected.is_empty() {
            assert!(ok, "{rel} lists no problems but validate failed:\n{err}");
            assert!(out.contains("is valid"), "{rel}: {out}");
            continue;
        }
        assert!(!ok, "{rel}: validate must exit non-zero");
        for (path, what) in &expected {
            assert!(
                err.lines()
                    .any(|l| l.trim().starts_with(&format!("{path}:")) && l.contains(what)),
                "{rel}: missing `{path}: {what}` in:\n{err}"
            );
        }
        assert!(
            err.contains(&format!("has {} problem(s)", expected.len())),
            "{rel}: expected exactly {} problems:\n{err}",
            expected.len()
        );
    }
}

/// Every topology shipped under `topologies/` validates (they are documented entry points).
#[test]
fn the_shipped_topologies_are_valid() {
    let files = yaml_files("topologies");
    assert!(!files.is_empty(), "no topologies in topologies/");
    for rel in &files {
        let (ok, out, err) = streamrl(&["validate", "--topology", rel]);
        assert!(ok && out.contains("is valid"), "{rel}:\n{out}{err}");
    }
}

#[test]
fn the_default_topology_is_valid_and_draws() {
    let (ok, out, err) = streamrl(&["validate"]);
    assert!(ok, "{err}");
    assert!(out.contains("10 topics, 7 stages"), "{out}");
    let (ok, out, _) = streamrl(&["graph"]);
    assert!(ok);
    assert!(out.starts_with("flowchart LR"));
    assert!(out.contains("s_sandbox -. feedback .-> t_continuations"), "{out}");
    assert!(out.contains("t_policy -. broadcast .-> s_rollout"), "{out}");
    assert!(out.contains("s_trainer --> t_trained"), "lineage topic: {out}");
    let (ok, out, _) = streamrl(&["graph", "--format", "dot"]);
    assert!(ok);
    assert!(out.contains("\"t:samples\" -> \"s:trainer\";"), "{out}");
    let (ok, _, err) = streamrl(&["graph", "--format", "svg"]);
    assert!(!ok && err.contains("unknown graph format `svg`"), "{err}");
}

#[test]
fn bad_urls_and_names_are_clear_errors() {
    let (ok, _, err) = streamrl(&["stage", "archive", "--bus", "redis://x"]);
    assert!(!ok && err.contains("unknown scheme `redis`"), "{err}");
    let (ok, _, err) = streamrl(&["stage", "nope", "--bus", "memory://"]);
    assert!(
        !ok && err.contains("no stage `nope`") && err.contains("archive"),
        "{err}"
    );
    let (ok, _, err) = streamrl(&["stage", "archive", "--replica", "3"]);
    assert!(!ok && err.contains("declares 1 replica"), "{err}");
    let (ok, _, err) = streamrl(&["query", "SELECT 1", "--run-dir", "/nonexistent/run"]);
    assert!(!ok && err.contains("no archive under"), "{err}");
}

#[test]
fn model_init_writes_a_loadable_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny");
    let (ok, stdout, err) = streamrl(&["model", "init", "--preset", "tiny", "--out", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(
        stdout.contains("406784 parameters") && stdout.contains("vocab 100"),
        "{stdout}"
    );
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let (ok, stdout, err) = streamrl(&["model", "info", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(
        stdout.contains("parameters: 406784") && stdout.contains("Qwen3"),
        "{stdout}"
    );
    let (ok, _, err) = streamrl(&["model", "init", "--preset", "huge", "--out", out.to_str().unwrap()]);
    assert!(!ok && err.contains("unknown preset `huge`"), "{err}");
}

/// A CUDA device asked for of a build without the `cuda` feature (or of a machine without
/// the driver) is one clear error, never a panic.
#[test]
fn cuda_without_a_gpu_is_one_clear_error() {
    let (ok, _, err) = streamrl(&["eval", "--device", "cuda", "--checkpoint", "."]);
    assert!(!ok);
    assert!(err.contains("device `cuda:0`: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    if cfg!(feature = "cuda") {
        assert!(err.contains("no NVIDIA driver") || err.contains("cuda:0"), "{err}");
    } else {
        assert!(
            err.contains("built without CUDA") && err.contains("--features cuda"),
            "{err}"
        );
    }
    let (ok, _, err) = streamrl(&["eval", "--device", "gpu", "--checkpoint", "."]);
    assert!(
        !ok && err.contains("device `gpu`: expected `cpu`, `cuda` or `cuda:N`"),
        "{err}"
    );
}

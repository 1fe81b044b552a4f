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

#[test]
fn validate_reports_all_five_mistakes_with_key_paths() {
    let (ok, _, err) = streamrl(&["validate", "--topology", "tests/fixtures/five_mistakes.yaml"]);
    assert!(!ok, "validate must exit non-zero");
    for (path, what) in [
        ("topics.rollouts.schema:", "unknown schema `rollout`"),
        ("stages.source.kind:", "unknown stage kind `sourse`"),
        ("stages.mask.outputs[1]:", "topic `sampels` is not declared"),
        (
            "stages.mask.replicas:",
            "3 replicas but input topic `scored` has only 2 partitions",
        ),
        ("stages.archive.config:", "unknown field `flush_every`"),
    ] {
        assert!(
            err.lines().any(|l| l.trim().starts_with(path) && l.contains(what)),
            "missing `{path} {what}` in:\n{err}"
        );
    }
    assert!(err.contains("5 problem(s)"), "{err}");
}

#[test]
fn validate_reports_env_and_sft_problems_with_the_rest() {
    let (ok, _, err) = streamrl(&["validate", "--topology", "tests/fixtures/every_section.yaml"]);
    assert!(!ok, "validate must exit non-zero");
    for (path, what) in [
        ("stages.source.config:", "group_size 0 must be at least 2"),
        ("stages.archive.config:", "unknown field `flush_every`"),
        ("envs.arithmetic.config:", "unknown environment `arithmetic`"),
        ("sft.steps:", "must be at least 1"),
        ("sft.preset:", "unknown preset `huge`"),
    ] {
        assert!(
            err.lines().any(|l| l.trim().starts_with(path) && l.contains(what)),
            "missing `{path} {what}` in:\n{err}"
        );
    }
    assert!(err.contains("5 problem(s)"), "{err}");
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

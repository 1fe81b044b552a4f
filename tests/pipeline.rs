//! `streamrl run` end to end on the embedded bus: SFT warm start, then asynchronous RL
//! through every stage, stopping at `max_steps`; the archive answers lineage queries.

mod common;

use std::path::Path;
use std::process::Command;

fn streamrl(dir: &Path, args: &[&str]) -> (bool, String, String) {
    streamrl_with(dir, args, &[])
}

fn streamrl_with(dir: &Path, args: &[&str], env: &[(&str, String)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(args)
        .current_dir(dir)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("run streamrl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const TOPOLOGY: &str = r#"
bus: memory://
run_id: e2e
run_dir: run
dead_letter: dead_letter
envs:
  arith: { weight: 1 }
sft: { out: run/sft, steps: 20, batch: 32 }
topics:
  prompts:       { schema: prompts,       partitions: 2, key: group_id }
  rollouts:      { schema: rollouts,      partitions: 2, key: group_id }
  continuations: { schema: continuations, partitions: 2, key: rollout_id, feedback: true }
  executed:      { schema: executed,      partitions: 2, key: group_id }
  scored:        { schema: scored,        partitions: 2, key: group_id }
  samples:       { schema: samples,       partitions: 2, key: group_id }
  policy:        { schema: policy,        partitions: 1 }
  trained:       { schema: trained,       partitions: 1 }
  metrics:       { schema: metrics,       partitions: 1 }
  dead_letter:   { schema: dead_letter,   partitions: 1 }
stages:
  source:
    kind: source
    inputs: [scored]
    broadcast: [policy]
    outputs: [prompts, metrics]
    config: { checkpoint: run/sft, group_size: 4, groups_per_step: 2, max_async_level: 1, max_steps: 3, max_tokens: 8, difficulty: { hard_fraction: 0.5 } }
  rollout:
    kind: rollout
    inputs: [prompts, continuations]
    broadcast: [policy]
    outputs: [rollouts, metrics]
    replicas: 2
    config: { checkpoint: run/sft, max_inflight_groups: 2 }
  sandbox: { kind: sandbox, inputs: [rollouts], outputs: [executed, continuations] }
  reward: { kind: reward, inputs: [executed], outputs: [scored], replicas: 2 }
  mask: { kind: mask, inputs: [scored], outputs: [samples, metrics], replicas: 2, config: { filter_zero_variance: false } }
  trainer:
    kind: trainer
    inputs: [samples]
    outputs: [policy, trained, metrics]
    # Versions travel over HTTP (the trainer serves its checkpoints; replicas download).
    config: { checkpoint: run/sft, groups_per_step: 2, max_steps: 3, keep_last: 2, eval_every: 1, eval_problems: 20, serve_checkpoints: "127.0.0.1:0" }
  archive: { kind: archive, inputs: all, config: { flush_rows: 100, flush_seconds: 1 } }
"#;

#[test]
fn run_warm_starts_then_trains_through_every_stage_and_archives_the_lineage() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("topology.yaml"), TOPOLOGY).unwrap();
    let (ok, out, err) = streamrl(dir.path(), &["run"]);
    assert!(ok, "run failed:\n{out}\n{err}");
    assert!(err.contains("sft: warm start into run/sft"), "{err}");
    assert!(err.contains("step    3/3"), "no progress line for step 3:\n{err}");
    assert!(err.contains("trainer reached max_steps 3"), "{err}");
    // Checkpoints: the newest two kept, each complete.
    let store = dir.path().join("run/checkpoints");
    let mut kept: Vec<String> = std::fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    kept.sort();
    assert_eq!(kept, ["step-000002", "step-000003"]);
    assert!(store.join("step-000003/trainer_state.json").exists());

    let q = |sql: &str| {
        let (ok, out, err) = streamrl(dir.path(), &["query", sql, "--format", "csv"]);
        assert!(ok, "{sql}: {err}");
        out.lines().skip(1).map(str::to_string).collect::<Vec<_>>()
    };
    // Every policy version 0..=3 was published, as the trainer's HTTP URL.
    assert_eq!(
        q("SELECT DISTINCT version FROM policy ORDER BY version"),
        ["0", "1", "2", "3"]
    );
    assert_eq!(
        q("SELECT count(*) FROM policy WHERE uri NOT SIMILAR TO 'http://127.0.0.1:[0-9]+/checkpoints/[0-3]'"),
        ["0"]
    );
    // Both rollout replicas downloaded new versions into their caches and swapped them
    // in; none failed to load.
    assert_eq!(
        q("SELECT count(*) > 0 FROM metrics WHERE name = 'policy_version' AND value >= 1"),
        ["true"]
    );
    assert_eq!(
        q("SELECT count(*) FROM metrics WHERE name = 'weight_load_failures'"),
        ["0"]
    );
    // Publication to serving, per replica and version loaded (each replica loads one at least).
    assert_eq!(
        q("SELECT count(*) >= 2, min(value) >= 0, max(value) < 60000 FROM metrics WHERE name = 'weight_sync_ms'"),
        ["true,true,true"]
    );
    for r in ["rollout-0", "rollout-1"] {
        let cached: Vec<String> = std::fs::read_dir(dir.path().join("run/weights").join(r))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            cached.iter().any(|n| n.starts_with('v')),
            "{r} fetched nothing: {cached:?}"
        );
    }
    // Rollouts carry per-token versions and logprobs; each sample went through every stage.
    let r = q(
        "SELECT count(*) FROM rollouts r JOIN scored s ON r.sample_id = s.sample_id \
               JOIN samples m ON m.sample_id = r.sample_id \
               WHERE cardinality(r.completion_versions) = cardinality(r.completion_logprobs)",
    );
    let joined: usize = r[0].parse().unwrap();
    assert!(
        joined >= 24,
        "3 steps × 2 groups × 4 samples should have gone all the way, got {joined}"
    );
    // Samples are unique by sample_id (the mask deduplicates, replicas split the work).
    assert_eq!(q("SELECT count(*) - count(DISTINCT sample_id) FROM samples"), ["0"]);
    // Version N was trained on exactly the groups admitted for step N − 1.
    assert_eq!(
        q("SELECT step, count(DISTINCT group_id) FROM samples WHERE step < 3 GROUP BY step ORDER BY step"),
        ["0,2", "1,2", "2,2"]
    );
    // Lineage: each version records exactly the samples it consumed (2 groups × 4),
    // each sample once, all of them archived on `samples`.
    assert_eq!(
        q("SELECT version, count(*), count(DISTINCT sample_id) FROM trained GROUP BY version ORDER BY version"),
        ["1,8,8", "2,8,8", "3,8,8"]
    );
    assert_eq!(
        q("SELECT count(*) FROM trained t LEFT JOIN samples s ON s.sample_id = t.sample_id WHERE s.sample_id IS NULL"),
        ["0"]
    );
    assert_eq!(
        q("SELECT count(*) FROM trained WHERE outcome NOT IN ('trained', 'filtered', 'stale')"),
        ["0"]
    );
    // The trainer recorded the version it published last; the run ended in-band.
    assert_eq!(std::fs::read_to_string(store.join("published")).unwrap(), "3");
    // Trainer metrics for every step.
    assert_eq!(
        q("SELECT DISTINCT step FROM metrics WHERE stage = 'trainer' AND name = 'loss' ORDER BY step"),
        ["1", "2", "3"]
    );
    // The source read the scored rows back (difficulty pools) and reported its pools.
    assert_eq!(
        q("SELECT count(*) > 0 FROM metrics WHERE stage = 'source' AND name = 'hard_pool_size'"),
        ["true"]
    );
    // Held-out accuracy was measured for versions 0..=3.
    assert_eq!(
        q("SELECT step FROM metrics WHERE name = 'heldout_accuracy' ORDER BY step"),
        ["0", "1", "2", "3"]
    );
    assert!(err.contains("step    0 held-out accuracy"), "{err}");
    // A version's eval runs after the version has gone out (the rollout stage loads it
    // meanwhile), in a metrics message of its own; the last version's comes with its step.
    assert_eq!(
        q("SELECT h.step, h.created_at > l.created_at FROM metrics h \
           JOIN metrics l ON l.step = h.step AND l.stage = 'trainer' AND l.name = 'loss' \
           WHERE h.name = 'heldout_accuracy' ORDER BY h.step"),
        ["1,true", "2,true", "3,false"]
    );
    assert!(err.contains("step    1 held-out accuracy"), "{err}");
    // The report: plots from the archive, an HTML page showing them.
    let (ok, out, err) = streamrl(dir.path(), &["report", "--run", "run"]);
    assert!(ok && out.contains("index.html"), "{out}{err}");
    let report = dir.path().join("run/report");
    let html = std::fs::read_to_string(report.join("index.html")).unwrap();
    for svg in [
        "heldout.svg",
        "reward.svg",
        "loss.svg",
        "masking.svg",
        "staleness.svg",
        "throughput.svg",
        "lag.svg",
    ] {
        assert!(html.contains(svg), "{svg} not on the page");
        let png = std::fs::read(report.join(svg.replace(".svg", ".png"))).unwrap();
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n") && &png[12..24] == b"IHDR\0\0\x02\xd0\0\0\x01\x68",
            "{svg}: no PNG beside it"
        );
        let text = std::fs::read_to_string(report.join(svg)).unwrap();
        assert!(text.starts_with("<svg") && text.ends_with("</svg>"), "{svg}");
        assert!(
            text.contains("<polyline") || text.contains("<rect x"),
            "{svg} plots nothing"
        );
    }
    // Nothing was dead-lettered (the archive writes a topic's directory with its first rows).
    assert!(
        !dir.path().join("run/archive/dead_letter").exists(),
        "dead letters were written"
    );
}

/// A mixture-of-experts policy (`tiny-moe`: 8 experts, 2 per token) through SFT and every
/// stage: the rollout records each completion token's experts and the trainer replays
/// them; the trainer publishes each MoE layer's load per expert, imbalance, router
/// entropy and z-loss per step, and the routing mismatch; the progress line shows the
/// worst load, and the report draws the load heat map.
#[test]
fn a_mixture_of_experts_policy_trains_through_every_stage_with_its_expert_load_published() {
    let dir = tempfile::tempdir().unwrap();
    let topology = TOPOLOGY
        .replace(
            "sft: { out: run/sft, steps: 20, batch: 32 }",
            "sft: { out: run/sft, steps: 20, batch: 32, preset: tiny-moe }",
        )
        .replace(
            "eval_problems: 20,",
            "eval_problems: 20, train: { balance_coef: 0.01, router_z_coef: 0.001 },",
        );
    std::fs::write(dir.path().join("topology.yaml"), topology).unwrap();
    let (ok, out, err) = streamrl(dir.path(), &["run"]);
    assert!(ok, "run failed:\n{out}\n{err}");
    assert!(err.contains("trainer reached max_steps 3"), "{err}");
    let step3 = err
        .lines()
        .find(|l| l.starts_with("step    3/3"))
        .unwrap_or_else(|| panic!("no step 3:\n{err}"));
    let moe: f64 = step3
        .split(" moe ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no moe figure on the progress line: {step3}"));
    assert!((1.0..=4.0).contains(&moe), "{step3}");
    let q = |sql: &str| {
        let (ok, out, err) = streamrl(dir.path(), &["query", sql, "--format", "csv"]);
        assert!(ok, "{sql}: {err}");
        out.lines().skip(1).map(str::to_string).collect::<Vec<_>>()
    };
    // The checkpoint is a MoE one.
    let config = std::fs::read_to_string(dir.path().join("run/checkpoints/step-000003/config.json")).unwrap();
    assert!(
        config.contains("\"num_experts\": 8") || config.contains("\"num_experts\":8"),
        "{config}"
    );
    // Per step and layer (2 layers): 8 load shares summing to 1, and the other figures.
    assert_eq!(
        q(
            "SELECT step, count(*), round(sum(value), 4) FROM metrics WHERE stage = 'trainer' AND name LIKE 'moe/%/load/%' \
           GROUP BY step ORDER BY step"
        ),
        ["1,16,2.0", "2,16,2.0", "3,16,2.0"]
    );
    for figure in ["imbalance", "router_entropy", "z_loss"] {
        assert_eq!(
            q(&format!(
                "SELECT count(*), min(value) >= 0 FROM metrics WHERE stage = 'trainer' AND name LIKE 'moe/%/{figure}'"
            )),
            ["6,true"],
            "{figure}"
        );
    }
    // The router's entropy is at most ln 8 and the worst load at least the mean.
    assert_eq!(
        q("SELECT max(value) <= ln(8.0) + 1e-4 FROM metrics WHERE name LIKE 'moe/%/router_entropy'"),
        ["true"]
    );
    assert_eq!(
        q("SELECT count(*), min(value) >= 1 FROM metrics WHERE stage = 'trainer' AND name = 'moe_max_load'"),
        ["3,true"]
    );
    // Samples went through every stage, carrying the experts the sampler routed each
    // completion token to (2 layers × top-2 per token) from the rollout to the trainer.
    let joined: usize = q(
        "SELECT count(*) FROM rollouts r JOIN scored s ON r.sample_id = s.sample_id \
                           JOIN samples m ON m.sample_id = r.sample_id \
         WHERE cardinality(r.completion_routes) = 4 * cardinality(r.completion_token_ids) \
           AND s.completion_routes = r.completion_routes AND m.completion_routes = r.completion_routes",
    )[0]
    .parse()
    .unwrap();
    assert!(joined >= 24, "{joined}");
    // Routing replay: the trainer replayed the recorded routes of every fed completion
    // token (none routed elsewhere) and published how many its own router would have
    // sent elsewhere (a fraction).
    assert_eq!(
        q("SELECT count(*), min(value) > 0 FROM metrics WHERE stage = 'trainer' AND name = 'moe_recorded_routes'"),
        ["3,true"]
    );
    assert_eq!(
        q("SELECT count(*), max(value) = 0 FROM metrics WHERE stage = 'trainer' AND name = 'moe_routing_mismatch'"),
        ["3,true"]
    );
    assert_eq!(
        q(
            "SELECT count(*), min(value) >= 0, max(value) <= 1 FROM metrics WHERE stage = 'trainer' AND name = 'moe_router_disagreement'"
        ),
        ["3,true,true"]
    );
    // The report draws the heat map.
    let (ok, out, err) = streamrl(dir.path(), &["report", "--run", "run"]);
    assert!(ok, "{out}{err}");
    let report = dir.path().join("run/report");
    assert!(
        std::fs::read_to_string(report.join("index.html"))
            .unwrap()
            .contains("moe-load.svg")
    );
    let svg = std::fs::read_to_string(report.join("moe-load.svg")).unwrap();
    assert!(svg.contains("layer 0") && svg.contains("layer 1"), "{svg}");
    assert!(
        std::fs::read(report.join("moe-load.png"))
            .unwrap()
            .starts_with(b"\x89PNG")
    );
}

/// Multi-turn tool use through the whole pipeline: a short SFT teaches the tiny model the
/// tool format; the rollout stage stops at `</python>`, the sandbox stage runs the call in a
/// real sandbox and sends its output back on `continuations`, the rollout stage generates
/// the answer turn, and the trainer trains on trajectories whose tool tokens are masked.
///
/// The run exports its telemetry over OTLP to a receiver in this test, which checks the
/// metrics against the archive and the trace of every step (see `check_telemetry`).
#[test]
fn run_trains_on_multi_turn_tool_trajectories_executed_in_sandboxes() {
    let (port, received) = common::otlp::receiver();
    let dir = tempfile::tempdir().unwrap();
    let topology = TOPOLOGY
        .replace("run_id: e2e", "run_id: tool")
        .replace(
            "  arith: { weight: 1 }\nsft: { out: run/sft, steps: 20, batch: 32 }",
            "  tool: { weight: 1, config: { digits: 2, max_turns: 3 } }\nsft: { out: run/sft, env: tool, steps: 60, batch: 16, lr: 0.003 }",
        )
        .replace("max_steps: 3, max_tokens: 8,", "max_steps: 2, max_tokens: 48, temperature: 0.7,")
        .replace("config: { checkpoint: run/sft, max_inflight_groups: 2 }", "config: { checkpoint: run/sft, max_inflight_groups: 2, turn_max_tokens: 32 }")
        .replace(
            // Versions as file:// paths here (the other test covers HTTP).
            r#"groups_per_step: 2, max_steps: 3, keep_last: 2, eval_every: 1, eval_problems: 20, serve_checkpoints: "127.0.0.1:0" }"#,
            "groups_per_step: 2, max_steps: 2, keep_last: 2, train: { temperature: 0.7 } }",
        );
    assert!(
        topology.contains("env: tool")
            && topology.contains("turn_max_tokens")
            && topology.contains("max_steps: 2, keep_last")
            && topology.contains("max_tokens: 48")
    );
    std::fs::write(dir.path().join("topology.yaml"), topology).unwrap();
    let (ok, out, err) = streamrl_with(
        dir.path(),
        &["run"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{port}")),
            ("OTEL_METRIC_EXPORT_INTERVAL", "1000".into()),
        ],
    );
    assert!(ok, "run failed:\n{out}\n{err}");
    assert!(err.contains("trainer reached max_steps 2"), "{err}");
    let q = |sql: &str| {
        let (ok, out, err) = streamrl(dir.path(), &["query", sql, "--format", "csv"]);
        assert!(ok, "{sql}: {err}");
        out.lines().skip(1).map(str::to_string).collect::<Vec<_>>()
    };
    let n = |sql: &str| -> usize { q(sql)[0].parse().unwrap() };
    // Most first turns end in a tool call, and each of those got a second turn.
    let calls = n("SELECT count(*) FROM rollouts WHERE turn = 0 AND finish_reason = 'tool_call'");
    assert!(calls >= 8, "only {calls} of 16 first turns called the tool");
    assert_eq!(
        n(
            "SELECT count(*) FROM rollouts a JOIN rollouts b ON a.rollout_id = b.rollout_id \
           WHERE a.turn = 0 AND a.finish_reason = 'tool_call' AND b.turn = 1"
        ),
        calls
    );
    // The sandbox ran every call.
    assert_eq!(
        n("SELECT count(*) FROM continuations WHERE tool_outputs[1]['status'] = 'ok'"),
        calls
    );
    // One scored row per trajectory (its last turn), and trained samples mask tool tokens.
    assert_eq!(q("SELECT count(DISTINCT rollout_id), count(*) FROM scored"), ["16,16"]);
    assert_eq!(
        n("SELECT count(*) FROM samples WHERE array_has(loss_mask, false)"),
        calls
    );
    assert!(
        !dir.path().join("run/archive/dead_letter").exists(),
        "dead letters were written"
    );
    check_telemetry(&received.lock().unwrap(), calls, &q);
}

/// What the tool run exported over OTLP (the exporters flush at exit):
/// * metrics: every stage counted its inputs and timed them; the trainer's sample
///   outcomes and staleness histogram agree with the lineage in the archive; the sandbox
///   counted one `ok` execution per tool call; the rollout counted generated tokens; the
///   metric rows arrived as `streamrl.stage.value` gauges;
/// * traces: each `train-step` span is a root linked to the traces of the groups it
///   trained, and each of those traces starts with the group's `admit` span (a root) and
///   holds its `generate` and `mask` spans.
fn check_telemetry(r: &common::otlp::Received, calls: usize, q: &dyn Fn(&str) -> Vec<String>) {
    let total =
        |metric: &str, filter: &[(&str, &str)]| -> f64 { r.latest(metric, filter).iter().map(|p| p.value).sum() };
    for stage in ["source", "rollout", "sandbox", "reward", "mask", "trainer", "archive"] {
        assert!(
            total("streamrl.stage.messages", &[("stage", stage), ("direction", "in")]) > 0.0,
            "no streamrl.stage.messages from {stage}; got {:?}",
            r.latest("streamrl.stage.messages", &[])
        );
        assert!(
            total("streamrl.stage.duration", &[("stage", stage)]) > 0.0,
            "no streamrl.stage.duration from {stage}"
        );
    }
    let lineage = |outcomes: &str| -> f64 {
        q(&format!("SELECT count(*) FROM trained WHERE outcome IN ({outcomes})"))[0]
            .parse()
            .unwrap()
    };
    let trained = lineage("'trained'");
    assert!(trained > 0.0);
    assert_eq!(total("streamrl.train.samples", &[("outcome", "trained")]), trained);
    assert_eq!(
        total("streamrl.train.staleness", &[]),
        lineage("'trained', 'filtered', 'stale'"),
        "one staleness observation per sample a step consumed"
    );
    let staleness = r.latest("streamrl.train.staleness", &[]);
    assert!(
        staleness.iter().all(|p| p.unit == "{version}" && p.sum.is_some()),
        "{staleness:?}"
    );
    assert_eq!(
        total("streamrl.sandbox.executions", &[("stage", "sandbox"), ("status", "ok")]),
        calls as f64
    );
    assert!(total("streamrl.rollout.tokens", &[]) >= 16.0);
    assert!(total("streamrl.train.tokens", &[]) > 0.0);
    assert!(
        !r.latest("streamrl.stage.value", &[("stage", "trainer"), ("name", "loss")])
            .is_empty(),
        "the trainer's loss row never reached the gauge"
    );
    assert!(
        !r.latest("streamrl.stage.lag", &[]).is_empty(),
        "no input lag was sampled"
    );

    let steps: Vec<_> = r.spans.iter().filter(|s| s.name == "train-step").collect();
    assert_eq!(steps.len(), 2, "one train-step span per version");
    for step in steps {
        assert!(step.parent_span_id.is_empty(), "a step is a root: {step:?}");
        assert!(
            !step.links.is_empty(),
            "a step links to the groups it trained: {step:?}"
        );
        for trace in &step.links {
            let names: Vec<&str> = r
                .spans
                .iter()
                .filter(|s| &s.trace_id == trace)
                .map(|s| s.name.as_str())
                .collect();
            for want in ["admit", "generate", "mask"] {
                assert!(names.contains(&want), "trace {trace} lacks `{want}`: {names:?}");
            }
            let admit = r
                .spans
                .iter()
                .find(|s| &s.trace_id == trace && s.name == "admit" && s.parent_span_id.is_empty())
                .unwrap_or_else(|| panic!("trace {trace} has no root admit span"));
            assert!(admit.group_id.is_some());
        }
    }
}

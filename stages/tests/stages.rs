//! Each stage driven directly (process / tick / start), outputs inspected.

use std::path::{Path, PathBuf};

use candle_core::Device;
use streamrl_model::{Tokenizer, checkpoint, config};
use streamrl_runtime::build::{BuildContext, BuildStage};
use streamrl_runtime::{Emitter, Input, Stage};
use streamrl_schemas::{PolicyRow, PromptRow, RolloutRow, SampleRow, SchemaId, ScoredRow, TopicRow, Validate};
use streamrl_stages::build_envs;
use streamrl_stages::mask::MaskStage;
use streamrl_stages::reward::RewardStage;
use streamrl_stages::rollout::{RolloutConfig, RolloutStage};
use streamrl_stages::sandbox::pass_through;
use streamrl_stages::source::{SourceConfig, SourceStage};
use streamrl_stages::trainer::{TrainerConfig, TrainerStage};

fn tiny(dir: &Path, seed: u64) -> String {
    let tok = Tokenizer::char_level();
    let hf = config::preset("tiny", tok.vocab_size()).unwrap();
    let l = checkpoint::init_seeded(&hf, &Device::Cpu, Some(seed)).unwrap();
    checkpoint::save(dir, &hf, &l.vars, Some(&tok), None).unwrap()
}

/// A temporary run directory holding a tiny checkpoint (seed 0) at `ckpt`.
fn tiny_in_tempdir() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    tiny(&ckpt, 0);
    (dir, ckpt)
}

mod common;
use common::rollout_row;

fn ctx(stage: &str, run_dir: &Path, outputs: &[(&str, SchemaId)]) -> BuildContext {
    common::ctx("test", stage, run_dir, outputs, "arith: {weight: 1}")
}

fn batches<T: TopicRow>(out: &mut Emitter, topic: &str) -> Vec<T> {
    rows_in(&out.drain(), topic)
}

/// The rows of `topic` among drained outputs.
fn rows_in<T: TopicRow>(out: &[(String, arrow::record_batch::RecordBatch)], topic: &str) -> Vec<T> {
    out.iter()
        .filter(|(t, _)| t == topic)
        .flat_map(|(_, b)| T::from_batch(b).unwrap())
        .collect()
}

fn input<T: TopicRow>(topic: &str, rows: &[T]) -> Input {
    Input::new(topic, T::SCHEMA, T::to_batch(rows).unwrap())
}

fn scored(group: &str, i: u32, size: u32, reward: f32) -> ScoredRow {
    let e = pass_through(rollout_row(group, i, size));
    let envs = build_envs(&serde_yaml::from_str("arith: {}").unwrap())
        .unwrap()
        .unwrap();
    let mut s = streamrl_stages::reward::score(&envs, e).unwrap();
    s.reward = reward;
    s
}

#[tokio::test]
async fn reward_scores_with_the_environment_rubric_and_refuses_unknown_environments() {
    let (_dir, mut stage) = common::default_stage::<RewardStage>("test", "reward", &[("scored", SchemaId::Scored)]);
    let good = pass_through(rollout_row("g", 0, 2));
    let mut wrong = good.clone();
    wrong.completion = "3\n".into();
    wrong.sample_id = "other".into();
    let mut out = Emitter::default();
    stage
        .process(input("executed", &[good, wrong.clone()]), &mut out)
        .await
        .unwrap();
    let rows: Vec<ScoredRow> = batches(&mut out, "scored");
    assert_eq!(rows.iter().map(|r| r.reward).collect::<Vec<_>>(), vec![1.0, 0.0]);
    assert_eq!(rows[1].reward_components[0].name, "exact_match");
    assert_eq!(rows[1].reward_components[0].reason, "3 != 2");
    let mut unknown = wrong;
    unknown.env = "chess".into();
    let err = stage
        .process(input("executed", &[unknown]), &mut out)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("`chess`"), "{err}");
}

#[tokio::test]
async fn mask_waits_for_the_whole_group_dedups_and_filters_groups_without_signal() {
    let (_dir, mut stage) = common::default_stage::<MaskStage>("test", "mask", &[("samples", SchemaId::Samples)]);
    let mut out = Emitter::default();
    for (i, r) in [1.0, 0.0, 0.0].into_iter().enumerate() {
        stage
            .process(input("scored", &[scored("g1", i as u32, 4, r)]), &mut out)
            .await
            .unwrap();
        assert_eq!(out.holding(), Some(Some("g1")));
        assert!(out.drain().is_empty(), "group emitted before it was whole");
    }
    // A redelivered sample is not a new one.
    stage
        .process(input("scored", &[scored("g1", 2, 4, 0.0)]), &mut out)
        .await
        .unwrap();
    assert!(out.drain().is_empty());
    let mut out = Emitter::default();
    stage
        .process(input("scored", &[scored("g1", 3, 4, 1.0)]), &mut out)
        .await
        .unwrap();
    assert_eq!(out.released(), ["g1".to_string()]);
    let s: Vec<SampleRow> = batches(&mut out, "samples");
    assert_eq!(s.len(), 4);
    assert_eq!(
        s.iter().map(|r| r.advantage).collect::<Vec<_>>(),
        vec![0.5, -0.5, -0.5, 0.5]
    );
    assert!(s.iter().all(|r| r.loss_mask == vec![true; 3]));
    assert_eq!(stage.counts().duplicates, 1);

    // All rewards equal: the group goes on untrainable, counted.
    let mut out = Emitter::default();
    for i in 0..2 {
        stage
            .process(input("scored", &[scored("g2", i, 2, 1.0)]), &mut out)
            .await
            .unwrap();
    }
    let s: Vec<SampleRow> = batches(&mut out, "samples");
    assert_eq!(s.len(), 2);
    assert!(s.iter().all(|r| r.advantage == 0.0 && r.loss_mask.iter().all(|m| !m)));
    assert_eq!(stage.counts().groups_filtered, 1);

    // A sample of a group already emitted is a duplicate, acknowledged without output.
    let mut out = Emitter::default();
    stage
        .process(input("scored", &[scored("g1", 0, 4, 1.0)]), &mut out)
        .await
        .unwrap();
    assert_eq!(out.holding(), None);
    assert!(out.drain().is_empty());
}

#[tokio::test]
async fn source_admits_groups_only_within_the_async_level_and_resumes_its_position() {
    let (dir, ckpt) = tiny_in_tempdir();
    let cfg = SourceConfig {
        max_steps: Some(4),
        ..source_config(&ckpt, 4, 3, 1)
    };
    let c = ctx("source", dir.path(), &[("prompts", SchemaId::Prompts)]);
    let mut stage = SourceStage::build(cfg.clone(), &c).unwrap();
    let mut out = Emitter::default();
    stage.start(&mut out).await.unwrap();
    stage.tick(&mut out).await.unwrap();
    assert!(
        out.drain().is_empty(),
        "admitted before the trainer's version was known"
    );
    let first = admit(&mut stage, 0, &mut out).await;
    // Version 0 and async level 1: steps 0 and 1, three groups each.
    assert_eq!(first.iter().map(|p| p.step).collect::<Vec<_>>(), vec![0, 0, 0, 1, 1, 1]);
    assert!(
        first
            .iter()
            .all(|p| p.group_size == 4 && !p.prompt_token_ids.is_empty())
    );
    stage.tick(&mut out).await.unwrap();
    assert!(out.drain().is_empty(), "admitted past the async level");
    let second = admit(&mut stage, 1, &mut out).await;
    assert_eq!(second.iter().map(|p| p.step).collect::<Vec<_>>(), vec![2, 2, 2]);
    // A restarted source continues where the snapshot says...
    let snap = stage.snapshot().unwrap();
    let mut again = SourceStage::build(cfg.clone(), &c).unwrap();
    again.restore(&snap).unwrap();
    let third = admit(&mut again, 5, &mut out).await;
    assert_eq!(
        third.iter().map(|p| p.step).collect::<Vec<_>>(),
        vec![3, 3, 3],
        "max_steps 4 stops at step 3"
    );
    let ids: std::collections::HashSet<_> = first
        .iter()
        .chain(&second)
        .chain(&third)
        .map(|p| p.group_id.clone())
        .collect();
    assert_eq!(ids.len(), 12);
    // ...but admits again, under the same ids, the groups of steps the trainer has not
    // trained (lost with an in-process bus).
    let mut behind = SourceStage::build(cfg, &c).unwrap();
    behind.restore(&snap).unwrap();
    let again_rows = admit(&mut behind, 1, &mut out).await;
    assert_eq!(
        again_rows.iter().map(|p| p.step).collect::<Vec<_>>(),
        vec![1, 1, 1, 2, 2, 2]
    );
    assert_eq!(
        again_rows.iter().map(|p| p.group_id.clone()).collect::<Vec<_>>(),
        first[3..]
            .iter()
            .chain(&second)
            .map(|p| p.group_id.clone())
            .collect::<Vec<_>>()
    );
}

fn policy_row(v: u32) -> PolicyRow {
    PolicyRow {
        run_id: "test".into(),
        version: v,
        step: v as u64,
        uri: String::new(),
        sha256: String::new(),
        created_at: 0,
    }
}

/// A source reading `checkpoint`'s tokenizer: groups of `group_size`, `groups_per_step` a
/// step, at most `max_async_level` steps ahead of the trainer.
fn source_config(checkpoint: &Path, group_size: u32, groups_per_step: u32, max_async_level: u64) -> SourceConfig {
    SourceConfig {
        checkpoint: checkpoint.to_path_buf(),
        group_size,
        groups_per_step,
        max_async_level,
        ..Default::default()
    }
}

/// Announces policy version `v` to a source and returns the prompts it admits.
async fn admit(source: &mut SourceStage, v: u32, out: &mut Emitter) -> Vec<PromptRow> {
    source.process(input("policy", &[policy_row(v)]), out).await.unwrap();
    batches(out, "prompts")
}

fn scored_row(p: &PromptRow, i: u32, reward: f32) -> ScoredRow {
    let mut s = scored(&p.group_id, i, p.group_size, reward);
    s.problem_id = p.problem_id.clone();
    s.step = p.step;
    s
}

fn metric_values(out: &[(String, arrow::record_batch::RecordBatch)], name: &str) -> Vec<f64> {
    rows_in::<streamrl_schemas::MetricRow>(out, "metrics")
        .into_iter()
        .filter(|m| m.name == name)
        .map(|m| m.value)
        .collect()
}

#[tokio::test]
async fn source_files_problems_into_difficulty_pools_by_group_reward_and_draws_from_them() {
    use streamrl_stages::source::DifficultyConfig;
    let (dir, ckpt) = tiny_in_tempdir();
    let cfg = SourceConfig {
        difficulty: Some(DifficultyConfig {
            easy_fraction: 1.0,
            capacity: 4,
            ..Default::default()
        }),
        ..source_config(&ckpt, 2, 4, 0)
    };
    let outputs = [("prompts", SchemaId::Prompts), ("metrics", SchemaId::Metrics)];
    // Pools without feedback are refused, naming what is missing.
    let err = SourceStage::build(cfg.clone(), &ctx("source", dir.path(), &outputs)).unwrap_err();
    assert!(err.to_string().contains("`scored`"), "{err:?}");
    let bad = SourceConfig {
        difficulty: Some(DifficultyConfig {
            easy_fraction: 0.8,
            hard_fraction: 0.5,
            hard_threshold: 1.0,
            ..Default::default()
        }),
        ..cfg.clone()
    };
    let problems = bad.problems();
    assert!(
        problems
            .iter()
            .any(|p| p.to_string() == "difficulty.hard_threshold: 1 must be below easy_threshold 1")
    );
    assert!(problems.iter().any(|p| p.message.contains("exceeds 1")), "{problems:?}");

    let c = BuildContext {
        inputs: vec![("scored".into(), SchemaId::Scored)],
        ..ctx("source", dir.path(), &outputs)
    };
    let mut stage = SourceStage::build(cfg.clone(), &c).unwrap();
    let mut out = Emitter::default();
    let step0 = admit(&mut stage, 0, &mut out).await;
    assert_eq!(step0.len(), 4);
    // Group 0 is solved by every sample (easy), group 1 by none (hard), group 2 by one
    // of two (stays in rotation), group 3 is still missing a sample.
    let feedback = [
        scored_row(&step0[0], 0, 1.0),
        scored_row(&step0[0], 1, 1.0),
        scored_row(&step0[1], 0, 0.0),
        scored_row(&step0[1], 1, 0.0),
        scored_row(&step0[2], 0, 1.0),
        scored_row(&step0[2], 1, 0.0),
        scored_row(&step0[3], 0, 1.0),
        // A duplicate delivery of a sample does not complete a group.
        scored_row(&step0[3], 0, 1.0),
    ];
    stage.process(input("scored", &feedback), &mut out).await.unwrap();
    stage
        .process(input("policy", &[policy_row(1)]), &mut out)
        .await
        .unwrap();
    let emitted = out.drain();
    assert_eq!(metric_values(&emitted, "groups_from_easy_pool"), vec![1.0]);
    assert_eq!(
        metric_values(&emitted, "easy_pool_size"),
        vec![0.0],
        "drawn out of the pool"
    );
    assert_eq!(metric_values(&emitted, "hard_pool_size"), vec![1.0]);
    let step1: Vec<PromptRow> = rows_in(&emitted, "prompts");
    assert_eq!(step1.len(), 4);
    let from_easy: Vec<_> = step1.iter().filter(|p| p.problem_id == step0[0].problem_id).collect();
    assert_eq!(from_easy.len(), 1, "the easy problem is asked again exactly once");
    assert_eq!(from_easy[0].prompt, step0[0].prompt);
    assert!(
        step1.iter().all(|p| p.problem_id != step0[1].problem_id),
        "hard_fraction 0: never again"
    );

    // The pools survive a restart: the re-asked easy problem is solved again, filed again,
    // and drawn by the restored stage.
    let again = step1.iter().find(|p| p.problem_id == step0[0].problem_id).unwrap();
    stage
        .process(
            input("scored", &[scored_row(again, 0, 1.0), scored_row(again, 1, 1.0)]),
            &mut out,
        )
        .await
        .unwrap();
    let snap = stage.snapshot().unwrap();
    let mut restored = SourceStage::build(cfg, &c).unwrap();
    restored.restore(&snap).unwrap();
    let readmitted = admit(&mut restored, 1, &mut out).await;
    assert_eq!(
        readmitted
            .iter()
            .map(|p| (&p.group_id, &p.problem_id))
            .collect::<Vec<_>>(),
        step1.iter().map(|p| (&p.group_id, &p.problem_id)).collect::<Vec<_>>(),
        "a re-admitted group asks the problem it asked before"
    );
    let step2 = admit(&mut restored, 2, &mut out).await;
    assert_eq!(step2.iter().filter(|p| p.problem_id == step0[0].problem_id).count(), 1);
}

#[tokio::test]
async fn source_reads_a_dataset_in_shuffled_epochs_and_stops_after_the_last() {
    let (dir, ckpt) = tiny_in_tempdir();
    let cfg = SourceConfig {
        epochs: Some(1),
        ..source_config(&ckpt, 2, 3, 100)
    };
    // The math fixture: 10 problems, every 5th held out, so 8 to train on.
    let c = ctx_with_envs("source", dir.path(), &[("prompts", SchemaId::Prompts)], "math: {}");
    let mut stage = SourceStage::build(cfg.clone(), &c).unwrap();
    let mut out = Emitter::default();
    let rows = admit(&mut stage, 0, &mut out).await;
    // The epoch ends with the 8th group (step 2); its step is completed, then nothing.
    assert_eq!(rows.len(), 9, "{:?}", rows.iter().map(|p| p.step).collect::<Vec<_>>());
    let first_epoch: std::collections::HashSet<_> = rows[..8].iter().map(|p| p.problem_id.clone()).collect();
    assert_eq!(first_epoch.len(), 8, "every train problem once per epoch");
    assert!(admit(&mut stage, 50, &mut out).await.is_empty());
    // Shuffled per epoch, but not in file order, and the same for the same seed.
    let unshuffled = SourceConfig {
        shuffle: false,
        ..cfg.clone()
    };
    let mut plain = SourceStage::build(unshuffled, &c).unwrap();
    let plain_rows = admit(&mut plain, 0, &mut out).await;
    let ids = |r: &[PromptRow]| r.iter().map(|p| p.problem_id.clone()).collect::<Vec<_>>();
    assert_ne!(ids(&plain_rows[..8]), ids(&rows[..8]));
    let mut same = SourceStage::build(cfg, &c).unwrap();
    assert_eq!(ids(&admit(&mut same, 0, &mut out).await), ids(&rows));
}

fn prompt(group: &str, size: u32) -> PromptRow {
    let tok = Tokenizer::char_level();
    PromptRow {
        run_id: "test".into(),
        problem_id: "p".into(),
        group_id: group.into(),
        env: "arith".into(),
        step: 0,
        group_size: size,
        prompt: "12+30=".into(),
        prompt_token_ids: tok.encode("12+30=").unwrap(),
        answer: Some("42".into()),
        info: None,
        temperature: 1.0,
        max_tokens: 6,
        created_at: 0,
    }
}

#[tokio::test]
async fn rollout_generates_whole_groups_and_swaps_policies_that_load() {
    let dir = tempfile::tempdir().unwrap();
    let v0 = dir.path().join("v0");
    let v1 = dir.path().join("v1");
    tiny(&v0, 0);
    let sha1 = tiny(&v1, 1);
    let cfg = RolloutConfig {
        checkpoint: v0,
        max_inflight_groups: 1,
        ..Default::default()
    };
    let mut stage = RolloutStage::build(cfg, &ctx("rollout", dir.path(), &[("rollouts", SchemaId::Rollouts)])).unwrap();
    let mut out = Emitter::default();
    // One group in flight at most: once it is in, the stage takes no more prompts, and
    // its ticks generate the group.
    assert!(stage.ready());
    stage
        .process(input("prompts", &[prompt("g1", 4)]), &mut out)
        .await
        .unwrap();
    assert_eq!(out.holding(), Some(Some("g1")));
    assert!(!stage.ready());
    tick_until_released(&mut stage, &mut out).await;
    assert!(stage.ready());
    assert_eq!(out.released(), ["g1".to_string()]);
    let rows: Vec<RolloutRow> = batches(&mut out, "rollouts");
    assert_eq!(rows.len(), 4);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r.rollout_id, format!("g1-{}", r.sample_index), "row {i}");
        assert_eq!(r.completion_token_ids.len(), r.completion_logprobs.len());
        assert_eq!(r.completion_versions, vec![0; r.completion_token_ids.len()]);
        assert!(r.completion_logprobs.iter().all(|l| *l <= 0.0));
        assert!(r.finish_reason == "stop" || r.finish_reason == "length");
    }
    // A policy whose checksum does not match is refused; the old weights keep serving.
    let bad = PolicyRow {
        run_id: "test".into(),
        version: 1,
        step: 1,
        uri: format!("file://{}", v1.display()),
        sha256: "0".repeat(64),
        created_at: 0,
    };
    let mut out = Emitter::default();
    stage
        .process(input("policy", std::slice::from_ref(&bad)), &mut out)
        .await
        .unwrap();
    stage.settle_policy(&mut out).await;
    assert_eq!(stage.version(), 0);
    let good = PolicyRow { sha256: sha1, ..bad };
    stage.process(input("policy", &[good]), &mut out).await.unwrap();
    stage.settle_policy(&mut out).await;
    assert_eq!(stage.version(), 1);
    let mut out = Emitter::default();
    stage
        .process(input("prompts", &[prompt("g2", 2)]), &mut out)
        .await
        .unwrap();
    tick_until_released(&mut stage, &mut out).await;
    let rows: Vec<RolloutRow> = batches(&mut out, "rollouts");
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r.completion_versions.iter().all(|v| *v == 1)));
}

/// Ticks `stage` (a rollout stage) until it releases a held input.
async fn tick_until_released(stage: &mut RolloutStage, out: &mut Emitter) {
    for _ in 0..10_000 {
        if !out.released().is_empty() {
            return;
        }
        stage.tick(out).await.unwrap();
    }
    panic!("no group finished after 10000 ticks");
}

/// With every slot full, a new policy still lands between two decode steps of the
/// group in flight (the runner keeps delivering broadcasts to a stage that is not
/// `ready`): the group's completions switch from version 0 to 1 part-way.
/// Completion length of a group that one 1 ms slice cannot finish (that would take a
/// decode step every 5 µs), whatever the machine's speed.
const LONG: usize = 200;

/// A rollout stage serving version 0 of the tiny model (`slots` groups in flight at
/// most, 1 ms slices, no EOS) with one group of 2 `LONG` completions in flight, and the
/// policy row of version 1.
async fn long_group_on_v0(
    dir: &Path,
    slots: usize,
    outputs: &[(&str, SchemaId)],
    out: &mut Emitter,
) -> (RolloutStage, PolicyRow) {
    let (v0, v1) = (dir.join("v0"), dir.join("v1"));
    tiny(&v0, 0);
    let sha256 = tiny(&v1, 1);
    let cfg = RolloutConfig {
        checkpoint: v0,
        max_inflight_groups: slots,
        slice_ms: 1,
        ignore_eos: true,
        ..Default::default()
    };
    let mut stage = RolloutStage::build(cfg, &ctx("rollout", dir, outputs)).unwrap();
    let long = PromptRow {
        max_tokens: LONG as u32,
        ..prompt("g1", 2)
    };
    stage.process(input("prompts", &[long]), out).await.unwrap();
    let policy = PolicyRow {
        run_id: "test".into(),
        version: 1,
        step: 1,
        uri: format!("file://{}", v1.display()),
        sha256,
        created_at: 0,
    };
    (stage, policy)
}

#[tokio::test]
async fn rollout_swaps_weights_mid_group_with_every_slot_full() {
    const LEN: usize = LONG;
    let dir = tempfile::tempdir().unwrap();
    let mut out = Emitter::default();
    let (mut stage, policy) = long_group_on_v0(dir.path(), 1, &[("rollouts", SchemaId::Rollouts)], &mut out).await;
    assert!(!stage.ready());
    // Decode steps on version 0 for one slice.
    stage.tick(&mut out).await.unwrap();
    assert!(out.released().is_empty(), "{LEN} tokens take more than one 1 ms slice");
    stage.process(input("policy", &[policy]), &mut out).await.unwrap();
    stage.settle_policy(&mut out).await;
    assert_eq!(stage.version(), 1);
    tick_until_released(&mut stage, &mut out).await;
    let rows: Vec<RolloutRow> = batches(&mut out, "rollouts");
    assert_eq!(rows.len(), 2);
    for r in &rows {
        let v = &r.completion_versions;
        assert_eq!(v.len(), LEN);
        assert_eq!(v[0], 0, "{v:?}");
        assert_eq!(v[LEN - 1], 1, "{v:?}");
        assert!(v.windows(2).all(|w| w[0] <= w[1]), "{v:?}");
    }
}

/// A new version is read, checked and laid out on another thread: the policy message
/// returns at once with the old version still serving, the group in flight keeps its
/// place, a group that arrives meanwhile waits for the new version and is generated on it
/// alone, and the swap itself (the decode pause) is reported apart from the whole load.
#[tokio::test]
async fn rollout_prepares_a_new_version_beside_decoding() {
    const LEN: usize = LONG;
    let dir = tempfile::tempdir().unwrap();
    let mut out = Emitter::default();
    let outputs = [("rollouts", SchemaId::Rollouts), ("metrics", SchemaId::Metrics)];
    let (mut stage, policy) = long_group_on_v0(dir.path(), 2, &outputs, &mut out).await;
    stage.tick(&mut out).await.unwrap();
    stage.process(input("policy", &[policy]), &mut out).await.unwrap();
    assert_eq!((stage.version(), stage.preparing()), (0, Some(1)));
    stage
        .process(input("prompts", &[prompt("g2", 2)]), &mut out)
        .await
        .unwrap();
    // Whether or not the new version is ready by then, g2 starts on it.
    stage.tick(&mut out).await.unwrap();
    stage.settle_policy(&mut out).await;
    assert_eq!((stage.version(), stage.preparing()), (1, None));
    for _ in 0..10_000 {
        if out.released().len() == 2 {
            break;
        }
        stage.tick(&mut out).await.unwrap();
    }
    let mut released = out.released().to_vec();
    released.sort();
    assert_eq!(released, ["g1", "g2"]);
    let emitted = out.drain();
    let rows = rows_in::<RolloutRow>(&emitted, "rollouts");
    assert_eq!(rows.len(), 4);
    for r in &rows {
        let v = &r.completion_versions;
        if r.group_id == "g2" {
            assert!(v.iter().all(|v| *v == 1), "g2 began before the new version: {v:?}");
        } else {
            assert_eq!((v[0], v[LEN - 1]), (0, 1), "{v:?}");
        }
    }
    let (load, swap) = (
        metric_values(&emitted, "weight_load_ms"),
        metric_values(&emitted, "weight_swap_ms"),
    );
    assert_eq!((load.len(), swap.len()), (1, 1), "{load:?} {swap:?}");
    assert!(
        swap[0] <= load[0],
        "the swap ({swap:?} ms) is part of the load ({load:?} ms)"
    );
}

/// The two samples of group `group` from policy `version`: rewards 0 and 1, advantages
/// −0.5 and 0.5.
fn pair(group: &str, version: u32) -> Vec<SampleRow> {
    (0..2)
        .map(|i| sample(group, i, i as f32, i as f32 - 0.5, version))
        .collect()
}

/// `rows` admitted for `step`.
fn at_step(rows: Vec<SampleRow>, step: u64) -> Vec<SampleRow> {
    rows.into_iter().map(|r| SampleRow { step, ..r }).collect()
}

fn sample(group: &str, i: u32, reward: f32, adv: f32, version: u32) -> SampleRow {
    SampleRow {
        run_id: "test".into(),
        problem_id: "p".into(),
        group_id: group.into(),
        rollout_id: format!("{group}-{i}"),
        sample_id: format!("{group}-{i}-t0"),
        env: "arith".into(),
        step: 0,
        turn: 0,
        prompt_token_ids: vec![21, 15, 21, 33],
        completion_token_ids: vec![22, 4, 2],
        completion_logprobs: vec![-3.0, -4.0, -4.5],
        completion_versions: vec![version; 3],
        completion_routes: vec![],
        loss_mask: vec![true; 3],
        finish_reason: "stop".into(),
        reward,
        advantage: adv,
        created_at: 0,
    }
}

fn trainer(run_dir: &Path, ckpt: PathBuf) -> TrainerStage {
    let cfg = TrainerConfig {
        checkpoint: ckpt,
        groups_per_step: 2,
        max_off_policy_steps: 1,
        ..Default::default()
    };
    TrainerStage::build(
        cfg,
        &ctx(
            "trainer",
            run_dir,
            &[("policy", SchemaId::Policy), ("metrics", SchemaId::Metrics)],
        ),
    )
    .unwrap()
}

/// A trainer on a fresh tiny checkpoint (`dir/init`), started: version 0 is in `out`.
async fn started_trainer(dir: &Path, out: &mut Emitter) -> TrainerStage {
    let ckpt = dir.join("init");
    tiny(&ckpt, 0);
    let mut t = trainer(dir, ckpt);
    t.start(out).await.unwrap();
    t
}

fn metric(rows: &[streamrl_schemas::MetricRow], name: &str) -> f64 {
    rows.iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no metric {name}"))
        .value
}

#[tokio::test]
async fn trainer_steps_per_batch_publishes_versions_and_resumes_without_repeating_samples() {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Emitter::default();
    let mut t = started_trainer(dir.path(), &mut out).await;
    let ckpt = dir.path().join("init");
    let v0: Vec<PolicyRow> = batches(&mut out, "policy");
    assert_eq!(v0[0].version, 0);

    let g1 = pair("g1", 0);
    t.process(input("samples", &g1), &mut out).await.unwrap();
    assert_eq!(out.holding(), Some(Some("g1")));
    assert!(out.drain().is_empty(), "stepped before the batch was full");
    t.process(input("samples", &g1), &mut out).await.unwrap();
    assert!(out.drain().is_empty(), "a duplicate group counted toward the batch");
    let g2 = pair("g2", 0);
    let mut out = Emitter::default();
    t.process(input("samples", &g2), &mut out).await.unwrap();
    assert_eq!(out.released(), ["g1".to_string(), "g2".to_string()]);
    let drained = out.drain();
    let policy: Vec<PolicyRow> = rows_in(&drained, "policy");
    assert_eq!(policy.len(), 1);
    assert_eq!(policy[0].version, 1);
    let path = streamrl_stages::uri_path(&policy[0].uri);
    assert_eq!(
        streamrl_model::checkpoint::weights_sha256(&path).unwrap(),
        policy[0].sha256
    );
    let m: Vec<streamrl_schemas::MetricRow> = rows_in(&drained, "metrics");
    assert_eq!(metric(&m, "samples_trained"), 4.0);
    assert_eq!(metric(&m, "samples_duplicate"), 2.0);
    assert!(metric(&m, "grad_norm") > 0.0);

    // Step 2: one group is too old (version 0 < 2 − 1), one is fresh.
    let mut out = Emitter::default();
    let old = at_step(pair("g3", 0), 1);
    let fresh = at_step(pair("g4", 1), 1);
    t.process(input("samples", &old), &mut out).await.unwrap();
    t.process(input("samples", &fresh), &mut out).await.unwrap();
    let drained = out.drain();
    let m: Vec<streamrl_schemas::MetricRow> = rows_in(&drained, "metrics");
    assert_eq!(
        metric(&m, "samples_dropped_stale"),
        0.0,
        "version 0 is within 1 of step 1"
    );
    assert_eq!(t.version(), 2);

    // A restarted trainer resumes at version 2 and skips every sample it consumed.
    let mut again = trainer(dir.path(), ckpt);
    assert_eq!(again.version(), 2);
    let mut out = Emitter::default();
    again.process(input("samples", &g1), &mut out).await.unwrap();
    again.process(input("samples", &fresh), &mut out).await.unwrap();
    assert!(out.drain().is_empty(), "consumed samples were trained again");
    let stale = at_step(pair("g5", 0), 2);
    let g6 = at_step(pair("g6", 2), 2);
    again.process(input("samples", &stale), &mut out).await.unwrap();
    again.process(input("samples", &g6), &mut out).await.unwrap();
    let m: Vec<streamrl_schemas::MetricRow> = batches(&mut out, "metrics");
    assert_eq!(
        metric(&m, "samples_dropped_stale"),
        2.0,
        "version 0 is older than 2 − 1"
    );
    assert_eq!(metric(&m, "samples_trained"), 2.0);
    assert_eq!(again.version(), 3);
}

/// A samples message the trainer could never train (no prompt, a loss mask of the wrong
/// length, more tokens than the context) fails with the sample and the reason, before
/// any of its group is buffered; the trainer goes on with the next message.
#[tokio::test]
async fn trainer_refuses_untrainable_samples_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Emitter::default();
    let mut t = started_trainer(dir.path(), &mut out).await;
    out.drain();
    type Spoil = fn(&mut SampleRow);
    let bad: [(&str, Spoil); 3] = [
        ("empty prompt", |s| s.prompt_token_ids.clear()),
        ("2 loss-mask values for 3 completion tokens", |s| {
            s.loss_mask.pop();
        }),
        ("exceed the model's context", |s| s.prompt_token_ids = vec![5; 4096]),
    ];
    for (i, (want, spoil)) in bad.into_iter().enumerate() {
        let g = format!("bad{i}");
        let mut rows: Vec<SampleRow> = (0..2).map(|k| sample(&g, k, 1.0, 0.5, 0)).collect();
        spoil(&mut rows[1]);
        let err = t.process(input("samples", &rows), &mut out).await.unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&format!("sample {g}-1-t0")) && msg.contains(want), "{msg}");
        assert_eq!(out.holding(), None, "nothing of a refused group is held");
    }
    let ok: Vec<SampleRow> = (0..2).map(|k| sample("ok", k, 1.0, 0.5, 0)).collect();
    t.process(input("samples", &ok), &mut out).await.unwrap();
    assert_eq!(out.holding(), Some(Some("ok")));
}

/// A trainer killed after the bus acknowledged version N but before it recorded that
/// (`checkpoints/published`) must not publish N again when it comes back on a durable bus:
/// it asks the `policy` topic. Killed before the bus had N, it publishes N (once), and
/// N's lineage unless `trained` holds it already.
#[tokio::test]
async fn restarted_trainer_on_a_durable_bus_publishes_each_version_and_its_lineage_once() {
    use streamrl_runtime::bus::{self, Record, TopicSpec};
    use streamrl_schemas::codec::{self, Compression};
    use streamrl_schemas::{Headers, TrainedRow};

    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("init");
    tiny(&ckpt, 0);
    let b = bus::connect(&format!("memory://trainer-restart-{}", std::process::id()))
        .await
        .unwrap();
    b.create_topic(&TopicSpec::new("policy", 1)).await.unwrap();
    b.create_topic(&TopicSpec::new("trained", 1)).await.unwrap();
    let build = |durable: bool| {
        let mut c = ctx(
            "trainer",
            dir.path(),
            &[
                ("policy", SchemaId::Policy),
                ("trained", SchemaId::Trained),
                ("metrics", SchemaId::Metrics),
            ],
        );
        c.durable_bus = durable;
        c.bus = durable.then(|| streamrl_runtime::build::BusHandle(b.clone()));
        let cfg = TrainerConfig {
            checkpoint: ckpt.clone(),
            groups_per_step: 2,
            max_off_policy_steps: 1,
            ..Default::default()
        };
        TrainerStage::build(cfg, &c).unwrap()
    };
    // Train version 1 outside the runtime: saved, never acknowledged by a bus.
    let mut t = build(false);
    let mut out = Emitter::default();
    t.start(&mut out).await.unwrap();
    for g in ["g1", "g2"] {
        let rows = pair(g, 0);
        t.process(input("samples", &rows), &mut out).await.unwrap();
    }
    assert_eq!(t.version(), 1);
    let drained = out.drain();
    let v1 = rows_in::<PolicyRow>(&drained, "policy").last().unwrap().clone();
    assert_eq!(v1.version, 1);
    let lineage: Vec<TrainedRow> = rows_in(&drained, "trained");
    assert_eq!(lineage.iter().filter(|r| r.version == 1).count(), 4, "{lineage:?}");
    drop(t);

    let send = |topic: &'static str, schema: SchemaId, batch: arrow::record_batch::RecordBatch| {
        let b = b.clone();
        async move {
            let record = Record::new(codec::encode(&batch, Compression::None).unwrap())
                .with_headers(Headers::data(schema, "trainer-0").to_wire());
            b.producer("test")
                .await
                .unwrap()
                .send(topic, record)
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };
    let restart = || async {
        let mut t = build(true);
        let mut out = Emitter::default();
        t.start(&mut out).await.unwrap();
        let drained = out.drain();
        let versions: Vec<u32> = rows_in::<PolicyRow>(&drained, "policy")
            .iter()
            .map(|r| r.version)
            .collect();
        (versions, rows_in::<TrainedRow>(&drained, "trained").len())
    };

    // The bus holds only version 0: version 1 and its lineage go out now.
    let v0 = PolicyRow {
        version: 0,
        step: 0,
        ..v1.clone()
    };
    send("policy", SchemaId::Policy, PolicyRow::to_batch(&[v0]).unwrap()).await;
    assert_eq!(
        restart().await,
        (vec![1], 4),
        "neither version 1 nor its lineage was on the bus"
    );

    // The lineage reached `trained`, the version did not: only the version goes out.
    let v1_lineage: Vec<TrainedRow> = lineage.iter().filter(|r| r.version == 1).cloned().collect();
    send("trained", SchemaId::Trained, TrainedRow::to_batch(&v1_lineage).unwrap()).await;
    assert_eq!(restart().await, (vec![1], 0), "the lineage of version 1 was sent twice");

    // The bus holds version 1 (delivered; the kill came before the record): nothing again.
    send(
        "policy",
        SchemaId::Policy,
        PolicyRow::to_batch(std::slice::from_ref(&v1)).unwrap(),
    )
    .await;
    assert_eq!(restart().await, (vec![], 0), "version 1 published twice");
    let record = std::fs::read_to_string(dir.path().join("checkpoints/published")).unwrap();
    assert_eq!(record.trim(), "1", "what the topic holds is recorded");
}

#[tokio::test]
async fn trainer_trains_each_version_on_the_groups_admitted_for_that_step() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("init");
    tiny(&ckpt, 0);
    let mut t = trainer(dir.path(), ckpt);
    let group = |g: &str, step: u64| -> Vec<SampleRow> {
        (0..2)
            .map(|i| SampleRow {
                step,
                ..sample(g, i, i as f32, i as f32 - 0.5, 0)
            })
            .collect()
    };
    let mut out = Emitter::default();
    // A group admitted for step 1 finishes first: it waits, held.
    t.process(input("samples", &group("late", 1)), &mut out).await.unwrap();
    assert_eq!(out.holding(), Some(Some("late")));
    t.process(input("samples", &group("a", 0)), &mut out).await.unwrap();
    assert_eq!(t.version(), 0, "one group of step 0 is not a batch");
    let mut out = Emitter::default();
    t.process(input("samples", &group("b", 0)), &mut out).await.unwrap();
    assert_eq!(t.version(), 1);
    assert_eq!(
        out.released(),
        ["a".to_string(), "b".to_string()],
        "the step-1 group stays held"
    );
    let mut out = Emitter::default();
    t.process(input("samples", &group("c", 1)), &mut out).await.unwrap();
    assert_eq!(t.version(), 2);
    assert_eq!(out.released(), ["c".to_string(), "late".to_string()]);
}

/// A step that waited `step_timeout_secs` trains without the group that did not come and
/// says which one on `trained` (`timed_out`); the group, coming later, rides along with the
/// next step without standing in for one of that step's own groups.
/// A sample of a step older than the deduplication window is dropped as `superseded`, with
/// its row; the window moves on with every version.
#[tokio::test]
async fn trainer_names_groups_it_stopped_waiting_for_and_drops_superseded_samples() {
    use streamrl_schemas::TrainedRow;
    use streamrl_schemas::ids::group_id;
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("init");
    tiny(&ckpt, 0);
    let cfg = TrainerConfig {
        checkpoint: ckpt,
        groups_per_step: 2,
        max_off_policy_steps: 1,
        dedup_window: 2,
        step_timeout_secs: 0,
        ..Default::default()
    };
    let c = ctx(
        "trainer",
        dir.path(),
        &[
            ("policy", SchemaId::Policy),
            ("trained", SchemaId::Trained),
            ("metrics", SchemaId::Metrics),
        ],
    );
    let mut t = TrainerStage::build(cfg, &c).unwrap();
    let mut out = Emitter::default();
    t.start(&mut out).await.unwrap();
    out.drain();
    // Groups are named as the source names them: group g is admitted for step g / 2.
    let g = |i: u64, version: u32| at_step(pair(&group_id("test", i), version), i / 2);
    let lineage = |out: &mut Emitter| -> Vec<(u32, String, String, String)> {
        batches::<TrainedRow>(out, "trained")
            .into_iter()
            .map(|r| (r.version, r.group_id, r.sample_id, r.outcome))
            .collect()
    };
    // Step 0 has one of its two groups when a group of step 1 comes: with no time to
    // wait, step 0 trains without group 1, named in the lineage.
    t.process(input("samples", &g(0, 0)), &mut out).await.unwrap();
    assert_eq!(t.version(), 0);
    t.process(input("samples", &g(2, 0)), &mut out).await.unwrap();
    assert_eq!(t.version(), 1);
    let rows = lineage(&mut out);
    let timed_out: Vec<_> = rows.iter().filter(|r| r.3 == "timed_out").collect();
    assert_eq!(
        timed_out,
        [&(1, group_id("test", 1), String::new(), "timed_out".to_string())],
        "{rows:?}"
    );
    assert_eq!(rows.iter().filter(|r| r.3 == "trained").count(), 2, "{rows:?}");
    // Group 1 comes late: it does not complete step 1 (group 3 does), and rides along.
    t.process(input("samples", &g(1, 0)), &mut out).await.unwrap();
    assert_eq!(t.version(), 1, "a late group stood in for one of step 1's");
    t.process(input("samples", &g(3, 1)), &mut out).await.unwrap();
    assert_eq!(t.version(), 2);
    let rows = lineage(&mut out);
    let outcome = |id: u64| -> Vec<&str> {
        rows.iter()
            .filter(|r| r.1 == group_id("test", id))
            .map(|r| r.3.as_str())
            .collect()
    };
    assert_eq!(outcome(1), ["trained", "trained"], "{rows:?}");
    assert_eq!(outcome(2), ["trained", "trained"], "{rows:?}");
    assert_eq!(outcome(3), ["trained", "trained"], "{rows:?}");
    assert!(rows.iter().all(|r| r.0 == 2 && r.3 != "timed_out"), "{rows:?}");
    // Versions 3 and 4 (the window, 2 steps, now starts at step 2).
    for i in 4..8 {
        t.process(input("samples", &g(i, 3)), &mut out).await.unwrap();
    }
    assert_eq!(t.version(), 4);
    out.drain();
    // A copy of group 2 (step 1, below the window) is dropped as superseded, at once.
    let mut out = Emitter::default();
    t.process(input("samples", &g(2, 0)), &mut out).await.unwrap();
    assert_eq!(out.holding(), None, "a superseded sample is not held");
    let rows = lineage(&mut out);
    assert_eq!(
        rows.iter().map(|r| (r.0, r.3.as_str())).collect::<Vec<_>>(),
        [(5, "superseded"), (5, "superseded")],
        "{rows:?}"
    );
    // A copy of group 5 (step 2, inside the window) is a duplicate.
    t.process(input("samples", &g(5, 3)), &mut out).await.unwrap();
    let rows = lineage(&mut out);
    assert!(rows.iter().all(|r| r.3 == "duplicate") && rows.len() == 2, "{rows:?}");
}

fn ctx_with_envs(stage: &str, run_dir: &Path, outputs: &[(&str, SchemaId)], envs: &str) -> BuildContext {
    common::ctx("test", stage, run_dir, outputs, envs)
}

const SANDBOX_ENVS: &str = "code: {config: {wall_ms: 1500, test_timeout_secs: 1}}\ntool: {}\narith: {}";

fn env_row(env: &str, problem: &streamrl_envs::Problem, completion: &str, id: u32) -> RolloutRow {
    RolloutRow {
        env: env.into(),
        problem_id: problem.id.clone(),
        answer: problem.answer.clone(),
        info: Some(problem.info.to_string()),
        completion: completion.into(),
        ..rollout_row("g", id, 8)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_runs_unit_tests_and_tool_calls_and_reward_reads_the_results() {
    use streamrl_schemas::{ContinuationRow, ExecutedRow};
    use streamrl_stages::sandbox::{SandboxConfig, SandboxStage};
    let dir = tempfile::tempdir().unwrap();
    let outputs = [
        ("executed", SchemaId::Executed),
        ("continuations", SchemaId::Continuations),
    ];
    let cfg = SandboxConfig {
        pool: streamrl_sandbox::SandboxConfig {
            pool_size: 2,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut stage = SandboxStage::build(cfg, &ctx_with_envs("sandbox", dir.path(), &outputs, SANDBOX_ENVS)).unwrap();
    let envs = build_envs(&serde_yaml::from_str(SANDBOX_ENVS).unwrap())
        .unwrap()
        .unwrap();
    let code = envs.get("code").unwrap();
    let add = code.sample(streamrl_envs::Split::Train, 0);
    assert!(add.question.contains("def add(a, b):"), "{}", add.question);
    let tool = envs.get("tool").unwrap().sample(streamrl_envs::Split::Train, 0);
    let mut call = env_row("tool", &tool, "I will compute. <python>\nprint(6 * 7)\n</python>", 4);
    call.finish_reason = "tool_call".into();
    let mut last_turn = env_row("tool", &tool, "<python>print(1)</python>", 5);
    last_turn.finish_reason = "tool_call".into();
    last_turn.turn = 2;
    let rows = vec![
        env_row("code", &add, &code.reference_completion(&add).unwrap(), 0),
        env_row("code", &add, "```python\ndef add(a, b):\n    return 3\n```", 1),
        env_row(
            "code",
            &add,
            "```python\nimport signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass\n```",
            2,
        ),
        rollout_row("g", 3, 8),
        call,
        last_turn,
    ];
    let mut out = Emitter::default();
    stage.process(input("rollouts", &rows), &mut out).await.unwrap();
    let drained = out.drain();
    let executed: Vec<ExecutedRow> = drained
        .iter()
        .filter(|(t, _)| t == "executed")
        .flat_map(|(_, b)| ExecutedRow::from_batch(b).unwrap())
        .collect();
    let conts: Vec<ContinuationRow> = drained
        .iter()
        .filter(|(t, _)| t == "continuations")
        .flat_map(|(_, b)| ContinuationRow::from_batch(b).unwrap())
        .collect();
    let by = |i: u32| executed.iter().find(|r| r.sample_index == i).unwrap();
    assert_eq!(
        (by(0).exec_status.as_str(), by(0).tests_passed, by(0).tests_total),
        ("ok", 3, 3),
        "{:?}",
        by(0)
    );
    assert_eq!(
        (by(1).exec_status.as_str(), by(1).tests_passed, by(1).tests_total),
        ("ok", 1, 3),
        "{:?}",
        by(1)
    );
    assert_eq!(by(2).exec_status, "timeout", "{:?}", by(2));
    assert!(
        by(2).stderr.contains("wall-clock limit of 1500 ms"),
        "{:?}",
        by(2).stderr
    );
    assert_eq!(by(3).exec_status, "skipped");
    assert_eq!(by(5).exec_status, "skipped");
    assert!(by(5).stderr.contains("max_turns (3) reached"), "{}", by(5).stderr);
    assert_eq!(executed.len(), 5);
    assert_eq!(conts.len(), 1);
    assert_eq!(conts[0].tool_outputs[0].output, "\n<output>\n42\n</output>\n");
    assert_eq!(conts[0].tool_outputs[0].status, "ok");
    assert_eq!(conts[0].tool_calls[0].arguments, r#"{"code":"print(6 * 7)"}"#);

    // The reward stage reads the sandbox's results through the rubric.
    let scored: Vec<ScoredRow> = executed
        .into_iter()
        .map(|e| streamrl_stages::reward::score(&envs, e).unwrap())
        .collect();
    let reward = |i: u32| scored.iter().find(|r| r.sample_index == i).unwrap();
    assert_eq!(reward(0).reward, 1.0);
    assert!((reward(1).reward - 1.0 / 3.0).abs() < 1e-6);
    assert_eq!(reward(1).reward_components[0].reason, "1/3 tests passed");
    assert_eq!(reward(2).reward, 0.0);
    assert!(
        reward(2).reward_components[0].reason.contains("sandbox timeout"),
        "{:?}",
        reward(2).reward_components
    );
    assert_eq!(reward(5).reward, 0.0);
}

#[tokio::test]
async fn rollout_continues_a_trajectory_after_its_tool_output_with_the_tool_tokens_masked() {
    use streamrl_schemas::{ContinuationRow, ToolOutput};
    let dir = tempfile::tempdir().unwrap();
    let v0 = dir.path().join("v0");
    tiny(&v0, 0);
    let cfg = RolloutConfig {
        checkpoint: v0,
        turn_max_tokens: 5,
        ..Default::default()
    };
    let mut stage = RolloutStage::build(
        cfg,
        &ctx_with_envs("rollout", dir.path(), &[("rollouts", SchemaId::Rollouts)], "tool: {}"),
    )
    .unwrap();
    let tok = Tokenizer::char_level();
    let first = "<python>print(1)</python>";
    let tool_text = "\n<output>\n1\n</output>\n";
    let n_first = tok.encode(first).unwrap().len();
    let n_tool = tok.encode(tool_text).unwrap().len();
    let base = rollout_row("g", 2, 4);
    let c = ContinuationRow {
        env: "tool".into(),
        completion: first.into(),
        completion_token_ids: tok.encode(first).unwrap(),
        completion_logprobs: vec![-0.5; n_first],
        completion_versions: vec![0; n_first],
        completion_routes: vec![],
        loss_mask: vec![true; n_first],
        finish_reason: "tool_call".into(),
        tool_outputs: vec![ToolOutput {
            call_id: "g-2-call0".into(),
            name: "python".into(),
            output: tool_text.into(),
            status: "ok".into(),
        }],
        run_id: base.run_id,
        problem_id: base.problem_id,
        group_id: base.group_id,
        rollout_id: base.rollout_id,
        sample_id: base.sample_id,
        step: base.step,
        sample_index: base.sample_index,
        group_size: base.group_size,
        turn: 0,
        prompt: base.prompt,
        prompt_token_ids: base.prompt_token_ids.clone(),
        tool_calls: vec![],
        answer: base.answer,
        info: None,
        temperature: 1.0,
        started_at: 0,
        finished_at: 0,
        created_at: 0,
    };
    let mut out = Emitter::default();
    stage.process(input("continuations", &[c]), &mut out).await.unwrap();
    assert_eq!(out.holding(), Some(Some("g-2")));
    for _ in 0..100 {
        stage.tick(&mut out).await.unwrap();
        if !out.released().is_empty() {
            break;
        }
    }
    assert_eq!(out.released(), ["g-2".to_string()]);
    let rows: Vec<RolloutRow> = batches(&mut out, "rollouts");
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(
        (r.turn, r.sample_id.as_str(), r.prompt_token_ids.clone()),
        (1, "g-2-t1", base.prompt_token_ids)
    );
    assert!(
        r.completion.starts_with(&format!("{first}{tool_text}")),
        "{:?}",
        r.completion
    );
    let n = r.completion_token_ids.len();
    assert!(n > n_first + n_tool && n <= n_first + n_tool + 5, "{n}");
    assert_eq!(
        (
            r.completion_logprobs.len(),
            r.completion_versions.len(),
            r.loss_mask.len()
        ),
        (n, n, n)
    );
    assert!(r.loss_mask[..n_first].iter().all(|m| *m));
    assert!(
        r.loss_mask[n_first..n_first + n_tool].iter().all(|m| !*m),
        "tool tokens are masked"
    );
    assert!(r.loss_mask[n_first + n_tool..].iter().all(|m| *m));
    assert!(
        r.completion_logprobs[n_first..n_first + n_tool]
            .iter()
            .all(|l| *l == 0.0)
    );
    assert!(r.completion_logprobs[n_first + n_tool..].iter().all(|l| *l < 0.0));
}

#[test]
fn few_shot_and_system_prompts_render_through_the_checkpoint_template() {
    use streamrl_model::chat::ChatTemplate;
    let envs = build_envs(&serde_yaml::from_str("arith: {few_shot: 2, system_prompt: Be exact.}").unwrap())
        .unwrap()
        .unwrap();
    let env = envs.get("arith").unwrap();
    let p = env.prompt(&env.sample(streamrl_envs::Split::Train, 1));
    let roles: Vec<&str> = p.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user", "assistant", "user"]);
    let jinja = ChatTemplate::from_jinja(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        None,
        None,
    )
    .unwrap();
    let text = streamrl_stages::render_prompt(&jinja, &p).unwrap();
    assert!(
        text.starts_with("<system>Be exact.<user>") && text.ends_with("<assistant>"),
        "{text}"
    );
    assert_eq!(
        streamrl_stages::render_prompt(&ChatTemplate::Plain, &p).unwrap(),
        p.text
    );
    assert!(
        p.text.starts_with("Be exact.\n") && p.text.matches('=').count() == 3,
        "{:?}",
        p.text
    );
    let err = build_envs(&serde_yaml::from_str("tool: {few_shot: 1, bogus: 2}").unwrap()).unwrap_err();
    assert!(
        err[0].path == "envs.tool.bogus" && err[0].message.contains("unknown field"),
        "{err:?}"
    );
}

/// A tiny Qwen3-MoE checkpoint (4 experts, 2 per token) with the character tokenizer.
fn tiny_moe(dir: &Path, seed: u64) {
    let tok = Tokenizer::char_level();
    let mut hf = config::preset("tiny", tok.vocab_size()).unwrap();
    hf.model_type = Some("qwen3_moe".into());
    hf.num_experts = Some(4);
    hf.num_experts_per_tok = Some(2);
    hf.moe_intermediate_size = Some(96);
    let l = checkpoint::init_seeded(&hf, &Device::Cpu, Some(seed)).unwrap();
    checkpoint::save(dir, &hf, &l.vars, Some(&tok), None).unwrap();
}

/// Dense and MoE: the same losses, gradient norms and entropies with and without activation
/// checkpointing; an MoE model's steps report its routing imbalance (the same either way),
/// a dense model's none.
#[test]
fn the_learner_steps_the_same_with_activation_checkpointing() {
    for moe in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        if moe {
            tiny_moe(dir.path(), 5);
        } else {
            tiny(dir.path(), 5);
        }
        learner_steps_the_same_with_activation_checkpointing(dir.path(), moe);
    }
}

/// A sample without a prompt has no position to predict its first completion token from
/// (in a packed row, the one before it belongs to another sample): refused, named.
#[test]
fn the_learner_refuses_a_sample_without_a_prompt() {
    use streamrl_stages::train::{Learner, TrainConfig, TrainSample};
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), 5);
    let sample = |prompt: Vec<u32>| TrainSample {
        prompt,
        completion: vec![20, 21, 2],
        sampler_logprobs: vec![-3.0, -2.5, -1.0],
        loss_mask: vec![true; 3],
        advantage: 0.5,
        routes: vec![],
    };
    let mut l = Learner::load(dir.path(), TrainConfig::default()).unwrap();
    let err = l.step(&[sample(vec![10, 11]), sample(vec![])]).unwrap_err().to_string();
    assert!(err.contains("sample 1: empty prompt"), "{err}");
    assert!(l.step(&[sample(vec![10, 11]), sample(vec![12])]).is_ok());
}

fn learner_steps_the_same_with_activation_checkpointing(dir: &Path, moe: bool) {
    use streamrl_stages::train::{Learner, TrainConfig, TrainSample};
    let batch: Vec<TrainSample> = (0..6u32)
        .map(|i| TrainSample {
            prompt: vec![10 + i, 11, 12],
            completion: vec![20 + i, 21, 22, 2],
            sampler_logprobs: vec![-3.0, -2.5, -4.0, -1.0],
            loss_mask: vec![true, true, i % 2 == 0, true],
            advantage: if i % 3 == 0 { -0.5 } else { 0.7 },
            routes: vec![],
        })
        .collect();
    let step = |ckpt: bool| {
        let cfg = TrainConfig {
            activation_checkpointing: ckpt,
            micro_batch_tokens: 16,
            pack_len: 16,
            ..Default::default()
        };
        let mut l = Learner::load(dir, cfg).unwrap();
        let first = l.step(&batch).unwrap();
        let second = l.step(&batch).unwrap();
        (first, second)
    };
    let (plain, ckpt) = (step(false), step(true));
    for (a, b) in [(&plain.0, &ckpt.0), (&plain.1, &ckpt.1)] {
        assert!(a.micro_batches > 1, "gradients accumulate over micro-batches");
        assert!((a.loss - b.loss).abs() < 1e-5, "{} vs {}", a.loss, b.loss);
        assert!(
            (a.grad_norm - b.grad_norm).abs() <= 1e-4 * a.grad_norm.max(1.0),
            "{} vs {}",
            a.grad_norm,
            b.grad_norm
        );
        assert!((a.entropy - b.entropy).abs() < 1e-5);
        match (moe, a.moe_imbalance, b.moe_imbalance) {
            (false, None, None) => {}
            (true, Some(x), Some(y)) => {
                // A randomly initialised router is never perfectly balanced.
                assert!(x.is_finite() && x > 0.0, "imbalance {x}");
                assert!((x - y).abs() < 1e-6, "{x} vs {y}");
            }
            other => panic!("moe {moe}: imbalance {other:?}"),
        }
    }
}

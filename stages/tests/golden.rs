//! Golden batches: fixed inputs through the reward and mask stages, the inputs and outputs
//! compared as pretty-printed Arrow tables with `stages/tests/golden/*.txt`. When an
//! output changes on purpose, paste the printed table over the file (or run with
//! `STREAMRL_BLESS=1`, which rewrites it) and review the diff.

use std::path::Path;

use arrow::record_batch::RecordBatch;
use arrow::util::pretty::pretty_format_batches;
use streamrl_runtime::{Emitter, Input, Stage};
use streamrl_schemas::{ExecutedRow, RolloutRow, SampleRow, SchemaId, ScoredRow, TopicRow};
use streamrl_stages::build_envs;
use streamrl_stages::mask::MaskStage;
use streamrl_stages::reward::RewardStage;
use streamrl_stages::sandbox::pass_through;

mod common;

/// An arith rollout of group `group` answering `completion` (the answer is 2).
fn executed(group: &str, i: u32, size: u32, completion: &str) -> ExecutedRow {
    pass_through(RolloutRow {
        run_id: "golden".into(),
        completion: completion.into(),
        completion_token_ids: completion.bytes().map(u32::from).collect(),
        completion_logprobs: vec![-0.5; completion.len()],
        completion_versions: vec![0; completion.len()],
        completion_routes: vec![],
        loss_mask: vec![true; completion.len()],
        ..common::rollout_row(group, i, size)
    })
}

/// `batch`'s `columns` as a pretty-printed table.
fn table(batch: &RecordBatch, columns: &[&str]) -> String {
    let idx: Vec<usize> = columns.iter().map(|c| batch.schema().index_of(c).unwrap()).collect();
    pretty_format_batches(&[batch.project(&idx).unwrap()])
        .unwrap()
        .to_string()
}

/// Compares `got` with the golden file `name` (rewrites it under `STREAMRL_BLESS=1`).
fn golden(name: &str, got: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name);
    if std::env::var_os("STREAMRL_BLESS").is_some() {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        want == got,
        "{} differs; if the change is intended, paste this over it (or run with STREAMRL_BLESS=1):\n{got}",
        path.display()
    );
}

/// The outputs of `topic` in `out`, as one batch of rows of type `T` with `created_at`
/// (a wall-clock time) zeroed.
fn outputs<T: TopicRow>(out: &mut Emitter, topic: &str, zero: impl Fn(&mut T)) -> RecordBatch {
    let mut rows: Vec<T> = out
        .drain()
        .iter()
        .filter(|(t, _)| t == topic)
        .flat_map(|(_, b)| T::from_batch(b).unwrap())
        .collect();
    rows.iter_mut().for_each(zero);
    T::to_batch(&rows).unwrap()
}

#[tokio::test]
async fn reward_stage_golden() {
    let (_dir, mut stage) = common::default_stage::<RewardStage>("golden", "reward", &[("scored", SchemaId::Scored)]);
    let rows = [
        executed("g", 0, 4, "2"),
        executed("g", 1, 4, "3"),
        executed("g", 2, 4, "two"),
        executed("g", 3, 4, ""),
    ];
    let input = ExecutedRow::to_batch(&rows).unwrap();
    let mut out = Emitter::default();
    stage
        .process(Input::new("executed", SchemaId::Executed, input.clone()), &mut out)
        .await
        .unwrap();
    let scored = outputs::<ScoredRow>(&mut out, "scored", |r| r.created_at = 0);
    let text = format!(
        "executed (in)\n{}\nscored (out)\n{}\n",
        table(&input, &["sample_id", "completion", "answer"]),
        table(&scored, &["sample_id", "reward", "reward_components"]),
    );
    golden("reward.txt", &text);
}

#[tokio::test]
async fn mask_stage_golden() {
    let (_dir, mut stage) = common::default_stage::<MaskStage>("golden", "mask", &[("samples", SchemaId::Samples)]);
    let envs = build_envs(&serde_yaml::from_str("arith: {}").unwrap())
        .unwrap()
        .unwrap();
    let score = |group: &str, i: u32, size: u32, completion: &str| -> ScoredRow {
        streamrl_stages::reward::score(&envs, executed(group, i, size, completion)).unwrap()
    };
    // A group with signal (two right, two wrong, one of them truncated) and one without.
    let mut truncated = score("g1", 3, 4, "22");
    truncated.finish_reason = "length".into();
    let rows = [
        score("g1", 0, 4, "2"),
        score("g1", 1, 4, "3"),
        score("g1", 2, 4, "2"),
        truncated,
        score("g2", 0, 2, "2"),
        score("g2", 1, 2, "2"),
    ];
    let input = ScoredRow::to_batch(&rows).unwrap();
    let mut out = Emitter::default();
    stage
        .process(Input::new("scored", SchemaId::Scored, input.clone()), &mut out)
        .await
        .unwrap();
    let samples = outputs::<SampleRow>(&mut out, "samples", |r| r.created_at = 0);
    let text = format!(
        "scored (in)\n{}\nsamples (out)\n{}\n",
        table(&input, &["sample_id", "completion", "finish_reason", "reward"]),
        table(&samples, &["sample_id", "reward", "advantage", "loss_mask"]),
    );
    golden("mask.txt", &text);
}

//! What the stage tests share: the context a stage is built in, and a rollout row.

use std::path::Path;

use streamrl_runtime::build::{BuildContext, BuildStage};
use streamrl_schemas::{RolloutRow, SchemaId};

/// The context of replica 0 of `stage` in run `run_id` under `run_dir`, emitting to
/// `outputs`, with the environments of the YAML `envs` (an `envs:` section).
pub fn ctx(run_id: &str, stage: &str, run_dir: &Path, outputs: &[(&str, SchemaId)], envs: &str) -> BuildContext {
    BuildContext {
        run_id: run_id.into(),
        run_dir: run_dir.to_path_buf(),
        outputs: outputs.iter().map(|(n, s)| (n.to_string(), *s)).collect(),
        envs: serde_yaml::from_str(envs).unwrap(),
        ..BuildContext::new(stage, 0)
    }
}

/// Replica 0 of a stage `S` with its default config, in run `run_id` with the arith
/// environment, emitting to `outputs`; the directory is its run dir (keep it alive).
pub fn default_stage<S: BuildStage>(run_id: &str, stage: &str, outputs: &[(&str, SchemaId)]) -> (tempfile::TempDir, S) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = ctx(run_id, stage, dir.path(), outputs, "arith: {weight: 1}");
    let built = S::build(S::Config::default(), &ctx).unwrap();
    (dir, built)
}

/// Sample `i` of arith group `group` (of `size`) in run `test`: the prompt `1+1=` answered
/// `2\n` (the answer is 2).
pub fn rollout_row(group: &str, i: u32, size: u32) -> RolloutRow {
    RolloutRow {
        run_id: "test".into(),
        problem_id: "p".into(),
        group_id: group.into(),
        rollout_id: format!("{group}-{i}"),
        sample_id: format!("{group}-{i}-t0"),
        env: "arith".into(),
        step: 0,
        sample_index: i,
        group_size: size,
        turn: 0,
        prompt: "1+1=".into(),
        prompt_token_ids: vec![21, 15, 21, 33],
        completion: "2\n".into(),
        completion_token_ids: vec![22, 4, 2],
        completion_logprobs: vec![-0.5, -0.25, -0.1],
        completion_versions: vec![0, 0, 0],
        completion_routes: vec![],
        loss_mask: vec![true, true, true],
        finish_reason: "stop".into(),
        tool_calls: vec![],
        answer: Some("2".into()),
        info: None,
        temperature: 1.0,
        started_at: 0,
        finished_at: 0,
        created_at: 0,
    }
}

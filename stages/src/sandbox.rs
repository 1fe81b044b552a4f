//! The sandbox stage: executes what a rollout's environment needs before it can be scored.
//!
//! This build has environments that need no execution (arith, countdown, math): their
//! rollouts pass through to `executed` with `exec_status = skipped`. A rollout that ended
//! in a tool call (`finish_reason = tool_call`) cannot be served without a sandbox
//! backend; it is passed on with `exec_status = internal_error` and the reason in
//! `stderr`, so the mask stage drops it from training instead of the pipeline stalling.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use streamrl_runtime::{Emitter, Input, Stage, StageError};
use streamrl_schemas::{ExecutedRow, RolloutRow, SchemaId, TopicRow};

use crate::{Ctx, now_ms, rows};

/// Configuration of the sandbox stage (nothing to configure for pass-through).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxConfig {}

/// The sandbox stage.
#[derive(Debug)]
pub struct SandboxStage {
    executed: String,
}

impl SandboxStage {
    /// Builds the stage.
    pub fn build(_cfg: SandboxConfig, ctx: Ctx) -> Result<Self, Vec<String>> {
        Ok(SandboxStage {
            executed: ctx.require_output(SchemaId::Executed)?,
        })
    }
}

/// A rollout passed through unexecuted (`skipped`), or refused for lack of a backend.
pub fn pass_through(r: RolloutRow) -> ExecutedRow {
    let tool = r.finish_reason == "tool_call";
    ExecutedRow {
        tool_outputs: vec![],
        exec_status: if tool { "internal_error" } else { "skipped" }.into(),
        exit_code: None,
        stdout: String::new(),
        stderr: if tool {
            "this build has no sandbox backend to execute tool calls".into()
        } else {
            String::new()
        },
        exec_duration_ms: 0,
        tests_passed: 0,
        tests_total: 0,
        run_id: r.run_id,
        problem_id: r.problem_id,
        group_id: r.group_id,
        rollout_id: r.rollout_id,
        sample_id: r.sample_id,
        env: r.env,
        step: r.step,
        sample_index: r.sample_index,
        group_size: r.group_size,
        turn: r.turn,
        prompt: r.prompt,
        prompt_token_ids: r.prompt_token_ids,
        completion: r.completion,
        completion_token_ids: r.completion_token_ids,
        completion_logprobs: r.completion_logprobs,
        completion_versions: r.completion_versions,
        loss_mask: r.loss_mask,
        finish_reason: r.finish_reason,
        tool_calls: r.tool_calls,
        answer: r.answer,
        info: r.info,
        temperature: r.temperature,
        started_at: r.started_at,
        finished_at: r.finished_at,
        created_at: now_ms(),
    }
}

#[async_trait]
impl Stage for SandboxStage {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        let executed: Vec<ExecutedRow> = rows::<RolloutRow>(&input.batch)?
            .into_iter()
            .map(pass_through)
            .collect();
        out.emit(
            self.executed.clone(),
            ExecutedRow::to_batch(&executed).map_err(|e| StageError::internal(e.to_string()))?,
        );
        Ok(())
    }
}

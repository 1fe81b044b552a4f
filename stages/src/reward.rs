//! The reward stage: scores each executed sample with its environment's rubric (task logic
//! and reward logic stay apart: the environment parses the answer, the rubric's weighted
//! reward functions score it) and emits `scored` with the total and every component.

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use streamrl_envs::rubric::ScoreInput;
use streamrl_envs::{Mix, Problem};
use streamrl_runtime::{Emitter, Input, Stage, StageError};
use streamrl_schemas::{ExecutedRow, RewardComponent, SchemaId, ScoredRow, TopicRow};

use crate::{Ctx, now_ms, rows};

/// Configuration of the reward stage.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {}

/// The reward stage.
#[derive(Debug)]
pub struct RewardStage {
    envs: Arc<Mix>,
    scored: String,
}

impl RewardStage {
    /// Builds the stage.
    pub fn build(_cfg: RewardConfig, ctx: Ctx) -> Result<Self, Vec<String>> {
        Ok(RewardStage {
            envs: ctx.require_envs()?,
            scored: ctx.require_output(SchemaId::Scored)?,
        })
    }
}

/// Scores one executed row with its environment's rubric.
pub fn score(envs: &Mix, r: ExecutedRow) -> Result<ScoredRow, String> {
    let env = envs.get(&r.env).ok_or_else(|| {
        format!(
            "sample {} names environment `{}`, which is not configured",
            r.sample_id, r.env
        )
    })?;
    let info = match &r.info {
        Some(s) => serde_json::from_str(s).map_err(|e| format!("sample {}: info is not JSON: {e}", r.sample_id))?,
        None => serde_json::Value::Null,
    };
    let problem = Problem {
        id: r.problem_id.clone(),
        env: r.env.clone(),
        question: r.prompt.clone(),
        answer: r.answer.clone(),
        info,
    };
    let parsed = env.parse_answer(&r.completion);
    let s = env.rubric().score(&ScoreInput {
        problem: &problem,
        completion: &r.completion,
        parsed: parsed.as_deref(),
    });
    Ok(ScoredRow {
        reward: s.reward,
        reward_components: s
            .components
            .into_iter()
            .map(|c| RewardComponent {
                name: c.name,
                value: c.value,
                weight: c.weight,
                reason: c.reason,
            })
            .collect(),
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
        tool_outputs: r.tool_outputs,
        exec_status: r.exec_status,
        exit_code: r.exit_code,
        stdout: r.stdout,
        stderr: r.stderr,
        exec_duration_ms: r.exec_duration_ms,
        tests_passed: r.tests_passed,
        tests_total: r.tests_total,
        created_at: now_ms(),
    })
}

#[async_trait]
impl Stage for RewardStage {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        let scored = rows::<ExecutedRow>(&input.batch)?
            .into_iter()
            .map(|r| score(&self.envs, r))
            .collect::<Result<Vec<_>, _>>()
            .map_err(StageError::user)?;
        out.emit(
            self.scored.clone(),
            ScoredRow::to_batch(&scored).map_err(|e| StageError::internal(e.to_string()))?,
        );
        Ok(())
    }
}

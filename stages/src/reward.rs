//! The reward stage: scores each executed sample with its environment's rubric (task logic
//! and reward logic stay apart: the environment parses the answer, the rubric's weighted
//! reward functions score it) and emits `scored` with the total and every component.

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use streamrl_envs::rubric::ScoreInput;
use streamrl_envs::{ExecInfo, Mix, Problem};
use streamrl_runtime::build::{BuildContext, BuildError, BuildStage, none_or_invalid};
use streamrl_runtime::{Emitter, Input, Stage, StageError};
use streamrl_schemas::{ExecutedRow, RewardComponent, SchemaId, ScoredRow, TopicRow, Validate, trajectory_into};

use crate::{Invalid, now_ms, rows};

/// Configuration of the reward stage.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {}

/// Nothing to check: the rubric is each environment's.
impl Validate for RewardConfig {
    fn problems(&self) -> Vec<Invalid> {
        Vec::new()
    }
}

/// The reward stage.
#[derive(Debug)]
pub struct RewardStage {
    envs: Arc<Mix>,
    scored: String,
}

impl BuildStage for RewardStage {
    type Config = RewardConfig;

    fn build(cfg: RewardConfig, ctx: &BuildContext) -> Result<Self, BuildError> {
        let mut errs = cfg.problems();
        let envs = crate::require_environments(ctx).map_err(|e| errs.extend(e));
        let scored = ctx.require_output(SchemaId::Scored).map_err(|e| errs.push(e));
        none_or_invalid(errs)?;
        Ok(RewardStage {
            envs: envs.expect("checked"),
            scored: scored.expect("checked"),
        })
    }
}

/// Scores one executed row with its environment's rubric.
pub fn score(envs: &Mix, mut r: ExecutedRow) -> Result<ScoredRow, String> {
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
    let exec = (r.exec_status != "skipped").then(|| ExecInfo {
        status: r.exec_status.clone(),
        tests_passed: r.tests_passed,
        tests_total: r.tests_total,
        stdout: r.stdout.clone(),
        stderr: r.stderr.clone(),
    });
    let s = env.rubric().score(&ScoreInput {
        problem: &problem,
        completion: &r.completion,
        parsed: parsed.as_deref(),
        exec: exec.as_ref(),
    });
    let reward_components = s
        .components
        .into_iter()
        .map(|c| RewardComponent {
            name: c.name,
            value: c.value,
            weight: c.weight,
            reason: c.reason,
        })
        .collect();
    let tool_outputs = std::mem::take(&mut r.tool_outputs);
    let (exec_status, stdout, stderr) = (
        std::mem::take(&mut r.exec_status),
        std::mem::take(&mut r.stdout),
        std::mem::take(&mut r.stderr),
    );
    let (exit_code, exec_duration_ms, tests_passed, tests_total) =
        (r.exit_code, r.exec_duration_ms, r.tests_passed, r.tests_total);
    Ok(trajectory_into!(
        r,
        ScoredRow {
            reward: s.reward,
            reward_components,
            tool_outputs,
            exec_status,
            exit_code,
            stdout,
            stderr,
            exec_duration_ms,
            tests_passed,
            tests_total,
            created_at: now_ms(),
        }
    ))
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

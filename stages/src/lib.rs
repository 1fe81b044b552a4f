//! The pipeline stages of streamrl's RL loop, one module per stage kind:
//!
//! | module | consumes | produces |
//! |---|---|---|
//! | [`source`] | policy (broadcast) | prompts, metrics |
//! | [`rollout`] | prompts, continuations, policy (broadcast) | rollouts, metrics |
//! | [`sandbox`] | rollouts | executed, continuations |
//! | [`reward`] | executed | scored |
//! | [`mask`] | scored | samples, metrics |
//! | [`trainer`] | samples | policy, metrics |
//!
//! They are one crate rather than six because they share the context every stage is
//! built from ([`BuildContext`]: run id, run directory, output topics, environments) and the
//! training core ([`train`]) that the trainer stage and `streamrl sft` both use; each
//! module has its config struct (documented fields, `problems()` listing every invalid
//! value) next to its logic.

pub mod eval;
pub mod gateways;
pub mod mask;
pub mod remote;
pub mod reward;
pub mod rollout;
pub mod sandbox;
pub mod source;
pub mod step_metrics;
pub mod train;
pub mod trainer;
pub mod weights;

use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;
pub use streamrl_envs::Invalid;
use streamrl_envs::{Environment, Mix};
use streamrl_runtime::StageError;
pub use streamrl_runtime::build::{BuildContext, BuildError, BusHandle, now_ms, parse_config};
use streamrl_schemas::{Problem, TopicRow};

/// The prompt text for the model: the environment's plain text with the built-in plain
/// template (character models, synthetic tasks), else its chat messages (system prompt,
/// few-shot turns, the question) rendered by the checkpoint's chat template with the
/// assistant's turn opened.
pub fn render_prompt(
    template: &streamrl_model::chat::ChatTemplate,
    p: &streamrl_envs::Prompt,
) -> streamrl_model::Result<String> {
    use streamrl_model::chat::{ChatMessage, ChatTemplate};
    match template {
        ChatTemplate::Plain => Ok(p.text.clone()),
        t => {
            let has_system = p.messages.iter().any(|m| m.role == "system");
            let system = p.system.iter().filter(|_| !has_system).map(|s| ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
            let msgs: Vec<ChatMessage> = system
                .chain(p.messages.iter().map(|m| ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                }))
                .collect();
            t.render(&msgs, true)
        }
    }
}

/// The tool call a turn's text ends in, as the schema's `ToolCall` (id `ROLLOUT-callTURN`,
/// arguments `{"code": ...}`).
pub fn tool_call(
    t: &streamrl_envs::ToolProtocol,
    rollout_id: &str,
    turn: u32,
    turn_text: &str,
) -> Option<streamrl_schemas::ToolCall> {
    let code = t.parse_call(turn_text)?;
    Some(streamrl_schemas::ToolCall {
        id: format!("{rollout_id}-call{turn}"),
        name: t.name.clone(),
        arguments: serde_json::json!({ "code": code }).to_string(),
    })
}

/// One entry of the topology's `envs:` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvDecl {
    /// Sampling weight in the mix.
    #[serde(default = "one")]
    weight: f64,
    /// The environment's own configuration.
    #[serde(default)]
    config: serde_json::Value,
    /// Worked examples (training problems with their reference completions) put before
    /// every prompt.
    #[serde(default)]
    few_shot: usize,
    /// A system prompt (replaces the environment's own, if it has one).
    #[serde(default)]
    system_prompt: Option<String>,
}

fn one() -> f64 {
    1.0
}

impl Default for EnvDecl {
    fn default() -> Self {
        EnvDecl {
            weight: one(),
            config: serde_json::Value::Null,
            few_shot: 0,
            system_prompt: None,
        }
    }
}

/// Builds one entry of a topology's `envs:` section (its weight, config, few-shot
/// examples and system prompt); problems carry the entry's key path (`envs.NAME...`).
pub fn build_env(name: &str, entry: &serde_yaml::Value) -> Result<(Box<dyn Environment>, f64), Vec<Problem>> {
    let path = format!("envs.{name}");
    let decl: EnvDecl = parse_config(entry).map_err(|ps| streamrl_schemas::problem::under(&path, ps))?;
    let env = streamrl_envs::build(name, &decl.config)
        .map_err(|ps| streamrl_schemas::problem::under(&format!("{path}.config"), ps))?;
    if decl.few_shot == 0 && decl.system_prompt.is_none() {
        return Ok((env, decl.weight));
    }
    let wrapped = streamrl_envs::prompted::Prompted::new(env, decl.few_shot, decl.system_prompt.clone())
        .map_err(|ps| streamrl_schemas::problem::under(&path, ps))?;
    Ok((Box::new(wrapped), decl.weight))
}

/// Builds the environments of a topology's `envs:` section (`None` when absent), reporting
/// every problem with its key path.
pub fn build_envs(envs: &serde_yaml::Value) -> Result<Option<Mix>, Vec<Problem>> {
    let Some(map) = envs.as_mapping() else {
        return if envs.is_null() {
            Ok(None)
        } else {
            Err(vec![Problem::new("envs", "expected a mapping")])
        };
    };
    let mut errs = Vec::new();
    let mut list: Vec<(Box<dyn Environment>, f64)> = Vec::new();
    for (k, v) in map {
        let name = k.as_str().unwrap_or_default().to_string();
        match build_env(&name, v) {
            Ok((env, weight)) => list.push((env, weight)),
            Err(es) => errs.extend(es),
        }
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    Mix::new(list)
        .map(Some)
        .map_err(|ps| streamrl_schemas::problem::under("envs", ps))
}

/// The environments of the topology a stage is built in (`None` when it has no `envs:`).
pub fn environments(ctx: &BuildContext) -> Result<Option<Arc<Mix>>, BuildError> {
    Ok(build_envs(&ctx.envs)?.map(Arc::new))
}

/// The environments of the topology a stage is built in; a problem when it has none.
pub fn require_environments(ctx: &BuildContext) -> Result<Arc<Mix>, Vec<Problem>> {
    build_envs(&ctx.envs)?.map(Arc::new).ok_or_else(|| {
        vec![Problem::whole(format!(
            "stage `{}` needs environments: add an `envs:` section to the topology",
            ctx.stage
        ))]
    })
}

/// Runs CPU-heavy work (a decode step, a gradient step) without starving the other stages
/// of a multi-threaded runtime: the worker thread hands its other tasks off first.
pub fn compute<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// A model error as a stage error that stops the stage (not the input's fault).
pub fn internal(what: &str, e: impl std::fmt::Display) -> StageError {
    StageError::internal(format!("{what}: {e}"))
}

/// Rows of `T` from an input, or a user error (dead-letter) naming the schema problem.
pub fn rows<T: TopicRow>(batch: &arrow::record_batch::RecordBatch) -> Result<Vec<T>, StageError> {
    T::from_batch(batch).map_err(|e| StageError::user(e.to_string()))
}

/// Path of a `file://` URI (or a plain path).
pub fn uri_path(uri: &str) -> PathBuf {
    PathBuf::from(uri.strip_prefix("file://").unwrap_or(uri))
}

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
//! built from ([`Ctx`]: run id, run directory, output topics, environments) and the
//! training core ([`train`]) that the trainer stage and `streamrl sft` both use; each
//! module has its config struct (documented fields, `problems()` listing every invalid
//! value) next to its logic.

pub mod eval;
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
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use streamrl_envs::{Environment, Mix};
use streamrl_runtime::StageError;
use streamrl_schemas::{MetricRow, SchemaId, TopicRow};

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

/// What every stage is built from besides its own config.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// Run id stamped on rows.
    pub run_id: String,
    /// Run directory (checkpoints live under it).
    pub run_dir: PathBuf,
    /// Stage name in the topology.
    pub stage: String,
    /// Replica index.
    pub replica: u32,
    /// Input topics with their schemas (not broadcast reads).
    pub inputs: Vec<(String, SchemaId)>,
    /// Output topics with their schemas.
    pub outputs: Vec<(String, SchemaId)>,
    /// The configured environments, when the topology has an `envs:` section.
    pub envs: Option<Arc<Mix>>,
    /// Whether the bus keeps what was published across a restart of this process (Kafka:
    /// true; the in-process memory bus: false, so a restarted run starts from empty topics
    /// and must re-admit and re-announce what was in flight).
    pub durable_bus: bool,
    /// The bus the stage runs on, for a stage that must see at start what a topic already
    /// holds (a restarted trainer: whether its newest version reached `policy`). `None`
    /// when a stage is driven outside the runtime (tests).
    pub bus: Option<BusHandle>,
}

/// A shared handle on the bus, printable in [`Ctx`]'s debug output.
#[derive(Clone)]
pub struct BusHandle(pub Arc<dyn streamrl_runtime::bus::Bus>);

impl std::fmt::Debug for BusHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bus({})", self.0.url())
    }
}

impl Ctx {
    /// `stage-replica`.
    pub fn instance(&self) -> String {
        format!("{}-{}", self.stage, self.replica)
    }

    /// Where this replica keeps the checkpoints it downloads: `<run_dir>/weights/<instance>`.
    pub fn weights_cache(&self) -> PathBuf {
        self.run_dir.join("weights").join(self.instance())
    }

    /// The output topic carrying `schema`, if the stage has one.
    pub fn output(&self, schema: SchemaId) -> Option<String> {
        self.outputs.iter().find(|(_, s)| *s == schema).map(|(n, _)| n.clone())
    }

    /// The output topic carrying `schema`; an error naming the stage when missing.
    pub fn require_output(&self, schema: SchemaId) -> Result<String, Vec<String>> {
        self.output(schema).ok_or_else(|| {
            vec![format!(
                "stage `{}` needs an output topic of schema `{schema}`",
                self.stage
            )]
        })
    }

    /// The environments; an error when the topology has none.
    pub fn require_envs(&self) -> Result<Arc<Mix>, Vec<String>> {
        self.envs.clone().ok_or_else(|| {
            vec![format!(
                "stage `{}` needs environments: add an `envs:` section to the topology",
                self.stage
            )]
        })
    }

    /// This replica's OpenTelemetry instruments.
    pub fn instruments(&self) -> streamrl_runtime::instruments::Instruments {
        streamrl_runtime::instruments::Instruments::new(&self.stage, self.replica)
    }

    /// Metric rows for the `metrics` output (empty when the stage has none). Each value
    /// also goes to the `streamrl.stage.value` gauge, for an OpenTelemetry backend.
    pub fn metrics(&self, step: u64, values: &[(&str, f64)]) -> Option<(String, arrow::record_batch::RecordBatch)> {
        let instruments = self.instruments();
        for (name, value) in values {
            instruments.value(name, *value);
        }
        let topic = self.output(SchemaId::Metrics)?;
        let now = now_ms();
        let rows: Vec<MetricRow> = values
            .iter()
            .map(|(name, value)| MetricRow {
                run_id: self.run_id.clone(),
                step,
                stage: self.stage.clone(),
                name: name.to_string(),
                value: *value,
                created_at: now,
            })
            .collect();
        MetricRow::to_batch(&rows).ok().map(|b| (topic, b))
    }
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

/// Builds one entry of a topology's `envs:` section (its weight, config, few-shot
/// examples and system prompt); errors carry the entry's key path.
pub fn build_env(name: &str, entry: &serde_yaml::Value) -> Result<(Box<dyn Environment>, f64), Vec<String>> {
    let decl: EnvDecl = serde_yaml::from_value(if entry.is_null() {
        serde_yaml::Value::Mapping(Default::default())
    } else {
        entry.clone()
    })
    .map_err(|e| vec![format!("envs.{name}: {e}")])?;
    let env = streamrl_envs::build(name, &decl.config).map_err(|es| {
        es.into_iter()
            .map(|e| format!("envs.{name}.config: {e}"))
            .collect::<Vec<_>>()
    })?;
    if decl.few_shot == 0 && decl.system_prompt.is_none() {
        return Ok((env, decl.weight));
    }
    let wrapped = streamrl_envs::prompted::Prompted::new(env, decl.few_shot, decl.system_prompt.clone())
        .map_err(|es| es.into_iter().map(|e| format!("envs.{name}: {e}")).collect::<Vec<_>>())?;
    Ok((Box::new(wrapped), decl.weight))
}

/// Builds the environments of a topology's `envs:` section (`None` when absent), reporting
/// every problem with its key path.
pub fn build_envs(envs: &serde_yaml::Value) -> Result<Option<Mix>, Vec<String>> {
    let Some(map) = envs.as_mapping() else {
        return if envs.is_null() {
            Ok(None)
        } else {
            Err(vec!["envs: expected a mapping".into()])
        };
    };
    let mut errs = Vec::new();
    let mut list: Vec<(Box<dyn Environment>, f64)> = Vec::new();
    for (k, v) in map {
        let name = k.as_str().unwrap_or_default().to_string();
        let built = build_env(&name, v);
        match built {
            Ok((env, weight)) => list.push((env, weight)),
            Err(es) => errs.extend(es),
        }
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    Mix::new(list)
        .map(Some)
        .map_err(|es| es.into_iter().map(|e| format!("envs: {e}")).collect())
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Runs CPU-heavy work (a decode step, a gradient step) without starving the other stages
/// of a multi-threaded runtime: the worker thread hands its other tasks off first.
pub fn compute<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// A stage config from its YAML block (`null`: defaults), every problem reported.
pub fn parse_config<T: serde::de::DeserializeOwned + Default>(v: &serde_yaml::Value) -> Result<T, Vec<String>> {
    if v.is_null() {
        Ok(T::default())
    } else {
        serde_yaml::from_value(v.clone()).map_err(|e| vec![e.to_string()])
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

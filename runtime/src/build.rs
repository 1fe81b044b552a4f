//! Building a stage from its topology entry (Arroyo's operator constructors): each stage
//! kind is a type implementing [`BuildStage`], which names its config struct (whose
//! [`Validate::problems`] lists every problem of a parsed config, run by `validate` before
//! anything starts) and builds a replica from the config and a [`BuildContext`] (the run,
//! the replica, its topics and the bus). The binary's registry is then one line per kind.
//!
//! ```
//! use streamrl_runtime::build::{BuildContext, BuildError, BuildStage, check, parse_config};
//! use streamrl_runtime::{Emitter, Input, Stage, StageError};
//! use streamrl_schemas::{Problem, SchemaId, Validate};
//!
//! /// Passes its input on, `times` times.
//! struct Repeat { times: usize, to: String }
//!
//! #[derive(serde::Deserialize, Default)]
//! #[serde(deny_unknown_fields, default)]
//! struct RepeatConfig { times: usize }
//!
//! impl Validate for RepeatConfig {
//!     fn problems(&self) -> Vec<Problem> {
//!         if self.times == 0 { vec![Problem::new("times", "must be at least 1")] } else { vec![] }
//!     }
//! }
//!
//! #[async_trait::async_trait]
//! impl Stage for Repeat {
//!     async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
//!         for _ in 0..self.times { out.emit(self.to.clone(), input.batch.clone()); }
//!         Ok(())
//!     }
//! }
//!
//! impl BuildStage for Repeat {
//!     type Config = RepeatConfig;
//!     fn build(c: RepeatConfig, ctx: &BuildContext) -> Result<Self, BuildError> {
//!         let to = ctx.checked_output(&c, SchemaId::Metrics)?;
//!         Ok(Repeat { times: c.times, to })
//!     }
//! }
//!
//! let bad: serde_yaml::Value = serde_yaml::from_str("{ times: 0, tims: 2 }").unwrap();
//! let problems = check::<Repeat>(&bad);
//! assert_eq!(problems[0].to_string(), "tims: unknown field `tims`, expected `times`");
//! let zero: serde_yaml::Value = serde_yaml::from_str("{ times: 0 }").unwrap();
//! assert_eq!(check::<Repeat>(&zero)[0].to_string(), "times: must be at least 1");
//! let cfg: RepeatConfig = parse_config(&serde_yaml::Value::Null).unwrap();
//! let err = Repeat::build(cfg, &BuildContext::new("repeat", 0)).err().unwrap().to_string();
//! assert!(err.contains("times: must be at least 1"), "{err}");
//! assert!(err.contains("needs an output topic of schema `metrics`"), "{err}");
//! ```

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_yaml::Value;
use streamrl_schemas::{MetricRow, Problem, SchemaId, TopicRow, Validate};

use crate::Stage;
use crate::bus::Bus;

/// A stage kind that can be built from its topology entry.
pub trait BuildStage: Stage + Sized + 'static {
    /// The `config:` block of the stage's topology entry (`null`: the default); its
    /// [`Validate::problems`] lists every invalid value, with key paths relative to the
    /// block. Checks that need more than the config (files, the environments, the topics)
    /// belong in [`BuildStage::build`].
    type Config: DeserializeOwned + Default + Validate;

    /// Builds one replica (expensive set-up, e.g. loading a checkpoint, happens here, once).
    /// Reports every problem of the config together with those only it can
    /// see (a missing output topic, no environments), before any set-up: it is the one
    /// place a config is checked on the way to a running stage.
    fn build(config: Self::Config, ctx: &BuildContext) -> Result<Self, BuildError>;
}

/// Why a stage could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The configuration (or what it names) is invalid; every problem, with key paths
    /// relative to the stage's `config:` block (or the topology's `envs:`, where it says so).
    #[error("{}", streamrl_schemas::problem::list(.0))]
    Invalid(Vec<Problem>),
    /// Set-up failed for a reason outside the configuration (a file that does not load, a
    /// bus that does not answer).
    #[error("{what}: {reason}")]
    Setup {
        /// What was being set up.
        what: String,
        /// What went wrong.
        reason: String,
    },
}

impl BuildError {
    /// A set-up failure.
    pub fn setup(what: impl Into<String>, reason: impl fmt::Display) -> Self {
        BuildError::Setup {
            what: what.into(),
            reason: reason.to_string(),
        }
    }

    /// One invalid value.
    pub fn invalid(path: impl Into<String>, message: impl Into<String>) -> Self {
        BuildError::Invalid(vec![Problem::new(path, message)])
    }
}

impl From<Vec<Problem>> for BuildError {
    fn from(p: Vec<Problem>) -> Self {
        BuildError::Invalid(p)
    }
}

impl From<Problem> for BuildError {
    fn from(p: Problem) -> Self {
        BuildError::Invalid(vec![p])
    }
}

/// `Err` with every problem of `problems`, `Ok` when there is none.
pub fn none_or_invalid(problems: Vec<Problem>) -> Result<(), BuildError> {
    if problems.is_empty() {
        Ok(())
    } else {
        Err(BuildError::Invalid(problems))
    }
}

/// A stage config from its YAML block (`null`: defaults); a value that does not fit the
/// struct is a problem at the key path where it was found.
pub fn parse_config<T: DeserializeOwned + Default>(v: &Value) -> Result<T, Vec<Problem>> {
    if v.is_null() {
        return Ok(T::default());
    }
    serde_path_to_error::deserialize::<_, T>(v.clone()).map_err(|e| vec![streamrl_schemas::problem::from_serde(e)])
}

/// Every problem of a kind's config block: how it parses, then [`Validate::problems`].
pub fn check<S: BuildStage>(config: &Value) -> Vec<Problem> {
    match parse_config::<S::Config>(config) {
        Ok(c) => c.problems(),
        Err(p) => p,
    }
}

/// Parses and builds one replica of `S` from its config block ([`BuildStage::build`]
/// checks it).
pub fn build<S: BuildStage>(config: &Value, ctx: &BuildContext) -> Result<Box<dyn Stage>, BuildError> {
    Ok(Box::new(S::build(parse_config::<S::Config>(config)?, ctx)?))
}

/// What every stage is built from besides its own config.
#[derive(Debug, Clone)]
pub struct BuildContext {
    /// Run id stamped on rows.
    pub run_id: String,
    /// Run directory (checkpoints, the archive).
    pub run_dir: PathBuf,
    /// Stage name in the topology.
    pub stage: String,
    /// Replica index.
    pub replica: u32,
    /// Input topics with their schemas (not broadcast reads).
    pub inputs: Vec<(String, SchemaId)>,
    /// Output topics with their schemas.
    pub outputs: Vec<(String, SchemaId)>,
    /// The topology's `envs:` section (`null`: none), built by the stages that need
    /// environments.
    pub envs: Value,
    /// Whether the bus keeps what was published across a restart of this process (Kafka:
    /// true; the in-process memory bus: false, so a restarted run starts from empty topics
    /// and must re-admit and re-announce what was in flight).
    pub durable_bus: bool,
    /// The bus the stage runs on, for a stage that must see at start what a topic already
    /// holds (a restarted trainer: whether its newest version reached `policy`). `None`
    /// when a stage is driven outside the runtime (tests).
    pub bus: Option<BusHandle>,
}

/// A shared handle on the bus, printable in [`BuildContext`]'s debug output.
#[derive(Clone)]
pub struct BusHandle(pub Arc<dyn Bus>);

impl fmt::Debug for BusHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bus({})", self.0.url())
    }
}

impl BuildContext {
    /// A context for replica `replica` of `stage` in run `default` under `runs/default`,
    /// with no topics, no environments and no bus (fill in what a test needs).
    pub fn new(stage: impl Into<String>, replica: u32) -> Self {
        BuildContext {
            run_id: "default".into(),
            run_dir: PathBuf::from("runs/default"),
            stage: stage.into(),
            replica,
            inputs: Vec::new(),
            outputs: Vec::new(),
            envs: Value::Null,
            durable_bus: false,
            bus: None,
        }
    }

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

    /// The output topic carrying `schema`; a problem naming the stage when missing.
    pub fn require_output(&self, schema: SchemaId) -> Result<String, Problem> {
        self.output(schema).ok_or_else(|| {
            Problem::whole(format!(
                "stage `{}` needs an output topic of schema `{schema}`",
                self.stage
            ))
        })
    }

    /// The output topic carrying `schema`, once `config` is checked: every problem of the
    /// config and a missing output together (the start of most stages' `build`).
    pub fn checked_output(&self, config: &impl Validate, schema: SchemaId) -> Result<String, BuildError> {
        let mut problems = config.problems();
        match self.require_output(schema) {
            Ok(topic) if problems.is_empty() => Ok(topic),
            Ok(_) => Err(BuildError::Invalid(problems)),
            Err(missing) => {
                problems.push(missing);
                Err(BuildError::Invalid(problems))
            }
        }
    }

    /// This replica's OpenTelemetry instruments.
    pub fn instruments(&self) -> crate::instruments::Instruments {
        crate::instruments::Instruments::new(&self.stage, self.replica)
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

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

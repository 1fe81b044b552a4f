//! topology.yaml: the bus, the topics and the stages of a pipeline, compiled into a
//! validated [`Topology`] before anything runs. Every problem is reported at once, each
//! with the key path it is about (Vector's topology compiler).
//!
//! ```
//! use streamrl_runtime::topology::Topology;
//!
//! let yaml = r#"
//! bus: memory://
//! topics:
//!   scored:      { schema: scored, partitions: 2, key: group_id }
//!   samples:     { schema: sampels, partitions: 2 }
//!   dead_letter: { schema: dead_letter, partitions: 1 }
//! stages:
//!   mask: { kind: mask, inputs: [scored], outputs: [samples], replicas: 4 }
//! "#;
//! let errors = Topology::parse(yaml, &|_, _| vec![]).unwrap_err();
//! let text: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
//! assert!(text.iter().any(|e| e.starts_with("topics.samples.schema")));
//! assert!(text.iter().any(|e| e.starts_with("stages.mask.replicas")));
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::Deserialize;
use serde_yaml::Value;
use streamrl_schemas::SchemaId;

use crate::bus::TopicSpec;
use crate::runner::{RunnerConfig, TopicBinding};

/// One problem in a topology, with the key path it is about.
pub use streamrl_schemas::Problem;

/// The kinds of stage streamrl has. Adding a kind means adding a variant here and an arm
/// in the binary's exhaustive `match` that builds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StageKind {
    /// Samples problems from environments; emits one prompt message per group.
    Source,
    /// Generates completions with the policy.
    Rollout,
    /// Executes tool calls and unit tests in sandboxes.
    Sandbox,
    /// Scores executed rollouts with rubrics.
    Reward,
    /// Group advantages, difficulty filtering, loss masks.
    Mask,
    /// Gradient steps; publishes policy versions.
    Trainer,
    /// Writes every topic to Parquet.
    Archive,
}

impl StageKind {
    /// Kinds that hold the run's single sequence (group numbering, policy versions) and so
    /// run as exactly one replica.
    pub fn is_singleton(self) -> bool {
        matches!(self, StageKind::Source | StageKind::Trainer)
    }
}

/// What schemas a stage kind reads and writes.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    /// Schemas it may consume as a group member (`None`: any).
    pub inputs: Option<&'static [SchemaId]>,
    /// Schemas it may read as a broadcast.
    pub broadcast: &'static [SchemaId],
    /// Schemas it may emit.
    pub outputs: &'static [SchemaId],
}

impl StageKind {
    /// Every kind.
    pub const ALL: [StageKind; 7] = [
        StageKind::Source,
        StageKind::Rollout,
        StageKind::Sandbox,
        StageKind::Reward,
        StageKind::Mask,
        StageKind::Trainer,
        StageKind::Archive,
    ];

    /// Name as written in topology.yaml.
    pub fn name(self) -> &'static str {
        match self {
            StageKind::Source => "source",
            StageKind::Rollout => "rollout",
            StageKind::Sandbox => "sandbox",
            StageKind::Reward => "reward",
            StageKind::Mask => "mask",
            StageKind::Trainer => "trainer",
            StageKind::Archive => "archive",
        }
    }

    /// The name of the span a stage of this kind handles one message in (what it does to
    /// a trajectory): `admit`, `generate`, `execute`, `score`, `mask`, `train` (a group
    /// joins the trainer's buffer; each optimizer step is a `train-step` span of its own,
    /// linked to the groups it consumed), `archive`.
    pub fn span_name(self) -> &'static str {
        match self {
            StageKind::Source => "admit",
            StageKind::Rollout => "generate",
            StageKind::Sandbox => "execute",
            StageKind::Reward => "score",
            StageKind::Mask => "mask",
            StageKind::Trainer => "train",
            StageKind::Archive => "archive",
        }
    }

    /// The kind's port signature.
    pub fn ports(self) -> Ports {
        use SchemaId as S;
        match self {
            StageKind::Source => Ports {
                // Scored rows are the source's feedback (difficulty pools), not data.
                inputs: Some(&[S::Scored]),
                broadcast: &[S::Policy],
                outputs: &[S::Prompts, S::Metrics],
            },
            StageKind::Rollout => Ports {
                inputs: Some(&[S::Prompts, S::Continuations]),
                broadcast: &[S::Policy],
                outputs: &[S::Rollouts, S::Metrics],
            },
            StageKind::Sandbox => Ports {
                inputs: Some(&[S::Rollouts]),
                broadcast: &[],
                outputs: &[S::Executed, S::Continuations, S::Metrics],
            },
            StageKind::Reward => Ports {
                inputs: Some(&[S::Executed]),
                broadcast: &[],
                outputs: &[S::Scored, S::Metrics],
            },
            StageKind::Mask => Ports {
                inputs: Some(&[S::Scored]),
                broadcast: &[],
                outputs: &[S::Samples, S::Metrics],
            },
            StageKind::Trainer => Ports {
                inputs: Some(&[S::Samples]),
                broadcast: &[],
                outputs: &[S::Policy, S::Trained, S::Metrics],
            },
            StageKind::Archive => Ports {
                inputs: None,
                broadcast: &[],
                outputs: &[],
            },
        }
    }
}

impl fmt::Display for StageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for StageKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        StageKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            format!(
                "unknown stage kind `{s}` (known: {})",
                StageKind::ALL.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
            )
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTopic {
    schema: String,
    #[serde(default = "one")]
    partitions: u32,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    feedback: bool,
    #[serde(default)]
    max_unconsumed_bytes: Option<u64>,
}

fn one() -> u32 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStage {
    kind: String,
    #[serde(default)]
    inputs: Inputs,
    #[serde(default)]
    broadcast: Vec<String>,
    #[serde(default)]
    outputs: Vec<String>,
    #[serde(default = "one")]
    replicas: u32,
    #[serde(default)]
    config: Value,
}

#[derive(Deserialize, Default)]
#[serde(untagged)]
enum Inputs {
    #[default]
    None,
    Named(Vec<String>),
    All(String),
}

/// A declared topic.
#[derive(Debug, Clone, PartialEq)]
pub struct TopicDecl {
    /// Its schema.
    pub schema: SchemaId,
    /// Partitions.
    pub partitions: u32,
    /// Key column: rows are split by it and it picks the partition.
    pub key: Option<String>,
    /// A feedback edge (e.g. continuations): the one kind of cycle allowed.
    pub feedback: bool,
    /// Memory-bus backpressure bound.
    pub max_unconsumed_bytes: Option<u64>,
}

/// A declared stage.
#[derive(Debug, Clone, PartialEq)]
pub struct StageDecl {
    /// Its kind.
    pub kind: StageKind,
    /// Topics it consumes as a group.
    pub inputs: Vec<String>,
    /// Topics every replica reads whole.
    pub broadcast: Vec<String>,
    /// Topics it emits to.
    pub outputs: Vec<String>,
    /// Replica count.
    pub replicas: u32,
    /// Kind-specific configuration (validated by the kind).
    pub config: Value,
}

/// A validated pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    /// Bus URL.
    pub bus: String,
    /// Run id stamped on rows.
    pub run_id: String,
    /// Where the run writes (archive, checkpoints).
    pub run_dir: PathBuf,
    /// The dead-letter topic.
    pub dead_letter: String,
    /// Topics by name.
    pub topics: BTreeMap<String, TopicDecl>,
    /// Stages by name.
    pub stages: BTreeMap<String, StageDecl>,
    /// Environments by name (`envs:`), each `{weight, config}`; read by the stages that
    /// need them (source, rollout, sandbox, reward), which validate it. `Null` when absent.
    pub envs: Value,
    /// The supervised warm start `streamrl run` performs first (`sft:`), validated by the
    /// binary. `Null` when absent.
    pub sft: Value,
}

/// Validates a stage kind's `config` block; returns every problem, with key paths
/// relative to the block.
pub type ConfigCheck<'a> = &'a dyn Fn(StageKind, &Value) -> Vec<Problem>;

const TOP_KEYS: [&str; 8] = [
    "bus",
    "run_id",
    "run_dir",
    "dead_letter",
    "envs",
    "sft",
    "topics",
    "stages",
];

/// Parses YAML text into a document (not yet validated).
fn document(yaml: &str) -> Result<Value, Vec<Problem>> {
    serde_yaml::from_str(yaml).map_err(|e| {
        vec![Problem {
            path: "(document)".into(),
            message: format!("not valid YAML: {e}"),
        }]
    })
}

/// Reads a topology file and applies `overrides` to it ([`apply_overrides`]): the
/// document every command sees, before validation. `streamrl sft` reads its `sft:`
/// section from it too.
pub fn read_document(path: &std::path::Path, overrides: &[String]) -> Result<Value, Vec<Problem>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        vec![Problem {
            path: path.display().to_string(),
            message: format!("cannot read: {e}"),
        }]
    })?;
    let mut root = document(&text)?;
    apply_overrides(&mut root, overrides)?;
    Ok(root)
}

/// Sets values in a topology document from `KEY.PATH=VALUE` strings (`--set`, or the
/// `STREAMRL_SET` environment variable, one per line), as a deployment changes a few
/// fields of the same file (compose.yaml serves weights over HTTP this way):
/// `stages.trainer.config.lr.lr=3e-4`, `stages.rollout.replicas=4`,
/// `stages.rollout.config.stop=["\n"]`. `VALUE` is read as YAML (a number, a bool, a list, a
/// string); mappings along the path are created when missing. Blank lines are skipped.
/// Every malformed override is reported, each with its path.
///
/// ```
/// let mut doc: serde_yaml::Value = serde_yaml::from_str("stages: { trainer: { kind: trainer } }").unwrap();
/// streamrl_runtime::topology::apply_overrides(&mut doc, &["stages.trainer.config.max_steps=20".into()]).unwrap();
/// assert_eq!(doc["stages"]["trainer"]["config"]["max_steps"].as_u64(), Some(20));
/// ```
pub fn apply_overrides(root: &mut Value, overrides: &[String]) -> Result<(), Vec<Problem>> {
    let mut errs = Vec::new();
    for o in overrides.iter().map(|o| o.trim()).filter(|o| !o.is_empty()) {
        let fail = |message: String| Problem {
            path: format!("--set {o}"),
            message,
        };
        let Some((path, value)) = o.split_once('=') else {
            errs.push(fail("expected KEY.PATH=VALUE".into()));
            continue;
        };
        let keys: Vec<&str> = path.trim().split('.').collect();
        if keys.iter().any(|k| k.is_empty()) {
            errs.push(fail(format!("`{}` is not a dotted key path", path.trim())));
            continue;
        }
        let value: Value = match serde_yaml::from_str(value.trim()) {
            Ok(v) => v,
            Err(e) => {
                errs.push(fail(format!("the value is not valid YAML: {e}")));
                continue;
            }
        };
        if let Err(m) = set_path(root, &keys, 0, value) {
            errs.push(fail(m));
        }
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}

/// Sets `keys[depth..]` below `at` (the value at `keys[..depth]`) to `value`, creating
/// mappings where a key is missing or null.
fn set_path(at: &mut Value, keys: &[&str], depth: usize, value: Value) -> Result<(), String> {
    if at.is_null() {
        *at = Value::Mapping(Default::default());
    }
    let Some(m) = at.as_mapping_mut() else {
        let walked = if depth == 0 {
            "(document)".into()
        } else {
            keys[..depth].join(".")
        };
        return Err(format!("`{walked}` is not a mapping"));
    };
    let key = Value::String(keys[depth].to_string());
    if depth + 1 == keys.len() {
        m.insert(key, value);
        return Ok(());
    }
    set_path(m.entry(key).or_insert(Value::Null), keys, depth + 1, value)
}

impl Topology {
    /// Parses and validates YAML, collecting every problem.
    pub fn parse(yaml: &str, check_config: ConfigCheck<'_>) -> Result<Topology, Vec<Problem>> {
        Self::from_document(document(yaml)?, check_config)
    }

    /// Validates a parsed document (e.g. [`read_document`]'s, overrides applied) in
    /// passes (top-level keys, the bus, topics, the dead-letter topic, each stage with its
    /// ports, replicas and config, `envs:`, cycles), collecting every problem.
    pub fn from_document(root: Value, check_config: ConfigCheck<'_>) -> Result<Topology, Vec<Problem>> {
        let Some(root) = root.as_mapping() else {
            return Err(vec![Problem::new("(document)", "expected a mapping at the top level")]);
        };
        let mut errs = check_keys(root);
        let get_str = |k: &str| root.get(k).and_then(Value::as_str).map(str::to_string);
        let bus = get_str("bus").unwrap_or_else(|| "memory://".into());
        if let Err(e) = crate::bus::scheme(&bus) {
            errs.push(Problem::new("bus", e.to_string()));
        }
        let run_id = get_str("run_id").unwrap_or_else(|| "default".into());
        let run_dir = PathBuf::from(get_str("run_dir").unwrap_or_else(|| format!("runs/{run_id}")));
        let dead_letter = get_str("dead_letter").unwrap_or_else(|| "dead_letter".into());
        let topics = compile_topics(root.get("topics"), &mut errs);
        errs.extend(check_dead_letter(&topics, &dead_letter));
        let mut stages = BTreeMap::new();
        for (name, v) in root.get("stages").and_then(Value::as_mapping).into_iter().flatten() {
            let name = key_str(name);
            let scope = Scope {
                path: format!("stages.{name}"),
                topics: &topics,
                dead_letter: &dead_letter,
            };
            if let Some(decl) = scope.compile_stage(v, check_config, &mut errs) {
                stages.insert(name, decl);
            }
        }
        let envs = root.get("envs").cloned().unwrap_or(Value::Null);
        if !(envs.is_null() || envs.is_mapping()) {
            errs.push(Problem::new(
                "envs",
                "expected a mapping of environment name to {weight, config}",
            ));
        }
        let topo = Topology {
            bus,
            run_id,
            run_dir,
            dead_letter,
            topics,
            stages,
            envs,
            sft: root.get("sft").cloned().unwrap_or(Value::Null),
        };
        errs.extend(topo.check_cycles());
        if errs.is_empty() { Ok(topo) } else { Err(errs) }
    }

    /// Reads and validates a file.
    pub fn load(path: &std::path::Path, check_config: ConfigCheck<'_>) -> Result<Topology, Vec<Problem>> {
        Self::load_with(path, &[], check_config)
    }

    /// Reads a file, applies `overrides` ([`apply_overrides`]) and validates the result.
    pub fn load_with(
        path: &std::path::Path,
        overrides: &[String],
        check_config: ConfigCheck<'_>,
    ) -> Result<Topology, Vec<Problem>> {
        Self::from_document(read_document(path, overrides)?, check_config)
    }

    /// Legal but suspicious wiring: a topic a stage consumes that no stage emits to (fine
    /// when `streamrl replay` or an outside producer feeds it).
    pub fn warnings(&self) -> Vec<Problem> {
        let produced: BTreeSet<&String> = self.stages.values().flat_map(|s| &s.outputs).collect();
        let mut out = Vec::new();
        for (name, s) in &self.stages {
            if s.kind == StageKind::Archive {
                continue;
            }
            for (i, t) in s.inputs.iter().enumerate() {
                if self.topics.contains_key(t) && !produced.contains(t) {
                    out.push(Problem {
                        path: format!("stages.{name}.inputs[{i}]"),
                        message: format!(
                            "no stage emits to topic `{t}`: only replay or an outside producer can feed it"
                        ),
                    });
                }
            }
        }
        out
    }

    /// Data edges (producer stage → consumer stage through a non-feedback topic) must form
    /// no cycle; broadcast reads (policy) are control, not data, and what a source reads
    /// (scored rows for its difficulty pools) is feedback by definition: the loop starts
    /// there.
    fn check_cycles(&self) -> Vec<Problem> {
        let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (p, ps) in &self.stages {
            for t in &ps.outputs {
                if self.topics.get(t).is_none_or(|d| d.feedback) {
                    continue;
                }
                for (c, cs) in &self.stages {
                    if !matches!(cs.kind, StageKind::Archive | StageKind::Source) && cs.inputs.contains(t) {
                        edges.entry(p.as_str()).or_default().insert(c.as_str());
                    }
                }
            }
        }
        // Depth-first search with colours; report each cycle once.
        let mut state: BTreeMap<&str, u8> = BTreeMap::new();
        let mut out = Vec::new();
        fn visit<'a>(
            n: &'a str,
            edges: &BTreeMap<&'a str, BTreeSet<&'a str>>,
            state: &mut BTreeMap<&'a str, u8>,
            stack: &mut Vec<&'a str>,
            out: &mut Vec<Problem>,
        ) {
            state.insert(n, 1);
            stack.push(n);
            for &m in edges.get(n).into_iter().flatten() {
                match state.get(m).copied().unwrap_or(0) {
                    0 => visit(m, edges, state, stack, out),
                    1 => {
                        let from = stack.iter().position(|&x| x == m).unwrap_or(0);
                        let mut cycle: Vec<&str> = stack[from..].to_vec();
                        cycle.push(m);
                        out.push(Problem {
                            path: format!("stages.{m}"),
                            message: format!(
                                "cycle {}: mark the topic that closes it as `feedback: true` if it is meant (like continuations)",
                                cycle.join(" → ")
                            ),
                        });
                    }
                    _ => {}
                }
            }
            stack.pop();
            state.insert(n, 2);
        }
        for n in self.stages.keys() {
            if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
                visit(n, &edges, &mut state, &mut Vec::new(), &mut out);
            }
        }
        out
    }

    /// Bus topic specs for every declared topic.
    pub fn topic_specs(&self) -> Vec<TopicSpec> {
        self.topics
            .iter()
            .map(|(n, t)| TopicSpec {
                name: n.clone(),
                partitions: t.partitions,
                max_unconsumed_bytes: t.max_unconsumed_bytes,
            })
            .collect()
    }

    /// The stages that read `topic` (each one consumer group), in name order.
    pub fn readers(&self, topic: &str) -> Vec<String> {
        self.stages
            .iter()
            .filter(|(_, s)| s.inputs.iter().any(|i| i == topic))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The runtime config of one replica of `stage`.
    pub fn runner_config(&self, stage: &str, replica: u32) -> Option<RunnerConfig> {
        let s = self.stages.get(stage)?;
        let bind = |t: &String| {
            self.topics.get(t).map(|d| TopicBinding {
                name: t.clone(),
                schema: d.schema,
                key: d.key.clone(),
            })
        };
        let mut cfg = RunnerConfig::new(stage, self.dead_letter.clone());
        cfg.replica = replica;
        cfg.inputs = s.inputs.iter().filter_map(bind).collect();
        cfg.broadcast = s.broadcast.iter().filter_map(bind).collect();
        cfg.outputs = s.outputs.iter().filter_map(bind).collect();
        cfg.state_dir = Some(self.run_dir.join("state"));
        cfg.span_name = s.kind.span_name().to_string();
        cfg.control = self
            .topics
            .iter()
            .find(|(_, d)| d.schema == SchemaId::Policy)
            .map(|(n, _)| n.clone());
        if s.kind == StageKind::Archive {
            cfg.drain_on_end = Some(std::time::Duration::from_secs(3));
        }
        Some(cfg)
    }

    /// A Mermaid flowchart of stages and topics.
    pub fn to_mermaid(&self) -> String {
        self.draw(&Notation {
            head: "flowchart LR\n",
            topic: |n, t| format!("  t_{n}[(\"{n}<br/>{} × {}\")]\n", t.schema, t.partitions),
            stage: |n, st| format!("  s_{n}[\"{n} ({}) × {}\"]\n", st.kind, st.replicas),
            edge: |n, t, edge| match edge {
                Edge::Input => format!("  t_{t} --> s_{n}\n"),
                Edge::Broadcast => format!("  t_{t} -. broadcast .-> s_{n}\n"),
                Edge::Output => format!("  s_{n} --> t_{t}\n"),
                Edge::Feedback => format!("  s_{n} -. feedback .-> t_{t}\n"),
            },
            tail: "",
        })
    }

    /// A Graphviz DOT graph of stages and topics.
    pub fn to_dot(&self) -> String {
        self.draw(&Notation {
            head: "digraph streamrl {\n  rankdir=LR;\n",
            topic: |n, t| {
                format!(
                    "  \"t:{n}\" [shape=cylinder,label=\"{n}\\n{} × {}\"];\n",
                    t.schema, t.partitions
                )
            },
            stage: |n, st| {
                format!(
                    "  \"s:{n}\" [shape=box,label=\"{n} ({}) × {}\"];\n",
                    st.kind, st.replicas
                )
            },
            edge: |n, t, edge| match edge {
                Edge::Input => format!("  \"t:{t}\" -> \"s:{n}\";\n"),
                Edge::Broadcast => format!("  \"t:{t}\" -> \"s:{n}\" [style=dashed,label=broadcast];\n"),
                Edge::Output => format!("  \"s:{n}\" -> \"t:{t}\";\n"),
                Edge::Feedback => format!("  \"s:{n}\" -> \"t:{t}\" [style=dashed,label=feedback];\n"),
            },
            tail: "}\n",
        })
    }

    /// The graph in `notation`: every topic node, then each stage's node followed by its edges.
    fn draw(&self, notation: &Notation) -> String {
        let mut s = String::from(notation.head);
        for (n, t) in &self.topics {
            s.push_str(&(notation.topic)(n, t));
        }
        for (n, st) in &self.stages {
            s.push_str(&(notation.stage)(n, st));
            for (t, edge) in self.edges_of(st) {
                s.push_str(&(notation.edge)(n, t, edge));
            }
        }
        s.push_str(notation.tail);
        s
    }

    /// A stage's edges in drawing order: its inputs, its broadcast topics, then its outputs
    /// (an output to a feedback topic is a [`Edge::Feedback`]).
    fn edges_of<'a>(&'a self, st: &'a StageDecl) -> impl Iterator<Item = (&'a str, Edge)> + 'a {
        let inputs = st.inputs.iter().map(|t| (t.as_str(), Edge::Input));
        let broadcast = st.broadcast.iter().map(|t| (t.as_str(), Edge::Broadcast));
        let outputs = st.outputs.iter().map(|t| {
            let feedback = self.topics.get(t).is_some_and(|d| d.feedback);
            (t.as_str(), if feedback { Edge::Feedback } else { Edge::Output })
        });
        inputs.chain(broadcast).chain(outputs)
    }
}

/// How one graph language writes a [`Topology`]: its lines, each ending in a newline.
struct Notation {
    /// Before the nodes.
    head: &'static str,
    /// A topic's node, from its name and declaration.
    topic: fn(&str, &TopicDecl) -> String,
    /// A stage's node, from its name and declaration.
    stage: fn(&str, &StageDecl) -> String,
    /// An edge between the stage and the topic named, of the kind given.
    edge: fn(&str, &str, Edge) -> String,
    /// After the edges.
    tail: &'static str,
}

/// An edge of the stage graph, as [`Topology::to_mermaid`] and [`Topology::to_dot`] draw it.
enum Edge {
    /// Topic → stage, consumed by the stage's group.
    Input,
    /// Topic → stage, read whole by every replica.
    Broadcast,
    /// Stage → topic.
    Output,
    /// Stage → a feedback topic (the one allowed cycle).
    Feedback,
}

/// Pass 1: every top-level key is one streamrl knows.
fn check_keys(root: &serde_yaml::Mapping) -> Vec<Problem> {
    root.keys()
        .map(key_str)
        .filter(|k| !TOP_KEYS.contains(&k.as_str()))
        .map(|k| {
            Problem::new(
                k.clone(),
                format!("unknown field `{k}` (known: {})", TOP_KEYS.join(", ")),
            )
        })
        .collect()
}

/// Pass 2: the `topics:` section, each topic's schema, partitions and key column.
fn compile_topics(section: Option<&Value>, errs: &mut Vec<Problem>) -> BTreeMap<String, TopicDecl> {
    if section.is_none() {
        errs.push(Problem::new(
            "topics",
            "missing: declare at least the dead-letter topic",
        ));
    }
    let mut topics = BTreeMap::new();
    for (name, v) in section.and_then(Value::as_mapping).into_iter().flatten() {
        let name = key_str(name);
        let path = format!("topics.{name}");
        let raw: RawTopic = match serde_yaml::from_value(v.clone()) {
            Ok(r) => r,
            Err(e) => {
                errs.push(Problem::new(path, e.to_string()));
                continue;
            }
        };
        let schema = match raw.schema.parse::<SchemaId>() {
            Ok(s) => s,
            Err(e) => {
                errs.push(Problem::new(format!("{path}.schema"), e.to_string()));
                continue;
            }
        };
        if raw.partitions == 0 {
            errs.push(Problem::new(format!("{path}.partitions"), "must be at least 1"));
        }
        if let Some(k) = &raw.key
            && schema.schema().field_with_name(k).is_err()
        {
            errs.push(Problem::new(
                format!("{path}.key"),
                format!("schema `{schema}` has no column `{k}`"),
            ));
        }
        topics.insert(
            name,
            TopicDecl {
                schema,
                partitions: raw.partitions,
                key: raw.key,
                feedback: raw.feedback,
                max_unconsumed_bytes: raw.max_unconsumed_bytes,
            },
        );
    }
    topics
}

/// Pass 3: the dead-letter topic is declared and carries `dead_letter`.
fn check_dead_letter(topics: &BTreeMap<String, TopicDecl>, dead_letter: &str) -> Option<Problem> {
    match topics.get(dead_letter) {
        Some(t) if t.schema != SchemaId::DeadLetter => Some(Problem::new(
            "dead_letter",
            format!("topic `{dead_letter}` carries schema `{}`, not `dead_letter`", t.schema),
        )),
        Some(_) => None,
        None => Some(Problem::new(
            "dead_letter",
            format!("topic `{dead_letter}` is not declared under topics"),
        )),
    }
}

/// Pass 4, one stage at a time: what a stage's checks see.
struct Scope<'a> {
    /// `stages.NAME`.
    path: String,
    topics: &'a BTreeMap<String, TopicDecl>,
    dead_letter: &'a str,
}

impl Scope<'_> {
    /// The stage's kind, topics, replicas and config, checked.
    fn compile_stage(&self, v: &Value, check_config: ConfigCheck<'_>, errs: &mut Vec<Problem>) -> Option<StageDecl> {
        let path = &self.path;
        let raw: RawStage = serde_yaml::from_value(v.clone())
            .map_err(|e| errs.push(Problem::new(path.clone(), e.to_string())))
            .ok()?;
        let kind = raw
            .kind
            .parse::<StageKind>()
            .map_err(|e| errs.push(Problem::new(format!("{path}.kind"), e)))
            .ok()?;
        let ports = kind.ports();
        let inputs = self.inputs(kind, raw.inputs, errs);
        self.check_ports(errs, kind, "inputs", &inputs, ports.inputs, "consumes");
        self.check_ports(
            errs,
            kind,
            "broadcast",
            &raw.broadcast,
            Some(ports.broadcast),
            "reads as broadcast",
        );
        self.check_ports(errs, kind, "outputs", &raw.outputs, Some(ports.outputs), "emits");
        self.check_replicas(errs, kind, raw.replicas, &inputs);
        errs.extend(streamrl_schemas::problem::under(
            &format!("{path}.config"),
            check_config(kind, &raw.config),
        ));
        Some(StageDecl {
            kind,
            inputs,
            broadcast: raw.broadcast,
            outputs: raw.outputs,
            replicas: raw.replicas,
            config: raw.config,
        })
    }

    /// The input topics, `all` expanded (every topic but the dead-letter one, which only
    /// the archive reads).
    fn inputs(&self, kind: StageKind, inputs: Inputs, errs: &mut Vec<Problem>) -> Vec<String> {
        match inputs {
            Inputs::None => Vec::new(),
            Inputs::Named(v) => v,
            Inputs::All(s) if s == "all" && kind.ports().inputs.is_none() => self
                .topics
                .keys()
                .filter(|t| **t != self.dead_letter || kind == StageKind::Archive)
                .cloned()
                .collect(),
            Inputs::All(s) => {
                errs.push(Problem::new(
                    format!("{}.inputs", self.path),
                    format!("expected a list of topics, got `{s}`"),
                ));
                Vec::new()
            }
        }
    }

    /// Each topic of `list` is declared and carries a schema the kind accepts there.
    fn check_ports(
        &self,
        errs: &mut Vec<Problem>,
        kind: StageKind,
        field: &str,
        list: &[String],
        allowed: Option<&[SchemaId]>,
        verb: &str,
    ) {
        for (i, t) in list.iter().enumerate() {
            let p = format!("{}.{field}[{i}]", self.path);
            let Some(decl) = self.topics.get(t) else {
                errs.push(Problem::new(p, format!("topic `{t}` is not declared under topics")));
                continue;
            };
            if let Some(allowed) = allowed
                && !allowed.contains(&decl.schema)
            {
                let accepted = if allowed.is_empty() {
                    "nothing here".to_string()
                } else {
                    allowed
                        .iter()
                        .map(|s| format!("`{s}`"))
                        .collect::<Vec<_>>()
                        .join(" or ")
                };
                errs.push(Problem::new(
                    p,
                    format!(
                        "topic `{t}` carries schema `{}`, but a `{kind}` stage {verb} {accepted}",
                        decl.schema
                    ),
                ));
            }
        }
    }

    /// At least one replica; one for a singleton kind; no more than an input has partitions.
    fn check_replicas(&self, errs: &mut Vec<Problem>, kind: StageKind, replicas: u32, inputs: &[String]) {
        let path = format!("{}.replicas", self.path);
        if replicas == 0 {
            errs.push(Problem::new(path.clone(), "must be at least 1"));
        }
        if replicas > 1 && kind.is_singleton() {
            let why = if kind == StageKind::Source {
                "each admit and number the same groups"
            } else {
                "each train and publish versions of their own"
            };
            errs.push(Problem::new(
                path.clone(),
                format!("a {kind} stage runs as one replica ({replicas} would {why}); set replicas: 1"),
            ));
        }
        for t in inputs {
            if let Some(decl) = self.topics.get(t)
                && replicas > decl.partitions
            {
                errs.push(Problem::new(
                    path.clone(),
                    format!(
                        "{replicas} replicas but input topic `{t}` has only {} partitions (replicas beyond that idle)",
                        decl.partitions
                    ),
                ));
            }
        }
    }
}

fn key_str(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other).unwrap_or_default().trim().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
bus: memory://
topics:
  prompts:       { schema: prompts, partitions: 2, key: group_id }
  rollouts:      { schema: rollouts, partitions: 2, key: group_id }
  continuations: { schema: continuations, partitions: 2, key: rollout_id, feedback: true }
  executed:      { schema: executed, partitions: 2, key: group_id }
  policy:        { schema: policy }
  dead_letter:   { schema: dead_letter }
stages:
  source:  { kind: source, outputs: [prompts], broadcast: [policy] }
  rollout: { kind: rollout, inputs: [prompts, continuations], broadcast: [policy], outputs: [rollouts], replicas: 2 }
  sandbox: { kind: sandbox, inputs: [rollouts], outputs: [executed, continuations], replicas: 2 }
  archive: { kind: archive, inputs: all }
"#;

    fn none(_: StageKind, _: &Value) -> Vec<Problem> {
        vec![]
    }

    #[test]
    fn a_feedback_cycle_is_allowed_and_all_expands() {
        let t = Topology::parse(GOOD, &none).unwrap();
        assert_eq!(t.stages["archive"].inputs.len(), 6);
        let cfg = t.runner_config("rollout", 1).unwrap();
        assert_eq!(cfg.instance(), "rollout-1");
        assert_eq!(cfg.inputs[1].key.as_deref(), Some("rollout_id"));
    }

    #[test]
    fn every_replica_learns_the_end_of_the_run_from_the_policy_topic() {
        let t = Topology::parse(GOOD, &none).unwrap();
        for (name, r) in [("source", 0), ("rollout", 1), ("sandbox", 0), ("archive", 0)] {
            let cfg = t.runner_config(name, r).unwrap();
            assert_eq!(cfg.control.as_deref(), Some("policy"), "{name}");
            assert_eq!(cfg.drain_on_end.is_some(), name == "archive", "{name}");
        }
    }

    #[test]
    fn overrides_set_nested_values_create_mappings_and_report_every_mistake() {
        let mut doc = document(GOOD).unwrap();
        apply_overrides(
            &mut doc,
            &[
                "stages.rollout.replicas=1".into(),
                "  stages.sandbox.config.pool.size = 4 ".into(),
                "".into(),
                "stages.source.config.stop=[\"\\n\", x]".into(),
                "bus=kafka://b:9092".into(),
            ],
        )
        .unwrap();
        assert_eq!(doc["stages"]["rollout"]["replicas"].as_u64(), Some(1));
        assert_eq!(doc["stages"]["sandbox"]["config"]["pool"]["size"].as_u64(), Some(4));
        assert_eq!(doc["stages"]["source"]["config"]["stop"][0].as_str(), Some("\n"));
        let t = Topology::from_document(doc, &none).unwrap();
        assert_eq!((t.stages["rollout"].replicas, t.bus.as_str()), (1, "kafka://b:9092"));

        let mut doc = document(GOOD).unwrap();
        let errs = apply_overrides(
            &mut doc,
            &[
                "stages.rollout.kind".into(),
                "stages..replicas=2".into(),
                "bus.url=x".into(),
                "stages.rollout.replicas=[1".into(),
            ],
        )
        .unwrap_err();
        let msgs: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(msgs.len(), 4, "{msgs:?}");
        assert!(
            msgs[0].starts_with("--set stages.rollout.kind: expected KEY.PATH=VALUE"),
            "{msgs:?}"
        );
        assert!(
            msgs[1].contains("`stages..replicas` is not a dotted key path"),
            "{msgs:?}"
        );
        assert!(msgs[2].contains("`bus` is not a mapping"), "{msgs:?}");
        assert!(msgs[3].contains("the value is not valid YAML"), "{msgs:?}");
        assert_eq!(
            doc["stages"]["rollout"]["replicas"].as_u64(),
            Some(2),
            "a failed override changes nothing"
        );
    }

    #[test]
    fn a_replicated_source_is_refused() {
        let yaml = GOOD.replace(
            "source:  { kind: source, outputs: [prompts], broadcast: [policy] }",
            "source:  { kind: source, outputs: [prompts], broadcast: [policy], replicas: 2 }",
        );
        let errs = Topology::parse(&yaml, &none).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "stages.source.replicas");
        assert!(errs[0].message.contains("runs as one replica"), "{}", errs[0]);
    }

    #[test]
    fn an_undeclared_cycle_is_refused() {
        let yaml = GOOD.replace(", feedback: true", "");
        let errs = Topology::parse(&yaml, &none).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].message.contains("rollout → sandbox → rollout"), "{}", errs[0]);
    }

    #[test]
    fn bus_urls_are_checked_against_the_schemes_connect_knows() {
        for (bus, want) in [
            ("redis://x", "unknown scheme `redis` (known: memory, kafka)"),
            ("localhost:9092", "expected scheme://"),
        ] {
            let yaml = format!("bus: {bus}\ntopics:\n  dead_letter: {{ schema: dead_letter }}\n");
            let errs = Topology::parse(&yaml, &none).unwrap_err();
            assert_eq!(errs.len(), 1, "{errs:?}");
            assert_eq!(errs[0].path, "bus");
            assert!(errs[0].message.contains(want), "{}", errs[0]);
        }
    }

    #[test]
    fn five_mistakes_are_all_reported_with_paths() {
        let yaml = r#"
bus: memory://
topics:
  prompts:     { schema: prompts, partitions: 2, key: group_id }
  rollouts:    { schema: executed, partitions: 2 }
  dead_letter: { schema: dead_letter }
stages:
  source:  { kind: sorce, outputs: [prompts] }
  rollout: { kind: rollout, inputs: [prompts], outputs: [rollouts, scoredd], replicas: 3 }
  reward:  { kind: reward, inputs: [rollouts], outputs: [], config: { weigth: 1 } }
"#;
        let check = |k: StageKind, v: &Value| -> Vec<Problem> {
            if k == StageKind::Reward && !v.is_null() {
                vec![Problem::whole("unknown field `weigth`")]
            } else {
                vec![]
            }
        };
        let errs = Topology::parse(yaml, &check).unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        for want in [
            "stages.source.kind",
            "stages.rollout.outputs[0]",
            "stages.rollout.outputs[1]",
            "stages.rollout.replicas",
            "stages.reward.config",
        ] {
            assert!(paths.contains(&want), "missing {want} in {errs:#?}");
        }
    }

    #[test]
    fn unknown_fields_name_the_field() {
        let yaml = "bus: memory://\nbsu: x\ntopics:\n  dead_letter: { schema: dead_letter, partitons: 2 }\n";
        let errs = Topology::parse(yaml, &none).unwrap_err();
        let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert!(text.iter().any(|e| e.starts_with("bsu:")), "{text:?}");
        assert!(
            text.iter()
                .any(|e| e.starts_with("topics.dead_letter:") && e.contains("partitons")),
            "{text:?}"
        );
    }
}

//! One module per verb of the `streamrl` command line (the `Command` enum in `main.rs`
//! names each), plus what several of them share: reading the topology file with the
//! invocation's `--set` overrides, and printing a replica's counters.

pub mod archive;
pub mod model;
pub mod pipeline;
pub mod sandbox;
pub mod serve;
pub mod soak;
pub mod train;
pub mod up;

use std::path::Path;
use std::sync::{Arc, OnceLock};

use anyhow::Result;
use streamrl_runtime::runner::StageMetrics;
use streamrl_runtime::topology::{Problem, Topology};

/// The `--set` overrides of this invocation, applied to every topology it reads.
static OVERRIDES: OnceLock<Vec<String>> = OnceLock::new();

/// Records this invocation's `--set` overrides (once, after the command line is parsed).
pub fn set_overrides(set: Vec<String>) {
    OVERRIDES.set(set).expect("set once");
}

/// [`OVERRIDES`] (none before the command line is parsed).
pub fn overrides() -> &'static [String] {
    OVERRIDES.get().map(Vec::as_slice).unwrap_or_default()
}

/// Every problem of the topology file at `path`, as one error.
fn problems(path: &Path, errs: Vec<Problem>) -> anyhow::Error {
    let mut msg = format!("{} has {} problem(s):", path.display(), errs.len());
    for e in &errs {
        msg.push_str(&format!("\n  {e}"));
    }
    anyhow::anyhow!(msg)
}

/// The topology document at `path` with this invocation's `--set` overrides, unvalidated
/// (for commands that read one section of it).
/// `--device` and `--dtype`: where a command's model runs and in what precision.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct Placement {
    /// Device: cpu, cuda or cuda:N (CUDA needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: streamrl_model::device::DeviceSpec,
    /// Precision: f32, or bf16 matrix products (on the CPU: its matrix units, weights kept f32; logits stay f32).
    #[arg(long, default_value = "f32")]
    pub dtype: streamrl_model::device::Precision,
}

impl Placement {
    /// Loads a checkpoint on this device in this dtype.
    pub fn load(&self, dir: &Path) -> Result<streamrl_model::checkpoint::Loaded> {
        let device = self.device.open()?;
        Ok(streamrl_model::checkpoint::load_in(dir, &device, self.dtype)?)
    }
}

pub fn read_document(path: &Path) -> Result<serde_yaml::Value> {
    streamrl_runtime::topology::read_document(path, overrides()).map_err(|errs| problems(path, errs))
}

/// The topology at `path`, validated in one pass: the runtime's checks (keys, topics,
/// stages, ports, cycles, stage configs) and the sections only this binary knows
/// (`envs:`, `sft:`), every problem reported at once.
pub fn load(path: &Path) -> Result<Topology> {
    let doc = read_document(path)?;
    let mut errs = Vec::new();
    let topology = Topology::from_document(doc.clone(), &crate::stages::check_config)
        .map_err(|es| errs.extend(es))
        .ok();
    // A malformed `envs:` is already reported by the runtime's pass.
    if doc.get("envs").is_none_or(|e| e.is_null() || e.is_mapping()) {
        errs.extend(crate::stages::check_envs(
            doc.get("envs").unwrap_or(&serde_yaml::Value::Null),
        ));
    }
    errs.extend(train::check_sft(&doc));
    match topology {
        Some(t) if errs.is_empty() => Ok(t),
        _ => Err(problems(path, errs)),
    }
}

/// [`load`], with the bus URL overridden when one is given.
pub fn load_on(path: &Path, bus: Option<String>) -> Result<Topology> {
    let mut t = load(path)?;
    if let Some(b) = bus {
        t.bus = b;
    }
    Ok(t)
}

/// [`load_on`], then the topology's SFT warm start when it has one and its output is
/// missing (`run` and `up` both start this way).
pub fn load_and_warm_start(path: &Path, bus: Option<String>) -> Result<Topology> {
    let t = load_on(path, bus)?;
    tokio::task::block_in_place(|| train::sft_from_topology(&t.sft, path))?;
    Ok(t)
}

/// Prints each replica's counters as one table on stderr.
pub fn print_metrics(all: &[(String, Arc<StageMetrics>)]) {
    eprintln!(
        "{:<16} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7} {:>10}",
        "stage", "in_msgs", "in_rows", "out_msgs", "out_rows", "errors", "dead", "proc_ms"
    );
    for (name, m) in all {
        let s: std::collections::HashMap<_, _> = m.snapshot().into_iter().collect();
        eprintln!(
            "{:<16} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7} {:>10}",
            name,
            s["in_messages"],
            s["in_rows"],
            s["out_messages"],
            s["out_rows"],
            s["errors"],
            s["dead_lettered"],
            s["processing_ms"]
        );
    }
}

//! Building stages from the topology: one exhaustive `match` on the stage kind, so a kind
//! that is declared but not wired does not compile.

use anyhow::{Result, anyhow};
use serde_yaml::Value;
use streamrl_archive::{ArchiveConfig, ArchiveStage};
use streamrl_runtime::Stage;
use streamrl_runtime::topology::{StageKind, Topology};

/// Whether this build has an implementation of `kind`.
pub fn is_built(kind: StageKind) -> bool {
    match kind {
        StageKind::Archive => true,
        StageKind::Source
        | StageKind::Rollout
        | StageKind::Sandbox
        | StageKind::Reward
        | StageKind::Mask
        | StageKind::Trainer => false,
    }
}

/// Stage names of the topology whose kind this build lacks.
pub fn unbuilt(t: &Topology) -> Vec<String> {
    t.stages
        .iter()
        .filter(|(_, s)| !is_built(s.kind))
        .map(|(n, s)| format!("{n} ({})", s.kind))
        .collect()
}

/// Validates a kind's `config` block, reporting every problem.
pub fn check_config(kind: StageKind, config: &Value) -> Vec<String> {
    match kind {
        StageKind::Archive => match parse::<ArchiveConfig>(config) {
            Ok(c) => c.problems(),
            Err(e) => vec![e],
        },
        StageKind::Source
        | StageKind::Rollout
        | StageKind::Sandbox
        | StageKind::Reward
        | StageKind::Mask
        | StageKind::Trainer => match config {
            Value::Null => vec![],
            Value::Mapping(m) if m.is_empty() => vec![],
            _ => vec![format!("stage kind `{kind}` has no configuration fields in this build")],
        },
    }
}

fn parse<T: serde::de::DeserializeOwned + Default>(v: &Value) -> std::result::Result<T, String> {
    if v.is_null() {
        Ok(T::default())
    } else {
        serde_yaml::from_value(v.clone()).map_err(|e| e.to_string())
    }
}

/// Builds replica `replica` of stage `name` (expensive setup happens here, once).
pub fn build(t: &Topology, name: &str, replica: u32) -> Result<Box<dyn Stage>> {
    let decl = t.stages.get(name).ok_or_else(|| anyhow!("no stage `{name}`"))?;
    let instance = format!("{name}-{replica}");
    match decl.kind {
        StageKind::Archive => {
            let cfg: ArchiveConfig = parse(&decl.config).map_err(|e| anyhow!("stages.{name}.config: {e}"))?;
            let stage = ArchiveStage::build(cfg, &t.run_dir, &instance)
                .map_err(|p| anyhow!("stages.{name}.config: {}", p.join("; ")))?;
            Ok(Box::new(stage))
        }
        kind @ (StageKind::Source
        | StageKind::Rollout
        | StageKind::Sandbox
        | StageKind::Reward
        | StageKind::Mask
        | StageKind::Trainer) => Err(anyhow!(
            "stage `{name}`: kind `{kind}` is not implemented in this build yet"
        )),
    }
}

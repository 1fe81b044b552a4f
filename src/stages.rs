//! Building stages from the topology: one exhaustive `match` on the stage kind, so a kind
//! that is declared but not wired does not compile.

use std::sync::Arc;

use anyhow::{Result, anyhow};
use serde_yaml::Value;
use streamrl_archive::{ArchiveConfig, ArchiveStage};
use streamrl_runtime::Stage;
use streamrl_runtime::bus::Bus;
use streamrl_runtime::topology::{StageKind, Topology};
use streamrl_stages::mask::{MaskConfig, MaskStage};
use streamrl_stages::reward::{RewardConfig, RewardStage};
use streamrl_stages::rollout::{RolloutConfig, RolloutStage};
use streamrl_stages::sandbox::{SandboxConfig, SandboxStage};
use streamrl_stages::source::{SourceConfig, SourceStage};
use streamrl_stages::trainer::{TrainerConfig, TrainerStage};
use streamrl_stages::{Ctx, parse_config};

fn problems<T: serde::de::DeserializeOwned + Default>(
    config: &Value,
    check: impl Fn(&T) -> Vec<String>,
) -> Vec<String> {
    match parse_config::<T>(config) {
        Ok(c) => check(&c),
        Err(e) => e,
    }
}

/// Validates a kind's `config` block, reporting every problem.
pub fn check_config(kind: StageKind, config: &Value) -> Vec<String> {
    match kind {
        StageKind::Archive => problems::<ArchiveConfig>(config, ArchiveConfig::problems),
        StageKind::Source => problems::<SourceConfig>(config, SourceConfig::problems),
        StageKind::Rollout => problems::<RolloutConfig>(config, RolloutConfig::problems),
        StageKind::Sandbox => problems::<SandboxConfig>(config, |c| c.problems()),
        StageKind::Reward => problems::<RewardConfig>(config, |_| vec![]),
        StageKind::Mask => problems::<MaskConfig>(config, MaskConfig::problems),
        StageKind::Trainer => problems::<TrainerConfig>(config, TrainerConfig::problems),
    }
}

/// Problems of the topology's `envs:` section.
pub fn check_envs(envs: &Value) -> Vec<String> {
    streamrl_stages::build_envs(envs).err().unwrap_or_default()
}

/// Whether the topology's bus keeps its topics across a restart of this process (every
/// backend but the in-process `memory://`).
fn durable_bus(t: &Topology) -> bool {
    !t.bus.starts_with("memory://")
}

/// Builds replica `replica` of stage `name` (expensive setup happens here, once).
pub fn build(t: &Topology, bus: &Arc<dyn Bus>, name: &str, replica: u32) -> Result<Box<dyn Stage>> {
    let decl = t.stages.get(name).ok_or_else(|| anyhow!("no stage `{name}`"))?;
    let instance = format!("{name}-{replica}");
    let fail = |p: Vec<String>| anyhow!("stages.{name}.config: {}", p.join("; "));
    let ctx = || -> Result<Ctx> {
        let envs = streamrl_stages::build_envs(&t.envs).map_err(|p| anyhow!("{}", p.join("; ")))?;
        Ok(Ctx {
            run_id: t.run_id.clone(),
            run_dir: t.run_dir.clone(),
            stage: name.to_string(),
            replica,
            inputs: decl
                .inputs
                .iter()
                .filter_map(|o| t.topics.get(o).map(|d| (o.clone(), d.schema)))
                .collect(),
            outputs: decl
                .outputs
                .iter()
                .filter_map(|o| t.topics.get(o).map(|d| (o.clone(), d.schema)))
                .collect(),
            envs: envs.map(Arc::new),
            durable_bus: durable_bus(t),
            bus: Some(streamrl_stages::BusHandle(bus.clone())),
        })
    };
    Ok(match decl.kind {
        StageKind::Archive => {
            let cfg: ArchiveConfig = parse_config(&decl.config).map_err(fail)?;
            let stage = ArchiveStage::build(cfg, &t.run_dir, &instance).map_err(fail)?;
            if durable_bus(t) {
                Box::new(stage.with_offsets_of(&t.bus))
            } else {
                Box::new(stage)
            }
        }
        StageKind::Source => {
            Box::new(SourceStage::build(parse_config(&decl.config).map_err(fail)?, ctx()?).map_err(fail)?)
        }
        StageKind::Rollout => {
            Box::new(RolloutStage::build(parse_config(&decl.config).map_err(fail)?, ctx()?).map_err(fail)?)
        }
        StageKind::Sandbox => {
            Box::new(SandboxStage::build(parse_config(&decl.config).map_err(fail)?, ctx()?).map_err(fail)?)
        }
        StageKind::Reward => {
            Box::new(RewardStage::build(parse_config(&decl.config).map_err(fail)?, ctx()?).map_err(fail)?)
        }
        StageKind::Mask => Box::new(MaskStage::build(parse_config(&decl.config).map_err(fail)?, ctx()?).map_err(fail)?),
        StageKind::Trainer => {
            Box::new(TrainerStage::build(parse_config(&decl.config).map_err(fail)?, ctx()?).map_err(fail)?)
        }
    })
}

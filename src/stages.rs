//! The stage registry: one exhaustive `match` on the stage kind naming the type that
//! builds it ([`BuildStage`]), so a kind that is declared but not wired does not compile.

use std::sync::Arc;

use anyhow::{Result, anyhow};
use serde_yaml::Value;
use streamrl_archive::ArchiveStage;
use streamrl_runtime::Stage;
use streamrl_runtime::build::{self, BuildContext, BuildStage, BusHandle};
use streamrl_runtime::bus::Bus;
use streamrl_runtime::topology::{Problem, StageKind, Topology};
use streamrl_stages::mask::MaskStage;
use streamrl_stages::reward::RewardStage;
use streamrl_stages::rollout::RolloutStage;
use streamrl_stages::sandbox::SandboxStage;
use streamrl_stages::source::SourceStage;
use streamrl_stages::trainer::TrainerStage;

/// What a registry entry does with a kind's type.
trait Visit {
    type Out;
    fn visit<S: BuildStage>(self) -> Self::Out;
}

/// Calls `v` with the type that builds stages of `kind`.
fn with_kind<V: Visit>(kind: StageKind, v: V) -> V::Out {
    match kind {
        StageKind::Archive => v.visit::<ArchiveStage>(),
        StageKind::Source => v.visit::<SourceStage>(),
        StageKind::Rollout => v.visit::<RolloutStage>(),
        StageKind::Sandbox => v.visit::<SandboxStage>(),
        StageKind::Reward => v.visit::<RewardStage>(),
        StageKind::Mask => v.visit::<MaskStage>(),
        StageKind::Trainer => v.visit::<TrainerStage>(),
    }
}

/// Validates a kind's `config` block, reporting every problem (paths relative to it).
pub fn check_config(kind: StageKind, config: &Value) -> Vec<Problem> {
    struct Check<'a>(&'a Value);
    impl Visit for Check<'_> {
        type Out = Vec<Problem>;
        fn visit<S: BuildStage>(self) -> Vec<Problem> {
            build::check::<S>(self.0)
        }
    }
    with_kind(kind, Check(config))
}

/// Problems of the topology's `envs:` section.
pub fn check_envs(envs: &Value) -> Vec<Problem> {
    streamrl_stages::build_envs(envs).err().unwrap_or_default()
}

/// The context replica `replica` of stage `name` is built in.
fn context(t: &Topology, bus: &Arc<dyn Bus>, name: &str, replica: u32) -> Result<BuildContext> {
    let decl = t.stages.get(name).ok_or_else(|| anyhow!("no stage `{name}`"))?;
    let schemas = |topics: &[String]| {
        topics
            .iter()
            .filter_map(|o| t.topics.get(o).map(|d| (o.clone(), d.schema)))
            .collect()
    };
    Ok(BuildContext {
        run_id: t.run_id.clone(),
        run_dir: t.run_dir.clone(),
        stage: name.to_string(),
        replica,
        inputs: schemas(&decl.inputs),
        outputs: schemas(&decl.outputs),
        envs: t.envs.clone(),
        // Every backend but the in-process `memory://` keeps its topics across a restart.
        durable_bus: !t.bus.starts_with("memory://"),
        bus: Some(BusHandle(bus.clone())),
    })
}

/// Builds replica `replica` of stage `name` (expensive setup happens here, once).
pub fn build(t: &Topology, bus: &Arc<dyn Bus>, name: &str, replica: u32) -> Result<Box<dyn Stage>> {
    struct Build<'a>(&'a Value, &'a BuildContext);
    impl Visit for Build<'_> {
        type Out = Result<Box<dyn Stage>, build::BuildError>;
        fn visit<S: BuildStage>(self) -> Self::Out {
            build::build::<S>(self.0, self.1)
        }
    }
    let ctx = context(t, bus, name, replica)?;
    let decl = &t.stages[name];
    with_kind(decl.kind, Build(&decl.config, &ctx)).map_err(|e| anyhow!("stages.{name}.config: {e}"))
}

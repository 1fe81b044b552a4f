//! Running replicas of a topology in one process: topics created first with the
//! topology's partition counts, every replica's group joined before any loop starts, the first failure
//! stopping the others. The run ends in-band: the trainer's [`Signal::EndOfRun`] on the
//! policy topic ends every stage (see [`crate::runner::run_stage`]); draining stages (the
//! archive) keep consuming until their inputs go quiet, so the Parquet files hold what
//! the others emitted while finishing. `streamrl run` runs every replica here;
//! `streamrl stage` one of them.
//!
//! [`Signal::EndOfRun`]: streamrl_schemas::Signal::EndOfRun

use std::sync::Arc;

use crate::Result;
use crate::bus::Bus;
use crate::runner::{Inputs, RunnerConfig, Shutdown, StageMetrics, run_stage_on};
use crate::stage::Stage;
use crate::topology::Topology;

/// One replica of one stage, built and ready to run.
pub struct Replica {
    /// How the runtime runs it (from [`Topology::runner_config`]).
    pub cfg: RunnerConfig,
    /// The stage.
    pub stage: Box<dyn Stage>,
}

/// Creates every topic of `t` with its declared partition count, before any client could
/// auto-create one with a broker default. Existing topics are kept when their partition
/// count matches; a mismatch is an error that says how to fix it.
pub async fn create_topics(bus: &Arc<dyn Bus>, t: &Topology) -> Result<()> {
    let existing = bus.topic_partitions().await?;
    for spec in t.topic_specs() {
        match existing.get(&spec.name) {
            None => bus.create_topic(&spec).await?,
            Some(&n) if n != spec.partitions => {
                return Err(crate::Error::PartitionMismatch {
                    topic: spec.name.clone(),
                    existing: n,
                    wanted: spec.partitions,
                });
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Runs `replicas` until each has ended: at the end of the run, on `shutdown`, or on a
/// failure, which triggers `shutdown` for the others. Returns every replica's counters
/// (by instance name, in the given order), or the first error.
pub async fn run_replicas(
    bus: Arc<dyn Bus>,
    replicas: Vec<Replica>,
    shutdown: Shutdown,
) -> Result<Vec<(String, Arc<StageMetrics>)>> {
    // Every replica joins its group before any loop runs: a replica that joined after
    // another had started on its inputs would take partitions with work in flight on them,
    // and that work would be done twice.
    let mut opened = Vec::with_capacity(replicas.len());
    for r in replicas {
        let inputs = Inputs::open(&bus, &r.cfg).await?;
        opened.push((r, inputs));
    }
    let mut tasks = tokio::task::JoinSet::new();
    let mut metrics = Vec::new();
    for (r, inputs) in opened {
        let m = Arc::new(StageMetrics::default());
        metrics.push((r.cfg.instance(), m.clone()));
        let (bus, sd) = (bus.clone(), shutdown.clone());
        let instance = r.cfg.instance();
        tasks.spawn(async move { (instance, run_stage_on(bus, r.cfg, r.stage, inputs, sd, m).await) });
    }
    let mut first_err = None;
    while let Some(joined) = tasks.join_next().await {
        let failed = match joined {
            Ok((_, Ok(()))) => None,
            Ok((instance, Err(e))) => {
                tracing::error!(stage = %instance, error = %e, "stage failed: stopping the others");
                Some(e)
            }
            Err(e) => Some(crate::Error::Stage {
                stage: "a stage task".into(),
                source: crate::StageError::internal(format!("panicked or was cancelled: {e}")),
            }),
        };
        if let Some(e) = failed {
            shutdown.trigger();
            first_err.get_or_insert(e);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(metrics),
    }
}

//! What `streamrl run` shows while it runs: one line per trainer step (reward, loss,
//! masking, staleness, throughput) read from the `metrics` and `policy` topics like any
//! other consumer, and a summary at the end. It only watches: the run ends in-band, when
//! the trainer signals the end of the run on `policy` after its `max_steps`-th version.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use streamrl_runtime::bus::Bus;
use streamrl_runtime::runner::Shutdown;
use streamrl_runtime::topology::{StageKind, Topology};
use streamrl_schemas::{MetricRow, PolicyRow, SchemaId, TopicRow, codec};
use streamrl_stages::step_metrics::name;
use streamrl_stages::trainer::TrainerConfig;

/// Per-step trainer metrics seen so far.
#[derive(Debug, Default)]
pub struct Summary {
    steps: BTreeMap<u64, BTreeMap<String, f64>>,
    /// Seconds from the start of the run to its end.
    pub wall: f64,
    /// Seconds from the start of the run to each step's metrics.
    pub at: BTreeMap<u64, f64>,
    /// Held-out greedy accuracy by version, where the trainer measured it.
    pub heldout: BTreeMap<u64, f64>,
}

impl Summary {
    /// Steps whose metrics arrived.
    pub fn steps(&self) -> usize {
        self.steps.len()
    }

    /// Mean staleness (versions behind the trainer) of the samples trained on.
    pub fn mean_staleness(&self) -> f64 {
        let (mut sum, mut n) = (0.0, 0.0);
        for m in self.steps.values() {
            for (k, v) in m {
                if let Some(s) = k
                    .strip_prefix(name::STALENESS_PREFIX)
                    .and_then(|s| s.parse::<f64>().ok())
                {
                    sum += s * v;
                    n += v;
                }
            }
        }
        if n > 0.0 { sum / n } else { 0.0 }
    }

    /// Seconds per step between the first and the last step seen (startup excluded).
    pub fn seconds_per_step(&self) -> f64 {
        match (self.at.iter().next(), self.at.iter().next_back()) {
            (Some((s0, t0)), Some((s1, t1))) if s1 > s0 => (t1 - t0) / (s1 - s0) as f64,
            _ => f64::NAN,
        }
    }

    /// Mean of a metric over every step.
    pub fn mean(&self, name: &str) -> f64 {
        let v: Vec<f64> = self.steps.values().filter_map(|m| m.get(name).copied()).collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    }

    /// Prints the first and last steps' key numbers.
    pub fn print(&self) {
        if self.steps.is_empty() {
            return;
        }
        let get = |m: &BTreeMap<String, f64>, k: &str| m.get(k).copied().unwrap_or(f64::NAN);
        let n = self.steps.len();
        let window = (n / 4).max(1);
        let mean =
            |it: Vec<&BTreeMap<String, f64>>, k: &str| it.iter().map(|m| get(m, k)).sum::<f64>() / it.len() as f64;
        let first: Vec<_> = self.steps.values().take(window).collect();
        let last: Vec<_> = self.steps.values().rev().take(window).collect();
        eprintln!();
        eprintln!(
            "{:<28} {:>12} {:>12}",
            format!("summary ({n} steps, {:.0} s)", self.wall),
            "first ¼",
            "last ¼"
        );
        for k in [
            name::REWARD_MEAN,
            name::LOSS,
            name::ENTROPY,
            name::MISMATCH_KL,
            name::MASKED_LOW,
            name::MASKED_HIGH,
            name::STEP_SECONDS,
            name::MOE_MAX_LOAD,
        ] {
            if k == name::MOE_MAX_LOAD && first.iter().all(|m| !m.contains_key(k)) {
                continue;
            }
            eprintln!(
                "{:<28} {:>12.4} {:>12.4}",
                k,
                mean(first.clone(), k),
                mean(last.clone(), k)
            );
        }
        if let (Some((s0, h0)), Some((s1, h1))) = (self.heldout.iter().next(), self.heldout.iter().next_back()) {
            eprintln!(
                "{:<28} {:>11.1}% {:>11.1}%   (versions {s0} and {s1})",
                name::HELDOUT_ACCURACY,
                h0 * 100.0,
                h1 * 100.0
            );
        }
    }
}

impl Summary {
    /// Takes in one `metrics` message, `secs` into the run: the held-out accuracy of
    /// version 0, or a trainer step's metrics (printed as one line unless `quiet`).
    fn record(&mut self, rows: &[MetricRow], secs: f64, max_steps: Option<u64>, quiet: bool) {
        let Some(step) = rows.iter().find(|r| r.name == name::STEP_SECONDS).map(|r| r.step) else {
            // A held-out eval arrives on its own (the trainer runs it once its version
            // has gone out), except the last version's, which comes with its step.
            if let Some(h) = rows.iter().find(|r| r.name == name::HELDOUT_ACCURACY) {
                self.heldout.insert(h.step, h.value);
                if !quiet {
                    eprintln!("step {:>4} held-out accuracy {:.1}%", h.step, h.value * 100.0);
                }
            }
            return;
        };
        self.at.insert(step, secs);
        let e = self.steps.entry(step).or_default();
        for r in rows.iter().filter(|r| r.step == step) {
            e.insert(r.name.clone(), r.value);
        }
        let g = |k: &str| e.get(k).copied().unwrap_or(0.0);
        let stale: Vec<String> = e
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(name::STALENESS_PREFIX).map(|s| format!("{s}:{v}")))
            .collect();
        let heldout = e.get(name::HELDOUT_ACCURACY).copied();
        let line = format!(
            "step {step:>4}{} reward {:.3} loss {:+.4} entropy {:.3} kl {:.4} masked {:.3}/{:.3}{} trained {:>3}/{:<3} staleness [{}] {:.2} s/step {secs:.0} s{}",
            max_steps.map(|m| format!("/{m}")).unwrap_or_default(),
            g(name::REWARD_MEAN),
            g(name::LOSS),
            g(name::ENTROPY),
            g(name::MISMATCH_KL),
            g(name::MASKED_LOW),
            g(name::MASKED_HIGH),
            // MoE: the most loaded expert over the mean (the worst layer's).
            e.get(name::MOE_MAX_LOAD)
                .map(|m| format!(" moe {m:.2}"))
                .unwrap_or_default(),
            g(name::SAMPLES_TRAINED),
            g(name::SAMPLES),
            stale.join(" "),
            g(name::STEP_SECONDS),
            heldout
                .map(|h| format!(" held-out {:.1}%", h * 100.0))
                .unwrap_or_default()
        );
        if let Some(h) = heldout {
            self.heldout.insert(step, h);
        }
        if !quiet {
            eprintln!("{line}");
        }
    }
}

/// Watches the run's policy and metrics topics.
pub struct Watcher {
    task: tokio::task::JoinHandle<Summary>,
}

impl Watcher {
    /// Subscribes (broadcast) to the policy and metrics topics and prints until `stop`.
    pub async fn start(bus: &Arc<dyn Bus>, t: &Topology, stop: Shutdown, quiet: bool) -> Result<Watcher> {
        let topic = |schema: SchemaId| {
            t.topics
                .iter()
                .find(|(_, d)| d.schema == schema)
                .map(|(n, _)| n.clone())
        };
        let max_steps = t
            .stages
            .values()
            .find(|s| s.kind == StageKind::Trainer)
            .and_then(|s| streamrl_stages::parse_config::<TrainerConfig>(&s.config).ok())
            .and_then(|c| c.max_steps);
        let mut policy = match topic(SchemaId::Policy) {
            Some(p) => Some(bus.broadcast(&p).await?),
            None => None,
        };
        let mut metrics = match topic(SchemaId::Metrics) {
            Some(m) => Some(bus.broadcast(&m).await?),
            None => None,
        };
        let task = tokio::spawn(async move {
            let t0 = Instant::now();
            let mut summary = Summary::default();
            loop {
                tokio::select! {
                    _ = stop.wait() => break,
                    m = async { match policy.as_mut() { Some(c) => c.recv().await, None => std::future::pending().await } } => {
                        let Ok(m) = m else { break };
                        let Ok(b) = codec::decode(SchemaId::Policy, &m.headers, &m.payload) else { continue };
                        let Ok(rows) = PolicyRow::from_batch(&b) else { continue };
                        if let (Some(max), Some(v)) = (max_steps, rows.iter().map(|r| r.version as u64).max())
                            && v == max
                            && !quiet
                        {
                            eprintln!("trainer reached max_steps {max}: the run ends");
                        }
                    }
                    m = async { match metrics.as_mut() { Some(c) => c.recv().await, None => std::future::pending().await } } => {
                        let Ok(m) = m else { break };
                        let Ok(b) = codec::decode(SchemaId::Metrics, &m.headers, &m.payload) else { continue };
                        let Ok(rows) = MetricRow::from_batch(&b) else { continue };
                        summary.record(&rows, t0.elapsed().as_secs_f64(), max_steps, quiet);
                    }
                }
            }
            summary.wall = t0.elapsed().as_secs_f64();
            summary
        });
        Ok(Watcher { task })
    }

    /// Stops watching and returns what was seen.
    pub async fn finish(self) -> Summary {
        self.task.await.unwrap_or_default()
    }
}

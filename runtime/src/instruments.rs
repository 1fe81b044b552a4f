//! Every OpenTelemetry metric streamrl records, in one place: names, units, attributes.
//!
//! Stages and the runner record through the global meter provider. [`crate::telemetry::init`]
//! installs an OTLP exporter as that provider when `OTEL_EXPORTER_OTLP_ENDPOINT` is set
//! (every `OTEL_METRIC_EXPORT_INTERVAL` ms, 60 s by default, and at exit); otherwise every
//! instrument is a no-op and costs a branch. The names follow OpenTelemetry's conventions
//! (dotted, units in `unit`, not in the name); rates such as tokens/s are the backend's
//! `rate()` over the counters. The stage counters (messages, rows, errors, dead letters)
//! are observable: each export reads them from the replica's
//! [`StageMetrics`], the one count that `streamrl run`'s table
//! and `streamrl stage --metrics-port` also show.
//!
//! | instrument | kind | unit | attributes |
//! |---|---|---|---|
//! | `streamrl.stage.messages` | counter | `{message}` | stage, replica, direction (`in`/`out`) |
//! | `streamrl.stage.rows` | counter | `{row}` | stage, replica, direction |
//! | `streamrl.stage.duration` | histogram | `s` | stage, replica (time in `process` per input) |
//! | `streamrl.stage.errors` | counter | `{error}` | stage, replica |
//! | `streamrl.stage.dead_letters` | counter | `{message}` | stage, replica |
//! | `streamrl.stage.lag` | gauge | `{record}` | stage, replica (input records not committed) |
//! | `streamrl.rollout.tokens` | counter | `{token}` | stage, replica (generated) |
//! | `streamrl.rollout.weight_sync` | histogram | `s` | stage, replica (publish → serving) |
//! | `streamrl.sandbox.executions` | counter | `{execution}` | stage, replica, status |
//! | `streamrl.sandbox.duration` | histogram | `s` | stage, replica, status |
//! | `streamrl.train.samples` | counter | `{sample}` | stage, replica, outcome |
//! | `streamrl.train.staleness` | histogram | `{version}` | stage, replica (per sample received for a step) |
//! | `streamrl.train.tokens` | counter | `{token}` | stage, replica (trained) |
//! | `streamrl.train.step.duration` | histogram | `s` | stage, replica |
//! | `streamrl.stage.value` | gauge | | stage, replica, name (each row a stage writes on `metrics`: loss, tokens_per_s, ...) |
//!
//! ```
//! use streamrl_runtime::instruments::Instruments;
//! // Without an installed provider this records nothing, and never fails.
//! let m = Instruments::new("sandbox", 0);
//! m.sandbox_execution("ok", std::time::Duration::from_millis(12));
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter};

use crate::runner::StageMetrics;

/// The replicas whose counters the observable instruments read, with their attributes.
type Replicas = Arc<Mutex<Vec<([KeyValue; 2], Arc<StageMetrics>)>>>;

/// A replica's counters for one observable instrument, each with its `direction`, if any.
type Reader = fn(&StageMetrics) -> Vec<(Option<&'static str>, &AtomicU64)>;

/// The instruments, built once from the global meter (after [`crate::telemetry::init`]).
struct All {
    replicas: Replicas,
    duration: Histogram<f64>,
    lag: Gauge<u64>,
    rollout_tokens: Counter<u64>,
    weight_sync: Histogram<f64>,
    executions: Counter<u64>,
    execution_duration: Histogram<f64>,
    samples: Counter<u64>,
    staleness: Histogram<u64>,
    train_tokens: Counter<u64>,
    step_duration: Histogram<f64>,
    value: Gauge<f64>,
}

/// Seconds: from a millisecond to ten minutes.
const SECONDS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0, 600.0,
];

fn all() -> &'static All {
    static ALL: OnceLock<All> = OnceLock::new();
    ALL.get_or_init(|| {
        let m: Meter = opentelemetry::global::meter("streamrl");
        let replicas: Replicas = Arc::default();
        observe_replicas(&m, &replicas);
        All {
            replicas,
            duration: seconds(
                &m,
                "streamrl.stage.duration",
                "Time a stage spent processing one input message",
            ),
            lag: m
                .u64_gauge("streamrl.stage.lag")
                .with_unit("{record}")
                .with_description("Input records the stage's consumer group has not committed")
                .build(),
            rollout_tokens: counter(&m, "streamrl.rollout.tokens", "{token}", "Completion tokens generated"),
            weight_sync: seconds(
                &m,
                "streamrl.rollout.weight_sync",
                "Time from a version's publication on policy to this replica serving it",
            ),
            executions: counter(
                &m,
                "streamrl.sandbox.executions",
                "{execution}",
                "Sandbox executions by outcome status",
            ),
            execution_duration: seconds(&m, "streamrl.sandbox.duration", "Wall time of one sandbox execution"),
            samples: counter(
                &m,
                "streamrl.train.samples",
                "{sample}",
                "Samples the trainer received, by outcome (trained, stale, filtered, duplicate, superseded)",
            ),
            staleness: m
                .u64_histogram("streamrl.train.staleness")
                .with_unit("{version}")
                .with_description(
                    "Policy versions between a sample's oldest sampling policy and the step that consumed it",
                )
                .with_boundaries(vec![0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0])
                .build(),
            train_tokens: counter(
                &m,
                "streamrl.train.tokens",
                "{token}",
                "Tokens the trainer ran forward and backward",
            ),
            step_duration: seconds(&m, "streamrl.train.step.duration", "Wall time of one optimizer step"),
            value: m
                .f64_gauge("streamrl.stage.value")
                .with_description("The latest value of each metric row a stage writes on the metrics topic")
                .build(),
        }
    })
}

/// A histogram of seconds ([`SECONDS`] buckets).
fn seconds(m: &Meter, name: &'static str, what: &'static str) -> Histogram<f64> {
    m.f64_histogram(name)
        .with_unit("s")
        .with_description(what)
        .with_boundaries(SECONDS.to_vec())
        .build()
}

/// A counter the instruments add to.
fn counter(m: &Meter, name: &'static str, unit: &'static str, what: &'static str) -> Counter<u64> {
    m.u64_counter(name).with_unit(unit).with_description(what).build()
}

/// The observable counters over the registered replicas' own counters: messages, rows,
/// errors and dead letters.
fn observe_replicas(m: &Meter, replicas: &Replicas) {
    // `read` gives each replica's values, with the `direction` they are for, if any.
    let observed = |name: &'static str, unit: &'static str, what: &'static str, read: Reader| {
        let replicas = replicas.clone();
        m.u64_observable_counter(name)
            .with_unit(unit)
            .with_description(what)
            .with_callback(move |o| {
                for (attrs, metrics) in replicas.lock().unwrap().iter() {
                    for (direction, v) in read(metrics) {
                        let v = v.load(Ordering::Relaxed);
                        match direction {
                            Some(d) => o.observe(v, &with(attrs, "direction", d)),
                            None => o.observe(v, attrs),
                        }
                    }
                }
            })
            .build();
    };
    observed(
        "streamrl.stage.messages",
        "{message}",
        "Messages a stage received (direction=in) or delivered (direction=out)",
        |m| vec![(Some("in"), &m.in_messages), (Some("out"), &m.out_messages)],
    );
    observed(
        "streamrl.stage.rows",
        "{row}",
        "Rows a stage received or delivered",
        |m| vec![(Some("in"), &m.in_rows), (Some("out"), &m.out_rows)],
    );
    observed(
        "streamrl.stage.errors",
        "{error}",
        "Stage errors (each retry counts)",
        |m| vec![(None, &m.errors)],
    );
    observed(
        "streamrl.stage.dead_letters",
        "{message}",
        "Messages sent to the dead-letter topic",
        |m| vec![(None, &m.dead_lettered)],
    );
}

fn with(attrs: &[KeyValue; 2], key: &'static str, value: &str) -> [KeyValue; 3] {
    let [a, b] = attrs.clone();
    [a, b, KeyValue::new(key, value.to_string())]
}

/// One stage replica's handle on the instruments: its attributes, bound once.
#[derive(Debug, Clone)]
pub struct Instruments {
    attrs: [KeyValue; 2],
}

impl Instruments {
    /// The instruments of replica `replica` of stage `stage`.
    pub fn new(stage: &str, replica: u32) -> Self {
        Instruments {
            attrs: [
                KeyValue::new("stage", stage.to_string()),
                KeyValue::new("replica", i64::from(replica)),
            ],
        }
    }

    fn with(&self, key: &'static str, value: &str) -> [KeyValue; 3] {
        with(&self.attrs, key, value)
    }

    /// Exports the replica's counters (`metrics`) through the observable stage counters,
    /// from now until the process exits (a replica registered again replaces its entry).
    pub fn observe(&self, metrics: &Arc<StageMetrics>) {
        let mut replicas = all().replicas.lock().unwrap();
        replicas.retain(|(a, _)| a != &self.attrs);
        replicas.push((self.attrs.clone(), metrics.clone()));
    }

    /// One input took `d` to process.
    pub fn processed(&self, d: Duration) {
        all().duration.record(d.as_secs_f64(), &self.attrs);
    }

    /// The input records not committed yet.
    pub fn lag(&self, records: u64) {
        all().lag.record(records, &self.attrs);
    }

    /// `n` completion tokens were generated.
    pub fn generated(&self, n: u64) {
        all().rollout_tokens.add(n, &self.attrs);
    }

    /// A new version was serving `d` after its publication.
    pub fn weight_sync(&self, d: Duration) {
        all().weight_sync.record(d.as_secs_f64(), &self.attrs);
    }

    /// One sandbox execution ended with `status` after `d`.
    pub fn sandbox_execution(&self, status: &str, d: Duration) {
        let a = self.with("status", status);
        all().executions.add(1, &a);
        all().execution_duration.record(d.as_secs_f64(), &a);
    }

    /// A sample reached the trainer and met `outcome`.
    pub fn sample(&self, outcome: &str) {
        all().samples.add(1, &self.with("outcome", outcome));
    }

    /// A sample consumed by a step was `versions` versions stale.
    pub fn staleness(&self, versions: u64) {
        all().staleness.record(versions, &self.attrs);
    }

    /// One optimizer step over `tokens` tokens took `d`.
    pub fn train_step(&self, tokens: u64, d: Duration) {
        all().train_tokens.add(tokens, &self.attrs);
        all().step_duration.record(d.as_secs_f64(), &self.attrs);
    }

    /// The latest value of metric row `name` (bridged from the `metrics` topic).
    pub fn value(&self, name: &str, v: f64) {
        if v.is_finite() {
            all().value.record(v, &self.with("name", name));
        }
    }
}

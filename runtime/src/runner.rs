//! The stage runtime: the loop around a [`Stage`].
//!
//! For every message: parse headers, decode the Arrow payload against the topic's schema,
//! call the stage (retrying retryable errors with exponential backoff), split each output
//! batch by its topic's key column, encode and deliver every output, and only then
//! acknowledge the input. A message that cannot be decoded, or that the stage rejects as
//! invalid, goes to the dead-letter topic with the reason, and the stage keeps running.
//! On shutdown the in-flight message is finished, the stage's `close` hook runs, offsets
//! are committed and the consumer leaves its group.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arrow::array::{Array, AsArray, UInt32Array};
use arrow::compute::take_record_batch;
use arrow::datatypes::DataType;
use arrow::record_batch::RecordBatch;
use futures::future::try_join_all;
use streamrl_schemas::codec::{self, Compression};
use streamrl_schemas::{DeadLetterRow, Headers, MessageKind, SchemaId, Signal, TopicRow};
use tokio::sync::watch;
use tracing::Instrument;

use crate::bus::{Bus, Consumer, DeliveryFuture, Message, Producer, Record};
use crate::stage::{Emitted, Emitter, Input, Stage};
use crate::{ErrorDomain, Result, RetryHint, StageError, telemetry};

/// A topic as a stage sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct TopicBinding {
    /// Topic name.
    pub name: String,
    /// Its schema.
    pub schema: SchemaId,
    /// Key column for outputs (rows are split so each message holds one key).
    pub key: Option<String>,
}

/// How the runtime runs one stage replica.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// Stage name (also the consumer group).
    pub stage: String,
    /// Replica index.
    pub replica: u32,
    /// Topics read as a member of the stage's consumer group.
    pub inputs: Vec<TopicBinding>,
    /// Topics every replica reads in full (e.g. `policy`).
    pub broadcast: Vec<TopicBinding>,
    /// Topics the stage may emit to.
    pub outputs: Vec<TopicBinding>,
    /// Where undecodable or invalid messages go.
    pub dead_letter: String,
    /// Retries of a retryable error before the stage gives up.
    pub max_retries: u32,
    /// First backoff; doubles per retry.
    pub initial_backoff: Duration,
    /// Backoff cap.
    pub max_backoff: Duration,
    /// Payload compression of outputs.
    pub compression: Compression,
    /// Where the stage's snapshot is kept (`<dir>/<stage>-<replica>.state`): restored
    /// before `start`; written atomically after a call's outputs are delivered and before
    /// the inputs it covers are acknowledged, whenever no input is held (while some are,
    /// acknowledgements wait, so the file and the committed offsets always agree).
    /// `None`: not persisted.
    pub state_dir: Option<std::path::PathBuf>,
    /// The topic whose in-band [`Signal::EndOfRun`] ends the stage (the policy topic),
    /// read as a broadcast for signals only when it is not already one of the stage's
    /// broadcast inputs. `None`: the stage ends only on [`Shutdown`].
    pub control: Option<String>,
    /// At the end of the run, keep consuming until nothing has arrived for this long
    /// before closing (the archive: what upstream stages emit while they finish still
    /// reaches Parquet). `None`: close at once.
    pub drain_on_end: Option<Duration>,
    /// Name of the span each message is handled in (the stage kind's
    /// [`span_name`](crate::topology::StageKind::span_name), `process` by default).
    pub span_name: String,
}

impl RunnerConfig {
    /// A config with default retry and compression settings.
    pub fn new(stage: impl Into<String>, dead_letter: impl Into<String>) -> Self {
        RunnerConfig {
            stage: stage.into(),
            replica: 0,
            inputs: Vec::new(),
            broadcast: Vec::new(),
            outputs: Vec::new(),
            dead_letter: dead_letter.into(),
            max_retries: 5,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(5),
            compression: Compression::Zstd,
            state_dir: None,
            control: None,
            drain_on_end: None,
            span_name: "process".into(),
        }
    }

    /// The producer / replica id, e.g. `reward-2`.
    pub fn instance(&self) -> String {
        format!("{}-{}", self.stage, self.replica)
    }
}

/// Per-stage counters.
#[derive(Debug, Default)]
pub struct StageMetrics {
    /// Messages received.
    pub in_messages: AtomicU64,
    /// Rows received.
    pub in_rows: AtomicU64,
    /// Messages delivered.
    pub out_messages: AtomicU64,
    /// Rows delivered.
    pub out_rows: AtomicU64,
    /// Stage errors (each retry counts).
    pub errors: AtomicU64,
    /// Retries.
    pub retries: AtomicU64,
    /// Messages sent to the dead-letter topic.
    pub dead_lettered: AtomicU64,
    /// Signals received.
    pub signals: AtomicU64,
    /// Time spent in the stage's `process`, ns.
    pub processing_ns: AtomicU64,
}

impl StageMetrics {
    /// A snapshot as (name, value) pairs.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        vec![
            ("in_messages", g(&self.in_messages)),
            ("in_rows", g(&self.in_rows)),
            ("out_messages", g(&self.out_messages)),
            ("out_rows", g(&self.out_rows)),
            ("errors", g(&self.errors)),
            ("retries", g(&self.retries)),
            ("dead_lettered", g(&self.dead_lettered)),
            ("signals", g(&self.signals)),
            ("processing_ms", g(&self.processing_ns) / 1_000_000),
        ]
    }

    /// The counters in the Prometheus text format (`streamrl_stage_<name>_total`, labelled
    /// with the stage and replica), plus the input lag when it is known, for a scrape of
    /// `streamrl stage --metrics-port`.
    pub fn prometheus(&self, stage: &str, replica: u32, lag: Option<u64>) -> String {
        let labels = format!(
            "stage=\"{}\",replica=\"{replica}\"",
            stage.replace(['"', '\\', '\n'], "_")
        );
        let mut out = String::new();
        for (name, v) in self.snapshot() {
            let help = match name {
                "processing_ms" => "Milliseconds spent in the stage's process calls",
                _ => "Count since the process started",
            };
            out.push_str(&format!(
                "# HELP streamrl_stage_{name}_total {help}\n# TYPE streamrl_stage_{name}_total counter\nstreamrl_stage_{name}_total{{{labels}}} {v}\n"
            ));
        }
        if let Some(l) = lag {
            out.push_str(&format!(
                "# HELP streamrl_stage_input_lag Input records the stage's group has not committed\n\
                 # TYPE streamrl_stage_input_lag gauge\nstreamrl_stage_input_lag{{{labels}}} {l}\n"
            ));
        }
        out
    }
}

/// Tells running stages to stop (SIGINT/SIGTERM, or a test).
#[derive(Debug, Clone)]
pub struct Shutdown {
    tx: Arc<watch::Sender<bool>>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown {
            tx: Arc::new(watch::channel(false).0),
        }
    }
}

impl Shutdown {
    /// A fresh, untriggered shutdown.
    pub fn new() -> Self {
        Self::default()
    }
    /// Asks every stage holding this to stop after its in-flight message.
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }
    /// Whether it was triggered.
    pub fn is_triggered(&self) -> bool {
        *self.tx.borrow()
    }
    /// Resolves once triggered.
    pub async fn wait(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|v| *v).await;
    }
    /// Triggers on SIGINT or SIGTERM.
    pub fn on_signals(&self) {
        let me = self.clone();
        tokio::spawn(async move {
            #[cfg(unix)]
            {
                use tokio::signal::unix::{SignalKind, signal};
                let mut term = match signal(SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(_) => return,
                };
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            #[cfg(not(unix))]
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("signal received: finishing in-flight work");
            me.trigger();
        });
    }
}

/// Runs one stage replica until `shutdown` triggers, the run ends in-band
/// ([`Signal::EndOfRun`] on an input or on the control topic), or the stage fails for good.
pub async fn run_stage(
    bus: Arc<dyn Bus>,
    cfg: RunnerConfig,
    stage: Box<dyn Stage>,
    shutdown: Shutdown,
    metrics: Arc<StageMetrics>,
) -> Result<()> {
    let inputs = Inputs::open(&bus, &cfg).await?;
    run_stage_on(bus, cfg, stage, inputs, shutdown, metrics).await
}

/// Like [`run_stage`], on readers opened beforehand: replicas that run together open all
/// their readers first ([`crate::running::run_replicas`]), so no member joins a group
/// after another has taken work from it (a late join moves partitions, and work in
/// flight on them is delivered again to the new owner and done twice).
pub async fn run_stage_on(
    bus: Arc<dyn Bus>,
    cfg: RunnerConfig,
    mut stage: Box<dyn Stage>,
    inputs: Inputs,
    shutdown: Shutdown,
    metrics: Arc<StageMetrics>,
) -> Result<()> {
    let Inputs {
        mut consumer,
        mut broadcasts,
    } = inputs;
    let mut runner = Runner::new(bus.producer(&cfg.instance()).await?, &cfg, metrics);
    // Exported metrics only: the replica's counters, and its input lag sampled while it runs.
    if crate::telemetry::metrics_enabled() {
        runner.instruments.observe(&runner.metrics);
    }
    let _stop_sampling = AbortOnDrop(sample_lag(&bus, &cfg, &runner.instruments));
    let mut out = Emitter::default();
    let state_file = restore_state(&cfg, stage.as_mut())?;
    let mut acks = Acks::new(state_file.filter(|_| stage.snapshot().is_some()));
    let (o, st, a) = (&mut out, &mut stage, &mut acks);
    runner
        .hook(o, st, a, consumer.as_mut(), "start", |s, o| Box::pin(s.start(o)))
        .await?;

    tracing::info!(stage = %runner.instance, "running");
    let mut tick = stage.tick_interval().map(ticker);
    let mut drain = Drain::default();
    loop {
        if tick.is_none() && !stage.ready() {
            return Err(stuck(&runner.instance));
        }
        let next = tokio::select! {
            biased;
            _ = shutdown.wait() => break,
            _ = drain.quiet(cfg.drain_on_end) => {
                if drain.inputs_drained(&bus, &cfg).await? {
                    break;
                }
                continue;
            }
            (m, i) = recv_any(&mut broadcasts) => Some((m, Some(i))),
            // Data inputs only while the stage takes them (broadcasts and ticks always).
            m = async { match consumer.as_mut() { Some(c) => c.recv().await, None => std::future::pending().await } }, if stage.ready() => Some((m, None)),
            _ = async { match tick.as_mut() { Some(t) => { t.tick().await; } None => std::future::pending().await } } => None,
        };
        let ended = match next {
            None => {
                let (o, st, a) = (&mut out, &mut stage, &mut acks);
                runner
                    .hook(o, st, a, consumer.as_mut(), "tick", |s, o| Box::pin(s.tick(o)))
                    .await?;
                false
            }
            Some((msg, from)) => {
                let msg = msg?;
                let ended = is_end_of_run(&msg);
                let to_stage = from.is_none_or(|i| broadcasts[i].1);
                if to_stage {
                    let id = msg.id();
                    runner.handle(msg, &mut stage, &mut out).await?;
                    let input = from.is_none().then_some(id);
                    acks.settle(consumer.as_mut(), &mut stage, input, out.take_flags())?;
                }
                drain.heard();
                ended
            }
        };
        if ended && !drain.ended(&cfg) {
            break;
        }
    }
    let (o, st, a) = (&mut out, &mut stage, &mut acks);
    runner
        .hook(o, st, a, consumer.as_mut(), "close", |s, o| Box::pin(s.close(o)))
        .await?;
    runner.stop(&acks, consumer, broadcasts).await
}

/// Ticks every `every`; a late tick is delayed, not made up for.
fn ticker(every: Duration) -> tokio::time::Interval {
    let mut i = tokio::time::interval(every);
    i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    i
}

/// A stage that takes no input and has no tick can never make progress.
fn stuck(instance: &str) -> crate::Error {
    crate::Error::Stage {
        stage: instance.to_string(),
        source: StageError::internal(
            "the stage takes no input (`ready` is false) and has no tick to work off what it holds",
        ),
    }
}

/// Where a replica stands in draining its inputs after the run has ended in-band.
#[derive(Debug, Default)]
struct Drain {
    /// Set once the run has ended, for a draining stage: when it last got a message.
    since: Option<tokio::time::Instant>,
    /// When the drain began.
    began: Option<tokio::time::Instant>,
}

impl Drain {
    /// Resolves once a draining stage has been quiet for `drain_on_end` (never before the
    /// run has ended, nor for a stage that does not drain).
    async fn quiet(&self, drain_on_end: Option<Duration>) {
        match (self.since, drain_on_end) {
            (Some(t), Some(d)) => tokio::time::sleep_until(t + d).await,
            _ => std::future::pending().await,
        }
    }

    /// A message arrived: a draining stage is not quiet yet.
    fn heard(&mut self) {
        if self.since.is_some() {
            self.since = Some(tokio::time::Instant::now());
        }
    }

    /// The end of the run was signalled; whether the replica goes on (to drain its inputs)
    /// rather than stop now.
    fn ended(&mut self, cfg: &RunnerConfig) -> bool {
        if self.since.is_some() {
            return true;
        }
        tracing::info!(stage = %cfg.instance(), "end of run signalled");
        cfg.drain_on_end.is_some_and(|_| {
            let now = tokio::time::Instant::now();
            (self.since, self.began) = (Some(now), Some(now));
            true
        })
    }

    /// Quiet for a while: done if the group has also committed everything there is (a
    /// consumer stuck after a broker outage is quiet too); an error once that has taken
    /// longer than [`MAX_DRAIN`].
    async fn inputs_drained(&mut self, bus: &Arc<dyn Bus>, cfg: &RunnerConfig) -> Result<bool> {
        let lag = input_lag(bus, cfg).await;
        if lag == Some(0) {
            tracing::info!(stage = %cfg.instance(), "run ended: inputs drained");
            return Ok(true);
        }
        if self.began.is_some_and(|b| b.elapsed() > MAX_DRAIN) {
            return Err(crate::Error::Stage {
                stage: cfg.instance(),
                source: StageError::internal(format!(
                    "the run ended, but {} input record(s) were still not consumed after {MAX_DRAIN:?} \
                     (exiting so that a restart reads them)",
                    lag.map_or("some".to_string(), |l| l.to_string())
                )),
            });
        }
        tracing::info!(stage = %cfg.instance(), lag = lag.map(|l| l as i64), "run ended: waiting for inputs");
        self.since = Some(tokio::time::Instant::now());
        Ok(false)
    }
}

/// A replica's readers: its group subscription to the data inputs (none without inputs),
/// and `(reader, whether its messages go to the stage)` for the broadcast inputs, then the
/// control topic when it is not one of them (its data is not the stage's business).
pub struct Inputs {
    consumer: Option<Box<dyn Consumer>>,
    broadcasts: Vec<(Box<dyn Consumer>, bool)>,
}

impl Inputs {
    /// Joins the replica's consumer group and opens its broadcast readers.
    pub async fn open(bus: &Arc<dyn Bus>, cfg: &RunnerConfig) -> Result<Inputs> {
        let names: Vec<String> = cfg.inputs.iter().map(|t| t.name.clone()).collect();
        let consumer = if names.is_empty() {
            None
        } else {
            Some(bus.subscribe_as(&cfg.stage, &cfg.instance(), &names).await?)
        };
        let mut broadcasts: Vec<(Box<dyn Consumer>, bool)> = Vec::new();
        for b in &cfg.broadcast {
            broadcasts.push((bus.broadcast(&b.name).await?, true));
        }
        if let Some(c) = cfg
            .control
            .as_ref()
            .filter(|c| !cfg.broadcast.iter().any(|b| &&b.name == c))
        {
            broadcasts.push((bus.broadcast(c).await?, false));
        }
        Ok(Inputs { consumer, broadcasts })
    }
}

/// Samples the replica's input lag into the `streamrl.stage.lag` gauge every
/// [`LAG_SAMPLE_INTERVAL`], when metrics are exported and it has inputs.
fn sample_lag(
    bus: &Arc<dyn Bus>,
    cfg: &RunnerConfig,
    instruments: &crate::instruments::Instruments,
) -> Option<tokio::task::JoinHandle<()>> {
    (crate::telemetry::metrics_enabled() && !cfg.inputs.is_empty()).then(|| {
        let (bus, cfg, instruments) = (bus.clone(), cfg.clone(), instruments.clone());
        tokio::spawn(async move {
            let mut every = tokio::time::interval(LAG_SAMPLE_INTERVAL);
            loop {
                every.tick().await;
                if let Some(lag) = input_lag(&bus, &cfg).await {
                    instruments.lag(lag);
                }
            }
        })
    })
}

/// Restores the stage from its state file when there is one; returns where the file is
/// (`None` without a state directory).
fn restore_state(cfg: &RunnerConfig, stage: &mut dyn Stage) -> Result<Option<std::path::PathBuf>> {
    let state_file = cfg
        .state_dir
        .as_ref()
        .map(|d| d.join(format!("{}.state", cfg.instance())));
    if let Some(path) = state_file.as_ref().filter(|p| p.exists()) {
        let bytes = std::fs::read(path).map_err(|e| crate::Error::Io {
            op: "reading stage state",
            path: path.display().to_string(),
            source: e,
        })?;
        stage.restore(&bytes).map_err(|e| crate::Error::Stage {
            stage: format!("{} (restore from {})", cfg.instance(), path.display()),
            source: e,
        })?;
        tracing::info!(stage = %cfg.instance(), bytes = bytes.len() as i64, "restored state");
    }
    Ok(state_file)
}

/// How often a replica samples its input lag for the `streamrl.stage.lag` gauge.
const LAG_SAMPLE_INTERVAL: Duration = Duration::from_secs(5);

/// Aborts a background task when dropped (however the replica's loop ends).
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.abort();
        }
    }
}

/// How long a draining stage waits at the end of the run for its inputs to be consumed
/// before it gives up (and exits with an error, so that a restarted process reads them).
const MAX_DRAIN: Duration = Duration::from_secs(60);

/// Records of the stage's inputs its group has not committed yet (`None`: unknown).
pub async fn input_lag(bus: &Arc<dyn Bus>, cfg: &RunnerConfig) -> Option<u64> {
    let group = std::slice::from_ref(&cfg.stage);
    let mut lag = 0;
    for t in &cfg.inputs {
        for p in bus.topic_stats(&t.name, group).await.ok()? {
            lag += p.lag(&cfg.stage)?;
        }
    }
    Some(lag)
}

/// Whether a message is the in-band end of the run.
fn is_end_of_run(msg: &Message) -> bool {
    Headers::from_wire(&msg.headers).is_ok_and(|h| h.signal == Some(Signal::EndOfRun))
}

/// The inputs a replica has received and not yet acknowledged, and the stage state that
/// must be durable before they are.
struct Acks {
    /// Inputs the stage holds, with their keys.
    held: Vec<(Option<String>, crate::bus::MessageId)>,
    /// Inputs processed while others were held, by a stage with persisted state: their
    /// acknowledgement waits until nothing is held and the snapshot covering them is written.
    deferred: Vec<crate::bus::MessageId>,
    /// Where the snapshot goes (`None`: the stage keeps no state).
    state_file: Option<std::path::PathBuf>,
    /// The snapshot written last (an unchanged state is not written again).
    written: Option<Vec<u8>>,
}

impl Acks {
    /// Nothing held yet; the stage's state goes to `state_file` (if it keeps state).
    fn new(state_file: Option<std::path::PathBuf>) -> Self {
        Acks {
            held: Vec::new(),
            deferred: Vec::new(),
            state_file,
            written: None,
        }
    }

    /// Called after a call's outputs are delivered: acknowledges `input` unless the stage
    /// holds it, then whatever the stage released (everything held, or the inputs held
    /// under given keys). A stage with persisted state has its snapshot written first, and
    /// only when no input stays held, so a restored state never counts an input that will
    /// be delivered again and never misses one that was committed.
    fn settle(
        &mut self,
        consumer: Option<&mut Box<dyn Consumer>>,
        stage: &mut Box<dyn Stage>,
        input: Option<crate::bus::MessageId>,
        flags: crate::stage::Settle,
    ) -> Result<()> {
        stage.delivered().map_err(|e| crate::Error::Stage {
            stage: "delivered hook".into(),
            source: e,
        })?;
        let mut ready = Vec::new();
        if let Some(id) = input {
            match flags.hold {
                Some(key) => self.held.push((key, id)),
                None => ready.push(id),
            }
        }
        if flags.release_all {
            ready.extend(self.held.drain(..).map(|(_, h)| h));
        } else if !flags.release_keys.is_empty() {
            let (released, kept): (Vec<_>, Vec<_>) = self
                .held
                .drain(..)
                .partition(|(key, _)| key.as_ref().is_some_and(|k| flags.release_keys.contains(k)));
            self.held = kept;
            ready.extend(released.into_iter().map(|(_, h)| h));
        }
        if let Some(path) = &self.state_file {
            if !self.held.is_empty() {
                self.deferred.append(&mut ready);
                return Ok(());
            }
            if let Some(state) = stage.snapshot()
                && self.written.as_ref() != Some(&state)
            {
                write_atomically(path, &state)?;
                self.written = Some(state);
            }
            ready.append(&mut self.deferred);
        }
        let Some(c) = consumer else { return Ok(()) };
        for id in &ready {
            c.ack(id)?;
        }
        Ok(())
    }
}

/// Writes `bytes` to `path` via a temporary file and a rename, so readers never see a
/// partial file.
fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    let io = |op: &'static str, e: std::io::Error| crate::Error::Io {
        op,
        path: path.display().to_string(),
        source: e,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io("creating the directory of", e))?;
    }
    let tmp = path.with_extension("state.tmp");
    std::fs::write(&tmp, bytes).map_err(|e| io("writing", e))?;
    std::fs::rename(&tmp, path).map_err(|e| io("renaming into", e))
}

/// The next message of any of the readers, with the reader's index.
async fn recv_any(consumers: &mut [(Box<dyn Consumer>, bool)]) -> (Result<Message>, usize) {
    if consumers.is_empty() {
        return std::future::pending().await;
    }
    let futs = consumers.iter_mut().map(|(c, _)| c.recv());
    let (m, i, _) = futures::future::select_all(futs).await;
    (m, i)
}

type StageFuture<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), StageError>> + Send + 'a>>;

struct Runner {
    producer: Arc<dyn Producer>,
    cfg: RunnerConfig,
    instance: String,
    metrics: Arc<StageMetrics>,
    schemas: HashMap<String, SchemaId>,
    outputs: HashMap<String, TopicBinding>,
    policy_version: Option<u32>,
    traceparent: Option<String>,
    groups: GroupTraces,
    instruments: crate::instruments::Instruments,
}

/// Groups whose trace context a replica remembers at most (the oldest are forgotten).
const TRACED_GROUPS: usize = 65_536;

/// The trace context of each group (`group_id`) a replica has handled: the context of its
/// processing span for the group's latest input. A group's outputs carry it whenever they
/// are emitted — from `process`, from `tick`, or later from held state — so one trajectory
/// is one trace through every stage, never parented to whatever message came last. A
/// group first seen in an output (the source admitting it) starts a trace of its own.
#[derive(Default)]
struct GroupTraces {
    by_group: HashMap<String, String>,
    /// Insertion order, for forgetting the oldest.
    order: VecDeque<String>,
}

impl GroupTraces {
    /// The distinct `group_id`s of `batch` (none when it has no such column).
    fn groups_of(batch: &RecordBatch) -> Vec<String> {
        let Some(col) = batch.column_by_name(streamrl_schemas::fields::GROUP_ID) else {
            return Vec::new();
        };
        let Some(col) = col.as_string_opt::<i32>() else {
            return Vec::new();
        };
        let mut out: Vec<String> = Vec::new();
        for g in col.iter().flatten() {
            if !out.iter().any(|o| o == g) {
                out.push(g.to_string());
            }
        }
        out
    }

    fn insert(&mut self, group: String, traceparent: String) {
        if self.by_group.insert(group.clone(), traceparent).is_none() {
            self.order.push_back(group);
            while self.by_group.len() > TRACED_GROUPS {
                match self.order.pop_front() {
                    Some(old) => {
                        self.by_group.remove(&old);
                    }
                    None => break,
                }
            }
        }
    }

    /// Records `traceparent` as the context of `groups` (an input's, [`Self::groups_of`]).
    fn remember(&mut self, groups: &[String], traceparent: &str) {
        for g in groups {
            self.insert(g.clone(), traceparent.to_string());
        }
    }

    /// The context for an output part of one group: the group's, or, for a group not seen
    /// before (the source admitting it), the context of a new root span `span_name` (the
    /// trajectory's first). `None` for rows of no group (metrics, policy) or of several
    /// (the trainer's lineage of a step), which keep the context of the message in hand.
    fn for_output(&mut self, part: &RecordBatch, span_name: &str, instance: &str) -> Option<String> {
        let [g] = <[String; 1]>::try_from(Self::groups_of(part)).ok()?;
        if let Some(tp) = self.by_group.get(&g) {
            return Some(tp.clone());
        }
        let span = telemetry::root_span(span_name, instance, &g, part.num_rows());
        let tp = telemetry::traceparent_for(&span, None).unwrap_or_else(telemetry::new_traceparent);
        self.insert(g, tp.clone());
        Some(tp)
    }
}

impl Runner {
    fn new(producer: Arc<dyn Producer>, cfg: &RunnerConfig, metrics: Arc<StageMetrics>) -> Self {
        Runner {
            producer,
            cfg: cfg.clone(),
            instance: cfg.instance(),
            metrics,
            schemas: cfg
                .inputs
                .iter()
                .chain(&cfg.broadcast)
                .map(|t| (t.name.clone(), t.schema))
                .collect(),
            outputs: cfg.outputs.iter().map(|t| (t.name.clone(), t.clone())).collect(),
            policy_version: None,
            traceparent: None,
            groups: GroupTraces::default(),
            instruments: crate::instruments::Instruments::new(&cfg.stage, cfg.replica),
        }
    }

    /// Calls a stage hook, retrying retryable errors with backoff.
    /// Calls one of the stage's hooks (`start`, `tick`, `close`) with retries, delivers what
    /// it emitted, then settles acknowledgements.
    async fn hook<F>(
        &mut self,
        out: &mut Emitter,
        stage: &mut Box<dyn Stage>,
        acks: &mut Acks,
        consumer: Option<&mut Box<dyn Consumer>>,
        what: &str,
        f: F,
    ) -> Result<()>
    where
        F: for<'a> Fn(&'a mut dyn Stage, &'a mut Emitter) -> StageFuture<'a>,
    {
        self.stage_call(out, what, f, stage).await?;
        self.deliver(out).await?;
        acks.settle(consumer, stage, None, out.take_flags())
    }

    async fn stage_call<F>(&self, out: &mut Emitter, what: &str, f: F, stage: &mut Box<dyn Stage>) -> Result<()>
    where
        F: for<'a> Fn(&'a mut dyn Stage, &'a mut Emitter) -> StageFuture<'a>,
    {
        match self.with_retries(out, |s, o| f(s, o), stage).await {
            Ok(()) => Ok(()),
            Err(e) => Err(crate::Error::Stage {
                stage: format!("{} ({what})", self.instance),
                source: e,
            }),
        }
    }

    async fn with_retries<F>(&self, out: &mut Emitter, f: F, stage: &mut Box<dyn Stage>) -> Result<(), StageError>
    where
        F: for<'a> Fn(&'a mut dyn Stage, &'a mut Emitter) -> StageFuture<'a>,
    {
        let mut backoff = self.cfg.initial_backoff;
        let mut attempt = 0;
        loop {
            let t0 = Instant::now();
            let r = f(stage.as_mut(), out).await;
            self.metrics
                .processing_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match r {
                Ok(()) => return Ok(()),
                Err(e) => {
                    self.metrics.errors.fetch_add(1, Ordering::Relaxed);
                    // Outputs of a failed attempt are discarded: a retry emits them again.
                    out.take();
                    out.take_flags();
                    if e.retry == RetryHint::WithBackoff && attempt < self.cfg.max_retries {
                        attempt += 1;
                        self.metrics.retries.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(stage = %self.instance, attempt, error = %e, "retrying after {backoff:?}");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(self.cfg.max_backoff);
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }

    /// After the stage's `close`: flushes what was produced and closes the inputs; what is
    /// still held stays unacknowledged (and is redelivered).
    async fn stop(
        &mut self,
        acks: &Acks,
        consumer: Option<Box<dyn Consumer>>,
        broadcasts: Vec<(Box<dyn Consumer>, bool)>,
    ) -> Result<()> {
        if !acks.held.is_empty() || !acks.deferred.is_empty() {
            tracing::info!(stage = %self.instance, held = acks.held.len() + acks.deferred.len(), "inputs still held at shutdown stay unacknowledged and will be redelivered");
        }
        self.producer.flush().await?;
        for c in consumer.into_iter().chain(broadcasts.into_iter().map(|(b, _)| b)) {
            c.close().await?;
        }
        tracing::info!(stage = %self.instance, "stopped cleanly");
        Ok(())
    }

    /// The schema of the message's topic and its checked headers; `Err`: why it goes to
    /// the dead-letter topic.
    fn input_headers(&self, msg: &Message) -> std::result::Result<(SchemaId, Headers), String> {
        let schema = self
            .schemas
            .get(&msg.topic)
            .copied()
            .ok_or_else(|| format!("topic `{}` is not an input of this stage", msg.topic))?;
        let headers = Headers::from_wire(&msg.headers).map_err(|e| e.to_string())?;
        codec::check_headers(schema, &headers).map_err(|e| e.to_string())?;
        Ok((schema, headers))
    }

    async fn handle(&mut self, msg: Message, stage: &mut Box<dyn Stage>, out: &mut Emitter) -> Result<()> {
        self.metrics.in_messages.fetch_add(1, Ordering::Relaxed);
        let (schema, headers) = match self.input_headers(&msg) {
            Ok(x) => x,
            Err(reason) => return self.dead_letter(&msg, reason).await,
        };
        if let Some(v) = headers.policy_version {
            self.policy_version = Some(self.policy_version.map_or(v, |p| p.max(v)));
        }
        let span = telemetry::consume_span(
            &self.cfg.span_name,
            &self.instance,
            &msg.topic,
            headers.traceparent.as_deref(),
        );
        span.record("policy_version", headers.policy_version.map(i64::from));
        self.traceparent = telemetry::traceparent_for(&span, headers.traceparent.as_deref());
        if headers.kind == MessageKind::Signal {
            self.metrics.signals.fetch_add(1, Ordering::Relaxed);
            let signal = headers.signal.expect("signal headers carry a signal");
            let topic = msg.topic.clone();
            let r = self
                .with_retries(
                    out,
                    |s, o| {
                        let t = topic.clone();
                        Box::pin(async move { s.signal(&t, signal, o).await })
                    },
                    stage,
                )
                .instrument(span)
                .await;
            return self.finish(&msg, r, out).await;
        }
        let batch = match codec::decode_payload(&msg.payload)
            .and_then(|b| codec::check_schema(schema, b.schema_ref()).map(|_| b))
        {
            Ok(b) => b,
            Err(e) => return self.dead_letter(&msg, e.to_string()).await,
        };
        self.metrics
            .in_rows
            .fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
        span.record("rows", batch.num_rows() as i64);
        let groups = GroupTraces::groups_of(&batch);
        if !groups.is_empty() {
            span.record("group_id", groups.join(",").as_str());
            // A sink (the archive) emits nothing a group's context could go on.
            if let Some(tp) = self.traceparent.as_deref().filter(|_| !self.outputs.is_empty()) {
                self.groups.remember(&groups, tp);
            }
        }
        let input = Input {
            topic: msg.topic.clone(),
            schema,
            partition: msg.partition,
            offset: msg.offset,
            headers,
            batch,
        };
        let t0 = Instant::now();
        let r = self
            .with_retries(
                out,
                |s, o| {
                    let i = input.clone();
                    Box::pin(async move { s.process(i, o).await })
                },
                stage,
            )
            .instrument(span)
            .await;
        self.instruments.processed(t0.elapsed());
        self.finish(&msg, r, out).await
    }

    async fn finish(&mut self, msg: &Message, r: Result<(), StageError>, out: &mut Emitter) -> Result<()> {
        match r {
            Ok(()) => self.deliver(out).await,
            Err(e) if e.domain == ErrorDomain::User => self.dead_letter(msg, e.to_string()).await,
            Err(e) => Err(crate::Error::Stage {
                stage: self.instance.clone(),
                source: e,
            }),
        }
    }

    /// Encodes and sends every pending output, and waits until all are delivered.
    async fn deliver(&mut self, out: &mut Emitter) -> Result<()> {
        if let Some(v) = out.policy_version {
            self.policy_version = Some(v);
        }
        let mut pending: Vec<(DeliveryFuture, u64)> = Vec::new();
        // Set by the stage (`Emitter::set_trace_context`) for outputs of no single group.
        let mut context: Option<String> = None;
        for item in out.take() {
            match item {
                Emitted::Batch { topic, batch } => {
                    let binding = self.outputs.get(&topic).cloned().ok_or_else(|| crate::Error::Stage {
                        stage: self.instance.clone(),
                        source: StageError::internal(format!(
                            "emitted to `{topic}`, which is not among its outputs {:?}",
                            self.cfg.outputs.iter().map(|o| &o.name).collect::<Vec<_>>()
                        )),
                    })?;
                    codec::check_schema(binding.schema, batch.schema_ref()).map_err(|e| crate::Error::Stage {
                        stage: self.instance.clone(),
                        source: StageError::internal(format!("output to `{topic}`: {e}")),
                    })?;
                    for (key, part) in
                        split_by_key(&batch, binding.key.as_deref()).map_err(|e| crate::Error::Stage {
                            stage: self.instance.clone(),
                            source: StageError::internal(format!("output to `{topic}`: {e}")),
                        })?
                    {
                        let payload = codec::encode(&part, self.cfg.compression)?;
                        let mut headers = self.headers(binding.schema);
                        if let Some(tp) = self
                            .groups
                            .for_output(&part, &self.cfg.span_name, &self.instance)
                            .or_else(|| context.clone())
                        {
                            headers.traceparent = Some(tp);
                        }
                        let record = Record {
                            key,
                            headers: headers.to_wire(),
                            payload,
                            partition: None,
                        };
                        let fut = self.producer.send(&topic, record).await?;
                        pending.push((fut, part.num_rows() as u64));
                    }
                }
                Emitted::Signal { topic, signal } => {
                    let binding = self.outputs.get(&topic).cloned().ok_or_else(|| crate::Error::Stage {
                        stage: self.instance.clone(),
                        source: StageError::internal(format!("signalled on `{topic}`, which is not an output")),
                    })?;
                    let mut h = Headers::signal(binding.schema, self.instance.clone(), signal);
                    h.policy_version = self.policy_version;
                    let fut = self
                        .producer
                        .send(&topic, Record::new(Vec::new()).with_headers(h.to_wire()))
                        .await?;
                    pending.push((fut, 0));
                }
                Emitted::Barrier => self.await_delivery(std::mem::take(&mut pending)).await?,
                Emitted::Trace(tp) => context = Some(tp),
            }
        }
        self.await_delivery(pending).await
    }

    /// Waits until the bus has every record in `pending`, and counts them.
    async fn await_delivery(&self, pending: Vec<(DeliveryFuture, u64)>) -> Result<()> {
        let rows: u64 = pending.iter().map(|(_, r)| r).sum();
        let n = pending.len() as u64;
        try_join_all(pending.into_iter().map(|(f, _)| f)).await?;
        self.metrics.out_messages.fetch_add(n, Ordering::Relaxed);
        self.metrics.out_rows.fetch_add(rows, Ordering::Relaxed);
        Ok(())
    }

    fn headers(&self, schema: SchemaId) -> Headers {
        let mut h = Headers::data(schema, self.instance.clone());
        h.policy_version = self.policy_version;
        h.traceparent = self.traceparent.clone().or_else(|| Some(telemetry::new_traceparent()));
        h
    }

    /// Sends a message to the dead-letter topic, whole, with the reason. Delivery is
    /// awaited: the input is acknowledged only once its dead letter is safe.
    async fn dead_letter(&mut self, msg: &Message, reason: String) -> Result<()> {
        tracing::warn!(stage = %self.instance, topic = %msg.topic, partition = msg.partition, offset = msg.offset, %reason, "dead-lettering");
        let headers_json = serde_json::to_string(
            &msg.headers
                .iter()
                .map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned()))
                .collect::<HashMap<_, _>>(),
        )
        .unwrap_or_else(|_| "{}".into());
        let row = DeadLetterRow {
            topic: msg.topic.clone(),
            partition: msg.partition,
            offset: msg.offset,
            key: msg.key.clone(),
            stage: self.instance.clone(),
            reason,
            headers_json,
            payload: msg.payload.to_vec(),
            created_at: streamrl_schemas::now_millis(),
        };
        let batch = DeadLetterRow::to_batch(&[row])?;
        let payload = codec::encode(&batch, self.cfg.compression)?;
        let mut record = Record::new(payload).with_headers(self.headers(SchemaId::DeadLetter).to_wire());
        record.key = msg.key.clone();
        self.producer.send(&self.cfg.dead_letter, record).await?.await?;
        self.metrics.dead_lettered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// One message's worth of rows and its key.
pub type Keyed = (Option<Vec<u8>>, RecordBatch);

/// Splits a batch into one batch per distinct value of `key` (in first-seen order), so
/// rows of one key land in one partition. Without a key the batch goes whole, unkeyed.
pub fn split_by_key(batch: &RecordBatch, key: Option<&str>) -> Result<Vec<Keyed>> {
    let Some(key) = key else {
        return Ok(vec![(None, batch.clone())]);
    };
    let col = batch
        .column_by_name(key)
        .ok_or_else(|| crate::Error::MissingKeyColumn { key: key.to_string() })?;
    // Integer keys split by their decimal text, the bytes a Kafka key would carry.
    let text = match col.data_type() {
        DataType::Utf8 => col.clone(),
        DataType::UInt32 | DataType::UInt64 => arrow::compute::cast(col, &DataType::Utf8)?,
        other => {
            return Err(crate::Error::KeyType {
                key: key.to_string(),
                data_type: other.to_string(),
            });
        }
    };
    let values = text
        .as_string::<i32>()
        .iter()
        .map(|v| v.unwrap_or("").as_bytes().to_vec());
    let mut order: Vec<Vec<u8>> = Vec::new();
    let mut rows: HashMap<Vec<u8>, Vec<u32>> = HashMap::new();
    for (i, v) in values.enumerate() {
        let e = rows.entry(v.clone()).or_default();
        if e.is_empty() {
            order.push(v);
        }
        e.push(i as u32);
    }
    if order.len() == 1 {
        return Ok(vec![(order.pop(), batch.clone())]);
    }
    order
        .into_iter()
        .map(|k| {
            let idx = UInt32Array::from(rows.remove(&k).unwrap_or_default());
            Ok((Some(k), take_record_batch(batch, &idx)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{StringArray, UInt64Array};
    use arrow::datatypes::{Field, Schema};

    #[test]
    fn split_keeps_row_order_within_a_key() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("group_id", DataType::Utf8, false),
            Field::new("n", DataType::UInt64, false),
        ]));
        let b = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from(vec!["a", "b", "a", "c", "b"])),
                Arc::new(UInt64Array::from(vec![0, 1, 2, 3, 4])),
            ],
        )
        .unwrap();
        let parts = split_by_key(&b, Some("group_id")).unwrap();
        let got: Vec<(String, Vec<u64>)> = parts
            .iter()
            .map(|(k, b)| {
                (
                    String::from_utf8(k.clone().unwrap()).unwrap(),
                    b.column(1)
                        .as_primitive::<arrow::datatypes::UInt64Type>()
                        .values()
                        .to_vec(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("a".into(), vec![0, 2]),
                ("b".into(), vec![1, 4]),
                ("c".into(), vec![3])
            ]
        );
        let e = split_by_key(&b, Some("rollout_id")).unwrap_err();
        assert!(
            matches!(&e, crate::Error::MissingKeyColumn { key } if key == "rollout_id"),
            "{e}"
        );
        assert_eq!(split_by_key(&b, None).unwrap().len(), 1);
    }

    #[test]
    fn integer_keys_split_by_their_decimal_text_and_other_types_are_refused() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("step", DataType::UInt64, false),
            Field::new("turn", DataType::UInt32, false),
            Field::new("x", DataType::Float32, false),
        ]));
        let b = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(UInt64Array::from(vec![7, 12, 7])),
                Arc::new(arrow::array::UInt32Array::from(vec![1, 1, 0])),
                Arc::new(arrow::array::Float32Array::from(vec![0.5, 0.5, 0.5])),
            ],
        )
        .unwrap();
        let keys = |key| -> Vec<(Vec<u8>, usize)> {
            split_by_key(&b, Some(key))
                .unwrap()
                .into_iter()
                .map(|(k, b)| (k.unwrap(), b.num_rows()))
                .collect()
        };
        assert_eq!(keys("step"), [(b"7".to_vec(), 2), (b"12".to_vec(), 1)]);
        assert_eq!(keys("turn"), [(b"1".to_vec(), 2), (b"0".to_vec(), 1)]);
        let e = split_by_key(&b, Some("x")).unwrap_err();
        assert!(
            matches!(&e, crate::Error::KeyType { key, data_type } if key == "x" && data_type == "Float32"),
            "{e}"
        );
    }
}

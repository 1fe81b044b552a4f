//! The [`Stage`] trait: what a pipeline stage implements. The runtime ([`crate::runner`])
//! owns the loop around it.

use std::time::Duration;

use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use streamrl_schemas::{Headers, SchemaId, Signal};

use crate::StageError;

/// One decoded input message.
#[derive(Debug, Clone)]
pub struct Input {
    /// Topic it came from.
    pub topic: String,
    /// Its schema.
    pub schema: SchemaId,
    /// Partition and offset it had.
    pub partition: u32,
    /// Offset within the partition.
    pub offset: u64,
    /// Its headers.
    pub headers: Headers,
    /// Its rows.
    pub batch: RecordBatch,
}

impl Input {
    /// An input as the runtime would hand it over (partition and offset 0, data headers).
    pub fn new(topic: impl Into<String>, schema: SchemaId, batch: RecordBatch) -> Self {
        Input {
            topic: topic.into(),
            schema,
            partition: 0,
            offset: 0,
            headers: Headers::data(schema, "test"),
            batch,
        }
    }
}

/// Where a stage puts its outputs. The runtime delivers them, and acknowledges the input
/// only after every output is delivered.
#[derive(Debug, Default)]
pub struct Emitter {
    pub(crate) outputs: Vec<Emitted>,
    pub(crate) policy_version: Option<u32>,
    pub(crate) hold: Option<Option<String>>,
    pub(crate) release: bool,
    pub(crate) release_keys: Vec<String>,
}

/// What [`Emitter`] asks the runtime to do with the current and held inputs.
#[derive(Debug, Default)]
pub(crate) struct Settle {
    /// Hold the current input, under this key if any.
    pub hold: Option<Option<String>>,
    /// Acknowledge every held input.
    pub release_all: bool,
    /// Acknowledge the inputs held under these keys.
    pub release_keys: Vec<String>,
}

#[derive(Debug)]
pub(crate) enum Emitted {
    Batch { topic: String, batch: RecordBatch },
    Signal { topic: String, signal: Signal },
    Barrier,
    Trace(String),
}

impl Emitter {
    /// Emits rows to an output topic. The runtime splits the batch by the topic's key
    /// column, so each message holds rows of one key.
    pub fn emit(&mut self, topic: impl Into<String>, batch: RecordBatch) {
        if batch.num_rows() > 0 {
            self.outputs.push(Emitted::Batch {
                topic: topic.into(),
                batch,
            });
        }
    }

    /// Emits an in-band signal on an output topic (to every partition).
    pub fn signal(&mut self, topic: impl Into<String>, signal: Signal) {
        self.outputs.push(Emitted::Signal {
            topic: topic.into(),
            signal,
        });
    }

    /// Orders delivery: everything emitted before the barrier is delivered (acknowledged
    /// by the bus) before anything emitted after it is sent. Without one, outputs of a call
    /// to different topics land in any order. The trainer puts one between a version's
    /// lineage rows and the version itself, so a version on `policy` implies its lineage
    /// on `trained`, whatever instant the process is killed at.
    pub fn barrier(&mut self) {
        self.outputs.push(Emitted::Barrier);
    }

    /// Outputs emitted after this call that belong to no single group (a policy version,
    /// metric rows) carry this trace context, a W3C `traceparent`, instead of the input's:
    /// the trainer's step span is the parent of the version it publishes. Rows of one group
    /// keep their group's trace.
    pub fn set_trace_context(&mut self, traceparent: impl Into<String>) {
        self.outputs.push(Emitted::Trace(traceparent.into()));
    }

    /// Stamps outputs from now on with this policy version header.
    pub fn set_policy_version(&mut self, version: u32) {
        self.policy_version = Some(version);
    }

    /// Keeps the current input unacknowledged after `process` returns: the stage still
    /// holds its rows in memory (a buffer, a group waiting for its last sample). Held
    /// inputs are acknowledged at the next [`release_held`](Emitter::release_held); if the
    /// stage dies first, they are delivered again.
    pub fn hold(&mut self) {
        self.hold = Some(None);
    }

    /// Like [`hold`](Emitter::hold), but under `key`, so the input can be acknowledged on
    /// its own with [`release`](Emitter::release) while others stay held (a rollout
    /// stage holds each prompt until its whole group has been emitted).
    pub fn hold_as(&mut self, key: impl Into<String>) {
        self.hold = Some(Some(key.into()));
    }

    /// Acknowledges the inputs held under `key` once this call's outputs are delivered.
    pub fn release(&mut self, key: impl Into<String>) {
        self.release_keys.push(key.into());
    }

    /// Everything held so far (and the current input) is now safe: acknowledge it once
    /// this call's outputs are delivered.
    pub fn release_held(&mut self) {
        self.release = true;
    }

    /// Takes the pending output batches (signals are dropped) — for driving a stage
    /// outside the runtime, e.g. in tests.
    pub fn drain(&mut self) -> Vec<(String, RecordBatch)> {
        self.take()
            .into_iter()
            .filter_map(|e| match e {
                Emitted::Batch { topic, batch } => Some((topic, batch)),
                Emitted::Signal { .. } | Emitted::Barrier | Emitted::Trace(_) => None,
            })
            .collect()
    }

    /// Whether the current input is held, and under which key (`Some(None)`: unkeyed).
    pub fn holding(&self) -> Option<Option<&str>> {
        self.hold.as_ref().map(|k| k.as_deref())
    }

    /// Keys released by this call so far.
    pub fn released(&self) -> &[String] {
        &self.release_keys
    }

    /// Whether this call released every held input.
    pub fn released_all(&self) -> bool {
        self.release
    }

    /// Number of pending outputs.
    pub fn len(&self) -> usize {
        self.outputs.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.outputs.is_empty()
    }

    pub(crate) fn take_flags(&mut self) -> Settle {
        Settle {
            hold: self.hold.take(),
            release_all: std::mem::take(&mut self.release),
            release_keys: std::mem::take(&mut self.release_keys),
        }
    }

    pub(crate) fn take(&mut self) -> Vec<Emitted> {
        std::mem::take(&mut self.outputs)
    }
}

/// A pipeline stage. Only [`process`](Stage::process) is required; the hooks default to
/// doing nothing. Expensive setup belongs in the stage's constructor (build), not here.
///
/// ```
/// use arrow::record_batch::RecordBatch;
/// use streamrl_runtime::{Emitter, Input, Stage, StageError};
///
/// /// Forwards every batch unchanged.
/// struct Forward { to: String }
///
/// #[async_trait::async_trait]
/// impl Stage for Forward {
///     async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
///         out.emit(self.to.clone(), input.batch);
///         Ok(())
///     }
/// }
/// ```
#[async_trait]
pub trait Stage: Send {
    /// Processes one input batch, emitting outputs. A `User` error sends the input to the
    /// dead-letter topic; a retryable error is retried with backoff; anything else stops
    /// the stage without acknowledging the input.
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError>;

    /// Called once before the first input.
    async fn start(&mut self, _out: &mut Emitter) -> Result<(), StageError> {
        Ok(())
    }

    /// How often [`tick`](Stage::tick) runs; `None` never.
    fn tick_interval(&self) -> Option<Duration> {
        None
    }

    /// Whether the stage takes another data input now (default: always). A stage with
    /// bounded work in hand (the rollout stage with every generation slot full) says no;
    /// the runner then stops reading its data inputs but still delivers broadcast inputs,
    /// in-band signals and ticks, and the stage works off what it holds in
    /// [`tick`](Stage::tick) (so a stage that can say no must have a tick).
    fn ready(&self) -> bool {
        true
    }

    /// Time-driven work (flushes, timeouts).
    async fn tick(&mut self, _out: &mut Emitter) -> Result<(), StageError> {
        Ok(())
    }

    /// An in-band signal arrived on `topic`.
    async fn signal(&mut self, _topic: &str, _signal: Signal, _out: &mut Emitter) -> Result<(), StageError> {
        Ok(())
    }

    /// Called after every output of the last call (`process`, `tick`, `signal`, `start`
    /// or `close`) was delivered, before the inputs it covers are acknowledged: the place
    /// to make durable what depends on those outputs being out (the trainer records the
    /// version it has published, so a restart does not publish it again).
    fn delivered(&mut self) -> Result<(), StageError> {
        Ok(())
    }

    /// State the runtime persists (see `RunnerConfig::state_dir`): written after a call's
    /// outputs are delivered and before its inputs are acknowledged, whenever no input
    /// is held; restored before `start`.
    fn snapshot(&self) -> Option<Vec<u8>> {
        None
    }

    /// Restores a snapshot.
    fn restore(&mut self, _state: &[u8]) -> Result<(), StageError> {
        Ok(())
    }

    /// Called once at shutdown, after the last input; may emit final outputs.
    async fn close(&mut self, _out: &mut Emitter) -> Result<(), StageError> {
        Ok(())
    }
}

/// A closure is a stage: `|input| -> Result<Vec<(topic, batch)>, StageError>`.
pub struct FnStage<F>(pub F);

#[async_trait]
impl<F> Stage for FnStage<F>
where
    F: FnMut(Input) -> Result<Vec<(String, RecordBatch)>, StageError> + Send,
{
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        for (topic, batch) in (self.0)(input)? {
            out.emit(topic, batch);
        }
        Ok(())
    }
}

//! Typed Rust rows, one per topic, converting to and from the topic's record batch.

use arrow::datatypes::FieldRef;
use arrow::record_batch::RecordBatch;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::{Error, Result, SchemaId};

/// A row type bound to one topic schema.
pub trait TopicRow: Serialize + DeserializeOwned + Sized {
    /// The schema these rows make.
    const SCHEMA: SchemaId;

    /// Rows to one record batch with exactly [`Self::SCHEMA`]'s Arrow schema.
    fn to_batch(rows: &[Self]) -> Result<RecordBatch> {
        let schema = Self::SCHEMA.schema();
        let fields: Vec<FieldRef> = schema.fields().iter().cloned().collect();
        serde_arrow::to_record_batch(&fields, &rows).map_err(|e| Error::Rows {
            schema: Self::SCHEMA,
            reason: e.to_string(),
        })
    }

    /// A record batch of this schema back to rows. A batch of another schema is an error
    /// that lists the differences.
    fn from_batch(batch: &RecordBatch) -> Result<Vec<Self>> {
        crate::codec::check_schema(Self::SCHEMA, batch.schema_ref())?;
        serde_arrow::from_record_batch(batch).map_err(|e| Error::Rows {
            schema: Self::SCHEMA,
            reason: e.to_string(),
        })
    }
}

/// A tool call parsed from a completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Call id, unique within the completion.
    pub id: String,
    /// Tool name.
    pub name: String,
    /// Arguments as JSON text.
    pub arguments: String,
}

/// The output of one executed tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolOutput {
    /// Id of the call this answers.
    pub call_id: String,
    /// Tool name.
    pub name: String,
    /// Output text rendered back to the model.
    pub output: String,
    /// Execution status (same vocabulary as `exec_status`).
    pub status: String,
}

/// One reward function's contribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardComponent {
    /// Reward function name.
    pub name: String,
    /// Value it returned (0 when it failed).
    pub value: f32,
    /// Its weight in the rubric.
    pub weight: f32,
    /// Why it gave this value, or its error.
    pub reason: String,
}

/// `prompts`: one message per group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptRow {
    /// Training run.
    pub run_id: String,
    /// Problem id within its environment.
    pub problem_id: String,
    /// Group id (partition key).
    pub group_id: String,
    /// Environment name.
    pub env: String,
    /// Trainer step this group is admitted for.
    pub step: u64,
    /// How many samples to generate.
    pub group_size: u32,
    /// Rendered prompt text.
    pub prompt: String,
    /// Prompt token ids.
    pub prompt_token_ids: Vec<u32>,
    /// Reference answer, if any.
    pub answer: Option<String>,
    /// Environment task data as JSON, if any.
    pub info: Option<String>,
    /// Sampling temperature.
    pub temperature: f32,
    /// Maximum completion tokens.
    pub max_tokens: u32,
    /// Creation time, ms since epoch.
    pub created_at: i64,
}

macro_rules! trajectory_row {
    ($(#[$meta:meta])* $name:ident, $schema:expr, { $($(#[$fmeta:meta])* $field:ident : $ty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        pub struct $name {
            /// Training run.
            pub run_id: String,
            /// Problem id within its environment.
            pub problem_id: String,
            /// Group id (partition key up to the mask stage).
            pub group_id: String,
            /// Trajectory id, stable across turns.
            pub rollout_id: String,
            /// Sample id, unique per row; downstream deduplication key.
            pub sample_id: String,
            /// Environment name.
            pub env: String,
            /// Trainer step the group was admitted for.
            pub step: u64,
            /// Index of the sample within its group.
            pub sample_index: u32,
            /// Samples in the group.
            pub group_size: u32,
            /// Turn index, from 0.
            pub turn: u32,
            /// Rendered prompt text.
            pub prompt: String,
            /// Prompt token ids.
            pub prompt_token_ids: Vec<u32>,
            /// Completion text.
            pub completion: String,
            /// Completion token ids.
            pub completion_token_ids: Vec<u32>,
            /// Per-token sampler logprobs.
            pub completion_logprobs: Vec<f32>,
            /// Per-token policy versions.
            pub completion_versions: Vec<u32>,
            /// Per completion token, per layer, the `top_k` experts the sampler routed it
            /// to (255: not recorded); empty for a dense model. Routing replay reads it.
            pub completion_routes: Vec<u8>,
            /// Per-token loss mask (false for tool output tokens).
            pub loss_mask: Vec<bool>,
            /// stop, length, tool_call or cancelled.
            pub finish_reason: String,
            /// Tool calls found in the completion.
            pub tool_calls: Vec<ToolCall>,
            /// Reference answer, if any.
            pub answer: Option<String>,
            /// Environment task data as JSON, if any.
            pub info: Option<String>,
            /// Sampling temperature.
            pub temperature: f32,
            /// Generation start, ms since epoch.
            pub started_at: i64,
            /// Generation end, ms since epoch.
            pub finished_at: i64,
            $($(#[$fmeta])* pub $field: $ty,)*
            /// Creation time, ms since epoch.
            pub created_at: i64,
        }

        impl TopicRow for $name {
            const SCHEMA: SchemaId = $schema;
        }
    };
}

/// Builds one trajectory row type (`RolloutRow`, `ContinuationRow`, `ExecutedRow`,
/// `ScoredRow`) from another: the fields every trajectory row shares are moved from
/// `$src`, the rest are given. The one place that lists the shared fields for conversions.
///
/// ```
/// use streamrl_schemas::{ExecutedRow, RolloutRow, trajectory_into};
/// # fn f(r: RolloutRow) -> ExecutedRow {
/// trajectory_into!(r, ExecutedRow {
///     tool_outputs: vec![], exec_status: "skipped".into(), exit_code: None, stdout: String::new(),
///     stderr: String::new(), exec_duration_ms: 0, tests_passed: 0, tests_total: 0, created_at: 0,
/// })
/// # }
/// ```
#[macro_export]
macro_rules! trajectory_into {
    ($src:expr, $dst:ident { $($field:ident $(: $value:expr)?),* $(,)? }) => {{
        let s = $src;
        $dst {
            run_id: s.run_id,
            problem_id: s.problem_id,
            group_id: s.group_id,
            rollout_id: s.rollout_id,
            sample_id: s.sample_id,
            env: s.env,
            step: s.step,
            sample_index: s.sample_index,
            group_size: s.group_size,
            turn: s.turn,
            prompt: s.prompt,
            prompt_token_ids: s.prompt_token_ids,
            completion: s.completion,
            completion_token_ids: s.completion_token_ids,
            completion_logprobs: s.completion_logprobs,
            completion_versions: s.completion_versions,
            completion_routes: s.completion_routes,
            loss_mask: s.loss_mask,
            finish_reason: s.finish_reason,
            tool_calls: s.tool_calls,
            answer: s.answer,
            info: s.info,
            temperature: s.temperature,
            started_at: s.started_at,
            finished_at: s.finished_at,
            $($field $(: $value)?,)*
        }
    }};
}

trajectory_row!(
    /// `rollouts`: one generated sample (one turn of a trajectory).
    RolloutRow, SchemaId::Rollouts, {}
);

trajectory_row!(
    /// `continuations`: a trajectory to extend with its tool outputs.
    ContinuationRow, SchemaId::Continuations, {
        /// Outputs of the tool calls of the last turn.
        tool_outputs: Vec<ToolOutput>,
    }
);

trajectory_row!(
    /// `executed`: a rollout after sandbox execution (or pass-through).
    ExecutedRow, SchemaId::Executed, {
        /// Outputs of executed tool calls.
        tool_outputs: Vec<ToolOutput>,
        /// ok, nonzero_exit, timeout, memory, output_limit, killed, internal_error or skipped.
        exec_status: String,
        /// Exit code, when a process ran to an exit.
        exit_code: Option<i32>,
        /// Captured standard output (capped).
        stdout: String,
        /// Captured standard error (capped).
        stderr: String,
        /// Execution wall time in ms.
        exec_duration_ms: u64,
        /// Unit tests passed.
        tests_passed: u32,
        /// Unit tests run.
        tests_total: u32,
    }
);

trajectory_row!(
    /// `scored`: an executed rollout with its reward.
    ScoredRow, SchemaId::Scored, {
        /// Outputs of executed tool calls.
        tool_outputs: Vec<ToolOutput>,
        /// Execution status.
        exec_status: String,
        /// Exit code, when a process ran to an exit.
        exit_code: Option<i32>,
        /// Captured standard output (capped).
        stdout: String,
        /// Captured standard error (capped).
        stderr: String,
        /// Execution wall time in ms.
        exec_duration_ms: u64,
        /// Unit tests passed.
        tests_passed: u32,
        /// Unit tests run.
        tests_total: u32,
        /// Weighted sum of the components.
        reward: f32,
        /// Every reward function's value and reason.
        reward_components: Vec<RewardComponent>,
    }
);

/// `samples`: a trainable sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleRow {
    /// Training run.
    pub run_id: String,
    /// Problem id.
    pub problem_id: String,
    /// Group id.
    pub group_id: String,
    /// Trajectory id.
    pub rollout_id: String,
    /// Sample id (deduplication key).
    pub sample_id: String,
    /// Environment name.
    pub env: String,
    /// Step the group was admitted for.
    pub step: u64,
    /// Turn index.
    pub turn: u32,
    /// Prompt token ids.
    pub prompt_token_ids: Vec<u32>,
    /// Completion token ids.
    pub completion_token_ids: Vec<u32>,
    /// Per-token sampler logprobs.
    pub completion_logprobs: Vec<f32>,
    /// Per-token policy versions.
    pub completion_versions: Vec<u32>,
    /// The sampler's expert routes per completion token (as in the rollout rows).
    pub completion_routes: Vec<u8>,
    /// Per-token loss mask over the completion.
    pub loss_mask: Vec<bool>,
    /// Why generation stopped.
    pub finish_reason: String,
    /// Total reward.
    pub reward: f32,
    /// Advantage broadcast to every trainable token.
    pub advantage: f32,
    /// Creation time, ms since epoch.
    pub created_at: i64,
}

/// `policy`: a new policy version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyRow {
    /// Training run.
    pub run_id: String,
    /// Policy version.
    pub version: u32,
    /// Trainer step that produced it.
    pub step: u64,
    /// Checkpoint location (`file://...`).
    pub uri: String,
    /// SHA-256 of the checkpoint's weights, hex.
    pub sha256: String,
    /// Creation time, ms since epoch.
    pub created_at: i64,
}

/// `trained`: lineage. One row per sample the trainer consumed for policy `version`:
/// trained into it, or dropped with the reason; and one row per group the step waited
/// for in vain (`timed_out`, with an empty `sample_id`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainedRow {
    /// Training run.
    pub run_id: String,
    /// The policy version this row belongs to (trained into it, or dropped while the
    /// trainer made it).
    pub version: u32,
    /// The step the sample's group was admitted for.
    pub step: u64,
    /// Its group.
    pub group_id: String,
    /// The sample (empty on a group's `timed_out` row).
    pub sample_id: String,
    /// What happened to it (see [`Outcome`]).
    pub outcome: String,
    /// The `created_at` of the `samples` row consumed: after a crash upstream, `samples`
    /// may hold regenerated copies of one sample id, and (`sample_id`,
    /// `sample_created_at`) names the copy this row is about.
    pub sample_created_at: i64,
    /// Creation time, ms since epoch.
    pub created_at: i64,
}

/// What the trainer did with a sample, as written in [`TrainedRow::outcome`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Trained into the version.
    Trained,
    /// Consumed but untrainable: no token in its loss mask (e.g. a zero-variance group).
    Filtered,
    /// Dropped: its oldest token came from a policy older than `max_off_policy_steps`.
    Stale,
    /// Dropped: a copy of a sample already consumed (a redelivery or a regenerated copy).
    Duplicate,
    /// Dropped: its step is older than the trainer's deduplication window, so it can no
    /// longer be told apart from a copy (an old group regenerated after a restart).
    Superseded,
    /// A whole group, not a sample: its step waited `step_timeout_secs` for it and was
    /// trained without it. If it comes later, its samples get rows of their own (trained,
    /// filtered or stale with a later version, or superseded).
    TimedOut,
}

impl Outcome {
    /// The name written on the topic.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Trained => "trained",
            Outcome::Filtered => "filtered",
            Outcome::Stale => "stale",
            Outcome::Duplicate => "duplicate",
            Outcome::Superseded => "superseded",
            Outcome::TimedOut => "timed_out",
        }
    }
}

/// `metrics`: one metric value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricRow {
    /// Training run.
    pub run_id: String,
    /// Trainer step (or the stage's own counter).
    pub step: u64,
    /// Stage that reported it.
    pub stage: String,
    /// Metric name.
    pub name: String,
    /// Value.
    pub value: f64,
    /// Creation time, ms since epoch.
    pub created_at: i64,
}

/// `dead_letter`: a message that could not be processed, kept whole with the reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetterRow {
    /// Topic it came from.
    pub topic: String,
    /// Partition it came from.
    pub partition: u32,
    /// Its offset there.
    pub offset: u64,
    /// Its key.
    #[serde(with = "opt_bytes")]
    pub key: Option<Vec<u8>>,
    /// Stage that gave up on it.
    pub stage: String,
    /// Why.
    pub reason: String,
    /// Its headers as a JSON object (values lossy UTF-8).
    pub headers_json: String,
    /// Its payload, byte for byte.
    #[serde(with = "bytes_field")]
    pub payload: Vec<u8>,
    /// When it was dead-lettered, ms since epoch.
    pub created_at: i64,
}

macro_rules! impl_row {
    ($($t:ty => $s:expr),*) => { $(impl TopicRow for $t { const SCHEMA: SchemaId = $s; })* };
}
impl_row!(PromptRow => SchemaId::Prompts, SampleRow => SchemaId::Samples, PolicyRow => SchemaId::Policy,
          TrainedRow => SchemaId::Trained,
          MetricRow => SchemaId::Metrics, DeadLetterRow => SchemaId::DeadLetter);

// serde_arrow maps `serde_bytes`-style byte sequences onto Binary columns.
mod bytes_field {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        Ok(ByteBuf::deserialize(d)?.0)
    }
    pub struct ByteBuf(pub Vec<u8>);
    impl<'de> Deserialize<'de> for ByteBuf {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = ByteBuf;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("bytes")
                }
                fn visit_bytes<E>(self, v: &[u8]) -> Result<ByteBuf, E> {
                    Ok(ByteBuf(v.to_vec()))
                }
                fn visit_byte_buf<E>(self, v: Vec<u8>) -> Result<ByteBuf, E> {
                    Ok(ByteBuf(v))
                }
                fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<ByteBuf, A::Error> {
                    let mut out = Vec::new();
                    while let Some(b) = a.next_element::<u8>()? {
                        out.push(b);
                    }
                    Ok(ByteBuf(out))
                }
            }
            d.deserialize_byte_buf(V)
        }
    }
}

mod opt_bytes {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_some(&Wrap(b)),
            None => s.serialize_none(),
        }
    }
    struct Wrap<'a>(&'a [u8]);
    impl serde::Serialize for Wrap<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(self.0)
        }
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        Ok(Option::<super::bytes_field::ByteBuf>::deserialize(d)?.map(|b| b.0))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn rollout(i: u32) -> RolloutRow {
        RolloutRow {
            run_id: "run".into(),
            problem_id: format!("arith-{i}"),
            group_id: format!("g{}", i / 4),
            rollout_id: format!("r{i}"),
            sample_id: format!("r{i}-t0"),
            env: "arith".into(),
            step: 7,
            sample_index: i % 4,
            group_size: 4,
            turn: 0,
            prompt: "2+2=".into(),
            prompt_token_ids: vec![1, 2, 3],
            completion: "4".into(),
            completion_token_ids: vec![9, 10],
            completion_logprobs: vec![-0.5, -0.25],
            completion_versions: vec![3, 4],
            completion_routes: vec![0, 3, 1, 255],
            loss_mask: vec![true, false],
            finish_reason: "stop".into(),
            tool_calls: vec![ToolCall {
                id: "c0".into(),
                name: "python".into(),
                arguments: "{}".into(),
            }],
            answer: if i.is_multiple_of(2) { Some("4".into()) } else { None },
            info: None,
            temperature: 1.0,
            started_at: 1_700_000_000_000,
            finished_at: 1_700_000_000_500 + i as i64,
            created_at: 1_700_000_001_000,
        }
    }

    fn round_trip<T: TopicRow + PartialEq + std::fmt::Debug>(rows: Vec<T>) {
        let batch = T::to_batch(&rows).unwrap();
        assert_eq!(batch.schema(), T::SCHEMA.schema(), "{}", T::SCHEMA);
        assert_eq!(batch.num_rows(), rows.len());
        assert_eq!(T::from_batch(&batch).unwrap(), rows, "{}", T::SCHEMA);
    }

    /// Rollout `i` as a later stage sees it: ended by `finish`, with `answer`.
    fn ended(i: u32, finish: &str, answer: Option<&str>) -> RolloutRow {
        let mut r = rollout(i);
        r.finish_reason = finish.into();
        r.answer = answer.map(Into::into);
        (r.started_at, r.finished_at) = (1, 2);
        r
    }

    fn tool_outputs() -> Vec<ToolOutput> {
        vec![ToolOutput {
            call_id: "c0".into(),
            name: "python".into(),
            output: "4\n".into(),
            status: "ok".into(),
        }]
    }

    #[test]
    fn rollout_and_continuation_rows_round_trip() {
        round_trip((0..5).map(rollout).collect());
        round_trip(vec![trajectory_into!(
            ended(1, "tool_call", None),
            ContinuationRow {
                tool_outputs: tool_outputs(),
                created_at: 3,
            }
        )]);
    }

    #[test]
    fn executed_and_scored_rows_round_trip() {
        // Empty lists and strings survive as such.
        let mut empty = ended(0, "length", None);
        empty.prompt = String::new();
        empty.completion = String::new();
        (empty.prompt_token_ids, empty.completion_token_ids) = (vec![], vec![]);
        (empty.completion_logprobs, empty.completion_versions, empty.loss_mask) = (vec![], vec![], vec![]);
        empty.completion_routes = vec![];
        empty.tool_calls = vec![];
        round_trip(vec![trajectory_into!(
            empty,
            ExecutedRow {
                tool_outputs: vec![],
                exec_status: "ok".into(),
                exit_code: Some(0),
                stdout: "passed".into(),
                stderr: String::new(),
                exec_duration_ms: 12,
                tests_passed: 3,
                tests_total: 3,
                created_at: 0,
            }
        )]);
        let mut scored = ended(1, "stop", Some("4"));
        scored.tool_calls = vec![];
        let component = |name: &str, value: f32, reason: &str| RewardComponent {
            name: name.into(),
            value,
            weight: 0.5,
            reason: reason.into(),
        };
        round_trip(vec![trajectory_into!(
            scored,
            ScoredRow {
                tool_outputs: tool_outputs(),
                exec_status: "timeout".into(),
                exit_code: None,
                stdout: String::new(),
                stderr: "killed after 10s".into(),
                exec_duration_ms: 10_000,
                tests_passed: 1,
                tests_total: 3,
                reward: 0.5,
                reward_components: vec![
                    component("correct", 1.0, "4 == 4"),
                    component("format", 0.0, "no <answer>")
                ],
                created_at: 3,
            }
        )]);
    }

    #[test]
    fn prompt_and_sample_rows_round_trip() {
        round_trip(vec![PromptRow {
            run_id: "run".into(),
            problem_id: "p".into(),
            group_id: "g".into(),
            env: "arith".into(),
            step: 1,
            group_size: 8,
            prompt: "1+1=".into(),
            prompt_token_ids: vec![5, 6],
            answer: Some("2".into()),
            info: Some("{\"level\":1}".into()),
            temperature: 0.7,
            max_tokens: 16,
            created_at: 5,
        }]);
        round_trip(vec![SampleRow {
            run_id: "run".into(),
            problem_id: "p".into(),
            group_id: "g".into(),
            rollout_id: "r".into(),
            sample_id: "s".into(),
            env: "arith".into(),
            step: 2,
            turn: 0,
            prompt_token_ids: vec![1],
            completion_token_ids: vec![2, 3],
            completion_logprobs: vec![-0.1, -0.2],
            completion_versions: vec![1, 2],
            completion_routes: vec![2, 7, 255, 255],
            loss_mask: vec![true, true],
            finish_reason: "stop".into(),
            reward: 1.0,
            advantage: 0.25,
            created_at: 9,
        }]);
    }

    #[test]
    fn policy_trained_and_metric_rows_round_trip() {
        round_trip(vec![PolicyRow {
            run_id: "run".into(),
            version: 4,
            step: 4,
            uri: "file:///tmp/x".into(),
            sha256: "00".repeat(32),
            created_at: 1,
        }]);
        round_trip(vec![TrainedRow {
            run_id: "run".into(),
            version: 5,
            step: 4,
            group_id: "run-g0000001".into(),
            sample_id: "run-g0000001-s3".into(),
            outcome: Outcome::Stale.name().into(),
            sample_created_at: 1,
            created_at: 2,
        }]);
        round_trip(vec![MetricRow {
            run_id: "run".into(),
            step: 3,
            stage: "trainer".into(),
            name: "loss".into(),
            value: -0.125,
            created_at: 1,
        }]);
    }

    #[test]
    fn dead_letter_rows_round_trip() {
        round_trip(vec![
            DeadLetterRow {
                topic: "rollouts".into(),
                partition: 2,
                offset: 41,
                key: Some(b"g1".to_vec()),
                stage: "reward".into(),
                reason: "payload truncated".into(),
                headers_json: "{}".into(),
                payload: vec![0, 159, 146, 150],
                created_at: 1,
            },
            DeadLetterRow {
                topic: "t".into(),
                partition: 0,
                offset: 0,
                key: None,
                stage: "s".into(),
                reason: "r".into(),
                headers_json: "{}".into(),
                payload: vec![],
                created_at: 2,
            },
        ]);
    }

    #[test]
    fn rows_of_another_schema_are_refused_with_the_difference() {
        let batch = RolloutRow::to_batch(&[rollout(0)]).unwrap();
        let err = ScoredRow::from_batch(&batch).unwrap_err().to_string();
        assert!(err.contains("scored") && err.contains("reward"), "{err}");
    }
}

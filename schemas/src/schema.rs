//! The Arrow schema of every topic, and its fingerprint.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef, TimeUnit};
use sha2::{Digest, Sha256};

use crate::fields as f;
use crate::{Error, Result};

/// The schema a topic carries. Topic names are free in topology.yaml; each topic declares
/// one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SchemaId {
    /// One message per group: a problem to sample `group_size` times.
    Prompts,
    /// One row per generated sample (one turn of a trajectory).
    Rollouts,
    /// A trajectory to extend after a tool call (tool output appended).
    Continuations,
    /// A rollout after sandbox execution (or pass-through).
    Executed,
    /// An executed rollout with its reward and reward components.
    Scored,
    /// A trainable sample: tokens, sampler logprobs, loss mask, advantage.
    Samples,
    /// A new policy version in the checkpoint store.
    Policy,
    /// Lineage: per policy version, every sample the trainer trained or dropped, and why.
    Trained,
    /// One metric value.
    Metrics,
    /// A message that could not be processed, with the reason.
    DeadLetter,
}

impl SchemaId {
    /// Every schema, in pipeline order.
    pub const ALL: [SchemaId; 10] = [
        SchemaId::Prompts,
        SchemaId::Rollouts,
        SchemaId::Continuations,
        SchemaId::Executed,
        SchemaId::Scored,
        SchemaId::Samples,
        SchemaId::Policy,
        SchemaId::Trained,
        SchemaId::Metrics,
        SchemaId::DeadLetter,
    ];

    /// The schema's name as written in topology.yaml and in the `streamrl-schema` header.
    pub fn name(self) -> &'static str {
        match self {
            SchemaId::Prompts => "prompts",
            SchemaId::Rollouts => "rollouts",
            SchemaId::Continuations => "continuations",
            SchemaId::Executed => "executed",
            SchemaId::Scored => "scored",
            SchemaId::Samples => "samples",
            SchemaId::Policy => "policy",
            SchemaId::Trained => "trained",
            SchemaId::Metrics => "metrics",
            SchemaId::DeadLetter => "dead_letter",
        }
    }

    /// The Arrow schema (built once).
    pub fn schema(self) -> SchemaRef {
        static SCHEMAS: OnceLock<Vec<SchemaRef>> = OnceLock::new();
        let all = SCHEMAS.get_or_init(|| {
            SchemaId::ALL
                .iter()
                .map(|s| Arc::new(Schema::new(s.build_fields())))
                .collect()
        });
        all[self as usize].clone()
    }

    /// First 16 hex digits of the SHA-256 of the schema's canonical form (field names,
    /// types and nullability, in order). Any change to a schema changes its fingerprint.
    pub fn fingerprint(self) -> &'static str {
        static PRINTS: OnceLock<Vec<String>> = OnceLock::new();
        let all = PRINTS.get_or_init(|| SchemaId::ALL.iter().map(|s| fingerprint_of(&s.schema())).collect());
        &all[self as usize]
    }

    fn build_fields(self) -> Vec<Field> {
        let mut v = match self {
            SchemaId::Prompts => prompt_fields(),
            SchemaId::Rollouts => trajectory_fields(),
            SchemaId::Continuations => {
                let mut v = trajectory_fields();
                v.push(tool_outputs_field());
                v
            }
            SchemaId::Executed => {
                let mut v = trajectory_fields();
                v.extend(execution_fields());
                v
            }
            SchemaId::Scored => {
                let mut v = trajectory_fields();
                v.extend(execution_fields());
                v.push(Field::new(f::REWARD, DataType::Float32, false));
                v.push(reward_components_field());
                v
            }
            SchemaId::Samples => sample_fields(),
            SchemaId::Policy => vec![
                utf8(f::RUN_ID),
                u32f(f::VERSION),
                u64f(f::STEP),
                utf8(f::URI),
                utf8(f::SHA256),
            ],
            SchemaId::Trained => vec![
                utf8(f::RUN_ID),
                u32f(f::VERSION),
                u64f(f::STEP),
                utf8(f::GROUP_ID),
                utf8(f::SAMPLE_ID),
                utf8(f::OUTCOME),
                timestamp(f::SAMPLE_CREATED_AT),
            ],
            SchemaId::Metrics => vec![
                utf8(f::RUN_ID),
                u64f(f::STEP),
                utf8(f::STAGE),
                utf8(f::NAME),
                Field::new(f::VALUE, DataType::Float64, false),
            ],
            SchemaId::DeadLetter => vec![
                utf8(f::TOPIC),
                u32f(f::PARTITION),
                u64f(f::OFFSET),
                Field::new(f::KEY, DataType::Binary, true),
                utf8(f::STAGE),
                utf8(f::REASON),
                utf8(f::HEADERS_JSON),
                Field::new(f::PAYLOAD, DataType::Binary, false),
            ],
        };
        v.push(timestamp(f::CREATED_AT));
        v
    }
}

impl fmt::Display for SchemaId {
    fn fmt(&self, fm: &mut fmt::Formatter<'_>) -> fmt::Result {
        fm.write_str(self.name())
    }
}

impl FromStr for SchemaId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        SchemaId::ALL
            .into_iter()
            .find(|id| id.name() == s)
            .ok_or_else(|| Error::UnknownSchema(s.to_string()))
    }
}

fn fingerprint_of(schema: &Schema) -> String {
    let mut h = Sha256::new();
    for field in schema.fields() {
        h.update(format!(
            "{}:{}:{};",
            field.name(),
            field.data_type(),
            field.is_nullable()
        ));
    }
    hex::encode(&h.finalize()[..8])
}

/// Columns shared by rollouts, continuations, executed and scored: one trajectory turn.
fn trajectory_fields() -> Vec<Field> {
    let mut v = sample_identity_fields();
    v.extend([
        u32f(f::SAMPLE_INDEX),
        u32f(f::GROUP_SIZE),
        u32f(f::TURN),
        utf8(f::PROMPT),
        list(f::PROMPT_TOKEN_IDS, DataType::UInt32),
        utf8(f::COMPLETION),
    ]);
    v.extend(completion_fields());
    v.extend([
        tool_calls_field(),
        utf8_null(f::ANSWER),
        utf8_null(f::INFO),
        Field::new(f::TEMPERATURE, DataType::Float32, false),
        timestamp(f::STARTED_AT),
        timestamp(f::FINISHED_AT),
    ]);
    v
}

/// The columns that name one sample and where it comes from (rollouts and samples alike).
fn sample_identity_fields() -> Vec<Field> {
    vec![
        utf8(f::RUN_ID),
        utf8(f::PROBLEM_ID),
        utf8(f::GROUP_ID),
        utf8(f::ROLLOUT_ID),
        utf8(f::SAMPLE_ID),
        utf8(f::ENV),
        u64f(f::STEP),
    ]
}

/// A completion's tokens with the sampler's logprobs, versions and expert routes, its loss mask and why it
/// ended (rollouts and samples alike).
fn completion_fields() -> [Field; 6] {
    [
        list(f::COMPLETION_TOKEN_IDS, DataType::UInt32),
        list(f::COMPLETION_LOGPROBS, DataType::Float32),
        list(f::COMPLETION_VERSIONS, DataType::UInt32),
        list(f::COMPLETION_ROUTES, DataType::UInt8),
        list(f::LOSS_MASK, DataType::Boolean),
        utf8(f::FINISH_REASON),
    ]
}

fn execution_fields() -> Vec<Field> {
    vec![
        tool_outputs_field(),
        utf8(f::EXEC_STATUS),
        Field::new(f::EXIT_CODE, DataType::Int32, true),
        utf8(f::STDOUT),
        utf8(f::STDERR),
        u64f(f::EXEC_DURATION_MS),
        u32f(f::TESTS_PASSED),
        u32f(f::TESTS_TOTAL),
    ]
}

fn tool_calls_field() -> Field {
    use f::tool_call as c;
    struct_list(f::TOOL_CALLS, [c::ID, c::NAME, c::ARGUMENTS].map(utf8).into())
}

fn tool_outputs_field() -> Field {
    use f::tool_output as o;
    struct_list(
        f::TOOL_OUTPUTS,
        [o::CALL_ID, o::NAME, o::OUTPUT, o::STATUS].map(utf8).into(),
    )
}

fn reward_components_field() -> Field {
    struct_list(
        f::REWARD_COMPONENTS,
        vec![
            utf8(f::reward_component::NAME),
            Field::new(f::reward_component::VALUE, DataType::Float32, false),
            Field::new(f::reward_component::WEIGHT, DataType::Float32, false),
            utf8(f::reward_component::REASON),
        ],
    )
}

fn utf8(name: &str) -> Field {
    Field::new(name, DataType::Utf8, false)
}

fn utf8_null(name: &str) -> Field {
    Field::new(name, DataType::Utf8, true)
}

fn u32f(name: &str) -> Field {
    Field::new(name, DataType::UInt32, false)
}

fn u64f(name: &str) -> Field {
    Field::new(name, DataType::UInt64, false)
}

fn timestamp(name: &str) -> Field {
    Field::new(
        name,
        DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
        false,
    )
}

fn list(name: &str, item: DataType) -> Field {
    Field::new(name, DataType::List(Arc::new(Field::new("item", item, false))), false)
}

fn struct_list(name: &str, fields: Vec<Field>) -> Field {
    let item = Field::new("item", DataType::Struct(Fields::from(fields)), false);
    Field::new(name, DataType::List(Arc::new(item)), false)
}

/// The fields of a `prompts` row.
fn prompt_fields() -> Vec<Field> {
    vec![
        utf8(f::RUN_ID),
        utf8(f::PROBLEM_ID),
        utf8(f::GROUP_ID),
        utf8(f::ENV),
        u64f(f::STEP),
        u32f(f::GROUP_SIZE),
        utf8(f::PROMPT),
        list(f::PROMPT_TOKEN_IDS, DataType::UInt32),
        utf8_null(f::ANSWER),
        utf8_null(f::INFO),
        Field::new(f::TEMPERATURE, DataType::Float32, false),
        u32f(f::MAX_TOKENS),
    ]
}

/// The fields of a `samples` row: one masked, scored training sample.
fn sample_fields() -> Vec<Field> {
    let mut v = sample_identity_fields();
    v.extend([u32f(f::TURN), list(f::PROMPT_TOKEN_IDS, DataType::UInt32)]);
    v.extend(completion_fields());
    v.extend([
        Field::new(f::REWARD, DataType::Float32, false),
        Field::new(f::ADVANTAGE, DataType::Float32, false),
    ]);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_fingerprints_differ() {
        let mut prints = std::collections::HashSet::new();
        for id in SchemaId::ALL {
            assert_eq!(id.name().parse::<SchemaId>().unwrap(), id);
            assert_eq!(id.fingerprint().len(), 16);
            assert!(prints.insert(id.fingerprint()), "{id} shares a fingerprint");
        }
        let err = "rollout".parse::<SchemaId>().unwrap_err().to_string();
        assert!(err.contains("`rollout`"), "{err}");
    }

    /// The fingerprints travel in every message's header: a schema change must be a
    /// decision (bump these), never a side effect of rearranging this file.
    #[test]
    fn fingerprints_are_pinned() {
        let prints: Vec<String> = SchemaId::ALL
            .iter()
            .map(|id| format!("{id} {}", id.fingerprint()))
            .collect();
        assert_eq!(
            prints,
            [
                "prompts e3ec52100a2740f3",
                "rollouts c5a498eef17bf727",
                "continuations 116404a1614af848",
                "executed b2ddbda5b9564f3a",
                "scored 5b6f3c713996e5d8",
                "samples bf3e4c49353f4e63",
                "policy 8d6857dd816098e2",
                "trained d82164875a8ebc6b",
                "metrics eeed1610d7c86cbe",
                "dead_letter fb219569d8dfea66",
            ]
        );
    }

    #[test]
    fn every_schema_has_run_or_topic_and_created_at() {
        for id in SchemaId::ALL {
            let s = id.schema();
            assert!(s.field_with_name(f::CREATED_AT).is_ok(), "{id}");
        }
        let scored = SchemaId::Scored.schema();
        for name in [f::REWARD, f::REWARD_COMPONENTS, f::EXEC_STATUS, f::COMPLETION_VERSIONS] {
            assert!(scored.field_with_name(name).is_ok(), "scored lacks {name}");
        }
    }
}

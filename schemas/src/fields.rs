//! Column names of every topic schema, as constants: stages, SQL and tests name columns
//! through these, never through string literals.

/// Training run the row belongs to.
pub const RUN_ID: &str = "run_id";
/// Problem drawn from an environment (stable across epochs).
pub const PROBLEM_ID: &str = "problem_id";
/// One problem sampled `group_size` times; partition key from prompts to scored.
pub const GROUP_ID: &str = "group_id";
/// One trajectory (stable across its turns); partition key of continuations.
pub const ROLLOUT_ID: &str = "rollout_id";
/// One trainable sample (one trajectory turn); the deduplication key downstream.
pub const SAMPLE_ID: &str = "sample_id";
/// Environment name.
pub const ENV: &str = "env";
/// Trainer step the group was admitted for.
pub const STEP: &str = "step";
/// Number of samples per group.
pub const GROUP_SIZE: &str = "group_size";
/// Index of a sample within its group.
pub const SAMPLE_INDEX: &str = "sample_index";
/// Turn index of a multi-turn trajectory, from 0.
pub const TURN: &str = "turn";
/// Rendered prompt text.
pub const PROMPT: &str = "prompt";
/// Prompt token ids.
pub const PROMPT_TOKEN_IDS: &str = "prompt_token_ids";
/// Reference answer, when the environment has one.
pub const ANSWER: &str = "answer";
/// Environment-specific task data as JSON (tests, tool schemas, ...).
pub const INFO: &str = "info";
/// Sampling temperature.
pub const TEMPERATURE: &str = "temperature";
/// Maximum completion tokens.
pub const MAX_TOKENS: &str = "max_tokens";
/// Completion text.
pub const COMPLETION: &str = "completion";
/// Completion token ids (model tokens and, in multi-turn, spliced tool output tokens).
pub const COMPLETION_TOKEN_IDS: &str = "completion_token_ids";
/// Per-token sampler logprob under the temperature-scaled distribution.
pub const COMPLETION_LOGPROBS: &str = "completion_logprobs";
/// Per-token policy version that produced the token.
pub const COMPLETION_VERSIONS: &str = "completion_versions";
/// For a mixture of experts, the experts each completion token was routed to when the
/// sampler fed it: per token, per layer, `top_k` one-byte expert ids (255: not recorded);
/// empty when nothing was recorded (a dense model). Routing replay reads it.
pub const COMPLETION_ROUTES: &str = "completion_routes";
/// Per-token loss mask over the completion (true = trainable).
pub const LOSS_MASK: &str = "loss_mask";
/// Why generation stopped: stop, length, tool_call, cancelled.
pub const FINISH_REASON: &str = "finish_reason";
/// Tool calls parsed from the completion.
pub const TOOL_CALLS: &str = "tool_calls";
/// Outputs of executed tool calls.
pub const TOOL_OUTPUTS: &str = "tool_outputs";
/// Execution status: ok, nonzero_exit, timeout, memory, output_limit, killed, internal_error, skipped.
pub const EXEC_STATUS: &str = "exec_status";
/// Process exit code.
pub const EXIT_CODE: &str = "exit_code";
/// Captured standard output.
pub const STDOUT: &str = "stdout";
/// Captured standard error.
pub const STDERR: &str = "stderr";
/// Wall time of execution in milliseconds.
pub const EXEC_DURATION_MS: &str = "exec_duration_ms";
/// Unit tests passed.
pub const TESTS_PASSED: &str = "tests_passed";
/// Unit tests run.
pub const TESTS_TOTAL: &str = "tests_total";
/// Total reward (weighted sum of components).
pub const REWARD: &str = "reward";
/// Per-function reward components.
pub const REWARD_COMPONENTS: &str = "reward_components";
/// Group-relative advantage.
pub const ADVANTAGE: &str = "advantage";
/// What the trainer did with a sample (`trained`, `filtered`, `stale`, `duplicate`,
/// `superseded`) or a group it stopped waiting for (`timed_out`), on the `trained`
/// lineage topic.
pub const OUTCOME: &str = "outcome";
/// On `trained`: the `created_at` of the `samples` row (which copy of a sample id).
pub const SAMPLE_CREATED_AT: &str = "sample_created_at";
/// Policy version number.
pub const VERSION: &str = "version";
/// Checkpoint URI.
pub const URI: &str = "uri";
/// SHA-256 of the checkpoint.
pub const SHA256: &str = "sha256";
/// Stage that produced a metric or a dead letter.
pub const STAGE: &str = "stage";
/// Metric name.
pub const NAME: &str = "name";
/// Metric value.
pub const VALUE: &str = "value";
/// Topic a dead letter came from.
pub const TOPIC: &str = "topic";
/// Partition a dead letter came from.
pub const PARTITION: &str = "partition";
/// Offset a dead letter had.
pub const OFFSET: &str = "offset";
/// Message key.
pub const KEY: &str = "key";
/// Why a message was dead-lettered.
pub const REASON: &str = "reason";
/// Original headers as a JSON object.
pub const HEADERS_JSON: &str = "headers_json";
/// Original payload bytes.
pub const PAYLOAD: &str = "payload";
/// When the row was created (ms since epoch, UTC).
pub const CREATED_AT: &str = "created_at";
/// When generation of this turn started.
pub const STARTED_AT: &str = "started_at";
/// When generation of this turn finished.
pub const FINISHED_AT: &str = "finished_at";

/// Fields of a tool call struct.
pub mod tool_call {
    /// Call id, unique within a completion.
    pub const ID: &str = "id";
    /// Tool name.
    pub const NAME: &str = "name";
    /// Arguments as JSON text.
    pub const ARGUMENTS: &str = "arguments";
}

/// Fields of a tool output struct.
pub mod tool_output {
    /// Id of the call this answers.
    pub const CALL_ID: &str = "call_id";
    /// Tool name.
    pub const NAME: &str = "name";
    /// Output text given back to the model.
    pub const OUTPUT: &str = "output";
    /// Execution status of the call.
    pub const STATUS: &str = "status";
}

/// Fields of a reward component struct.
pub mod reward_component {
    /// Reward function name.
    pub const NAME: &str = "name";
    /// Value the function returned (0 when it failed).
    pub const VALUE: &str = "value";
    /// Weight of the function in the rubric.
    pub const WEIGHT: &str = "weight";
    /// Why the function gave this value, or its error.
    pub const REASON: &str = "reason";
}

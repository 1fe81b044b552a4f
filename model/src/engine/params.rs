//! What the engine is asked and what it answers: limits, per-request sampling, outputs,
//! events and counters.

/// Scheduler limits.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_num_seqs: usize,
    /// Cached tokens (prompt + generated) over all running sequences at most; a request
    /// is admitted only if its prompt plus `max_tokens` fits next to the running ones.
    pub max_kv_tokens: usize,
    /// Prompt tokens prefilled in one step at most (at least one request is always
    /// admitted when the batch has room).
    pub max_prefill_tokens: usize,
    /// While sequences are running, admit newcomers only once this many slots are free
    /// (on devices where a prefill is a forward pass of its own; 1 admits at every step).
    /// The CPU kernels prefill inside the decode step's forward and always admit at once.
    pub min_prefill_batch: usize,
    /// Run a model whose weights are f32 on the CPU on the [CPU kernels](crate::infer)
    /// (default); false uses candle ops, as on every other device.
    pub cpu_kernels: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 64,
            max_kv_tokens: 1 << 20,
            max_prefill_tokens: 8192,
            min_prefill_batch: 4,
            cpu_kernels: true,
        }
    }
}

impl EngineConfig {
    /// Every invalid value.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.max_num_seqs == 0 {
            p.push("max_num_seqs must be at least 1".into());
        }
        if self.max_kv_tokens == 0 {
            p.push("max_kv_tokens must be at least 1".into());
        }
        if self.max_prefill_tokens == 0 {
            p.push("max_prefill_tokens must be at least 1".into());
        }
        p
    }
}

/// Per-request sampling.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Temperature; 0 is greedy.
    pub temperature: f32,
    /// Nucleus sampling mass (1.0: off).
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    pub top_k: usize,
    /// RNG seed; requests with the same seed and prompt sample the same tokens whatever
    /// else is in the batch.
    pub seed: u64,
    /// New tokens at most.
    pub max_tokens: usize,
    /// Stop when the text contains one of these (excluded from `text`).
    pub stop: Vec<String>,
    /// Stop when the text contains one of these; `finish_reason` is `tool_call` and the
    /// marker stays in `text`.
    pub tool_call_stop: Vec<String>,
    /// Stop at these token ids (kept in `tokens`).
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the tokenizer's end-of-sequence token.
    pub ignore_eos: bool,
    /// Also report the `logprobs` most likely tokens at each step with their logprobs
    /// (0: none; at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: usize,
}

/// Per prompt position after the first: the token's logprob and the most likely tokens
/// there ([`Engine::prompt_logprobs`](super::Engine::prompt_logprobs)).
pub type PromptScores = Vec<(f32, Vec<(u32, f32)>)>;

/// The most alternatives [`SamplingParams::logprobs`] may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            max_tokens: 64,
            stop: Vec::new(),
            tool_call_stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: 0,
        }
    }
}

impl SamplingParams {
    /// Whether `token` ends a sequence under these parameters: one of `stop_token_ids`, or
    /// the tokenizer's end-of-sequence `eos` unless `ignore_eos`. Such a final token stays
    /// in [`Output::tokens`] but is not part of [`Output::text`].
    pub fn ends_at(&self, token: u32, eos: Option<u32>) -> bool {
        self.stop_token_ids.contains(&token) || (!self.ignore_eos && Some(token) == eos)
    }

    /// Every invalid value.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            p.push(format!("temperature {} must be a finite number ≥ 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            p.push(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if self.max_tokens == 0 {
            p.push("max_tokens must be at least 1".into());
        }
        if self.stop.iter().chain(&self.tool_call_stop).any(String::is_empty) {
            p.push("stop strings must not be empty".into());
        }
        if self.logprobs > MAX_TOP_LOGPROBS {
            p.push(format!(
                "logprobs {} asks for more than {MAX_TOP_LOGPROBS} alternatives per token",
                self.logprobs
            ));
        }
        p
    }
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop string, stop token or end-of-sequence.
    Stop,
    /// `max_tokens` (or the model's context) reached.
    Length,
    /// A tool-call marker appeared.
    ToolCall,
    /// Cancelled by the caller.
    Cancelled,
}

impl FinishReason {
    /// The name used in rows and in the OpenAI API.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCall => "tool_call",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// Request id from [`Engine::add`](super::Engine::add).
    pub id: u64,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Logprob of each generated token (temperature-scaled distribution).
    pub logprobs: Vec<f32>,
    /// Per generated token, the [`SamplingParams::logprobs`] most likely tokens with their
    /// logprobs, most likely first (empty lists when none were asked for).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Policy version that produced each token.
    pub versions: Vec<u32>,
    /// For a mixture of experts on the CPU kernels, the experts each generated token was
    /// routed to when it was fed back: per token, per layer, `top_k` ids
    /// ([`NO_ROUTE`](crate::NO_ROUTE) for the last token, never fed); what routing replay
    /// records. Empty for a dense model or another step backend.
    pub routes: Vec<u8>,
    /// Decoded completion (stop string removed), when the engine has a tokenizer.
    pub text: String,
    /// Why it finished.
    pub finish_reason: FinishReason,
    /// When it was added, ms since epoch.
    pub queued_at: i64,
    /// When its prefill ran, ms since epoch.
    pub started_at: i64,
    /// When it finished, ms since epoch.
    pub finished_at: i64,
}

/// What a step produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A token was generated for request `id`.
    Token {
        /// Request id.
        id: u64,
        /// The token.
        token: u32,
        /// Its logprob.
        logprob: f32,
        /// The most likely tokens at this step with their logprobs (as many as
        /// [`SamplingParams::logprobs`] asked for).
        top: Vec<(u32, f32)>,
        /// Policy version that produced it.
        version: u32,
    },
    /// Request finished.
    Done(Output),
}

/// Counters of what the engine did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Tokens generated.
    pub generated: u64,
    /// Prompt tokens prefilled.
    pub prefilled: u64,
    /// Weight swaps.
    pub swaps: u64,
    /// Sum over decode steps of the batch size (mean batch = this / decode steps).
    pub batch_rows: u64,
    /// Decode forwards.
    pub decode_steps: u64,
}

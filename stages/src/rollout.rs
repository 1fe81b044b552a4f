//! The rollout stage: the continuous-batching engine behind the `prompts` topic.
//!
//! Each `prompts` message (one group) becomes `group_size` engine requests; the input is
//! held under its group id and acknowledged once the whole group has been emitted, so a
//! crash regenerates the group (ids are deterministic, and the mask stage deduplicates by
//! `rollout_id`). The engine advances in `tick`, in time slices of `slice_ms`. At most
//! `max_inflight_groups` groups are in flight: at the limit the stage is not `ready`, so
//! the runner reads no more prompts until a group finishes (and replaces it at once),
//! while it still delivers the broadcast `policy` topic: a new policy version is loaded
//! between two decode steps even with every slot full (in-flight weight update); a
//! version that fails to load (missing file, checksum mismatch, other shape) leaves the
//! old weights serving.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use streamrl_model::Tokenizer;
use streamrl_model::checkpoint;
use streamrl_model::device::{DeviceSpec, Precision};
use streamrl_model::engine::{Engine, EngineConfig, Event, Output, Prepared, SamplingParams};
use streamrl_runtime::build::{BuildContext, BuildError, BuildStage};
use streamrl_runtime::{Emitter, Input, Stage, StageError};
use streamrl_schemas::{
    ContinuationRow, PolicyRow, PromptRow, RolloutRow, SchemaId, ToolCall, TopicRow, Validate, trajectory_into,
};

use crate::remote::RemoteEngine;
use crate::{Invalid, compute, now_ms, rows, uri_path};

/// Configuration of the rollout stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// Initial policy (HF checkpoint directory), served as version 0 until the trainer
    /// publishes another.
    pub checkpoint: PathBuf,
    /// Groups generated concurrently at most (per replica).
    pub max_inflight_groups: usize,
    /// Sequences in one decode batch at most.
    pub max_num_seqs: usize,
    /// KV-cache tokens over all running sequences at most.
    pub max_kv_tokens: usize,
    /// Nucleus sampling mass (1.0: off).
    pub top_p: f32,
    /// Top-k sampling (0: off).
    pub top_k: usize,
    /// Stop strings (excluded from the completion text; the tokens stay).
    pub stop: Vec<String>,
    /// How long one engine time slice runs between inputs, in ms.
    pub slice_ms: u64,
    /// Generate until `max_tokens` even past end-of-sequence (benchmarks).
    pub ignore_eos: bool,
    /// Most new tokens of a turn after a tool call (continuations).
    pub turn_max_tokens: u32,
    /// Where samples are generated: `local` (default) or `{openai: {url, ...}}`.
    pub engine: EngineChoice,
    /// Where the local engine runs: `cpu` (default: the fused CPU kernels), `cuda` or
    /// `cuda:N` (candle's forward on the GPU; a build with the `cuda` feature).
    pub device: DeviceSpec,
    /// The local engine's number type: `f32` (default) or `bf16` (matrix products of
    /// prefill and decode in bf16, on the CPU on its matrix units with the weights
    /// converted once per policy version; logits stay f32). In bf16 the sampled logprobs
    /// differ slightly from the trainer's (the published `mismatch_kl`), which the
    /// double-sided importance mask bounds.
    pub dtype: Precision,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            checkpoint: PathBuf::new(),
            max_inflight_groups: 8,
            max_num_seqs: 64,
            max_kv_tokens: 1 << 20,
            top_p: 1.0,
            top_k: 0,
            stop: Vec::new(),
            slice_ms: 50,
            ignore_eos: false,
            turn_max_tokens: 256,
            engine: EngineChoice::Local,
            device: DeviceSpec::Cpu,
            dtype: Precision::F32,
        }
    }
}

/// Where the rollout stage generates.
///
/// ```
/// use streamrl_stages::rollout::{EngineChoice, RolloutConfig};
///
/// let local: RolloutConfig = serde_yaml::from_str("engine: local").unwrap();
/// assert_eq!(local.engine, EngineChoice::Local);
/// let yaml = "engine: { openai: { url: http://127.0.0.1:8000, served_model_name: policy } }";
/// let remote: RolloutConfig = serde_yaml::from_str(yaml).unwrap();
/// let EngineChoice::Openai(o) = remote.engine else { panic!() };
/// assert_eq!((o.url.as_str(), o.sync_weights), ("http://127.0.0.1:8000", true));
/// let typo = serde_yaml::from_str::<RolloutConfig>("engine: { opnai: { url: x } }").unwrap_err();
/// assert!(typo.to_string().contains("expected `local` or `{openai: {url: ...}}`"), "{typo}");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineChoice {
    /// The in-process continuous-batching engine.
    #[default]
    Local,
    /// A remote OpenAI-compatible server (`streamrl serve`, vLLM, SGLang) that supports
    /// token-id prompts and `return_tokens_as_token_ids`; the stage's `checkpoint` then
    /// only supplies the tokenizer.
    Openai(OpenAiEngine),
}

/// `local`, `{openai: {...}}` (a mapping with the one key, as in JSON), or the YAML tag
/// form `!openai {...}`.
impl<'de> Deserialize<'de> for EngineChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        use serde_yaml::Value;
        let expected = "expected `local` or `{openai: {url: ...}}`";
        let v = Value::deserialize(d)?;
        let (name, body) = match v {
            Value::String(s) => (s, Value::Null),
            Value::Mapping(m) if m.len() == 1 => {
                let (k, body) = m.into_iter().next().expect("one entry");
                (k.as_str().unwrap_or_default().to_string(), body)
            }
            Value::Tagged(t) => (t.tag.to_string().trim_start_matches('!').to_string(), t.value),
            other => return Err(D::Error::custom(format!("{expected}, got {other:?}"))),
        };
        match (name.as_str(), body) {
            ("local", Value::Null) => Ok(EngineChoice::Local),
            ("openai", body) => serde_yaml::from_value(body)
                .map(EngineChoice::Openai)
                .map_err(|e| D::Error::custom(format!("openai: {e}"))),
            (other, _) => Err(D::Error::custom(format!("{expected}, got `{other}`"))),
        }
    }
}

/// A remote OpenAI-compatible engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiEngine {
    /// The server: `http://host:port` (or `openai://host:port`).
    pub url: String,
    /// Model name sent with each request (default: none, the server's only model).
    #[serde(default)]
    pub served_model_name: Option<String>,
    /// Push each new policy version to the server (`POST /v1/load_weights`, which
    /// `streamrl serve` implements); off for servers synced some other way.
    #[serde(default = "yes")]
    pub sync_weights: bool,
    /// Name of an environment variable that holds the server's API key, sent as
    /// `Authorization: Bearer <key>` (`streamrl serve --api-key`, vLLM `--api-key`).
    /// Unset: no key. The key itself never goes in the topology file.
    #[serde(default)]
    pub api_key_env: Option<String>,
}

fn yes() -> bool {
    true
}

impl OpenAiEngine {
    /// A server at `url` with the defaults (weights synced, no model name, no key).
    pub fn at(url: impl Into<String>) -> Self {
        OpenAiEngine {
            url: url.into(),
            served_model_name: None,
            sync_weights: true,
            api_key_env: None,
        }
    }
}

impl Validate for RolloutConfig {
    fn problems(&self) -> Vec<Invalid> {
        let mut p = Vec::new();
        if self.checkpoint.as_os_str().is_empty() {
            p.push(Invalid::new("checkpoint", "required (the initial policy)"));
        }
        if self.max_inflight_groups == 0 {
            p.push(Invalid::new("max_inflight_groups", "must be at least 1"));
        }
        p.extend(
            EngineConfig {
                max_num_seqs: self.max_num_seqs,
                max_kv_tokens: self.max_kv_tokens,
                ..Default::default()
            }
            .problems()
            .into_iter()
            .map(Invalid::whole),
        );
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            p.push(Invalid::new("top_p", format!("{} must be in (0, 1]", self.top_p)));
        }
        if self.slice_ms == 0 {
            p.push(Invalid::new("slice_ms", "must be at least 1"));
        }
        if self.turn_max_tokens == 0 {
            p.push(Invalid::new("turn_max_tokens", "must be at least 1"));
        }
        if let EngineChoice::Openai(o) = &self.engine {
            if let Err(e) = crate::remote::base_url(&o.url) {
                p.push(Invalid::new("engine.openai.url", e));
            }
            if self.device != DeviceSpec::Cpu || self.dtype != Precision::F32 {
                p.push(Invalid::new(
                    "device",
                    format!(
                        "device `{}` / dtype `{}` apply to the local engine only; the remote engine `{}` \
                         chooses its own",
                        self.device, self.dtype, o.url
                    ),
                ));
            }
        }
        p
    }
}

struct Group {
    prompt: PromptRow,
    remaining: u32,
}

/// What an engine request belongs to.
enum Pending {
    /// Sample `index` of a group's first turn.
    Sample { group: String, index: u32 },
    /// The next turn of a trajectory, after its tool outputs.
    Turn {
        prev: Box<ContinuationRow>,
        tool_text: String,
        tool_tokens: Vec<u32>,
    },
}

/// Where samples are generated.
enum Backend {
    /// The in-process engine.
    Local(Box<Engine>),
    /// A remote OpenAI-compatible server (it retries failed requests itself).
    Remote(RemoteEngine),
}

/// The rollout stage.
pub struct RolloutStage {
    cfg: RolloutConfig,
    ctx: BuildContext,
    /// The topology's environments (tool protocols), if it has any.
    envs: Option<std::sync::Arc<streamrl_envs::Mix>>,
    backend: Backend,
    tokenizer: Tokenizer,
    out_topic: String,
    groups: HashMap<String, Group>,
    requests: HashMap<u64, Pending>,
    /// Continuations being generated, by rollout id.
    turns: std::collections::HashSet<String>,
    load_failures: u64,
    /// The policy version a local engine is preparing beside decoding, if any.
    loading: Option<Loading>,
    /// The newest version announced while another was loading: prepared next.
    queued: Option<PolicyRow>,
    /// Downloads `http://` policy versions (a trainer serving its checkpoints).
    http: reqwest::Client,
    instruments: streamrl_runtime::instruments::Instruments,
}

impl std::fmt::Debug for RolloutStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutStage").field("cfg", &self.cfg).finish()
    }
}

/// A policy version being read, checked and laid out on a blocking thread
/// ([`WeightLoader`](streamrl_model::engine::WeightLoader)) while the engine decodes with
/// the current one. Meanwhile the engine admits no new request, so that groups arriving
/// now start on the version being prepared; running sequences keep decoding. It is
/// installed between two decode steps (a move): the decode pause is that alone.
struct Loading {
    row: PolicyRow,
    /// When its download began: the policy message's arrival, or, for a version queued
    /// behind another, the end of that one's load.
    started: Instant,
    task: tokio::task::JoinHandle<Result<Prepared, String>>,
}

/// A trajectory's recorded expert routes (`before` completion tokens so far) extended by a
/// turn: `n_tool` tool tokens (not routed by the sampler as completion tokens: not
/// recorded) and the turn's generated tokens with the routes `o` recorded. A dense model's
/// trajectory, or one whose sampler recorded nothing, keeps none.
fn extend_routes(routes: &mut Vec<u8>, before: usize, n_tool: usize, o: &Output) {
    let per = match (routes.len(), o.routes.len()) {
        (0, 0) => return,
        (_, n) if n > 0 => n / o.tokens.len().max(1),
        (n, _) => n / before.max(1),
    };
    routes.resize(before * per, streamrl_model::NO_ROUTE);
    routes.resize((before + n_tool) * per, streamrl_model::NO_ROUTE);
    match o.routes.is_empty() {
        true => routes.resize((before + n_tool + o.tokens.len()) * per, streamrl_model::NO_ROUTE),
        false => routes.extend_from_slice(&o.routes),
    }
}

/// FNV-1a of the group id and the sample's index in it.
fn seed_of(group_id: &str, index: u32) -> u64 {
    use std::hash::Hasher as _;
    let mut h = fnv::FnvHasher::default();
    h.write(group_id.as_bytes());
    h.write(&index.to_le_bytes());
    h.finish()
}

/// Builds the stage: loads the initial policy and its tokenizer.
impl BuildStage for RolloutStage {
    type Config = RolloutConfig;

    fn build(cfg: RolloutConfig, ctx: &BuildContext) -> Result<Self, BuildError> {
        let out = ctx.checked_output(&cfg, SchemaId::Rollouts)?;
        let envs = crate::environments(ctx)?;
        let mut cfg = cfg;
        cfg.checkpoint = crate::weights::initial(&cfg.checkpoint, &ctx.weights_cache(), crate::weights::INITIAL_WAIT)
            .map_err(|e| Invalid::new("checkpoint", e.to_string()))?;
        let (backend, tokenizer) = match &cfg.engine {
            EngineChoice::Local => Self::local(&cfg)?,
            EngineChoice::Openai(o) => Self::remote(&cfg, o)?,
        };
        Ok(RolloutStage {
            instruments: ctx.instruments(),
            cfg,
            ctx: ctx.clone(),
            envs,
            backend,
            tokenizer,
            out_topic: out,
            groups: HashMap::new(),
            requests: HashMap::new(),
            turns: Default::default(),
            load_failures: 0,
            loading: None,
            queued: None,
            http: reqwest::Client::new(),
        })
    }
}

impl RolloutStage {
    /// The in-process engine on the initial policy, and its tokenizer.
    fn local(cfg: &RolloutConfig) -> Result<(Backend, Tokenizer), BuildError> {
        let device = cfg.device.open().map_err(|e| Invalid::new("device", e.to_string()))?;
        let loaded = checkpoint::load_in(&cfg.checkpoint, &device, cfg.dtype)
            .map_err(|e| Invalid::new("checkpoint", e.to_string()))?;
        let Some(tokenizer) = loaded.tokenizer else {
            return Err(BuildError::invalid(
                "checkpoint",
                format!("{} has no tokenizer.json", cfg.checkpoint.display()),
            ));
        };
        let engine = Engine::new(
            loaded.model,
            0,
            Some(tokenizer.clone()),
            EngineConfig {
                max_num_seqs: cfg.max_num_seqs,
                max_kv_tokens: cfg.max_kv_tokens,
                ..Default::default()
            },
        );
        Ok((Backend::Local(Box::new(engine)), tokenizer))
    }

    /// A client of the remote engine `o`, and the tokenizer of the initial policy.
    fn remote(cfg: &RolloutConfig, o: &OpenAiEngine) -> Result<(Backend, Tokenizer), BuildError> {
        let tokenizer = Tokenizer::from_file(&cfg.checkpoint.join("tokenizer.json"))
            .map_err(|e| Invalid::new("checkpoint", e.to_string()))?;
        let key = match &o.api_key_env {
            None => None,
            Some(var) => match std::env::var(var) {
                Ok(k) if !k.is_empty() => Some(k),
                _ => {
                    return Err(BuildError::invalid(
                        "engine.openai.api_key_env",
                        format!(
                            "the environment variable `{var}` is not set (it should hold the remote engine's API key)"
                        ),
                    ));
                }
            },
        };
        let engine = RemoteEngine::new(&o.url, o.served_model_name.clone(), key)
            .map_err(|e| Invalid::new("engine.openai.url", e))?;
        Ok((Backend::Remote(engine), tokenizer))
    }

    /// The version now serving.
    pub fn version(&self) -> u32 {
        match &self.backend {
            Backend::Local(e) => e.version(),
            Backend::Remote(engine) => engine.version(),
        }
    }

    /// Starts one sequence on the backend.
    fn submit(&mut self, tokens: Vec<u32>, params: SamplingParams) -> Result<u64, String> {
        match &mut self.backend {
            Backend::Local(e) => e.add(tokens, params).map_err(|e| e.to_string()),
            Backend::Remote(engine) => engine.submit(tokens, params),
        }
    }

    fn cancel(&mut self, id: u64) {
        if let Backend::Local(e) = &mut self.backend {
            e.cancel(id);
        }
    }

    /// The tool-call stop marker of an environment, if it offers tools.
    fn tool_stop(&self, env: &str) -> Vec<String> {
        self.envs
            .as_ref()
            .and_then(|m| m.get(env))
            .and_then(|e| e.tools())
            .map(|t| vec![t.call_end.clone()])
            .unwrap_or_default()
    }

    /// The tool call turn `o` ended in, as the schema's ToolCall (none unless it finished
    /// with `tool_call` in an environment with tools).
    fn tool_call(&self, o: &Output, env: &str, rollout_id: &str, turn: u32, text: &str) -> Vec<ToolCall> {
        if o.finish_reason.as_str() != "tool_call" {
            return vec![];
        }
        let Some(t) = self.envs.as_ref().and_then(|m| m.get(env)).and_then(|e| e.tools()) else {
            return vec![];
        };
        crate::tool_call(t, rollout_id, turn, t.last_turn(text))
            .into_iter()
            .collect()
    }

    /// Starts the next turn of a trajectory: its prompt and completion so far, then the
    /// rendered tool outputs (masked out of the loss), then new tokens.
    fn add_turn(&mut self, c: ContinuationRow) -> Result<(), StageError> {
        if self.turns.contains(&c.rollout_id) {
            return Ok(()); // redelivered while still generating
        }
        let tok = self.tokenizer.clone();
        let tool_text: String = c.tool_outputs.iter().map(|o| o.output.as_str()).collect();
        let tool_tokens = tok.encode(&tool_text).map_err(|e| StageError::user(e.to_string()))?;
        let prompt = if c.prompt_token_ids.is_empty() {
            tok.encode(&c.prompt).map_err(|e| StageError::user(e.to_string()))?
        } else {
            c.prompt_token_ids.clone()
        };
        let tokens: Vec<u32> = prompt
            .iter()
            .chain(&c.completion_token_ids)
            .chain(&tool_tokens)
            .copied()
            .collect();
        let params = SamplingParams {
            temperature: c.temperature,
            top_p: self.cfg.top_p,
            top_k: self.cfg.top_k,
            seed: seed_of(&c.rollout_id, c.turn + 1),
            max_tokens: self.cfg.turn_max_tokens as usize,
            stop: self.cfg.stop.clone(),
            tool_call_stop: self.tool_stop(&c.env),
            ignore_eos: self.cfg.ignore_eos,
            ..Default::default()
        };
        let id = self
            .submit(tokens, params)
            .map_err(|e| StageError::user(format!("trajectory {} turn {}: {e}", c.rollout_id, c.turn + 1)))?;
        self.turns.insert(c.rollout_id.clone());
        self.requests.insert(
            id,
            Pending::Turn {
                prev: Box::new(c),
                tool_text,
                tool_tokens,
            },
        );
        Ok(())
    }

    fn add_group(&mut self, p: PromptRow) -> Result<(), StageError> {
        if self.groups.contains_key(&p.group_id) {
            // A redelivered group that is still being generated: nothing new to do.
            return Ok(());
        }
        let mut ids = Vec::new();
        let tokens = if p.prompt_token_ids.is_empty() {
            self.tokenizer
                .encode(&p.prompt)
                .map_err(|e| StageError::user(e.to_string()))?
        } else {
            p.prompt_token_ids.clone()
        };
        for i in 0..p.group_size {
            let params = SamplingParams {
                temperature: p.temperature,
                top_p: self.cfg.top_p,
                top_k: self.cfg.top_k,
                seed: seed_of(&p.group_id, i),
                max_tokens: p.max_tokens as usize,
                stop: self.cfg.stop.clone(),
                tool_call_stop: self.tool_stop(&p.env),
                ignore_eos: self.cfg.ignore_eos,
                ..Default::default()
            };
            match self.submit(tokens.clone(), params) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    for id in ids {
                        self.cancel(id);
                        self.requests.remove(&id);
                    }
                    return Err(StageError::user(format!("group {}: {e}", p.group_id)));
                }
            }
            self.requests.insert(
                *ids.last().expect("pushed"),
                Pending::Sample {
                    group: p.group_id.clone(),
                    index: i,
                },
            );
        }
        self.groups.insert(
            p.group_id.clone(),
            Group {
                remaining: p.group_size,
                prompt: p,
            },
        );
        Ok(())
    }

    /// Runs engine steps (or collects remote answers) until `deadline` or until nothing
    /// is in flight; emits finished samples and releases finished groups.
    async fn drive(&mut self, out: &mut Emitter, deadline: Instant) -> Result<(), StageError> {
        let mut done = Vec::new();
        while Instant::now() < deadline {
            if self.loading.is_some() {
                // With nothing running, there is nothing to decode meanwhile: wait for it.
                let idle = matches!(&self.backend, Backend::Local(e) if e.num_running() == 0);
                self.poll_load(out, idle.then_some(deadline)).await;
            }
            let mut new = Vec::new();
            match &mut self.backend {
                Backend::Local(engine) => {
                    if !engine.has_work() {
                        break;
                    }
                    let events =
                        compute(|| engine.step()).map_err(|e| StageError::internal(format!("engine step: {e}")))?;
                    new.extend(events.into_iter().filter_map(|e| match e {
                        Event::Done(o) => Some(o),
                        _ => None,
                    }));
                }
                Backend::Remote(engine) => {
                    let wait = deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1));
                    match engine.next(wait).await {
                        None => break,
                        Some(r) => new.push(r.map_err(StageError::internal)?),
                    }
                }
            }
            for o in &new {
                self.finish(o);
            }
            done.extend(new);
        }
        self.emit(done, out)
    }

    fn finish(&mut self, o: &Output) {
        if let Some(Pending::Sample { group, .. }) = self.requests.get(&o.id)
            && let Some(group) = self.groups.get_mut(group)
        {
            group.remaining -= 1;
        }
    }

    fn emit(&mut self, done: Vec<Output>, out: &mut Emitter) -> Result<(), StageError> {
        if done.is_empty() {
            return Ok(());
        }
        let mut rows_out = Vec::with_capacity(done.len());
        self.instruments
            .generated(done.iter().map(|o| o.tokens.len() as u64).sum());
        for o in done {
            let Some(pending) = self.requests.remove(&o.id) else {
                continue;
            };
            let text = if o.text.is_empty() {
                self.tokenizer.decode(&o.tokens).unwrap_or_default()
            } else {
                o.text.clone()
            };
            match pending {
                Pending::Sample { group, index } => rows_out.extend(self.first_turn(&group, index, o, text)),
                Pending::Turn {
                    prev,
                    tool_text,
                    tool_tokens,
                } => {
                    self.turns.remove(&prev.rollout_id);
                    out.release(prev.rollout_id.clone());
                    rows_out.push(self.next_turn(*prev, &tool_text, tool_tokens, o, text));
                }
            }
        }
        let finished: Vec<String> = self
            .groups
            .iter()
            .filter(|(_, g)| g.remaining == 0)
            .map(|(id, _)| id.clone())
            .collect();
        for gid in finished {
            self.groups.remove(&gid);
            out.release(gid);
        }
        out.emit(
            self.out_topic.clone(),
            RolloutRow::to_batch(&rows_out).map_err(|e| StageError::internal(e.to_string()))?,
        );
        Ok(())
    }

    /// The row of sample `index` of group `gid` after its first turn (`None`: the group
    /// is gone).
    fn first_turn(&self, gid: &str, index: u32, o: Output, text: String) -> Option<RolloutRow> {
        let p = &self.groups.get(gid)?.prompt;
        let rollout_id = format!("{gid}-{index}");
        let tool_calls = self.tool_call(&o, &p.env, &rollout_id, 0, &text);
        Some(RolloutRow {
            run_id: p.run_id.clone(),
            problem_id: p.problem_id.clone(),
            group_id: gid.to_string(),
            sample_id: format!("{rollout_id}-t0"),
            rollout_id,
            env: p.env.clone(),
            step: p.step,
            sample_index: index,
            group_size: p.group_size,
            turn: 0,
            prompt: p.prompt.clone(),
            prompt_token_ids: p.prompt_token_ids.clone(),
            completion: text,
            loss_mask: vec![true; o.tokens.len()],
            completion_token_ids: o.tokens,
            completion_logprobs: o.logprobs,
            completion_versions: o.versions,
            completion_routes: o.routes,
            finish_reason: o.finish_reason.as_str().to_string(),
            tool_calls,
            answer: p.answer.clone(),
            info: p.info.clone(),
            temperature: p.temperature,
            started_at: o.started_at,
            finished_at: o.finished_at,
            created_at: now_ms(),
        })
    }

    /// The trajectory `c` extended by its tool outputs and the turn generated after them.
    fn next_turn(
        &self,
        mut c: ContinuationRow,
        tool_text: &str,
        tool_tokens: Vec<u32>,
        o: Output,
        text: String,
    ) -> RolloutRow {
        let turn = c.turn + 1;
        let n_tool = tool_tokens.len();
        // Tool tokens are the environment's, not the policy's: masked out of the loss,
        // logprob 0, and the version of the turn before them.
        let tool_version = c
            .completion_versions
            .last()
            .copied()
            .or(o.versions.first().copied())
            .unwrap_or(0);
        extend_routes(&mut c.completion_routes, c.completion_token_ids.len(), n_tool, &o);
        c.completion.push_str(tool_text);
        c.completion.push_str(&text);
        c.completion_token_ids
            .extend(tool_tokens.into_iter().chain(o.tokens.iter().copied()));
        c.completion_logprobs
            .extend(std::iter::repeat_n(0.0, n_tool).chain(o.logprobs.iter().copied()));
        c.completion_versions
            .extend(std::iter::repeat_n(tool_version, n_tool).chain(o.versions.iter().copied()));
        c.loss_mask
            .extend(std::iter::repeat_n(false, n_tool).chain(std::iter::repeat_n(true, o.tokens.len())));
        c.tool_calls = self.tool_call(&o, &c.env, &c.rollout_id, turn, &text);
        c.finish_reason = o.finish_reason.as_str().to_string();
        c.sample_id = format!("{}-t{turn}", c.rollout_id);
        c.turn = turn;
        c.finished_at = o.finished_at;
        trajectory_into!(c, RolloutRow { created_at: now_ms() })
    }

    /// Waits until every version announced so far serves (or failed to load), for a
    /// caller that needs it in place before what it does next; meanwhile nothing decodes.
    pub async fn settle_policy(&mut self, out: &mut Emitter) {
        while self.loading.is_some() {
            self.poll_load(out, Some(Instant::now() + Duration::from_secs(24 * 3600)))
                .await;
        }
    }

    /// The version being prepared beside decoding, if any.
    pub fn preparing(&self) -> Option<u32> {
        self.loading.as_ref().map(|l| l.row.version)
    }

    /// The newest version serving, being prepared or queued.
    fn newest_version(&self) -> u32 {
        let pending = [self.loading.as_ref().map(|l| &l.row), self.queued.as_ref()];
        pending
            .into_iter()
            .flatten()
            .map(|p| p.version)
            .fold(self.version(), u32::max)
    }

    /// A newer policy version: a local engine prepares it beside decoding ([`Loading`];
    /// one at a time, the newest announced one next); a remote engine loads it itself
    /// (`sync_weights`) or is only told the version.
    async fn load_policy(&mut self, p: &PolicyRow, out: &mut Emitter) {
        if p.version <= self.newest_version() {
            return;
        }
        let t0 = Instant::now();
        let sync = matches!(&self.cfg.engine, EngineChoice::Openai(o) if o.sync_weights);
        let r = match &mut self.backend {
            Backend::Local(_) if self.loading.is_some() => {
                self.queued = Some(p.clone());
                return;
            }
            Backend::Local(_) => return self.start_load(p.clone(), out).await,
            Backend::Remote(engine) if sync => {
                let location = if p.uri.starts_with("http") {
                    p.uri.clone()
                } else {
                    uri_path(&p.uri).display().to_string()
                };
                engine.load_weights(&location, p.version, &p.sha256).await
            }
            Backend::Remote(engine) => {
                engine.set_version(p.version);
                Ok(())
            }
        };
        self.policy_loaded(p, r, t0, None, out);
    }

    /// Starts preparing `p` for the local engine: an `http://` version is downloaded into
    /// this replica's cache first, then read, checked and laid out on a blocking thread.
    async fn start_load(&mut self, p: PolicyRow, out: &mut Emitter) {
        let t0 = Instant::now();
        let dir = match crate::weights::fetch(&self.http, &p.uri, &self.ctx.weights_cache()).await {
            Ok(dir) => dir,
            Err(e) => return self.policy_loaded(&p, Err(e), t0, None, out),
        };
        let Backend::Local(engine) = &mut self.backend else {
            return;
        };
        let loader = engine.loader();
        engine.hold_admissions(true);
        let (version, sha) = (p.version, p.sha256.clone());
        let task =
            tokio::task::spawn_blocking(move || loader.load(&dir, version, Some(&sha)).map_err(|e| e.to_string()));
        self.loading = Some(Loading {
            row: p,
            started: t0,
            task,
        });
    }

    /// Installs the version being prepared once it is ready (waiting for it until `wait`,
    /// when given), then starts on the one queued behind it, or admits again.
    async fn poll_load(&mut self, out: &mut Emitter, wait: Option<Instant>) {
        let Some(l) = self.loading.as_mut() else { return };
        let r = if l.task.is_finished() {
            (&mut l.task).await
        } else {
            let Some(until) = wait else { return };
            match tokio::time::timeout_at(until.into(), &mut l.task).await {
                Ok(r) => r,
                Err(_) => return,
            }
        };
        let Some(Loading { row, started, .. }) = self.loading.take() else {
            return;
        };
        let Backend::Local(engine) = &mut self.backend else {
            return;
        };
        let swap = Instant::now();
        let r = r
            .map_err(|e| format!("preparing the weights failed: {e}"))
            .and_then(|prepared| prepared)
            .and_then(|prepared| engine.install(prepared).map_err(|e| e.to_string()));
        let pause = swap.elapsed();
        self.policy_loaded(&row, r, started, Some(pause), out);
        if let Some(next) = self.queued.take() {
            self.start_load(next, out).await;
        }
        if self.loading.is_none()
            && let Backend::Local(engine) = &mut self.backend
        {
            engine.hold_admissions(false);
        }
    }

    /// Metrics of a version now serving (`pause`: how long decoding stopped for the swap,
    /// for a local engine), or of a failed load (the old weights keep serving).
    fn policy_loaded(
        &mut self,
        p: &PolicyRow,
        r: Result<(), String>,
        t0: Instant,
        pause: Option<Duration>,
        out: &mut Emitter,
    ) {
        match r {
            Ok(()) => {
                tracing::debug!(stage = %self.ctx.instance(), version = p.version, ms = t0.elapsed().as_millis() as u64, "loaded policy");
                let sync_ms = (crate::now_ms() - p.created_at).max(0);
                self.instruments
                    .weight_sync(std::time::Duration::from_millis(sync_ms as u64));
                let mut values = vec![
                    // From the start of its download to serving it (download, check,
                    // load, swap).
                    ("weight_load_ms", t0.elapsed().as_secs_f64() * 1e3),
                    // From the trainer's publication (the row's created_at, its clock)
                    // to this replica serving it; the largest over replicas is the
                    // version's weight-sync time.
                    ("weight_sync_ms", sync_ms as f64),
                    ("policy_version", p.version as f64),
                ];
                if let Some(pause) = pause {
                    values.push(("weight_swap_ms", pause.as_secs_f64() * 1e3));
                }
                if let Some((t, b)) = self.ctx.metrics(p.step, &values) {
                    out.emit(t, b);
                }
            }
            Err(e) => {
                self.load_failures += 1;
                tracing::warn!(stage = %self.ctx.instance(), version = p.version, error = %e, "policy load failed; the old weights keep serving");
                if let Some((t, b)) = self
                    .ctx
                    .metrics(p.step, &[("weight_load_failures", self.load_failures as f64)])
                {
                    out.emit(t, b);
                }
            }
        }
    }
}

#[async_trait]
impl Stage for RolloutStage {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        match input.schema {
            SchemaId::Policy => {
                if let Some(p) = rows::<PolicyRow>(&input.batch)?.into_iter().max_by_key(|p| p.version) {
                    self.load_policy(&p, out).await;
                }
                Ok(())
            }
            SchemaId::Prompts => {
                let prompts = rows::<PromptRow>(&input.batch)?;
                let Some(first) = prompts.first() else { return Ok(()) };
                // The runtime splits messages by key: one message is one group.
                out.hold_as(first.group_id.clone());
                for p in prompts {
                    self.add_group(p)?;
                }
                // Generation happens in `tick`, a slice at a time; while every slot is
                // taken the stage is not `ready` and the runner reads no more prompts,
                // but still delivers policies, so new weights are adopted between decode
                // steps, not only between groups.
                Ok(())
            }
            SchemaId::Continuations => {
                let conts = rows::<ContinuationRow>(&input.batch)?;
                let Some(first) = conts.first() else { return Ok(()) };
                // Keyed by rollout id: one message is one trajectory's next turn.
                out.hold_as(first.rollout_id.clone());
                for c in conts {
                    self.add_turn(c)?;
                }
                Ok(())
            }
            other => Err(StageError::user(format!("rollout does not consume `{other}` rows"))),
        }
    }

    fn tick_interval(&self) -> Option<Duration> {
        Some(Duration::from_millis(1))
    }

    /// Another group fits: fewer than `max_inflight_groups` are in flight.
    fn ready(&self) -> bool {
        self.groups.len() < self.cfg.max_inflight_groups
    }

    async fn tick(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        let deadline = Instant::now() + Duration::from_millis(self.cfg.slice_ms);
        self.drive(out, deadline).await
    }

    async fn close(&mut self, _out: &mut Emitter) -> Result<(), StageError> {
        let Backend::Local(engine) = &self.backend else {
            return Ok(());
        };
        let s = engine.stats();
        tracing::info!(stage = %self.ctx.instance(), generated = s.generated, decode_steps = s.decode_steps,
            mean_batch = if s.decode_steps > 0 { s.batch_rows as f64 / s.decode_steps as f64 } else { 0.0 },
            "engine stopped; unfinished groups stay unacknowledged and are generated again on restart");
        Ok(())
    }
}

//! Model configuration: a serde mirror of Hugging Face `config.json`, resolved once into a
//! plain [`Config`] (candle's `LlamaConfig → Config` pattern).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Which family a checkpoint belongs to; decides biases, q/k norms and weight names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// Llama (and Mistral-style): no biases, no q/k norms.
    Llama,
    /// Qwen2: biases on q/k/v projections.
    Qwen2,
    /// Qwen3: RMSNorm on q and k per head.
    Qwen3,
    /// Qwen3-MoE: Qwen3 attention with mixture-of-experts feed-forward layers.
    Qwen3Moe,
    /// Mixtral: Llama attention with mixture-of-experts feed-forward layers.
    Mixtral,
}

/// Router scoring function of a mixture-of-experts layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterScore {
    /// softmax over experts.
    Softmax,
    /// Independent sigmoid per expert.
    Sigmoid,
}

/// Layout of the rotary embedding over a head's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeLayout {
    /// Pairs are (i, i + d/2): Hugging Face's `rotate_half`.
    HalfSplit,
    /// Pairs are (2i, 2i + 1): GPT-J / llama.cpp style.
    Interleaved,
}

/// The fields of a Hugging Face `config.json` that streamrl reads (others are ignored and
/// kept when saving).
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HfConfig {
    /// `llama`, `qwen2`, `qwen3`, `qwen3_moe`, `mixtral`.
    pub model_type: Option<String>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Dense feed-forward width.
    #[serde(default)]
    pub intermediate_size: usize,
    /// Transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to the query heads.
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to hidden_size / heads.
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base (transformers < 5; transformers 5 writes it in `rope_parameters`, which
    /// wins when both are present).
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// transformers ≥ 5: the RoPE base and scaling (`rope_type`, `rope_theta`, `factor`, …).
    pub rope_parameters: Option<RopeParameters>,
    /// transformers < 5: RoPE scaling (`rope_type` or `type`, `factor`, …); `null` for none.
    pub rope_scaling: Option<RopeParameters>,
    /// Fraction of each head rotated by RoPE; only 1.0 (the whole head) is supported.
    pub partial_rotary_factor: Option<f64>,
    /// Longest sequence the model is meant for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether the head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on the attention projections: q/k/v/o for Llama, Qwen3 and Qwen3-MoE.
    /// Qwen2 always has q/k/v biases and no o bias, whatever this says; Mistral and
    /// Mixtral have none.
    pub attention_bias: Option<bool>,
    /// Llama: biases on gate/up/down (other families have none and ignore the key).
    pub mlp_bias: Option<bool>,
    /// Sliding-window attention width (Mistral, Mixtral; Qwen2/3 when
    /// `use_sliding_window` or `layer_types` says so). Supported only when inactive or
    /// at least `max_position_embeddings` wide, where it changes nothing.
    pub sliding_window: Option<usize>,
    /// Qwen2/3: whether `sliding_window` applies.
    pub use_sliding_window: Option<bool>,
    /// Per layer: `full_attention` or `sliding_attention` (transformers ≥ 4.53).
    pub layer_types: Option<Vec<String>>,
    /// Experts per MoE layer (Qwen3-MoE `num_experts`).
    pub num_experts: Option<usize>,
    /// Experts per MoE layer (Mixtral `num_local_experts`).
    pub num_local_experts: Option<usize>,
    /// Experts each token uses.
    pub num_experts_per_tok: Option<usize>,
    /// Feed-forward width of one expert.
    pub moe_intermediate_size: Option<usize>,
    /// Whether top-k router weights are renormalised to sum to 1.
    pub norm_topk_prob: Option<bool>,
    /// Width of the always-on shared expert (0/absent: none).
    pub shared_expert_intermediate_size: Option<usize>,
    /// Load-balance loss coefficient.
    pub router_aux_loss_coef: Option<f64>,
    /// streamrl extension: `softmax` (default) or `sigmoid` router scores.
    pub router_score: Option<RouterScore>,
    /// streamrl extension: `half_split` (HF default) or `interleaved` RoPE.
    pub rope_layout: Option<RopeLayout>,
    /// Every other key, preserved on save.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    4096
}

/// RoPE settings as Hugging Face writes them: `rope_parameters` (transformers ≥ 5) or
/// `rope_scaling` (earlier). Keys streamrl does not read are kept on save.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    /// `default`, `linear` or `llama3` (others are refused). Older files say `type`.
    pub rope_type: Option<String>,
    /// RoPE base.
    pub rope_theta: Option<f64>,
    /// Scaling factor (`linear`, `llama3`).
    pub factor: Option<f64>,
    /// `llama3`: wavelengths above `original_max_position_embeddings / low_freq_factor`
    /// are scaled by `factor`.
    pub low_freq_factor: Option<f64>,
    /// `llama3`: wavelengths below `original_max_position_embeddings / high_freq_factor`
    /// are kept.
    pub high_freq_factor: Option<f64>,
    /// `llama3`: the context length the model was pretrained with.
    pub original_max_position_embeddings: Option<f64>,
    /// Fraction of each head rotated; only 1.0 is supported.
    pub partial_rotary_factor: Option<f64>,
    /// Every other key (`type`, yarn's `beta_fast`, …), preserved on save.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// How RoPE's inverse frequencies are rescaled for a longer context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Position interpolation: every inverse frequency divided by `factor`.
    Linear {
        /// Divisor.
        factor: f64,
    },
    /// Llama 3.x: low frequencies divided by `factor`, high ones kept, the band between
    /// interpolated smoothly.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Lower edge of the smoothed band, in `original / wavelength`.
        low_freq_factor: f64,
        /// Upper edge of the smoothed band.
        high_freq_factor: f64,
        /// Pretraining context length.
        original_max_positions: f64,
    },
}

impl RopeScaling {
    /// The inverse frequencies of RoPE base `theta` over `head_dim`, scaled (Hugging Face's
    /// `_compute_default_rope_parameters` and `_compute_{linear,llama3}_parameters`).
    pub fn inv_freq(scaling: Option<RopeScaling>, theta: f64, head_dim: usize) -> Vec<f64> {
        let base = (0..head_dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64));
        match scaling {
            None => base.collect(),
            Some(RopeScaling::Linear { factor }) => base.map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_positions: old,
            }) => base
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < old / high {
                        f
                    } else if wavelen > old / low {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect(),
        }
    }
}

/// Mixture-of-experts settings of a resolved config.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Width of one expert.
    pub expert_ff: usize,
    /// Router scores.
    pub score: RouterScore,
    /// Renormalise the top-k weights.
    pub renormalize: bool,
    /// Width of the shared expert, if any.
    pub shared_ff: Option<usize>,
    /// Load-balance loss coefficient.
    pub aux_loss_coef: f64,
}

/// A resolved, validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Family (weight names, biases, q/k norms).
    pub family: Family,
    /// Vocabulary size.
    pub vocab: usize,
    /// Width.
    pub d_model: usize,
    /// Blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Dense feed-forward width.
    pub d_ff: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// RoPE layout.
    pub rope_layout: RopeLayout,
    /// Maximum positions.
    pub max_positions: usize,
    /// Tied head.
    pub tie_embeddings: bool,
    /// q/k/v biases.
    pub qkv_bias: bool,
    /// o-projection bias.
    pub o_bias: bool,
    /// gate/up/down biases of the dense feed-forward.
    pub mlp_bias: bool,
    /// q/k RMSNorm per head.
    pub qk_norm: bool,
    /// MoE feed-forward (every layer), if any.
    pub moe: Option<MoeConfig>,
}

impl HfConfig {
    /// Resolves and validates, reporting every problem at once.
    pub fn resolve(&self) -> Result<Config> {
        let mut errs = Vec::new();
        let family = self.family(&mut errs);
        let (n_heads, n_kv_heads, head_dim) = self.heads(&mut errs);
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
        ] {
            if v == 0 {
                errs.push(format!("{name} must be at least 1"));
            }
        }
        let moe = self.moe(family, &mut errs);
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            errs.push(format!("rms_norm_eps {} must be positive", self.rms_norm_eps));
        }
        let (rope_theta, rope_scaling) = self.rope(&mut errs);
        let model_type = self.model_type.as_deref().unwrap_or("llama");
        self.check_sliding_window(model_type, &mut errs);
        let (qkv_bias, o_bias, mlp_bias) = self.biases(model_type, &mut errs);
        if !errs.is_empty() {
            return Err(Error::Config(errs));
        }
        Ok(Config {
            family,
            vocab: self.vocab_size,
            d_model: self.hidden_size,
            n_layers: self.num_hidden_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            d_ff: self.intermediate_size,
            eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            rope_layout: self.rope_layout.unwrap_or(RopeLayout::HalfSplit),
            max_positions: self.max_position_embeddings,
            tie_embeddings: self.tie_word_embeddings,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
            moe,
        })
    }

    /// The architecture family of `model_type` (absent: llama).
    fn family(&self, errs: &mut Vec<String>) -> Family {
        match self.model_type.as_deref().unwrap_or("llama") {
            "llama" | "mistral" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "qwen3_moe" => Family::Qwen3Moe,
            "mixtral" => Family::Mixtral,
            other => {
                errs.push(format!(
                    "model_type `{other}` is not supported (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral)"
                ));
                Family::Llama
            }
        }
    }

    /// Query heads, key/value heads and the head dimension.
    fn heads(&self, errs: &mut Vec<String>) -> (usize, usize, usize) {
        let n_heads = self.num_attention_heads;
        let n_kv_heads = self.num_key_value_heads.unwrap_or(n_heads);
        if n_heads == 0 {
            errs.push("num_attention_heads must be at least 1".into());
        }
        if n_kv_heads == 0 || (n_heads > 0 && !n_heads.is_multiple_of(n_kv_heads)) {
            errs.push(format!(
                "num_key_value_heads {n_kv_heads} must divide num_attention_heads {n_heads}"
            ));
        }
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size.checked_div(n_heads).unwrap_or(0));
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            errs.push(format!(
                "head_dim {head_dim} must be even and positive (RoPE rotates pairs)"
            ));
        }
        if self.head_dim.is_none() && n_heads > 0 && !self.hidden_size.is_multiple_of(n_heads) {
            errs.push(format!(
                "hidden_size {} is not divisible by {n_heads} heads",
                self.hidden_size
            ));
        }
        (n_heads, n_kv_heads, head_dim)
    }

    /// The MoE feed-forward when the checkpoint has experts (`None`: a dense one, whose
    /// `intermediate_size` is checked instead).
    fn moe(&self, family: Family, errs: &mut Vec<String>) -> Option<MoeConfig> {
        let n_experts = self.num_experts.or(self.num_local_experts).unwrap_or(0);
        let moe_family = matches!(family, Family::Qwen3Moe | Family::Mixtral);
        if n_experts == 0 && !moe_family {
            if self.intermediate_size == 0 {
                errs.push("intermediate_size must be at least 1".into());
            }
            return None;
        }
        let top_k = self.num_experts_per_tok.unwrap_or(2);
        if n_experts == 0 {
            errs.push(format!("{family:?} needs num_experts (or num_local_experts)"));
        }
        if n_experts > 255 {
            // Recorded routes (routing replay) keep an expert id in one byte, 255 meaning none.
            errs.push(format!(
                "num_experts {n_experts} exceeds 255, the most recorded routes can name"
            ));
        }
        if top_k == 0 || top_k > n_experts.max(1) {
            errs.push(format!("num_experts_per_tok {top_k} must be in 1..={n_experts}"));
        }
        let expert_ff = self.moe_intermediate_size.unwrap_or(self.intermediate_size);
        if expert_ff == 0 {
            errs.push("moe_intermediate_size (or intermediate_size) must be at least 1".into());
        }
        Some(MoeConfig {
            n_experts,
            top_k,
            expert_ff,
            score: self.router_score.unwrap_or(RouterScore::Softmax),
            renormalize: self.norm_topk_prob.unwrap_or(family == Family::Mixtral),
            shared_ff: self.shared_expert_intermediate_size.filter(|&s| s > 0),
            aux_loss_coef: self.router_aux_loss_coef.unwrap_or(0.001),
        })
    }

    /// The q/k/v, o and MLP biases, as each family's transformers code has them.
    fn biases(&self, model_type: &str, errs: &mut Vec<String>) -> (bool, bool, bool) {
        let attention_bias = self.attention_bias.unwrap_or(false);
        let (qkv_bias, o_bias) = match model_type {
            // Qwen2's q/k/v always carry biases and its o never does; it has no such key.
            "qwen2" => (true, false),
            "mistral" | "mixtral" => {
                if attention_bias {
                    errs.push(format!(
                        "attention_bias true: {model_type} attention has no biases in transformers, so this checkpoint is not a {model_type} one"
                    ));
                }
                (false, false)
            }
            _ => (attention_bias, attention_bias),
        };
        (
            qkv_bias,
            o_bias,
            model_type == "llama" && self.mlp_bias.unwrap_or(false),
        )
    }

    /// The RoPE base and scaling, from `rope_parameters` (transformers ≥ 5) or the
    /// top-level `rope_theta` and `rope_scaling`; refuses what streamrl cannot compute.
    fn rope(&self, errs: &mut Vec<String>) -> (f64, Option<RopeScaling>) {
        let (key, params) = match (&self.rope_parameters, &self.rope_scaling) {
            (Some(p), _) => ("rope_parameters", Some(p)),
            (None, Some(p)) => ("rope_scaling", Some(p)),
            (None, None) => ("rope_parameters", None),
        };
        let theta = params.and_then(|p| p.rope_theta).unwrap_or(self.rope_theta);
        if theta.is_nan() || theta <= 0.0 {
            errs.push(format!("rope_theta {theta} must be positive"));
        }
        let partial = params
            .and_then(|p| p.partial_rotary_factor)
            .or(self.partial_rotary_factor);
        if let Some(f) = partial.filter(|&f| f != 1.0) {
            errs.push(format!(
                "partial_rotary_factor {f} is not supported (RoPE over the whole head, 1.0)"
            ));
        }
        let Some(p) = params else {
            return (theta, None);
        };
        let kind = p
            .rope_type
            .clone()
            .or_else(|| p.extra.get("type").and_then(|t| t.as_str()).map(str::to_string))
            .unwrap_or_else(|| "default".into());
        let mut need = |name: &str, v: Option<f64>| -> f64 {
            match v {
                Some(v) if v.is_finite() && v > 0.0 => v,
                Some(v) => {
                    errs.push(format!("{key}.{name} {v} must be positive ({kind} RoPE)"));
                    1.0
                }
                None => {
                    errs.push(format!("{key}.{name} is missing ({kind} RoPE needs it)"));
                    1.0
                }
            }
        };
        let scaling = match kind.as_str() {
            "default" => None,
            "linear" => Some(RopeScaling::Linear {
                factor: need("factor", p.factor),
            }),
            "llama3" => {
                let s = RopeScaling::Llama3 {
                    factor: need("factor", p.factor),
                    low_freq_factor: need("low_freq_factor", p.low_freq_factor),
                    high_freq_factor: need("high_freq_factor", p.high_freq_factor),
                    original_max_positions: need(
                        "original_max_position_embeddings",
                        p.original_max_position_embeddings,
                    ),
                };
                if let (Some(lo), Some(hi)) = (p.low_freq_factor, p.high_freq_factor)
                    && hi <= lo
                {
                    errs.push(format!(
                        "{key}.high_freq_factor {hi} must exceed low_freq_factor {lo} (llama3 RoPE)"
                    ));
                }
                Some(s)
            }
            other => {
                errs.push(format!(
                    "{key}.rope_type `{other}` is not supported (default, linear, llama3)"
                ));
                None
            }
        };
        (theta, scaling)
    }

    /// Sliding-window attention is refused unless it is off or spans the whole context
    /// (a window of at least `max_position_embeddings` never hides a position).
    fn check_sliding_window(&self, model_type: &str, errs: &mut Vec<String>) {
        let mut sliding_layers = 0;
        if let Some(types) = &self.layer_types {
            if types.len() != self.num_hidden_layers {
                errs.push(format!(
                    "layer_types has {} entries for {} layers",
                    types.len(),
                    self.num_hidden_layers
                ));
            }
            for t in types {
                match t.as_str() {
                    "full_attention" => {}
                    "sliding_attention" => sliding_layers += 1,
                    other => errs.push(format!(
                        "layer_types entry `{other}` is not supported (full_attention, sliding_attention)"
                    )),
                }
            }
        }
        let active = match model_type {
            "mistral" | "mixtral" => self.sliding_window.is_some(),
            "qwen2" | "qwen3" | "qwen3_moe" => match &self.layer_types {
                Some(_) => sliding_layers > 0,
                None => self.use_sliding_window == Some(true),
            },
            _ => sliding_layers > 0,
        };
        if !active {
            return;
        }
        let why = if sliding_layers > 0 {
            format!("{sliding_layers} layer_types entries are sliding_attention")
        } else if model_type == "mistral" || model_type == "mixtral" {
            format!("{model_type} applies it whenever it is set")
        } else {
            "use_sliding_window is true".to_string()
        };
        match self.sliding_window {
            Some(w) if w >= self.max_position_embeddings => {}
            Some(w) => errs.push(format!(
                "sliding_window {w} is active ({why}) and narrower than max_position_embeddings {}: sliding-window attention is not supported",
                self.max_position_embeddings
            )),
            None => errs.push(format!(
                "sliding-window attention is requested ({why}) but sliding_window is null"
            )),
        }
    }

    /// Reads `config.json`.
    pub fn load(path: &std::path::Path) -> Result<HfConfig> {
        let text = std::fs::read_to_string(path).map_err(Error::io("reading", path))?;
        serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
    }
}

/// Named model sizes for `streamrl model init --preset`.
pub fn preset(name: &str, vocab: usize) -> Result<HfConfig> {
    let (d, layers, heads, kv, ff) = match name {
        "tiny" => (128, 2, 4, 2, 384),
        "small" => (256, 4, 8, 4, 768),
        // SmolLM2-135M's shape (Llama, grouped-query attention, tied head): for benchmarks
        // and tests of a real model's size without its weights.
        "smollm2" => {
            return Ok(HfConfig {
                model_type: Some("llama".into()),
                vocab_size: vocab,
                hidden_size: 576,
                intermediate_size: 1536,
                num_hidden_layers: 30,
                num_attention_heads: 9,
                num_key_value_heads: Some(3),
                head_dim: Some(64),
                rms_norm_eps: 1e-5,
                rope_theta: 100_000.0,
                max_position_embeddings: 2048,
                tie_word_embeddings: true,
                ..Default::default()
            });
        }
        // A mixture of experts with tiny's active width: 8 experts of 192 per layer, 2 per
        // token (2 × 192 = tiny's 384), renormalised softmax routing (as Qwen3-MoE). The
        // load-balance loss enters at the trainer's `balance_coef` (its coefficient here
        // is 1).
        "tiny-moe" => {
            let mut c = preset("tiny", vocab)?;
            c.model_type = Some("qwen3_moe".into());
            c.num_experts = Some(8);
            c.num_experts_per_tok = Some(2);
            c.moe_intermediate_size = Some(192);
            c.norm_topk_prob = Some(true);
            c.router_aux_loss_coef = Some(1.0);
            return Ok(c);
        }
        other => {
            return Err(Error::Config(vec![format!(
                "unknown preset `{other}` (tiny, tiny-moe, small, smollm2)"
            )]));
        }
    };
    Ok(HfConfig {
        model_type: Some("qwen3".into()),
        vocab_size: vocab,
        hidden_size: d,
        intermediate_size: ff,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv),
        head_dim: Some(d / heads),
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        max_position_embeddings: 512,
        tie_word_embeddings: true,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_problem_is_reported() {
        let c = HfConfig {
            model_type: Some("gpt2".into()),
            vocab_size: 0,
            hidden_size: 100,
            num_hidden_layers: 1,
            num_attention_heads: 3,
            num_key_value_heads: Some(2),
            rms_norm_eps: 1e-6,
            rope_theta: 1e4,
            ..Default::default()
        };
        let Err(Error::Config(errs)) = c.resolve() else {
            panic!("accepted")
        };
        let text = errs.join("\n");
        for want in [
            "gpt2",
            "vocab_size",
            "num_key_value_heads 2",
            "hidden_size 100",
            "intermediate_size",
        ] {
            assert!(text.contains(want), "missing {want}:\n{text}");
        }
    }

    #[test]
    fn families_resolve_their_defaults() {
        let mut c = preset("tiny", 32).unwrap();
        let r = c.resolve().unwrap();
        assert!(r.qk_norm && !r.qkv_bias && r.moe.is_none());
        c.model_type = Some("qwen2".into());
        assert!(c.resolve().unwrap().qkv_bias);
        c.model_type = Some("qwen3_moe".into());
        c.num_experts = Some(4);
        c.num_experts_per_tok = Some(2);
        c.moe_intermediate_size = Some(64);
        let m = c.resolve().unwrap().moe.unwrap();
        assert_eq!((m.n_experts, m.top_k, m.expert_ff), (4, 2, 64));
        // Unknown keys survive a round trip.
        let json = r#"{"vocab_size":8,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"torch_dtype":"bfloat16"}"#;
        let h: HfConfig = serde_json::from_str(json).unwrap();
        assert_eq!(serde_json::to_value(&h).unwrap()["torch_dtype"], "bfloat16");
    }

    fn llama_json(extra: &str) -> HfConfig {
        let json = format!(
            r#"{{"model_type":"llama","vocab_size":8,"hidden_size":16,"intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":2,"max_position_embeddings":64{extra}}}"#
        );
        serde_json::from_str(&json).unwrap()
    }

    fn refusal(c: &HfConfig) -> String {
        match c.resolve() {
            Err(Error::Config(errs)) => errs.join("\n"),
            other => panic!("accepted: {other:?}"),
        }
    }

    #[test]
    fn both_rope_layouts_are_read_and_rope_parameters_wins() {
        // transformers 5: the base lives under rope_parameters.
        let c = llama_json(r#","rope_parameters":{"rope_type":"default","rope_theta":500000.0}"#);
        let r = c.resolve().unwrap();
        assert_eq!((r.rope_theta, r.rope_scaling), (500_000.0, None));
        // transformers 4: top-level rope_theta and rope_scaling with `type`.
        let c = llama_json(r#","rope_theta":1000.0,"rope_scaling":{"type":"linear","factor":4.0}"#);
        let r = c.resolve().unwrap();
        assert_eq!(r.rope_theta, 1000.0);
        assert_eq!(r.rope_scaling, Some(RopeScaling::Linear { factor: 4.0 }));
        let c = llama_json(r#","rope_theta":1000.0,"rope_scaling":null,"rope_parameters":{"rope_theta":20.0}"#);
        assert_eq!(c.resolve().unwrap().rope_theta, 20.0);
        // Unknown keys inside survive a round trip.
        let c = llama_json(r#","rope_parameters":{"rope_type":"default","rope_theta":5.0,"mrope":1}"#);
        assert_eq!(serde_json::to_value(&c).unwrap()["rope_parameters"]["mrope"], 1);
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 8192.0,
        };
        let plain = RopeScaling::inv_freq(None, 500_000.0, 128);
        let scaled = RopeScaling::inv_freq(Some(s), 500_000.0, 128);
        assert_eq!(scaled[0], plain[0], "wavelength 2π is far below 8192 / 4");
        assert!(
            (scaled[63] - plain[63] / 8.0).abs() < 1e-15,
            "the longest wavelength is divided"
        );
        let mid = (0..64)
            .filter(|&i| scaled[i] < plain[i] && scaled[i] > plain[i] / 8.0)
            .count();
        assert!(mid > 0, "some frequencies lie in the smoothed band");
    }

    #[test]
    fn unsupported_variants_are_refused_naming_field_and_value() {
        for (extra, want) in [
            (
                r#","rope_parameters":{"rope_type":"yarn","rope_theta":1e4,"factor":4.0}"#,
                "rope_parameters.rope_type `yarn`",
            ),
            (
                r#","rope_scaling":{"type":"dynamic","factor":2.0}"#,
                "rope_scaling.rope_type `dynamic`",
            ),
            (
                r#","rope_parameters":{"rope_type":"linear"}"#,
                "rope_parameters.factor is missing",
            ),
            (
                r#","rope_parameters":{"rope_type":"llama3","factor":8,"low_freq_factor":4,"high_freq_factor":1,"original_max_position_embeddings":32}"#,
                "high_freq_factor 1 must exceed low_freq_factor 4",
            ),
            (r#","partial_rotary_factor":0.5"#, "partial_rotary_factor 0.5"),
            (
                r#","layer_types":["full_attention","chunked_attention"]"#,
                "`chunked_attention`",
            ),
            (
                r#","layer_types":["full_attention"]"#,
                "layer_types has 1 entries for 2 layers",
            ),
        ] {
            let text = refusal(&llama_json(extra));
            assert!(text.contains(want), "{extra}: want {want:?} in {text}");
        }
        let with = |mt: &str, extra: &str| {
            let mut c = llama_json(extra);
            c.model_type = Some(mt.into());
            c
        };
        for (mt, extra, want) in [
            (
                "mistral",
                r#","sliding_window":16"#,
                "sliding_window 16 is active (mistral applies it",
            ),
            (
                "mixtral",
                r#","sliding_window":16,"num_local_experts":2"#,
                "sliding_window 16 is active",
            ),
            (
                "qwen2",
                r#","use_sliding_window":true,"sliding_window":16"#,
                "sliding_window 16 is active (use_sliding_window is true)",
            ),
            (
                "qwen3",
                r#","sliding_window":16,"layer_types":["full_attention","sliding_attention"]"#,
                "1 layer_types entries are sliding_attention",
            ),
            ("mistral", r#","attention_bias":true"#, "attention_bias true"),
        ] {
            let text = refusal(&with(mt, extra));
            assert!(text.contains(want), "{mt} {extra}: want {want:?} in {text}");
        }
        // Inactive or context-wide windows change nothing and load.
        for (mt, extra) in [
            ("mistral", r#","sliding_window":null"#),
            ("mistral", r#","sliding_window":64"#),
            ("qwen2", r#","use_sliding_window":false,"sliding_window":16"#),
            (
                "qwen3",
                r#","sliding_window":16,"layer_types":["full_attention","full_attention"]"#,
            ),
            ("qwen3", r#","use_sliding_window":true,"sliding_window":4096"#),
        ] {
            with(mt, extra)
                .resolve()
                .unwrap_or_else(|e| panic!("{mt} {extra}: {e}"));
        }
    }

    #[test]
    fn biases_follow_each_familys_rules() {
        let bias = |mt: &str, extra: &str| {
            let mut c = llama_json(extra);
            c.model_type = Some(mt.into());
            let r = c.resolve().unwrap();
            (r.qkv_bias, r.o_bias, r.mlp_bias)
        };
        assert_eq!(
            bias("llama", r#","attention_bias":true,"mlp_bias":true"#),
            (true, true, true)
        );
        assert_eq!(
            bias("qwen2", r#","attention_bias":false,"mlp_bias":true"#),
            (true, false, false)
        );
        assert_eq!(bias("qwen3", r#","attention_bias":true"#), (true, true, false));
        assert_eq!(bias("mistral", ""), (false, false, false));
    }
}

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
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HfConfig {
    /// `llama`, `qwen2`, `qwen3`, `qwen3_moe`, `mixtral`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to hidden_size / heads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Longest sequence the model is meant for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether the head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (Qwen2 sets true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// Experts per MoE layer (Qwen3-MoE `num_experts`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<usize>,
    /// Experts per MoE layer (Mixtral `num_local_experts`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_local_experts: Option<usize>,
    /// Experts each token uses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    /// Feed-forward width of one expert.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<usize>,
    /// Whether top-k router weights are renormalised to sum to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_topk_prob: Option<bool>,
    /// Width of the always-on shared expert (0/absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert_intermediate_size: Option<usize>,
    /// Load-balance loss coefficient.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_aux_loss_coef: Option<f64>,
    /// streamrl extension: `softmax` (default) or `sigmoid` router scores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_score: Option<RouterScore>,
    /// streamrl extension: `half_split` (HF default) or `interleaved` RoPE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    /// RoPE layout.
    pub rope_layout: RopeLayout,
    /// Maximum positions.
    pub max_positions: usize,
    /// Tied head.
    pub tie_embeddings: bool,
    /// q/k/v biases.
    pub qkv_bias: bool,
    /// q/k RMSNorm per head.
    pub qk_norm: bool,
    /// MoE feed-forward (every layer), if any.
    pub moe: Option<MoeConfig>,
}

impl HfConfig {
    /// Resolves and validates, reporting every problem at once.
    pub fn resolve(&self) -> Result<Config> {
        let mut errs = Vec::new();
        let family = match self.model_type.as_deref().unwrap_or("llama") {
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
        };
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
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
        ] {
            if v == 0 {
                errs.push(format!("{name} must be at least 1"));
            }
        }
        let n_experts = self.num_experts.or(self.num_local_experts).unwrap_or(0);
        let moe_family = matches!(family, Family::Qwen3Moe | Family::Mixtral);
        let moe = if n_experts > 0 || moe_family {
            let top_k = self.num_experts_per_tok.unwrap_or(2);
            if n_experts == 0 {
                errs.push(format!("{family:?} needs num_experts (or num_local_experts)"));
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
        } else {
            if self.intermediate_size == 0 {
                errs.push("intermediate_size must be at least 1".into());
            }
            None
        };
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            errs.push(format!("rms_norm_eps {} must be positive", self.rms_norm_eps));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            errs.push(format!("rope_theta {} must be positive", self.rope_theta));
        }
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
            rope_theta: self.rope_theta,
            rope_layout: self.rope_layout.unwrap_or(RopeLayout::HalfSplit),
            max_positions: self.max_position_embeddings,
            tie_embeddings: self.tie_word_embeddings,
            qkv_bias: self.attention_bias.unwrap_or(family == Family::Qwen2),
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
            moe,
        })
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
        other => return Err(Error::Config(vec![format!("unknown preset `{other}` (tiny, small)")])),
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
}

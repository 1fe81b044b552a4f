//! GGUF checkpoints (llama architecture, as llama.cpp writes them): dequantised into
//! trainable f32 weights under Hugging Face names, with the Q/K rows un-permuted from
//! llama.cpp's interleaved-RoPE order back to HF's half-split order, and the tokenizer
//! rebuilt from the GGUF metadata. The result is an ordinary streamrl/HF model.

use std::path::Path;
use std::str::FromStr;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};

use crate::checkpoint::{Loaded, init_seeded};
use crate::config::HfConfig;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

fn meta<'a>(c: &'a Content, key: &str, path: &Path) -> Result<&'a Value> {
    c.metadata
        .get(key)
        .ok_or_else(|| Error::checkpoint(path, format!("no `{key}` in GGUF metadata")))
}

/// Loads a llama-architecture GGUF file as a trainable f32 model with its tokenizer.
pub fn load(path: &Path, device: &Device) -> Result<Loaded> {
    let mut file = std::fs::File::open(path).map_err(Error::io("opening", path))?;
    let content = Content::read(&mut file).map_err(|e| Error::checkpoint(path, e.to_string()))?;
    let hf = config(&content, path)?;
    let mut loaded = init_seeded(&hf, device, None)?;
    fill(&loaded, &content, &mut file, &hf, path, device)?;
    loaded.tokenizer = Some(tokenizer(&content, path)?);
    Ok(loaded)
}

/// The model's configuration from the GGUF metadata (llama only, no RoPE scaling).
fn config(content: &Content, path: &Path) -> Result<HfConfig> {
    let arch = meta(content, "general.architecture", path)?.to_string()?.clone();
    if arch != "llama" {
        return Err(Error::checkpoint(
            path,
            format!("architecture `{arch}` is not supported (llama)"),
        ));
    }
    let u = |k: &str| -> Result<usize> { Ok(meta(content, &format!("llama.{k}"), path)?.to_u32()? as usize) };
    let f = |k: &str| -> Result<f64> { Ok(meta(content, &format!("llama.{k}"), path)?.to_f32()? as f64) };
    let tokens = meta(content, "tokenizer.ggml.tokens", path)?.to_vec()?;
    let (d, heads) = (u("embedding_length")?, u("attention.head_count")?);
    let kv = u("attention.head_count_kv").unwrap_or(heads);
    if let Some(kind) = content.metadata.get("llama.rope.scaling.type") {
        let kind = kind.to_string()?.clone();
        if kind != "none" {
            return Err(Error::checkpoint(
                path,
                format!("llama.rope.scaling.type `{kind}` is not supported in GGUF files (none)"),
            ));
        }
    }
    Ok(HfConfig {
        model_type: Some("llama".into()),
        vocab_size: tokens.len(),
        hidden_size: d,
        intermediate_size: u("feed_forward_length")?,
        num_hidden_layers: u("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv),
        head_dim: Some(d / heads),
        rms_norm_eps: f("attention.layer_norm_rms_epsilon")?,
        rope_theta: f("rope.freq_base").unwrap_or(10_000.0),
        max_position_embeddings: u("context_length").unwrap_or(2048),
        tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        ..Default::default()
    })
}

/// Sets every weight of `loaded` from the file's tensors, dequantised, with Q/K rows
/// un-permuted; a tensor the model does not use, or a weight left unset, is an error.
fn fill(
    loaded: &Loaded,
    content: &Content,
    file: &mut std::fs::File,
    hf: &HfConfig,
    path: &Path,
    device: &Device,
) -> Result<()> {
    let heads = hf.num_attention_heads;
    let kv = hf.num_key_value_heads.unwrap_or(heads);
    let hd = hf.hidden_size / heads;
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut unused = Vec::new();
    let data = loaded
        .vars
        .data()
        .lock()
        .map_err(|_| Error::Shape("var map lock poisoned".into()))?;
    let mut seen = 0;
    for name in names {
        let Some(hf_name) = hf_name(name) else {
            unused.push(name.clone());
            continue;
        };
        let q = content.tensor(file, name, device)?;
        let mut t = q.dequantize(device)?;
        if name.ends_with("attn_q.weight") {
            t = unpermute(&t, heads, hd)?;
        } else if name.ends_with("attn_k.weight") {
            t = unpermute(&t, kv, hd)?;
        }
        let var = data.get(&hf_name).ok_or_else(|| {
            Error::checkpoint(
                path,
                format!("`{name}` maps to `{hf_name}`, which the model does not have"),
            )
        })?;
        if var.dims() != t.dims() {
            return Err(Error::checkpoint(
                path,
                format!("`{name}` is {:?}, `{hf_name}` needs {:?}", t.dims(), var.dims()),
            ));
        }
        var.set(&t)?;
        seen += 1;
    }
    if !unused.is_empty() {
        return Err(Error::checkpoint(
            path,
            format!(
                "GGUF tensors the llama model does not use: {unused:?} (`rope_freqs.weight` is Llama 3 RoPE scaling, which streamrl reads only from Hugging Face checkpoints)"
            ),
        ));
    }
    if seen != data.len() {
        return Err(Error::checkpoint(
            path,
            format!(
                "filled {seen} of {} weights (unmapped GGUF tensors: {unused:?})",
                data.len()
            ),
        ));
    }
    Ok(())
}

/// GGUF tensor name → Hugging Face name.
fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Undoes llama.cpp's `permute` of q/k rows: per head, GGUF row `2i + j` is HF row
/// `j·hd/2 + i`.
pub fn unpermute(w: &Tensor, heads: usize, hd: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    if rows != heads * hd {
        return Err(Error::Shape(format!(
            "q/k weight has {rows} rows, expected {heads} heads × {hd}"
        )));
    }
    Ok(w.reshape((heads, hd / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// Rebuilds a byte-level BPE `tokenizer.json` from `tokenizer.ggml.*` metadata.
fn tokenizer(c: &Content, path: &Path) -> Result<Tokenizer> {
    let model = meta(c, "tokenizer.ggml.model", path)?.to_string()?;
    if model != "gpt2" {
        return Err(Error::Tokenizer(format!(
            "GGUF tokenizer model `{model}` is not supported (gpt2 byte-level BPE)"
        )));
    }
    let tokens: Vec<String> = meta(c, "tokenizer.ggml.tokens", path)?
        .to_vec()?
        .iter()
        .map(|v| v.to_string().cloned())
        .collect::<candle_core::Result<_>>()?;
    let inner = tokenizers::Tokenizer::from_str(&bpe_json(c, path, &tokens)?.to_string())
        .map_err(|e| Error::Tokenizer(format!("rebuilding from GGUF: {e}")))?;
    let mut t = Tokenizer::new(inner);
    let id = |key: &str| c.metadata.get(key).and_then(|v| v.to_u32().ok());
    t.eos = id("tokenizer.ggml.eos_token_id").or(t.eos);
    t.bos = id("tokenizer.ggml.bos_token_id").or(t.bos);
    // tokenizer_config.json as Hugging Face tools expect it: the class, the special tokens
    // by name, and the chat template the GGUF carries.
    let mut cfg = serde_json::Map::new();
    cfg.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
    let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned();
    for (key, token) in [
        ("eos_token", name(t.eos)),
        ("bos_token", name(t.bos)),
        ("pad_token", name(id("tokenizer.ggml.padding_token_id"))),
    ] {
        if let Some(token) = token {
            cfg.insert(key.into(), token.into());
        }
    }
    if let Some(template) = c
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
    {
        cfg.insert("chat_template".into(), template.clone().into());
    }
    if let Some(ctx) = id("llama.context_length") {
        cfg.insert("model_max_length".into(), ctx.into());
    }
    t.set_config(cfg);
    Ok(t)
}

/// The `tokenizer.json` of a byte-level BPE from the GGUF's vocabulary (`tokens`),
/// merges and token types.
fn bpe_json(c: &Content, path: &Path, tokens: &[String]) -> Result<serde_json::Value> {
    let merges: Vec<String> = meta(c, "tokenizer.ggml.merges", path)?
        .to_vec()?
        .iter()
        .map(|v| v.to_string().cloned())
        .collect::<candle_core::Result<_>>()?;
    let types: Vec<i32> = match c.metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()?
            .iter()
            .map(|x| x.to_i32())
            .collect::<candle_core::Result<_>>()?,
        None => vec![1; tokens.len()],
    };
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::json!(i)))
        .collect();
    // Control (3) and user-defined (4) tokens are matched whole, before BPE.
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(3 | 4)))
        .map(|(i, t)| serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    Ok(serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // HF → GGUF as llama.cpp's convert script does: reshape(h, 2, hd/2, in).swapaxes(1, 2).
        let (h, hd, cols) = (3, 4, 2);
        let hf = Tensor::arange(0f32, (h * hd * cols) as f32, &Device::Cpu)
            .unwrap()
            .reshape((h * hd, cols))
            .unwrap();
        let gguf = hf
            .reshape((h, 2, hd / 2, cols))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((h * hd, cols))
            .unwrap();
        let back = unpermute(&gguf, h, hd).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
        assert_ne!(gguf.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
    }
}

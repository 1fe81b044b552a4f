//! `streamrl model ...`: create and inspect policy checkpoints.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use streamrl_model::{Tokenizer, checkpoint, config};

#[derive(Subcommand)]
pub enum ModelCmd {
    /// Write a randomly initialised checkpoint of a named size (with the character tokenizer).
    Init {
        /// tiny (d128, 2 layers) or small (d256, 4 layers).
        #[arg(long, default_value = "tiny")]
        preset: String,
        /// Output directory (HF layout: config.json, model.safetensors, tokenizer.json).
        #[arg(long)]
        out: PathBuf,
        /// Initialisation seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Print a checkpoint's configuration and parameter count.
    Info {
        /// Checkpoint directory.
        checkpoint: PathBuf,
    },
}

pub fn run(cmd: ModelCmd) -> Result<()> {
    match cmd {
        ModelCmd::Init { preset, out, seed } => {
            let tok = Tokenizer::char_level();
            let hf = config::preset(&preset, tok.vocab_size())?;
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
        ModelCmd::Info { checkpoint: dir } => {
            let loaded = checkpoint::load(&dir, &candle_core::Device::Cpu)?;
            println!("{:#?}", loaded.config);
            println!("parameters: {}", parameters(&loaded.vars));
            println!("sha256: {}", checkpoint::weights_sha256(&dir)?);
            Ok(())
        }
    }
}

pub fn parameters(vars: &candle_nn::VarMap) -> usize {
    vars.all_vars().iter().map(|v| v.elem_count()).sum()
}

//! `streamrl sft` (supervised warm start from an environment's reference solutions) and
//! `streamrl eval` (greedy accuracy and pass@k on the environment's held-out split).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use candle_core::Device;
use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use streamrl_envs::{Environment, Split};
use streamrl_model::chat::ChatTemplate;
use streamrl_model::optim::LrSchedule;
use streamrl_model::{Tokenizer, checkpoint, config};
use streamrl_schemas::Problem;
use streamrl_stages::train::{Learner, LossConfig, TrainConfig, TrainSample};

/// Where an environment's configuration comes from.
#[derive(Args, Debug, Clone)]
pub struct EnvArgs {
    /// Environment name.
    #[arg(long, default_value = "arith")]
    pub env: String,
    /// Take the environment's configuration from this topology's `envs:` section (when it
    /// has the environment; built-in defaults otherwise).
    #[arg(short, long, default_value = "topology.yaml", env = "STREAMRL_TOPOLOGY")]
    pub topology: PathBuf,
}

impl EnvArgs {
    fn build(&self) -> Result<Box<dyn Environment>> {
        let mut entry = serde_yaml::Value::Null;
        if self.topology.exists() {
            let root = crate::cli::read_document(&self.topology)?;
            if let Some(e) = root.get("envs").and_then(|e| e.get(&self.env)) {
                entry = e.clone();
            }
        }
        streamrl_stages::build_env(&self.env, &entry)
            .map(|(env, _)| env)
            .map_err(|e| anyhow!("environment `{}`: {}", self.env, streamrl_schemas::problem::list(&e)))
    }
}

/// `streamrl sft`.
#[derive(Args, Debug)]
pub struct SftArgs {
    #[command(flatten)]
    env: EnvArgs,
    /// Output checkpoint directory (default: run the topology's `sft:` section, skipped
    /// when its output exists).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Start from this checkpoint (default: a fresh model of `--preset`).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Size of a fresh model: tiny, tiny-moe, small or smollm2 (a named preset).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Samples per step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Peak learning rate (warmup + cosine).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed (model init and data order).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    placement: crate::cli::Placement,
}

fn tokenized(
    env: &dyn Environment,
    tok: &Tokenizer,
    template: &ChatTemplate,
    seed: u64,
) -> Result<Option<TrainSample>> {
    let p = env.sample(Split::Train, seed);
    let Some(reference) = env.reference_completion(&p) else {
        return Ok(None);
    };
    let prompt = tok.encode(&streamrl_stages::render_prompt(template, &env.prompt(&p))?)?;
    let mut completion = tok.encode(&reference)?;
    completion.extend(tok.eos);
    Ok(Some(TrainSample {
        loss_mask: vec![true; completion.len()],
        sampler_logprobs: vec![0.0; completion.len()],
        prompt,
        completion,
        advantage: 0.0,
        routes: vec![],
    }))
}

/// Runs SFT.
pub fn sft(a: SftArgs) -> Result<()> {
    let Some(out) = a.out.clone() else {
        let root = crate::cli::read_document(&a.env.topology).context("no --out given")?;
        let spec = root.get("sft").cloned().unwrap_or_default();
        if spec.is_null() {
            bail!("no --out given and {} has no `sft:` section", a.env.topology.display());
        }
        return sft_from_topology(&spec, &a.env.topology);
    };
    let env = a.env.build()?;
    let tmp;
    let start: &Path = match &a.checkpoint {
        Some(c) => c,
        None => {
            tmp = tempdir_near(&out)?;
            let tok = Tokenizer::char_level();
            let hf = config::preset(&a.preset, tok.vocab_size())?;
            let l = checkpoint::init_seeded(&hf, &Device::Cpu, Some(a.seed))?;
            checkpoint::save(&tmp, &hf, &l.vars, Some(&tok), None)?;
            &tmp
        }
    };
    let cfg = TrainConfig {
        loss: LossConfig::Sft,
        lr: LrSchedule::WarmupCosine {
            peak: a.lr,
            warmup: (a.steps / 10).max(1),
            total: a.steps,
            min: a.lr / 10.0,
        },
        device: a.placement.device,
        dtype: a.placement.dtype,
        ..Default::default()
    };
    let mut learner = Learner::load(start, cfg).with_context(|| format!("loading {}", start.display()))?;
    let tok = learner
        .tokenizer
        .clone()
        .ok_or_else(|| anyhow!("{} has no tokenizer.json", start.display()))?;
    let template = ChatTemplate::for_checkpoint(start)?;
    let mut rng = StdRng::seed_from_u64(a.seed);
    let t0 = Instant::now();
    for step in 1..=a.steps {
        let mut batch = Vec::with_capacity(a.batch);
        while batch.len() < a.batch {
            match tokenized(env.as_ref(), &tok, &template, rng.random())? {
                Some(s) => batch.push(s),
                None => bail!("environment `{}` has no reference completions to train on", env.name()),
            }
        }
        let r = learner.step(&batch)?;
        if step == 1 || step % 25 == 0 || step == a.steps {
            eprintln!(
                "sft step {step:>5}/{} loss {:.4} grad_norm {:.3} lr {:.2e} {:.0} tok/s",
                a.steps,
                r.loss,
                r.grad_norm,
                r.lr,
                r.tokens as f64 / r.seconds.max(1e-9)
            );
        }
    }
    let sha = learner.save(&out)?;
    // The optimizer state of SFT is not what RL should start from.
    for f in ["optimizer.json", "optimizer.safetensors"] {
        let _ = std::fs::remove_file(out.join(f));
    }
    if a.checkpoint.is_none() {
        let _ = std::fs::remove_dir_all(start);
    }
    println!(
        "wrote {} after {} steps in {:.1} s (sha256 {sha})",
        out.display(),
        a.steps,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn tempdir_near(out: &Path) -> Result<PathBuf> {
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    Ok(parent.join(format!(".sft-init-{}", std::process::id())))
}

/// `streamrl eval`.
#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    env: EnvArgs,
    /// Checkpoint directory.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Held-out problems (the first n of the environment's eval split).
    #[arg(long, default_value_t = 1000)]
    n: usize,
    /// Samples per problem for pass@k at temperature 1 (0: greedy only).
    #[arg(long, default_value_t = 8)]
    k: usize,
    /// Completion tokens at most.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Also print the greedy completions of the first N problems.
    #[arg(long, default_value_t = 0)]
    show: usize,
    #[command(flatten)]
    placement: crate::cli::Placement,
}

pub use streamrl_stages::eval::EvalReport;

/// Evaluates a checkpoint on an environment's held-out split, its model placed by `at`.
pub fn evaluate(
    env: &dyn Environment,
    dir: &Path,
    at: crate::cli::Placement,
    n: usize,
    k: usize,
    max_tokens: usize,
) -> Result<EvalReport> {
    let l = at.load(dir)?;
    let template = ChatTemplate::for_checkpoint(dir)?;
    let tok = l
        .tokenizer
        .ok_or_else(|| anyhow!("{} has no tokenizer.json", dir.display()))?;
    // Alone in its process: the decode's products spread over every core.
    let cores = streamrl_model::cores::process_default();
    streamrl_model::cores::spread(cores, || {
        streamrl_stages::eval::evaluate(env, l.model, &tok, &template, n, k, max_tokens)
    })
    .map_err(|e| anyhow!("{e}"))
}

/// Runs `streamrl eval`.
pub fn eval(a: EvalArgs) -> Result<()> {
    let env = a.env.build()?;
    let r = evaluate(env.as_ref(), &a.checkpoint, a.placement, a.n, a.k, a.max_tokens)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{} on {} held-out {} problems ({:.1} s)",
            a.checkpoint.display(),
            r.n,
            env.name(),
            r.seconds
        );
        println!("  greedy accuracy   {:.1}%", 100.0 * r.greedy_accuracy);
        if let (Some(p), Some(s)) = (r.pass_at_k, r.sampled_accuracy) {
            println!("  pass@{:<2} (T=1)     {:.1}%", r.k, 100.0 * p);
            println!("  sampled accuracy  {:.1}%", 100.0 * s);
        }
        for g in r.greedy.iter().take(a.show) {
            println!(
                "\n{} (answer {}; reward {})\n  {:?}",
                g.question,
                g.answer.as_deref().unwrap_or("-"),
                g.reward,
                g.completion
            );
        }
    }
    Ok(())
}

/// The topology's `sft:` section: the warm start `streamrl run` performs first.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SftSpec {
    /// Output checkpoint directory (the run skips SFT when it exists).
    pub out: PathBuf,
    /// Environment trained on.
    #[serde(default = "arith")]
    pub env: String,
    /// Start from this checkpoint instead of a fresh model.
    #[serde(default)]
    pub checkpoint: Option<PathBuf>,
    /// Fresh model size (tiny, tiny-moe, small or smollm2).
    #[serde(default = "tiny")]
    pub preset: String,
    /// Optimizer steps.
    #[serde(default = "d_steps")]
    pub steps: u64,
    /// Samples per step.
    #[serde(default = "d_batch")]
    pub batch: usize,
    /// Peak learning rate.
    #[serde(default = "d_lr")]
    pub lr: f64,
    /// Seed.
    #[serde(default)]
    pub seed: u64,
    /// Device: cpu, cuda or cuda:N.
    #[serde(default)]
    pub device: streamrl_model::device::DeviceSpec,
    /// Precision: f32, or bf16 matrix products (on the CPU: its matrix units, weights kept f32).
    #[serde(default)]
    pub dtype: streamrl_model::device::Precision,
}

fn arith() -> String {
    "arith".into()
}
fn tiny() -> String {
    "tiny".into()
}
fn d_steps() -> u64 {
    300
}
fn d_batch() -> usize {
    64
}
fn d_lr() -> f64 {
    3e-3
}

/// Every problem of a topology's `sft:` section (`root` is the whole document; an
/// environment configured under its `envs:` is left to that section's check), each with
/// its key path.
pub fn check_sft(root: &serde_yaml::Value) -> Vec<Problem> {
    let Some(spec) = root.get("sft").filter(|s| !s.is_null()) else {
        return Vec::new();
    };
    let s: SftSpec = match serde_path_to_error::deserialize(spec.clone()) {
        Ok(s) => s,
        Err(e) => return vec![streamrl_schemas::problem::from_serde(e).under("sft")],
    };
    let mut errs = Vec::new();
    if s.steps == 0 {
        errs.push(Problem::new("sft.steps", "must be at least 1"));
    }
    if s.batch == 0 {
        errs.push(Problem::new("sft.batch", "must be at least 1"));
    }
    if !(s.lr.is_finite() && s.lr > 0.0) {
        errs.push(Problem::new(
            "sft.lr",
            format!("must be a positive number, got {}", s.lr),
        ));
    }
    if s.checkpoint.is_none()
        && let Err(e) = config::preset(&s.preset, 1)
    {
        errs.push(Problem::new("sft.preset", e.to_string()));
    }
    // An environment configured under `envs:` is checked there; a built-in one here.
    if root.get("envs").and_then(|e| e.get(&s.env)).is_none()
        && let Err(es) = streamrl_stages::build_env(&s.env, &serde_yaml::Value::Null)
    {
        errs.extend(
            es.into_iter()
                .map(|e| Problem::new("sft.env", format!("environment `{}`: {e}", s.env))),
        );
    }
    errs
}

/// Runs the topology's SFT section unless its output exists already.
pub fn sft_from_topology(spec: &serde_yaml::Value, topology: &Path) -> Result<()> {
    if spec.is_null() {
        return Ok(());
    }
    let s: SftSpec = serde_yaml::from_value(spec.clone()).map_err(|e| anyhow!("{}: sft: {e}", topology.display()))?;
    if s.out.join("config.json").exists() {
        eprintln!("sft: {} exists; starting RL from it", s.out.display());
        return Ok(());
    }
    eprintln!(
        "sft: warm start into {} ({} steps of {} samples)",
        s.out.display(),
        s.steps,
        s.batch
    );
    sft(SftArgs {
        env: EnvArgs {
            env: s.env,
            topology: topology.to_path_buf(),
        },
        out: Some(s.out),
        checkpoint: s.checkpoint,
        preset: s.preset,
        steps: s.steps,
        batch: s.batch,
        lr: s.lr,
        seed: s.seed,
        placement: crate::cli::Placement {
            device: s.device,
            dtype: s.dtype,
        },
    })
}

//! `streamrl bench async`: the same RL workload — a tiny model on arith, generation lengths
//! drawn from a heavy tail — run through the whole pipeline in this process with
//! `max_async_level` 0 (synchronous: each step's rollouts wait for the previous version)
//! and 2 (generation up to two versions ahead), side by side.

use anyhow::Result;
use streamrl_model::{Tokenizer, checkpoint, config};
use streamrl_runtime::topology::Topology;

fn topology(dir: &std::path::Path, ckpt: &std::path::Path, level: u64, steps: u64, alpha: f64) -> String {
    format!(
        r#"
bus: memory://bench-async-{level}
run_id: bench-async-{level}
run_dir: {run}
dead_letter: dead_letter
envs:
  arith: {{ weight: 1 }}
topics:
  prompts:       {{ schema: prompts,       partitions: 2, key: group_id }}
  rollouts:      {{ schema: rollouts,      partitions: 2, key: group_id }}
  continuations: {{ schema: continuations, partitions: 2, key: rollout_id, feedback: true }}
  executed:      {{ schema: executed,      partitions: 2, key: group_id }}
  scored:        {{ schema: scored,        partitions: 2, key: group_id }}
  samples:       {{ schema: samples,       partitions: 2, key: group_id }}
  policy:        {{ schema: policy,        partitions: 1 }}
  metrics:       {{ schema: metrics,       partitions: 1 }}
  dead_letter:   {{ schema: dead_letter,   partitions: 1 }}
stages:
  source:
    kind: source
    broadcast: [policy]
    outputs: [prompts, metrics]
    config: {{ checkpoint: {ckpt}, group_size: 8, groups_per_step: 4, max_async_level: {level}, max_steps: {steps},
              max_tokens: 96, min_tokens: 4, length_tail_alpha: {alpha} }}
  rollout:
    kind: rollout
    inputs: [prompts, continuations]
    broadcast: [policy]
    outputs: [rollouts, metrics]
    config: {{ checkpoint: {ckpt}, max_inflight_groups: 12, ignore_eos: true }}
  sandbox: {{ kind: sandbox, inputs: [rollouts], outputs: [executed, continuations] }}
  reward: {{ kind: reward, inputs: [executed], outputs: [scored] }}
  mask: {{ kind: mask, inputs: [scored], outputs: [samples, metrics], config: {{ filter_zero_variance: false }} }}
  trainer:
    kind: trainer
    inputs: [samples]
    outputs: [policy, metrics]
    config: {{ checkpoint: {ckpt}, groups_per_step: 4, max_steps: {steps}, max_off_policy_steps: 8, keep_last: 3,
              train: {{ lr: {{ type: constant, lr: 0.00001 }} }} }}
"#,
        run = dir.join(format!("run-{level}")).display(),
        ckpt = ckpt.display(),
    )
}

/// Runs the benchmark and prints the table.
pub async fn run(steps: u64, alpha: f64) -> Result<()> {
    let dir = tempfile_dir()?;
    let ckpt = dir.join("init");
    let tok = Tokenizer::char_level();
    let hf = config::preset("tiny", tok.vocab_size())?;
    let l = checkpoint::init_seeded(&hf, &candle_core::Device::Cpu, Some(0))?;
    checkpoint::save(&ckpt, &hf, &l.vars, Some(&tok), None)?;
    let threads = std::env::var("CANDLE_NUM_THREADS").unwrap_or_else(|_| "default".into());
    println!(
        "streamrl bench async (CANDLE_NUM_THREADS={threads}; tiny model, arith, 4 groups × 8 samples per step, \
         max_tokens ~ Pareto(α={alpha}) in 4..=96, ignore_eos; {steps} steps; whole pipeline on the memory bus)"
    );
    println!();
    println!(
        "{:<16} {:>6} {:>9} {:>9} {:>15} {:>13}",
        "max_async_level", "steps", "wall s", "s/step", "mean staleness", "tokens/step"
    );
    let mut per_step = Vec::new();
    for level in [0u64, 2] {
        let yaml = topology(&dir, &ckpt, level, steps, alpha);
        let t = Topology::parse(&yaml, &crate::stages::check_config).map_err(|e| {
            anyhow::anyhow!(
                "bench topology: {}",
                e.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
            )
        })?;
        let (summary, _) = crate::cli::pipeline::run_all(t, true).await?;
        let sps = summary.seconds_per_step();
        per_step.push(sps);
        println!(
            "{level:<16} {:>6} {:>9.1} {sps:>9.3} {:>15.2} {:>13.0}",
            summary.steps(),
            summary.wall,
            summary.mean_staleness(),
            summary.mean("samples") * summary.mean("completion_len_mean"),
        );
    }
    println!();
    println!(
        "ratio (s/step at level 0 / at level 2): {:.2}×  (goal ≥ 1.5× on this machine; s/step excludes start-up)",
        per_step[0] / per_step[1]
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn tempfile_dir() -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("streamrl-bench-async-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

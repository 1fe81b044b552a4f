//! `streamrl bench gpu`: the GPU check's one table (`scripts/gpu-check.sh` runs it on a
//! GPU machine). On one device and dtype: the fused RL kernels' parity with their
//! references and their achieved bandwidth against the op-by-op versions; then, per model
//! shape, training tokens/s (forward, logprobs, loss, backward, AdamW) and decode tokens/s
//! of the engine at batch 1 and 64, each against PyTorch + transformers
//! `LlamaForCausalLM` on the same device and dtype when a python3 imports them; then the
//! ways a training step can keep its activations (all, checkpointing, offloading, both):
//! peak device memory and step time. Exits non-zero when a parity check fails. Runs on
//! the CPU too (`--device cpu --dtype f32`; no memory figures there).

use std::time::Instant;

use anyhow::{Result, bail};
use candle_core::{Device, Tensor, Var};
use streamrl_model::config::{self, HfConfig};
use streamrl_model::device::{DeviceSpec, Precision};
use streamrl_model::engine::{Engine, EngineConfig, SamplingParams};
use streamrl_model::loss::{self, LossInputs, LossKind};
use streamrl_model::optim::{Optimizer, OptimizerConfig};
use streamrl_model::{Packed, Transformer, checkpoint, parity, token_logprobs, token_logprobs_entropy};

/// What to measure.
#[derive(clap::Args, Debug)]
pub struct GpuArgs {
    /// Device (cuda:N, or cpu).
    #[arg(long, default_value = "cuda:0")]
    device: DeviceSpec,
    /// Weights' dtype.
    #[arg(long, default_value = "bf16")]
    dtype: Precision,
    /// Model shapes (presets): tiny, tiny-moe, small, smollm2.
    #[arg(long, value_delimiter = ',', default_value = "tiny,small,smollm2")]
    preset: Vec<String>,
    /// Training batch: sequences × tokens per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Timed training steps (after one warm-up).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// New tokens per sequence when decoding.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Rows of the kernels' throughput shapes (positions × a 49152 vocabulary).
    #[arg(long, default_value_t = 512)]
    rows: usize,
    /// Decode batches (sequences at once).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    decode_batch: Vec<usize>,
    /// The activation-memory comparison's shape (a preset; empty: skip it).
    #[arg(long, default_value = "smollm2")]
    memory_preset: String,
    /// Its batch: sequences × tokens per step.
    #[arg(long, default_value_t = 8)]
    memory_batch: usize,
    /// Its tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    memory_seq: usize,
}

/// The vocabulary of every shape: SmolLM2's (the head is a fifth of its compute).
const VOCAB: usize = 49152;

fn sync(d: &Device) -> Result<()> {
    Ok(d.synchronize()?)
}

/// Best wall time (s) of `reps` runs of `f` after one warm-up, synchronised.
fn time(d: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    sync(d)?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        f()?;
        sync(d)?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

pub fn run(a: GpuArgs) -> Result<()> {
    let device = a.device.open()?;
    println!(
        "streamrl bench gpu on {} ({}, weights {}; CANDLE_NUM_THREADS={})",
        a.device,
        if device.is_cuda() { "CUDA" } else { "CPU" },
        a.dtype,
        std::env::var("CANDLE_NUM_THREADS").unwrap_or_else(|_| "default".into())
    );
    println!();
    let checks = parity::run(&device)?;
    println!(
        "{:<34} {:<42} {:>9} {:>9} {:>6} ok",
        "kernel parity", "case", "value", "gradient", "bound"
    );
    for c in &checks {
        println!(
            "{:<34} {:<42} {:>9.1e} {:>9.1e} {:>6.0e} {}",
            c.kernel,
            c.case,
            c.value_err,
            c.grad_err,
            c.tol,
            if c.ok() { "yes" } else { "NO" }
        );
    }
    println!();
    kernels(&device, a.rows)?;
    println!();
    models(&a, &device)?;
    if !a.memory_preset.is_empty() {
        println!();
        memory(&a, &device)?;
    }
    let failed = checks.iter().filter(|c| !c.ok()).count();
    if failed > 0 {
        bail!("{failed} kernel parity check(s) failed (the rows marked NO)");
    }
    Ok(())
}

/// The fused kernels against op by op: best time, and the bytes each must move at least
/// over its time.
fn kernels(d: &Device, rows: usize) -> Result<()> {
    let peak = if d.is_cuda() { " (H200 HBM: ~4300 GB/s)" } else { "" };
    println!(
        "{:<40} {:>10} {:>12} {:>7} {:>10}",
        "kernel (fused vs op by op)", "fused ms", "op-by-op ms", "ratio", "fused GB/s"
    );
    let (b, t, v) = (1, rows, VOCAB);
    let logits = Var::from_tensor(&(Tensor::randn(0f32, 3.0, (b, t, v), d)?))?;
    let toks = Tensor::from_vec((0..(b * t) as u32).map(|i| i * 7919 % v as u32).collect(), (b, t), d)?;
    let bytes = (b * t * v * 4) as f64;
    let fused = time(d, 5, || {
        token_logprobs_entropy(logits.as_tensor(), &toks, 1.0)?;
        Ok(())
    })?;
    let naive = time(d, 5, || {
        streamrl_model::model::token_logprobs_unfused(logits.as_tensor(), &toks, 1.0)?;
        streamrl_model::model::entropy_unfused(logits.as_tensor(), 1.0)?;
        Ok(())
    })?;
    row(&format!("log-softmax + entropy fwd {t}×{v}"), fused, naive, bytes)?;
    let fused = time(d, 5, || {
        token_logprobs(logits.as_tensor(), &toks, 1.0)?.sum_all()?.backward()?;
        Ok(())
    })?;
    let naive = time(d, 5, || {
        streamrl_model::model::token_logprobs_unfused(logits.as_tensor(), &toks, 1.0)?
            .sum_all()?
            .backward()?;
        Ok(())
    })?;
    // Forward reads the logits; backward reads them and writes their gradient.
    row(&format!("log-softmax fwd + bwd {t}×{v}"), fused, naive, 3.0 * bytes)?;
    masked_is_loss(d)?;
    adamw(d)?;
    println!("GB/s: the bytes the kernel must move at least over its time{peak}.");
    Ok(())
}

/// The fused masked importance-sampling loss and its gradient against op by op.
fn masked_is_loss(d: &Device) -> Result<()> {
    let n = 1 << 18;
    let lp = Var::from_tensor(&(Tensor::randn(0f32, 1.0, n, d)? - 2.0)?)?;
    let host: Vec<f32> = lp.to_vec1()?;
    let sampler: Vec<f32> = host
        .iter()
        .enumerate()
        .map(|(i, l)| l + 0.01 * (i % 7) as f32)
        .collect();
    let adv: Vec<f32> = (0..n).map(|i| (i % 5) as f32 - 2.0).collect();
    let mask = vec![1f32; n];
    let inputs = LossInputs {
        logprobs: lp.as_tensor(),
        sampler: &sampler,
        advantages: &adv,
        mask: &mask,
        spans: &[],
    };
    let fused = time(d, 5, || {
        loss::masked_is_fused(inputs, 0.5, 5.0, 0.0)?.0.backward()?;
        Ok(())
    })?;
    let naive = time(d, 5, || {
        loss::compute_op_by_op(LossKind::default(), inputs)?.0.backward()?;
        Ok(())
    })?;
    row(
        &format!("masked IS loss + grad, {n} tokens"),
        fused,
        naive,
        (n * 4 * 5) as f64,
    )
}

/// The fused AdamW step against op by op, on 16M parameters.
fn adamw(d: &Device) -> Result<()> {
    let n = 1 << 24;
    let time_adamw = |op_by_op: bool| -> Result<f64> {
        let vars = candle_nn::VarMap::new();
        let w = vars.get(n, "w", candle_nn::Init::Const(0.5), candle_core::DType::F32, d)?;
        let mut opt = Optimizer::new(&vars, OptimizerConfig::default())?;
        if op_by_op {
            opt.force_op_by_op()?;
        }
        let g = w.sum_all()?.backward()?;
        time(d, 5, || {
            opt.step(&g, 1e-4)?;
            Ok(())
        })
    };
    let (fused, naive) = (time_adamw(false)?, time_adamw(true)?);
    // Reads parameter, gradient and two moments; writes parameter and moments.
    row(
        &format!("AdamW step, {}M parameters", n >> 20),
        fused,
        naive,
        (n * 4 * 7) as f64,
    )
}

fn row(name: &str, fused: f64, naive: f64, bytes: f64) -> Result<()> {
    println!(
        "{name:<40} {:>10.3} {:>12.3} {:>6.2}× {:>10.1}",
        fused * 1e3,
        naive * 1e3,
        naive / fused,
        bytes / fused / 1e9
    );
    Ok(())
}

/// Greedy decode tokens/s of `model` with `slots` sequences at once, `tokens` new tokens
/// each after 16-token prompts (after a warm-up run).
fn decode_rate(model: &Transformer, slots: usize, tokens: usize) -> Result<f64> {
    let mk = || -> Result<Engine> {
        let mut e = Engine::new(
            model.clone(),
            0,
            None,
            EngineConfig {
                max_num_seqs: slots,
                ..Default::default()
            },
        );
        for s in 0..slots {
            let prompt: Vec<u32> = (0..16).map(|i| ((s + i * 7) % VOCAB) as u32).collect();
            let sp = SamplingParams {
                temperature: 0.0,
                max_tokens: tokens,
                ignore_eos: true,
                ..Default::default()
            };
            e.add(prompt, sp)?;
        }
        Ok(e)
    };
    mk()?.run_to_completion()?; // warm-up
    let mut e = mk()?;
    let t0 = Instant::now();
    let produced: usize = e.run_to_completion()?.iter().map(|o| o.tokens.len()).sum();
    Ok(produced as f64 / t0.elapsed().as_secs_f64())
}

/// The shape of a preset with SmolLM2's vocabulary.
fn shape(preset: &str) -> Result<HfConfig> {
    Ok(config::preset(preset, VOCAB)?)
}

/// Training tokens/s and decode tokens/s at batch 1 and 32, per preset, against torch.
fn models(a: &GpuArgs, d: &Device) -> Result<()> {
    let mut ours = Vec::new();
    for p in &a.preset {
        let hf = shape(p)?;
        let init = checkpoint::init(&hf, &Device::Cpu)?;
        let dir = tempfile::tempdir()?;
        checkpoint::save(dir.path(), &hf, &init.vars, None, None)?;
        let l = checkpoint::load_in(dir.path(), d, a.dtype)?;
        let params = crate::cli::model::parameters(&l.vars);
        let rows: Vec<Vec<Vec<u32>>> = (0..a.batch)
            .map(|r| vec![(0..a.seq).map(|i| ((r * 7 + i * 13) % VOCAB) as u32).collect()])
            .collect();
        let batch = Packed::new(&rows, d)?;
        let mut opt = Optimizer::new(&l.vars, OptimizerConfig::default())?;
        let n = batch.tokens.elem_count();
        let step = time(d, a.steps, || {
            let (logits, _) = l.model.forward(&batch)?;
            opt.step(&super::train::sft_loss(&logits, &batch)?.backward()?, 1e-5)?;
            Ok(())
        })?;
        let train = n as f64 / step;
        let decode = a
            .decode_batch
            .iter()
            .map(|&b| decode_rate(&l.model, b, a.tokens))
            .collect::<Result<Vec<_>>>()?;
        ours.push((p.clone(), hf, params, train, decode));
    }
    let torch = torch_rates(a, &ours.iter().map(|o| o.1.clone()).collect::<Vec<_>>())?;
    let mut head = format!(
        "{:<8} {:>7} {:>12} {:>11} {:>6}",
        "shape", "params", "train tok/s", "torch", "ratio"
    );
    for b in &a.decode_batch {
        head += &format!(" {:>13} {:>11} {:>6}", format!("decode b{b}"), "torch", "ratio");
    }
    println!("{head}");
    for (i, (p, _, params, train, decode)) in ours.iter().enumerate() {
        let t = torch.as_ref().map(|t| t[i].clone()).unwrap_or_default();
        let at = |j: usize| t.get(j).copied().unwrap_or(f64::NAN);
        let mut line = format!(
            "{p:<8} {:>6.1}M {train:>12.0} {:>11} {:>6}",
            *params as f64 / 1e6,
            shown(at(0)),
            ratio(*train, at(0))
        );
        for (j, d) in decode.iter().enumerate() {
            line += &format!(" {d:>13.0} {:>11} {:>6}", shown(at(j + 1)), ratio(*d, at(j + 1)));
        }
        println!("{line}");
    }
    println!(
        "train: {}×{} tokens per step, SFT loss, AdamW{} (best of {}); decode: greedy, {} new tokens after 16-token prompts.",
        a.batch,
        a.seq,
        if a.dtype == Precision::Bf16 {
            " with f32 master weights"
        } else {
            ""
        },
        a.steps,
        a.tokens
    );
    match torch {
        Some(_) => println!(
            "torch: transformers LlamaForCausalLM of the same shape on the same device in {}, AdamW, generate(); ratio = streamrl / torch.",
            a.dtype
        ),
        None => println!("torch: not measured (no python3 here imports torch and transformers)."),
    }
    Ok(())
}

/// One way's (peak GB above the start, best step seconds, bytes offloaded per step).
fn measure_way(
    model: &Transformer,
    batch: &Packed,
    way: Option<streamrl_model::model::LayerMemory>,
    d: &Device,
    steps: usize,
) -> Result<(f64, f64, u64)> {
    use streamrl_model::offload::{peak_device_memory, reset_peak_device_memory};
    let mut moved = 0u64;
    let mut step = || -> Result<()> {
        match way {
            None => {
                let (logits, _) = model.forward(batch)?;
                super::train::sft_loss(&logits, batch)?.backward()?;
            }
            Some(m) => {
                let (_, _, _, stats) =
                    model.backward_by_layer(batch, None, 0.0, m, |lg| super::train::sft_loss(lg, batch))?;
                moved = stats.bytes;
            }
        }
        Ok(())
    };
    step()?;
    sync(d)?;
    reset_peak_device_memory(d)?;
    let before = peak_device_memory(d)?;
    step()?;
    sync(d)?;
    let peak = match (peak_device_memory(d)?, before) {
        (Some(p), Some(b)) => p.saturating_sub(b) as f64 / 1e9,
        _ => f64::NAN,
    };
    let secs = time(d, steps, &mut step)?;
    Ok((peak, secs, moved))
}

/// A measured figure, or `–` where it was not measured.
fn shown(x: f64) -> String {
    if x.is_finite() { format!("{x:.0}") } else { "–".into() }
}

fn ratio(ours: f64, theirs: f64) -> String {
    if theirs.is_finite() && theirs > 0.0 {
        format!("{:.2}×", ours / theirs)
    } else {
        "–".into()
    }
}

/// One training step (forward, SFT loss, backward; no optimizer) per way of keeping
/// activations, at the memory preset's shape: the peak of device memory in use during the
/// step (above what the weights and batch already hold) and the best step time.
fn memory(a: &GpuArgs, d: &Device) -> Result<()> {
    use streamrl_model::model::LayerMemory;
    let hf = shape(&a.memory_preset)?;
    let init = checkpoint::init(&hf, &Device::Cpu)?;
    let dir = tempfile::tempdir()?;
    checkpoint::save(dir.path(), &hf, &init.vars, None, None)?;
    let l = checkpoint::load_in(dir.path(), d, a.dtype)?;
    let rows: Vec<Vec<Vec<u32>>> = (0..a.memory_batch)
        .map(|r| vec![(0..a.memory_seq).map(|i| ((r * 7 + i * 13) % VOCAB) as u32).collect()])
        .collect();
    let batch = Packed::new(&rows, d)?;
    let ways: [(&str, Option<LayerMemory>); 5] = [
        ("all kept (plain backward)", None),
        (
            "all kept, layer by layer",
            Some(LayerMemory {
                checkpoint: false,
                offload: false,
            }),
        ),
        (
            "offloaded",
            Some(LayerMemory {
                checkpoint: false,
                offload: true,
            }),
        ),
        (
            "checkpointed",
            Some(LayerMemory {
                checkpoint: true,
                offload: false,
            }),
        ),
        (
            "checkpointed + offloaded",
            Some(LayerMemory {
                checkpoint: true,
                offload: true,
            }),
        ),
    ];
    println!(
        "{:<28} {:>12} {:>8} {:>10} {:>7} {:>12}",
        format!("activations ({}, {}×{})", a.memory_preset, a.memory_batch, a.memory_seq),
        "peak GB",
        "vs all",
        "step ms",
        "vs all",
        "offloaded GB"
    );
    let mut base: Option<(f64, f64)> = None;
    for (name, way) in ways {
        let (peak, secs, moved) = match measure_way(&l.model, &batch, way, d, a.steps) {
            Ok(m) => m,
            Err(e) => {
                println!("{name:<28} failed: {e:#}");
                continue;
            }
        };
        let (p0, s0) = *base.get_or_insert((peak, secs));
        println!(
            "{name:<28} {:>12} {:>8} {:>10.1} {:>6.2}× {:>12.2}",
            if peak.is_finite() {
                format!("{peak:.2}")
            } else {
                "–".into()
            },
            if peak.is_finite() {
                format!("{:.0} %", 100.0 * peak / p0)
            } else {
                "–".into()
            },
            secs * 1e3,
            secs / s0,
            moved as f64 / 1e9
        );
    }
    println!(
        "peak GB: device memory in use at the step's highest, above what the weights and batch hold (the default memory pool's high mark); step: forward, SFT loss, backward, best of {}.",
        a.steps
    );
    Ok(())
}

/// The PyTorch side of the model comparison (argv: device, dtype, batch, seq, steps,
/// tokens, decode batches, then one JSON shape each).
const TORCH_SCRIPT: &str = include_str!("gpu_torch.py");

/// PyTorch's [train, decode at each batch] tokens/s per shape, or `None` without torch.
fn torch_rates(a: &GpuArgs, shapes: &[HfConfig]) -> Result<Option<Vec<Vec<f64>>>> {
    let Some(pythonpath) = super::generate::torch_python() else {
        return Ok(None);
    };
    let mut args = vec![
        a.device.to_string(),
        a.dtype.to_string(),
        a.batch.to_string(),
        a.seq.to_string(),
        a.steps.to_string(),
        a.tokens.to_string(),
        a.decode_batch
            .iter()
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join(","),
    ];
    args.extend(shapes.iter().map(|s| {
        serde_json::json!({
            "vocab": s.vocab_size, "d": s.hidden_size, "ff": s.intermediate_size,
            "layers": s.num_hidden_layers, "heads": s.num_attention_heads,
            "kv": s.num_key_value_heads.unwrap_or(s.num_attention_heads),
            "theta": s.rope_theta, "tied": s.tie_word_embeddings,
        })
        .to_string()
    }));
    let lines = super::generate::run_python_lines("the torch GPU script", TORCH_SCRIPT, &args, pythonpath.as_deref())?;
    if lines.len() != shapes.len() {
        bail!(
            "the torch GPU script measured {} shapes of {}",
            lines.len(),
            shapes.len()
        );
    }
    let get = |l: &serde_json::Value, k: &str| l[k].as_f64().unwrap_or(f64::NAN);
    Ok(Some(
        lines
            .iter()
            .map(|l| {
                std::iter::once(get(l, "train"))
                    .chain(a.decode_batch.iter().map(|b| get(l, &format!("b{b}"))))
                    .collect()
            })
            .collect(),
    ))
}

//! `streamrl bench train`: step time and training tokens/s of the policy model.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use candle_core::Device;
use candle_nn::Optimizer as _;
use streamrl_model::config::HfConfig;
use streamrl_model::loss::{self, LossInputs, LossKind};
use streamrl_model::optim::{Optimizer, OptimizerConfig};
use streamrl_model::{Packed, checkpoint, token_logprobs};

struct Shape {
    name: &'static str,
    hf: HfConfig,
    batch: usize,
    seq: usize,
    /// PyTorch 2.15 CPU, 1 thread, same shape (issue #3, measured on this machine).
    torch_ms: f64,
}

/// A Llama-family shape as the benches train it (untied head, 256 positions).
fn mk(d: usize, layers: usize, heads: usize, ff: usize, vocab: usize) -> HfConfig {
    HfConfig {
        model_type: Some("llama".into()),
        vocab_size: vocab,
        hidden_size: d,
        intermediate_size: ff,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: Some(heads),
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        ..Default::default()
    }
}

/// SmolLM2-135M's layers, heads and vocabulary (its head untied, as the other bench
/// shapes): the large row of the step table and the large memory probe.
fn smollm2_shape() -> HfConfig {
    let mut smol = mk(576, 30, 9, 1536, 49152);
    smol.num_key_value_heads = Some(3);
    smol.rope_theta = 100_000.0;
    smol
}

fn shapes(skip_large: bool) -> Vec<Shape> {
    let mut v = vec![
        Shape {
            name: "d128 L2 V64, 64×16",
            hf: mk(128, 2, 4, 336, 64),
            batch: 64,
            seq: 16,
            torch_ms: 50.0,
        },
        Shape {
            name: "d256 L4 V64, 64×16",
            hf: mk(256, 4, 4, 688, 64),
            batch: 64,
            seq: 16,
            torch_ms: 275.0,
        },
    ];
    if !skip_large {
        v.push(Shape {
            name: "SmolLM2-135M shape, 4×128",
            hf: smollm2_shape(),
            batch: 4,
            seq: 128,
            torch_ms: 6800.0,
        });
    }
    v
}

/// One training step: packed forward, logprobs, SFT loss over every next token, backward,
/// optimizer step. Returns the step time.
fn step(
    model: &streamrl_model::Transformer,
    batch: &Packed,
    opt: &mut dyn FnMut(&candle_core::backprop::GradStore) -> Result<()>,
) -> Result<Duration> {
    let t0 = Instant::now();
    let (logits, _) = model.forward(batch)?;
    let grads = sft_loss(&logits, batch)?.backward()?;
    opt(&grads)?;
    Ok(t0.elapsed())
}

/// The SFT loss over every next token of a packed batch of one sample per row (a row's
/// first position has no logprob), as the benches train.
pub(super) fn sft_loss(logits: &candle_core::Tensor, batch: &Packed) -> streamrl_model::Result<candle_core::Tensor> {
    let lp = token_logprobs(logits, &batch.tokens, 1.0)?.flatten_all()?;
    let n = lp.dims1()?;
    let mask: Vec<f32> = (0..n).map(|i| if i % batch.width == 0 { 0.0 } else { 1.0 }).collect();
    let zeros = vec![0f32; n];
    let inputs = LossInputs {
        logprobs: &lp,
        sampler: &zeros,
        advantages: &zeros,
        mask: &mask,
        spans: &[],
    };
    Ok(loss::compute(LossKind::Sft, inputs)?.0)
}

/// The best step time (ms) of `steps` timed steps after one warm-up, for a freshly
/// initialised model of `s`, fused ops and streamrl's AdamW (`naive`: op-by-op candle and
/// candle's stock AdamW), and the parameter count.
fn time_shape(s: &Shape, batch: &Packed, steps: usize, naive: bool) -> Result<(f64, usize)> {
    let mut m = checkpoint::init(&s.hf, &Device::Cpu)?;
    m.model.set_fused_ops(!naive);
    let params = crate::cli::model::parameters(&m.vars);
    let cfg = OptimizerConfig {
        max_grad_norm: 0.0,
        ..Default::default()
    };
    let mut ours = Optimizer::new(&m.vars, cfg)?;
    let mut theirs = candle_nn::AdamW::new(
        m.vars.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 1e-4,
            ..Default::default()
        },
    )?;
    let mut opt = |g: &candle_core::backprop::GradStore| -> Result<()> {
        if naive {
            theirs.step(g)?;
        } else {
            ours.step(g, 1e-4)?;
        }
        Ok(())
    };
    let mut best = f64::INFINITY;
    for i in 0..=steps {
        let d = step(&m.model, batch, &mut opt)?.as_secs_f64() * 1e3;
        if i > 0 {
            best = best.min(d);
        }
    }
    Ok((best, params))
}

pub fn run(steps: usize, skip_large: bool) -> Result<()> {
    let threads = std::env::var("CANDLE_NUM_THREADS").unwrap_or_else(|_| "default".into());
    println!("streamrl bench train (CANDLE_NUM_THREADS={threads}; best of {steps} steps after one warm-up)");
    let shapes = shapes(skip_large);
    let torch = torch_step_ms(&shapes, steps)?;
    println!();
    println!(
        "{:<28} {:>10} {:>10} {:>11} {:>8} {:>10} {:>10} {:>9}",
        "shape", "params", "naive ms", "streamrl ms", "speed-up", "tokens/s", "torch ms", "vs torch"
    );
    for (i, s) in shapes.iter().enumerate() {
        let rows: Vec<Vec<Vec<u32>>> = (0..s.batch)
            .map(|b| {
                vec![
                    (0..s.seq)
                        .map(|i| ((b * 7 + i * 13) % s.hf.vocab_size) as u32)
                        .collect(),
                ]
            })
            .collect();
        let batch = Packed::new(&rows, &Device::Cpu)?;
        let (ours, params) = time_shape(s, &batch, steps, false)?;
        let (naive, _) = time_shape(s, &batch, steps, true)?;
        let tokens = (s.batch * s.seq) as f64;
        let (torch_ms, mark) = match &torch {
            Some(t) => (t[i], ""),
            None => (s.torch_ms, "*"),
        };
        println!(
            "{:<28} {:>10} {:>10.1} {:>11.1} {:>8.2} {:>10.0} {:>9.1}{mark:1} {:>8.2}×",
            s.name,
            params,
            naive,
            ours,
            naive / ours,
            tokens / (ours / 1e3),
            torch_ms,
            ours / torch_ms
        );
    }
    println!();
    println!("naive: the same model op by op in candle (what runs off the CPU) with candle's stock AdamW;");
    println!("streamrl: fused training ops (streamrl_model::fused) and streamrl's fused AdamW.");
    match torch {
        Some(_) => println!(
            "torch: PyTorch + transformers LlamaForCausalLM of the same shape, 1 thread, AdamW, best of {steps} steps, this run."
        ),
        None => println!(
            "torch *: recorded for issue #3 on this machine (PyTorch 2.15, 1 thread): no python3 here imports torch and\n\
             transformers (also tried $STREAMRL_TOOLS_DIR/py and target/test-tools/py, where the interop tests install them)."
        ),
    }
    println!("vs torch: streamrl step time / torch's (below 1.00× beats it).");
    checkpointing_table(skip_large)
}

const TORCH_SCRIPT: &str = r#"
import json, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.set_num_threads(1)
torch.manual_seed(0)
steps = int(sys.argv[1])
for spec in map(json.loads, sys.argv[2:]):
    cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["d"], intermediate_size=spec["ff"],
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv"], rms_norm_eps=1e-5, rope_theta=spec["theta"],
                      max_position_embeddings=256, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    b, t, v = spec["batch"], spec["seq"], spec["vocab"]
    ids = torch.tensor([[(r * 7 + i * 13) % v for i in range(t)] for r in range(b)])
    best = float("inf")
    for i in range(steps + 1):
        t0 = time.perf_counter()
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i > 0:
            best = min(best, time.perf_counter() - t0)
    print(json.dumps({"ms": best * 1e3}), flush=True)
"#;

/// PyTorch's step time (ms) at every shape, run now in a python3 that imports torch and
/// transformers; `None` when there is none.
fn torch_step_ms(shapes: &[Shape], steps: usize) -> Result<Option<Vec<f64>>> {
    let Some(pythonpath) = super::generate::torch_python() else {
        return Ok(None);
    };
    let specs: Vec<String> = shapes
        .iter()
        .map(|s| {
            serde_json::json!({
                "vocab": s.hf.vocab_size, "d": s.hf.hidden_size, "ff": s.hf.intermediate_size,
                "layers": s.hf.num_hidden_layers, "heads": s.hf.num_attention_heads,
                "kv": s.hf.num_key_value_heads.unwrap_or(s.hf.num_attention_heads),
                "theta": s.hf.rope_theta, "batch": s.batch, "seq": s.seq,
            })
            .to_string()
        })
        .collect();
    let mut args = vec![steps.max(1).to_string()];
    args.extend(specs);
    let ms = super::generate::run_python_script(
        "the torch training script",
        TORCH_SCRIPT,
        &args,
        pythonpath.as_deref(),
        "ms",
    )?;
    if ms.len() != shapes.len() {
        bail!("the torch script timed {} shapes of {}", ms.len(), shapes.len());
    }
    Ok(Some(ms))
}

/// The memory probe's shape: activations dominate (d256, 8 layers, 16 × 256 tokens).
fn probe_shape() -> HfConfig {
    let mut h = streamrl_model::config::preset("small", 64).expect("preset");
    h.num_hidden_layers = 8;
    h.max_position_embeddings = 256;
    h
}

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// One micro-batch of the memory probe: the small shape's 16 rows of one 256-token sample,
/// or (`large`) SmolLM2-135M's shape with the trainer's default micro-batch, 16 rows of 256
/// tokens each packing three samples (90, 85 and 81 tokens).
fn probe_batch(large: bool) -> Result<(HfConfig, Packed)> {
    if !large {
        let rows: Vec<Vec<Vec<u32>>> = (0..16)
            .map(|b| vec![(0..256).map(|i| ((b * 7 + i * 13) % 64) as u32).collect()])
            .collect();
        return Ok((probe_shape(), Packed::new(&rows, &Device::Cpu)?));
    }
    let hf = smollm2_shape();
    let vocab = hf.vocab_size;
    let rows: Vec<Vec<Vec<u32>>> = (0..16)
        .map(|b| {
            [90usize, 85, 81]
                .iter()
                .map(|&len| (0..len).map(|i| ((b * 7 + i * 13) % vocab) as u32).collect())
                .collect()
        })
        .collect();
    Ok((hf, Packed::new(&rows, &Device::Cpu)?))
}

/// One training step of a probe batch ([`probe_batch`]) with or without activation
/// checkpointing, in a process of its own; prints `peak_bytes step_ms` (peak RSS above
/// the RSS before it).
pub fn memory_probe(checkpointing: bool, large: bool) -> Result<()> {
    let (hf, batch) = probe_batch(large)?;
    let m = checkpoint::init(&hf, &Device::Cpu)?;
    let loss_of = |logits: &candle_core::Tensor| sft_loss(logits, &batch);
    let before = status_kib("VmRSS:");
    // Reset the high-water mark so VmHWM is this step's peak.
    std::fs::write("/proc/self/clear_refs", "5")?;
    let t0 = Instant::now();
    let grads = if checkpointing {
        m.model.backward_checkpointed(&batch, None, 0.0, loss_of)?.0
    } else {
        let (logits, _) = m.model.forward(&batch)?;
        loss_of(&logits)?.backward()?
    };
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let peak = status_kib("VmHWM:").saturating_sub(before) * 1024;
    drop(grads);
    println!("{peak} {ms:.1}");
    Ok(())
}

/// Peak memory and step time of one training step with and without activation
/// checkpointing, each in a fresh process.
fn checkpointing_table(skip_large: bool) -> Result<()> {
    let exe = std::env::current_exe()?;
    let probe = |mode: &str, large: bool| -> Result<(f64, f64)> {
        let mut args = vec!["bench", "train", "--memory-probe", mode];
        if large {
            args.push("--probe-smollm2");
        }
        let out = std::process::Command::new(&exe).args(args).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let mut it = text.split_whitespace();
        match (
            it.next().and_then(|v| v.parse().ok()),
            it.next().and_then(|v| v.parse().ok()),
        ) {
            (Some(p), Some(ms)) => Ok((p, ms)),
            _ => anyhow::bail!("memory probe `{mode}` failed: {}", String::from_utf8_lossy(&out.stderr)),
        }
    };
    println!();
    println!("activation checkpointing (one micro-batch's forward + backward, fresh process each)");
    println!("{:<52} {:>15} {:>12}", "", "peak RSS MiB", "step ms");
    let shapes = [
        (false, "d256 L8 V64, 16×256 tokens"),
        (true, "SmolLM2-135M shape, 16×256 tokens (3 samples a row)"),
    ];
    for (large, name) in shapes.into_iter().filter(|(large, _)| !(skip_large && *large)) {
        let (off, on) = (probe("off", large)?, probe("on", large)?);
        println!(
            "{:<52} {:>15.1} {:>12.1}",
            format!("{name}: off"),
            off.0 / 1048576.0,
            off.1
        );
        println!("{:<52} {:>15.1} {:>12.1}", "  on", on.0 / 1048576.0, on.1);
        println!("{:<52} {:>14.2}× {:>11.2}×", "  on / off", on.0 / off.0, on.1 / off.1);
    }
    Ok(())
}

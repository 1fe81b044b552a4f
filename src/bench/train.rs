//! `streamrl bench train`: step time and training tokens/s of the policy model.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use candle_core::Device;
use candle_nn::Optimizer as _;
use streamrl_kernels::bf16::{self, Products};
use streamrl_kernels::cores;
use streamrl_model::config::HfConfig;
use streamrl_model::loss::{self, LossInputs, LossKind};
use streamrl_model::optim::{Optimizer, OptimizerConfig};
use streamrl_model::{Packed, checkpoint, token_logprobs};

struct Shape {
    name: &'static str,
    hf: HfConfig,
    batch: usize,
    seq: usize,
    /// Whether the naive (op-by-op candle) step is timed too (small shapes: at SmolLM2's
    /// it takes several times the fused step and says nothing new).
    naive: bool,
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
            naive: true,
        },
        Shape {
            name: "d256 L4 V64, 64×16",
            hf: mk(256, 4, 4, 688, 64),
            batch: 64,
            seq: 16,
            naive: true,
        },
    ];
    if !skip_large {
        for (name, batch, seq) in [
            ("SmolLM2-135M shape, 4×128", 4, 128),
            ("SmolLM2-135M shape, 8×256", 8, 256),
        ] {
            v.push(Shape {
                name,
                hf: smollm2_shape(),
                batch,
                seq,
                naive: false,
            });
        }
    }
    v
}

/// The thread counts every shape is timed at.
const THREADS: [usize; 2] = [1, 2];

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
/// initialised model of `s` with products of type `p` spread over `threads` cores, fused
/// ops and streamrl's AdamW (`naive`: op-by-op candle and candle's stock AdamW), and the
/// parameter count.
fn time_shape(
    s: &Shape,
    batch: &Packed,
    steps: usize,
    naive: bool,
    p: Products,
    threads: usize,
) -> Result<(f64, usize)> {
    let mut m = checkpoint::init(&s.hf, &Device::Cpu)?;
    m.model.set_fused_ops(!naive);
    m.model.set_products(p);
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
        let d = cores::spread(threads, || step(&m.model, batch, &mut opt))?.as_secs_f64() * 1e3;
        if i > 0 {
            best = best.min(d);
        }
    }
    Ok((best, params))
}

pub fn run(steps: usize, skip_large: bool, only: Option<&str>) -> Result<()> {
    println!("streamrl bench train (best of {steps} steps after one warm-up; a training step is packed forward,");
    println!("SFT loss over every next token, backward and AdamW)");
    println!("{}", bf16::describe());
    let mut shapes = shapes(skip_large);
    shapes.retain(|s| only.is_none_or(|o| s.name.contains(o)));
    if shapes.is_empty() {
        bail!("no bench shape's name contains `{}`", only.unwrap_or_default());
    }
    let torch = torch_step_ms(&shapes, steps)?;
    println!();
    println!(
        "{:<27} {:>3} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9}",
        "shape",
        "thr",
        "params",
        "naive ms",
        "f32 ms",
        "bf16 ms",
        "torch f32",
        "torch ac",
        "torch b16",
        "f32/tf32",
        "b16/tb16",
        "b16 tok/s"
    );
    let na = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.1}"));
    let ratio = |a: f64, b: Option<f64>| b.map_or("–".to_string(), |b| format!("{:.2}×", a / b));
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
        for (j, &threads) in THREADS.iter().enumerate() {
            let (f32_ms, params) = time_shape(s, &batch, steps, false, Products::F32, threads)?;
            let (bf16_ms, _) = time_shape(s, &batch, steps, false, Products::Bf16, threads)?;
            let naive = (s.naive && threads == 1)
                .then(|| time_shape(s, &batch, steps, true, Products::F32, threads).map(|t| t.0))
                .transpose()?;
            let t = torch.as_ref().map(|t| t[i * THREADS.len() + j]);
            // The faster of PyTorch's two bf16 modes is the one to beat.
            let torch_bf16 = t.map(|t| t.autocast.min(t.bf16));
            println!(
                "{:<27} {:>3} {:>10} {:>9} {:>9.1} {:>9.1} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9.0}",
                s.name,
                threads,
                params,
                na(naive),
                f32_ms,
                bf16_ms,
                na(t.map(|t| t.f32)),
                na(t.map(|t| t.autocast)),
                na(t.map(|t| t.bf16)),
                ratio(f32_ms, t.map(|t| t.f32)),
                ratio(bf16_ms, torch_bf16),
                (s.batch * s.seq) as f64 / (bf16_ms / 1e3)
            );
        }
    }
    println!();
    println!("naive: the same model op by op in candle (what runs off the CPU) with candle's stock AdamW, f32.");
    println!("f32, bf16: streamrl's fused training ops and fused AdamW, products in f32 or in bf16 with f32 sums");
    println!("  (weights, norms, softmax, logprobs, loss and optimizer state f32), spread over `thr` cores.");
    match torch {
        Some(_) => {
            println!(
                "torch: PyTorch + transformers LlamaForCausalLM of the same shape, torch.set_num_threads(thr), AdamW,"
            );
            println!("  this run: f32; ac = bf16 autocast (f32 weights, as streamrl's bf16); b16 = the model in bf16.");
            println!(
                "b16/tb16: streamrl bf16 / the faster torch bf16 mode; f32/tf32: f32 against f32 (below 1.00× beats it)."
            );
        }
        None => println!(
            "torch: not measured (no python3 imports torch and transformers, and installing them failed: see above)."
        ),
    }
    if only.is_some() {
        return Ok(());
    }
    checkpointing_table(skip_large)
}

const TORCH_SCRIPT: &str = r#"
import contextlib, json, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
steps = int(sys.argv[1])
for spec in map(json.loads, sys.argv[2:]):
    torch.set_num_threads(spec["threads"])
    cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["d"], intermediate_size=spec["ff"],
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv"], rms_norm_eps=1e-5, rope_theta=spec["theta"],
                      max_position_embeddings=256, tie_word_embeddings=False)
    b, t, v = spec["batch"], spec["seq"], spec["vocab"]
    ids = torch.tensor([[(r * 7 + i * 13) % v for i in range(t)] for r in range(b)])
    out = {}
    for mode in ("f32", "autocast", "bf16"):
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).float().train()
        if mode == "bf16":
            m = m.to(torch.bfloat16)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext
        best = float("inf")
        for i in range(steps + 1):
            t0 = time.perf_counter()
            with ctx():
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i > 0:
                best = min(best, time.perf_counter() - t0)
        out[mode] = best * 1e3
        del m, opt
    print(json.dumps({"ms": out}), flush=True)
"#;

/// PyTorch's best step times (ms) at one shape and thread count.
#[derive(Debug, Clone, Copy, serde::Deserialize)]
struct TorchMs {
    f32: f64,
    autocast: f64,
    bf16: f64,
}

/// PyTorch's step times at every shape and thread count ([`THREADS`], shape-major), run
/// now in a python3 that imports torch and transformers; `None` when there is none.
fn torch_step_ms(shapes: &[Shape], steps: usize) -> Result<Option<Vec<TorchMs>>> {
    let Some(pythonpath) = super::generate::torch_python() else {
        return Ok(None);
    };
    let specs: Vec<String> = shapes
        .iter()
        .flat_map(|s| THREADS.iter().map(move |&threads| (s, threads)))
        .map(|(s, threads)| {
            serde_json::json!({
                "vocab": s.hf.vocab_size, "d": s.hf.hidden_size, "ff": s.hf.intermediate_size,
                "layers": s.hf.num_hidden_layers, "heads": s.hf.num_attention_heads,
                "kv": s.hf.num_key_value_heads.unwrap_or(s.hf.num_attention_heads),
                "theta": s.hf.rope_theta, "batch": s.batch, "seq": s.seq, "threads": threads,
            })
            .to_string()
        })
        .collect();
    let n = specs.len();
    let mut args = vec![steps.max(1).to_string()];
    args.extend(specs);
    let what = "the torch training script";
    let ms = super::generate::run_python_lines(what, TORCH_SCRIPT, &args, pythonpath.as_deref())?
        .into_iter()
        .map(|v| serde_json::from_value::<TorchMs>(v["ms"].clone()).with_context(|| format!("{what} printed {v}")))
        .collect::<Result<Vec<_>>>()?;
    if ms.len() != n {
        bail!("{what} timed {} shapes and thread counts of {n}", ms.len());
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

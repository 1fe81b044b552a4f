//! `streamrl bench generate`: decode throughput of the continuous-batching engine at batch
//! 1, 32 and 128 against full recompute; continuous against static batching on a
//! workload whose lengths vary 10×; and, when a Python with torch and transformers is
//! found, the same checkpoint through Hugging Face `generate`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::Device;
use streamrl_kernels::bf16::Products;
use streamrl_kernels::cores;
use streamrl_model::engine::{Engine, EngineConfig, EngineStats, SamplingParams};
use streamrl_model::infer::CpuModel;
use streamrl_model::{Packed, Transformer, checkpoint};

use super::stats::median;

const VOCAB: usize = 100;
const PROMPT: usize = 16;

fn prompt(b: usize) -> Vec<u32> {
    (0..PROMPT).map(|i| ((b + i * 7) % VOCAB) as u32).collect()
}

fn params(seed: u64, max_tokens: usize, temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        seed,
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

fn engine(model: &Transformer, slots: usize) -> Engine {
    Engine::new(
        model.clone(),
        0,
        None,
        EngineConfig {
            max_num_seqs: slots,
            ..Default::default()
        },
    )
}

/// Runs `requests` (prompt, max_tokens) through a fresh engine with `slots` sequences at a
/// time; returns (seconds, tokens generated, the engine's counters).
fn engine_run(
    model: &Transformer,
    slots: usize,
    requests: &[(Vec<u32>, usize)],
    temperature: f32,
) -> Result<(f64, usize, EngineStats)> {
    let mut e = engine(model, slots);
    for (i, (p, n)) in requests.iter().enumerate() {
        e.add(p.clone(), params(i as u64, *n, temperature))?;
    }
    let t0 = Instant::now();
    let produced = e.run_to_completion()?.iter().map(|o| o.tokens.len()).sum();
    Ok((t0.elapsed().as_secs_f64(), produced, e.stats()))
}

/// SmolLM2's vocabulary: the head (49152 × 576) is a fifth of the model's compute.
const SMOLLM2_VOCAB: usize = 49152;

/// Whether a preset is too large for the mixed workloads and batch 128.
fn large(preset: &str) -> bool {
    preset == "smollm2"
}

pub fn generate(tokens: usize, presets: &[String]) -> Result<()> {
    let threads = std::env::var("CANDLE_NUM_THREADS").unwrap_or_else(|_| "default".into());
    println!(
        "streamrl bench generate (CANDLE_NUM_THREADS={threads}; {tokens} new tokens per sequence, {PROMPT}-token prompts)"
    );
    println!();
    println!(
        "{:<8} {:>6} {:>10} {:>13} {:>9} {:>16} {:>7}",
        "preset", "batch", "wall ms", "decode tok/s", "ms/step", "recompute tok/s", "ratio"
    );
    let models: Vec<(&str, Transformer)> = presets
        .iter()
        .map(|p| {
            let vocab = if large(p) { SMOLLM2_VOCAB } else { VOCAB };
            Ok((
                p.as_str(),
                checkpoint::init(&streamrl_model::config::preset(p, vocab)?, &Device::Cpu)?.model,
            ))
        })
        .collect::<Result<_>>()?;
    fixed_batches(tokens, &models)?;
    let models: Vec<(&str, Transformer)> = models.into_iter().filter(|(p, _)| !large(p)).collect();
    if !models.is_empty() {
        mixed_workloads(&models)?;
    }
    hf_comparison(tokens, presets)
}

/// Batches of 1, 32 and 128 equal requests: decode tokens/s against recomputing every
/// sequence in full.
fn fixed_batches(tokens: usize, models: &[(&str, Transformer)]) -> Result<()> {
    for (preset, m) in models {
        let batches: &[usize] = if large(preset) { &[1, 32] } else { &[1, 32, 128] };
        for &batch in batches {
            let requests: Vec<_> = (0..batch).map(|b| (prompt(b), tokens)).collect();
            engine_run(m, batch, &requests, 1.0)?; // warm-up (page faults, allocator)
            let (wall, produced, _) = engine_run(m, batch, &requests, 1.0)?;
            let rate = produced as f64 / wall;
            // Recomputing every sequence in full is quadratic: batch 1 only at SmolLM2's size.
            let recompute = if large(preset) { batch == 1 } else { batch <= 32 };
            let base = if recompute {
                let prompts: Vec<Vec<u32>> = requests.iter().map(|r| r.0.clone()).collect();
                recompute_tokens_per_sec(m, &prompts, tokens.min(32))?
            } else {
                f64::NAN
            };
            println!(
                "{preset:<8} {batch:>6} {:>10.1} {rate:>13.0} {:>9.2} {base:>16.0} {:>7.2}",
                wall * 1e3,
                wall * 1e3 / tokens as f64,
                rate / base
            );
        }
    }
    println!();
    println!("Baseline: greedy decoding that recomputes every sequence in full each step (no KV cache), same process.");
    println!();
    Ok(())
}

/// 256 requests of mixed lengths, 32 at a time: continuous batching against static
/// batches and against the engine draining each batch before admitting the next.
fn mixed_workloads(models: &[(&str, Transformer)]) -> Result<()> {
    // Mixed lengths: 256 requests, max_tokens 8..=80 (10×), 32 sequences at a time, in two
    // shapes: spread evenly, and log-uniform (most short, a few long, as RL completions).
    let (n, slots) = (256usize, 32usize);
    let golden = |i: usize| (i as f64 * 0.618_033_988_749_895).fract();
    let workloads: [(&str, Vec<usize>); 2] = [
        ("uniform", (0..n).map(|i| 8 + (i * 37 % 73)).collect()),
        (
            "log-uniform",
            (0..n).map(|i| (8.0 * 10f64.powf(golden(i))).round() as usize).collect(),
        ),
    ];
    println!("mixed workloads: {n} requests, max_tokens 8..=80 (10×), {slots} sequences at a time");
    println!(
        "{:<8} {:<12} {:>16} {:>13} {:>7} {:>6} {:>14} {:>7} {:>7} {:>7}",
        "preset",
        "lengths",
        "continuous tok/s",
        "static tok/s",
        "ratio",
        "bound",
        "drained tok/s",
        "ratio",
        "batch c",
        "batch d"
    );
    for (shape, lens) in &workloads {
        let requests: Vec<(Vec<u32>, usize)> = lens.iter().enumerate().map(|(i, &l)| (prompt(i), l)).collect();
        let useful: usize = lens.iter().sum();
        // What static batching computes over what is asked, prompts included: the most
        // continuous batching can gain when a token costs the same in any batch.
        let padded: usize = lens.chunks(slots).map(|c| c.len() * c.iter().max().unwrap_or(&0)).sum();
        let bound = (padded + n * PROMPT) as f64 / (useful + n * PROMPT) as f64;
        for (preset, m) in models {
            let cpu = CpuModel::new(m)?;
            static_batches(&cpu, &requests[..slots], slots)?; // warm-up
            // Three alternating rounds; each column is the median (one round on a shared
            // 2-core machine is at the mercy of its neighbours).
            let (mut cont, mut stat, mut drained) = (vec![], vec![], vec![]);
            let (mut batch_c, mut batch_d) = (0.0, 0.0);
            for _ in 0..3 {
                // Continuous: the engine admits a waiting request whenever a sequence finishes.
                let (secs, produced, st) = engine_run(m, slots, &requests, 1.0)?;
                cont.push(secs);
                if produced != useful {
                    bail!("the engine produced {produced} tokens, {useful} were requested");
                }
                batch_c = st.batch_rows as f64 / st.decode_steps.max(1) as f64;
                // Static: batches of `slots` in arrival order, each decoded until its longest
                // is done, through the same kernels.
                stat.push(static_batches(&cpu, &requests, slots)?);
                let (secs, sd) = drained_batches(m, &requests, slots)?;
                drained.push(secs);
                batch_d = sd.batch_rows as f64 / sd.decode_steps.max(1) as f64;
            }
            let (cont, stat, drained) = (median(cont), median(stat), median(drained));
            println!(
                "{preset:<8} {shape:<12} {:>16.0} {:>13.0} {:>7.2} {bound:>6.2} {:>14.0} {:>7.2} {batch_c:>7.1} {batch_d:>7.1}",
                useful as f64 / cont,
                useful as f64 / stat,
                stat / cont,
                useful as f64 / drained,
                drained / cont,
            );
        }
    }
    println!();
    println!("static: every batch decodes until its longest request is done (the rows that finished early are");
    println!("wasted work), as HF `generate` does, on the same CPU kernels. drained: the engine admitting a new");
    println!("batch only when the last one has drained (finished rows leave, nobody joins). tok/s counts only");
    println!(
        "requested tokens; ratio = continuous / baseline; bound = (static's padded tokens + prompts) / (requested"
    );
    println!("tokens + prompts); batch c/d = mean decode batch, continuous / drained;");
    println!("each time the median of 3 alternating rounds.");
    println!();
    Ok(())
}

/// The engine admitting a new batch only once the previous one has drained: seconds and
/// the engine's counters.
fn drained_batches(m: &Transformer, requests: &[(Vec<u32>, usize)], slots: usize) -> Result<(f64, EngineStats)> {
    let mut e = engine(m, slots);
    let t0 = Instant::now();
    for chunk in requests.chunks(slots) {
        for (i, (p, l)) in chunk.iter().enumerate() {
            e.add(p.clone(), params(i as u64, *l, 1.0))?;
        }
        e.run_to_completion()?;
    }
    Ok((t0.elapsed().as_secs_f64(), e.stats()))
}

/// Static batching on the CPU kernels: each batch is prefilled in one forward and then
/// decoded (greedy) for as many steps as its longest request asks, every row every step.
fn static_batches(cpu: &CpuModel, requests: &[(Vec<u32>, usize)], slots: usize) -> Result<f64> {
    let v = cpu.config().vocab;
    let t0 = Instant::now();
    for chunk in requests.chunks(slots) {
        let max = chunk.iter().map(|r| r.1).max().unwrap_or(1);
        let mut kvs: Vec<_> = chunk.iter().map(|(p, _)| cpu.new_kv(p.len() + max)).collect();
        let mut entries: Vec<_> = kvs.iter_mut().zip(chunk).map(|(k, (p, _))| (k, &p[..])).collect();
        let mut next = argmax_rows(&cpu.forward(&mut entries)?, v);
        for _ in 1..max {
            let mut entries: Vec<_> = kvs
                .iter_mut()
                .zip(&next)
                .map(|(k, t)| (k, std::slice::from_ref(t)))
                .collect();
            next = argmax_rows(&cpu.forward(&mut entries)?, v);
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn argmax_rows(logits: &[f32], v: usize) -> Vec<u32> {
    logits
        .chunks_exact(v)
        .map(|r| {
            r.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |a, (i, &x)| if x > a.1 { (i, x) } else { a })
                .0 as u32
        })
        .collect()
}

/// Greedy decoding without a cache: a full forward of every sequence per new token.
fn recompute_tokens_per_sec(model: &Transformer, prompts: &[Vec<u32>], tokens: usize) -> Result<f64> {
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let t0 = Instant::now();
    for _ in 0..tokens {
        let rows: Vec<Vec<Vec<u32>>> = seqs.iter().map(|s| vec![s.clone()]).collect();
        let batch = Packed::new(&rows, &Device::Cpu)?;
        let (logits, _) = model.forward(&batch)?;
        let t = seqs[0].len();
        let last = logits
            .narrow(1, t - 1, 1)?
            .squeeze(1)?
            .argmax(candle_core::D::Minus1)?
            .to_vec1::<u32>()?;
        for (s, tok) in seqs.iter_mut().zip(last) {
            s.push(tok);
        }
    }
    Ok((tokens * prompts.len()) as f64 / t0.elapsed().as_secs_f64())
}

/// The PyTorch and transformers the baselines run, pinned as the interop tests pin them.
const TORCH_PACKAGES: [&str; 2] = ["torch==2.15.0", "transformers==5.24.0"];

/// Where torch and transformers can be imported from (see
/// [`super::sql::python_importing`]): when no python3 imports them, they are installed
/// into the tools' Python directory first, as the interop tests install them (once; about
/// 3 GB). `None` when that fails too (the message says why).
pub(crate) fn torch_python() -> Option<Option<PathBuf>> {
    const MODULES: &str = "torch, transformers";
    if let Some(found) = super::sql::python_importing(MODULES) {
        return Some(found);
    }
    let dir = super::sql::tools_python_dir();
    eprintln!(
        "installing {} into {} for the baselines (once)",
        TORCH_PACKAGES.join(" "),
        dir.display()
    );
    let status = std::fs::create_dir_all(&dir).and_then(|_| {
        Command::new("flock")
            .arg(dir.with_file_name(".py.lock"))
            .args(["python3", "-m", "pip", "install", "--quiet", "--target"])
            .arg(&dir)
            .args(TORCH_PACKAGES)
            .status()
    });
    match status {
        Ok(s) if s.success() => super::sql::python_importing(MODULES),
        other => {
            eprintln!("installing the baselines failed ({other:?})");
            None
        }
    }
}

const HF_SCRIPT: &str = r#"
import json, sys, time, torch
from transformers import AutoModelForCausalLM
ckpt, tokens, vocab, prompt_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
models = {}
for spec in sys.argv[5:]:
    batch, threads, dtype = spec.split(":")
    batch, threads = int(batch), int(threads)
    torch.set_num_threads(threads)
    if dtype not in models:
        models[dtype] = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype={"f32": torch.float32, "bf16": torch.bfloat16}[dtype]).eval()
    m = models[dtype]
    ids = torch.tensor([[(b + i * 7) % vocab for i in range(prompt_len)] for b in range(batch)])
    # No end-of-sequence token: every row generates `tokens` (no min_new_tokens processor,
    # which costs HF about 20%). The best of two timed runs after a warm-up.
    kw = dict(max_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    best = 0.0
    with torch.no_grad():
        m.generate(ids, **kw)
        for _ in range(2):
            t0 = time.perf_counter()
            out = m.generate(ids, **kw)
            secs = time.perf_counter() - t0
            best = max(best, (out.shape[1] - prompt_len) * batch / secs)
    print(json.dumps({"tok_per_s": best}), flush=True)
"#;

/// Decode batches and thread counts of the comparison with Hugging Face `generate`.
const HF_BATCHES: [usize; 2] = [1, 32];
const HF_THREADS: [usize; 2] = [1, 2];

/// Every preset's checkpoint through HF `generate` and through the engine (greedy), in
/// f32 and bf16, at batch 1 and 32, on 1 and 2 threads, all in this run.
fn hf_comparison(tokens: usize, presets: &[String]) -> Result<()> {
    println!("{}", streamrl_kernels::bf16::describe());
    let python = torch_python();
    if python.is_none() {
        println!("Hugging Face transformers: not measured (no python3 imports torch and transformers, and installing");
        println!("them failed: see above).");
    }
    println!(
        "Against Hugging Face transformers `generate` on the same checkpoint: greedy, {tokens} new tokens (HF: best of 2)"
    );
    println!(
        "{:<8} {:>5} {:>3} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "preset", "batch", "thr", "f32 tok/s", "bf16 tok/s", "HF f32", "HF bf16", "f32/HF", "bf16/HF"
    );
    for preset in presets {
        let dir = tempfile::tempdir()?;
        let vocab = if large(preset) { SMOLLM2_VOCAB } else { VOCAB };
        let hf = streamrl_model::config::preset(preset, vocab)?;
        let loaded = checkpoint::init(&hf, &Device::Cpu)?;
        checkpoint::save(dir.path(), &hf, &loaded.vars, None, None)?;
        let m = &loaded.model;
        let specs: Vec<(usize, usize, &str)> = HF_BATCHES
            .iter()
            .flat_map(|&b| HF_THREADS.iter().flat_map(move |&t| [(b, t, "f32"), (b, t, "bf16")]))
            .collect();
        let theirs = match &python {
            Some(pp) => Some(run_hf(dir.path(), pp.as_deref(), tokens, vocab, &specs)?),
            None => None,
        };
        let mut bf16_model = m.clone();
        bf16_model.set_products(Products::Bf16);
        for (i, &(batch, threads)) in HF_BATCHES
            .iter()
            .flat_map(|&b| HF_THREADS.iter().map(move |&t| (b, t)))
            .collect::<Vec<_>>()
            .iter()
            .enumerate()
        {
            let requests: Vec<_> = (0..batch).map(|b| (prompt(b), tokens)).collect();
            let rate = |model: &Transformer| -> Result<f64> {
                cores::spread(threads, || {
                    engine_run(model, batch, &requests, 0.0)?;
                    let (wall, produced, _) = engine_run(model, batch, &requests, 0.0)?;
                    Ok(produced as f64 / wall)
                })
            };
            let (f, b) = (rate(m)?, rate(&bf16_model)?);
            let (hf32, hf16) = match &theirs {
                Some(t) => (Some(t[2 * i]), Some(t[2 * i + 1])),
                None => (None, None),
            };
            let na = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.0}"));
            let ratio = |a: f64, v: Option<f64>| v.map_or("–".to_string(), |v| format!("{:.2}×", a / v));
            println!(
                "{preset:<8} {batch:>5} {threads:>3} {f:>9.0} {b:>9.0} {:>9} {:>9} {:>9} {:>9}",
                na(hf32),
                na(hf16),
                ratio(f, hf32),
                ratio(b, hf16)
            );
        }
    }
    println!();
    println!(
        "f32, bf16: the engine's decode with f32 products, or bf16 products with f32 sums (weights converted once),"
    );
    println!("spread over `thr` cores; HF: AutoModelForCausalLM in float32 or bfloat16, torch.set_num_threads(thr).");
    println!("tok/s counts generated tokens over the whole call, prefill included; ratio = streamrl / HF, same dtype.");
    Ok(())
}

fn run_hf(
    ckpt: &Path,
    pythonpath: Option<&Path>,
    tokens: usize,
    vocab: usize,
    specs: &[(usize, usize, &str)],
) -> Result<Vec<f64>> {
    let mut args = vec![
        ckpt.display().to_string(),
        tokens.to_string(),
        vocab.to_string(),
        PROMPT.to_string(),
    ];
    args.extend(specs.iter().map(|(b, t, d)| format!("{b}:{t}:{d}")));
    run_python_script("the HF generate script", HF_SCRIPT, &args, pythonpath, "tok_per_s")
}

/// Runs `script` in python3 with one thread (`PYTHONPATH` = `pythonpath` when given) and
/// returns `field` of every JSON line it prints.
pub(crate) fn run_python_script(
    what: &str,
    script: &str,
    args: &[String],
    pythonpath: Option<&Path>,
    field: &str,
) -> Result<Vec<f64>> {
    run_python_lines(what, script, args, pythonpath)?
        .iter()
        .map(|v| {
            v[field]
                .as_f64()
                .with_context(|| format!("{what}: {field} missing in {v}"))
        })
        .collect()
}

/// Runs `script` as [`run_python_script`] does and returns every JSON line it prints.
pub(crate) fn run_python_lines(
    what: &str,
    script: &str,
    args: &[String],
    pythonpath: Option<&Path>,
) -> Result<Vec<serde_json::Value>> {
    let mut c = Command::new("python3");
    c.arg("-c").arg(script).args(args).env("OMP_NUM_THREADS", "1");
    // PyTorch runs with its OpenMP's own default, not the spin limit set for streamrl.
    if streamrl_kernels::bf16::wait_policy_set_here() {
        c.env_remove(streamrl_kernels::bf16::SPIN_VARIABLE);
    }
    if let Some(p) = pythonpath {
        c.env("PYTHONPATH", p);
    }
    let out = c.output().with_context(|| format!("run python3 for {what}"))?;
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("{what} printed {l:?}")))
        .collect()
}

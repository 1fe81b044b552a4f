//! The policy model: gradients reach every parameter (dense and MoE), finite differences
//! agree, packing isolates samples, cached decoding equals a full recompute, checkpoints
//! round-trip exactly (single file and sharded), and optimizer resume is bit-identical.

mod onednn;
#[path = "../../tests/common/skip.rs"]
mod skip;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use streamrl_model::checkpoint;
use streamrl_model::config::{HfConfig, RopeLayout, RouterScore, preset};
use streamrl_model::generate::{Sampling, generate};
use streamrl_model::loss::{self, LossInputs, LossKind};
use streamrl_model::model::LayerMemory;
use streamrl_model::offload::OffloadStats;
use streamrl_model::optim::{Optimizer, OptimizerConfig, OptimizerKind};
use streamrl_model::{Packed, Transformer, token_logprobs};

const V: usize = 48;

fn dense(model_type: &str) -> HfConfig {
    let mut h = preset("tiny", V).unwrap();
    h.model_type = Some(model_type.into());
    h.hidden_size = 32;
    h.head_dim = Some(8);
    h.intermediate_size = 48;
    h.tie_word_embeddings = false;
    h
}

fn moe(score: RouterScore, shared: bool) -> HfConfig {
    let mut h = dense("qwen3_moe");
    h.num_experts = Some(4);
    h.num_experts_per_tok = Some(2);
    h.moe_intermediate_size = Some(24);
    h.norm_topk_prob = Some(true);
    h.router_score = Some(score);
    h.shared_expert_intermediate_size = shared.then_some(16);
    h
}

fn all_configs() -> Vec<(&'static str, HfConfig)> {
    let mut llama_i = dense("llama");
    llama_i.rope_layout = Some(RopeLayout::Interleaved);
    llama_i.tie_word_embeddings = true;
    let mut llama_b = dense("llama");
    llama_b.attention_bias = Some(true);
    llama_b.mlp_bias = Some(true);
    llama_b.rope_parameters = Some(streamrl_model::config::RopeParameters {
        rope_type: Some("llama3".into()),
        rope_theta: Some(500_000.0),
        factor: Some(8.0),
        low_freq_factor: Some(1.0),
        high_freq_factor: Some(4.0),
        original_max_position_embeddings: Some(8.0),
        ..Default::default()
    });
    vec![
        ("llama (interleaved rope, tied)", llama_i),
        ("llama (q/k/v/o and mlp biases, llama3 rope scaling)", llama_b),
        ("qwen2 (qkv bias)", dense("qwen2")),
        ("qwen3 (qk norm)", dense("qwen3")),
        ("qwen3_moe softmax + shared expert", moe(RouterScore::Softmax, true)),
        ("mixtral-style sigmoid router", {
            let mut h = moe(RouterScore::Sigmoid, false);
            h.model_type = Some("mixtral".into());
            h.num_local_experts = h.num_experts.take();
            h
        }),
    ]
}

/// A seeded model whose biases are random too (they start at zero, where a bias that is
/// dropped or misplaced would change nothing).
fn init(hf: &HfConfig) -> checkpoint::Loaded {
    let loaded = checkpoint::init(hf, &Device::Cpu).unwrap();
    for (k, v) in loaded.vars.data().lock().unwrap().iter() {
        if k.ends_with(".bias") {
            v.set(&Tensor::randn(0f32, 0.5, v.dims(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    loaded
}

fn samples() -> Vec<Vec<Vec<u32>>> {
    vec![
        vec![vec![5, 9, 13, 2, 7, 30], vec![11, 3, 8, 41]],
        vec![vec![1, 2, 3, 4, 5, 6, 7, 8, 9]],
    ]
}

/// The default RL loss (plus the MoE balance loss) over a packed batch, with sampler
/// logprobs taken from the model as it is now (ratios then start near 1).
fn rl_loss(model: &Transformer) -> Tensor {
    rl_loss_against(model, None)
}

/// The same with fixed sampler logprobs, so that the loss value depends on the weights
/// (as the finite-difference check needs).
fn rl_loss_against(model: &Transformer, fixed_sampler: Option<&[f32]>) -> Tensor {
    let batch = Packed::new(&samples(), &Device::Cpu).unwrap();
    let (logits, aux) = model.forward(&batch).unwrap();
    (rl_loss_of(&logits, &batch, fixed_sampler) + aux.balance_loss).unwrap()
}

/// The RL loss of given logits (without the balance loss).
fn rl_loss_of(logits: &Tensor, batch: &Packed, fixed_sampler: Option<&[f32]>) -> Tensor {
    let lp = token_logprobs(logits, &batch.tokens, 1.0)
        .unwrap()
        .flatten_all()
        .unwrap();
    let n = lp.dims1().unwrap();
    let width = batch.width;
    let mut mask = vec![0f32; n];
    let mut spans = Vec::new();
    for &(row, start, len) in &batch.spans {
        // Position 0 of a sample has no logprob; the rest are trainable.
        for i in 1..len {
            mask[row * width + start + i] = 1.0;
        }
        spans.push((row * width + start, len));
    }
    let host = lp.to_vec1::<f32>().unwrap();
    // Sampler logprobs near the trainer's (ratios within [0.5, 5]) and mixed advantages.
    let sampler: Vec<f32> = match fixed_sampler {
        Some(f) => f.to_vec(),
        None => host
            .iter()
            .enumerate()
            .map(|(i, l)| l + 0.05 * ((i % 5) as f32 - 2.0))
            .collect(),
    };
    let adv: Vec<f32> = (0..n)
        .map(|i| if i % 3 == 0 { -0.7 } else { 0.4 + 0.1 * (i % 4) as f32 })
        .collect();
    let (l, m) = loss::compute(
        LossKind::default(),
        LossInputs {
            logprobs: &lp,
            sampler: &sampler,
            advantages: &adv,
            mask: &mask,
            spans: &spans,
        },
    )
    .unwrap();
    assert_eq!(m.masked_low + m.masked_high, 0.0);
    l
}

#[test]
fn activation_checkpointing_gives_the_same_gradients() {
    for (name, hf) in all_configs() {
        let loaded = checkpoint::init(&hf, &Device::Cpu).unwrap();
        let plain = rl_loss(&loaded.model).backward().unwrap();
        let batch = Packed::new(&samples(), &Device::Cpu).unwrap();
        let (ckpt, logits, aux) = loaded
            .model
            .backward_checkpointed(&batch, None, 1.0, |lg| Ok(rl_loss_of(lg, &batch, None)))
            .unwrap();
        let (plain_logits, plain_aux) = loaded.model.forward(&batch).unwrap();
        let diff = max_abs_diff;
        assert!(diff(&logits, &plain_logits) < 1e-6, "{name}: logits differ");
        assert_eq!(aux.moe.len(), plain_aux.moe.len());
        let layers = loaded.model.config().n_layers;
        // The other ways of keeping activations, offloading included (on the CPU every
        // stashed storage is taken out of its tensors and put back before the backward
        // that reads it: a tensor not put back fails the op that reads it).
        let mut ways = vec![("checkpointing", ckpt, OffloadStats::default())];
        for (how, checkpoint, offload) in [
            ("graphs kept by layer", false, false),
            ("offloading", false, true),
            ("checkpointing + offloading", true, true),
        ] {
            let memory = LayerMemory { checkpoint, offload };
            let (g, logits, _, stats) = loaded
                .model
                .backward_by_layer(&batch, None, 1.0, memory, |lg| Ok(rl_loss_of(lg, &batch, None)))
                .unwrap();
            assert!(diff(&logits, &plain_logits) < 1e-6, "{name}: logits differ ({how})");
            match (checkpoint, offload) {
                // Each layer's input but the first (the embedding's) and the last.
                (true, true) => assert_eq!(stats.tensors, layers - 1, "{name}: {how} moved {stats:?}"),
                // Several saved tensors per layer (the fused CPU layer saves fewer than
                // the op-by-op one), more bytes than the layers' inputs.
                (false, true) => {
                    let inputs = (layers * batch.tokens.elem_count() * loaded.model.config().d_model * 4) as u64;
                    assert!(
                        stats.tensors >= 2 * layers && stats.bytes >= 2 * inputs,
                        "{name}: {how} moved only {stats:?}"
                    );
                }
                _ => assert_eq!(stats, OffloadStats::default()),
            }
            ways.push((how, g, stats));
        }
        let data = loaded.vars.data().lock().unwrap();
        for (how, g, _) in &ways {
            for (k, v) in data.iter() {
                let (a, b) = (plain.get(v.as_tensor()).unwrap(), g.get(v.as_tensor()));
                let b = b.unwrap_or_else(|| panic!("{name}: {k} got no gradient with {how}"));
                let scale = max_abs(a).max(1e-6);
                let d = diff(a, b);
                assert!(
                    d <= 1e-4 * scale.max(1.0),
                    "{name}: {k} differs by {d} with {how} (scale {scale})"
                );
            }
        }
    }
}

/// The positions of `samples()` packed that predict a next token of the same sample,
/// out of order and with a repeat, and the tokens they predict.
fn predicting_positions(batch: &Packed) -> (Vec<u32>, Vec<u32>) {
    let toks = batch.tokens.flatten_all().unwrap().to_vec1::<u32>().unwrap();
    let mut at = Vec::new();
    for &(row, start, len) in batch.spans.iter().rev() {
        for i in 0..len - 1 {
            at.push((row * batch.width + start + i) as u32);
        }
    }
    at.swap(0, 3);
    at.push(at[2]);
    let next = at.iter().map(|&p| toks[p as usize + 1]).collect();
    (at, next)
}

/// The mean logprob of `next[j]` under `logits` (1, n, V) row `j`, as the trainer
/// lines them up for `token_logprobs`: a repeated last row, the targets one column on.
fn mean_logprob_at(logits: &Tensor, next: &[u32]) -> Tensor {
    let n = next.len();
    let last = logits.narrow(1, n - 1, 1).unwrap();
    let logits = Tensor::cat(&[logits, &last], 1).unwrap();
    let targets: Vec<u32> = std::iter::once(0).chain(next.iter().copied()).collect();
    let targets = Tensor::from_vec(targets, (1, n + 1), &Device::Cpu).unwrap();
    token_logprobs(&logits, &targets, 1.0)
        .unwrap()
        .narrow(1, 1, n)
        .unwrap()
        .mean_all()
        .unwrap()
}

#[test]
fn logits_at_chosen_positions_are_the_full_forwards_and_train_alike() {
    for (name, hf) in all_configs() {
        let loaded = init(&hf);
        let model = &loaded.model;
        let batch = Packed::new(&samples(), &Device::Cpu).unwrap();
        let (at, next) = predicting_positions(&batch);
        let (full, _) = model.forward(&batch).unwrap();
        let (b, t, v) = full.dims3().unwrap();
        let idx = Tensor::new(at.as_slice(), &Device::Cpu).unwrap();
        let gathered = full.reshape((b * t, v)).unwrap().index_select(&idx, 0).unwrap();
        let (some, aux) = model.forward_at(&batch, &at).unwrap();
        assert_eq!(some.dims(), &[1, at.len(), v], "{name}");
        // The same bits: the head's product is row-invariant, the norm per position.
        assert_eq!(
            some.squeeze(0).unwrap().to_vec2::<f32>().unwrap(),
            gathered.to_vec2::<f32>().unwrap(),
            "{name}: logits at chosen positions differ from the full forward's"
        );
        // Gradients: the full forward's loss over the same positions, with and without
        // activation checkpointing, give the same gradients for every weight.
        let loss_full = (mean_logprob_at(&gathered.unsqueeze(0).unwrap(), &next) + &aux.balance_loss).unwrap();
        let g_full = loss_full.backward().unwrap();
        let (some, aux) = model.forward_at(&batch, &at).unwrap();
        let g_at = (mean_logprob_at(&some, &next) + aux.balance_loss)
            .unwrap()
            .backward()
            .unwrap();
        let (g_ckpt, _, _) = model
            .backward_checkpointed(&batch, Some(&at), 1.0, |lg| Ok(mean_logprob_at(lg, &next)))
            .unwrap();
        for (k, var) in loaded.vars.data().lock().unwrap().iter() {
            let a = g_full.get(var.as_tensor()).unwrap();
            let scale = a.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1.0);
            for (how, g) in [("forward_at", &g_at), ("checkpointed", &g_ckpt)] {
                let b = g
                    .get(var.as_tensor())
                    .unwrap_or_else(|| panic!("{name}: {k} got no gradient ({how})"));
                let d = max_abs_diff(a, b);
                assert!(d <= 1e-5 * scale, "{name}: {k} differs by {d} ({how}, scale {scale})");
            }
        }
    }
    // A position outside the batch is named.
    let loaded = init(&all_configs()[0].1);
    let batch = Packed::new(&samples(), &Device::Cpu).unwrap();
    let err = loaded.model.forward_at(&batch, &[3, 20]).unwrap_err().to_string();
    assert!(
        err.contains("flat position 20") && err.contains("20 positions"),
        "{err}"
    );
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&(a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap())
}

/// The largest absolute value of `t` (any float dtype).
fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn fused_ops_give_the_op_by_op_logits_and_gradients_for_every_family() {
    for (name, hf) in all_configs() {
        let loaded = init(&hf);
        assert!(loaded.model.fused_ops(), "{name}: f32 on the CPU runs fused by default");
        let mut plain = loaded.model.clone();
        plain.set_fused_ops(false);
        assert!(!plain.fused_ops());
        let batch = Packed::new(&samples(), &Device::Cpu).unwrap();
        let (a, _) = loaded.model.forward(&batch).unwrap();
        let (b, _) = plain.forward(&batch).unwrap();
        let d = max_abs_diff(&a, &b);
        assert!(d < 1e-5, "{name}: logits differ by {d}");
        let fused = rl_loss(&loaded.model).backward().unwrap();
        let reference = rl_loss(&plain).backward().unwrap();
        let data = loaded.vars.data().lock().unwrap();
        for (k, v) in data.iter() {
            let r = reference
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{name}: {k}: no reference gradient"));
            let f = fused
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{name}: {k}: no fused gradient"));
            let scale = r.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let d = max_abs_diff(f, r);
            assert!(
                d <= 1e-4 * scale.max(1e-3),
                "{name}: {k} differs by {d} (scale {scale})"
            );
        }
    }
}

#[test]
fn fused_token_logprobs_equal_the_op_by_op_ones_with_gradients() {
    let logits = Var::from_tensor(&Tensor::randn(0f32, 2.0, (3, 5, V), &Device::Cpu).unwrap()).unwrap();
    let tokens = Tensor::from_vec(
        (0..15u32).map(|i| (i * 7) % V as u32).collect::<Vec<_>>(),
        (3, 5),
        &Device::Cpu,
    )
    .unwrap();
    let weights = Tensor::randn(0f32, 1.0, (3, 5), &Device::Cpu).unwrap();
    for temp in [1.0, 0.7] {
        let a = streamrl_model::fused::token_logprobs(logits.as_tensor(), &tokens, temp).unwrap();
        let b = streamrl_model::model::token_logprobs_unfused(logits.as_tensor(), &tokens, temp).unwrap();
        assert!(max_abs_diff(&a, &b) < 1e-5, "temperature {temp}");
        let ga = (a * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (b * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let (ga, gb) = (ga.get(logits.as_tensor()).unwrap(), gb.get(logits.as_tensor()).unwrap());
        assert!(max_abs_diff(ga, gb) < 1e-5, "temperature {temp}: gradients differ");
    }
    let bad = Tensor::from_vec(vec![0u32, V as u32], (1, 2), &Device::Cpu).unwrap();
    let lg = Tensor::zeros((1, 2, V), DType::F32, &Device::Cpu).unwrap();
    let err = streamrl_model::fused::token_logprobs(&lg, &bad, 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("token {V} outside the vocabulary of {V}")),
        "{err}"
    );
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    for (name, hf) in all_configs() {
        let loaded = checkpoint::init(&hf, &Device::Cpu).unwrap();
        let grads = rl_loss(&loaded.model).backward().unwrap();
        let data = loaded.vars.data().lock().unwrap();
        let mut without = Vec::new();
        for (k, v) in data.iter() {
            let norm = grads
                .get(v.as_tensor())
                .map(|g| g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap());
            if !norm.is_some_and(|n| n > 0.0 && n.is_finite()) {
                without.push(k.clone());
            }
        }
        without.sort();
        assert!(
            without.is_empty(),
            "{name}: {} of {} parameters got no gradient: {without:?}",
            without.len(),
            data.len()
        );
        assert!(data.len() > 10, "{name}: only {} parameters", data.len());
    }
}

#[test]
fn finite_differences_agree_with_backprop() {
    // Top-k selection is discontinuous: a finite difference across a routing flip measures
    // a jump, not a slope. With every expert selected the MoE layer is smooth, and the
    // router, expert and shared-expert gradients can be checked exactly.
    let mut smooth_moe = moe(RouterScore::Softmax, true);
    smooth_moe.num_experts_per_tok = Some(4);
    for (name, hf) in [("qwen3", dense("qwen3")), ("moe", smooth_moe)] {
        let loaded = checkpoint::init(&hf, &Device::Cpu).unwrap();
        let batch = Packed::new(&samples(), &Device::Cpu).unwrap();
        let lp0 = token_logprobs(&loaded.model.forward(&batch).unwrap().0, &batch.tokens, 1.0).unwrap();
        let sampler: Vec<f32> = lp0
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, l)| l + 0.05 * ((i % 5) as f32 - 2.0))
            .collect();
        let grads = rl_loss_against(&loaded.model, Some(&sampler)).backward().unwrap();
        let data = loaded.vars.data().lock().unwrap();
        let mut probes = vec![
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.k_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.1.self_attn.q_norm.weight",
            "lm_head.weight",
        ];
        if name == "moe" {
            probes.extend([
                "model.layers.0.mlp.gate.weight",
                "model.layers.0.mlp.experts.1.up_proj.weight",
                "model.layers.1.mlp.shared_expert.down_proj.weight",
                "model.layers.1.mlp.shared_expert_gate.weight",
            ]);
        } else {
            probes.push("model.layers.0.mlp.down_proj.weight");
        }
        for p in probes {
            let var: &Var = &data[p];
            let g = grads
                .get(var.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            // Probe the entry with the largest gradient (best signal-to-rounding ratio).
            let (idx, &an) = g
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap();
            let orig = var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            // Small enough that no top-k routing decision flips, large enough for f32.
            let h = 2e-3f32;
            let eval = |delta: f32| {
                let mut w = orig.clone();
                w[idx] += delta;
                var.set(&Tensor::from_vec(w, var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                rl_loss_against(&loaded.model, Some(&sampler))
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            };
            let fd = ((eval(h) - eval(-h)) / (2.0 * h as f64)) as f32;
            var.set(&Tensor::from_vec(orig, var.shape(), &Device::Cpu).unwrap())
                .unwrap();
            let tol = 0.05 * an.abs() + 2e-4;
            assert!(
                (fd - an).abs() <= tol,
                "{name} {p}[{idx}]: finite difference {fd} vs backprop {an}"
            );
        }
    }
}

#[test]
fn packed_samples_do_not_see_each_other() {
    let loaded = checkpoint::init(&dense("qwen3"), &Device::Cpu).unwrap();
    let a = vec![5u32, 9, 13, 2];
    let b = vec![11u32, 3, 8, 41, 7];
    let packed = Packed::new(&[vec![a.clone(), b.clone()]], &Device::Cpu).unwrap();
    let alone = Packed::new(&[vec![b.clone()]], &Device::Cpu).unwrap();
    let (lp, _) = loaded.model.forward(&packed).unwrap();
    let (la, _) = loaded.model.forward(&alone).unwrap();
    let x = lp.narrow(1, a.len(), b.len()).unwrap();
    let diff = max_abs_diff(&x, &la);
    assert!(diff <= 1e-5, "packed logits differ from alone by {diff}");
}

#[test]
fn cached_decoding_logprobs_equal_a_full_recompute() {
    for (name, hf) in all_configs() {
        let loaded = checkpoint::init(&hf, &Device::Cpu).unwrap();
        let prompts = vec![vec![5u32, 9, 13], vec![11u32, 3, 8, 41, 7, 2], vec![4u32]];
        for temperature in [0.0, 0.8] {
            let out = generate(
                &loaded.model,
                &prompts,
                Sampling {
                    temperature,
                    max_tokens: 7,
                    eos: None,
                    seed: 3,
                },
            )
            .unwrap();
            for (r, prompt) in prompts.iter().enumerate() {
                let full: Vec<u32> = prompt.iter().chain(&out.tokens[r]).copied().collect();
                let batch = Packed::new(&[vec![full.clone()]], &Device::Cpu).unwrap();
                let (logits, _) = loaded.model.forward(&batch).unwrap();
                let t = if temperature > 0.0 { temperature } else { 1.0 };
                let lp = token_logprobs(&logits, &batch.tokens, t)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap()
                    .remove(0);
                for (k, &got) in out.logprobs[r].iter().enumerate() {
                    let want = lp[prompt.len() + k];
                    assert!(
                        (got - want).abs() <= 1e-5,
                        "{name} T={temperature} seq {r} token {k}: cached {got} vs full {want}"
                    );
                }
            }
        }
    }
}

fn logits_of(model: &Transformer) -> Vec<f32> {
    let batch = Packed::new(&samples(), &Device::Cpu).unwrap();
    model
        .forward(&batch)
        .unwrap()
        .0
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

#[test]
fn checkpoints_round_trip_exactly_single_and_sharded() {
    let dir = tempfile::tempdir().unwrap();
    let hf = moe(RouterScore::Softmax, true);
    let loaded = checkpoint::init(&hf, &Device::Cpu).unwrap();
    let tok = streamrl_model::Tokenizer::char_level();
    let want = logits_of(&loaded.model);
    let single = dir.path().join("single");
    let sha = checkpoint::save(&single, &hf, &loaded.vars, Some(&tok), None).unwrap();
    assert_eq!(sha, checkpoint::weights_sha256(&single).unwrap());
    let back = checkpoint::load(&single, &Device::Cpu).unwrap();
    assert_eq!(logits_of(&back.model), want, "reloaded logits are identical");
    assert!(back.tokenizer.is_some());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(single.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "Qwen3MoeForCausalLM");

    let sharded = dir.path().join("sharded");
    checkpoint::save(&sharded, &hf, &loaded.vars, None, Some(64 * 1024)).unwrap();
    let shards = std::fs::read_dir(&sharded)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".safetensors")
        })
        .count();
    assert!(shards >= 2, "{shards} shards");
    assert!(sharded.join("model.safetensors.index.json").exists());
    assert_eq!(
        logits_of(&checkpoint::load(&sharded, &Device::Cpu).unwrap().model),
        want
    );

    // A checkpoint missing a weight names it.
    let mut other = hf.clone();
    other.num_hidden_layers = 3;
    std::fs::write(single.join("config.json"), serde_json::to_string(&other).unwrap()).unwrap();
    let e = checkpoint::load(&single, &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("missing `model.layers.2."), "{e}");
}

fn train_steps(model: &Transformer, opt: &mut Optimizer, steps: usize) {
    for s in 0..steps {
        let grads = rl_loss(model).backward().unwrap();
        let st = opt.step(&grads, 1e-2 / (1 + s) as f64).unwrap();
        assert_eq!(st.missing_grads, 0);
    }
}

fn params(vars: &VarMap) -> Vec<(String, Vec<f32>)> {
    let d = vars.data().lock().unwrap();
    let mut v: Vec<_> = d
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn optimizer_resume_is_bit_identical() {
    for kind in [OptimizerKind::Adamw, OptimizerKind::Muon] {
        let dir = tempfile::tempdir().unwrap();
        let hf = dense("qwen3");
        let cfg = OptimizerConfig {
            kind,
            ..Default::default()
        };
        let a = checkpoint::init(&hf, &Device::Cpu).unwrap();
        let mut opt = Optimizer::new(&a.vars, cfg.clone()).unwrap();
        train_steps(&a.model, &mut opt, 2);
        let ck = dir.path().join("ck");
        checkpoint::save(&ck, &hf, &a.vars, None, None).unwrap();
        opt.save(&ck).unwrap();
        train_steps(&a.model, &mut opt, 2);

        let b = checkpoint::load(&ck, &Device::Cpu).unwrap();
        let mut opt_b = Optimizer::new(&b.vars, cfg.clone()).unwrap();
        opt_b.load(&ck).unwrap();
        assert_eq!(opt_b.steps(), 2);
        train_steps(&b.model, &mut opt_b, 2);
        assert_eq!(params(&a.vars), params(&b.vars), "{kind:?}: resumed training diverged");
        // And training did move the weights.
        assert_ne!(
            params(&a.vars),
            params(&checkpoint::load(&ck, &Device::Cpu).unwrap().vars)
        );
    }
}

/// The CPU inference kernels give the candle forward's logits for every family (interleaved
/// rope, tied and untied heads, qkv bias, q/k norms, MoE with softmax + shared expert and
/// with a sigmoid router), on a mixed batch: one sequence continuing from its cache, one
/// whole new prompt. The continuing sequence's cache starts with room for 2 positions and
/// grows twice (the second time keeping the 6 positions it holds).
#[test]
fn cpu_kernels_match_the_candle_forward_for_every_family() {
    use streamrl_model::infer::CpuModel;
    for (name, hf) in all_configs() {
        let m = init(&hf).model;
        let cpu = CpuModel::new(&m).unwrap();
        let a: Vec<u32> = (0..9).map(|i| (i * 7 + 3) % V as u32).collect();
        let b: Vec<u32> = (0..5).map(|i| (i * 11 + 1) % V as u32).collect();
        let (mut ka, mut kb) = (cpu.new_kv(2), cpu.new_kv(16));
        let first = cpu.forward(&mut [(&mut ka, &a[..6])]).unwrap();
        let both = cpu.forward(&mut [(&mut ka, &a[6..]), (&mut kb, &b[..])]).unwrap();
        let logits_at = |seq: &[u32], at: usize| -> Vec<f32> {
            let batch = Packed::new(&[vec![seq.to_vec()]], &Device::Cpu).unwrap();
            let (logits, _) = m.forward(&batch).unwrap();
            logits.get(0).unwrap().get(at).unwrap().to_vec1().unwrap()
        };
        for (what, want, got) in [
            ("a after 6 tokens", logits_at(&a[..6], 5), &first[..]),
            ("a continued", logits_at(&a, a.len() - 1), &both[..V]),
            ("b prefilled beside it", logits_at(&b, b.len() - 1), &both[V..]),
        ] {
            let diff = want.iter().zip(got).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-4, "{name}, {what}: max |Δlogit| {diff}");
        }
    }
}

/// bf16 weights on the CPU, for every family: logits stay f32 and near the f32 model's,
/// every parameter gets a gradient, the optimizer keeps f32 master weights (so steps
/// smaller than bf16's resolution are not lost), training lowers the loss like f32 does,
/// and checkpoints save as bf16 (half the bytes) and resume exactly.
#[test]
fn bf16_weights_train_like_f32_and_checkpoint_as_bf16() {
    for (name, hf) in all_configs() {
        let dir = tempfile::tempdir().unwrap();
        let f32_dir = dir.path().join("f32");
        let f = init(&hf);
        checkpoint::save(&f32_dir, &hf, &f.vars, None, None).unwrap();
        let b = checkpoint::load_as(&f32_dir, &Device::Cpu, DType::BF16).unwrap();
        assert_eq!(b.model.dtype(), DType::BF16, "{name}");
        assert!(!b.model.fused_ops(), "{name}: the fused ops are f32-only");
        let batch = Packed::new(&samples(), &Device::Cpu).unwrap();
        let (lf, _) = f.model.forward(&batch).unwrap();
        let (lb, _) = b.model.forward(&batch).unwrap();
        assert_eq!(lb.dtype(), DType::F32, "{name}: logits are f32");
        let scale = lf.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        let diff = max_abs_diff(&lf, &lb);
        assert!(
            diff < 0.05 * scale.max(1.0),
            "{name}: bf16 logits differ by {diff} (scale {scale})"
        );

        // Gradients reach every bf16 parameter.
        let grads = rl_loss(&b.model).backward().unwrap();
        for (k, v) in b.vars.data().lock().unwrap().iter() {
            let g = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient for {k}"));
            assert_eq!(g.dtype(), DType::BF16);
            let n = g.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap();
            assert!(n.to_scalar::<f32>().unwrap() > 0.0, "{name}: zero gradient for {k}");
        }

        // A few SFT steps on one batch: both precisions lower the loss, by similar amounts.
        let sft = |m: &Transformer| -> Tensor {
            let (logits, aux) = m.forward(&batch).unwrap();
            let lp = token_logprobs(&logits, &batch.tokens, 1.0)
                .unwrap()
                .flatten_all()
                .unwrap();
            let n = lp.dims1().unwrap();
            let mut mask = vec![0f32; n];
            for &(row, start, len) in &batch.spans {
                for i in 1..len {
                    mask[row * batch.width + start + i] = 1.0;
                }
            }
            let z = vec![0f32; n];
            let inputs = LossInputs {
                logprobs: &lp,
                sampler: &z,
                advantages: &z,
                mask: &mask,
                spans: &[],
            };
            (loss::compute(LossKind::Sft, inputs).unwrap().0 + aux.balance_loss).unwrap()
        };
        let cfg = OptimizerConfig::default();
        let train = |l: &checkpoint::Loaded| -> (f32, f32) {
            let mut opt = Optimizer::new(&l.vars, cfg.clone()).unwrap();
            let first = sft(&l.model).to_scalar::<f32>().unwrap();
            for _ in 0..8 {
                opt.step(&sft(&l.model).backward().unwrap(), 3e-3).unwrap();
            }
            (first, sft(&l.model).to_scalar::<f32>().unwrap())
        };
        let (f0, f8) = train(&f);
        let (b0, b8) = train(&b);
        assert!(f8 < f0 && b8 < b0, "{name}: f32 {f0} → {f8}, bf16 {b0} → {b8}");
        assert!(
            (f0 - f8 - (b0 - b8)).abs() < 0.25 * (f0 - f8),
            "{name}: f32 fell by {}, bf16 by {}",
            f0 - f8,
            b0 - b8
        );

        // Steps of ~1e-3 are below half of bf16's spacing at 1.0 (2^-8): rounded alone,
        // each would leave the norm weights at exactly 1.0; the f32 master copy adds them
        // up until the rounded value moves.
        let b = checkpoint::load_as(&f32_dir, &Device::Cpu, DType::BF16).unwrap();
        let mut opt = Optimizer::new(&b.vars, cfg.clone()).unwrap();
        let w_name = "model.norm.weight";
        let w = b.vars.data().lock().unwrap()[w_name].clone();
        let before = w.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        assert!(before.iter().all(|x| *x == 1.0), "{name}: norm weights start at 1");
        for _ in 0..8 {
            opt.step(&sft(&b.model).backward().unwrap(), 1e-3).unwrap();
        }
        let after = w.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        assert!(
            after.iter().any(|x| *x != 1.0),
            "{name}: 8 steps of lr 1e-3 left {w_name} at 1.0"
        );
        let save = dir.path().join("bf16");
        checkpoint::save(&save, &hf, &b.vars, None, None).unwrap();
        opt.save(&save).unwrap();
        let cfg_json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(save.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg_json["torch_dtype"], "bfloat16", "{name}");
        let (fs, bs) = (
            std::fs::metadata(f32_dir.join("model.safetensors")).unwrap().len(),
            std::fs::metadata(save.join("model.safetensors")).unwrap().len(),
        );
        // Half the tensor bytes; the JSON header (the same in both) is the rest.
        assert!((bs as f64) < 0.55 * fs as f64, "{name}: bf16 file {bs} bytes, f32 {fs}");
        // Resume: the same weights and the same master copy, so the next step agrees.
        let r = checkpoint::load_as(&save, &Device::Cpu, DType::BF16).unwrap();
        let mut ropt = Optimizer::new(&r.vars, cfg.clone()).unwrap();
        ropt.load(&save).unwrap();
        opt.step(&sft(&b.model).backward().unwrap(), 1e-4).unwrap();
        ropt.step(&sft(&r.model).backward().unwrap(), 1e-4).unwrap();
        for (k, v) in b.vars.data().lock().unwrap().iter() {
            let rv = r.vars.data().lock().unwrap()[k].clone();
            assert_eq!(
                max_abs_diff(v.as_tensor(), rv.as_tensor()),
                0.0,
                "{name}: {k} after resume"
            );
        }
    }
}

/// bf16 products with f32 weights (`dtype: bf16` on the CPU), for every family: the fused
/// training forward's logits, every parameter's gradient and the CPU inference kernels'
/// logits stay within bf16 rounding of the f32 model's (each product's inputs carry 2⁻⁹
/// relative error, so the outputs carry a few thousandths; 2% of the logits' scale and 5%
/// of each gradient's norm leave room for the depth of the network and no more), and on a
/// CPU with bf16 units they are not the f32 numbers (the products really ran in bf16).
#[test]
fn bf16_products_stay_within_bf16_rounding_of_f32_for_every_family() {
    use streamrl_kernels::bf16::{self, Path, Products};
    use streamrl_model::infer::CpuModel;
    onednn::fetch();
    let mut said = false;
    for (name, hf) in all_configs() {
        let f = init(&hf);
        let mut b = f.model.clone();
        b.set_products(Products::Bf16);
        assert_eq!(b.precision(), streamrl_model::device::Precision::Bf16);
        assert!(b.fused_ops(), "{name}: bf16 products run through the fused ops");
        let batch = Packed::new(&samples(), &Device::Cpu).unwrap();
        let (lf, _) = f.model.forward(&batch).unwrap();
        let (lb, _) = b.forward(&batch).unwrap();
        let scale = lf.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        let diff = max_abs_diff(&lf, &lb);
        assert!(
            diff < 0.02 * scale,
            "{name}: bf16 logits differ by {diff} (scale {scale})"
        );
        if bf16::path() != Path::F32 {
            assert!(
                diff > 0.0,
                "{name}: bf16 logits are the f32 logits: the products did not run in bf16"
            );
        } else if !said {
            said = true;
            skip::skipped(
                "bf16_products_stay_within_bf16_rounding_of_f32_for_every_family",
                "bf16 products on bf16 units (the f32 fallback ran; the tolerances were checked on it)",
                "this CPU has neither AMX nor AVX-512 BF16",
            );
        }
        let gf = rl_loss(&f.model).backward().unwrap();
        let gb = rl_loss(&b).backward().unwrap();
        let data = f.vars.data().lock().unwrap();
        let pairs: Vec<(&String, &Tensor, &Tensor)> = data
            .iter()
            .map(|(k, v)| match (gb.get(v.as_tensor()), gf.get(v.as_tensor())) {
                (Some(a), Some(r)) => (k, a, r),
                _ => panic!("{name}: {k}: no gradient in bf16 or in f32"),
            })
            .collect();
        let norm = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
        let total = pairs.iter().map(|(_, _, r)| norm(r).powi(2)).sum::<f32>().sqrt();
        for (k, a, r) in pairs {
            let n = norm(a);
            assert!(n > 0.0 && n.is_finite(), "{name}: {k}: bf16 gradient norm {n}");
            // 5% of the parameter's own gradient, plus 0.5% of the whole gradient's norm: a
            // gradient that is zero in exact arithmetic (a key bias, under the softmax's
            // indifference to a shift of a query's scores, up to the rotary embedding) is
            // nearly all rounding, in f32 as in bf16.
            let d = norm(&(a - r).unwrap());
            assert!(
                d <= 0.05 * norm(r) + 0.005 * total,
                "{name}: {k}: bf16 gradient off by {d} (its f32 norm {}, the whole gradient's {total})",
                norm(r)
            );
        }
        // The inference kernels with the weights converted once.
        let cpu = CpuModel::new(&b).unwrap();
        let seq: Vec<u32> = (0..7).map(|i| (i * 5 + 2) % V as u32).collect();
        let mut kv = cpu.new_kv(8);
        let got = cpu.forward(&mut [(&mut kv, &seq[..])]).unwrap();
        let (want, _) = f
            .model
            .forward(&Packed::new(&[vec![seq.clone()]], &Device::Cpu).unwrap())
            .unwrap();
        let want: Vec<f32> = want.get(0).unwrap().get(6).unwrap().to_vec1().unwrap();
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = want.iter().zip(&got).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            d < 0.02 * scale,
            "{name}: bf16 inference logits differ by {d} (scale {scale})"
        );
    }
}

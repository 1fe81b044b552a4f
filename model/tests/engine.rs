//! The continuous-batching engine: batching changes nothing about what a request gets,
//! logprobs match a recompute, weight swaps are clean, stops behave. The suite runs twice:
//! on the CPU kernels (`cpu_kernels::`) and on candle ops (`candle_ops::`, the path every
//! other device takes).

mod onednn;

use candle_core::Device;
use streamrl_model::engine::{Engine, EngineConfig, FinishReason, Output, SamplingParams};
use streamrl_model::{Packed, Tokenizer, Transformer, checkpoint, config, token_logprobs};

fn model(seed: u64) -> Transformer {
    let tok = Tokenizer::char_level();
    let hf = config::preset("tiny", tok.vocab_size()).unwrap();
    checkpoint::init_seeded(&hf, &Device::Cpu, Some(seed)).unwrap().model
}

fn engine(cpu_kernels: bool, seed: u64, max_num_seqs: usize) -> Engine {
    Engine::new(
        model(seed),
        0,
        Some(Tokenizer::char_level()),
        EngineConfig {
            max_num_seqs,
            cpu_kernels,
            ..Default::default()
        },
    )
}

fn prompts() -> Vec<Vec<u32>> {
    let tok = Tokenizer::char_level();
    ["1+1=", "123+456=", "7=", "98-76*5=", "31415926+27=", "0*0="]
        .iter()
        .map(|p| tok.encode(p).unwrap())
        .collect()
}

fn params(i: usize, temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: 100 + i as u64,
        // Lengths vary so sequences leave the batch at different steps.
        max_tokens: 3 + 5 * i,
        ignore_eos: true,
        top_k: if i.is_multiple_of(2) { 0 } else { 20 },
        top_p: if i.is_multiple_of(3) { 0.9 } else { 1.0 },
        ..Default::default()
    }
}

fn by_id(mut outs: Vec<Output>) -> Vec<Output> {
    outs.sort_by_key(|o| o.id);
    outs
}

fn continuous_batching_gives_every_request_what_it_gets_alone(k: bool) {
    for temperature in [0.0, 0.8] {
        // Three slots for six requests: sequences join as others finish.
        let mut batched = engine(k, 1, 3);
        assert_eq!(batched.kernels(), if k { "cpu" } else { "candle" });
        for (i, p) in prompts().into_iter().enumerate() {
            batched.add(p, params(i, temperature)).unwrap();
        }
        let mut max_running = 0;
        let mut outs = Vec::new();
        while batched.has_work() {
            for e in batched.step().unwrap() {
                if let streamrl_model::engine::Event::Done(o) = e {
                    outs.push(o);
                }
            }
            max_running = max_running.max(batched.num_running());
        }
        let outs = by_id(outs);
        assert_eq!(max_running, 3);
        assert!(batched.stats().decode_steps > 0);
        for (i, p) in prompts().into_iter().enumerate() {
            let mut alone = engine(k, 1, 1);
            alone.add(p, params(i, temperature)).unwrap();
            let a = alone.run_to_completion().unwrap().remove(0);
            let b = &outs[i];
            assert_eq!(a.tokens, b.tokens, "request {i} at T={temperature}");
            assert_eq!(a.tokens.len(), 3 + 5 * i);
            assert_eq!(b.finish_reason, FinishReason::Length);
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() <= tolerance(k), "request {i}: {x} vs {y}");
            }
        }
    }
}

/// Logprobs at temperature `t` of `prompt` + `completion` under `m`, by a full forward
/// (position i is the logprob of token i).
fn recompute(m: &Transformer, prompt: &[u32], completion: &[u32], t: f64) -> Vec<f32> {
    let seq: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let batch = Packed::new(&[vec![seq]], &Device::Cpu).unwrap();
    let (logits, _) = m.forward(&batch).unwrap();
    token_logprobs(&logits, &batch.tokens, t)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// How far a logprob may move with the batch it was computed in: not at all on the CPU
/// kernels, which sum every row in the same order whatever shares its step (and as the
/// training forward sums it); to f32 rounding on candle's ops.
fn tolerance(kernels: bool) -> f32 {
    if kernels { 0.0 } else { 1e-5 }
}

fn sampled_logprobs_equal_a_full_recompute(kernels: bool) {
    let temperature = 0.7;
    let mut e = engine(kernels, 2, 4);
    for (i, p) in prompts().into_iter().enumerate() {
        e.add(p, params(i, temperature)).unwrap();
    }
    let outs = by_id(e.run_to_completion().unwrap());
    let m = e.model();
    for (o, p) in outs.iter().zip(prompts()) {
        let lp = recompute(m, &p, &o.tokens, temperature as f64);
        for (k, got) in o.logprobs.iter().enumerate() {
            let want = lp[p.len() + k];
            assert!(
                (got - want).abs() <= tolerance(kernels),
                "token {k}: sampled {got}, recomputed {want}"
            );
        }
        assert!(o.versions.iter().all(|v| *v == 0));
    }
}

fn a_weight_swap_changes_versions_from_that_token_on_and_nothing_before(k: bool) {
    let steps_before = 4;
    let run = |swap: bool| {
        let mut e = engine(k, 3, 8);
        for (i, p) in prompts().into_iter().enumerate() {
            e.add(
                p,
                SamplingParams {
                    max_tokens: 12,
                    ..params(i, 0.0)
                },
            )
            .unwrap();
        }
        let mut outs = Vec::new();
        for step in 0.. {
            if !e.has_work() {
                break;
            }
            if swap && step == steps_before {
                e.swap(model(4), 1).unwrap();
                assert_eq!(e.version(), 1);
            }
            for ev in e.step().unwrap() {
                if let streamrl_model::engine::Event::Done(o) = ev {
                    outs.push(o);
                }
            }
        }
        by_id(outs)
    };
    let (old, swapped) = (run(false), run(true));
    for (a, b) in old.iter().zip(&swapped) {
        // Step 0 prefills (1 token), every later step decodes one: 4 tokens before the swap.
        let n_old = b.versions.iter().take_while(|v| **v == 0).count();
        assert_eq!(n_old, steps_before, "versions {:?}", b.versions);
        assert!(b.versions[n_old..].iter().all(|v| *v == 1));
        assert_eq!(a.tokens[..n_old], b.tokens[..n_old]);
        assert_eq!(a.logprobs[..n_old], b.logprobs[..n_old]);
        assert_eq!(b.tokens.len(), 12);
    }
    assert!(
        old.iter().zip(&swapped).any(|(a, b)| a.tokens != b.tokens),
        "new weights changed nothing"
    );
}

/// A tiny checkpoint (seed 9) saved as `dir/v1`; its path and weights hash.
fn saved_v1(dir: &std::path::Path) -> (std::path::PathBuf, String) {
    let tok = Tokenizer::char_level();
    let v1 = dir.join("v1");
    let hf = config::preset("tiny", tok.vocab_size()).unwrap();
    let l = checkpoint::init_seeded(&hf, &Device::Cpu, Some(9)).unwrap();
    let sha = checkpoint::save(&v1, &hf, &l.vars, Some(&tok), None).unwrap();
    (v1, sha)
}

fn a_failed_weight_load_keeps_the_old_weights_serving(k: bool) {
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::char_level();
    let (good, sha) = saved_v1(dir.path());
    let wrong_shape = dir.path().join("small");
    let hf_small = config::preset("small", tok.vocab_size()).unwrap();
    let s = checkpoint::init_seeded(&hf_small, &Device::Cpu, Some(9)).unwrap();
    checkpoint::save(&wrong_shape, &hf_small, &s.vars, Some(&tok), None).unwrap();

    let mut e = engine(k, 5, 2);
    let p = prompts()[1].clone();
    let greedy = SamplingParams {
        temperature: 0.0,
        max_tokens: 5,
        ignore_eos: true,
        ..Default::default()
    };
    e.add(p.clone(), greedy.clone()).unwrap();
    let before = e.run_to_completion().unwrap().remove(0);

    let missing = e
        .load_weights(&dir.path().join("nope"), 1, None)
        .unwrap_err()
        .to_string();
    assert!(missing.contains("nope"), "{missing}");
    let bad_sum = e.load_weights(&good, 1, Some(&"0".repeat(64))).unwrap_err().to_string();
    assert!(
        bad_sum.contains("checksum mismatch") && bad_sum.contains(&sha),
        "{bad_sum}"
    );
    let shape = e.load_weights(&wrong_shape, 1, None).unwrap_err().to_string();
    assert!(shape.contains("another shape"), "{shape}");
    assert_eq!(e.version(), 0);
    e.add(p.clone(), greedy.clone()).unwrap();
    assert_eq!(e.run_to_completion().unwrap().remove(0).tokens, before.tokens);

    e.load_weights(&good, 1, Some(&sha)).unwrap();
    assert_eq!(e.version(), 1);
    e.add(p, greedy).unwrap();
    let after = e.run_to_completion().unwrap().remove(0);
    assert!(after.versions.iter().all(|v| *v == 1));
}

fn stop_strings_tool_markers_stop_tokens_and_max_tokens(k: bool) {
    let tok = Tokenizer::char_level();
    let p = prompts()[3].clone();
    let greedy = |max_tokens| SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let mut e = engine(k, 6, 4);
    e.add(p.clone(), greedy(16)).unwrap();
    let full = e.run_to_completion().unwrap().remove(0);
    assert_eq!(full.tokens.len(), 16);
    assert_eq!(full.finish_reason, FinishReason::Length);
    let text = tok.decode(&full.tokens).unwrap();
    assert_eq!(full.text, text);

    // Stop at the text of generated characters 3..5: stops right after it appears first.
    let marker: String = text.chars().skip(3).take(2).collect();
    let first = text.find(&marker).unwrap();
    e.add(
        p.clone(),
        SamplingParams {
            stop: vec![marker.clone()],
            ..greedy(16)
        },
    )
    .unwrap();
    let o = e.run_to_completion().unwrap().remove(0);
    assert_eq!(o.finish_reason, FinishReason::Stop);
    assert_eq!(o.text, text[..first], "stop string excluded from the text");
    assert_eq!(
        o.tokens,
        full.tokens[..first + 2],
        "tokens up to the one completing the stop"
    );

    e.add(
        p.clone(),
        SamplingParams {
            tool_call_stop: vec![marker.clone()],
            ..greedy(16)
        },
    )
    .unwrap();
    let o = e.run_to_completion().unwrap().remove(0);
    assert_eq!(o.finish_reason, FinishReason::ToolCall);
    assert_eq!(o.text, text[..first + 2], "tool-call marker kept");

    e.add(
        p.clone(),
        SamplingParams {
            stop_token_ids: vec![full.tokens[5]],
            ..greedy(16)
        },
    )
    .unwrap();
    let o = e.run_to_completion().unwrap().remove(0);
    let at = full.tokens.iter().position(|t| *t == full.tokens[5]).unwrap();
    assert_eq!(o.tokens, full.tokens[..=at]);
    assert_eq!(o.finish_reason, FinishReason::Stop);
    assert_eq!(
        o.text,
        tok.decode(&full.tokens[..at]).unwrap(),
        "the stop token is not in the text"
    );

    e.add(p.clone(), greedy(7)).unwrap();
    let o = e.run_to_completion().unwrap().remove(0);
    assert_eq!((o.tokens.len(), o.finish_reason), (7, FinishReason::Length));
    assert_eq!(o.tokens, full.tokens[..7]);

    let id = e.add(p.clone(), greedy(50)).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    let o = e.cancel(id).unwrap();
    assert_eq!((o.tokens.len(), o.finish_reason), (2, FinishReason::Cancelled));
    assert!(!e.has_work());
}

fn bad_requests_are_refused_with_every_reason(k: bool) {
    let mut e = engine(k, 7, 2);
    let err = e
        .add(
            vec![],
            SamplingParams {
                temperature: -1.0,
                top_p: 0.0,
                max_tokens: 0,
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
    for want in ["temperature -1", "top_p 0", "max_tokens", "prompt is empty"] {
        assert!(err.contains(want), "{want} missing from: {err}");
    }
    let err = e.add(vec![5000], SamplingParams::default()).unwrap_err().to_string();
    assert!(err.contains("5000") && err.contains("vocabulary"), "{err}");
}

fn cancelling_one_running_sequence_leaves_the_others_untouched(k: bool) {
    let mut e = engine(k, 8, 4);
    let ids: Vec<u64> = prompts()
        .into_iter()
        .take(3)
        .enumerate()
        .map(|(i, p)| {
            e.add(
                p,
                SamplingParams {
                    max_tokens: 10,
                    ..params(i, 0.7)
                },
            )
            .unwrap()
        })
        .collect();
    e.step().unwrap();
    e.step().unwrap();
    let c = e.cancel(ids[1]).unwrap();
    assert_eq!((c.tokens.len(), c.finish_reason), (2, FinishReason::Cancelled));
    let outs = by_id(e.run_to_completion().unwrap());
    for (o, i) in outs.iter().zip([0usize, 2]) {
        let mut alone = engine(k, 8, 1);
        alone
            .add(
                prompts()[i].clone(),
                SamplingParams {
                    max_tokens: 10,
                    ..params(i, 0.7)
                },
            )
            .unwrap();
        assert_eq!(alone.run_to_completion().unwrap()[0].tokens, o.tokens, "request {i}");
    }
}

fn top_logprobs_and_prompt_scores_agree_with_the_sampled_logprobs(k: bool) {
    let mut e = engine(k, 9, 4);
    for (i, p) in prompts().into_iter().take(3).enumerate() {
        e.add(
            p,
            SamplingParams {
                logprobs: 5,
                temperature: 1.0,
                ..params(i, 1.0)
            },
        )
        .unwrap();
    }
    let outs = by_id(e.run_to_completion().unwrap());
    for (o, p) in outs.iter().zip(prompts()) {
        assert_eq!(o.top_logprobs.len(), o.tokens.len());
        let full: Vec<u32> = p.iter().chain(&o.tokens).copied().collect();
        let scored = e.prompt_logprobs(&full, 5).unwrap();
        assert_eq!(scored.len(), full.len() - 1);
        for (j, (tok, lp)) in o.tokens.iter().zip(&o.logprobs).enumerate() {
            let top = &o.top_logprobs[j];
            assert_eq!(top.len(), 5);
            assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "most likely first: {top:?}");
            // The sampled token is in the list exactly when its logprob reaches the 5th.
            if *lp > top[4].1 + 1e-6 {
                assert!(top.iter().any(|(t, _)| t == tok), "{tok} missing from {top:?}");
            }
            for (t, l) in top {
                if t == tok {
                    assert!((l - lp).abs() < 1e-6);
                }
            }
            // Scoring the prompt + completion gives the same numbers at temperature 1.
            let (slp, stop) = &scored[p.len() - 1 + j];
            assert!((slp - lp).abs() < 1e-4, "token {j}: scored {slp} sampled {lp}");
            for ((a, x), (b, y)) in stop.iter().zip(top) {
                assert!(a == b || (x - y).abs() < 1e-5, "{stop:?} vs {top:?}");
                assert!((x - y).abs() < 1e-4);
            }
        }
    }
    let err = e
        .add(
            prompts()[0].clone(),
            SamplingParams {
                logprobs: 21,
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("logprobs 21"), "{err}");
    assert!(
        e.prompt_logprobs(&[1, 5000], 0)
            .unwrap_err()
            .to_string()
            .contains("5000")
    );
    assert!(e.prompt_logprobs(&[1], 3).unwrap().is_empty());
}

/// A version prepared on another thread and installed serves exactly as one loaded in
/// place; while admissions are held the running sequence goes on decoding and a new
/// request waits, then starts on the installed version.
fn a_version_prepared_on_another_thread_serves_like_one_loaded_in_place(k: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (v1, sha) = saved_v1(dir.path());
    let greedy = SamplingParams {
        temperature: 0.0,
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    let (p, q) = (prompts()[1].clone(), prompts()[4].clone());
    let mut in_place = engine(k, 5, 4);
    in_place.load_weights(&v1, 1, Some(&sha)).unwrap();
    in_place.add(q.clone(), greedy.clone()).unwrap();
    let want = in_place.run_to_completion().unwrap().remove(0);

    let mut e = engine(k, 5, 4);
    let running = e.add(p, greedy.clone()).unwrap();
    e.step().unwrap();
    let loader = e.loader();
    let (v1_, sha_) = (v1.clone(), sha.clone());
    let prepared = std::thread::spawn(move || loader.load(&v1_, 1, Some(&sha_)));
    e.hold_admissions(true);
    let waiting = e.add(q, greedy).unwrap();
    e.step().unwrap();
    assert_eq!(
        (e.num_running(), e.num_waiting()),
        (1, 1),
        "held: only the running one decodes"
    );
    let prepared = prepared.join().unwrap().unwrap();
    assert_eq!(prepared.version(), 1);
    e.install(prepared).unwrap();
    e.hold_admissions(false);
    let outs = by_id(e.run_to_completion().unwrap());
    let (first, second) = (&outs[0], &outs[1]);
    assert_eq!((first.id, second.id), (running, waiting));
    assert_eq!(first.versions[..2], [0, 0]);
    assert!(first.versions[2..].iter().all(|v| *v == 1), "{:?}", first.versions);
    assert_eq!(second.tokens, want.tokens);
    // (To f32 rounding: here it shared its steps with another sequence.)
    for (a, b) in second.logprobs.iter().zip(&want.logprobs) {
        assert!((a - b).abs() <= 1e-5, "{:?} vs {:?}", second.logprobs, want.logprobs);
    }
    assert!(second.versions.iter().all(|v| *v == 1));
    // A bad checksum fails in the loader, before anything is installed.
    let err = e
        .loader()
        .load(&v1, 2, Some(&"0".repeat(64)))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("checksum mismatch"), "{err}");
    assert_eq!(e.version(), 1);
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod cpu_kernels {
            $(#[test]
            fn $name() {
                super::$name(true)
            })*
        }
        mod candle_ops {
            $(#[test]
            fn $name() {
                super::$name(false)
            })*
        }
    };
}

suite!(
    continuous_batching_gives_every_request_what_it_gets_alone,
    sampled_logprobs_equal_a_full_recompute,
    a_weight_swap_changes_versions_from_that_token_on_and_nothing_before,
    a_failed_weight_load_keeps_the_old_weights_serving,
    a_version_prepared_on_another_thread_serves_like_one_loaded_in_place,
    stop_strings_tool_markers_stop_tokens_and_max_tokens,
    bad_requests_are_refused_with_every_reason,
    cancelling_one_running_sequence_leaves_the_others_untouched,
    top_logprobs_and_prompt_scores_agree_with_the_sampled_logprobs,
);

/// A seeded tiny model saved with the character-level tokenizer: the directory, and the
/// model as saved (f32).
fn saved_tiny() -> (tempfile::TempDir, checkpoint::Loaded) {
    let tok = Tokenizer::char_level();
    let hf = config::preset("tiny", tok.vocab_size()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let f = checkpoint::init_seeded(&hf, &Device::Cpu, Some(3)).unwrap();
    checkpoint::save(dir.path(), &hf, &f.vars, Some(&tok), None).unwrap();
    (dir, f)
}

/// An engine over `model` (4 sequences at a time) that has run every prompt of
/// [`prompts`] to completion at temperature 0.7, and the outputs by request.
fn run_prompts(model: Transformer) -> (Engine, Vec<Output>) {
    let mut e = Engine::new(
        model,
        0,
        Some(Tokenizer::char_level()),
        EngineConfig {
            max_num_seqs: 4,
            ..Default::default()
        },
    );
    for (i, p) in prompts().into_iter().enumerate() {
        e.add(p, params(i, 0.7)).unwrap();
    }
    let outs = by_id(e.run_to_completion().unwrap());
    (e, outs)
}

/// bf16 weights (the candle path, as on a GPU in bf16): the engine batches them, its
/// logprobs match the same model's recompute as closely as bf16 rounding of the
/// different batch shapes allows, and a weight swap loads a checkpoint into bf16.
#[test]
fn bf16_weights_decode_and_swap() {
    let (dir, _) = saved_tiny();
    let b = checkpoint::load_as(dir.path(), &Device::Cpu, candle_core::DType::BF16).unwrap();
    let (mut e, outs) = run_prompts(b.model);
    assert_eq!(e.kernels(), "candle", "the CPU kernels are f32-only");
    for (o, p) in outs.iter().zip(prompts()) {
        let lp = recompute(e.model(), &p, &o.tokens, 0.7);
        for (k, got) in o.logprobs.iter().enumerate() {
            let want = lp[p.len() + k];
            assert!(
                got.is_finite() && (got - want).abs() <= 0.05,
                "token {k}: sampled {got}, recomputed {want}"
            );
        }
    }
    e.load_weights(dir.path(), 1, None).unwrap();
    assert_eq!(
        e.model().dtype(),
        candle_core::DType::BF16,
        "a swap keeps the engine's dtype"
    );
    assert_eq!(e.version(), 1);
}

/// bf16 products on the CPU (`dtype: bf16` there): the engine runs its CPU kernels with the
/// weights converted once, its sampled logprobs stay within bf16 rounding of the f32
/// training forward's recompute (the sampler/trainer mismatch the importance mask bounds),
/// and a weight swap keeps bf16 products.
#[test]
fn bf16_products_decode_on_the_cpu_kernels_and_swap() {
    use streamrl_kernels::bf16::Products;
    onednn::fetch();
    let (dir, f) = saved_tiny();
    let b = checkpoint::load_in(dir.path(), &Device::Cpu, streamrl_model::device::Precision::Bf16).unwrap();
    assert_eq!(
        (b.model.dtype(), b.model.products()),
        (candle_core::DType::F32, Products::Bf16)
    );
    let (mut e, outs) = run_prompts(b.model);
    assert_eq!(e.kernels(), "cpu");
    let mut worst = 0f32;
    for (o, p) in outs.iter().zip(prompts()) {
        // Recomputed in f32: the trainer's view of the same tokens.
        let lp = recompute(&f.model, &p, &o.tokens, 0.7);
        for (k, got) in o.logprobs.iter().enumerate() {
            worst = worst.max((got - lp[p.len() + k]).abs());
        }
    }
    assert!(
        worst.is_finite() && worst <= 0.05,
        "bf16 sampler vs f32 trainer: |Δlogprob| up to {worst}"
    );
    e.load_weights(dir.path(), 1, None).unwrap();
    assert_eq!(e.model().products(), Products::Bf16, "a swap keeps bf16 products");
    assert_eq!(e.kernels(), "cpu");
}

/// A mixture of experts (`tiny-moe`) on the CPU kernels, its completions sampled at
/// temperature 0.7, with the routes the engine recorded for them.
fn moe_outputs() -> (Engine, Vec<Output>) {
    let tok = Tokenizer::char_level();
    let hf = config::preset("tiny-moe", tok.vocab_size()).unwrap();
    let m = checkpoint::init_seeded(&hf, &Device::Cpu, Some(5)).unwrap().model;
    run_prompts(m)
}

/// The training forward's logprobs (temperature 0.7) of `prompt` + `completion`, with the
/// completion's `routes` replayed (or only compared), and the step's routing statistics.
fn replayed(
    m: &Transformer,
    prompt: &[u32],
    completion: &[u32],
    routes: &[u8],
    replay: bool,
) -> (Vec<f32>, Vec<streamrl_model::MoeStats>) {
    let seq: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let ids = streamrl_model::SampleRoutes {
        from: prompt.len(),
        ids: routes,
    };
    let batch = Packed::new(&[vec![seq]], &Device::Cpu)
        .unwrap()
        .with_routes(m.config(), &[Some(ids)], replay)
        .unwrap();
    let (logits, aux) = m.forward(&batch).unwrap();
    let lp = token_logprobs(&logits, &batch.tokens, 0.7)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    (lp, aux.moe)
}

/// Routing replay, f32: the engine records the experts of every generated token it fed
/// back (per layer, top-k, the last token none), and the training forward that replays
/// them computes the sampler's logprobs, with no token routed differently.
#[test]
fn a_mixture_of_experts_records_its_routes_and_the_trainer_replays_them() {
    let (e, outs) = moe_outputs();
    assert_eq!(e.kernels(), "cpu");
    let cfg = e.model().config().clone();
    let moe = cfg.moe.clone().unwrap();
    let per = cfg.n_layers * moe.top_k;
    let mut recorded = 0;
    for (o, p) in outs.iter().zip(prompts()) {
        assert_eq!(o.routes.len(), o.tokens.len() * per, "request {}", o.id);
        let (fed, last) = o.routes.split_at(o.routes.len() - per);
        assert!(
            last.iter().all(|&r| r == streamrl_model::NO_ROUTE),
            "the last token is never fed"
        );
        assert!(fed.iter().all(|&r| (r as usize) < moe.n_experts), "{fed:?}");
        for token in fed.chunks_exact(moe.top_k) {
            assert!(token[0] != token[1], "one expert chosen twice: {token:?}");
        }
        let (lp, stats) = replayed(e.model(), &p, &o.tokens, &o.routes, true);
        for (k, got) in o.logprobs.iter().enumerate() {
            let want = lp[p.len() + k];
            assert!(
                (got - want).abs() <= 1e-4,
                "request {}, token {k}: sampled {got}, replayed {want}",
                o.id
            );
        }
        assert_eq!(stats.len(), cfg.n_layers);
        for s in &stats {
            assert_eq!(s.recorded, o.tokens.len() - 1, "every fed completion token replayed");
            assert_eq!(
                (s.mismatched, s.disagreed),
                (0, 0),
                "f32: the trainer's router agrees with the sampler's"
            );
        }
        recorded += o.tokens.len() - 1;
    }
    assert!(recorded > 20, "{recorded} tokens replayed");
}

/// Routing replay sends each token exactly where the record says: with every recorded
/// token sent to other experts than its own, the logprobs up to the first recorded
/// position stay (causal: nothing replayed reaches them; to the rounding of the experts'
/// products over other batches of tokens), every recorded token is routed as recorded (no
/// mismatch) against its own router's choice (disagreed), and the logprobs after it
/// change; compared only (`replay: false`), the same record changes nothing but the
/// counts: every recorded token is then routed elsewhere than recorded.
#[test]
fn replayed_routes_that_differ_change_the_forward_as_recorded() {
    let (e, outs) = moe_outputs();
    let m = e.model();
    let n_experts = m.config().moe.as_ref().unwrap().n_experts as u8;
    let o = outs.iter().max_by_key(|o| o.tokens.len()).unwrap();
    let p = &prompts()[o.id as usize];
    // Each recorded token sent to the first two experts it was not sent to.
    let moved: Vec<u8> = o
        .routes
        .chunks_exact(2)
        .flat_map(|pair| match pair[0] {
            streamrl_model::NO_ROUTE => pair.to_vec(),
            _ => (0..n_experts).filter(|e| !pair.contains(e)).take(2).collect(),
        })
        .collect();
    let (own, _) = replayed(m, p, &o.tokens, &o.routes, true);
    let (forced, stats) = replayed(m, p, &o.tokens, &moved, true);
    let (compared, compared_stats) = replayed(m, p, &o.tokens, &moved, false);
    // Position i's logprob comes from position i − 1's logits; positions up to the
    // prompt's last are computed before any recorded one.
    let first = p.len();
    for i in 0..=first {
        assert!(
            (own[i] - forced[i]).abs() <= 1e-5,
            "position {i}, before the replayed ones: {} vs {}",
            own[i],
            forced[i]
        );
    }
    let changed = (first + 1..own.len())
        .filter(|&i| (own[i] - forced[i]).abs() > 1e-3)
        .count();
    assert!(
        changed > (own.len() - first - 1) / 2,
        "{changed} of {} logprobs changed",
        own.len() - first - 1
    );
    // The first layer's router sees what it saw when sampling, and is overruled on every
    // recorded token; later layers see the states the replay changed.
    let n = o.tokens.len() - 1;
    assert_eq!((stats[0].recorded, stats[0].mismatched, stats[0].disagreed), (n, 0, n));
    for s in &stats[1..] {
        assert!(s.recorded == n && s.mismatched == 0 && s.disagreed >= n / 2, "{s:?}");
    }
    for (a, b) in own.iter().zip(&compared) {
        assert_eq!(a.to_bits(), b.to_bits(), "compared only: the forward routes itself");
    }
    for s in &compared_stats {
        assert_eq!((s.recorded, s.mismatched, s.disagreed), (n, n, n));
    }
}

/// Routes that do not fit the model are refused with every problem named.
#[test]
fn routes_that_do_not_fit_are_refused() {
    let (e, _) = moe_outputs();
    let m = e.model();
    let batch = || Packed::new(&[vec![vec![1, 2, 3]], vec![vec![4, 5]]], &Device::Cpu).unwrap();
    let per = m.config().n_layers * 2;
    let bad_expert = vec![9u8; per];
    let odd = vec![0u8; per + 1];
    let long = vec![0u8; 3 * per];
    let err = batch()
        .with_routes(
            m.config(),
            &[
                Some(streamrl_model::SampleRoutes {
                    from: 2,
                    ids: &bad_expert,
                }),
                Some(streamrl_model::SampleRoutes { from: 0, ids: &odd }),
            ],
            true,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("sample 0: expert 9 of a model with 8 experts"), "{err}");
    assert!(
        err.contains(&format!("sample 1: {} route ids are not whole positions", per + 1)),
        "{err}"
    );
    let err = batch()
        .with_routes(
            m.config(),
            &[None, Some(streamrl_model::SampleRoutes { from: 0, ids: &long })],
            true,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("sample 1: routes for positions 0..3 of a sample of 2"),
        "{err}"
    );
    let twice = vec![1u8; per];
    let b = batch()
        .with_routes(
            m.config(),
            &[Some(streamrl_model::SampleRoutes { from: 0, ids: &twice }), None],
            true,
        )
        .unwrap();
    let err = m.forward(&b).unwrap_err().to_string();
    assert!(err.contains("names an expert twice"), "{err}");
}

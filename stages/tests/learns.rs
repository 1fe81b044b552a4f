//! The learning chain without the bus: sample a group with the engine, score it with the
//! environment's rubric, take group-relative advantages, train with the default loss,
//! load the new weights into the engine — repeated on a handful of problems, the reward
//! must go up.

use streamrl_envs::Split;
use streamrl_envs::rubric::ScoreInput;
use streamrl_model::engine::{Engine, EngineConfig, SamplingParams};
use streamrl_model::optim::LrSchedule;
use streamrl_model::{Tokenizer, checkpoint, config};
use streamrl_stages::mask::{Advantage, advantages};
use streamrl_stages::train::{Learner, LossConfig, TrainConfig, TrainSample};

#[test]
fn rl_on_a_few_problems_raises_their_reward() {
    let dir = tempfile::tempdir().unwrap();
    let env = streamrl_envs::build(
        "arith",
        &serde_json::json!({"levels": [{"digits": 1, "operands": 2, "operators": "+"}]}),
    )
    .unwrap();
    let tok = Tokenizer::char_level();
    let hf = config::preset("tiny", tok.vocab_size()).unwrap();
    let init = checkpoint::init_seeded(&hf, &candle_core::Device::Cpu, Some(3)).unwrap();
    checkpoint::save(dir.path(), &hf, &init.vars, Some(&tok), None).unwrap();
    // A short SFT so the model emits digits and stops.
    let sft = TrainConfig {
        loss: LossConfig::Sft,
        lr: LrSchedule::Constant { lr: 3e-3 },
        ..Default::default()
    };
    let mut learner = Learner::load(dir.path(), sft).unwrap();
    let problems: Vec<_> = (0..4u64).map(|i| env.sample(Split::Train, i)).collect();
    let sample = |p: &streamrl_envs::Problem, completion: &str| {
        let mut c = tok.encode(completion).unwrap();
        c.push(tok.eos.unwrap());
        TrainSample {
            prompt: tok.encode(&env.prompt(p).text).unwrap(),
            loss_mask: vec![true; c.len()],
            sampler_logprobs: vec![0.0; c.len()],
            completion: c,
            advantage: 0.0,
            routes: vec![],
        }
    };
    for step in 0..30u64 {
        let batch: Vec<TrainSample> = (0..32u64)
            .map(|i| {
                sample(
                    &env.sample(Split::Train, 1000 + step * 32 + i),
                    &env.reference_completion(&env.sample(Split::Train, 1000 + step * 32 + i))
                        .unwrap(),
                )
            })
            .collect();
        learner.step(&batch).unwrap();
    }
    let rl = TrainConfig {
        lr: LrSchedule::Constant { lr: 1e-3 },
        ..Default::default()
    };
    learner.save(&dir.path().join("sft")).unwrap();
    let mut learner = Learner::load(&dir.path().join("sft"), TrainConfig { ..rl }).unwrap();
    let mut engine = Engine::new(learner.model.clone(), 0, Some(tok.clone()), EngineConfig::default());
    let mut curve = Vec::new();
    for step in 0..25u32 {
        let mut batch = Vec::new();
        let mut total = 0.0;
        for (pi, p) in problems.iter().enumerate() {
            let prompt = tok.encode(&env.prompt(p).text).unwrap();
            for i in 0..8 {
                engine
                    .add(
                        prompt.clone(),
                        SamplingParams {
                            seed: (step as u64) * 1000 + pi as u64 * 10 + i,
                            max_tokens: 6,
                            ..Default::default()
                        },
                    )
                    .unwrap();
            }
            let outs = engine.run_to_completion().unwrap();
            let rewards: Vec<f32> = outs
                .iter()
                .map(|o| {
                    let parsed = env.parse_answer(&o.text);
                    env.rubric()
                        .score(&ScoreInput {
                            problem: p,
                            completion: &o.text,
                            parsed: parsed.as_deref(),
                            exec: None,
                        })
                        .reward
                })
                .collect();
            total += rewards.iter().sum::<f32>();
            for (o, a) in outs.iter().zip(advantages(&rewards, Advantage::Mean)) {
                batch.push(TrainSample {
                    prompt: prompt.clone(),
                    completion: o.tokens.clone(),
                    sampler_logprobs: o.logprobs.clone(),
                    loss_mask: vec![true; o.tokens.len()],
                    advantage: a,
                    routes: vec![],
                });
            }
        }
        curve.push(total / 32.0);
        learner.step(&batch).unwrap();
        engine.swap(learner.model.clone(), step + 1).unwrap();
    }
    eprintln!("reward per step: {curve:?}");
    let first: f32 = curve[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = curve[20..].iter().sum::<f32>() / 5.0;
    assert!(last > first + 0.2, "reward did not rise: {curve:?}");
}

//! Held-out evaluation: greedy accuracy and pass@k of a model on the first `n` problems of
//! an environment's eval split (the same problems every time). Used by `streamrl eval` and
//! by the trainer's periodic held-out metric.

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;
use streamrl_envs::rubric::ScoreInput;
use streamrl_envs::{Environment, Split};
use streamrl_model::chat::ChatTemplate;
use streamrl_model::engine::{Engine, EngineConfig, SamplingParams};
use streamrl_model::{Tokenizer, Transformer};

/// Accuracy numbers of one model.
#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    /// Problems.
    pub n: usize,
    /// Fraction solved greedily (reward ≥ 1).
    pub greedy_accuracy: f64,
    /// Mean greedy reward.
    pub greedy_reward: f64,
    /// k of pass@k.
    pub k: usize,
    /// Fraction with at least one of k samples correct.
    pub pass_at_k: Option<f64>,
    /// Fraction of the k samples correct (pass@1 at temperature 1).
    pub sampled_accuracy: Option<f64>,
    /// Seconds.
    pub seconds: f64,
    /// Every problem's greedy completion and reward, in eval-split order.
    pub greedy: Vec<GreedySample>,
}

/// One held-out problem's greedy completion.
#[derive(Debug, Clone, Serialize)]
pub struct GreedySample {
    /// The problem's question.
    pub question: String,
    /// The reference answer.
    pub answer: Option<String>,
    /// What the model wrote.
    pub completion: String,
    /// The rubric's reward.
    pub reward: f32,
}

/// Evaluates `model` on the first `n` held-out problems of `env`: one greedy completion
/// and `k` samples at temperature 1 (fixed seeds) each, scored by the environment's
/// rubric. Environments that need a sandbox are refused.
pub fn evaluate(
    env: &dyn Environment,
    model: Transformer,
    tok: &Tokenizer,
    template: &ChatTemplate,
    n: usize,
    k: usize,
    max_tokens: usize,
) -> Result<EvalReport, String> {
    if env.needs_sandbox() {
        return Err(format!(
            "environment `{}` needs a sandbox to be scored; evaluate it through the pipeline",
            env.name()
        ));
    }
    let t0 = Instant::now();
    let mut engine = Engine::new(
        model,
        0,
        Some(tok.clone()),
        EngineConfig {
            max_num_seqs: 128,
            ..Default::default()
        },
    );
    let problems: Vec<_> = (0..n as u64).map(|i| env.sample(Split::Eval, i)).collect();
    let ids = submit(&mut engine, env, &problems, tok, template, k, max_tokens)?;
    let mut greedy = vec![0f32; n];
    let mut texts = vec![String::new(); n];
    let mut sampled = vec![vec![0f32; k]; n];
    for o in engine.run_to_completion().map_err(|e| e.to_string())? {
        let (i, j) = ids[&o.id];
        let r = score(env, &problems[i], &o.text);
        if j == usize::MAX {
            greedy[i] = r;
            texts[i] = o.text;
        } else {
            sampled[i][j] = r;
        }
    }
    let nf = n.max(1) as f64;
    Ok(EvalReport {
        n,
        greedy_accuracy: greedy.iter().filter(|r| **r >= 1.0).count() as f64 / nf,
        greedy_reward: greedy.iter().map(|r| *r as f64).sum::<f64>() / nf,
        k,
        pass_at_k: (k > 0).then(|| sampled.iter().filter(|s| s.iter().any(|r| *r >= 1.0)).count() as f64 / nf),
        sampled_accuracy: (k > 0)
            .then(|| sampled.iter().flatten().filter(|r| **r >= 1.0).count() as f64 / (nf * k as f64)),
        seconds: t0.elapsed().as_secs_f64(),
        greedy: problems
            .iter()
            .zip(texts)
            .zip(&greedy)
            .map(|((p, completion), &reward)| GreedySample {
                question: p.question.clone(),
                answer: p.answer.clone(),
                completion,
                reward,
            })
            .collect(),
    })
}

/// Queues one greedy completion and `k` samples at temperature 1 (seeded by problem and
/// sample) per problem; request id → (problem, sample; `usize::MAX`: the greedy one).
fn submit(
    engine: &mut Engine,
    env: &dyn Environment,
    problems: &[streamrl_envs::Problem],
    tok: &Tokenizer,
    template: &ChatTemplate,
    k: usize,
    max_tokens: usize,
) -> Result<HashMap<u64, (usize, usize)>, String> {
    let mut ids = HashMap::new();
    for (i, p) in problems.iter().enumerate() {
        let text = crate::render_prompt(template, &env.prompt(p)).map_err(|e| e.to_string())?;
        let prompt = tok.encode(&text).map_err(|e| e.to_string())?;
        let greedy = SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        };
        ids.insert(
            engine.add(prompt.clone(), greedy).map_err(|e| e.to_string())?,
            (i, usize::MAX),
        );
        for j in 0..k {
            let sampled = SamplingParams {
                temperature: 1.0,
                max_tokens,
                seed: (i * 1000 + j) as u64,
                ..Default::default()
            };
            ids.insert(engine.add(prompt.clone(), sampled).map_err(|e| e.to_string())?, (i, j));
        }
    }
    Ok(ids)
}

/// The rubric's reward for `text` as the answer to `p`.
fn score(env: &dyn Environment, p: &streamrl_envs::Problem, text: &str) -> f32 {
    let parsed = env.parse_answer(text);
    env.rubric()
        .score(&ScoreInput {
            problem: p,
            completion: text,
            parsed: parsed.as_deref(),
            exec: None,
        })
        .reward
}

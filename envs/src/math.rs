//! `math`: question/answer datasets (JSONL with `question` and `answer`), answers parsed
//! from `\boxed{}` (else `<answer>` tags, else the last number) and graded by
//! equivalence; an optional format reward for boxing the answer.

use serde::{Deserialize, Serialize};

use crate::rubric::Rubric;
use crate::{Environment, Invalid, Problem, Prompt, Split};

/// Configuration of the math environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MathConfig {
    /// Dataset file, JSON Lines or Parquet (`question` or `problem`, `answer` or
    /// `solution`, optional `id`); `None`: the built-in fixture.
    pub dataset: Option<String>,
    /// Relative tolerance of numeric equivalence.
    pub tolerance: f64,
    /// Weight of the `boxed_format` reward (0: off).
    pub format_weight: f32,
    /// One problem in this many is held out for eval.
    pub eval_every: usize,
    /// System prompt.
    pub system_prompt: Option<String>,
}

impl Default for MathConfig {
    fn default() -> Self {
        MathConfig {
            dataset: None,
            tolerance: 1e-6,
            format_weight: 0.0,
            eval_every: 5,
            system_prompt: None,
        }
    }
}

#[derive(Deserialize)]
struct Row {
    #[serde(default)]
    id: Option<String>,
    #[serde(alias = "problem")]
    question: String,
    #[serde(alias = "solution")]
    answer: String,
}

/// The math environment.
#[derive(Debug)]
pub struct Math {
    cfg: MathConfig,
    splits: crate::dataset::Splits,
    rubric: Rubric,
}

impl Math {
    /// Loads the dataset; every problem with the config or the file is reported.
    pub fn new(cfg: MathConfig) -> Result<Self, Vec<Invalid>> {
        let (rows, errs) = crate::dataset::rows::<Row>(cfg.dataset.as_deref(), include_str!("../fixtures/math.jsonl"));
        let all: Vec<Problem> = rows
            .into_iter()
            .map(|(n, r)| Problem {
                id: r.id.unwrap_or_else(|| format!("math-{n}")),
                env: "math".into(),
                question: r.question,
                answer: Some(r.answer),
                info: serde_json::Value::Null,
            })
            .collect();
        let splits = crate::dataset::Splits::checked(all, cfg.eval_every, errs)?;
        let tol = cfg.tolerance;
        let mut rubric = Rubric::new().with_answer("correct", 1.0, "no answer found", move |got, want| {
            if crate::equiv::equivalent(got, want, tol) {
                (1.0, format!("{got} ≡ {want}"))
            } else {
                (0.0, format!("{got} ≢ {want}"))
            }
        });
        if cfg.format_weight > 0.0 {
            rubric = rubric.with("boxed_format", cfg.format_weight, |i| {
                Ok(if crate::parse::boxed(i.completion).is_some() {
                    (1.0, "answer is boxed".into())
                } else {
                    (0.0, "no \\boxed{}".into())
                })
            });
        }
        Ok(Math { cfg, splits, rubric })
    }
}

impl Environment for Math {
    fn name(&self) -> &str {
        "math"
    }

    fn sample(&self, split: Split, seed: u64) -> Problem {
        self.splits.sample(split, seed)
    }

    fn split_len(&self, split: Split) -> Option<usize> {
        Some(self.splits.len(split))
    }

    fn prompt(&self, p: &Problem) -> Prompt {
        let mut prompt = Prompt::text(format!("{}\nPut the final answer in \\boxed{{}}.\n", p.question));
        prompt.system = self.cfg.system_prompt.clone();
        prompt
    }

    fn parse_answer(&self, completion: &str) -> Option<String> {
        crate::parse::boxed(completion)
            .or_else(|| crate::parse::answer_tag(completion))
            .or_else(|| crate::parse::last_number(completion))
    }

    fn reference_completion(&self, p: &Problem) -> Option<String> {
        p.answer.as_ref().map(|a| format!("The answer is \\boxed{{{a}}}."))
    }

    fn rubric(&self) -> &Rubric {
        &self.rubric
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rubric::ScoreInput;

    fn score(env: &Math, p: &Problem, completion: &str) -> f32 {
        let parsed = env.parse_answer(completion);
        env.rubric()
            .score(&ScoreInput {
                problem: p,
                completion,
                parsed: parsed.as_deref(),
                exec: None,
            })
            .reward
    }

    #[test]
    fn grades_equivalent_answers_and_resists_tricks() {
        let env = Math::new(MathConfig {
            format_weight: 0.1,
            ..Default::default()
        })
        .unwrap();
        let p = |id: &str| {
            env.splits
                .problems(Split::Train)
                .iter()
                .chain(env.splits.problems(Split::Eval))
                .find(|p| p.id == id)
                .unwrap()
                .clone()
        };
        assert_eq!(score(&env, &p("m1"), r"so \boxed{\dfrac{5}{6}}"), 1.1);
        assert_eq!(
            score(&env, &p("m1"), "it is 0.8333333333"),
            1.0,
            "last number, within tolerance, no box"
        );
        assert_eq!(score(&env, &p("m4"), r"\boxed{\sqrt{50}}"), 1.1);
        assert_eq!(
            score(&env, &p("m9"), r"\boxed{−15}"),
            0.1,
            "unicode minus parsed, wrong sign"
        );
        // Several boxes: the last one counts.
        assert_eq!(score(&env, &p("m2"), r"\boxed{1024} no wait \boxed{2048}"), 0.1);
        assert_eq!(
            score(&env, &p("m2"), r"\boxed{\boxed{1024}}"),
            0.1,
            "nested box is not a number"
        );
        assert_eq!(score(&env, &p("m2"), &format!("\\boxed{{{}}}", "9".repeat(300))), 0.1);
        assert_eq!(score(&env, &p("m3"), "<answer>12</answer>"), 1.0);
    }

    #[test]
    fn bad_datasets_are_reported_by_line() {
        let dir = std::env::temp_dir().join(format!("streamrl-math-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("bad.jsonl");
        std::fs::write(
            &f,
            "{\"question\": \"q\", \"answer\": \"1\"}\nnot json\n{\"question\": \"q2\"}\n",
        )
        .unwrap();
        let errs = Math::new(MathConfig {
            dataset: Some(f.display().to_string()),
            ..Default::default()
        })
        .unwrap_err()
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
        assert!(errs.contains("line 2") && errs.contains("line 3"), "{errs}");
        let _ = std::fs::remove_dir_all(dir);
    }
}

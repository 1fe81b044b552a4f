//! Rubrics: reward logic, separate from task logic. A rubric is a list of named reward
//! functions with weights; the reward is their weighted sum; each returns a value and a
//! reason, and a function that fails (an error or a panic) scores 0 with the error as its
//! reason.

use crate::Problem;

/// What a reward function sees.
#[derive(Debug, Clone, Copy)]
pub struct ScoreInput<'a> {
    /// The problem.
    pub problem: &'a Problem,
    /// The model's completion text.
    pub completion: &'a str,
    /// The answer the environment parsed out of it, if any.
    pub parsed: Option<&'a str>,
    /// What the sandbox reported, for environments that execute something.
    pub exec: Option<&'a ExecInfo>,
}

/// A sandbox's report on a sample, as the rubric sees it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ExecInfo {
    /// ok, nonzero_exit, timeout, memory, output_limit, killed, internal_error or skipped.
    pub status: String,
    /// Unit tests passed.
    pub tests_passed: u32,
    /// Unit tests run.
    pub tests_total: u32,
    /// Captured stdout.
    pub stdout: String,
    /// Captured stderr.
    pub stderr: String,
}

/// A reward function's result: a value (usually in [0, 1]) and why.
pub type RewardResult = Result<(f32, String), String>;

/// A named, weighted reward function.
pub struct RewardFn {
    /// Name (a column value in `scored.reward_components`).
    pub name: String,
    /// Weight in the sum.
    pub weight: f32,
    f: Box<dyn Fn(&ScoreInput<'_>) -> RewardResult + Send + Sync>,
}

impl std::fmt::Debug for RewardFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RewardFn({} × {})", self.name, self.weight)
    }
}

/// One function's contribution.
#[derive(Debug, Clone, PartialEq)]
pub struct Component {
    /// Function name.
    pub name: String,
    /// Value it returned (0 when it failed).
    pub value: f32,
    /// Its weight.
    pub weight: f32,
    /// Why, or its error.
    pub reason: String,
}

/// A rubric's verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    /// Weighted sum of the components.
    pub reward: f32,
    /// Every function's value and reason.
    pub components: Vec<Component>,
}

/// Weighted reward functions.
#[derive(Debug, Default)]
pub struct Rubric {
    fns: Vec<RewardFn>,
}

impl Rubric {
    /// An empty rubric.
    pub fn new() -> Self {
        Rubric::default()
    }

    /// Adds a reward function.
    pub fn with(
        mut self,
        name: &str,
        weight: f32,
        f: impl Fn(&ScoreInput<'_>) -> RewardResult + Send + Sync + 'static,
    ) -> Self {
        self.fns.push(RewardFn {
            name: name.to_string(),
            weight,
            f: Box::new(f),
        });
        self
    }

    /// Adds a reward function of the parsed answer against the problem's reference answer:
    /// `f(got, want)` when an answer was parsed, 0 with the reason `missing` when none was,
    /// and an error for a problem without a reference answer.
    pub fn with_answer(
        self,
        name: &str,
        weight: f32,
        missing: &'static str,
        f: impl Fn(&str, &str) -> (f32, String) + Send + Sync + 'static,
    ) -> Self {
        self.with(name, weight, move |i| {
            let want = i.problem.answer.as_deref().ok_or("problem has no answer")?;
            Ok(match i.parsed {
                Some(got) => f(got, want),
                None => (0.0, missing.into()),
            })
        })
    }

    /// The functions, in order.
    pub fn functions(&self) -> &[RewardFn] {
        &self.fns
    }

    /// Scores one completion.
    pub fn score(&self, input: &ScoreInput<'_>) -> Score {
        let mut components = Vec::with_capacity(self.fns.len());
        for rf in &self.fns {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (rf.f)(input)));
            let (value, reason) = match r {
                Ok(Ok((v, why))) if v.is_finite() => (v, why),
                Ok(Ok((v, _))) => (0.0, format!("error: returned non-finite value {v}")),
                Ok(Err(e)) => (0.0, format!("error: {e}")),
                Err(p) => {
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned());
                    (
                        0.0,
                        format!("error: panicked: {}", msg.unwrap_or_else(|| "unknown panic".into())),
                    )
                }
            };
            components.push(Component {
                name: rf.name.clone(),
                value,
                weight: rf.weight,
                reason,
            });
        }
        Score {
            reward: components.iter().map(|c| c.value * c.weight).sum(),
            components,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_sum_and_failures_score_zero_with_reason() {
        let p = Problem {
            id: "p".into(),
            env: "t".into(),
            question: "q".into(),
            answer: Some("4".into()),
            info: serde_json::Value::Null,
        };
        let r = Rubric::new()
            .with("correct", 1.0, |i| {
                Ok((
                    (i.parsed == i.problem.answer.as_deref()) as u8 as f32,
                    "compared".into(),
                ))
            })
            .with("format", 0.5, |i| {
                Ok((i.completion.ends_with('\n') as u8 as f32, "newline".into()))
            })
            .with("broken", 2.0, |_| Err("parser exploded on input".into()))
            .with("panics", 3.0, |_| panic!("index out of range"));
        let s = r.score(&ScoreInput {
            problem: &p,
            completion: "4\n",
            parsed: Some("4"),
            exec: None,
        });
        assert_eq!(s.reward, 1.5);
        assert_eq!(s.components[2].value, 0.0);
        assert!(
            s.components[2].reason.contains("parser exploded"),
            "{:?}",
            s.components[2]
        );
        assert!(
            s.components[3].reason.contains("panicked: index out of range"),
            "{:?}",
            s.components[3]
        );
    }
}

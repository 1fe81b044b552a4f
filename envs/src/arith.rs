//! `arith`: generated arithmetic with difficulty levels; exact-match answers. The CPU demo
//! task: prompts like `37+5*12=` and answers like `97`, one token per character with the
//! built-in character tokenizer.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::rubric::Rubric;
use crate::{Environment, Problem, Prompt, Split};

/// A difficulty level.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Level {
    /// Largest operand digit count.
    pub digits: u32,
    /// Operands per problem.
    pub operands: u32,
    /// Operators to draw from (`+`, `-`, `*`).
    pub operators: String,
}

/// Configuration of the arith environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArithConfig {
    /// Difficulty levels; problems draw a level uniformly.
    pub levels: Vec<Level>,
    /// One problem in this many (by a hash of the expression) is held out for eval.
    pub eval_every: u64,
}

impl Default for ArithConfig {
    fn default() -> Self {
        ArithConfig {
            levels: vec![
                Level {
                    digits: 2,
                    operands: 2,
                    operators: "+-".into(),
                },
                Level {
                    digits: 3,
                    operands: 2,
                    operators: "+-".into(),
                },
                Level {
                    digits: 2,
                    operands: 3,
                    operators: "+-*".into(),
                },
            ],
            eval_every: 10,
        }
    }
}

/// The arith environment.
#[derive(Debug)]
pub struct Arith {
    cfg: ArithConfig,
    rubric: Rubric,
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Evaluates `+ - *` with the usual precedence, exactly (i128, overflow is `None`).
pub fn evaluate(expr: &str) -> Option<i128> {
    let (mut total, mut term, mut sign) = (0i128, 1i128, 1i128);
    let mut digits = String::new();
    for c in expr.chars().chain(std::iter::once('+')) {
        match c {
            '0'..='9' => digits.push(c),
            ' ' => {}
            '*' | '+' | '-' => {
                term = term.checked_mul(digits.parse().ok()?)?;
                digits.clear();
                if c != '*' {
                    total = total.checked_add(sign.checked_mul(term)?)?;
                    term = 1;
                    sign = if c == '-' { -1 } else { 1 };
                }
            }
            _ => return None,
        }
    }
    Some(total)
}

impl Arith {
    /// Builds the environment; every invalid value is reported.
    pub fn new(cfg: ArithConfig) -> Result<Self, Vec<String>> {
        let mut errs = Vec::new();
        if cfg.levels.is_empty() {
            errs.push("levels must not be empty".into());
        }
        for (i, l) in cfg.levels.iter().enumerate() {
            if !(1..=9).contains(&l.digits) {
                errs.push(format!("levels[{i}].digits {} must be 1..=9", l.digits));
            }
            if !(2..=6).contains(&l.operands) {
                errs.push(format!("levels[{i}].operands {} must be 2..=6", l.operands));
            }
            if l.operators.is_empty() || !l.operators.chars().all(|c| "+-*".contains(c)) {
                errs.push(format!(
                    "levels[{i}].operators {:?} must be a non-empty subset of \"+-*\"",
                    l.operators
                ));
            }
        }
        if cfg.eval_every < 2 {
            errs.push(format!("eval_every {} must be at least 2", cfg.eval_every));
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let rubric = Rubric::new().with("exact_match", 1.0, |i| {
            let want = i.problem.answer.as_deref().ok_or("problem has no answer")?;
            Ok(match i.parsed {
                Some(got) if got == want => (1.0, format!("{got} == {want}")),
                Some(got) => (0.0, format!("{got} != {want}")),
                None => (0.0, "no answer found".into()),
            })
        });
        Ok(Arith { cfg, rubric })
    }

    fn draw(&self, rng: &mut StdRng) -> (String, i128) {
        let level = &self.cfg.levels[rng.random_range(0..self.cfg.levels.len())];
        let ops: Vec<char> = level.operators.chars().collect();
        let hi = 10i64.pow(level.digits);
        let mut expr = rng.random_range(0..hi).to_string();
        for _ in 1..level.operands {
            expr.push(ops[rng.random_range(0..ops.len())]);
            expr.push_str(&rng.random_range(0..hi).to_string());
        }
        let v = evaluate(&expr).expect("generated expressions are in range");
        (expr, v)
    }
}

impl Environment for Arith {
    fn name(&self) -> &str {
        "arith"
    }

    fn sample(&self, split: Split, seed: u64) -> Problem {
        let mut rng = StdRng::seed_from_u64(seed);
        loop {
            let (expr, v) = self.draw(&mut rng);
            let held_out = fnv(&expr).is_multiple_of(self.cfg.eval_every);
            if held_out == (split == Split::Eval) {
                return Problem {
                    id: format!("arith-{}", fnv(&expr)),
                    env: "arith".into(),
                    question: expr,
                    answer: Some(v.to_string()),
                    info: serde_json::Value::Null,
                };
            }
        }
    }

    fn prompt(&self, p: &Problem) -> Prompt {
        Prompt::text(format!("{}=", p.question))
    }

    fn parse_answer(&self, completion: &str) -> Option<String> {
        let line = completion.split(['\n', '<']).next()?.trim();
        let ok = !line.is_empty() && line.trim_start_matches('-').chars().all(|c| c.is_ascii_digit());
        ok.then(|| line.to_string())
    }

    fn reference_completion(&self, p: &Problem) -> Option<String> {
        p.answer.as_ref().map(|a| format!("{a}\n"))
    }

    fn rubric(&self) -> &Rubric {
        &self.rubric
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rubric::ScoreInput;

    #[test]
    fn evaluates_with_precedence_and_scores_exact_match() {
        assert_eq!(evaluate("2+3*4"), Some(14));
        assert_eq!(evaluate("10-2-3"), Some(5));
        assert_eq!(evaluate("7*8-6*9+1"), Some(3));
        let env = Arith::new(ArithConfig::default()).unwrap();
        let p = env.sample(Split::Train, 7);
        assert_eq!(evaluate(&p.question).unwrap().to_string(), p.answer.clone().unwrap());
        let good = env.reference_completion(&p).unwrap();
        let parsed = env.parse_answer(&good);
        assert_eq!(
            env.rubric()
                .score(&ScoreInput {
                    problem: &p,
                    completion: &good,
                    parsed: parsed.as_deref(),
                    exec: None
                })
                .reward,
            1.0
        );
        let s = env.rubric().score(&ScoreInput {
            problem: &p,
            completion: "banana",
            parsed: env.parse_answer("banana").as_deref(),
            exec: None,
        });
        assert_eq!((s.reward, s.components[0].reason.as_str()), (0.0, "no answer found"));
    }

    #[test]
    fn splits_are_disjoint_and_deterministic() {
        let env = Arith::new(ArithConfig::default()).unwrap();
        let train: std::collections::HashSet<String> =
            (0..2000).map(|s| env.sample(Split::Train, s).question).collect();
        let eval: Vec<String> = (0..200).map(|s| env.sample(Split::Eval, s).question).collect();
        assert!(
            eval.iter().all(|q| !train.contains(q)),
            "eval problems never appear in training"
        );
        assert_eq!(env.sample(Split::Eval, 5), env.sample(Split::Eval, 5));
    }

    #[test]
    fn bad_config_lists_every_problem() {
        let cfg = ArithConfig {
            levels: vec![Level {
                digits: 0,
                operands: 9,
                operators: "/".into(),
            }],
            eval_every: 1,
        };
        let errs = Arith::new(cfg).unwrap_err().join("\n");
        for want in ["digits 0", "operands 9", "operators \"/\"", "eval_every 1"] {
            assert!(errs.contains(want), "missing {want}: {errs}");
        }
    }
}

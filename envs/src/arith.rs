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
    /// Weight of a partial-credit reward (`digits`: the fraction of the answer's digits,
    /// aligned from the right, and its sign, that the completion gets right); 0: off.
    /// Denser than exact match, so RL has a signal on problems it never solves outright.
    pub partial_credit: f32,
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
            partial_credit: 0.0,
        }
    }
}

/// The arith environment.
#[derive(Debug)]
pub struct Arith {
    cfg: ArithConfig,
    rubric: Rubric,
}

/// Whether `expr` is held out for eval: a well-mixed hash (FNV-1a, then the splitmix64
/// finaliser) modulo `every`. FNV-1a alone is not enough: its low bit is the XOR of the
/// bytes' low bits, which for `+`/`-` expressions is the parity of the answer, so `fnv % 10
/// == 0` held out only even answers — a biased eval split that RL on the rest learned to
/// do worse on.
fn held_out(expr: &str, every: u64) -> bool {
    let mut z = crate::fnv1a(expr).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)).is_multiple_of(every)
}

/// The fraction of `want`'s digits (aligned from the right) and sign that `got` matches;
/// extra digits in `got` count against it. 1 only for the exact answer.
pub fn digit_credit(got: &str, want: &str) -> f32 {
    let split = |s: &str| -> (bool, Vec<u8>) {
        let neg = s.starts_with('-');
        (neg, s.trim_start_matches('-').bytes().rev().collect())
    };
    let ((gn, g), (wn, w)) = (split(got), split(want));
    let positions = g.len().max(w.len()) + 1;
    let same = g.iter().zip(&w).filter(|(a, b)| a == b).count() + (gn == wn) as usize;
    same as f32 / positions as f32
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
        if !(0.0..=10.0).contains(&cfg.partial_credit) {
            errs.push(format!("partial_credit {} must be in [0, 10]", cfg.partial_credit));
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let mut rubric = Rubric::new().with("exact_match", 1.0, |i| {
            let want = i.problem.answer.as_deref().ok_or("problem has no answer")?;
            Ok(match i.parsed {
                Some(got) if got == want => (1.0, format!("{got} == {want}")),
                Some(got) => (0.0, format!("{got} != {want}")),
                None => (0.0, "no answer found".into()),
            })
        });
        if cfg.partial_credit > 0.0 {
            rubric = rubric.with("digits", cfg.partial_credit, |i| {
                let want = i.problem.answer.as_deref().ok_or("problem has no answer")?;
                Ok(match i.parsed {
                    Some(got) => {
                        let v = digit_credit(got, want);
                        (v, format!("{:.0}% of the digits of {want}", v * 100.0))
                    }
                    None => (0.0, "no answer found".into()),
                })
            });
        }
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
            if held_out(&expr, self.cfg.eval_every) == (split == Split::Eval) {
                return Problem {
                    id: format!("arith-{}", crate::fnv1a(&expr)),
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
    fn the_held_out_split_is_an_unbiased_sample() {
        let env = Arith::new(ArithConfig {
            levels: vec![Level {
                digits: 1,
                operands: 4,
                operators: "+-".into(),
            }],
            ..Default::default()
        })
        .unwrap();
        let answers = |split| -> Vec<i64> {
            (0..4000)
                .map(|s| env.sample(split, s).answer.unwrap().parse().unwrap())
                .collect()
        };
        let (train, eval) = (answers(Split::Train), answers(Split::Eval));
        let odd = |v: &[i64]| v.iter().filter(|a| *a % 2 != 0).count() as f64 / v.len() as f64;
        let mean = |v: &[i64]| v.iter().sum::<i64>() as f64 / v.len() as f64;
        // Half the answers are odd in both splits (plain FNV held out only even ones).
        assert!((odd(&eval) - 0.5).abs() < 0.04, "odd answers in eval: {}", odd(&eval));
        assert!(
            (odd(&train) - 0.5).abs() < 0.04,
            "odd answers in train: {}",
            odd(&train)
        );
        assert!(
            (mean(&eval) - mean(&train)).abs() < 0.5,
            "{} vs {}",
            mean(&eval),
            mean(&train)
        );
        // About one problem in eval_every is held out, and the splits do not overlap.
        let all: Vec<String> = (0..20_000)
            .map(|s| {
                let mut rng = StdRng::seed_from_u64(s);
                env.draw(&mut rng).0
            })
            .collect();
        let frac = all.iter().filter(|e| held_out(e, 10)).count() as f64 / all.len() as f64;
        assert!((frac - 0.1).abs() < 0.01, "held out {frac}");
        let eval_q: std::collections::HashSet<String> = (0..500).map(|s| env.sample(Split::Eval, s).question).collect();
        assert!((0..2000).all(|s| !eval_q.contains(&env.sample(Split::Train, s).question)));
    }

    #[test]
    fn partial_credit_counts_right_aligned_digits_and_sign() {
        assert_eq!(digit_credit("123", "123"), 1.0);
        assert_eq!(digit_credit("124", "123"), 0.75);
        assert_eq!(digit_credit("23", "123"), 0.75, "a missing digit is wrong");
        assert_eq!(digit_credit("-123", "123"), 0.75, "the sign counts");
        assert_eq!(digit_credit("9123", "123"), 0.8, "an extra digit counts against");
        assert_eq!(digit_credit("", "7"), 0.5);
        let env = Arith::new(ArithConfig {
            partial_credit: 0.5,
            ..Default::default()
        })
        .unwrap();
        let p = Problem {
            id: "x".into(),
            env: "arith".into(),
            question: "100+23".into(),
            answer: Some("123".into()),
            info: serde_json::Value::Null,
        };
        let s = env.rubric().score(&ScoreInput {
            problem: &p,
            completion: "124\n",
            parsed: Some("124"),
            exec: None,
        });
        assert_eq!(
            (s.reward, s.components[1].reason.as_str()),
            (0.375, "75% of the digits of 123")
        );
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
            partial_credit: -1.0,
        };
        let errs = Arith::new(cfg).unwrap_err().join("\n");
        for want in [
            "digits 0",
            "operands 9",
            "operators \"/\"",
            "eval_every 1",
            "partial_credit -1",
        ] {
            assert!(errs.contains(want), "missing {want}: {errs}");
        }
    }
}

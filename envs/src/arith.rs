//! `arith`: generated arithmetic with difficulty levels; exact-match answers. Two styles:
//! `bare`, the CPU demo task (prompts like `37+5*12=`, answers like `97` on the first line,
//! one token per character with the built-in character tokenizer), and `boxed`, for chat
//! models (`What is 37 + 5 * 12?`, a reasoning line, the answer in the last `\boxed{}`).
//!
//! ```
//! use streamrl_envs::{Environment, Split, arith::{Arith, ArithConfig, Style}};
//!
//! let env = Arith::new(ArithConfig { style: Style::Boxed, ..Default::default() }).unwrap();
//! let p = env.sample(Split::Train, 3);
//! assert!(env.prompt(&p).text.starts_with("What is "));
//! let reference = env.reference_completion(&p).unwrap();
//! assert_eq!(env.parse_answer(&reference), p.answer);
//! assert_eq!(env.parse_answer("12 + 30 = 42"), None, "the answer must be boxed");
//! ```

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::rubric::Rubric;
use crate::{Environment, Invalid, Problem, Prompt, Split};

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

/// How problems are asked and answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Style {
    /// `7-3+9-4=` → `9`: the bare expression, the answer alone on the first line (for a
    /// model trained from scratch with the character tokenizer).
    #[default]
    Bare,
    /// `What is 7 - 3 + 9 - 4?` → a reasoning line and `\boxed{9}` (for a chat model): the
    /// answer is the integer in the last `\boxed{}`; a completion without one has none.
    /// Reference solutions work `+`/`-` chains left to right (`7 - 3 = 4, 4 + 9 = 13,
    /// 13 - 4 = 9.`).
    Boxed,
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
    /// How problems are asked and answered.
    pub style: Style,
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
            style: Style::Bare,
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

/// `7-3*2` as `7 - 3 * 2`.
fn spaced(expr: &str) -> String {
    let mut out = String::with_capacity(expr.len() * 2);
    for c in expr.chars() {
        if "+-*".contains(c) {
            out.push(' ');
            out.push(c);
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out
}

/// One reasoning line: a `+`/`-` chain worked left to right (`7 - 3 = 4, 4 + 9 = 13.`),
/// anything else evaluated in one go (`7 - 3 * 2 = 1.`).
fn worked(expr: &str) -> Option<String> {
    let operands: Vec<&str> = expr.split(['+', '-']).collect();
    if expr.contains('*') || operands.len() <= 2 {
        return Some(format!("{} = {}.", spaced(expr), evaluate(expr)?));
    }
    let ops: Vec<char> = expr.chars().filter(|c| *c == '+' || *c == '-').collect();
    let mut acc: i128 = operands[0].parse().ok()?;
    let mut steps = Vec::new();
    for (op, x) in ops.iter().zip(&operands[1..]) {
        let x: i128 = x.parse().ok()?;
        let next = if *op == '+' { acc + x } else { acc - x };
        steps.push(format!("{acc} {op} {x} = {next}"));
        acc = next;
    }
    Some(format!("{}.", steps.join(", ")))
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
    pub fn new(cfg: ArithConfig) -> Result<Self, Vec<Invalid>> {
        let mut errs = Vec::new();
        if cfg.levels.is_empty() {
            errs.push(Invalid::new("levels", "must not be empty"));
        }
        for (i, l) in cfg.levels.iter().enumerate() {
            if !(1..=9).contains(&l.digits) {
                errs.push(Invalid::new(
                    format!("levels[{i}].digits"),
                    format!("{} must be 1..=9", l.digits),
                ));
            }
            if !(2..=6).contains(&l.operands) {
                errs.push(Invalid::new(
                    format!("levels[{i}].operands"),
                    format!("{} must be 2..=6", l.operands),
                ));
            }
            if l.operators.is_empty() || !l.operators.chars().all(|c| "+-*".contains(c)) {
                errs.push(Invalid::new(
                    format!("levels[{i}].operators"),
                    format!("{:?} must be a non-empty subset of \"+-*\"", l.operators),
                ));
            }
        }
        errs.extend(crate::dataset::check_eval_every(cfg.eval_every));
        if !(0.0..=10.0).contains(&cfg.partial_credit) {
            errs.push(Invalid::new(
                "partial_credit",
                format!("{} must be in [0, 10]", cfg.partial_credit),
            ));
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let mut rubric = Rubric::new().with_answer("exact_match", 1.0, "no answer found", |got, want| {
            if got == want {
                (1.0, format!("{got} == {want}"))
            } else {
                (0.0, format!("{got} != {want}"))
            }
        });
        if cfg.partial_credit > 0.0 {
            rubric = rubric.with_answer("digits", cfg.partial_credit, "no answer found", |got, want| {
                let v = digit_credit(got, want);
                (v, format!("{:.0}% of the digits of {want}", v * 100.0))
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
        match self.cfg.style {
            Style::Bare => Prompt::text(format!("{}=", p.question)),
            Style::Boxed => Prompt::text(format!(
                "What is {}?\nPut the final answer in \\boxed{{}}.",
                spaced(&p.question)
            )),
        }
    }

    fn parse_answer(&self, completion: &str) -> Option<String> {
        let line = match self.cfg.style {
            Style::Bare => completion.split(['\n', '<']).next()?.trim().to_string(),
            Style::Boxed => crate::parse::boxed(completion)?.replace([' ', ','], ""),
        };
        let ok = !line.is_empty() && line.trim_start_matches('-').chars().all(|c| c.is_ascii_digit());
        ok.then_some(line)
    }

    fn reference_completion(&self, p: &Problem) -> Option<String> {
        let a = p.answer.as_ref()?;
        Some(match self.cfg.style {
            Style::Bare => format!("{a}\n"),
            Style::Boxed => format!("{} The answer is \\boxed{{{a}}}.", worked(&p.question)?),
        })
    }

    fn rubric(&self) -> &Rubric {
        &self.rubric
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rubric::ScoreInput;

    /// An arith problem asking `question`, answered `answer`.
    fn problem(question: &str, answer: &str) -> Problem {
        Problem {
            id: "x".into(),
            env: "arith".into(),
            question: question.into(),
            answer: Some(answer.into()),
            info: serde_json::Value::Null,
        }
    }

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
        let p = problem("100+23", "123");
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
    fn boxed_style_asks_in_words_and_grades_the_last_box() {
        let env = Arith::new(ArithConfig {
            style: Style::Boxed,
            levels: vec![Level {
                digits: 2,
                operands: 3,
                operators: "+-".into(),
            }],
            ..Default::default()
        })
        .unwrap();
        let p = problem("7-3+90", "94");
        assert_eq!(
            env.prompt(&p).text,
            "What is 7 - 3 + 90?\nPut the final answer in \\boxed{}."
        );
        assert_eq!(
            env.reference_completion(&p).unwrap(),
            "7 - 3 = 4, 4 + 90 = 94. The answer is \\boxed{94}."
        );
        let score = |c: &str| {
            env.rubric()
                .score(&ScoreInput {
                    problem: &p,
                    completion: c,
                    parsed: env.parse_answer(c).as_deref(),
                    exec: None,
                })
                .reward
        };
        assert_eq!(score("\\boxed{93} no, \\boxed{ 94 }"), 1.0, "the last box counts");
        assert_eq!(score("7 - 3 + 90 = 94"), 0.0, "an unboxed answer is no answer");
        assert_eq!(score("\\boxed{94.5}"), 0.0);
        assert_eq!(score("\\boxed{-94}"), 0.0);
        // Every generated problem's reference solution earns the full reward, with `*` too.
        let env = Arith::new(ArithConfig {
            style: Style::Boxed,
            ..Default::default()
        })
        .unwrap();
        for seed in 0..200 {
            let p = env.sample(Split::Train, seed);
            let r = env.reference_completion(&p).unwrap();
            assert_eq!(env.parse_answer(&r), p.answer, "{r}");
        }
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
            style: Style::Bare,
        };
        let errs: Vec<String> = Arith::new(cfg).unwrap_err().iter().map(ToString::to_string).collect();
        let errs = errs.join("\n");
        for want in [
            "digits: 0",
            "operands: 9",
            "operators: \"/\"",
            "eval_every: 1",
            "partial_credit: -1",
        ] {
            assert!(errs.contains(want), "missing {want}: {errs}");
        }
    }
}

//! `countdown`: reach a target from given numbers with + − × ÷, each number used at most
//! once. The verifier parses and evaluates the expression itself, in exact rationals —
//! model text is never evaluated by anything else.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::rubric::Rubric;
use crate::{Environment, Problem, Prompt, Split};

/// An exact rational.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Q {
    n: i128,
    d: i128,
}

fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 { a.abs() } else { gcd(b, a % b) }
}

impl Q {
    fn new(n: i128, d: i128) -> Option<Q> {
        if d == 0 {
            return None;
        }
        let g = gcd(n, d).max(1);
        let s = if d < 0 { -1 } else { 1 };
        Some(Q {
            n: s * n / g,
            d: s * d / g,
        })
    }
    fn int(n: i128) -> Q {
        Q { n, d: 1 }
    }
    fn op(self, o: char, r: Q) -> Option<Q> {
        match o {
            '+' => Q::new(
                self.n.checked_mul(r.d)?.checked_add(r.n.checked_mul(self.d)?)?,
                self.d.checked_mul(r.d)?,
            ),
            '-' => Q::new(
                self.n.checked_mul(r.d)?.checked_sub(r.n.checked_mul(self.d)?)?,
                self.d.checked_mul(r.d)?,
            ),
            '*' => Q::new(self.n.checked_mul(r.n)?, self.d.checked_mul(r.d)?),
            '/' => Q::new(self.n.checked_mul(r.d)?, self.d.checked_mul(r.n)?),
            _ => None,
        }
    }
    /// Whether this is exactly the integer `v`.
    pub fn is(&self, v: i128) -> bool {
        self.d == 1 && self.n == v
    }
}

/// Why an expression is not a valid countdown answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalid {
    /// Not a well-formed arithmetic expression.
    Syntax(String),
    /// Division by zero or overflow.
    Arithmetic,
    /// A number not available (or used too often).
    NumberNotAvailable(i128),
}

struct Parser<'a> {
    t: &'a [char],
    i: usize,
    used: Vec<i128>,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.t.get(self.i).is_some_and(|c| c.is_whitespace()) {
            self.i += 1;
        }
    }
    fn op(&mut self, set: &[(char, char)]) -> Option<char> {
        self.ws();
        let c = *self.t.get(self.i)?;
        let o = set.iter().find(|(k, _)| *k == c).map(|(_, v)| *v)?;
        self.i += 1;
        Some(o)
    }
    fn expr(&mut self, depth: usize) -> Result<Q, Invalid> {
        let mut v = self.term(depth)?;
        while let Some(o) = self.op(&[('+', '+'), ('-', '-'), ('−', '-')]) {
            v = v.op(o, self.term(depth)?).ok_or(Invalid::Arithmetic)?;
        }
        Ok(v)
    }
    fn term(&mut self, depth: usize) -> Result<Q, Invalid> {
        let mut v = self.atom(depth)?;
        while let Some(o) = self.op(&[('*', '*'), ('×', '*'), ('x', '*'), ('/', '/'), ('÷', '/')]) {
            v = v.op(o, self.atom(depth)?).ok_or(Invalid::Arithmetic)?;
        }
        Ok(v)
    }
    fn atom(&mut self, depth: usize) -> Result<Q, Invalid> {
        if depth > 50 {
            return Err(Invalid::Syntax("nested too deeply".into()));
        }
        self.ws();
        match self.t.get(self.i) {
            Some('(') => {
                self.i += 1;
                let v = self.expr(depth + 1)?;
                self.ws();
                if self.t.get(self.i) != Some(&')') {
                    return Err(Invalid::Syntax(format!("expected `)` at {}", self.i)));
                }
                self.i += 1;
                Ok(v)
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.i;
                while self.t.get(self.i).is_some_and(|c| c.is_ascii_digit()) {
                    self.i += 1;
                }
                let s: String = self.t[start..self.i].iter().collect();
                let n: i128 = s
                    .parse()
                    .map_err(|_| Invalid::Syntax(format!("number `{s}` too large")))?;
                self.used.push(n);
                Ok(Q::int(n))
            }
            other => Err(Invalid::Syntax(format!("unexpected {:?} at {}", other, self.i))),
        }
    }
}

/// Evaluates `expr` using only `numbers` (each at most once).
pub fn check(expr: &str, numbers: &[i128]) -> Result<Q, Invalid> {
    let chars: Vec<char> = expr.chars().collect();
    let mut p = Parser {
        t: &chars,
        i: 0,
        used: Vec::new(),
    };
    let v = p.expr(0)?;
    p.ws();
    if p.i != chars.len() {
        return Err(Invalid::Syntax(format!("trailing text at {}", p.i)));
    }
    let mut avail = numbers.to_vec();
    for u in p.used {
        match avail.iter().position(|&a| a == u) {
            Some(k) => {
                avail.swap_remove(k);
            }
            None => return Err(Invalid::NumberNotAvailable(u)),
        }
    }
    Ok(v)
}

/// The countdown environment: 4 numbers in 1..=50 and a target reachable from them.
#[derive(Debug)]
pub struct Countdown {
    rubric: Rubric,
}

impl Default for Countdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Countdown {
    /// The environment with its rubric (reaches_target 1.0, valid_expression 0.1).
    pub fn new() -> Self {
        fn numbers(p: &Problem) -> Result<(Vec<i128>, i128), String> {
            let nums = p.info["numbers"]
                .as_array()
                .ok_or("problem has no numbers")?
                .iter()
                .filter_map(|v| v.as_i64())
                .map(i128::from)
                .collect();
            let target = p.info["target"].as_i64().ok_or("problem has no target")? as i128;
            Ok((nums, target))
        }
        let rubric = Rubric::new()
            .with("reaches_target", 1.0, |i| {
                let (nums, target) = numbers(i.problem)?;
                let Some(expr) = i.parsed else {
                    return Ok((0.0, "no expression found".into()));
                };
                Ok(match check(expr, &nums) {
                    Ok(v) if v.is(target) => (1.0, format!("{expr} = {target}")),
                    Ok(v) => (0.0, format!("{expr} = {}/{} ≠ {target}", v.n, v.d)),
                    Err(e) => (0.0, format!("{e:?}")),
                })
            })
            .with("valid_expression", 0.1, |i| {
                let (nums, _) = numbers(i.problem)?;
                Ok(match i.parsed.map(|e| check(e, &nums)) {
                    Some(Ok(_)) => (1.0, "parses and uses only given numbers".into()),
                    Some(Err(e)) => (0.0, format!("{e:?}")),
                    None => (0.0, "no expression found".into()),
                })
            });
        Countdown { rubric }
    }
}

impl Environment for Countdown {
    fn name(&self) -> &str {
        "countdown"
    }

    fn sample(&self, split: Split, seed: u64) -> Problem {
        let salt = if split == Split::Eval { 0x9e37_79b9_7f4a_7c15 } else { 0 };
        let mut rng = StdRng::seed_from_u64(seed ^ salt);
        let nums: Vec<i128> = (0..4).map(|_| rng.random_range(1..=50)).collect();
        // Build a target by combining the numbers in a random order with + − ×.
        let mut order = nums.clone();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        let mut expr = order[0].to_string();
        let mut v = Q::int(order[0]);
        for &n in &order[1..] {
            let o = ['+', '-', '*'][rng.random_range(0..3)];
            v = v.op(o, Q::int(n)).expect("small values");
            expr = format!("({expr}{o}{n})");
        }
        let target = v.n;
        Problem {
            id: format!(
                "countdown-{}-{seed}",
                if split == Split::Eval { "eval" } else { "train" }
            ),
            env: "countdown".into(),
            question: format!(
                "Using the numbers {:?} (each at most once) and + - * /, make {target}.",
                nums
            ),
            answer: Some(expr),
            info: serde_json::json!({"numbers": nums.iter().map(|n| *n as i64).collect::<Vec<_>>(), "target": target as i64}),
        }
    }

    fn prompt(&self, p: &Problem) -> Prompt {
        Prompt::text(format!(
            "{}\nAnswer with the expression inside <answer></answer>.\n",
            p.question
        ))
    }

    fn parse_answer(&self, completion: &str) -> Option<String> {
        crate::parse::answer_tag(completion)
    }

    fn reference_completion(&self, p: &Problem) -> Option<String> {
        p.answer.as_ref().map(|a| format!("<answer>{a}</answer>"))
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
    fn verifier_checks_numbers_and_value() {
        let nums = [3, 7, 25, 50];
        assert!(check("(50 - 25) * 3 + 7", &nums).unwrap().is(82));
        assert!(check("50 × 3 ÷ 25", &nums).unwrap().is(6));
        assert!(check("50 − 7", &nums).unwrap().is(43));
        assert_eq!(check("3 + 3", &nums), Err(Invalid::NumberNotAvailable(3)));
        assert_eq!(check("4 * 2", &nums), Err(Invalid::NumberNotAvailable(4)));
        assert_eq!(check("7 / (3 - 3)", &[7, 3, 3]), Err(Invalid::Arithmetic));
        assert!(matches!(check("import os", &nums), Err(Invalid::Syntax(_))));
        assert!(matches!(check("7 +", &nums), Err(Invalid::Syntax(_))));
        assert!(matches!(
            check(&format!("{}7{}", "(".repeat(500), ")".repeat(500)), &nums),
            Err(Invalid::Syntax(_))
        ));
        assert!(matches!(check(&"9".repeat(60), &nums), Err(Invalid::Syntax(_))));
        // 7/3 is not 2: exact rationals, no float rounding.
        assert!(!check("7 / 3", &nums).unwrap().is(2));
    }

    #[test]
    fn generated_problems_are_solvable_by_their_reference() {
        let env = Countdown::new();
        for seed in 0..50 {
            let p = env.sample(Split::Train, seed);
            let c = env.reference_completion(&p).unwrap();
            let parsed = env.parse_answer(&c);
            let s = env.rubric().score(&ScoreInput {
                problem: &p,
                completion: &c,
                parsed: parsed.as_deref(),
                exec: None,
            });
            assert!((s.reward - 1.1).abs() < 1e-6, "{p:?} {s:?}");
        }
    }
}

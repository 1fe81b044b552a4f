//! `tool`: multi-turn tool use. The model may run Python (in a sandbox) before it
//! answers: it writes `<python>CODE</python>`, generation stops at the closing tag
//! (`finish_reason = tool_call`), the sandbox stage runs the code and sends the output
//! back as `<output>…</output>` on a continuation, and the rollout stage generates the
//! next turn. The final answer, `<answer>N</answer>` after the last tool output, is
//! graded by exact integer match.
//!
//! Problems are generated: products and sums of several-digit numbers, which are easy
//! with the tool and hard without it.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::rubric::Rubric;
use crate::{Environment, Execution, Invalid, Problem, Prompt, Split};

/// How tool calls are written, recognised and answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolProtocol {
    /// The one tool's name.
    pub name: String,
    /// Text that opens a call.
    pub call_start: String,
    /// Text that closes a call; generation stops here (the engine's tool-call marker).
    pub call_end: String,
    /// Text that opens a rendered tool output.
    pub output_start: String,
    /// Text that closes a rendered tool output.
    pub output_end: String,
    /// Most model turns per trajectory (the last turn must answer).
    pub max_turns: u32,
    /// Characters of tool output shown to the model at most.
    pub max_output_chars: usize,
    /// Wall-clock limit of one call in ms.
    pub wall_ms: u64,
}

impl ToolProtocol {
    /// The code of the last call in one turn's text, if the turn ends in a call.
    pub fn parse_call(&self, turn: &str) -> Option<String> {
        let end = turn.rfind(&self.call_end)?;
        let start = turn[..end].rfind(&self.call_start)? + self.call_start.len();
        Some(turn[start..end].trim_matches('\n').to_string())
    }

    /// The program that runs a call in the sandbox.
    pub fn execution(&self, code: &str) -> Execution {
        Execution {
            files: vec![("call.py".into(), code.to_string())],
            argv: vec!["python3".into(), "call.py".into()],
            wall_ms: Some(self.wall_ms),
            report_marker: None,
        }
    }

    /// The text appended to the trajectory after a call: its stdout and stderr (cut to
    /// `max_output_chars`) and, when it did not end well, its status.
    pub fn render(&self, stdout: &str, stderr: &str, status: &str) -> String {
        let mut out = format!("{stdout}{stderr}");
        if out.chars().count() > self.max_output_chars {
            out = out.chars().take(self.max_output_chars).collect::<String>() + "…[cut]\n";
        }
        if status != "ok" {
            out.push_str(&format!("[{status}]\n"));
        }
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        format!("\n{}\n{out}{}\n", self.output_start, self.output_end)
    }

    /// The part of a trajectory after the last tool output (the final turn).
    pub fn last_turn<'a>(&self, completion: &'a str) -> &'a str {
        completion
            .rfind(&self.output_end)
            .map_or(completion, |i| &completion[i + self.output_end.len()..])
    }
}

/// Configuration of the tool environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ToolConfig {
    /// Digits of each operand.
    pub digits: u32,
    /// Most model turns per trajectory.
    pub max_turns: u32,
    /// One problem in this many (by a hash of the question) is held out for eval.
    pub eval_every: u64,
    /// Weight of a reward for using the tool at least once (0: off).
    pub tool_use_weight: f32,
}

impl Default for ToolConfig {
    fn default() -> Self {
        ToolConfig {
            digits: 4,
            max_turns: 3,
            eval_every: 10,
            tool_use_weight: 0.0,
        }
    }
}

/// The tool environment.
#[derive(Debug)]
pub struct Tool {
    cfg: ToolConfig,
    protocol: ToolProtocol,
    rubric: Rubric,
}

impl Tool {
    /// Validates the configuration (every problem reported).
    pub fn new(cfg: ToolConfig) -> Result<Self, Vec<Invalid>> {
        let mut errs = vec![];
        if !(1..=9).contains(&cfg.digits) {
            errs.push(Invalid::new("digits", format!("{} must be in 1..=9", cfg.digits)));
        }
        if cfg.max_turns < 2 {
            errs.push(Invalid::new(
                "max_turns",
                format!("{} must be at least 2 (a call and an answer)", cfg.max_turns),
            ));
        }
        errs.extend(crate::dataset::check_eval_every(cfg.eval_every));
        if !errs.is_empty() {
            return Err(errs);
        }
        let protocol = ToolProtocol {
            name: "python".into(),
            call_start: "<python>".into(),
            call_end: "</python>".into(),
            output_start: "<output>".into(),
            output_end: "</output>".into(),
            max_turns: cfg.max_turns,
            max_output_chars: 2000,
            wall_ms: 5000,
        };
        let p2 = protocol.clone();
        let mut rubric =
            Rubric::new().with_answer("correct", 1.0, "no <answer> after the last tool output", |got, want| {
                if got == want {
                    (1.0, format!("{got} = {want}"))
                } else {
                    (0.0, format!("{got} ≠ {want}"))
                }
            });
        if cfg.tool_use_weight > 0.0 {
            rubric = rubric.with("used_tool", cfg.tool_use_weight, move |i| {
                Ok(if i.completion.contains(&p2.output_start) {
                    (1.0, "called the tool".into())
                } else {
                    (0.0, "no tool call".into())
                })
            });
        }
        Ok(Tool { cfg, protocol, rubric })
    }

    fn question(&self, seed: u64) -> (String, i128) {
        let mut rng = StdRng::seed_from_u64(seed);
        let lo = 10i128.pow(self.cfg.digits - 1);
        let hi = 10i128.pow(self.cfg.digits);
        let (a, b, c) = (
            rng.random_range(lo..hi),
            rng.random_range(lo..hi),
            rng.random_range(lo..hi),
        );
        (format!("{a} * {b} + {c}"), a * b + c)
    }

    fn is_eval(&self, q: &str) -> bool {
        crate::fnv1a(q).is_multiple_of(self.cfg.eval_every)
    }
}

impl Environment for Tool {
    fn name(&self) -> &str {
        "tool"
    }

    fn sample(&self, split: Split, seed: u64) -> Problem {
        let mut s = seed.wrapping_mul(2_654_435_761);
        loop {
            let (q, v) = self.question(s);
            if self.is_eval(&q) == (split == Split::Eval) {
                return Problem {
                    id: format!("tool-{q}"),
                    env: "tool".into(),
                    question: format!("What is {q}?"),
                    answer: Some(v.to_string()),
                    info: serde_json::json!({"expression": q}),
                };
            }
            s = s.wrapping_add(1);
        }
    }

    fn prompt(&self, p: &Problem) -> Prompt {
        let t = &self.protocol;
        Prompt::text(format!(
            "Run Python with {}code{}; its output comes back in {}. Answer as <answer>N</answer>.\n{}\n",
            t.call_start, t.call_end, t.output_start, p.question
        ))
    }

    fn parse_answer(&self, completion: &str) -> Option<String> {
        crate::parse::answer_tag(self.protocol.last_turn(completion))
            .map(|a| a.replace('\u{2212}', "-").replace(',', ""))
    }

    fn reference_completion(&self, p: &Problem) -> Option<String> {
        let expr = p.info.get("expression")?.as_str()?;
        let answer = p.answer.as_ref()?;
        let t = &self.protocol;
        Some(format!(
            "{}print({expr}){}{}<answer>{answer}</answer>",
            t.call_start,
            t.call_end,
            t.render(&format!("{answer}\n"), "", "ok")
        ))
    }

    fn rubric(&self) -> &Rubric {
        &self.rubric
    }

    fn tools(&self) -> Option<&ToolProtocol> {
        Some(&self.protocol)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rubric::ScoreInput;

    #[test]
    fn calls_are_parsed_rendered_and_answers_graded_after_the_last_output() {
        let env = Tool::new(ToolConfig::default()).unwrap();
        let t = env.tools().unwrap();
        assert_eq!(
            t.parse_call("let me compute <python>\nprint(2*3)\n</python>")
                .as_deref(),
            Some("print(2*3)")
        );
        assert_eq!(t.parse_call("no call"), None);
        assert_eq!(t.parse_call("</python> before <python>"), None);
        assert_eq!(t.render("6\n", "", "ok"), "\n<output>\n6\n</output>\n");
        assert_eq!(
            t.render("", "boom", "timeout"),
            "\n<output>\nboom[timeout]\n</output>\n"
        );
        let long = t.render(&"x".repeat(5000), "", "ok");
        assert!(long.len() < 2100 && long.contains("…[cut]"));

        let p = env.sample(Split::Train, 3);
        let good = env.reference_completion(&p).unwrap();
        assert_eq!(env.parse_answer(&good), p.answer);
        let score = |c: &str| {
            let parsed = env.parse_answer(c);
            env.rubric()
                .score(&ScoreInput {
                    problem: &p,
                    completion: c,
                    parsed: parsed.as_deref(),
                    exec: None,
                })
                .reward
        };
        assert_eq!(score(&good), 1.0);
        // An answer inside the tool output (or before it) does not count.
        let sneaky = format!(
            "<answer>{}</answer><python>print(1)</python>\n<output>\n<answer>{}</answer>\n</output>\n",
            p.answer.clone().unwrap(),
            p.answer.clone().unwrap()
        );
        assert_eq!(score(&sneaky), 0.0);
        assert_eq!(
            score(&format!(
                "<answer>{}</answer>",
                p.answer.clone().unwrap().replacen('1', "2", 1) + "0"
            )),
            0.0
        );
    }

    #[test]
    fn splits_are_disjoint_and_config_is_checked() {
        let env = Tool::new(ToolConfig {
            digits: 2,
            ..Default::default()
        })
        .unwrap();
        let train: std::collections::HashSet<String> =
            (0..3000).map(|s| env.sample(Split::Train, s).question).collect();
        assert!((0..100).all(|s| !train.contains(&env.sample(Split::Eval, s).question)));
        let errs = Tool::new(ToolConfig {
            digits: 0,
            max_turns: 1,
            eval_every: 0,
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(errs.len(), 3, "{errs:?}");
    }
}

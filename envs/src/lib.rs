//! Environments (task logic) and rubrics (reward logic), kept apart as in INTELLECT-3's
//! verifiers: an [`Environment`] says where problems come from, how a problem becomes a
//! prompt and how an answer is parsed out of a completion; its [`Rubric`] is a list of
//! named, weighted reward functions.
//!
//! ```
//! use streamrl_envs::{Environment, Split, build, rubric::ScoreInput};
//!
//! let env = build("arith", &serde_json::Value::Null).unwrap();
//! let p = env.sample(Split::Train, 42);
//! let completion = env.reference_completion(&p).unwrap();
//! let parsed = env.parse_answer(&completion);
//! let score = env.rubric().score(&ScoreInput { problem: &p, completion: &completion, parsed: parsed.as_deref(), exec: None });
//! assert_eq!(score.reward, 1.0);
//! ```

pub mod arith;
pub mod code;
pub mod countdown;
pub mod dataset;
pub mod equiv;
pub mod math;
pub mod parse;
pub mod prompted;
pub mod rubric;
pub mod tool;

use serde::{Deserialize, Serialize};
/// A problem with an environment's configuration, with its key path (the workspace's
/// config problem, named `Invalid` here because a [`Problem`] is a task's problem).
pub use streamrl_schemas::Problem as Invalid;

pub use rubric::{ExecInfo, Rubric};
pub use tool::ToolProtocol;

/// Which side of the fixed train/eval split to draw from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Split {
    /// Problems for training.
    Train,
    /// Held-out problems for evaluation (never drawn for training).
    Eval,
}

/// One problem of an environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// Stable id.
    pub id: String,
    /// Environment name.
    pub env: String,
    /// The question.
    pub question: String,
    /// Reference answer, if any.
    pub answer: Option<String>,
    /// Environment-specific data (numbers, tests, ...).
    pub info: serde_json::Value,
}

/// A chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// system, user or assistant.
    pub role: String,
    /// Text.
    pub content: String,
}

/// What the model is given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prompt {
    /// Plain-text prompt (used with the built-in plain template).
    pub text: String,
    /// The same as chat messages (used with a checkpoint's chat template).
    pub messages: Vec<Message>,
    /// System prompt, if any.
    pub system: Option<String>,
}

impl Prompt {
    /// A single-turn prompt.
    pub fn text(text: impl Into<String>) -> Self {
        let text = text.into();
        Prompt {
            messages: vec![Message {
                role: "user".into(),
                content: text.clone(),
            }],
            text,
            system: None,
        }
    }
}

/// Task logic.
pub trait Environment: Send + Sync + std::fmt::Debug {
    /// Name, as in topology.yaml.
    fn name(&self) -> &str;
    /// The problem drawn by `seed` from `split` (deterministic).
    fn sample(&self, split: Split, seed: u64) -> Problem;
    /// Size of a finite split (`None`: generated, unbounded).
    fn split_len(&self, _split: Split) -> Option<usize> {
        None
    }
    /// The prompt for a problem.
    fn prompt(&self, problem: &Problem) -> Prompt;
    /// The answer in a completion, if one can be found.
    fn parse_answer(&self, completion: &str) -> Option<String>;
    /// A correct completion, for SFT warm starts.
    fn reference_completion(&self, problem: &Problem) -> Option<String>;
    /// Reward logic.
    fn rubric(&self) -> &Rubric;
    /// What must run in a sandbox before `completion` can be scored (`None`: nothing).
    fn execution(&self, _problem: &Problem, _completion: &str) -> Option<Execution> {
        None
    }
    /// The multi-turn tool protocol, for environments that offer tools.
    fn tools(&self) -> Option<&ToolProtocol> {
        None
    }
    /// Whether samples of this environment need a sandbox (to execute or for tools).
    fn needs_sandbox(&self) -> bool {
        self.tools().is_some()
    }
}

/// A program to run in a sandbox for one sample: files written under `/work`, then
/// `argv`. When `report_marker` is set, the program prints one line
/// `MARKER {"passed": P, "total": T}` with its unit-test counts.
#[derive(Debug, Clone, PartialEq)]
pub struct Execution {
    /// Files (path under `/work`, contents).
    pub files: Vec<(String, String)>,
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Wall-clock limit in ms (`None`: the sandbox default).
    pub wall_ms: Option<u64>,
    /// Marker of the test-report line, if the program reports tests.
    pub report_marker: Option<String>,
}

impl Execution {
    /// The `(passed, total)` test counts reported on stdout (the last marker line wins),
    /// or `None` when the program printed no report.
    pub fn report(&self, stdout: &str) -> Option<(u32, u32)> {
        let marker = self.report_marker.as_deref()?;
        let line = stdout.lines().rev().find_map(|l| l.strip_prefix(marker))?;
        let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
        let passed = u32::try_from(v.get("passed")?.as_u64()?).ok()?;
        let total = u32::try_from(v.get("total")?.as_u64()?).ok()?;
        (passed <= total).then_some((passed, total))
    }
}

/// An environment's config from its JSON block (`null`: defaults); a value that does not
/// fit is a problem at the key path where it was found.
fn config<T: serde::de::DeserializeOwned + Default>(v: &serde_json::Value) -> Result<T, Vec<Invalid>> {
    if v.is_null() {
        return Ok(T::default());
    }
    serde_path_to_error::deserialize::<_, T>(v.clone()).map_err(|e| vec![streamrl_schemas::problem::from_serde(e)])
}

/// FNV-1a (64-bit) of a string: stable problem ids and held-out splits.
pub(crate) fn fnv1a(s: &str) -> u64 {
    use std::hash::Hasher as _;
    let mut h = fnv::FnvHasher::default();
    h.write(s.as_bytes());
    h.finish()
}

/// Builds an environment by name from its configuration (`null`: defaults).
pub fn build(name: &str, cfg: &serde_json::Value) -> Result<Box<dyn Environment>, Vec<Invalid>> {
    match name {
        "arith" => Ok(Box::new(arith::Arith::new(config(cfg)?)?)),
        "countdown" => {
            if !cfg.is_null() && cfg.as_object().is_none_or(|m| !m.is_empty()) {
                return Err(vec![Invalid::whole("countdown takes no configuration")]);
            }
            Ok(Box::new(countdown::Countdown::new()))
        }
        "math" => Ok(Box::new(math::Math::new(config(cfg)?)?)),
        "code" => Ok(Box::new(code::Code::new(config(cfg)?)?)),
        "tool" => Ok(Box::new(tool::Tool::new(config(cfg)?)?)),
        other => Err(vec![Invalid::whole(format!(
            "unknown environment `{other}` (built in: arith, countdown, math, code, tool)"
        ))]),
    }
}

/// Environments mixed by weight.
#[derive(Debug)]
pub struct Mix {
    envs: Vec<(Box<dyn Environment>, f64)>,
}

impl Mix {
    /// A mix; weights must be positive.
    pub fn new(envs: Vec<(Box<dyn Environment>, f64)>) -> Result<Self, Vec<Invalid>> {
        let errs: Vec<Invalid> = envs
            .iter()
            .filter(|(_, w)| !w.is_finite() || *w <= 0.0)
            .map(|(e, w)| Invalid::new(format!("{}.weight", e.name()), format!("{w}: weights must be positive")))
            .collect();
        if envs.is_empty() {
            return Err(vec![Invalid::whole("a mix needs at least one environment")]);
        }
        if errs.is_empty() { Ok(Mix { envs }) } else { Err(errs) }
    }

    /// The environment chosen by `u` in [0, 1).
    pub fn pick(&self, u: f64) -> &dyn Environment {
        let total: f64 = self.envs.iter().map(|(_, w)| w).sum();
        let mut acc = 0.0;
        for (e, w) in &self.envs {
            acc += w / total;
            if u < acc {
                return e.as_ref();
            }
        }
        self.envs.last().expect("non-empty").0.as_ref()
    }

    /// Whether any environment of the mix needs a sandbox.
    pub fn needs_sandbox(&self) -> bool {
        self.envs.iter().any(|(e, _)| e.needs_sandbox())
    }

    /// The environments and their weights.
    pub fn iter(&self) -> impl Iterator<Item = (&dyn Environment, f64)> {
        self.envs.iter().map(|(e, w)| (e.as_ref(), *w))
    }

    /// An environment by name.
    pub fn get(&self, name: &str) -> Option<&dyn Environment> {
        self.envs
            .iter()
            .find(|(e, _)| e.name() == name)
            .map(|(e, _)| e.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published FNV-1a 64 test vectors: problem ids and held-out splits depend on it.
    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn registry_and_mix() {
        assert!(
            build("cobol", &serde_json::Value::Null).unwrap_err()[0]
                .message
                .contains("unknown environment `cobol`")
        );
        let e = build("arith", &serde_json::json!({"eval_every": 1, "bogus": 2})).unwrap_err();
        assert!(e[0].to_string().contains("bogus"), "{e:?}");
        let mix = Mix::new(vec![
            (build("arith", &serde_json::Value::Null).unwrap(), 3.0),
            (build("countdown", &serde_json::Value::Null).unwrap(), 1.0),
        ])
        .unwrap();
        let picks: Vec<&str> = (0..100).map(|i| mix.pick(i as f64 / 100.0).name()).collect();
        assert_eq!(picks.iter().filter(|n| **n == "arith").count(), 75);
        assert!(Mix::new(vec![(build("math", &serde_json::Value::Null).unwrap(), 0.0)]).is_err());
    }
}

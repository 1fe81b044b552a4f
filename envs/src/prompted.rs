//! Prompt options every environment gets from its topology entry: a system prompt and
//! few-shot examples (the first `few_shot` training problems with their reference
//! completions), as chat turns and, for the plain template, as text before the question.
//!
//! ```
//! use streamrl_envs::{Environment, Split, build, prompted::Prompted};
//!
//! let env = Prompted::new(build("arith", &serde_json::Value::Null).unwrap(), 2, Some("Be exact.".into())).unwrap();
//! let p = env.prompt(&env.sample(Split::Train, 7));
//! assert_eq!(p.messages.len(), 1 + 2 * 2 + 1); // system, two examples, the question
//! assert_eq!(p.messages[0].role, "system");
//! ```

use crate::{Environment, Execution, Invalid, Message, Problem, Prompt, Rubric, Split, ToolProtocol};

/// An environment with a system prompt and few-shot examples added to its prompts.
#[derive(Debug)]
pub struct Prompted {
    inner: Box<dyn Environment>,
    shots: Vec<(Prompt, String)>,
    system: Option<String>,
}

impl Prompted {
    /// Wraps `inner`; fails when it has no reference completions for the examples.
    pub fn new(inner: Box<dyn Environment>, few_shot: usize, system: Option<String>) -> Result<Self, Vec<Invalid>> {
        let mut shots = Vec::with_capacity(few_shot);
        for i in 0..few_shot as u64 {
            let p = inner.sample(Split::Train, u64::MAX - i);
            match inner.reference_completion(&p) {
                Some(c) => shots.push((inner.prompt(&p), c)),
                None => {
                    return Err(vec![Invalid::new(
                        "few_shot",
                        format!(
                            "environment `{}` has no reference completion for problem {}",
                            inner.name(),
                            p.id
                        ),
                    )]);
                }
            }
        }
        Ok(Prompted { inner, shots, system })
    }
}

impl Environment for Prompted {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn sample(&self, split: Split, seed: u64) -> Problem {
        self.inner.sample(split, seed)
    }
    fn split_len(&self, split: Split) -> Option<usize> {
        self.inner.split_len(split)
    }
    fn prompt(&self, problem: &Problem) -> Prompt {
        let base = self.inner.prompt(problem);
        let system = self.system.clone().or(base.system.clone());
        let mut messages = Vec::new();
        let mut text = String::new();
        if let Some(s) = &system {
            messages.push(Message {
                role: "system".into(),
                content: s.clone(),
            });
            text.push_str(s);
            text.push('\n');
        }
        for (p, completion) in &self.shots {
            messages.extend(p.messages.iter().filter(|m| m.role != "system").cloned());
            messages.push(Message {
                role: "assistant".into(),
                content: completion.clone(),
            });
            text.push_str(&p.text);
            text.push_str(completion);
            text.push('\n');
        }
        messages.extend(base.messages.into_iter().filter(|m| m.role != "system"));
        text.push_str(&base.text);
        Prompt { text, messages, system }
    }
    fn parse_answer(&self, completion: &str) -> Option<String> {
        self.inner.parse_answer(completion)
    }
    fn reference_completion(&self, problem: &Problem) -> Option<String> {
        self.inner.reference_completion(problem)
    }
    fn rubric(&self) -> &Rubric {
        self.inner.rubric()
    }
    fn execution(&self, problem: &Problem, completion: &str) -> Option<Execution> {
        self.inner.execution(problem, completion)
    }
    fn tools(&self) -> Option<&ToolProtocol> {
        self.inner.tools()
    }
    fn needs_sandbox(&self) -> bool {
        self.inner.needs_sandbox()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_come_before_the_question_in_text_and_messages() {
        let inner = crate::build("arith", &serde_json::Value::Null).unwrap();
        let plain = inner.prompt(&inner.sample(Split::Train, 3));
        let env = Prompted::new(crate::build("arith", &serde_json::Value::Null).unwrap(), 1, None).unwrap();
        let p = env.prompt(&env.sample(Split::Train, 3));
        assert!(
            p.text.ends_with(&plain.text) && p.text.len() > plain.text.len(),
            "{:?}",
            p.text
        );
        assert_eq!(
            p.messages.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(),
            ["user", "assistant", "user"]
        );
        assert_eq!(p.messages[2].content, plain.messages[0].content);
        // The examples are training problems with correct answers.
        let shot = &p.messages[1].content;
        assert_eq!(
            env.rubric()
                .score(&crate::rubric::ScoreInput {
                    problem: &env.sample(Split::Train, u64::MAX),
                    completion: shot,
                    parsed: env.parse_answer(shot).as_deref(),
                    exec: None,
                })
                .reward,
            1.0
        );
    }
}

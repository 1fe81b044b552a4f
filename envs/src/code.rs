//! `code`: write a Python function; hidden unit tests run in a sandbox; the reward is the
//! fraction of tests passed. A sandbox that crashed, timed out or ran out of memory scores
//! 0 with its status as the reason (and the mask stage can drop the sample).
//!
//! The program is a small harness: it loads `solution.py` (the model's code), runs each
//! test (`assert ...` lines) with a per-test alarm, and prints one line
//! `MARKER {"passed": P, "total": T}` where the marker is random per execution.

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::rubric::Rubric;
use crate::{Environment, Execution, Invalid, Problem, Prompt, Split};

/// Configuration of the code environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CodeConfig {
    /// Dataset file, JSON Lines or Parquet, with `prompt`, `signature`, `tests` (a list of
    /// Python statements, typically `assert`s) and optional `id` and `solution`; `None`:
    /// the built-in fixture.
    pub dataset: Option<String>,
    /// One problem in this many is held out for eval.
    pub eval_every: usize,
    /// Seconds each test may run.
    pub test_timeout_secs: u32,
    /// Wall-clock limit of the whole harness in ms.
    pub wall_ms: u64,
    /// System prompt.
    pub system_prompt: Option<String>,
}

impl Default for CodeConfig {
    fn default() -> Self {
        CodeConfig {
            dataset: None,
            eval_every: 5,
            test_timeout_secs: 2,
            wall_ms: 10_000,
            system_prompt: None,
        }
    }
}

#[derive(Debug, Deserialize)]
struct Row {
    #[serde(default)]
    id: Option<String>,
    prompt: String,
    signature: String,
    tests: Vec<String>,
    #[serde(default)]
    solution: Option<String>,
}

/// The code environment.
#[derive(Debug)]
pub struct Code {
    cfg: CodeConfig,
    splits: crate::dataset::Splits,
    rubric: Rubric,
}

const HARNESS: &str = r#"import json, signal, sys
MARKER, TIMEOUT = sys.argv[1], int(sys.argv[2])
tests = json.load(open("tests.json"))
def report(passed, **extra):
    sys.stdout.flush()
    print("\n" + MARKER, json.dumps(dict(passed=passed, total=len(tests), **extra)), flush=True)
def alarm(signum, frame):
    raise TimeoutError(f"test ran past {TIMEOUT} s")
signal.signal(signal.SIGALRM, alarm)
ns = {"__name__": "solution"}
try:
    signal.alarm(TIMEOUT)
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
    signal.alarm(0)
except BaseException as e:
    report(0, error=f"solution did not load: {type(e).__name__}: {e}")
    sys.exit(0)
passed, failures = 0, []
for t in tests:
    try:
        signal.alarm(TIMEOUT)
        exec(t, ns)
        passed += 1
    except BaseException as e:
        failures.append(f"{t}: {type(e).__name__}")
    finally:
        signal.alarm(0)
report(passed, failures=failures[:5])
"#;

impl Code {
    /// Loads the dataset; every problem with the config or the file is reported.
    pub fn new(cfg: CodeConfig) -> Result<Self, Vec<Invalid>> {
        let (rows, mut errs) =
            crate::dataset::rows::<Row>(cfg.dataset.as_deref(), include_str!("../fixtures/code.jsonl"));
        let mut all = Vec::new();
        for (n, r) in rows {
            if r.tests.is_empty() {
                errs.push(Invalid::new("dataset", format!("line {n}: `tests` is empty")));
                continue;
            }
            all.push(Problem {
                id: r.id.unwrap_or_else(|| format!("code-{n}")),
                env: "code".into(),
                question: format!("{}\n\n{}", r.prompt, r.signature),
                answer: r.solution,
                info: serde_json::json!({"signature": r.signature, "tests": r.tests}),
            });
        }
        if cfg.test_timeout_secs == 0 || cfg.wall_ms == 0 {
            errs.push(Invalid::new(
                if cfg.test_timeout_secs == 0 {
                    "test_timeout_secs"
                } else {
                    "wall_ms"
                },
                "must be positive",
            ));
        }
        let splits = crate::dataset::Splits::checked(all, cfg.eval_every, errs)?;
        let rubric = Rubric::new().with("tests", 1.0, |i| {
            let e = i.exec.ok_or("no sandbox result for this sample")?;
            match e.status.as_str() {
                "ok" | "nonzero_exit" if e.tests_total > 0 => Ok((
                    e.tests_passed as f32 / e.tests_total as f32,
                    format!("{}/{} tests passed", e.tests_passed, e.tests_total),
                )),
                "ok" | "nonzero_exit" => Err(format!(
                    "the harness reported no tests ({})",
                    e.stderr.lines().last().unwrap_or("no output")
                )),
                other => Err(format!(
                    "sandbox {other}: {}",
                    e.stderr.lines().last().unwrap_or_default()
                )),
            }
        });
        Ok(Code { cfg, splits, rubric })
    }
}

/// The code in a completion: the last fenced block (```python or ```), else the whole
/// completion when it defines something.
pub fn extract_code(completion: &str) -> Option<String> {
    let mut last = None;
    let mut rest = completion;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let body_start = after.find('\n').map_or(after.len(), |i| i + 1);
        let Some(end) = after[body_start..].find("```") else {
            break;
        };
        last = Some(after[body_start..body_start + end].to_string());
        rest = &after[body_start + end + 3..];
    }
    last.or_else(|| completion.contains("def ").then(|| completion.to_string()))
        .filter(|c| !c.trim().is_empty())
}

impl Environment for Code {
    fn name(&self) -> &str {
        "code"
    }

    fn sample(&self, split: Split, seed: u64) -> Problem {
        self.splits.sample(split, seed)
    }

    fn split_len(&self, split: Split) -> Option<usize> {
        Some(self.splits.len(split))
    }

    fn prompt(&self, p: &Problem) -> Prompt {
        let mut prompt = Prompt::text(format!(
            "{}\nWrite the complete function in Python, in a ```python code block.\n",
            p.question
        ));
        prompt.system = self.cfg.system_prompt.clone();
        prompt
    }

    fn parse_answer(&self, completion: &str) -> Option<String> {
        extract_code(completion)
    }

    fn reference_completion(&self, p: &Problem) -> Option<String> {
        p.answer.as_ref().map(|s| format!("```python\n{s}```"))
    }

    fn rubric(&self) -> &Rubric {
        &self.rubric
    }

    fn execution(&self, problem: &Problem, completion: &str) -> Option<Execution> {
        let tests = problem.info.get("tests")?;
        let code = extract_code(completion).unwrap_or_default();
        let marker = format!("__streamrl_tests_{:016x}__", rand::rng().random::<u64>());
        Some(Execution {
            files: vec![
                ("solution.py".into(), code),
                ("tests.json".into(), tests.to_string()),
                ("harness.py".into(), HARNESS.into()),
            ],
            argv: vec![
                "python3".into(),
                "harness.py".into(),
                marker.clone(),
                self.cfg.test_timeout_secs.to_string(),
            ],
            wall_ms: Some(self.cfg.wall_ms),
            report_marker: Some(marker),
        })
    }

    fn needs_sandbox(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rubric::{ExecInfo, ScoreInput};

    #[test]
    fn extracts_the_last_code_block() {
        assert_eq!(
            extract_code("x\n```python\ndef f(): return 1\n```\nthen\n```\ndef f(): return 2\n```").unwrap(),
            "def f(): return 2\n"
        );
        assert_eq!(
            extract_code("def g(x):\n    return x").unwrap(),
            "def g(x):\n    return x"
        );
        assert_eq!(extract_code("no code here"), None);
        assert_eq!(extract_code("```python\n```"), None);
        assert_eq!(
            extract_code("```python\ndef open_block(): pass").unwrap(),
            "```python\ndef open_block(): pass",
            "an unclosed fence: the whole text"
        );
    }

    #[test]
    fn execution_reports_and_rubric_reads_them() {
        let env = Code::new(CodeConfig::default()).unwrap();
        let p = env.sample(Split::Train, 0);
        let ex = env.execution(&p, &env.reference_completion(&p).unwrap()).unwrap();
        assert_eq!(ex.files.len(), 3);
        let m = ex.report_marker.clone().unwrap();
        assert_eq!(
            ex.report(&format!("noise\n{m} {{\"passed\": 2, \"total\": 3}}\n")),
            Some((2, 3))
        );
        assert_eq!(
            ex.report(&format!("{m} {{\"passed\": 4, \"total\": 3}}")),
            None,
            "more passed than run"
        );
        assert_eq!(
            ex.report("__streamrl_tests_0000000000000000__ {\"passed\": 3, \"total\": 3}"),
            None,
            "another marker"
        );
        let score = |exec: &ExecInfo| {
            env.rubric().score(&ScoreInput {
                problem: &p,
                completion: "",
                parsed: None,
                exec: Some(exec),
            })
        };
        let s = score(&ExecInfo {
            status: "ok".into(),
            tests_passed: 2,
            tests_total: 4,
            ..Default::default()
        });
        assert_eq!((s.reward, s.components[0].reason.as_str()), (0.5, "2/4 tests passed"));
        let s = score(&ExecInfo {
            status: "timeout".into(),
            stderr: "wall-clock limit".into(),
            ..Default::default()
        });
        assert_eq!(s.reward, 0.0);
        assert!(s.components[0].reason.contains("sandbox timeout"), "{:?}", s.components);
        let s = env.rubric().score(&ScoreInput {
            problem: &p,
            completion: "",
            parsed: None,
            exec: None,
        });
        assert!(s.components[0].reason.contains("no sandbox result"));
    }

    #[test]
    fn bad_datasets_are_reported() {
        let errs = crate::dataset::parse_jsonl(
            "{\"prompt\": \"p\", \"signature\": \"def f():\", \"tests\": []}\n{\"prompt\": 1}\n",
        )
        .and_then(crate::dataset::typed::<Row>)
        .unwrap_err();
        assert!(errs[0].contains("line 2"), "{errs:?}");
        let dir = std::env::temp_dir().join(format!("streamrl-code-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("d.jsonl");
        std::fs::write(&f, "{\"prompt\": \"p\", \"signature\": \"def f():\", \"tests\": []}\n").unwrap();
        let errs = Code::new(CodeConfig {
            dataset: Some(f.display().to_string()),
            eval_every: 1,
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            errs.iter().any(|e| e.to_string().contains("`tests` is empty"))
                && errs.iter().any(|e| e.to_string().contains("eval_every: 1")),
            "{errs:?}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

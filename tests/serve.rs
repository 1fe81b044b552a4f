//! `streamrl serve` speaks the OpenAI API: the official `openai` Python client chats with
//! it (plain, n > 1 with logprobs, streaming, concurrent requests), and bad requests get
//! 4xx answers with OpenAI-style error bodies.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const CLIENT: &str = r#"
import json, sys, urllib.request, urllib.error
from concurrent.futures import ThreadPoolExecutor
from openai import OpenAI, BadRequestError, NotFoundError

port = sys.argv[1]
c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

assert [m.id for m in c.models.list().data] == ["tiny"]

r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "12+7="}],
                              max_tokens=8, temperature=0, logprobs=True, n=2, seed=1)
assert len(r.choices) == 2, r
greedy = r.choices[0].message.content
assert r.choices[1].message.content == greedy, "greedy choices differ"
assert r.usage.prompt_tokens == 5, r.usage
assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices), r.usage
assert all(t.logprob <= 0 for t in r.choices[0].logprobs.content)
assert r.choices[0].finish_reason in ("stop", "length")

comp = c.completions.create(model="tiny", prompt="12+7=", max_tokens=5, temperature=0, logprobs=1)
text = comp.choices[0].text
assert greedy.startswith(text) or text.startswith(greedy), (greedy, text)
assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens

chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "12+7="}],
                                        max_tokens=8, temperature=0, stream=True))
streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert streamed == greedy, (streamed, greedy)
assert chunks[-1].choices[0].finish_reason in ("stop", "length")

def one(i):
    return c.completions.create(model="tiny", prompt=f"{i}+{i}=", max_tokens=6, temperature=1.0, seed=i).choices[0].text
with ThreadPoolExecutor(8) as pool:
    assert len(list(pool.map(one, range(16)))) == 16

for kwargs, param in [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "user", "content": "1+1="}], temperature=5), "temperature"),
    (dict(messages=[{"role": "user", "content": "1+1="}], max_tokens=100000), "max_tokens"),
    (dict(messages=[{"role": "user", "content": "1+1="}], n=0), "n"),
]:
    try:
        c.chat.completions.create(model="tiny", **kwargs)
        raise SystemExit(f"accepted a bad request: {kwargs}")
    except BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == param and e.body["type"] == "invalid_request_error", e.body
try:
    c.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "1+1="}])
    raise SystemExit("accepted an unknown model")
except NotFoundError as e:
    assert "gpt-9" in e.message, e.message

req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b"{not json",
                             headers={"Content-Type": "application/json"})
try:
    urllib.request.urlopen(req)
    raise SystemExit("accepted invalid JSON")
except urllib.error.HTTPError as e:
    body = json.loads(e.read())
    assert e.code == 400 and "not valid JSON" in body["error"]["message"], body
print("client ok")
"#;

#[test]
fn the_openai_client_chats_with_serve_and_bad_requests_get_openai_errors() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny");
    let bin = env!("CARGO_BIN_EXE_streamrl");
    let ok = Command::new(bin)
        .args(["model", "init", "--preset", "tiny", "--out"])
        .arg(&ckpt)
        .status()
        .unwrap();
    assert!(ok.success());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _server = Server(
        Command::new(bin)
            .args([
                "serve",
                "--served-model-name",
                "tiny",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--checkpoint",
            ])
            .arg(&ckpt)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "serve did not listen within 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (python, path) = common::python_with(&["openai==3.57.0"]);
    let mut cmd = Command::new(python);
    cmd.arg("-c").arg(CLIENT).arg(port.to_string());
    if let Some(p) = path {
        cmd.env("PYTHONPATH", p);
    }
    let out = cmd.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("client ok"),
        "{stdout}\n{stderr}"
    );
}

/// The rollout stage with `engine: openai://` against `streamrl serve`: the same tokens
/// and logprobs as the in-process engine for the same seeds, and new policy versions
/// pushed to the server between steps (a bad checksum keeps the old weights).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rollout_stage_drives_serve_as_a_remote_engine_with_weight_updates() {
    use std::sync::Arc;
    use streamrl_runtime::{Emitter, Input, Stage};
    use streamrl_schemas::{PolicyRow, PromptRow, RolloutRow, SchemaId, TopicRow};
    use streamrl_stages::rollout::{RolloutConfig, RolloutStage};

    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_streamrl");
    let (v0, v1) = (dir.path().join("v0"), dir.path().join("v1"));
    for (d, seed) in [(&v0, "0"), (&v1, "1")] {
        let ok = Command::new(bin)
            .args(["model", "init", "--preset", "tiny", "--seed", seed, "--out"])
            .arg(d)
            .status()
            .unwrap();
        assert!(ok.success());
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _server = Server(
        Command::new(bin)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--checkpoint"])
            .arg(&v0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "serve did not listen within 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let envs = streamrl_stages::build_envs(&serde_yaml::from_str("arith: {}").unwrap())
        .unwrap()
        .map(Arc::new);
    let ctx = streamrl_stages::Ctx {
        run_id: "t".into(),
        run_dir: dir.path().into(),
        stage: "rollout".into(),
        replica: 0,
        inputs: vec![("prompts".into(), SchemaId::Prompts)],
        outputs: vec![("rollouts".into(), SchemaId::Rollouts)],
        envs,
        durable_bus: false,
        bus: None,
    };
    let local = RolloutConfig {
        checkpoint: v0.clone(),
        max_inflight_groups: 1,
        ..Default::default()
    };
    let remote = RolloutConfig {
        engine: format!("openai://127.0.0.1:{port}"),
        ..local.clone()
    };
    let tok = streamrl_model::Tokenizer::char_level();
    let prompt = |group: &str| PromptRow {
        run_id: "t".into(),
        problem_id: "p".into(),
        group_id: group.into(),
        env: "arith".into(),
        step: 0,
        group_size: 4,
        prompt: "12+30=".into(),
        prompt_token_ids: tok.encode("12+30=").unwrap(),
        answer: Some("42".into()),
        info: None,
        temperature: 1.0,
        max_tokens: 10,
        created_at: 0,
    };
    async fn generate(stage: &mut RolloutStage, p: PromptRow) -> Vec<RolloutRow> {
        let mut out = Emitter::default();
        stage
            .process(
                Input::new("prompts", SchemaId::Prompts, PromptRow::to_batch(&[p]).unwrap()),
                &mut out,
            )
            .await
            .unwrap();
        for _ in 0..200 {
            if !out.released().is_empty() {
                break;
            }
            stage.tick(&mut out).await.unwrap();
        }
        let mut rows: Vec<RolloutRow> = out
            .drain()
            .into_iter()
            .flat_map(|(_, b)| RolloutRow::from_batch(&b).unwrap())
            .collect();
        rows.sort_by_key(|r| r.sample_index);
        rows
    }
    let mut l = RolloutStage::build(local, ctx.clone()).unwrap();
    let mut r = RolloutStage::build(remote, ctx).unwrap();
    let (a, b) = (
        generate(&mut l, prompt("g1")).await,
        generate(&mut r, prompt("g1")).await,
    );
    assert_eq!(b.len(), 4);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            (&x.completion_token_ids, &x.completion, &x.finish_reason),
            (&y.completion_token_ids, &y.completion, &y.finish_reason)
        );
        assert!(
            x.completion_logprobs
                .iter()
                .zip(&y.completion_logprobs)
                .all(|(p, q)| (p - q).abs() < 1e-5)
        );
        assert!(y.completion_versions.iter().all(|v| *v == 0));
    }
    // Weight updates go to the server; a wrong checksum is refused there.
    let sha1 = streamrl_model::checkpoint::weights_sha256(&v1).unwrap();
    let policy = |sha: String| PolicyRow {
        run_id: "t".into(),
        version: 1,
        step: 1,
        uri: format!("file://{}", v1.display()),
        sha256: sha,
        created_at: 0,
    };
    let mut out = Emitter::default();
    let load = |row: PolicyRow| Input::new("policy", SchemaId::Policy, PolicyRow::to_batch(&[row]).unwrap());
    r.process(load(policy("0".repeat(64))), &mut out).await.unwrap();
    assert_eq!(r.version(), 0, "a bad checksum keeps the old weights");
    r.process(load(policy(sha1)), &mut out).await.unwrap();
    assert_eq!(r.version(), 1);
    let c = generate(&mut r, prompt("g2")).await;
    assert!(
        c.iter().all(|x| x.completion_versions.iter().all(|v| *v == 1)),
        "tokens come from version 1"
    );
}

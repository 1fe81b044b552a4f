//! `streamrl serve` speaks the OpenAI API: the official `openai` Python client chats with
//! it (plain, n > 1 with logprobs, streaming, concurrent requests), and bad requests get
//! 4xx answers with OpenAI-style error bodies.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

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
# A final end-of-sequence token counts as generated but is not in the logprobs.
assert r.usage.completion_tokens >= sum(len(ch.logprobs.content) for ch in r.choices), r.usage
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

/// `streamrl model init --preset tiny` into `dir`.
fn init_tiny(dir: &Path, seed: &str) {
    let ok = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["model", "init", "--preset", "tiny", "--seed", seed, "--out"])
        .arg(dir)
        .status()
        .unwrap();
    assert!(ok.success());
}

/// `streamrl serve` on a free port with `args` and `envs`, once it listens.
fn start_serve(ckpt: &Path, args: &[&str], envs: &[(&str, &str)]) -> (common::Server, u16) {
    let port = common::free_port();
    let server = common::Server(
        Command::new(env!("CARGO_BIN_EXE_streamrl"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--checkpoint"])
            .arg(ckpt)
            .args(args)
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    common::wait_listening(port, "serve", Duration::from_secs(30));
    (server, port)
}

/// Runs a Python `script` with the official `openai` client; it must print `client ok`.
fn run_client(script: &str, args: &[String]) {
    let (python, path) = common::python_with(&["openai==3.57.0"]);
    let mut cmd = Command::new(python);
    cmd.arg("-c").arg(script).args(args);
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

#[test]
fn the_openai_client_chats_with_serve_and_bad_requests_get_openai_errors() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny");
    init_tiny(&ckpt, "0");
    let (_server, port) = start_serve(&ckpt, &["--served-model-name", "tiny"], &[]);
    run_client(CLIENT, &[port.to_string()]);
}

/// What the OpenAI API promises and a first version of `serve` broke: streaming never
/// shows the end-of-sequence token and carries logprobs and a usage chunk; logprobs have
/// alternatives and leave out the stop token the text leaves out; `echo` returns the
/// prompt with its logprobs; mistyped fields and overflowing numbers are 400s naming the
/// field; an API key guards every route, weight loading included.
const CLIENT2: &str = r#"
import json, sys, urllib.request, urllib.error
from openai import OpenAI, BadRequestError, AuthenticationError

port, key = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}/v1"
c = OpenAI(base_url=base, api_key=key, max_retries=0)
ctx = c.models.list().data[0].model_extra["max_model_len"]

# --- the API key guards every route but /health
for wrong in ["nope", ""]:
    bad = OpenAI(base_url=base, api_key=wrong or "x", max_retries=0,
                 default_headers={} if wrong else {"Authorization": ""})
    for call in [lambda: bad.models.list(),
                 lambda: bad.completions.create(model="tiny", prompt="1+1=", max_tokens=2),
                 lambda: bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1"}])]:
        try:
            call()
            raise SystemExit(f"accepted API key {wrong!r}")
        except AuthenticationError as e:
            assert e.status_code == 401 and e.body["code"] == "invalid_api_key", e.body
def raw(path, body, auth):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **({"Authorization": auth} if auth else {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
code, body = raw("/load_weights", {"path": "/nonexistent", "version": 1}, None)
assert code == 401 and body["error"]["code"] == "invalid_api_key", (code, body)
code, body = raw("/load_weights", {"path": "/nonexistent", "version": 1}, "Bearer wrong")
assert code == 401, (code, body)
# RFC 6750: the scheme is case-insensitive; with the key the load is tried (and fails: no such dir).
code, body = raw("/load_weights", {"path": "/nonexistent", "version": 1}, f"bearer {key}")
assert code == 400 and "old ones keep serving" in body["error"]["message"], (code, body)
code, body = raw("/completions", {"prompt": "1+1=", "max_tokens": 1}, f"BEARER {key}")
assert code == 200, (code, body)
with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as r:
    assert r.status == 200

# --- a request that ends in end-of-sequence: find a seed whose sample stops on its own
prompt = "12+7="
found = None
for seed in range(60):
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=ctx - 8, temperature=1.5, seed=seed, logprobs=2)
    if r.choices[0].finish_reason == "stop":
        found = (seed, r)
        break
assert found, "no seed ended in end-of-sequence"
seed, r = found
ch = r.choices[0]
assert "<eos>" not in ch.text and "</s>" not in ch.text, ch.text
# The stop token is in the usage but neither in the text nor in the logprobs.
assert "".join(ch.logprobs.tokens) == ch.text, (ch.logprobs.tokens, ch.text)
assert r.usage.completion_tokens == len(ch.logprobs.tokens) + 1, (r.usage, len(ch.logprobs.tokens))
assert all(ch.logprobs.tokens[i] in d for i, d in enumerate(ch.logprobs.top_logprobs)), \
    "the sampled token is among the alternatives"
assert all(len(d) >= 2 for d in ch.logprobs.top_logprobs)
# With token ids (the rollout stage's mode) the stop token stays: it is trained on.
r2 = c.completions.create(model="tiny", prompt=prompt, max_tokens=ctx - 8, temperature=1.5, seed=seed, logprobs=1,
                          extra_body={"return_tokens_as_token_ids": True})
assert len(r2.choices[0].logprobs.tokens) == r.usage.completion_tokens
assert r2.choices[0].logprobs.token_logprobs[:-1] == ch.logprobs.token_logprobs

# --- streaming: same text, no end-of-sequence text, logprobs in the chunks, a usage chunk
chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=ctx - 8, temperature=1.5, seed=seed,
                                   logprobs=2, stream=True, stream_options={"include_usage": True}))
text = "".join(k.choices[0].text for k in chunks if k.choices)
assert text == ch.text, (text, ch.text)
toks = [t for k in chunks if k.choices and k.choices[0].logprobs for t in k.choices[0].logprobs.tokens]
lps = [t for k in chunks if k.choices and k.choices[0].logprobs for t in k.choices[0].logprobs.token_logprobs]
assert toks == ch.logprobs.tokens and lps == ch.logprobs.token_logprobs, (toks, ch.logprobs.tokens)
offs = [t for k in chunks if k.choices and k.choices[0].logprobs for t in k.choices[0].logprobs.text_offset]
assert offs == ch.logprobs.text_offset
assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens, chunks[-1]
assert all(k.usage is None for k in chunks[:-1])
assert [k.choices[0].finish_reason for k in chunks if k.choices][-1] == "stop"

# Chat streaming carries logprobs with alternatives and ends with usage too.
msgs = [{"role": "user", "content": "12+7="}]
full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                 logprobs=True, top_logprobs=3)
entries = full.choices[0].logprobs.content
assert "".join(e.token for e in entries) == full.choices[0].message.content
for e in entries:
    assert len(e.top_logprobs) == 3, e
    tops = [t.logprob for t in e.top_logprobs]
    assert tops == sorted(tops, reverse=True)
    assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6
    assert bytes(e.bytes).decode() == e.token
chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                        top_logprobs=3, stream=True, stream_options={"include_usage": True}))
sent = [e for k in chunks if k.choices and k.choices[0].logprobs for e in k.choices[0].logprobs.content]
assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in sent] ==        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in entries]
assert "".join(k.choices[0].delta.content or "" for k in chunks if k.choices) == full.choices[0].message.content
assert chunks[-1].usage.total_tokens == full.usage.total_tokens

# --- echo: the prompt comes back first, with its logprobs (the first token has none)
e = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=1.0, seed=3, logprobs=1, echo=True)
ech = e.choices[0]
assert ech.text.startswith(prompt), ech.text
assert ech.logprobs.token_logprobs[0] is None and ech.logprobs.top_logprobs[0] is None
assert "".join(ech.logprobs.tokens[:len(prompt)]) == prompt
assert all(x <= 0 for x in ech.logprobs.token_logprobs[1:])
# Scoring prompt + completion (max_tokens 0) gives the completion's sampled logprobs.
gen = ech.text[len(prompt):]
sc = c.completions.create(model="tiny", prompt=ech.text, max_tokens=0, echo=True, logprobs=0)
assert sc.choices[0].text == ech.text and sc.usage.completion_tokens == 0
got = sc.choices[0].logprobs.token_logprobs[len(prompt):]
want = ech.logprobs.token_logprobs[len(prompt):len(prompt) + len(gen)]
assert len(got) == len(want) and all(abs(a - b) < 1e-4 for a, b in zip(got, want)), (got, want)
es = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=1.0, seed=3, echo=True, stream=True))
assert "".join(k.choices[0].text for k in es) == ech.text

# --- mistyped and overflowing fields are 400s that name the field
ok_msgs = dict(messages=msgs)
for kwargs, param in [
    (dict(model=123, **ok_msgs), "model"),
    (dict(model="tiny", extra_body={"stream": "yes"}, **ok_msgs), "stream"),
    (dict(model="tiny", extra_body={"logprobs": "yes"}, **ok_msgs), "logprobs"),
    (dict(model="tiny", logprobs=True, top_logprobs=-1, **ok_msgs), "top_logprobs"),
    (dict(model="tiny", logprobs=True, top_logprobs=21, **ok_msgs), "top_logprobs"),
    (dict(model="tiny", max_tokens=1e300, **ok_msgs), "max_tokens"),
    (dict(model="tiny", max_tokens=2**64, **ok_msgs), "max_tokens"),
    (dict(model="tiny", max_tokens=2**64 - 1, **ok_msgs), "max_tokens"),
    (dict(model="tiny", presence_penalty=1.0, **ok_msgs), "presence_penalty"),
    (dict(model="tiny", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
]:
    try:
        c.chat.completions.create(**kwargs)
        raise SystemExit(f"accepted {kwargs}")
    except BadRequestError as err:
        assert err.status_code == 400 and err.body["param"] == param, (kwargs, err.body)
for kwargs, param in [
    (dict(prompt=[1, 2**32 + 5]), "prompt"),
    (dict(prompt=[1, 100000]), "prompt"),
    (dict(prompt="1+1=", logprobs=21), "logprobs"),
    (dict(prompt="1+1=", max_tokens=0), "max_tokens"),
]:
    try:
        c.completions.create(model="tiny", **kwargs)
        raise SystemExit(f"accepted {kwargs}")
    except BadRequestError as err:
        assert err.status_code == 400 and err.body["param"] == param, (kwargs, err.body)
print("client ok")
"#;

#[test]
fn serve_streams_logprobs_and_usage_echoes_prompts_and_refuses_mistyped_fields_and_wrong_keys() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny");
    init_tiny(&ckpt, "0");
    let (_server, port) = start_serve(
        &ckpt,
        &["--served-model-name", "tiny"],
        &[("STREAMRL_API_KEY", "sk-test-1234")],
    );
    run_client(CLIENT2, &[port.to_string(), "sk-test-1234".into()]);
}

/// The rollout stage with `engine: openai://` against `streamrl serve`: the same tokens
/// and logprobs as the in-process engine for the same seeds, and new policy versions
/// pushed to the server between steps (a bad checksum keeps the old weights).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rollout_stage_drives_serve_as_a_remote_engine_with_weight_updates() {
    use streamrl_runtime::build::{BuildContext, BuildStage};
    use streamrl_runtime::{Emitter, Input, Stage};
    use streamrl_schemas::{PolicyRow, PromptRow, RolloutRow, SchemaId, TopicRow};
    use streamrl_stages::rollout::{EngineChoice, OpenAiEngine, RolloutConfig, RolloutStage};

    let dir = tempfile::tempdir().unwrap();
    let (v0, v1) = (dir.path().join("v0"), dir.path().join("v1"));
    init_tiny(&v0, "0");
    init_tiny(&v1, "1");
    // The server wants a key; the stage reads it from the variable its config names.
    let (_server, port) = start_serve(&v0, &["--api-key", "sk-stage-key"], &[]);
    // SAFETY: no other thread of this test binary reads or writes this variable, and
    // std's own environment lock orders it with the other test's process spawns.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("STREAMRL_TEST_REMOTE_KEY", "sk-stage-key")
    };
    let ctx = BuildContext {
        run_id: "t".into(),
        run_dir: dir.path().into(),
        inputs: vec![("prompts".into(), SchemaId::Prompts)],
        outputs: vec![("rollouts".into(), SchemaId::Rollouts)],
        envs: serde_yaml::from_str("arith: {}").unwrap(),
        ..BuildContext::new("rollout", 0)
    };
    let local = RolloutConfig {
        checkpoint: v0.clone(),
        max_inflight_groups: 1,
        ..Default::default()
    };
    let remote = RolloutConfig {
        engine: EngineChoice::Openai(OpenAiEngine {
            api_key_env: Some("STREAMRL_TEST_REMOTE_KEY".into()),
            ..OpenAiEngine::at(format!("openai://127.0.0.1:{port}"))
        }),
        ..local.clone()
    };
    let unset = RolloutConfig {
        engine: EngineChoice::Openai(OpenAiEngine {
            api_key_env: Some("STREAMRL_TEST_UNSET_KEY".into()),
            ..OpenAiEngine::at(format!("openai://127.0.0.1:{port}"))
        }),
        ..remote.clone()
    };
    let err = RolloutStage::build(unset, &ctx).err().unwrap().to_string();
    assert!(err.contains("STREAMRL_TEST_UNSET_KEY"), "{err}");
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
    let mut l = RolloutStage::build(local, &ctx).unwrap();
    let mut r = RolloutStage::build(remote, &ctx).unwrap();
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
    // A version served over HTTP by a trainer (no shared disk): the stage sends the URL,
    // the server downloads, checks and swaps it in.
    let ckpts = streamrl_stages::weights::CheckpointServer::start(
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        dir.path().join("no-store"),
        v0.clone(),
    )
    .unwrap();
    let sha0 = streamrl_model::checkpoint::weights_sha256(&v0).unwrap();
    let over_http = PolicyRow {
        version: 2,
        step: 2,
        uri: format!("{}/checkpoints/0", ckpts.base_url()),
        ..policy(sha0)
    };
    r.process(load(over_http), &mut out).await.unwrap();
    assert_eq!(r.version(), 2, "the HTTP version was loaded");
    let d = generate(&mut r, prompt("g1")).await;
    assert!(d.iter().all(|x| x.completion_versions.iter().all(|v| *v == 2)));
    // Version 0's weights again: the same tokens as the first generation of g1.
    for (x, y) in a.iter().zip(&d) {
        assert_eq!(x.completion_token_ids, y.completion_token_ids);
    }
}

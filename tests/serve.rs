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

//! `streamrl sandbox serve`: one-shot execs and sessions (exec, upload, download,
//! delete) over HTTP with bearer-token auth; requests without the token get 401 and
//! malformed ones a 4xx with the reason.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

const TOKEN: &str = "test-token-0123456789abcdef";

/// One HTTP/1.1 exchange with a bearer token: (status, body).
fn http(port: u16, method: &str, path: &str, token: Option<&str>, body: &[u8]) -> (u16, Vec<u8>) {
    http_auth(
        port,
        method,
        path,
        token.map(|t| format!("Bearer {t}")).as_deref(),
        body,
    )
}

/// Like [`http`], with the whole `Authorization` value (sent through reqwest).
fn http_auth(port: u16, method: &str, path: &str, authorization: Option<&str>, body: &[u8]) -> (u16, Vec<u8>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut req = reqwest::Client::new()
            .request(method, format!("http://127.0.0.1:{port}{path}"))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_vec());
        if let Some(a) = authorization {
            req = req.header(reqwest::header::AUTHORIZATION, a);
        }
        let resp = req.send().await.unwrap_or_else(|e| panic!("{path}: {e}"));
        let status = resp.status().as_u16();
        (status, resp.bytes().await.unwrap().to_vec())
    })
}

fn json_of(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)))
}

#[test]
fn the_gateway_runs_commands_and_sessions_behind_a_token() {
    let port = common::free_port();
    // The streamrl binary alone, as the Dockerfile ships it: it is its own sandbox init
    // (no `streamrl-sandbox-init` beside it, none named by the environment).
    let alone = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("alone-{}", std::process::id()));
    std::fs::create_dir_all(&alone).unwrap();
    let bin = alone.join("streamrl");
    let _ = std::fs::remove_file(&bin);
    std::fs::hard_link(env!("CARGO_BIN_EXE_streamrl"), &bin)
        .or_else(|_| std::fs::copy(env!("CARGO_BIN_EXE_streamrl"), &bin).map(|_| ()))
        .unwrap();
    let _server = common::Server(
        Command::new(&bin)
            .args([
                "sandbox",
                "serve",
                "--pool-size",
                "2",
                "--max-body-bytes",
                "1048576",
                "--listen",
                &format!("127.0.0.1:{port}"),
            ])
            .env("STREAMRL_SANDBOX_TOKEN", TOKEN)
            .env_remove("STREAMRL_SANDBOX_INIT")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    common::wait_listening(port, "the gateway", Duration::from_secs(30));
    let t = Some(TOKEN);

    // Auth.
    let exec = json!({"argv": ["python3", "-c", "print(6*7)"]}).to_string();
    let (st, body) = http(port, "POST", "/v1/exec", None, exec.as_bytes());
    assert_eq!(st, 401, "{}", String::from_utf8_lossy(&body));
    assert!(json_of(&body)["error"]["message"].as_str().unwrap().contains("Bearer"));
    let (st, _) = http(
        port,
        "POST",
        "/v1/exec",
        Some("wrong-token-wrong-token"),
        exec.as_bytes(),
    );
    assert_eq!(st, 401);
    // The scheme is case-insensitive (RFC 6750).
    for scheme in ["bearer", "BEARER"] {
        let (st, body) = http_auth(
            port,
            "POST",
            "/v1/exec",
            Some(&format!("{scheme} {TOKEN}")),
            exec.as_bytes(),
        );
        assert_eq!(st, 200, "{scheme}: {}", String::from_utf8_lossy(&body));
    }
    // Every error is JSON with a fitting status: too large, wrong method, refused paths.
    let big = vec![b' '; (1 << 20) + 1];
    let (st, body) = http(port, "POST", "/v1/exec", t, &big);
    assert_eq!(st, 413);
    assert_eq!(json_of(&body)["error"]["type"], "payload_too_large");
    let (st, body) = http(port, "DELETE", "/v1/exec", t, b"");
    assert_eq!(st, 405);
    assert!(json_of(&body)["error"]["message"].is_string());
    for path in ["/workshop/x.py", "/etc/cron.d/x", "../x"] {
        let req = json!({"argv": ["true"], "files": {path: "x"}}).to_string();
        let (st, body) = http(port, "POST", "/v1/exec", t, req.as_bytes());
        assert_eq!(st, 400, "{path}: {}", String::from_utf8_lossy(&body));
        assert!(json_of(&body)["error"]["message"].as_str().unwrap().contains("files"));
    }
    let (st, body) = http(port, "GET", "/health", None, b"");
    assert_eq!((st, json_of(&body)["status"].as_str()), (200, Some("ok")));

    // One-shot exec, with files and stdin.
    let (st, body) = http(port, "POST", "/v1/exec", t, exec.as_bytes());
    assert_eq!(st, 200);
    let r = json_of(&body);
    assert_eq!(
        (r["status"].as_str(), r["stdout"].as_str()),
        (Some("ok"), Some("42\n")),
        "{r}"
    );
    let with_files = json!({
        "argv": ["python3", "main.py"],
        "files": {"main.py": "import sys; print(sys.stdin.read()[::-1])"},
        "stdin": "olleh",
        "limits": {"wall_ms": 2000},
    });
    let r = json_of(&http(port, "POST", "/v1/exec", t, with_files.to_string().as_bytes()).1);
    assert_eq!(r["stdout"].as_str(), Some("hello\n"), "{r}");
    let slow = json!({"argv": ["sleep", "10"], "limits": {"wall_ms": 300}});
    let r = json_of(&http(port, "POST", "/v1/exec", t, slow.to_string().as_bytes()).1);
    assert_eq!(r["status"].as_str(), Some("timeout"), "{r}");

    // Malformed requests: 4xx with the reason.
    for (body, needle) in [
        ("{not json".to_string(), "not a valid exec request"),
        (json!({"argv": []}).to_string(), "argv must name a program"),
        (
            json!({"argv": ["true"], "bogus": 1}).to_string(),
            "unknown field `bogus`",
        ),
        (
            json!({"argv": ["true"], "limits": {"wall_ms": 999999999}}).to_string(),
            "limits.wall_ms = 999999999 exceeds the maximum 10000",
        ),
        (
            json!({"argv": ["true"], "limits": {"walltime": 5}}).to_string(),
            "unknown field `walltime`",
        ),
    ] {
        let (st, resp) = http(port, "POST", "/v1/exec", t, body.as_bytes());
        assert_eq!(st, 400, "{body}");
        let msg = json_of(&resp)["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    let (st, _) = http(port, "POST", "/v1/sandboxes/nope/exec", t, exec.as_bytes());
    assert_eq!(st, 404);

    // A session: upload, run, download, list, delete.
    let (st, body) = http(port, "POST", "/v1/sandboxes", t, b"");
    assert_eq!(st, 201);
    let id = json_of(&body)["id"].as_str().unwrap().to_string();
    let (st, _) = http(
        port,
        "PUT",
        &format!("/v1/sandboxes/{id}/files/src/sq.py"),
        t,
        b"print(open('in.txt').read() * 2)",
    );
    assert_eq!(st, 204);
    let (st, _) = http(port, "PUT", &format!("/v1/sandboxes/{id}/files/in.txt"), t, b"ab");
    assert_eq!(st, 204);
    let run = json!({"argv": ["bash", "-c", "python3 src/sq.py > out.txt"]}).to_string();
    let r = json_of(&http(port, "POST", &format!("/v1/sandboxes/{id}/exec"), t, run.as_bytes()).1);
    assert_eq!(r["status"].as_str(), Some("ok"), "{r}");
    let (st, body) = http(port, "GET", &format!("/v1/sandboxes/{id}/files/out.txt"), t, b"");
    assert_eq!((st, body.as_slice()), (200, b"abab\n".as_slice()));
    let (st, body) = http(port, "GET", &format!("/v1/sandboxes/{id}/files/../etc/passwd"), t, b"");
    assert!((400..500).contains(&st), "{st} {}", String::from_utf8_lossy(&body));
    let list = json_of(&http(port, "GET", "/v1/sandboxes", t, b"").1);
    assert_eq!(list["sandboxes"][0]["id"].as_str(), Some(id.as_str()));
    let (st, _) = http(port, "DELETE", &format!("/v1/sandboxes/{id}"), t, b"");
    assert_eq!(st, 204);
    let (st, _) = http(port, "POST", &format!("/v1/sandboxes/{id}/exec"), t, run.as_bytes());
    assert_eq!(st, 404);
}

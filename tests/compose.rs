//! compose.yaml: checked against topology.yaml (a healthy-checked broker, one service per
//! stage with the topology's replicas, HTTP weights, no disk shared between stages), then
//! run for real with `docker-compose` on images built here (tests/compose.test.yaml swaps
//! them in): up, progress, `--scale rollout=2` while it runs, the end of the run, down.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_yaml::Value;
use streamrl_runtime::topology::Topology;

#[test]
fn compose_matches_the_topology() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut compose: Value =
        serde_yaml::from_str(&std::fs::read_to_string(root.join("compose.yaml")).unwrap()).unwrap();
    compose.apply_merge().unwrap(); // `<<: *stage`, as docker compose resolves it
    let topo = Topology::load(&root.join("topology.yaml"), &|_, _| vec![]).unwrap();
    let services = compose["services"].as_mapping().expect("services");

    let broker = &compose["services"]["broker"];
    assert!(
        broker["healthcheck"]["test"]
            .as_sequence()
            .is_some_and(|t| !t.is_empty()),
        "broker healthcheck"
    );
    let env = &broker["environment"];
    assert!(
        env["KAFKA_PROCESS_ROLES"].as_str().unwrap().contains("controller"),
        "KRaft mode"
    );
    assert!(
        env["KAFKA_MESSAGE_MAX_BYTES"].as_u64().unwrap() >= 8 << 20,
        "8 MiB messages"
    );
    for p in broker["ports"].as_sequence().into_iter().flatten() {
        assert!(
            p.as_str().unwrap().starts_with("127.0.0.1:"),
            "published on loopback only: {p:?}"
        );
    }

    let stage_services: Vec<String> = services
        .keys()
        .map(|k| k.as_str().unwrap().to_string())
        .filter(|k| k != "broker" && k != "sft")
        .collect();
    let mut stages: Vec<String> = topo.stages.keys().cloned().collect();
    let mut got = stage_services.clone();
    stages.sort();
    got.sort();
    assert_eq!(got, stages, "one service per stage");
    for (name, decl) in &topo.stages {
        let s = &compose["services"][name.as_str()];
        let cmd: Vec<&str> = s["command"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(cmd, ["stage", name.as_str()], "{name} command");
        assert_eq!(
            s["deploy"]["replicas"].as_u64(),
            Some(decl.replicas as u64),
            "{name} replicas"
        );
        assert_eq!(
            s["depends_on"]["broker"]["condition"].as_str(),
            Some("service_healthy"),
            "{name} waits for broker"
        );
        assert_eq!(
            s["depends_on"]["sft"]["condition"].as_str(),
            Some("service_completed_successfully"),
            "{name} waits for the SFT warm start"
        );
        assert_eq!(
            s["environment"]["STREAMRL_BUS"].as_str(),
            Some("kafka://broker:9092"),
            "{name} bus"
        );
    }
    assert_eq!(compose["services"]["sft"]["command"][0].as_str(), Some("sft"));

    // Weights over HTTP: no two stages share a volume (the trainer shares its own with the
    // one-shot SFT job that writes the warm start).
    let mut mounts: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (service, s) in services {
        for v in s["volumes"].as_sequence().into_iter().flatten() {
            let volume = v.as_str().unwrap().split(':').next().unwrap().to_string();
            mounts
                .entry(volume)
                .or_default()
                .push(service.as_str().unwrap().to_string());
        }
    }
    for (volume, users) in &mounts {
        let stages: Vec<&String> = users.iter().filter(|u| *u != "sft").collect();
        assert_eq!(stages.len(), 1, "volume `{volume}` is shared by {users:?}");
    }
    assert_eq!(mounts["trainer"], ["sft", "trainer"]);
    let set = compose["services"]["rollout"]["environment"]["STREAMRL_SET"]
        .as_str()
        .unwrap();
    assert!(
        set.contains("stages.trainer.config.serve_checkpoints=0.0.0.0:8400"),
        "{set}"
    );
    assert!(
        set.contains("stages.rollout.config.checkpoint=http://trainer:8400/checkpoints/0"),
        "{set}"
    );
    for name in ["sft", "source", "trainer", "archive"] {
        assert_eq!(
            compose["services"][name]["environment"]["STREAMRL_SET"].as_str(),
            Some(set),
            "{name} reads the same topology"
        );
    }
    // The overrides make a valid topology (every stage config checked by the binary).
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["validate", "--topology"])
        .arg(root.join("topology.yaml"))
        .env("STREAMRL_SET", set)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // A mistyped override is refused by name.
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["validate", "--topology"])
        .arg(root.join("topology.yaml"))
        .args(["--set", "stages.trainer.config.serve_checkpoints=0.0.0.0:8400"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("set checkpoint_url"), "{err}");
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    assert_eq!(
        dockerfile.lines().filter(|l| l.starts_with("FROM ")).count(),
        2,
        "multi-stage Dockerfile"
    );
}

// ---------------------------------------------------------------------------------------
// `docker compose up` for real.

/// Whether a Docker daemon and docker-compose answer here, or why not.
fn docker_ready() -> Result<(), String> {
    for (bin, arg) in [("docker", "info"), ("docker-compose", "version")] {
        match Command::new(bin).arg(arg).output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                return Err(format!(
                    "`{bin} {arg}` failed: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
            }
            Err(e) => return Err(format!("`{bin} {arg}`: {e}")),
        }
    }
    Ok(())
}

/// The host's Debian release (the binary built here links its glibc).
fn host_codename() -> String {
    std::fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("VERSION_CODENAME=")
                .map(|v| v.trim_matches('"').to_string())
        })
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "bookworm".into())
}

/// A local image of the host's Debian release with python3 (the sandboxes' interpreter)
/// and CA certificates: a root file system made once with debootstrap (fetched with
/// `apt-get download` and run from where it is unpacked), kept as a tarball under the
/// tools dir, and `docker import`ed when the engine lacks the image.
fn base_image() -> String {
    let codename = host_codename();
    let tag = format!("streamrl-base:{codename}");
    if Command::new("docker")
        .args(["image", "inspect", &tag])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return tag;
    }
    let tools = common::tools_dir();
    std::fs::create_dir_all(&tools).unwrap();
    let tar = tools.join(format!("debian-{codename}-rootfs.tar"));
    if !tar.exists() {
        eprintln!("compose: making a Debian {codename} root file system with debootstrap (once, ~2 min)");
        let t0 = Instant::now();
        common::run(
            Command::new("flock")
                .arg(tools.join(".rootfs.lock"))
                .arg("sh")
                .arg("-ec")
                .arg(format!(
                    "test -s '{tar}' && exit 0
                 w='{tools}/debootstrap'; rm -rf \"$w\"; mkdir -p \"$w\"; cd \"$w\"
                 apt-get download debootstrap 2>/dev/null
                 dpkg-deb -x debootstrap_*.deb pkg
                 DEBOOTSTRAP_DIR=\"$w/pkg/usr/share/debootstrap\" pkg/usr/sbin/debootstrap --variant=minbase \
                   --include=python3,ca-certificates,zlib1g {codename} rootfs http://deb.debian.org/debian >log 2>&1 \
                   || {{ tail -20 log; exit 1; }}
                 rm -rf rootfs/var/cache/apt/archives/*.deb rootfs/var/lib/apt/lists/*
                 tar -C rootfs -cf '{tar}.tmp' . && mv '{tar}.tmp' '{tar}'
                 cd / && rm -rf \"$w\"",
                    tar = tar.display(),
                    tools = tools.display(),
                )),
            "debootstrap",
        );
        eprintln!("compose: root file system made in {:.0} s", t0.elapsed().as_secs_f64());
    }
    common::run(
        Command::new("docker").arg("import").arg(&tar).arg(&tag),
        "docker import",
    );
    tag
}

/// `base` plus `files` (host path → absolute path in the image, parents created), with
/// `changes` (Dockerfile instructions such as ENTRYPOINT), committed as `tag`.
fn layered_image(base: &str, tag: &str, files: &[(&Path, &str)], changes: &[&str]) {
    let staging = tempfile::tempdir().unwrap();
    for (src, dest) in files {
        let to = staging.path().join(dest.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(src, &to).unwrap_or_else(|e| panic!("copying {}: {e}", src.display()));
    }
    let id = common::run(
        Command::new("docker").args(["create", base, "/bin/true"]),
        "docker create",
    );
    let id = id.trim();
    for top in std::fs::read_dir(staging.path()).unwrap() {
        let top = top.unwrap().path();
        let name = top.file_name().unwrap().to_string_lossy().into_owned();
        // Copying the directory's contents merges them into the image's `/name`.
        common::run(
            Command::new("docker")
                .arg("cp")
                .arg(format!("{}/.", top.display()))
                .arg(format!("{id}:/{name}")),
            "docker cp",
        );
    }
    let mut commit = Command::new("docker");
    commit.arg("commit");
    for c in changes {
        commit.args(["--change", c]);
    }
    common::run(commit.args([id, tag]), "docker commit");
    common::run(Command::new("docker").args(["rm", id]), "docker rm");
}

/// A compose project of compose.yaml + tests/compose.test.yaml, taken down (volumes
/// included) when dropped; its logs are printed first when the test failed.
struct Project {
    name: String,
    env: Vec<(String, String)>,
}

impl Project {
    fn cmd(&self) -> Command {
        let root = common::root();
        let mut c = Command::new("docker-compose");
        c.current_dir(&root)
            .args(["-p", &self.name, "-f", "compose.yaml", "-f", "tests/compose.test.yaml"])
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    fn run(&self, args: &[&str]) -> String {
        common::run(self.cmd().args(args), &format!("docker-compose {}", args.join(" ")))
    }

    /// Container ids of `service`.
    fn containers(&self, service: &str) -> Vec<String> {
        self.run(&["ps", "-q", service]).lines().map(str::to_string).collect()
    }

    fn logs(&self, container: &str) -> String {
        let out = Command::new("docker").args(["logs", container]).output().unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let out = self.cmd().args(["logs", "--no-color", "--tail", "40"]).output();
            if let Ok(o) = out {
                eprintln!("compose logs:\n{}", String::from_utf8_lossy(&o.stdout));
            }
        }
        let _ = self.cmd().args(["down", "-v", "--remove-orphans", "-t", "20"]).output();
    }
}

/// `(status, exit code)` of a container; a container that was restarted fails the test
/// with its log (nothing is killed here, so a restart means a stage crashed).
fn state(container: &str) -> (String, i64) {
    let s = common::run(
        Command::new("docker").args([
            "inspect",
            "-f",
            "{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}} {{.Name}}",
            container,
        ]),
        "docker inspect",
    );
    let f: Vec<&str> = s.split_whitespace().collect();
    if f[2] != "0" || f[0] == "restarting" {
        let log = Command::new("docker")
            .args(["logs", "--tail", "30", container])
            .output()
            .unwrap();
        panic!(
            "{} crashed and was restarted ({} times):\n{}{}",
            f[3],
            f[2],
            String::from_utf8_lossy(&log.stdout),
            String::from_utf8_lossy(&log.stderr)
        );
    }
    (f[0].to_string(), f[1].parse().unwrap())
}

/// A number from SQL over the archive in `dir`, or `None` while its topic has no file yet.
fn try_number(dir: &Path, sql: &str) -> Option<i64> {
    let out = Command::new(env!("CARGO_BIN_EXE_streamrl"))
        .args(["query", sql, "--format", "csv"])
        .current_dir(dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    out.status
        .success()
        .then(|| text.lines().nth(1)?.parse().ok())
        .flatten()
}

fn number(dir: &Path, sql: &str) -> i64 {
    try_number(dir, sql).unwrap_or_else(|| panic!("{sql}: no number; {:?}", common::query(dir, sql)))
}

/// The partitions a stage replica owns after the newest rebalance of each of its
/// consumers (one per input topic), from its `assigned` / `revoked` log lines, sorted.
fn owned(log: &str) -> (String, usize) {
    // `… INFO assigned consumer=rollout-0/prompts partitions=prompts/0 prompts/2`: the
    // partitions field is the last.
    let mut latest: std::collections::BTreeMap<&str, &str> = Default::default();
    let mut events = 0;
    for l in log.lines() {
        if !(l.contains(" assigned ") || l.contains(" revoked ")) {
            continue;
        }
        let (Some(c), Some(p)) = (l.split("consumer=").nth(1), l.split("partitions=").nth(1)) else {
            continue;
        };
        latest.insert(c.split_whitespace().next().unwrap_or(""), p.trim());
        events += 1;
    }
    let mut all: Vec<&str> = latest.values().flat_map(|p| p.split_whitespace()).collect();
    all.sort();
    (all.join(" "), events)
}

#[test]
fn compose_up_runs_the_pipeline_scales_out_while_running_and_goes_down() {
    if let Err(why) = docker_ready() {
        common::skip::skipped(
            "compose_up_runs_the_pipeline_scales_out_while_running_and_goes_down",
            "docker-compose up, scale and down",
            &format!("no Docker here: {why}"),
        );
        return;
    }
    let t0 = Instant::now();
    let root = common::root();
    let base = base_image();
    let bin = tempfile::tempdir().unwrap();
    let streamrl = bin.path().join("streamrl");
    // The debug build (numeric crates optimised), stripped to 60% of its size.
    common::run(
        Command::new("objcopy")
            .arg("--strip-all")
            .arg(env!("CARGO_BIN_EXE_streamrl"))
            .arg(&streamrl),
        "objcopy --strip-all",
    );
    let fixture = root.join("tests/fixtures/compose/topology.yaml");
    // The topology the services will read: the fixture with compose.yaml's overrides.
    let compose: Value = serde_yaml::from_str(&std::fs::read_to_string(root.join("compose.yaml")).unwrap()).unwrap();
    let set = compose["x-env"]["STREAMRL_SET"]
        .as_str()
        .expect("x-env.STREAMRL_SET")
        .to_string();
    common::run(
        Command::new(env!("CARGO_BIN_EXE_streamrl"))
            .args(["validate", "--topology"])
            .arg(&fixture)
            .env("STREAMRL_SET", &set),
        "validating the test topology with compose.yaml's overrides",
    );
    let suffix = common::unique("t");
    let image = format!("streamrl-test:{suffix}");
    let broker_image = format!("streamrl-test-tansu:{suffix}");
    let _images = ImagesRemoved(vec![image.clone(), broker_image.clone()]);
    layered_image(
        &base,
        &image,
        &[(&streamrl, "/usr/local/bin/streamrl"), (&fixture, "/app/topology.yaml")],
        &["WORKDIR /app", r#"ENTRYPOINT ["streamrl"]"#, r#"CMD ["run"]"#],
    );
    layered_image(
        &base,
        &broker_image,
        &[(&common::tansu_binary(), "/usr/local/bin/tansu")],
        &[r#"ENTRYPOINT ["tansu"]"#],
    );
    let images = t0.elapsed();

    // The host side: the test topology (for `streamrl query`) over the archive's directory.
    let host = tempfile::tempdir().unwrap();
    let archive: PathBuf = host.path().join("runs/demo/archive");
    std::fs::create_dir_all(&archive).unwrap();
    std::fs::copy(&fixture, host.path().join("topology.yaml")).unwrap();
    let port = common::free_port();
    let project = Project {
        name: format!("streamrl{}", suffix.replace('-', "")),
        env: vec![
            ("STREAMRL_IMAGE".into(), image.clone()),
            ("STREAMRL_BROKER_IMAGE".into(), broker_image.clone()),
            ("STREAMRL_COMPOSE_ARCHIVE".into(), archive.display().to_string()),
            ("STREAMRL_KAFKA_PORT".into(), port.to_string()),
        ],
    };

    let t_up = Instant::now();
    project.run(&["up", "-d", "--no-build"]);
    let up = t_up.elapsed();
    let dir = host.path();
    let deadline = Instant::now() + Duration::from_secs(600);
    // Progress: versions published and rows archived.
    while try_number(dir, "SELECT max(version) FROM policy").unwrap_or(0) < 3 {
        assert!(
            Instant::now() < deadline,
            "no policy version 3 archived within 10 minutes"
        );
        for c in ["trainer", "rollout", "archive"]
            .iter()
            .flat_map(|s| project.containers(s))
        {
            state(&c);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let progress = t_up.elapsed();
    let first = project.containers("rollout");
    assert_eq!(first.len(), 1, "one rollout replica to start with");

    // Scale out while it runs: the new replica joins the group and takes partitions. What
    // the first one owns is read before (the newcomer may have joined by the time the
    // scale command returns).
    let (before, _) = owned(&project.logs(&first[0]));
    project.run(&[
        "up",
        "-d",
        "--no-deps",
        "--no-recreate",
        "--scale",
        "rollout=2",
        "rollout",
    ]);
    let both = project.containers("rollout");
    assert_eq!(both.len(), 2, "two rollout replicas after --scale rollout=2: {both:?}");
    let new = both.iter().find(|c| !first.contains(c)).unwrap().clone();
    let scaled_at_version = number(dir, "SELECT max(version) FROM policy");
    // Until the group has rebalanced: the newcomer owns partitions, the first one fewer.
    let (old_parts, new_parts) = loop {
        let (o, _) = owned(&project.logs(&first[0]));
        let (n, _) = owned(&project.logs(&new));
        let count = |p: &str| p.split_whitespace().count();
        if count(&n) > 0 && count(&o) < count(&before) {
            break (o, n);
        }
        assert!(
            Instant::now() < deadline && state(&new).0 == "running",
            "the new rollout replica took no partitions: first [{o}] (was [{before}]), new [{n}]"
        );
        std::thread::sleep(Duration::from_millis(500));
    };

    // The run ends in-band: every stage exits 0 once the last version is out.
    let services = ["source", "rollout", "sandbox", "reward", "mask", "trainer", "archive"];
    let all: Vec<(String, String)> = services
        .iter()
        .flat_map(|s| project.containers(s).into_iter().map(move |c| (s.to_string(), c)))
        .collect();
    loop {
        let states: Vec<(String, (String, i64))> = all.iter().map(|(s, c)| (s.clone(), state(c))).collect();
        if let Some((s, (_, code))) = states.iter().find(|(_, (st, code))| st == "exited" && *code != 0) {
            panic!("{s} exited with {code}");
        }
        if states.iter().all(|(_, (st, _))| st == "exited") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the run did not end within 10 minutes: {states:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let done = t_up.elapsed();

    let generated = |log: &str| -> u64 {
        log.lines()
            .find_map(|l| l.split("generated=").nth(1)?.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let (new_generated, old_generated) = (generated(&project.logs(&new)), generated(&project.logs(&first[0])));
    let max_steps = 400;
    let checks = [
        (
            "target step reached".to_string(),
            number(dir, "SELECT max(version) FROM policy") == max_steps,
        ),
        (
            "each version published once".into(),
            number(dir, "SELECT count(*) FROM policy") == max_steps + 1
                && number(dir, "SELECT count(DISTINCT version) FROM policy") == max_steps + 1,
        ),
        (
            "every version over HTTP from the trainer".into(),
            number(
                dir,
                "SELECT count(*) FROM policy WHERE uri LIKE 'http://trainer:8400/checkpoints/%'",
            ) == max_steps + 1,
        ),
        (
            "no sample trained twice".into(),
            number(
                dir,
                "SELECT count(*) FROM (SELECT sample_id FROM trained WHERE outcome = 'trained' \
                 GROUP BY sample_id HAVING count(DISTINCT version) > 1)",
            ) == 0,
        ),
        (
            "every admitted group trained or dropped with a reason".into(),
            number(
                dir,
                "SELECT count(DISTINCT p.group_id) FROM prompts p LEFT JOIN trained t ON t.group_id = p.group_id \
                 WHERE t.group_id IS NULL",
            ) == 0
                && number(dir, "SELECT count(DISTINCT group_id) FROM prompts") == max_steps * 4,
        ),
        (
            "every trained sample archived".into(),
            number(
                dir,
                "SELECT count(*) FROM trained t LEFT JOIN samples s ON s.sample_id = t.sample_id \
                 AND s.created_at = t.sample_created_at WHERE t.outcome = 'trained' AND s.sample_id IS NULL",
            ) == 0,
        ),
        (
            format!("scaled: the new rollout replica took [{new_parts}], generated {new_generated}"),
            new_generated > 0,
        ),
        (
            format!("scaled: the first kept [{old_parts}] of [{before}], generated {old_generated}"),
            old_generated > 0,
        ),
        (
            "no dead letters".into(),
            !archive.join("dead_letter").exists() || number(dir, "SELECT count(*) FROM dead_letter") == 0,
        ),
    ];
    project.run(&["down", "-v", "-t", "20"]);
    let total = t0.elapsed();
    eprintln!("\ncompose run (scaled rollout to 2 at version {scaled_at_version}):");
    for (name, ok) in &checks {
        eprintln!("  {:<64} {}", name, if *ok { "yes" } else { "NO" });
    }
    eprintln!(
        "  images {:.1} s, up {:.1} s, to version 3 {:.1} s, to the end {:.1} s, total {:.1} s",
        images.as_secs_f64(),
        up.as_secs_f64(),
        progress.as_secs_f64(),
        done.as_secs_f64(),
        total.as_secs_f64()
    );
    assert!(checks.iter().all(|(_, ok)| *ok), "an invariant failed (table above)");
}

/// Local test images, removed when dropped.
struct ImagesRemoved(Vec<String>);

impl Drop for ImagesRemoved {
    fn drop(&mut self) {
        for i in &self.0 {
            let _ = Command::new("docker").args(["rmi", "-f", i]).output();
        }
    }
}

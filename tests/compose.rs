//! compose.yaml against topology.yaml: parses, has a healthy-checked broker, and one
//! service per stage with the topology's replicas, each waiting for a healthy broker.

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
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    assert_eq!(
        dockerfile.lines().filter(|l| l.starts_with("FROM ")).count(),
        2,
        "multi-stage Dockerfile"
    );
}

//! The pipeline verbs: `validate`, `graph`, `run` (every stage in this process), `stage`
//! (one replica, for separate processes) and `topics`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use streamrl_runtime::bus;
use streamrl_runtime::runner::{RunnerConfig, Shutdown, StageMetrics, run_stage};
use streamrl_runtime::running;
use streamrl_runtime::topology::{StageKind, Topology};

use super::{load, load_on, print_metrics};
use crate::{progress, stages};

/// `streamrl validate`.
#[derive(Args)]
pub struct ValidateArgs {
    /// Topology file.
    #[arg(short, long, default_value = "topology.yaml")]
    topology: PathBuf,
}

/// `streamrl graph`.
#[derive(Args)]
pub struct GraphArgs {
    /// Topology file.
    #[arg(short, long, default_value = "topology.yaml")]
    topology: PathBuf,
    /// mermaid or dot.
    #[arg(long, default_value = "mermaid")]
    format: String,
}

/// `streamrl run`.
#[derive(Args)]
pub struct RunArgs {
    /// Topology file.
    #[arg(short, long, default_value = "topology.yaml")]
    topology: PathBuf,
    /// Override the topology's bus URL.
    #[arg(long)]
    bus: Option<String>,
}

/// `streamrl stage`.
#[derive(Args)]
pub struct StageArgs {
    /// Stage name in the topology.
    pub name: String,
    /// Bus URL (overrides the topology's).
    #[arg(long, env = "STREAMRL_BUS")]
    bus: Option<String>,
    /// Replica index.
    #[arg(long, default_value_t = 0, env = "STREAMRL_REPLICA")]
    replica: u32,
    /// Topology file.
    #[arg(short, long, default_value = "topology.yaml", env = "STREAMRL_TOPOLOGY")]
    topology: PathBuf,
    /// Serve the stage's counters and input lag in the Prometheus text format on
    /// `GET /metrics` at this port.
    #[arg(long, env = "STREAMRL_METRICS_PORT")]
    metrics_port: Option<u16>,
    /// Address the metrics endpoint binds (0.0.0.0 in a container).
    #[arg(long, default_value = "127.0.0.1", env = "STREAMRL_METRICS_HOST")]
    metrics_host: String,
}

/// `streamrl topics`.
#[derive(Args)]
pub struct TopicsArgs {
    /// Bus URL (overrides the topology's).
    #[arg(long)]
    bus: Option<String>,
    /// Topology file.
    #[arg(short, long, default_value = "topology.yaml")]
    topology: PathBuf,
}

/// Checks a topology and prints a summary, or every problem with its key path.
pub fn validate(a: ValidateArgs) -> Result<()> {
    let t = load(&a.topology)?;
    println!(
        "{} is valid: bus {}, {} topics, {} stages ({} replicas)",
        a.topology.display(),
        t.bus,
        t.topics.len(),
        t.stages.len(),
        t.stages.values().map(|s| s.replicas).sum::<u32>()
    );
    for w in t.warnings() {
        println!("warning: {w}");
    }
    Ok(())
}

/// Prints the pipeline as a Mermaid or DOT graph.
pub fn graph(a: GraphArgs) -> Result<()> {
    let t = load(&a.topology)?;
    match a.format.as_str() {
        "mermaid" => print!("{}", t.to_mermaid()),
        "dot" => print!("{}", t.to_dot()),
        other => bail!("unknown graph format `{other}` (known: mermaid, dot)"),
    }
    Ok(())
}

/// The SFT warm start when the topology has one and its output is missing, then every
/// stage in this process until the run ends; prints the counters and the summary.
pub async fn run(a: RunArgs) -> Result<()> {
    let t = super::load_and_warm_start(&a.topology, a.bus)?;
    let (summary, metrics) = run_all(t, false).await?;
    print_metrics(&metrics);
    summary.print();
    Ok(())
}

/// One replica of one stage until the run ends (or a signal arrives).
pub async fn stage(a: StageArgs) -> Result<()> {
    let StageArgs {
        name,
        bus,
        replica,
        topology,
        metrics_port,
        metrics_host,
    } = a;
    // Other stage processes share this machine, and their busy cores are not visible from
    // here: a trainer left to the process default keeps its step on one thread.
    streamrl_model::cores::set_process_default(1);
    let t = load_on(&topology, bus)?;
    let decl = t.stages.get(&name).with_context(|| {
        format!(
            "no stage `{name}` in {} (stages: {})",
            topology.display(),
            t.stages.keys().cloned().collect::<Vec<_>>().join(", ")
        )
    })?;
    if replica >= decl.replicas {
        bail!(
            "replica {replica} of `{name}`: the topology declares {} replica(s)",
            decl.replicas
        );
    }
    if matches!(decl.kind, StageKind::Trainer | StageKind::Rollout) {
        // Steps and decoding reuse their freed buffers (see main.rs); the other kinds keep
        // malloc's defaults: with heap trimming off, the archive's compaction
        // passes left ~40 MiB more resident each (`streamrl soak`).
        streamrl_kernels::alloc::retain_freed_memory();
    }
    tracing::info!(stage = %name, replica, "starting");
    let bus = bus::connect(&t.bus).await?;
    running::create_topics(&bus, &t).await?;
    tracing::info!(stage = %name, replica, "topics ready");
    let shutdown = Shutdown::new();
    shutdown.on_signals();
    let metrics = Arc::new(StageMetrics::default());
    let stage = stages::build(&t, &bus, &name, replica)?;
    let cfg = t.runner_config(&name, replica).expect("stage exists");
    if let Some(port) = metrics_port {
        serve_metrics(&metrics_host, port, bus.clone(), cfg.clone(), metrics.clone()).await?;
    }
    run_stage(bus, cfg, stage, shutdown, metrics.clone()).await?;
    print_metrics(&[(format!("{name}-{replica}"), metrics)]);
    Ok(())
}

/// Per topic: partitions, offsets and the lag of every consuming stage.
pub async fn topics(a: TopicsArgs) -> Result<()> {
    let t = load(&a.topology)?;
    let url = a.bus.unwrap_or(t.bus.clone());
    let bus = bus::connect(&url).await?;
    println!(
        "{:<16} {:>4} {:>12} {:>12}  lag by stage",
        "topic", "part", "start", "end"
    );
    let existing = bus.topics().await?;
    for name in t.topics.keys() {
        if !existing.contains(name) {
            println!("{name:<16} (not created on {url})");
            continue;
        }
        let groups = t.readers(name);
        for p in bus.topic_stats(name, &groups).await? {
            let lags: Vec<String> = groups
                .iter()
                .map(|g| format!("{g}={}", p.lag(g).map_or("-".into(), |l| l.to_string())))
                .collect();
            println!(
                "{name:<16} {:>4} {:>12} {:>12}  {}",
                p.partition,
                p.start_offset,
                p.end_offset,
                lags.join(" ")
            );
        }
    }
    Ok(())
}

/// Builds every replica of every stage of `t` (loading models is the slow part), then runs
/// them in this process (`streamrl_runtime::running`) until the run ends in-band or a
/// signal arrives; returns the per-step summary and each replica's counters.
pub async fn run_all(t: Topology, quiet: bool) -> Result<(progress::Summary, Vec<(String, Arc<StageMetrics>)>)> {
    let bus = bus::connect(&t.bus).await?;
    running::create_topics(&bus, &t).await?;
    let shutdown = Shutdown::new();
    shutdown.on_signals();
    let mut replicas = Vec::new();
    for (name, decl) in &t.stages {
        for r in 0..decl.replicas {
            let cfg = t.runner_config(name, r).expect("stage exists");
            replicas.push(running::Replica {
                cfg,
                stage: stages::build(&t, &bus, name, r)?,
            });
        }
    }
    let stop_watching = Shutdown::new();
    let watcher = progress::Watcher::start(&bus, &t, stop_watching.clone(), quiet).await?;
    let result = running::run_replicas(bus, replicas, shutdown).await;
    stop_watching.trigger();
    let summary = watcher.finish().await;
    Ok((summary, result?))
}

/// `GET /metrics` on `host:port` in the background: the stage's counters and input lag in
/// the Prometheus text format.
async fn serve_metrics(
    host: &str,
    port: u16,
    bus: Arc<dyn bus::Bus>,
    cfg: RunnerConfig,
    metrics: Arc<StageMetrics>,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .with_context(|| format!("--metrics-port: binding {host}:{port}"))?;
    tracing::info!(addr = %listener.local_addr()?, "serving Prometheus metrics on /metrics");
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let (bus, cfg, metrics) = (bus.clone(), cfg.clone(), metrics.clone());
            async move {
                let lag = streamrl_runtime::runner::input_lag(&bus, &cfg).await;
                (
                    [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    metrics.prometheus(&cfg.stage, cfg.replica, lag),
                )
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(())
}

//! `streamrl`: asynchronous RL post-training as a dataflow pipeline over a message bus.
//!
//! One binary for every stage and tool: `validate`, `graph`, `run` (every stage of
//! topology.yaml in one process), `stage` (one stage, for separate processes), `topics`,
//! `query` (SQL over the Parquet archive), `replay`, and `bench`.

mod bench;
mod bench_async;
mod bench_generate;
mod bench_sandbox;
mod bench_scale;
mod bench_sql;
mod bench_train;
mod bench_weights;
mod model_cmd;
mod plot;
mod progress;
mod report;
mod sandbox_cmd;
mod serve;
mod stages;
mod train_cmd;
mod up;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use streamrl_archive::{OutputFormat, Sql, format_batches};
use streamrl_runtime::bus;
use streamrl_runtime::runner::{Shutdown, StageMetrics, run_stage};
use streamrl_runtime::running;
use streamrl_runtime::topology::Topology;

#[derive(Parser)]
#[command(
    name = "streamrl",
    version,
    about = "Asynchronous RL post-training for language models, as stages over a message bus"
)]
struct Cli {
    /// Set a value of the topology file for this command, `KEY.PATH=VALUE` (repeatable;
    /// VALUE is YAML), e.g. `--set stages.trainer.config.max_steps=20`. The environment
    /// variable holds one per line. `up` passes them on to every stage it starts.
    #[arg(
        long = "set",
        global = true,
        env = "STREAMRL_SET",
        value_delimiter = '\n',
        value_name = "KEY.PATH=VALUE"
    )]
    set: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

/// The `--set` overrides of this invocation, applied to every topology it reads.
static OVERRIDES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// [`OVERRIDES`] (none before the command line is parsed).
fn overrides() -> &'static [String] {
    OVERRIDES.get().map(Vec::as_slice).unwrap_or_default()
}

#[derive(Subcommand)]
enum Command {
    /// Check a topology and print every problem with its key path.
    Validate {
        /// Topology file.
        #[arg(short, long, default_value = "topology.yaml")]
        topology: PathBuf,
    },
    /// Print the pipeline as a Mermaid (default) or DOT graph.
    Graph {
        /// Topology file.
        #[arg(short, long, default_value = "topology.yaml")]
        topology: PathBuf,
        /// mermaid or dot.
        #[arg(long, default_value = "mermaid")]
        format: String,
    },
    /// Run every stage of the topology in this process (memory bus by default).
    Run {
        /// Topology file.
        #[arg(short, long, default_value = "topology.yaml")]
        topology: PathBuf,
        /// Override the topology's bus URL.
        #[arg(long)]
        bus: Option<String>,
    },
    /// Run every replica of every stage as its own `streamrl stage` process on a Kafka
    /// bus, restarting any that dies, until the run ends.
    Up {
        /// Topology file.
        #[arg(short, long, default_value = "topology.yaml")]
        topology: PathBuf,
        /// Bus URL (overrides the topology's; must be shared by processes: kafka://).
        #[arg(long, env = "STREAMRL_BUS")]
        bus: Option<String>,
    },
    /// Stop the `streamrl up` of a topology's run: every replica finishes, commits, exits.
    Down {
        /// Topology file (its run_dir locates the running `up`).
        #[arg(short, long, default_value = "topology.yaml")]
        topology: PathBuf,
    },
    /// Run one replica of one stage (for separate processes on a shared Kafka bus).
    Stage {
        /// Stage name in the topology.
        name: String,
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
    },
    /// Per topic: partitions, offsets and the lag of every consuming stage.
    Topics {
        /// Bus URL (overrides the topology's).
        #[arg(long)]
        bus: Option<String>,
        /// Topology file.
        #[arg(short, long, default_value = "topology.yaml")]
        topology: PathBuf,
    },
    /// Run SQL over the archived topics (one table per topic).
    Query {
        /// The SQL.
        sql: String,
        /// Run directory holding `archive/` (default: the topology's run_dir).
        #[arg(long)]
        run_dir: Option<PathBuf>,
        /// table, csv, json or parquet.
        #[arg(long, default_value = "table")]
        format: String,
        /// Write to this file instead of stdout (required for parquet).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Topology file (for the default run_dir).
        #[arg(short, long, default_value = "topology.yaml")]
        topology: PathBuf,
    },
    /// Republish archived rows of a topic to a bus.
    Replay {
        /// Archived topic to read.
        #[arg(long)]
        topic: String,
        /// SQL predicate selecting rows, e.g. "step = 3".
        #[arg(long = "where")]
        predicate: Option<String>,
        /// Bus URL to publish to.
        #[arg(long)]
        bus: String,
        /// Target topic (default: the same name).
        #[arg(long)]
        to: Option<String>,
        /// Rows per message at most.
        #[arg(long, default_value_t = 1024)]
        batch_rows: usize,
        /// Run directory holding `archive/` (default: the topology's run_dir).
        #[arg(long)]
        run_dir: Option<PathBuf>,
        /// Topology file (topic schemas and keys).
        #[arg(short, long, default_value = "topology.yaml")]
        topology: PathBuf,
    },
    /// Supervised warm start on an environment's reference solutions.
    Sft(train_cmd::SftArgs),
    /// Greedy accuracy and pass@k of a checkpoint on an environment's held-out split.
    Eval(train_cmd::EvalArgs),
    /// An OpenAI-compatible HTTP server (completions, chat completions) over the
    /// continuous-batching engine.
    Serve(serve::ServeArgs),
    /// Sandboxes: `serve` runs the HTTP gateway over a warm pool.
    Sandbox {
        #[command(subcommand)]
        cmd: sandbox_cmd::SandboxCmd,
    },
    /// Plots of a run (reward, loss, masking, staleness, throughput, generation lag) from its
    /// archive with SQL: SVG files and an HTML page.
    Report(report::ReportArgs),
    /// Create and inspect policy checkpoints.
    Model {
        #[command(subcommand)]
        cmd: model_cmd::ModelCmd,
    },
    /// Benchmarks that print a table with a ratio against a baseline run in-process.
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
}

/// `GET /metrics` on `host:port` in the background: the stage's counters and input lag in
/// the Prometheus text format.
async fn serve_metrics(
    host: &str,
    port: u16,
    bus: Arc<dyn bus::Bus>,
    cfg: streamrl_runtime::runner::RunnerConfig,
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

/// Every problem of the topology file at `path`, as one error.
fn problems(path: &std::path::Path, errs: Vec<String>) -> anyhow::Error {
    let mut msg = format!("{} has {} problem(s):", path.display(), errs.len());
    for e in &errs {
        msg.push_str(&format!("\n  {e}"));
    }
    anyhow::anyhow!(msg)
}

/// The topology document at `path` with this invocation's `--set` overrides, unvalidated
/// (for commands that read one section of it).
fn read_document(path: &std::path::Path) -> Result<serde_yaml::Value> {
    streamrl_runtime::topology::read_document(path, overrides())
        .map_err(|errs| problems(path, errs.iter().map(ToString::to_string).collect()))
}

fn load(path: &std::path::Path) -> Result<Topology> {
    let report = |errs: Vec<String>| problems(path, errs);
    let t = Topology::load_with(path, overrides(), &stages::check_config)
        .map_err(|errs| report(errs.iter().map(ToString::to_string).collect()))?;
    let env_errs = stages::check_envs(&t);
    if !env_errs.is_empty() {
        return Err(report(env_errs));
    }
    Ok(t)
}

/// [`load`], with the bus URL overridden when one is given.
fn load_on(path: &std::path::Path, bus: Option<String>) -> Result<Topology> {
    let mut t = load(path)?;
    if let Some(b) = bus {
        t.bus = b;
    }
    Ok(t)
}

fn main() -> std::process::ExitCode {
    // `streamrl __sandbox-init CONFIG`: this binary is also the sandboxes' init (one file
    // to ship). First, before any thread exists.
    streamrl_sandbox::init::run_if_invoked();
    let cli = Cli::parse();
    OVERRIDES.set(cli.set.clone()).expect("set once");
    // Training reuses its freed activation buffers instead of faulting them in again.
    streamrl_kernels::alloc::retain_freed_memory();
    if matches!(cli.command, Command::Run { .. }) {
        one_thread_per_op();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(async_main(cli))
}

/// `streamrl run` puts the rollout engine and the trainer in one process, each busy at the
/// same time. Candle's default CPU parallelism (a spinning pool over every core per op)
/// collapses under that contention (5–7× slower on 2 cores); one thread per op, with the
/// stages running in parallel, is the fast setting. An explicit `CANDLE_NUM_THREADS` /
/// `RAYON_NUM_THREADS` wins.
fn one_thread_per_op() {
    for var in ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            // SAFETY: called from `main` before the async runtime (or any other thread)
            // starts, so nothing can read the environment concurrently.
            #[allow(unsafe_code)]
            unsafe {
                std::env::set_var(var, "1")
            };
        }
    }
}

async fn async_main(cli: Cli) -> std::process::ExitCode {
    // One service per stage process (`streamrl-reward`), so a trace shows which did what.
    let service = match &cli.command {
        Command::Stage { name, .. } => format!("streamrl-{name}"),
        _ => "streamrl".to_string(),
    };
    let _telemetry = match streamrl_runtime::telemetry::init(&service) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("warning: {e}");
            None
        }
    };
    match dispatch(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve(a) => serve::serve(a).await,
        Command::Sandbox { cmd } => sandbox_cmd::run(cmd).await,
        Command::Report(a) => {
            let page = report::report(a).await?;
            println!("wrote {}", page.display());
            Ok(())
        }
        Command::Sft(a) => tokio::task::block_in_place(|| train_cmd::sft(a)),
        Command::Eval(a) => tokio::task::block_in_place(|| train_cmd::eval(a)),
        Command::Validate { topology } => {
            let t = load(&topology)?;
            println!(
                "{} is valid: bus {}, {} topics, {} stages ({} replicas)",
                topology.display(),
                t.bus,
                t.topics.len(),
                t.stages.len(),
                t.stages.values().map(|s| s.replicas).sum::<u32>()
            );
            for w in t.warnings() {
                println!("warning: {w}");
            }
            let missing = stages::unbuilt(&t);
            if !missing.is_empty() {
                println!("note: stage kinds not in this build yet: {}", missing.join(", "));
            }
            Ok(())
        }
        Command::Graph { topology, format } => {
            let t = load(&topology)?;
            match format.as_str() {
                "mermaid" => print!("{}", t.to_mermaid()),
                "dot" => print!("{}", t.to_dot()),
                other => bail!("unknown graph format `{other}` (known: mermaid, dot)"),
            }
            Ok(())
        }
        Command::Run { topology, bus } => {
            let t = load_on(&topology, bus)?;
            let sft = t.sft.clone();
            tokio::task::block_in_place(|| train_cmd::sft_from_topology(&sft, &topology))?;
            let (summary, metrics) = run_all(t, false).await?;
            print_metrics(&metrics);
            summary.print();
            Ok(())
        }
        Command::Up { topology, bus } => {
            let t = load_on(&topology, bus)?;
            let sft = t.sft.clone();
            tokio::task::block_in_place(|| train_cmd::sft_from_topology(&sft, &topology))?;
            let url = t.bus.clone();
            up::up(&t, &topology, &url).await
        }
        Command::Down { topology } => up::down(&load(&topology)?.run_dir).await,
        Command::Stage {
            name,
            bus,
            replica,
            topology,
            metrics_port,
            metrics_host,
        } => {
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
        Command::Topics { bus, topology } => {
            let t = load(&topology)?;
            let url = bus.unwrap_or(t.bus.clone());
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
                let groups: Vec<String> = t
                    .stages
                    .iter()
                    .filter(|(_, s)| s.inputs.contains(name))
                    .map(|(n, _)| n.clone())
                    .collect();
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
        Command::Query {
            sql,
            run_dir,
            format,
            out,
            topology,
        } => {
            let run_dir = match run_dir {
                Some(d) => d,
                None => load(&topology)?.run_dir,
            };
            let format: OutputFormat = format.parse().map_err(anyhow::Error::msg)?;
            let q = Sql::open(&run_dir).await?;
            let batches = q.query(&sql).await?;
            match (out, format) {
                (None, OutputFormat::Parquet) => bail!("--format parquet needs --out FILE"),
                (Some(path), f) => {
                    let mut file =
                        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
                    format_batches(&batches, f, &mut file)?;
                }
                (None, f) => format_batches(&batches, f, &mut std::io::stdout().lock())?,
            }
            Ok(())
        }
        Command::Replay {
            topic,
            predicate,
            bus,
            to,
            batch_rows,
            run_dir,
            topology,
        } => {
            let t = load(&topology)?;
            let run_dir = run_dir.unwrap_or(t.run_dir.clone());
            let target = to.unwrap_or(topic.clone());
            let decl = t.topics.get(&target).with_context(|| {
                format!(
                    "target topic `{target}` is not declared in {} (its schema and key come from there)",
                    topology.display()
                )
            })?;
            let bus = bus::connect(&bus).await?;
            bus.create_topic(&bus::TopicSpec::new(target.clone(), decl.partitions))
                .await?;
            let q = Sql::open(&run_dir).await?;
            let r = streamrl_archive::replay(
                &q,
                &topic,
                predicate.as_deref(),
                decl.schema,
                decl.key.as_deref(),
                &bus,
                &target,
                batch_rows,
            )
            .await?;
            println!(
                "replayed {} rows of `{topic}` as {} messages to `{target}` on {}",
                r.rows,
                r.messages,
                bus.url()
            );
            Ok(())
        }
        Command::Model { cmd } => model_cmd::run(cmd),
        Command::Bench { which } => bench::run(which).await,
    }
}

/// Builds every replica of every stage of `t` (loading models is the slow part), then runs
/// them in this process (`streamrl_runtime::running`) until the run ends in-band or a
/// signal arrives; returns the per-step summary and each replica's counters.
async fn run_all(t: Topology, quiet: bool) -> Result<(progress::Summary, Vec<(String, Arc<StageMetrics>)>)> {
    let missing = stages::unbuilt(&t);
    if !missing.is_empty() {
        bail!("this build lacks stage kind(s) {}", missing.join(", "));
    }
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

fn print_metrics(all: &[(String, Arc<StageMetrics>)]) {
    eprintln!(
        "{:<16} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7} {:>10}",
        "stage", "in_msgs", "in_rows", "out_msgs", "out_rows", "errors", "dead", "proc_ms"
    );
    for (name, m) in all {
        let s: std::collections::HashMap<_, _> = m.snapshot().into_iter().collect();
        eprintln!(
            "{:<16} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7} {:>10}",
            name,
            s["in_messages"],
            s["in_rows"],
            s["out_messages"],
            s["out_rows"],
            s["errors"],
            s["dead_lettered"],
            s["processing_ms"]
        );
    }
}

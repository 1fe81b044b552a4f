//! `streamrl`: asynchronous RL post-training as a dataflow pipeline over a message bus.
//!
//! One binary for every stage and tool. Each verb of [`Command`] lives in its own module:
//! `src/cli/` (pipeline, archive, train, model, sandbox, serve, up), `src/report/` and
//! `src/bench/`.

mod bench;
mod cli;
mod progress;
mod report;
mod stages;

use clap::{Parser, Subcommand};
use cli::{archive, model, pipeline, sandbox, serve, soak, train, up};

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

#[derive(Subcommand)]
enum Command {
    /// Check a topology and print every problem with its key path.
    Validate(pipeline::ValidateArgs),
    /// Print the pipeline as a Mermaid (default) or DOT graph.
    Graph(pipeline::GraphArgs),
    /// Run every stage of the topology in this process (memory bus by default).
    Run(pipeline::RunArgs),
    /// Run every replica of every stage as its own `streamrl stage` process on a Kafka
    /// bus, restarting any that dies, until the run ends.
    Up(up::UpArgs),
    /// Stop the `streamrl up` of a topology's run: every replica finishes, commits, exits.
    Down(up::DownArgs),
    /// `up` for a set time with SIGKILLs at random moments, sampling every process's
    /// memory, files and threads, the consumers' lag and the archive's files: a plot and a
    /// verdict per series (non-zero exit on growth).
    Soak(soak::SoakArgs),
    /// Run one replica of one stage (for separate processes on a shared Kafka bus).
    Stage(pipeline::StageArgs),
    /// Per topic: partitions, offsets and the lag of every consuming stage.
    Topics(pipeline::TopicsArgs),
    /// Run SQL over the archived topics (one table per topic).
    Query(archive::QueryArgs),
    /// Republish archived rows of a topic to a bus.
    Replay(archive::ReplayArgs),
    /// Merge each archived topic's small Parquet files into large ones (the archive stage
    /// does this on a schedule); queries and replays read the same rows before and after.
    Compact(archive::CompactArgs),
    /// Supervised warm start on an environment's reference solutions.
    Sft(train::SftArgs),
    /// Greedy accuracy and pass@k of a checkpoint on an environment's held-out split.
    Eval(train::EvalArgs),
    /// An OpenAI-compatible HTTP server (completions, chat completions) over the
    /// continuous-batching engine.
    Serve(serve::ServeArgs),
    /// Sandboxes: `serve` runs the HTTP gateway over a warm pool.
    Sandbox {
        #[command(subcommand)]
        cmd: sandbox::SandboxCmd,
    },
    /// Plots of a run (reward, loss, masking, staleness, throughput, generation lag) from its
    /// archive with SQL: SVG files and an HTML page.
    Report(report::ReportArgs),
    /// Create and inspect policy checkpoints.
    Model {
        #[command(subcommand)]
        cmd: model::ModelCmd,
    },
    /// Benchmarks that print a table with a ratio against a baseline run in-process.
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
}

/// Large buffers (a training step's logits and vocabulary gradients) on huge pages.
#[global_allocator]
static ALLOC: streamrl_kernels::alloc::HugePages = streamrl_kernels::alloc::HugePages;

fn main() -> std::process::ExitCode {
    // `streamrl __sandbox-init CONFIG`: this binary is also the sandboxes' init (one file
    // to ship). First, before any thread exists.
    streamrl_sandbox::init::run_if_invoked();
    let cli = Cli::parse();
    cli::set_overrides(cli.set.clone());
    // Training reuses its freed activation buffers instead of faulting them in again. A
    // `streamrl stage` process decides by its stage's kind (`pipeline::stage`): one that
    // neither trains nor decodes keeps malloc's defaults, which give freed memory back.
    if !matches!(cli.command, Command::Stage(_)) {
        streamrl_kernels::alloc::retain_freed_memory();
    }
    // SAFETY: no other thread exists yet (the async runtime starts below).
    #[allow(unsafe_code)]
    unsafe {
        streamrl_kernels::bf16::sleep_between_products()
    };
    if matches!(cli.command, Command::Run(_) | Command::Bench { .. }) {
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
/// stages running in parallel, is the fast setting. The benches spread their products over
/// the cores they time (`cores::spread`) and keep the rest of an op on one thread, as the
/// trainer does. An explicit `CANDLE_NUM_THREADS` / `RAYON_NUM_THREADS` wins.
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
        Command::Stage(a) => format!("streamrl-{}", a.name),
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

/// One line per verb: each lives in its own module.
async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Validate(a) => pipeline::validate(a),
        Command::Graph(a) => pipeline::graph(a),
        Command::Run(a) => pipeline::run(a).await,
        Command::Up(a) => up::run(a).await,
        Command::Down(a) => up::stop(a).await,
        Command::Soak(a) => soak::run(a).await,
        Command::Stage(a) => pipeline::stage(a).await,
        Command::Topics(a) => pipeline::topics(a).await,
        Command::Query(a) => archive::query(a).await,
        Command::Replay(a) => archive::replay(a).await,
        Command::Compact(a) => archive::compact(a).await,
        Command::Sft(a) => tokio::task::block_in_place(|| train::sft(a)),
        Command::Eval(a) => tokio::task::block_in_place(|| train::eval(a)),
        Command::Serve(a) => serve::serve(a).await,
        Command::Sandbox { cmd } => sandbox::run(cmd).await,
        Command::Report(a) => report::run(a).await,
        Command::Model { cmd } => model::run(cmd),
        Command::Bench { which } => bench::run(which).await,
    }
}

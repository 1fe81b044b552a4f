//! `streamrl bench ...`: throughput tables with a baseline measured in the same process.

mod async_level;
mod bus;
mod generate;
mod gpu;
mod sandbox;
mod scale;
mod sql;
mod stats;
mod train;
mod weights;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum Which {
    /// Training step time and tokens/s (forward + backward + optimizer) at four shapes (two
    /// small, SmolLM2-135M's at 4×128 and 8×256 tokens) on 1 and 2 threads: streamrl in
    /// f32 and bf16, the small shapes also op by op in candle with its stock AdamW, against
    /// PyTorch + transformers in f32 and bf16 in the same run ("not measured" without them).
    Train {
        /// Timed steps per shape (after one warm-up step).
        #[arg(long, default_value_t = 3)]
        steps: usize,
        /// Skip the SmolLM2-135M shapes (seconds to tens of seconds per step, and its
        /// checkpointing probe of a 4096-token micro-batch, minutes).
        #[arg(long)]
        skip_large: bool,
        /// Only the shapes whose name contains this text (e.g. `8×256`), and no
        /// checkpointing table.
        #[arg(long)]
        only: Option<String>,
        /// Internal: run one step of the memory probe in this process (`on` or `off` for
        /// activation checkpointing) and print its peak RSS.
        #[arg(long, hide = true)]
        memory_probe: Option<String>,
        /// Internal: the memory probe at SmolLM2-135M's shape.
        #[arg(long, hide = true)]
        probe_smollm2: bool,
    },
    /// The GPU check's table (scripts/gpu-check.sh): the fused RL kernels' parity and
    /// bandwidth, and training and decode tokens/s of the tiny, small and SmolLM2-135M
    /// shapes against PyTorch on the same device and dtype.
    Gpu(gpu::GpuArgs),
    /// Decode tokens/s of the KV-cache sampler (batch 1, 32 and 128) against full
    /// recompute, continuous against static batching on a mixed workload, and each preset
    /// through the engine and HF `generate` in f32 and bf16 on 1 and 2 threads.
    Generate {
        /// New tokens per sequence.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// Model shapes (comma-separated presets, randomly initialised): tiny, small, and
        /// smollm2 (SmolLM2-135M's shape and vocabulary; batch 1 and 32, recompute at batch
        /// 1, no mixed workloads: they would take many minutes at this size).
        #[arg(long, value_delimiter = ',', default_value = "tiny,small")]
        preset: Vec<String>,
    },
    /// Wall time per RL step through the whole pipeline with max_async_level 0 vs 2, on a
    /// workload whose generation lengths have a heavy tail.
    Async {
        /// Trainer steps per run.
        #[arg(long, default_value_t = 20)]
        steps: u64,
        /// Pareto shape of the per-group max_tokens (smaller: heavier tail).
        #[arg(long, default_value_t = 1.2)]
        alpha: f64,
    },
    /// Exec latency p50/p99 and execs/s of a small Python command through the warm
    /// sandbox pool vs a bare fork+exec of the same command.
    Sandbox {
        /// Execs per row.
        #[arg(long, default_value_t = 256)]
        n: usize,
        /// Concurrencies to measure (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,64")]
        concurrency: Vec<usize>,
        /// Sandboxes kept warm.
        #[arg(long, default_value_t = 64)]
        pool_size: usize,
        /// The interpreter (the same path inside the sandbox and on the host).
        #[arg(long, default_value = "/usr/bin/python3")]
        python: String,
        /// Alternating rounds per concurrency (each column reports the median; at
        /// concurrency 64 one round's p50 moves with the VM's speed by more than the goal).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Executors to compare (comma-separated): `local` alone is the sandbox pool
        /// against bare fork+exec; with `gateways`, the pool against the sandbox stage's
        /// gateway client over `--gateways` gateway processes.
        #[arg(long, value_delimiter = ',', default_value = "local")]
        executor: Vec<String>,
        /// Gateway processes per row (comma-separated), with `--executor gateways`.
        #[arg(long, value_delimiter = ',', default_value = "1,2")]
        gateways: Vec<usize>,
    },
    /// `streamrl query` (whole processes) vs DuckDB on a run's archive: common queries,
    /// median wall time each, ratio and geometric mean.
    Sql {
        /// Run directory holding `archive/`.
        #[arg(long, default_value = "runs/demo")]
        run_dir: std::path::PathBuf,
        /// Runs per query and engine (the median is reported).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// The streamrl binary to time (default: this one; another build for before/after).
        #[arg(long)]
        exe: Option<std::path::PathBuf>,
    },
    /// Weight-sync time (publication → every replica serving) over HTTP from the trainer's
    /// checkpoint server vs file:// on a shared disk; tiny and small, 1 and 4 replicas.
    /// Then the decode pause per version: loaded in place vs prepared beside decoding.
    Weights {
        /// Versions published per row (the median is reported).
        #[arg(long, default_value_t = 5)]
        versions: usize,
    },
    /// Rollouts/s through the sandbox stage (the `code` environment's bottleneck) at 1, 2
    /// and 4 replica processes on a Kafka broker, each rollout checked executed once.
    Scale {
        /// The Kafka broker (e.g. kafka://127.0.0.1:9092).
        #[arg(long)]
        bus: String,
        /// Rollouts per round (groups of 4).
        #[arg(long, default_value_t = 256)]
        rollouts: usize,
        /// Replica counts, one round each (comma-separated; the first is the baseline).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        replicas: Vec<u32>,
        /// Executions in flight per replica.
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
    },
    /// Memory bus rows/s (vs an mpsc channel) and, with --kafka, Kafka MB/s (vs raw rdkafka).
    Bus {
        /// Kafka URL for the Kafka half (e.g. kafka://127.0.0.1:9092); omitted: memory only.
        #[arg(long)]
        kafka: Option<String>,
        /// Rows per message in the memory run.
        #[arg(long, default_value_t = 1024)]
        rows_per_message: usize,
        /// Messages in the memory run.
        #[arg(long, default_value_t = 2000)]
        messages: usize,
        /// Total payload MiB in the Kafka run.
        #[arg(long, default_value_t = 256)]
        kafka_mib: usize,
    },
}

pub async fn run(which: Which) -> Result<()> {
    match which {
        Which::Train {
            memory_probe: Some(mode),
            probe_smollm2,
            ..
        } => train::memory_probe(mode == "on", probe_smollm2),
        Which::Train {
            steps,
            skip_large,
            only,
            ..
        } => train::run(steps, skip_large, only.as_deref()),
        Which::Async { steps, alpha } => async_level::run(steps, alpha).await,
        Which::Sandbox {
            n,
            concurrency,
            pool_size,
            python,
            rounds,
            executor,
            gateways,
        } => {
            if let Some(bad) = executor.iter().find(|e| !matches!(e.as_str(), "local" | "gateways")) {
                anyhow::bail!("--executor {bad}: the executors are `local` and `gateways`");
            }
            if executor.iter().any(|e| e == "gateways") {
                // Off the async context: the gateway client runs on a runtime of its own.
                std::thread::spawn(move || {
                    sandbox::executors(n, &concurrency, pool_size, &python, rounds.max(1), &executor, &gateways)
                })
                .join()
                .map_err(|_| anyhow::anyhow!("the sandbox bench panicked"))?
            } else {
                sandbox::run(n, concurrency, pool_size, python, rounds.max(1))
            }
        }
        Which::Generate { tokens, preset } => generate::generate(tokens, &preset),
        Which::Gpu(a) => gpu::run(a),
        Which::Weights { versions } => weights::run(versions.max(1)),
        Which::Scale {
            bus,
            rollouts,
            replicas,
            concurrency,
        } => scale::run(&bus, rollouts, &replicas, concurrency.max(1)).await,
        Which::Sql { run_dir, rounds, exe } => sql::run(&run_dir, rounds.max(1), exe),
        Which::Bus {
            kafka,
            rows_per_message,
            messages,
            kafka_mib,
        } => bus::run(kafka, rows_per_message, messages, kafka_mib).await,
    }
}

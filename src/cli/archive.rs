//! The archive verbs: `query` (SQL over the Parquet archive), `replay` (archived rows
//! back onto a bus) and `compact` (small files merged into large ones).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use streamrl_archive::{CompactConfig, OutputFormat, Sql, compact_topic, format_batches, live_files};
use streamrl_runtime::bus;

use super::load;

/// `streamrl query`.
#[derive(Args)]
pub struct QueryArgs {
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
}

/// `streamrl replay`.
#[derive(Args)]
pub struct ReplayArgs {
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
}

/// `streamrl compact`.
#[derive(Args)]
pub struct CompactArgs {
    /// Run directory holding `archive/` (default: the topology's run_dir).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Topology file (for the default run_dir).
    #[arg(short, long, default_value = "topology.yaml")]
    topology: PathBuf,
    /// Rows a merged file aims for.
    #[arg(long, default_value_t = CompactConfig::default().target_rows)]
    target_rows: usize,
    /// Files the newest run of small files needs before it is merged.
    #[arg(long, default_value_t = CompactConfig::default().min_files)]
    min_files: usize,
}

/// Merges each topic's small files into large ones and prints what changed per topic.
pub async fn compact(a: CompactArgs) -> Result<()> {
    let run_dir = match a.run_dir {
        Some(d) => d,
        None => load(&a.topology)?.run_dir,
    };
    if a.min_files < 2 || a.target_rows == 0 {
        bail!(
            "--min-files must be at least 2 (got {}) and --target-rows at least 1 (got {})",
            a.min_files,
            a.target_rows
        );
    }
    let cfg = CompactConfig {
        target_rows: a.target_rows,
        min_files: a.min_files,
        ..CompactConfig::default()
    };
    let dir = run_dir.join("archive");
    let mut topics: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("no archive under {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    topics.sort();
    println!(
        "{:<16} {:>12} {:>12} {:>8} {:>8} {:>8} {:>10}",
        "topic", "files before", "files after", "merged", "written", "deleted", "rows"
    );
    for t in topics {
        let before = live_files(&t)?.len();
        let r = tokio::task::block_in_place(|| compact_topic(&t, &cfg))?;
        let after = live_files(&t)?.len();
        let name = t
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        println!(
            "{name:<16} {before:>12} {after:>12} {:>8} {:>8} {:>8} {:>10}",
            r.merged, r.written, r.deleted, r.rows
        );
    }
    Ok(())
}

/// Runs the SQL over the archive (one table per topic) and prints or writes the result.
pub async fn query(a: QueryArgs) -> Result<()> {
    let run_dir = match a.run_dir {
        Some(d) => d,
        None => load(&a.topology)?.run_dir,
    };
    let format: OutputFormat = a.format.parse().map_err(anyhow::Error::msg)?;
    let q = Sql::open(&run_dir).await?;
    let batches = q.query(&a.sql).await?;
    match (a.out, format) {
        (None, OutputFormat::Parquet) => bail!("--format parquet needs --out FILE"),
        (Some(path), f) => {
            let mut file = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            format_batches(&batches, f, &mut file)?;
        }
        (None, f) => format_batches(&batches, f, &mut std::io::stdout().lock())?,
    }
    Ok(())
}

/// Republishes the archived rows of a topic (optionally filtered) to a bus.
pub async fn replay(a: ReplayArgs) -> Result<()> {
    let t = load(&a.topology)?;
    let run_dir = a.run_dir.unwrap_or(t.run_dir.clone());
    let topic = a.topic;
    let target = a.to.unwrap_or(topic.clone());
    let decl = t.topics.get(&target).with_context(|| {
        format!(
            "target topic `{target}` is not declared in {} (its schema and key come from there)",
            a.topology.display()
        )
    })?;
    let bus = bus::connect(&a.bus).await?;
    bus.create_topic(&bus::TopicSpec::new(target.clone(), decl.partitions))
        .await?;
    let q = Sql::open(&run_dir).await?;
    let r = streamrl_archive::replay(
        &q,
        &topic,
        a.predicate.as_deref(),
        decl.schema,
        decl.key.as_deref(),
        &bus,
        &target,
        a.batch_rows,
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

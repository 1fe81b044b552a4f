//! The archive verbs: `query` (SQL over the Parquet archive) and `replay` (archived rows
//! back onto a bus).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use streamrl_archive::{OutputFormat, Sql, format_batches};
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

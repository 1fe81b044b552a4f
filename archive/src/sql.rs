//! SQL over the archive: one table per topic directory.

use std::path::{Path, PathBuf};

use arrow::record_batch::RecordBatch;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};

use crate::{Error, Result};

/// A DataFusion session with every archived topic registered as a table.
pub struct Sql {
    ctx: SessionContext,
    tables: Vec<String>,
    dir: PathBuf,
}

impl Sql {
    /// Opens `<run_dir>/archive`.
    pub async fn open(run_dir: &Path) -> Result<Sql> {
        let dir = run_dir.join("archive");
        let entries = std::fs::read_dir(&dir).map_err(|_| Error::NoArchive(dir.display().to_string()))?;
        // Plain Utf8 (not view types), so rows read back have exactly the topic schemas.
        let config = SessionConfig::new().set_bool("datafusion.execution.parquet.schema_force_view_types", false);
        let ctx = SessionContext::new_with_config(config);
        let mut tables = Vec::new();
        for e in entries.flatten() {
            let path = e.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_string) else {
                continue;
            };
            let has_files = std::fs::read_dir(&path)
                .map(|d| {
                    d.flatten()
                        .any(|f| f.file_name().to_string_lossy().ends_with(".parquet"))
                })
                .unwrap_or(false);
            if !path.is_dir() || !has_files {
                continue;
            }
            let url = format!("{}/", path.display());
            ctx.register_parquet(&format!("\"{name}\""), &url, ParquetReadOptions::default())
                .await?;
            tables.push(name);
        }
        tables.sort();
        Ok(Sql { ctx, tables, dir })
    }

    /// Registered table names (topics with rows).
    pub fn tables(&self) -> &[String] {
        &self.tables
    }

    /// Runs a query.
    pub async fn query(&self, sql: &str) -> Result<Vec<RecordBatch>> {
        let df = self.ctx.sql(sql).await.map_err(|e| {
            Error::Sql(format!(
                "{e} (tables: {})",
                if self.tables.is_empty() {
                    "none".into()
                } else {
                    self.tables.join(", ")
                }
            ))
        })?;
        Ok(df.collect().await?)
    }

    /// Every row of `topic` matching an optional SQL predicate, in archive order.
    pub async fn select(&self, topic: &str, predicate: Option<&str>) -> Result<Vec<RecordBatch>> {
        if !self.tables.iter().any(|t| t == topic) {
            return Err(Error::EmptyTopic {
                topic: topic.to_string(),
                dir: self.dir.display().to_string(),
            });
        }
        let sql = match predicate {
            Some(p) => format!("SELECT * FROM \"{topic}\" WHERE {p}"),
            None => format!("SELECT * FROM \"{topic}\""),
        };
        self.query(&sql).await
    }
}

/// How `streamrl query` prints results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    /// An aligned text table.
    Table,
    /// CSV with a header row.
    Csv,
    /// One JSON object per line.
    Json,
    /// A Parquet file (written to the given path).
    Parquet,
}

impl std::str::FromStr for OutputFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "table" => Ok(OutputFormat::Table),
            "csv" => Ok(OutputFormat::Csv),
            "json" => Ok(OutputFormat::Json),
            "parquet" => Ok(OutputFormat::Parquet),
            other => Err(format!("unknown format `{other}` (known: table, csv, json, parquet)")),
        }
    }
}

/// Renders batches in a text format (table, csv or json) into `out`.
pub fn format_batches(batches: &[RecordBatch], format: OutputFormat, out: &mut dyn std::io::Write) -> Result<()> {
    let io = |e: std::io::Error| Error::Io {
        op: "writing",
        path: "output".into(),
        source: e,
    };
    let arrow_err = |e: arrow::error::ArrowError| Error::Sql(e.to_string());
    match format {
        OutputFormat::Table => {
            let t = arrow::util::pretty::pretty_format_batches(batches).map_err(arrow_err)?;
            writeln!(out, "{t}").map_err(io)?;
        }
        OutputFormat::Csv => {
            let mut w = arrow::csv::WriterBuilder::new().with_header(true).build(out);
            for b in batches {
                w.write(b).map_err(arrow_err)?;
            }
        }
        OutputFormat::Json => {
            let mut w = arrow::json::LineDelimitedWriter::new(out);
            for b in batches {
                w.write(b).map_err(arrow_err)?;
            }
            w.finish().map_err(arrow_err)?;
        }
        OutputFormat::Parquet => {
            let schema = batches
                .first()
                .map(|b| b.schema())
                .unwrap_or_else(|| std::sync::Arc::new(arrow::datatypes::Schema::empty()));
            let mut buf = Vec::new();
            let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, schema, None).map_err(|e| Error::Parquet {
                path: "output".into(),
                reason: e.to_string(),
            })?;
            for b in batches {
                w.write(b).map_err(|e| Error::Parquet {
                    path: "output".into(),
                    reason: e.to_string(),
                })?;
            }
            w.close().map_err(|e| Error::Parquet {
                path: "output".into(),
                reason: e.to_string(),
            })?;
            out.write_all(&buf).map_err(io)?;
        }
    }
    Ok(())
}

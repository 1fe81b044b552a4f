//! SQL over the archive: one table per topic directory.
//!
//! Opening lists the topic directories only; each query registers the topics it names
//! over their live files (compaction's merged files stand for the files they replaced:
//! see [`crate::compact`]), with the schema read from the footer of one file (the newest)
//! instead of every file's, and without per-file statistics at planning. A query over one
//! topic of a long run therefore reads one footer to plan (plus those of merged files),
//! not the whole archive's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl};
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::{Error, Result};

/// A DataFusion session over the archived topics (each registered on first use).
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
        let config = SessionConfig::new()
            // Plain Utf8 (not view types), so rows read back have exactly the topic schemas.
            .set_bool("datafusion.execution.parquet.schema_force_view_types", false)
            // Per-file statistics would read every footer of a table before planning;
            // pruning still reads the footers of the files a scan opens.
            .set_bool("datafusion.execution.collect_statistics", false);
        let ctx = SessionContext::new_with_config(config);
        let mut tables = Vec::new();
        for e in entries.flatten() {
            let path = e.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_string) else {
                continue;
            };
            if path.is_dir() && has_rows(&path) {
                tables.push(name);
            }
        }
        tables.sort();
        Ok(Sql { ctx, tables, dir })
    }

    /// Registered table names (topics with rows).
    pub fn tables(&self) -> &[String] {
        &self.tables
    }

    /// Registers the topics `sql` names that are not tables yet.
    /// (Re-)registers the topics `sql` names over their files as they are now; returns
    /// each with the files it was registered over.
    async fn register_named(&self, sql: &str) -> Result<Vec<(String, Vec<PathBuf>)>> {
        let state = self.ctx.state();
        let dialect = state.config().options().sql_parser.dialect;
        // A statement that does not parse is reported by the query itself.
        let Ok(statement) = state.sql_to_statement(sql, &dialect) else {
            return Ok(Vec::new());
        };
        let Ok(refs) = state.resolve_table_references(&statement) else {
            return Ok(Vec::new());
        };
        let mut listed: Vec<(String, Vec<PathBuf>)> = Vec::new();
        for r in refs {
            let name = r.table();
            if self.tables.iter().any(|t| t == name) && !listed.iter().any(|(t, _)| t == name) {
                if self.ctx.table_exist(name)? {
                    self.ctx.deregister_table(name)?;
                }
                listed.push((name.to_string(), self.register(name).await?));
            }
        }
        Ok(listed)
    }

    /// Registers topic `name` as a table over its live files (those no merged file
    /// replaces: see [`crate::compact`]) with the schema of its newest file; returns them.
    async fn register(&self, name: &str) -> Result<Vec<PathBuf>> {
        let dir = self.dir.join(name);
        let live = crate::live_files(&dir)?;
        let newest = newest_of(&live).ok_or_else(|| Error::EmptyTopic {
            topic: name.to_string(),
            dir: self.dir.display().to_string(),
        })?;
        let state = self.ctx.state();
        let options = ListingOptions::new(Arc::new(ParquetFormat::default())).with_file_extension(".parquet");
        let one = ListingTableConfig::new(ListingTableUrl::parse(newest.display().to_string())?)
            .with_listing_options(options.clone())
            .infer_schema(&state)
            .await?;
        let schema = one
            .file_schema
            .clone()
            .ok_or_else(|| Error::Sql(format!("no schema could be read from {}", newest.display())))?;
        let urls = live
            .iter()
            .map(|p| ListingTableUrl::parse(p.display().to_string()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let config = ListingTableConfig::new_with_multi_paths(urls)
            .with_listing_options(options)
            .with_schema(schema);
        self.ctx.register_table(
            datafusion::common::TableReference::bare(name),
            Arc::new(ListingTable::try_new(config)?),
        )?;
        Ok(live)
    }

    /// Runs a query over the topics' files as they are when it starts. A compaction pass
    /// (see [`crate::compact`]) that changes a named topic's files while the query runs
    /// (a file gone that the query listed, or a merged file it did not list) is noticed
    /// after the query, which then runs again: a result never counts a row twice or
    /// misses one.
    pub async fn query(&self, sql: &str) -> Result<Vec<RecordBatch>> {
        const TRIES: usize = 5;
        for _ in 1..TRIES {
            let listed = self.register_named(sql).await?;
            let result = self.query_once(sql).await;
            let mut unchanged = true;
            for (t, files) in &listed {
                unchanged &= crate::live_files(&self.dir.join(t))? == *files;
            }
            match result {
                Err(Error::Sql(m)) if m.contains("No such file or directory") && !unchanged => continue,
                _ if !unchanged => continue,
                r => return r,
            }
        }
        self.register_named(sql).await?;
        self.query_once(sql).await
    }

    async fn query_once(&self, sql: &str) -> Result<Vec<RecordBatch>> {
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

/// Whether a topic directory holds a non-empty `.parquet` file.
fn has_rows(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|d| {
        d.flatten().any(|f| {
            let name = f.file_name().to_string_lossy().into_owned();
            !name.starts_with('.') && name.ends_with(".parquet") && f.metadata().is_ok_and(|m| m.len() > 0)
        })
    })
}

/// The most recently written non-empty file of `files`.
fn newest_of(files: &[PathBuf]) -> Option<PathBuf> {
    files
        .iter()
        .filter_map(|f| {
            let m = std::fs::metadata(f).ok().filter(|m| m.len() > 0)?;
            Some((m.modified().ok(), f.clone()))
        })
        .max()
        .map(|(_, p)| p)
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

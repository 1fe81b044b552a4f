//! The archive: every topic lands in Parquet under `<run_dir>/archive/<topic>/`, SQL over
//! it with DataFusion (one table per topic), and replay of stored rows back onto a bus.
//!
//! Files appear atomically (written as `.tmp`, then renamed), and the archive stage holds
//! its inputs unacknowledged until the rows are on disk, so a crash loses nothing. On a
//! durable bus each file also records the highest offset of every partition it holds,
//! and a record delivered again after a crash is recognised by its offset and not
//! written twice.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use streamrl_archive::{ArchiveConfig, ArchiveWriter, Sql};
//! use streamrl_schemas::{MetricRow, SchemaId, TopicRow};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let mut w = ArchiveWriter::new(dir.path(), "archive-0", ArchiveConfig::default());
//! let rows = vec![MetricRow { run_id: "r".into(), step: 1, stage: "trainer".into(), name: "loss".into(), value: 0.5, created_at: 0 }];
//! w.append("metrics", SchemaId::Metrics, MetricRow::to_batch(&rows).unwrap());
//! w.flush_all().unwrap();
//! let sql = Sql::open(dir.path()).await.unwrap();
//! let out = sql.query("SELECT name, value FROM metrics").await.unwrap();
//! assert_eq!(out.iter().map(|b| b.num_rows()).sum::<usize>(), 1);
//! # }
//! ```

mod compact;
mod error;
mod replay;
mod sql;
mod writer;

pub use compact::{CompactConfig, CompactReport, ROW_GROUP_ROWS, compact_topic, live_files};
pub use error::{Error, Result};
pub use replay::{ReplayReport, replay};
pub use sql::{OutputFormat, Sql, format_batches};
pub use writer::{ArchiveConfig, ArchiveStage, ArchiveWriter};

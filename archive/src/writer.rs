//! The archive stage and its Parquet writer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::Deserialize;
use streamrl_runtime::build::{BuildContext, BuildError, BuildStage, none_or_invalid};
use streamrl_runtime::{Emitter, Input, Stage, StageError};
use streamrl_schemas::{Problem, SchemaId, Validate};

use crate::{Error, Result};

/// Configuration of the archive stage (`stages.archive.config` in topology.yaml).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArchiveConfig {
    /// Write a topic's buffered rows once this many have accumulated.
    pub flush_rows: usize,
    /// Write buffered rows at least this often, in seconds.
    pub flush_seconds: f64,
    /// Zstandard level of the Parquet files (1–22).
    pub zstd_level: i32,
    /// Merge each topic's small files into large ones this often, in seconds (0: never;
    /// `streamrl archive compact` does it by hand). See [`crate::compact`].
    pub compact_seconds: f64,
    /// Rows a merged file aims for.
    pub compact_target_rows: usize,
    /// Files the newest run of small files needs before it is merged.
    pub compact_min_files: usize,
}

impl Default for ArchiveConfig {
    fn default() -> Self {
        ArchiveConfig {
            flush_rows: 10_000,
            flush_seconds: 5.0,
            zstd_level: 3,
            compact_seconds: 60.0,
            compact_target_rows: 1_000_000,
            compact_min_files: 16,
        }
    }
}

impl ArchiveConfig {
    /// How compaction merges, from these settings.
    pub fn compaction(&self) -> crate::CompactConfig {
        crate::CompactConfig {
            target_rows: self.compact_target_rows,
            min_files: self.compact_min_files,
            zstd_level: self.zstd_level,
        }
    }
}

impl Validate for ArchiveConfig {
    fn problems(&self) -> Vec<Problem> {
        let mut v = Vec::new();
        if self.flush_rows == 0 {
            v.push(Problem::new("flush_rows", "must be at least 1"));
        }
        if !self.flush_seconds.is_finite() || self.flush_seconds <= 0.0 {
            v.push(Problem::new(
                "flush_seconds",
                format!("must be positive, got {}", self.flush_seconds),
            ));
        }
        if !self.compact_seconds.is_finite() || self.compact_seconds < 0.0 {
            v.push(Problem::new(
                "compact_seconds",
                format!("must be 0 (never) or positive, got {}", self.compact_seconds),
            ));
        }
        if self.compact_target_rows == 0 {
            v.push(Problem::new("compact_target_rows", "must be at least 1"));
        }
        if self.compact_min_files < 2 {
            v.push(Problem::new(
                "compact_min_files",
                format!(
                    "must be at least 2 (a merge of one file does nothing), got {}",
                    self.compact_min_files
                ),
            ));
        }
        if !(1..=22).contains(&self.zstd_level) {
            v.push(Problem::new(
                "zstd_level",
                format!("must be 1..=22, got {}", self.zstd_level),
            ));
        }
        v
    }
}

struct Buffer {
    schema: SchemaId,
    batches: Vec<RecordBatch>,
    rows: usize,
    since: Instant,
    /// The highest bus offset buffered, per partition (recorded in the file's metadata).
    offsets: BTreeMap<u32, u64>,
}

/// Parquet key-value metadata: the name of the rows' schema.
pub(crate) const META_SCHEMA: &str = "streamrl.schema";
/// Parquet key-value metadata: the bus the rows came from.
pub(crate) const META_BUS: &str = "streamrl.bus";
/// Parquet key-value metadata: JSON `{partition: highest offset}` of the rows in the file.
pub(crate) const META_OFFSETS: &str = "streamrl.offsets";

/// Buffers batches per topic and writes them as Parquet files, atomically.
pub struct ArchiveWriter {
    dir: PathBuf,
    instance: String,
    cfg: ArchiveConfig,
    buffers: BTreeMap<String, Buffer>,
    seq: u64,
    /// Files written so far.
    pub files_written: u64,
    /// The durable bus whose offsets files record and redeliveries are checked against.
    bus: Option<String>,
    /// Per topic, the highest offset of each partition already in a file of `bus`
    /// (loaded from the files' metadata on the topic's first record).
    archived: BTreeMap<String, BTreeMap<u32, u64>>,
}

impl ArchiveWriter {
    /// A writer for `<run_dir>/archive/`.
    pub fn new(run_dir: &Path, instance: &str, cfg: ArchiveConfig) -> Self {
        ArchiveWriter {
            dir: run_dir.join("archive"),
            instance: instance.to_string(),
            cfg,
            buffers: BTreeMap::new(),
            seq: 0,
            files_written: 0,
            bus: None,
            archived: BTreeMap::new(),
        }
    }

    /// Records which offsets of `bus_url` each file holds, and from then on recognises a
    /// record already in a file (a redelivery after a restart or a rebalance) by its
    /// offset: effectively-once files on a durable bus. Offsets restart with an in-process
    /// bus, so only use this for a durable one.
    pub fn with_offsets_of(mut self, bus_url: &str) -> Self {
        self.bus = Some(bus_url.to_string());
        self
    }

    /// Whether the record at `partition`/`offset` of `topic` is already in a file.
    pub fn is_archived(&mut self, topic: &str, partition: u32, offset: u64) -> bool {
        let Some(bus) = &self.bus else { return false };
        if !self.archived.contains_key(topic) {
            let found = archived_offsets(&self.dir.join(topic), bus);
            self.archived.insert(topic.to_string(), found);
        }
        self.archived[topic].get(&partition).is_some_and(|&max| offset <= max)
    }

    /// Like [`append`](Self::append), for a record read at `partition`/`offset`.
    pub fn append_at(
        &mut self,
        topic: &str,
        schema: SchemaId,
        batch: RecordBatch,
        partition: u32,
        offset: u64,
    ) -> bool {
        let full = self.append(topic, schema, batch);
        let b = self.buffers.get_mut(topic).expect("appended above");
        let max = b.offsets.entry(partition).or_insert(offset);
        *max = (*max).max(offset);
        full
    }

    /// Buffers a batch; returns true when the topic reached `flush_rows`.
    pub fn append(&mut self, topic: &str, schema: SchemaId, batch: RecordBatch) -> bool {
        let b = self.buffers.entry(topic.to_string()).or_insert_with(|| Buffer {
            schema,
            batches: Vec::new(),
            rows: 0,
            since: Instant::now(),
            offsets: BTreeMap::new(),
        });
        if b.batches.is_empty() {
            b.since = Instant::now();
        }
        b.rows += batch.num_rows();
        b.batches.push(batch);
        b.rows >= self.cfg.flush_rows
    }

    /// Whether any buffer is older than `flush_seconds`.
    pub fn due(&self) -> bool {
        let max = Duration::from_secs_f64(self.cfg.flush_seconds);
        self.buffers
            .values()
            .any(|b| !b.batches.is_empty() && b.since.elapsed() >= max)
    }

    /// Rows buffered and not yet written.
    pub fn buffered_rows(&self) -> usize {
        self.buffers.values().map(|b| b.rows).sum()
    }

    /// Writes every non-empty buffer to its own file.
    pub fn flush_all(&mut self) -> Result<()> {
        let topics: Vec<String> = self.buffers.keys().cloned().collect();
        for t in topics {
            self.flush_topic(&t)?;
        }
        Ok(())
    }

    /// A Parquet file's key-value metadata: the schema's name and, on a durable bus, the
    /// bus URL with the highest offset per partition of the rows in the file.
    fn file_metadata(bus: Option<&str>, buf: &Buffer) -> Vec<parquet::file::metadata::KeyValue> {
        use parquet::file::metadata::KeyValue;
        let mut kv = vec![KeyValue::new(META_SCHEMA.to_string(), buf.schema.name().to_string())];
        if let Some(bus) = bus {
            kv.push(KeyValue::new(META_BUS.to_string(), bus.to_string()));
            kv.push(KeyValue::new(
                META_OFFSETS.to_string(),
                serde_json::to_string(&buf.offsets).unwrap_or_default(),
            ));
        }
        kv
    }

    fn flush_topic(&mut self, topic: &str) -> Result<()> {
        let Some(buf) = self.buffers.get_mut(topic) else {
            return Ok(());
        };
        if buf.batches.is_empty() {
            return Ok(());
        }
        let dir = self.dir.join(topic);
        std::fs::create_dir_all(&dir).map_err(|e| Error::Io {
            op: "creating",
            path: dir.display().to_string(),
            source: e,
        })?;
        self.seq += 1;
        let name = format!(
            "part-{}-{}-{:06}.parquet",
            self.instance,
            streamrl_schemas::now_millis(),
            self.seq
        );
        let final_path = dir.join(&name);
        let tmp = dir.join(format!(".{name}.tmp"));
        let perr = |e: parquet::errors::ParquetError| Error::Parquet {
            path: tmp.display().to_string(),
            reason: e.to_string(),
        };
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(
                ZstdLevel::try_new(self.cfg.zstd_level).map_err(perr)?,
            ))
            .set_key_value_metadata(Some(Self::file_metadata(self.bus.as_deref(), buf)))
            .build();
        let file = std::fs::File::create(&tmp).map_err(|e| Error::Io {
            op: "creating",
            path: tmp.display().to_string(),
            source: e,
        })?;
        let mut w = ArrowWriter::try_new(file, buf.schema.schema(), Some(props)).map_err(perr)?;
        for b in &buf.batches {
            w.write(b).map_err(perr)?;
        }
        let file = w.into_inner().map_err(perr)?;
        file.sync_all().map_err(|e| Error::Io {
            op: "syncing",
            path: tmp.display().to_string(),
            source: e,
        })?;
        std::fs::rename(&tmp, &final_path).map_err(|e| Error::Io {
            op: "renaming into",
            path: final_path.display().to_string(),
            source: e,
        })?;
        buf.batches.clear();
        buf.rows = 0;
        let written = std::mem::take(&mut buf.offsets);
        if self.bus.is_some() {
            let known = self.archived.entry(topic.to_string()).or_default();
            for (p, o) in written {
                let max = known.entry(p).or_insert(o);
                *max = (*max).max(o);
            }
        }
        self.files_written += 1;
        Ok(())
    }
}

/// The highest offset per partition recorded in the metadata of the Parquet files under
/// `dir` written from `bus` (unreadable or foreign files are ignored).
fn archived_offsets(dir: &Path, bus: &str) -> BTreeMap<u32, u64> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let mut out: BTreeMap<u32, u64> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().is_none_or(|x| x != "parquet") {
            continue;
        }
        let Some(reader) = std::fs::File::open(&path)
            .ok()
            .and_then(|f| SerializedFileReader::new(f).ok())
        else {
            continue;
        };
        let kv = reader.metadata().file_metadata().key_value_metadata();
        let get = |k: &str| {
            kv.and_then(|kv| kv.iter().find(|x| x.key == k))
                .and_then(|x| x.value.clone())
        };
        if get(META_BUS).as_deref() != Some(bus) {
            continue;
        }
        let Some(offsets) = get(META_OFFSETS).and_then(|j| serde_json::from_str::<BTreeMap<u32, u64>>(&j).ok()) else {
            continue;
        };
        for (p, o) in offsets {
            let max = out.entry(p).or_insert(o);
            *max = (*max).max(o);
        }
    }
    out
}

/// Hands the memory a compaction pass freed back to the kernel. A pass reads and
/// rewrites whole files on a blocking thread; glibc keeps what it frees in that thread's
/// arena (and the binary raises malloc's trim threshold for training), so without this
/// every pass left ~40 MiB more resident in the archive process (seen by `streamrl soak`:
/// 81 → 222 MiB in four minutes, a step per pass).
#[allow(unsafe_code)]
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel; it takes the arena
    // locks and has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The archive stage: subscribes to topics, writes them to Parquet, acknowledges inputs
/// only once their rows are in a renamed file.
pub struct ArchiveStage {
    writer: ArchiveWriter,
    skipped: u64,
    /// When compaction last ran (see [`ArchiveConfig::compact_seconds`]).
    compacted_at: Instant,
    /// What compaction has done so far.
    compacted: crate::CompactReport,
}

/// Builds the stage for the context's `run_dir`; on a durable bus, files record the bus's
/// offsets ([`ArchiveStage::with_offsets_of`]).
impl BuildStage for ArchiveStage {
    type Config = ArchiveConfig;

    fn build(cfg: ArchiveConfig, ctx: &BuildContext) -> std::result::Result<Self, BuildError> {
        none_or_invalid(cfg.problems())?;
        let stage = ArchiveStage::new(cfg, &ctx.run_dir, &ctx.instance());
        Ok(match (&ctx.bus, ctx.durable_bus) {
            (Some(bus), true) => stage.with_offsets_of(bus.0.url()),
            _ => stage,
        })
    }
}

impl ArchiveStage {
    /// The stage for `run_dir`, as replica `instance` (a checked config).
    pub fn new(cfg: ArchiveConfig, run_dir: &Path, instance: &str) -> Self {
        ArchiveStage {
            writer: ArchiveWriter::new(run_dir, instance, cfg),
            skipped: 0,
            compacted_at: Instant::now(),
            compacted: crate::CompactReport::default(),
        }
    }

    /// Files record the offsets of `bus_url` (a durable bus), and records already in a
    /// file are recognised and skipped when delivered again: see
    /// [`ArchiveWriter::with_offsets_of`].
    pub fn with_offsets_of(mut self, bus_url: &str) -> Self {
        self.writer = self.writer.with_offsets_of(bus_url);
        self
    }

    /// Records skipped because a file already held them.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// What compaction has done so far.
    pub fn compacted(&self) -> crate::CompactReport {
        self.compacted
    }

    /// One compaction pass over every topic directory, on a blocking thread (a failed
    /// pass is logged and retried at the next: compaction never loses rows, so it never
    /// stops the stage).
    async fn compact(&mut self) {
        self.compacted_at = Instant::now();
        let (dir, cfg) = (self.writer.dir.clone(), self.writer.cfg.compaction());
        let pass = tokio::task::spawn_blocking(move || -> Result<crate::CompactReport> {
            let mut total = crate::CompactReport::default();
            let Ok(topics) = std::fs::read_dir(&dir) else {
                return Ok(total);
            };
            for t in topics.flatten().filter(|t| t.path().is_dir()) {
                total += crate::compact_topic(&t.path(), &cfg)?;
            }
            release_freed_memory();
            Ok(total)
        });
        match pass.await {
            Ok(Ok(r)) => {
                if r.written > 0 || r.deleted > 0 {
                    tracing::info!(
                        merged = r.merged,
                        written = r.written,
                        deleted = r.deleted,
                        rows = r.rows,
                        "archive compacted"
                    );
                }
                self.compacted += r;
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "archive compaction failed; retrying at the next pass"),
            Err(e) => tracing::warn!(error = %e, "archive compaction panicked; retrying at the next pass"),
        }
    }

    fn flush(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        self.writer
            .flush_all()
            .map_err(|e| StageError::transient(e.to_string()))?;
        out.release_held();
        Ok(())
    }
}

#[async_trait]
impl Stage for ArchiveStage {
    async fn process(&mut self, input: Input, out: &mut Emitter) -> Result<(), StageError> {
        if self.writer.is_archived(&input.topic, input.partition, input.offset) {
            // Already in a file (delivered again after a restart): acknowledge, don't write.
            self.skipped += 1;
            tracing::debug!(topic = %input.topic, partition = input.partition, offset = input.offset, "already archived");
            return Ok(());
        }
        let full = self
            .writer
            .append_at(&input.topic, input.schema, input.batch, input.partition, input.offset);
        out.hold();
        // A failed write is not this input's fault and must not append it twice on retry:
        // the rows stay buffered (and held) and the next tick retries the write.
        if full && let Err(e) = self.flush(out) {
            tracing::warn!(error = %e, "archive flush failed; retrying on the next tick");
        }
        Ok(())
    }

    fn tick_interval(&self) -> Option<Duration> {
        Some(Duration::from_secs_f64(
            (self.writer.cfg.flush_seconds / 4.0).clamp(0.05, 1.0),
        ))
    }

    async fn tick(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        if self.writer.due() {
            self.flush(out)?;
        }
        let every = self.writer.cfg.compact_seconds;
        if every > 0.0 && self.compacted_at.elapsed().as_secs_f64() >= every {
            self.compact().await;
        }
        Ok(())
    }

    async fn close(&mut self, out: &mut Emitter) -> Result<(), StageError> {
        self.flush(out)
    }
}

//! Compaction: a topic's small Parquet files merged into large ones, without a reader ever
//! seeing a row twice or missing one.
//!
//! The archive stage writes a file per topic every `flush_seconds` (a week of a run is
//! ~120 000 files per topic); listing, planning and `replay` slow with every file.
//! [`compact_topic`] merges runs of consecutive small files of one writer into files of
//! about `target_rows` rows:
//!
//! 1. the merged rows are written to a hidden `.compact-*.tmp` file, synced, and renamed to
//!    `part-<instance>-<first>-to-<last>.parquet`, which sorts where its first source did
//!    (rows keep their archive order). Its footer names every file it replaces
//!    (`streamrl.replaces`), and carries their schema, bus and highest offsets;
//! 2. the replaced files are deleted right after the rename. Should the process die
//!    between the two, [`live_files`] (what [`crate::Sql`] reads) leaves the replaced
//!    files out all the same, by the merged file's footer, and the next pass deletes them.
//!
//! A crash before the rename leaves only a `.tmp` file, which no reader lists and the next
//! pass removes. So the archive's own readers never see a row twice or miss one; a
//! foreign reader that globs `*.parquet` (DuckDB, pyarrow) sees a topic's rows twice only
//! after such a crash, until the next pass. A query that listed a file a pass then
//! deleted is planned again ([`crate::Sql::query`]). Row groups are at most
//! [`ROW_GROUP_ROWS`] rows, so each group's column statistics (`step`, `version`, …) let a
//! scan skip it.
//!
//! ```
//! use streamrl_archive::{ArchiveConfig, ArchiveWriter, CompactConfig, compact_topic, live_files};
//! use streamrl_schemas::{MetricRow, SchemaId, TopicRow};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let mut w = ArchiveWriter::new(dir.path(), "archive-0", ArchiveConfig::default());
//! for step in 0..10 {
//!     let row = MetricRow { run_id: "r".into(), step, stage: "trainer".into(), name: "loss".into(), value: 0.5, created_at: 0 };
//!     w.append("metrics", SchemaId::Metrics, MetricRow::to_batch(&[row]).unwrap());
//!     w.flush_all().unwrap(); // one file per step
//! }
//! let topic = dir.path().join("archive/metrics");
//! let cfg = CompactConfig { min_files: 4, ..CompactConfig::default() };
//! let report = compact_topic(&topic, &cfg).unwrap();
//! assert_eq!((report.merged, report.written, report.deleted), (10, 1, 10));
//! assert_eq!(live_files(&topic).unwrap().len(), 1);
//! let parquet = |e: &std::fs::DirEntry| e.file_name().to_string_lossy().ends_with(".parquet");
//! assert_eq!(std::fs::read_dir(&topic).unwrap().flatten().filter(parquet).count(), 1);
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::datatypes::Schema;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{FileReader, SerializedFileReader};

use crate::writer::{META_BUS, META_OFFSETS, META_SCHEMA};
use crate::{Error, Result};

/// Footer key of a merged file: JSON list of the file names it replaces.
pub(crate) const META_REPLACES: &str = "streamrl.replaces";

/// Rows per row group of a merged file: small enough that each group's statistics
/// (`step`, `version`, …) let a scan skip it, large enough to compress well.
pub const ROW_GROUP_ROWS: usize = 65_536;

/// A merged file's row group is closed early once its encoded data reaches this size
/// (rows of `samples` and `rollouts` carry token lists), which bounds a pass's memory.
const MERGE_BUFFER_BYTES: usize = 8 << 20;

/// How [`compact_topic`] merges (`stages.archive.config.compact_*` in topology.yaml).
#[derive(Debug, Clone)]
pub struct CompactConfig {
    /// Rows a merged file aims for; files already this large are left as they are.
    pub target_rows: usize,
    /// A run of small files that does not reach `target_rows` yet (the newest files) is
    /// merged only once it has this many files.
    pub min_files: usize,
    /// Zstandard level of merged files.
    pub zstd_level: i32,
}

impl Default for CompactConfig {
    fn default() -> Self {
        CompactConfig {
            target_rows: 1_000_000,
            min_files: 16,
            zstd_level: 3,
        }
    }
}

/// What one [`compact_topic`] pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompactReport {
    /// Files merged into new ones.
    pub merged: usize,
    /// Merged files written.
    pub written: usize,
    /// Replaced files (and stale temporary files) deleted.
    pub deleted: usize,
    /// Rows rewritten.
    pub rows: u64,
}

impl std::ops::AddAssign for CompactReport {
    fn add_assign(&mut self, o: Self) {
        self.merged += o.merged;
        self.written += o.written;
        self.deleted += o.deleted;
        self.rows += o.rows;
    }
}

/// A data file of a topic directory, as its name and footer describe it.
struct DataFile {
    path: PathBuf,
    name: String,
    /// The writer instance (`archive-0`), and the order key within it.
    instance: String,
    order: (u64, u64),
    rows: u64,
    replaces: Vec<String>,
    kv: BTreeMap<String, String>,
    schema: Arc<Schema>,
}

/// Parses `part-<instance>-<millis>-<seq>[-to-<millis>-<seq>].parquet`.
fn parse_name(name: &str) -> Option<(String, (u64, u64))> {
    let stem = name.strip_prefix("part-")?.strip_suffix(".parquet")?;
    let first = stem.split("-to-").next()?;
    let mut it = first.rsplitn(3, '-');
    let seq = it.next()?.parse().ok()?;
    let millis = it.next()?.parse().ok()?;
    Some((it.next()?.to_string(), (millis, seq)))
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        op,
        path: path.display().to_string(),
        source,
    }
}

fn pq(path: &Path) -> impl Fn(parquet::errors::ParquetError) -> Error + '_ {
    move |e| Error::Parquet {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// Every data file of a topic directory with its footer (files that are not the
/// archive's, or cannot be read, are skipped: a reader reports them when it opens them).
fn scan(dir: &Path) -> Result<Vec<DataFile>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io("listing", dir))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((instance, order)) = parse_name(&name) else {
            continue;
        };
        let path = e.path();
        let Some(reader) = File::open(&path).ok().and_then(|f| SerializedFileReader::new(f).ok()) else {
            continue;
        };
        let meta = reader.metadata().file_metadata();
        let kv: BTreeMap<String, String> = meta
            .key_value_metadata()
            .into_iter()
            .flatten()
            .filter_map(|k| Some((k.key.clone(), k.value.clone()?)))
            .collect();
        let replaces = kv
            .get(META_REPLACES)
            .and_then(|j| serde_json::from_str(j).ok())
            .unwrap_or_default();
        let Ok(schema) = parquet::arrow::parquet_to_arrow_schema(meta.schema_descr(), meta.key_value_metadata()) else {
            continue;
        };
        // The footer's own keys (offsets, replaced files) differ per file; the rows'
        // schema is what the rest says.
        let mut md = schema.metadata().clone();
        md.retain(|k, _| !k.starts_with("streamrl."));
        let schema = Schema::new_with_metadata(schema.fields().clone(), md);
        out.push(DataFile {
            rows: meta.num_rows().max(0) as u64,
            path,
            name,
            instance,
            order,
            replaces,
            kv,
            schema: Arc::new(schema),
        });
    }
    out.sort_by(|a, b| (&a.instance, a.order, &a.name).cmp(&(&b.instance, b.order, &b.name)));
    Ok(out)
}

/// Names of the files some merged file of `files` replaces.
fn replaced(files: &[DataFile]) -> BTreeSet<String> {
    files.iter().flat_map(|f| f.replaces.iter().cloned()).collect()
}

/// The files of a topic directory that hold its rows, in archive order: every `.parquet`
/// file except those a merged file replaces (they may still be on disk for a while).
/// Reads the footers of merged files only.
pub fn live_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut named = Vec::new();
    let mut other = Vec::new();
    let mut gone = BTreeSet::new();
    for e in std::fs::read_dir(dir).map_err(io("listing", dir))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".parquet") {
            continue;
        }
        match parse_name(&name) {
            Some((instance, order)) => {
                if name.contains("-to-") {
                    gone.extend(footer_replaces(&e.path()));
                }
                named.push(((instance, order, name), e.path()));
            }
            // Files whose names the archive does not give (copied in by hand) still count.
            None => other.push(e.path()),
        }
    }
    named.sort();
    Ok(named
        .into_iter()
        .filter(|((_, _, name), _)| !gone.contains(name))
        .map(|(_, p)| p)
        .chain(other)
        .collect())
}

/// The files a merged file's footer says it replaces (none when it cannot be read).
fn footer_replaces(path: &Path) -> Vec<String> {
    let Some(reader) = File::open(path).ok().and_then(|f| SerializedFileReader::new(f).ok()) else {
        return Vec::new();
    };
    reader
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .into_iter()
        .flatten()
        .find(|k| k.key == META_REPLACES)
        .and_then(|k| serde_json::from_str(k.value.as_deref()?).ok())
        .unwrap_or_default()
}

/// One compaction pass over a topic directory: deletes what an interrupted pass left
/// (replaced files, temporary files), then merges each writer's consecutive small files
/// into files of about `target_rows` rows, deleting each merged file's sources once it is
/// in place.
///
/// Passes over one directory take turns (an advisory lock on `.compact.lock`, released if
/// the process dies): a pass that finds another under way returns at once, doing nothing.
pub fn compact_topic(dir: &Path, cfg: &CompactConfig) -> Result<CompactReport> {
    let mut report = CompactReport::default();
    let lock_path = dir.join(".compact.lock");
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io("opening", &lock_path))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(report),
        Err(std::fs::TryLockError::Error(e)) => return Err(io("locking", &lock_path)(e)),
    }
    let files = scan(dir)?;
    let gone = replaced(&files);
    for f in files.iter().filter(|f| gone.contains(&f.name)) {
        remove(&f.path)?;
        report.deleted += 1;
    }
    // No other pass runs (the lock): any temporary file is one a dead pass left.
    for e in std::fs::read_dir(dir).map_err(io("listing", dir))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".compact-") && name.ends_with(".tmp") {
            remove(&e.path())?;
            report.deleted += 1;
        }
    }
    let live: Vec<&DataFile> = files.iter().filter(|f| !gone.contains(&f.name)).collect();
    for run in runs(&live, cfg) {
        report.rows += merge(dir, &run, cfg)?;
        report.merged += run.len();
        report.written += 1;
        for f in &run {
            remove(&f.path)?;
            report.deleted += 1;
        }
    }
    Ok(report)
}

/// Deletes a file that may already be gone.
fn remove(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("deleting", path)(e)),
        _ => Ok(()),
    }
}

/// Consecutive small files of one writer with one schema, cut at about `target_rows`. A
/// writer's newest run (which may still grow) is merged only once it has `min_files`
/// files; a run ended by a large file or a schema change, once it has two.
fn runs<'a>(live: &[&'a DataFile], cfg: &CompactConfig) -> Vec<Vec<&'a DataFile>> {
    let mut out = Vec::new();
    let mut cur: Vec<&DataFile> = Vec::new();
    let mut rows = 0u64;
    let close = |cur: &mut Vec<&'a DataFile>, rows: &mut u64, out: &mut Vec<Vec<&'a DataFile>>, ended: bool| {
        if cur.len() >= 2 && (ended || cur.len() >= cfg.min_files.max(2)) {
            out.push(std::mem::take(cur));
        } else {
            cur.clear();
        }
        *rows = 0;
    };
    for &f in live {
        if let Some(l) = cur.last() {
            let same_writer = l.instance == f.instance;
            if !same_writer || l.schema != f.schema || l.kv.get(META_BUS) != f.kv.get(META_BUS) {
                close(&mut cur, &mut rows, &mut out, same_writer);
            }
        }
        if f.rows >= cfg.target_rows as u64 {
            close(&mut cur, &mut rows, &mut out, true);
            continue;
        }
        cur.push(f);
        rows += f.rows;
        if rows >= cfg.target_rows as u64 {
            close(&mut cur, &mut rows, &mut out, true);
        }
    }
    close(&mut cur, &mut rows, &mut out, false);
    out
}

/// Writes the rows of `run` (in order) to one merged file; returns the rows written.
fn merge(dir: &Path, run: &[&DataFile], cfg: &CompactConfig) -> Result<u64> {
    let (first, last) = (run[0], run[run.len() - 1]);
    let last_stem = last.name.strip_suffix(".parquet").unwrap_or(&last.name);
    let last_tail = last_stem.rsplitn(3, '-').take(2).collect::<Vec<_>>();
    let name = format!(
        "part-{}-{}-{:06}-to-{}-{}.parquet",
        first.instance, first.order.0, first.order.1, last_tail[1], last_tail[0]
    );
    let final_path = dir.join(&name);
    let tmp = dir.join(format!(".compact-{name}.tmp"));
    // Everything the merged file stands for, replaced files of replaced files included
    // (those may still be on disk, and only this footer will say they are gone).
    let mut replaces: BTreeSet<String> = run.iter().map(|f| f.name.clone()).collect();
    replaces.extend(run.iter().flat_map(|f| f.replaces.iter().cloned()));
    let mut offsets: BTreeMap<u32, u64> = BTreeMap::new();
    for f in run {
        let o: BTreeMap<u32, u64> =
            f.kv.get(META_OFFSETS)
                .and_then(|j| serde_json::from_str(j).ok())
                .unwrap_or_default();
        for (p, o) in o {
            let m = offsets.entry(p).or_insert(o);
            *m = (*m).max(o);
        }
    }
    let mut kv = vec![KeyValue::new(
        META_REPLACES.to_string(),
        serde_json::to_string(&replaces).unwrap_or_default(),
    )];
    if let Some(s) = first.kv.get(META_SCHEMA) {
        kv.push(KeyValue::new(META_SCHEMA.to_string(), s.clone()));
    }
    if let Some(bus) = first.kv.get(META_BUS) {
        kv.push(KeyValue::new(META_BUS.to_string(), bus.clone()));
        kv.push(KeyValue::new(
            META_OFFSETS.to_string(),
            serde_json::to_string(&offsets).unwrap_or_default(),
        ));
    }
    let perr = pq(&tmp);
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(cfg.zstd_level).map_err(&perr)?))
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .set_key_value_metadata(Some(kv))
        .build();
    let file = File::create(&tmp).map_err(io("creating", &tmp))?;
    let mut w = ArrowWriter::try_new(file, first.schema.clone(), Some(props)).map_err(&perr)?;
    let mut rows = 0u64;
    for f in run {
        let src = File::open(&f.path).map_err(io("opening", &f.path))?;
        let reader = ParquetRecordBatchReaderBuilder::try_new(src)
            .map_err(pq(&f.path))?
            .build()
            .map_err(pq(&f.path))?;
        for b in reader {
            let b = b.map_err(|e| Error::Parquet {
                path: f.path.display().to_string(),
                reason: e.to_string(),
            })?;
            rows += b.num_rows() as u64;
            w.write(&b).map_err(&perr)?;
            // A row group of wide rows (token lists) can be tens of MiB before it reaches
            // ROW_GROUP_ROWS: close it early, so a pass holds at most this much.
            if w.in_progress_size() > MERGE_BUFFER_BYTES {
                w.flush().map_err(&perr)?;
            }
        }
    }
    let file = w.into_inner().map_err(&perr)?;
    file.sync_all().map_err(io("syncing", &tmp))?;
    std::fs::rename(&tmp, &final_path).map_err(io("renaming into", &final_path))?;
    // The rename is what makes the replaced files dead: make it durable before they can go.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(rows)
}

//! Replay: stored rows back onto a bus, into any topic of the same schema.

use std::sync::Arc;

use arrow::compute::cast;
use arrow::record_batch::RecordBatch;
use streamrl_runtime::bus::{Bus, Record};
use streamrl_runtime::runner::split_by_key;
use streamrl_schemas::codec::{self, Compression};
use streamrl_schemas::{Headers, SchemaId};

use crate::{Error, Result, Sql};

/// What a replay sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplayReport {
    /// Rows republished.
    pub rows: u64,
    /// Messages sent.
    pub messages: u64,
}

/// Republishes the archived rows of `topic` that match `predicate` to `target` on `bus`,
/// as messages of `schema`, split by `key` (so a group lands in one partition again) and
/// at most `batch_rows` rows per message. Waits until every message is delivered.
#[allow(clippy::too_many_arguments)]
pub async fn replay(
    sql: &Sql,
    topic: &str,
    predicate: Option<&str>,
    schema: SchemaId,
    key: Option<&str>,
    bus: &Arc<dyn Bus>,
    target: &str,
    batch_rows: usize,
) -> Result<ReplayReport> {
    let batches = sql.select(topic, predicate).await?;
    let producer = bus.producer("replay").await?;
    let mut pending = Vec::new();
    let mut report = ReplayReport::default();
    for b in batches {
        let b = conform(topic, schema, &b)?;
        let mut start = 0;
        while start < b.num_rows() {
            let len = batch_rows.max(1).min(b.num_rows() - start);
            let chunk = b.slice(start, len);
            start += len;
            for (k, part) in split_by_key(&chunk, key).map_err(|reason| Error::Schema {
                topic: topic.to_string(),
                schema: schema.name().to_string(),
                reason: reason.to_string(),
            })? {
                let headers = Headers::data(schema, "replay")
                    .with_traceparent(streamrl_runtime::telemetry::new_traceparent())
                    .to_wire();
                let payload = codec::encode(&part, Compression::Zstd)?;
                report.rows += part.num_rows() as u64;
                report.messages += 1;
                pending.push(
                    producer
                        .send(
                            target,
                            Record {
                                key: k,
                                headers,
                                payload,
                                partition: None,
                            },
                        )
                        .await?,
                );
            }
        }
    }
    futures::future::try_join_all(pending).await?;
    Ok(report)
}

/// Casts query output to exactly the topic schema (column order, types, nullability).
fn conform(topic: &str, schema: SchemaId, b: &RecordBatch) -> Result<RecordBatch> {
    let want = schema.schema();
    let err = |reason: String| Error::Schema {
        topic: topic.to_string(),
        schema: schema.name().to_string(),
        reason,
    };
    let mut cols = Vec::with_capacity(want.fields().len());
    for f in want.fields() {
        let c = b
            .column_by_name(f.name())
            .ok_or_else(|| err(format!("missing column `{}`", f.name())))?;
        let c = if c.data_type() == f.data_type() {
            c.clone()
        } else {
            cast(c, f.data_type()).map_err(|e| err(format!("column `{}`: {e}", f.name())))?
        };
        cols.push(c);
    }
    RecordBatch::try_new(want, cols).map_err(|e| err(e.to_string()))
}

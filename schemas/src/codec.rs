//! The payload codec: one record batch ⇄ one self-contained Arrow IPC stream.
//!
//! Sans-io: bytes in, bytes out. The decoder checks the headers against the topic's schema
//! before reading, reads exactly one batch, and compares the payload's Arrow schema with
//! the topic's, so a message of the wrong schema is refused before any stage sees it.

use std::io::Cursor;

use arrow::datatypes::Schema;
use arrow::error::ArrowError;
use arrow::ipc::CompressionType;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};
use arrow::record_batch::RecordBatch;
use bytes::Bytes;

use crate::{Error, Headers, MessageKind, Result, SchemaId};

/// Body compression of IPC payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// No compression.
    None,
    /// LZ4 frame: fastest.
    Lz4,
    /// Zstandard: smallest (default).
    #[default]
    Zstd,
}

/// Encodes one batch as an IPC stream (schema message, one batch, end-of-stream marker).
pub fn encode(batch: &RecordBatch, compression: Compression) -> Result<Bytes> {
    let err = |e: ArrowError| Error::Encode {
        rows: batch.num_rows(),
        reason: e.to_string(),
    };
    let options = IpcWriteOptions::default()
        .try_with_compression(match compression {
            Compression::None => None,
            Compression::Lz4 => Some(CompressionType::LZ4_FRAME),
            Compression::Zstd => Some(CompressionType::ZSTD),
        })
        .map_err(err)?;
    let mut out = Vec::with_capacity(batch.get_array_memory_size() / 2 + 256);
    {
        let mut w = StreamWriter::try_new_with_options(&mut out, &batch.schema(), options).map_err(err)?;
        w.write(batch).map_err(err)?;
        w.finish().map_err(err)?;
    }
    Ok(Bytes::from(out))
}

/// Decodes a data message of `expected` schema: checks headers, reads exactly one batch,
/// and checks the batch's schema. Never panics, whatever the bytes.
pub fn decode(expected: SchemaId, headers: &[(String, Vec<u8>)], payload: &[u8]) -> Result<RecordBatch> {
    let h = Headers::from_wire(headers)?;
    check_headers(expected, &h)?;
    if h.kind == MessageKind::Signal {
        return Err(Error::InvalidHeader {
            key: crate::HeaderKey::KIND,
            value: "signal".into(),
            reason: "a signal message has no rows to decode".into(),
        });
    }
    let batch = decode_payload(payload)?;
    check_schema(expected, batch.schema_ref())?;
    Ok(batch)
}

/// Checks that parsed headers belong to `expected` (name and fingerprint).
pub fn check_headers(expected: SchemaId, h: &Headers) -> Result<()> {
    if h.schema != expected {
        return Err(Error::WrongSchema {
            expected,
            found: h.schema.name().to_string(),
        });
    }
    if h.fingerprint != expected.fingerprint() {
        return Err(Error::FingerprintMismatch {
            schema: expected,
            expected: expected.fingerprint().to_string(),
            found: h.fingerprint.clone(),
        });
    }
    Ok(())
}

/// Reads exactly one record batch from an IPC stream, whatever its schema.
pub fn decode_payload(payload: &[u8]) -> Result<RecordBatch> {
    let len = payload.len();
    precheck(payload)?;
    // arrow-ipc validates flatbuffers and array data; the unwind guard is a second line of
    // defence so that no byte sequence can take a stage down.
    let read = std::panic::catch_unwind(|| -> Result<Vec<RecordBatch>> {
        let reader = StreamReader::try_new(Cursor::new(payload), None).map_err(|e| classify(len, e))?;
        reader.map(|b| b.map_err(|e| classify(len, e))).collect()
    });
    let batches = match read {
        Ok(r) => r?,
        Err(_) => {
            return Err(Error::Malformed {
                len,
                reason: "IPC reader panicked".into(),
            });
        }
    };
    match <[RecordBatch; 1]>::try_from(batches) {
        Ok([b]) => Ok(b),
        Err(v) => Err(Error::BatchCount { found: v.len() }),
    }
}

/// Largest decompressed size any one message may claim (a payload is at most tens of MiB).
pub const MAX_DECOMPRESSED_BYTES: i64 = 1 << 30;
/// Most rows one message may claim.
pub const MAX_ROWS: i64 = 1 << 28;

/// Walks the IPC framing and the (verified) flatbuffer headers before arrow reads the
/// bodies: a flipped length prefix must not make the reader allocate exabytes (that aborts
/// the process, which no unwind guard can catch).
fn precheck(payload: &[u8]) -> Result<()> {
    let len = payload.len();
    let truncated = |what: &str| Error::Truncated {
        len,
        reason: format!("stream ends inside {what}"),
    };
    let malformed = |reason: String| Error::Malformed { len, reason };
    let mut pos = 0usize;
    let mut claimed: i64 = 0;
    loop {
        let word = |at: usize| -> Option<u32> {
            payload
                .get(at..at + 4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        // Every IPC message since Arrow 0.15 starts with the 0xFFFFFFFF continuation marker.
        let marker = word(pos).ok_or_else(|| truncated("a message length"))?;
        if marker != 0xFFFF_FFFF {
            return Err(malformed(format!(
                "no IPC continuation marker at byte {pos} (found {marker:#010x})"
            )));
        }
        let meta_len = word(pos + 4).ok_or_else(|| truncated("a message length"))?;
        pos += 8;
        if meta_len == 0 {
            return Ok(());
        }
        let meta_len = meta_len as usize;
        let meta = payload
            .get(pos..pos.saturating_add(meta_len))
            .ok_or_else(|| truncated("message metadata"))?;
        pos += meta_len;
        let msg = arrow::ipc::root_as_message(meta).map_err(|e| malformed(format!("message header: {e}")))?;
        let body_len = usize::try_from(msg.bodyLength())
            .map_err(|_| malformed(format!("negative body length {}", msg.bodyLength())))?;
        let body = payload
            .get(pos..pos.saturating_add(body_len))
            .ok_or_else(|| truncated("a message body"))?;
        pos += body_len;
        let batch = msg
            .header_as_record_batch()
            .or_else(|| msg.header_as_dictionary_batch().and_then(|d| d.data()));
        let Some(batch) = batch else { continue };
        if !(0..=MAX_ROWS).contains(&batch.length()) {
            return Err(malformed(format!("batch claims {} rows", batch.length())));
        }
        if batch.compression().is_none() {
            continue;
        }
        for b in batch.buffers().into_iter().flatten() {
            if b.length() == 0 {
                continue;
            }
            let at =
                usize::try_from(b.offset()).map_err(|_| malformed(format!("negative buffer offset {}", b.offset())))?;
            let prefix = body
                .get(at..at.saturating_add(8))
                .ok_or_else(|| malformed(format!("buffer at {at} lies outside the body")))?;
            let n = i64::from_le_bytes(prefix.try_into().expect("8 bytes"));
            if !(-1..=MAX_DECOMPRESSED_BYTES).contains(&n) {
                return Err(malformed(format!("buffer claims {n} decompressed bytes")));
            }
            claimed = claimed.saturating_add(n.max(0));
            if claimed > MAX_DECOMPRESSED_BYTES {
                return Err(malformed(format!(
                    "message claims over {MAX_DECOMPRESSED_BYTES} decompressed bytes"
                )));
            }
        }
    }
}

fn classify(len: usize, e: ArrowError) -> Error {
    let reason = e.to_string();
    let truncated = matches!(&e, ArrowError::IoError(_, io) if io.kind() == std::io::ErrorKind::UnexpectedEof)
        || reason.contains("UnexpectedEof")
        || reason.contains("failed to fill whole buffer")
        || reason.contains("unexpected end");
    if truncated {
        Error::Truncated { len, reason }
    } else {
        Error::Malformed { len, reason }
    }
}

/// Checks a batch schema against a topic schema, listing every difference.
pub fn check_schema(expected: SchemaId, actual: &Schema) -> Result<()> {
    let want = expected.schema();
    if want.fields() == actual.fields() {
        return Ok(());
    }
    let mut diffs = Vec::new();
    for f in want.fields() {
        match actual.field_with_name(f.name()) {
            Err(_) => diffs.push(format!("missing `{}` ({})", f.name(), f.data_type())),
            Ok(a) if a.data_type() != f.data_type() => {
                diffs.push(format!("`{}` is {} not {}", f.name(), a.data_type(), f.data_type()))
            }
            Ok(a) if a.is_nullable() != f.is_nullable() => diffs.push(format!(
                "`{}` nullable={} not {}",
                f.name(),
                a.is_nullable(),
                f.is_nullable()
            )),
            Ok(_) => {}
        }
    }
    for a in actual.fields() {
        if want.field_with_name(a.name()).is_err() {
            diffs.push(format!("unexpected `{}`", a.name()));
        }
    }
    if diffs.is_empty() {
        diffs.push("fields are in a different order".into());
    }
    Err(Error::SchemaMismatch {
        schema: expected,
        differences: diffs.join(", "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rows::tests::rollout;
    use crate::{RolloutRow, TopicRow};
    use proptest::prelude::*;

    fn sample() -> (Vec<(String, Vec<u8>)>, Bytes) {
        let batch = RolloutRow::to_batch(&(0..8).map(rollout).collect::<Vec<_>>()).unwrap();
        let payload = encode(&batch, Compression::Zstd).unwrap();
        (Headers::data(SchemaId::Rollouts, "test").to_wire(), payload)
    }

    #[test]
    fn round_trip_every_compression() {
        let rows: Vec<_> = (0..8).map(rollout).collect();
        let batch = RolloutRow::to_batch(&rows).unwrap();
        let h = Headers::data(SchemaId::Rollouts, "t").to_wire();
        for c in [Compression::None, Compression::Lz4, Compression::Zstd] {
            let p = encode(&batch, c).unwrap();
            let back = decode(SchemaId::Rollouts, &h, &p).unwrap();
            assert_eq!(RolloutRow::from_batch(&back).unwrap(), rows, "{c:?}");
        }
    }

    #[test]
    fn wrong_schema_is_refused() {
        let (_, payload) = sample();
        // Header says scored: refused by name.
        let h = Headers::data(SchemaId::Scored, "t").to_wire();
        let e = decode(SchemaId::Rollouts, &h, &payload).unwrap_err();
        assert!(matches!(e, Error::WrongSchema { .. }), "{e}");
        // Header lies (says rollouts) but the payload is a policy batch: refused by content.
        let policy = crate::PolicyRow::to_batch(&[crate::PolicyRow {
            run_id: "r".into(),
            version: 1,
            step: 1,
            uri: "u".into(),
            sha256: "s".into(),
            created_at: 0,
        }])
        .unwrap();
        let p = encode(&policy, Compression::Lz4).unwrap();
        let e = decode(
            SchemaId::Rollouts,
            &Headers::data(SchemaId::Rollouts, "t").to_wire(),
            &p,
        )
        .unwrap_err();
        assert!(matches!(e, Error::SchemaMismatch { .. }), "{e}");
        assert!(e.to_string().contains("missing `rollout_id`"), "{e}");
        // A stale fingerprint is refused and both prints are named.
        let mut h = Headers::data(SchemaId::Rollouts, "t");
        h.fingerprint = "0123456789abcdef".into();
        let e = decode(SchemaId::Rollouts, &h.to_wire(), &payload)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("0123456789abcdef") && e.contains(SchemaId::Rollouts.fingerprint()),
            "{e}"
        );
    }

    #[test]
    fn every_truncation_is_an_error() {
        let (h, payload) = sample();
        for cut in 0..payload.len() {
            let e = decode(SchemaId::Rollouts, &h, &payload[..cut]);
            assert!(e.is_err(), "prefix of {cut} bytes decoded");
        }
        let e = decode(SchemaId::Rollouts, &h, &payload[..payload.len() / 2]).unwrap_err();
        assert!(matches!(e, Error::Truncated { .. } | Error::Malformed { .. }), "{e}");
    }

    #[test]
    fn two_batches_are_refused() {
        let batch = RolloutRow::to_batch(&[rollout(0)]).unwrap();
        let mut out = Vec::new();
        let mut w = StreamWriter::try_new(&mut out, &batch.schema()).unwrap();
        w.write(&batch).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
        drop(w);
        let (h, _) = sample();
        let e = decode(SchemaId::Rollouts, &h, &out).unwrap_err();
        assert!(matches!(e, Error::BatchCount { found: 2 }), "{e}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let (h, _) = sample();
            prop_assert!(decode(SchemaId::Rollouts, &h, &bytes).is_err());
        }

        #[test]
        fn bit_flips_never_panic(flips in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..8), 1..8)) {
            let (h, payload) = sample();
            let mut p = payload.to_vec();
            for (i, bit) in flips {
                let i = i.index(p.len());
                p[i] ^= 1 << bit;
            }
            // A flip may land in padding and still decode; what matters is: no panic, and
            // whatever decodes has the right schema.
            if let Ok(b) = decode(SchemaId::Rollouts, &h, &p) {
                prop_assert_eq!(b.schema(), SchemaId::Rollouts.schema());
            }
        }
    }
}

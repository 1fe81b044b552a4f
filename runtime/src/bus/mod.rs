//! The bus: partitioned topics, consumer groups, acknowledgements, broadcast.
//!
//! A [`Bus`] is chosen by URL ([`connect`]): `memory://[name]` is the embedded in-process
//! log (the default), `kafka://host:port[,host:port]` any Kafka-compatible cluster. Both
//! pass the same conformance suite (`tests/bus_*.rs`).
//!
//! Delivery is at-least-once: a consumer [`acknowledges`](Consumer::ack) a message once
//! everything derived from it is delivered, and only acknowledged offsets are committed;
//! whatever was delivered but not acknowledged is delivered again to the partition's next
//! owner.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use streamrl_runtime::bus::{self, Record, TopicSpec};
//!
//! let bus = bus::connect("memory://doc-example").await.unwrap();
//! bus.create_topic(&TopicSpec::new("greetings", 2)).await.unwrap();
//! let producer = bus.producer("doc").await.unwrap();
//! producer.send("greetings", Record::new(b"hello".to_vec()).with_key("k")).await.unwrap().await.unwrap();
//! let mut consumer = bus.subscribe("readers", &["greetings".to_string()]).await.unwrap();
//! let msg = consumer.recv().await.unwrap();
//! assert_eq!(&msg.payload[..], b"hello");
//! consumer.ack(&msg.id()).unwrap();
//! # }
//! ```

pub(crate) mod ack;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod memory;

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;
use streamrl_schemas::WireHeaders;

use crate::{Error, Result};

/// What a topic looks like.
#[derive(Debug, Clone, PartialEq)]
pub struct TopicSpec {
    /// Topic name.
    pub name: String,
    /// Number of partitions.
    pub partitions: u32,
    /// Memory bus: producers block while the topic's unconsumed bytes exceed this.
    /// `None` takes the bus default.
    pub max_unconsumed_bytes: Option<u64>,
}

impl TopicSpec {
    /// A topic with `partitions` partitions and the bus's default bound.
    pub fn new(name: impl Into<String>, partitions: u32) -> Self {
        TopicSpec {
            name: name.into(),
            partitions,
            max_unconsumed_bytes: None,
        }
    }

    /// Sets the unconsumed-bytes bound (memory bus).
    pub fn with_max_unconsumed_bytes(mut self, bytes: u64) -> Self {
        self.max_unconsumed_bytes = Some(bytes);
        self
    }
}

/// A record to produce.
#[derive(Debug, Clone, Default)]
pub struct Record {
    /// Partitioning key; records with equal keys land in one partition, in order.
    pub key: Option<Vec<u8>>,
    /// Headers.
    pub headers: WireHeaders,
    /// Payload.
    pub payload: Bytes,
    /// Explicit partition (overrides the key).
    pub partition: Option<u32>,
}

impl Record {
    /// A record with this payload, no key, no headers.
    pub fn new(payload: impl Into<Bytes>) -> Self {
        Record {
            payload: payload.into(),
            ..Default::default()
        }
    }
    /// Sets the key.
    pub fn with_key(mut self, key: impl AsRef<[u8]>) -> Self {
        self.key = Some(key.as_ref().to_vec());
        self
    }
    /// Sets the headers.
    pub fn with_headers(mut self, headers: WireHeaders) -> Self {
        self.headers = headers;
        self
    }
    /// Bytes this record occupies on the bus (payload, key and headers).
    pub fn size(&self) -> usize {
        self.payload.len()
            + self.key.as_ref().map_or(0, Vec::len)
            + self.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
    }
}

/// Where a message lives.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: u32,
    /// Offset within the partition.
    pub offset: u64,
    /// The consumer's assignment epoch when the message was delivered: an
    /// acknowledgement of a delivery from before a rebalance is ignored (the partition's
    /// new owner, or this consumer after it was reassigned, gets the record again).
    pub epoch: u64,
}

/// A consumed message.
#[derive(Debug, Clone)]
pub struct Message {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: u32,
    /// Offset within the partition.
    pub offset: u64,
    /// Key, if any.
    pub key: Option<Vec<u8>>,
    /// Headers.
    pub headers: WireHeaders,
    /// Payload.
    pub payload: Bytes,
    /// Append time, ms since epoch.
    pub timestamp_ms: i64,
    /// The consumer's assignment epoch at delivery (see [`MessageId::epoch`]).
    pub epoch: u64,
}

impl Message {
    /// The message's id, for [`Consumer::ack`].
    pub fn id(&self) -> MessageId {
        MessageId {
            topic: self.topic.clone(),
            partition: self.partition,
            offset: self.offset,
            epoch: self.epoch,
        }
    }

    /// A header value as UTF-8, if present and valid.
    pub fn header(&self, key: &str) -> Option<&str> {
        self.headers
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }
}

/// Where a produced record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// Partition.
    pub partition: u32,
    /// Offset.
    pub offset: u64,
}

/// Resolves when the bus has durably accepted a record.
pub type DeliveryFuture = BoxFuture<'static, Result<Delivery>>;

/// Per-partition position and lag of one consumer group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionStats {
    /// Partition.
    pub partition: u32,
    /// First retained offset.
    pub start_offset: u64,
    /// Offset the next record will get.
    pub end_offset: u64,
    /// Committed offset per group asked about (`None`: nothing committed).
    pub committed: Vec<(String, Option<u64>)>,
}

impl PartitionStats {
    /// Records the group still has to read here.
    pub fn lag(&self, group: &str) -> Option<u64> {
        self.committed
            .iter()
            .find(|(g, _)| g == group)
            .map(|(_, c)| self.end_offset - c.unwrap_or(self.start_offset).min(self.end_offset))
    }
}

/// What a backend can promise, for tests and tools that must know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Producers wait while a topic's unconsumed bytes exceed its bound (memory bus). A
    /// Kafka broker keeps a durable log instead, and the producer's bound is its own
    /// in-flight queue.
    pub blocks_on_unconsumed: bool,
    /// Largest record the bus accepts, in bytes.
    pub max_record_bytes: usize,
}

/// A message bus backend.
#[async_trait]
pub trait Bus: Send + Sync + 'static {
    /// The URL this bus was opened with.
    fn url(&self) -> &str;

    /// What this backend guarantees.
    fn capabilities(&self) -> Capabilities;

    /// Creates a topic; creating an existing topic with the same partition count is a
    /// no-op, with another count an error.
    async fn create_topic(&self, spec: &TopicSpec) -> Result<()>;

    /// Names of existing topics.
    async fn topics(&self) -> Result<Vec<String>>;

    /// A producer identified as `client_id`.
    async fn producer(&self, client_id: &str) -> Result<Arc<dyn Producer>>;

    /// Joins consumer group `group` reading `topics`. Partitions are spread over the
    /// group's members and re-spread when members join or leave.
    async fn subscribe(&self, group: &str, topics: &[String]) -> Result<Box<dyn Consumer>>;

    /// Like [`subscribe`](Bus::subscribe), as the named member `member` of the group (a
    /// stage replica, e.g. `rollout-1`): where the backend supports it (Kafka static
    /// membership), a member that comes back under the same name within the session
    /// timeout takes its partitions back without a rebalance of the whole group.
    async fn subscribe_as(&self, group: &str, member: &str, topics: &[String]) -> Result<Box<dyn Consumer>> {
        let _ = member;
        self.subscribe(group, topics).await
    }

    /// A broadcast subscription: sees the newest message of each partition of `topic`
    /// (its current value, e.g. the latest policy version) and every message after it,
    /// whoever else reads it; never older history, so a restarted reader does not replay
    /// the past. Nothing is committed.
    async fn broadcast(&self, topic: &str) -> Result<Box<dyn Consumer>>;

    /// Per-partition offsets of `topic` and the committed offsets of `groups`.
    async fn topic_stats(&self, topic: &str, groups: &[String]) -> Result<Vec<PartitionStats>>;

    /// Every topic (internal ones aside) with its partition count, in one round trip.
    async fn topic_partitions(&self) -> Result<std::collections::BTreeMap<String, u32>>;

    /// Bytes this bus holds in memory for `topic` that are not yet consumed (memory bus)
    /// or not yet delivered to the broker (Kafka producers of this process).
    fn buffered_bytes(&self, topic: &str) -> u64;
}

/// Produces records to topics.
#[async_trait]
pub trait Producer: Send + Sync {
    /// Hands a record to the bus, waiting while the bus applies backpressure; the returned
    /// future resolves when the record is durably accepted. Await several at once for
    /// throughput.
    async fn send(&self, topic: &str, record: Record) -> Result<DeliveryFuture>;

    /// Waits until every record handed over so far is delivered.
    async fn flush(&self) -> Result<()>;
}

/// Consumes records as a member of a group (or as a broadcast subscriber).
#[async_trait]
pub trait Consumer: Send {
    /// The next message from any assigned partition (waits for one).
    async fn recv(&mut self) -> Result<Message>;

    /// Marks a delivered message as done. Only acknowledged messages are committed; a
    /// message never acknowledged is delivered again to the partition's next owner.
    fn ack(&mut self, id: &MessageId) -> Result<()>;

    /// Commits acknowledged positions now (they are also committed periodically).
    async fn commit(&mut self) -> Result<()>;

    /// Partitions currently assigned to this member.
    fn assignment(&self) -> Vec<(String, u32)>;

    /// Leaves the group cleanly after committing. Dropping a consumer without `close`
    /// models a crash: nothing more is committed.
    async fn close(self: Box<Self>) -> Result<()>;
}

/// Opens the bus a URL names.
pub async fn connect(url: &str) -> Result<Arc<dyn Bus>> {
    match scheme(url)? {
        "memory" => Ok(memory::MemoryBus::open(url)?),
        #[cfg(feature = "kafka")]
        "kafka" => Ok(Arc::new(kafka::KafkaBus::connect(url).await?)),
        #[cfg(not(feature = "kafka"))]
        "kafka" => Err(Error::FeatureNotEnabled {
            url: url.to_string(),
            feature: "kafka",
        }),
        other => unreachable!("scheme() admits only SCHEMES, not `{other}`"),
    }
}

/// The bus URL schemes [`connect`] knows, in the order error messages list them.
pub const SCHEMES: [&str; 2] = ["memory", "kafka"];

/// The scheme of a bus URL, one of [`SCHEMES`]; an error names the URL and says why not.
/// (The rest of a URL is the backend's: a Kafka bootstrap list `host:port,host:port` is
/// no authority the `url` crate accepts, so only the query is parsed with it.)
pub fn scheme(url: &str) -> Result<&'static str> {
    let Some((scheme, _)) = url.split_once("://") else {
        return Err(Error::InvalidUrl {
            url: url.to_string(),
            reason: "expected scheme://..., e.g. memory:// or kafka://127.0.0.1:9092".into(),
        });
    };
    SCHEMES
        .iter()
        .copied()
        .find(|s| *s == scheme)
        .ok_or_else(|| Error::InvalidUrl {
            url: url.to_string(),
            reason: format!("unknown scheme `{scheme}` (known: {})", SCHEMES.join(", ")),
        })
}

/// The newest message of each non-empty partition of `topic`, read as a broadcast reader
/// does (nothing is committed), in partition order; empty for an empty topic. For a stage
/// that must know at start what a topic already holds (a restarted trainer: whether its
/// newest version reached `policy` before it was killed). Waits at most `patience` for
/// the bus to hand them over.
pub async fn newest(bus: &dyn Bus, topic: &str, patience: std::time::Duration) -> Result<Vec<Message>> {
    let stats = bus.topic_stats(topic, &[]).await?;
    let mut last: std::collections::BTreeMap<u32, Option<Message>> = stats
        .iter()
        .filter(|s| s.end_offset > s.start_offset)
        .map(|s| (s.partition, None))
        .collect();
    if last.is_empty() {
        return Ok(Vec::new());
    }
    // The newest message read of each partition asked about wins.
    fn keep(last: &mut std::collections::BTreeMap<u32, Option<Message>>, m: Message) {
        if let Some(slot) = last.get_mut(&m.partition)
            && slot.as_ref().is_none_or(|old| old.offset < m.offset)
        {
            *slot = Some(m);
        }
    }
    let mut reader = bus.broadcast(topic).await?;
    let deadline = tokio::time::Instant::now() + patience;
    let ends: std::collections::BTreeMap<u32, u64> = stats.iter().map(|s| (s.partition, s.end_offset)).collect();
    // The reader starts at the newest record of each partition; keep reading until each
    // partition's record at or after the end seen above has arrived (a concurrent writer
    // may have added more: the newest one read wins).
    while last
        .iter()
        .any(|(p, m)| m.as_ref().is_none_or(|m| m.offset + 1 < ends[p]))
    {
        let m = tokio::time::timeout_at(deadline, reader.recv())
            .await
            .map_err(|_| Error::Timeout {
                op: format!("reading the newest message of each partition of `{topic}`"),
                secs: patience.as_secs(),
            })??;
        keep(&mut last, m);
    }
    // Some brokers (tansu) report a partition's end as one past its last record *batch*,
    // not its last record: the rest of that batch follows at once, so read on until the
    // reader has been quiet for a moment.
    while let Ok(m) = tokio::time::timeout(std::time::Duration::from_millis(300), reader.recv()).await {
        keep(&mut last, m?);
    }
    reader.close().await?;
    Ok(last.into_values().flatten().collect())
}

/// The partition a key maps to: murmur2 like the Java client's default partitioner, so
/// every streamrl backend and any Java producer agree.
pub fn partition_for_key(key: &[u8], partitions: u32) -> u32 {
    (murmur2(key) & 0x7fff_ffff) % partitions.max(1)
}

fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    const SEED: u32 = 0x9747_b28c;
    let mut h: u32 = SEED ^ data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= (rest[2] as u32) << 16;
    }
    if rest.len() >= 2 {
        h ^= (rest[1] as u32) << 8;
    }
    if !rest.is_empty() {
        h ^= rest[0] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

/// Parses `?k=v&...` query parameters of a bus URL (percent-decoded by the `url` crate's
/// form decoder).
pub(crate) fn query_params(url: &str) -> Result<(String, Vec<(String, String)>)> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    if let Some(pair) = query.split('&').find(|p| !p.is_empty() && !p.contains('=')) {
        return Err(Error::InvalidUrl {
            url: url.to_string(),
            reason: format!("query parameter `{pair}` is not key=value"),
        });
    }
    let out = url::form_urlencoded::parse(query.as_bytes()).into_owned().collect();
    Ok((base.to_string(), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_the_java_client() {
        // Values from Kafka's Java `Utils.murmur2` test vectors.
        assert_eq!(murmur2(b"21") as i32, -973932308);
        assert_eq!(murmur2(b"foobar") as i32, -790332482);
        assert_eq!(murmur2(b"a-little-bit-long-string") as i32, -985981536);
        assert_eq!(murmur2(b"a-little-bit-longer-string") as i32, -1486304829);
        assert_eq!(
            murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8") as i32,
            -58897971
        );
        assert_eq!(murmur2(b"abc") as i32, 479470107);
    }

    #[tokio::test]
    async fn unknown_and_malformed_urls_are_named() {
        let e = connect("redis://x").await.err().unwrap().to_string();
        assert!(e.contains("redis") && e.contains("memory, kafka"), "{e}");
        let e = connect("localhost:9092").await.err().unwrap().to_string();
        assert!(e.contains("localhost:9092"), "{e}");
    }
}

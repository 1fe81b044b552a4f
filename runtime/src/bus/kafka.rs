//! `kafka://host:port[,host:port][?param=value...]` — any Kafka-compatible cluster, via
//! rdkafka (bundled librdkafka).
//!
//! * Producers are idempotent (`enable.idempotence=true`, `acks=all`); the partition is
//!   computed here with the same murmur2 hash as the memory bus and the Java client.
//!   `idempotence=false` turns that off (retries then keep order with one request in
//!   flight per broker, and may write a record twice): for a broker whose producer
//!   sequence bookkeeping is not atomic with its log. tansu 0.6's `s3://` engine is one:
//!   it records a batch's sequence number and advances the partition's high watermark
//!   before it writes the batch, so a broker killed between the two answers the
//!   producer's retry with `DUPLICATE_SEQUENCE_NUMBER`, which an idempotent producer must
//!   take as success — an acknowledged record is lost. Without idempotence the retry is
//!   written again; the pipeline reconciles duplicates (see the README's guarantees).
//! * A producer whose client enters a fatal state (an idempotent producer's sequence
//!   bookkeeping given up, e.g. after a broker lost its producer state) re-creates the
//!   client and sends again every record the old one failed ([`KafkaProducer`]): none is
//!   lost; one whose first copy did reach the log is written twice, a copy the pipeline
//!   reconciles.
//! * Consumers use `enable.auto.offset.store=false`: an offset is stored only when the
//!   message is acknowledged (after its outputs were delivered) and only up to the first
//!   unacknowledged offset; stored offsets are auto-committed every second, committed
//!   synchronously when partitions are revoked, and on [`Consumer::close`].
//! * Broadcast readers assign every partition manually from its newest record (no group).
//! * A group reading several topics is one Kafka consumer group per topic,
//!   `<group>.<topic>` ([`kafka_group`]), so each topic's partitions are spread over the
//!   replicas on their own (one Kafka group over all of them balances only each member's
//!   total); the consumers are merged into one [`Consumer`].
//! * Cooperative rebalancing (`cooperative-sticky`): when a replica dies or joins, only
//!   the partitions that move are revoked; the others keep consuming. Acknowledgement
//!   trackers are per partition and per assignment epoch, so a kept partition keeps its
//!   position and a moved one starts afresh.
//! * Consumers never auto-create topics (`allow.auto.create.topics=false`): topics are
//!   created with the topology's partition counts before any stage starts.
//! * Static membership (`static_membership=true`): a stage replica joins with
//!   `group.instance.id = <stage>-<replica>`, so a replica restarted within the session
//!   timeout takes its partitions back without a rebalance of the others. Off by default:
//!   tansu 0.6 lets a restarted static member wait ~20 s for its assignment, where a
//!   dynamic member with a short session timeout is consuming again in ~3 s.
//! * A SIGKILLed member's partitions move after `session_timeout_ms` (default 6000, the
//!   lowest Apache Kafka accepts by default; tansu accepts less, e.g. 3000). It is also
//!   how long a heartbeat may take: below the broker's worst heartbeat latency, members
//!   are expelled and rejoin over and over (seen with 1000 on tansu's S3 engine under
//!   load: a rebalance storm that stalled consumers for minutes).
//! * Broker outages do not end a consumer: transient errors (all brokers down, transport
//!   failures) are logged and retried with backoff; only fatal errors are returned.
//! * `fetch_wait_ms` (default 50) is how long the broker may hold a fetch that finds no
//!   data (`fetch.wait.max.ms`). Apache Kafka and Redpanda answer as soon as data arrives,
//!   so there a longer wait (Kafka's default is 500) costs no latency and saves the
//!   broker a poll per consumer every 50 ms. tansu 0.6 holds every fetch for the full wait,
//!   data or not, so each hop of the pipeline pays it: keep it short on tansu.
//!
//! URL parameters: `queue_kbytes` (producer in-flight bound, default 65536),
//! `session_timeout_ms` (default 6000), `max_message_bytes` (default 16 MiB),
//! `static_membership` (default false), `idempotence` (default true), `fetch_wait_ms`
//! (default 50).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::FutureExt;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use super::ack::PartitionAcks;
use super::{
    Bus, Capabilities, Consumer, Delivery, DeliveryFuture, Message, MessageId, PartitionStats, Producer, Record,
    TopicSpec, partition_for_key,
};
use crate::{Error, Result};

const TIMEOUT: Duration = Duration::from_secs(10);

fn kerr(op: &'static str) -> impl Fn(KafkaError) -> Error {
    move |e| Error::Kafka {
        op,
        reason: e.to_string(),
    }
}

#[derive(Debug, Clone)]
struct Options {
    brokers: String,
    queue_kbytes: u64,
    session_timeout_ms: u64,
    max_message_bytes: usize,
    static_membership: bool,
    idempotence: bool,
    fetch_wait_ms: u64,
}

/// A Kafka cluster.
pub struct KafkaBus {
    url: String,
    opts: Options,
    admin: AdminClient<DefaultClientContext>,
    /// Partition counts seen, so producers can hash keys themselves.
    partitions: Arc<Mutex<HashMap<String, u32>>>,
    /// Bytes handed to producers of this process and not yet acknowledged, per topic.
    in_flight: InFlight,
}

impl KafkaBus {
    /// Connects to the cluster of `url` (checks that brokers answer).
    pub async fn connect(url: &str) -> Result<KafkaBus> {
        let (base, params) = super::query_params(url)?;
        let brokers = base
            .strip_prefix("kafka://")
            .unwrap_or("")
            .trim_end_matches('/')
            .to_string();
        if brokers.is_empty() {
            return Err(Error::InvalidUrl {
                url: url.into(),
                reason: "no broker address (kafka://host:port)".into(),
            });
        }
        let mut opts = Options {
            brokers,
            queue_kbytes: 65536,
            session_timeout_ms: 6_000,
            max_message_bytes: 16 << 20,
            static_membership: false,
            idempotence: true,
            fetch_wait_ms: 50,
        };
        for (k, v) in params {
            let num = |v: &str| -> Result<u64> {
                v.parse().map_err(|_| Error::InvalidUrl {
                    url: url.into(),
                    reason: format!("`{k}={v}` is not a number"),
                })
            };
            let flag = |v: &str| -> Result<bool> {
                v.parse().map_err(|_| Error::InvalidUrl {
                    url: url.into(),
                    reason: format!("`{k}={v}` is not true or false"),
                })
            };
            match k.as_str() {
                "queue_kbytes" => opts.queue_kbytes = num(&v)?,
                "session_timeout_ms" => opts.session_timeout_ms = num(&v)?,
                "max_message_bytes" => opts.max_message_bytes = num(&v)? as usize,
                "static_membership" => opts.static_membership = flag(&v)?,
                "idempotence" => opts.idempotence = flag(&v)?,
                "fetch_wait_ms" => opts.fetch_wait_ms = num(&v)?,
                other => {
                    return Err(Error::InvalidUrl {
                        url: url.into(),
                        reason: format!(
                            "unknown parameter `{other}` (known: queue_kbytes, session_timeout_ms, max_message_bytes, static_membership, idempotence, fetch_wait_ms)"
                        ),
                    });
                }
            }
        }
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &opts.brokers)
            .create()
            .map_err(kerr("creating admin client"))?;
        let bus = KafkaBus {
            url: url.to_string(),
            opts,
            admin,
            partitions: Default::default(),
            in_flight: Default::default(),
        };
        let probe = bus.base_consumer(None)?;
        tokio::task::spawn_blocking(move || probe.fetch_metadata(None, TIMEOUT))
            .await
            .map_err(|e| Error::Kafka {
                op: "fetching metadata",
                reason: e.to_string(),
            })?
            .map_err(|e| Error::Kafka {
                op: "reaching brokers",
                reason: format!("{e} (url {url})"),
            })?;
        Ok(bus)
    }

    fn consumer_config(&self, group: &str) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.opts.brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "true")
            .set("auto.commit.interval.ms", "1000")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("allow.auto.create.topics", "false")
            // Incremental rebalances: members keep their partitions (and positions) while
            // another joins or dies; only the partitions that move are revoked.
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("session.timeout.ms", self.opts.session_timeout_ms.to_string())
            .set(
                "heartbeat.interval.ms",
                (self.opts.session_timeout_ms / 5).max(100).to_string(),
            )
            .set("fetch.wait.max.ms", self.opts.fetch_wait_ms.to_string())
            .set("fetch.max.bytes", (self.opts.max_message_bytes * 4).to_string())
            .set(
                "max.partition.fetch.bytes",
                (self.opts.max_message_bytes * 2).to_string(),
            )
            .set(
                "receive.message.max.bytes",
                (self.opts.max_message_bytes * 4 + 1024 * 1024).to_string(),
            );
        c
    }

    fn base_consumer(&self, group: Option<&str>) -> Result<BaseConsumer> {
        let mut c = self.consumer_config(group.unwrap_or("streamrl-admin"));
        c.set("enable.auto.commit", "false");
        c.create().map_err(kerr("creating consumer"))
    }

    async fn partition_count(&self, topic: &str) -> Result<u32> {
        let client = self.base_consumer(None)?;
        cached_partition_count(&self.partitions, topic, move |t| {
            client.fetch_metadata(Some(t), TIMEOUT)
        })
        .await
    }
}

/// Bytes handed to producers of this process and not yet acknowledged, per topic.
type InFlight = Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>;

/// `topic`'s counter in `in_flight`, created at zero.
fn in_flight_counter(in_flight: &InFlight, topic: &str) -> Arc<AtomicU64> {
    in_flight
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(topic.to_string())
        .or_default()
        .clone()
}

#[async_trait]
impl Bus for KafkaBus {
    fn url(&self) -> &str {
        &self.url
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            blocks_on_unconsumed: false,
            max_record_bytes: self.opts.max_message_bytes,
        }
    }

    async fn create_topic(&self, spec: &TopicSpec) -> Result<()> {
        let max = self.opts.max_message_bytes.to_string();
        let topic = NewTopic::new(&spec.name, spec.partitions as i32, TopicReplication::Fixed(1))
            .set("max.message.bytes", &max);
        let res = self
            .admin
            .create_topics([&topic], &AdminOptions::new().operation_timeout(Some(TIMEOUT)))
            .await
            .map_err(kerr("creating topic"))?;
        for r in res {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => {
                    return Err(Error::Kafka {
                        op: "creating topic",
                        reason: format!("`{name}`: {code}"),
                    });
                }
            }
        }
        // Metadata can lag creation; wait until the partitions are visible.
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        loop {
            self.partitions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&spec.name);
            match self.partition_count(&spec.name).await {
                Ok(n) if n == spec.partitions => return Ok(()),
                Ok(n) => {
                    return Err(Error::PartitionMismatch {
                        topic: spec.name.clone(),
                        existing: n,
                        wanted: spec.partitions,
                    });
                }
                Err(e) if tokio::time::Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn topics(&self) -> Result<Vec<String>> {
        let c = self.base_consumer(None)?;
        tokio::task::spawn_blocking(move || {
            let md = c.fetch_metadata(None, TIMEOUT).map_err(kerr("fetching metadata"))?;
            let mut v: Vec<String> = md
                .topics()
                .iter()
                .map(|t| t.name().to_string())
                .filter(|n| !n.starts_with("__"))
                .collect();
            v.sort();
            Ok(v)
        })
        .await
        .map_err(|e| Error::Kafka {
            op: "fetching metadata",
            reason: e.to_string(),
        })?
    }

    async fn producer(&self, client_id: &str) -> Result<Arc<dyn Producer>> {
        Ok(Arc::new(self.kafka_producer(client_id)?))
    }

    async fn subscribe(&self, group: &str, topics: &[String]) -> Result<Box<dyn Consumer>> {
        self.join(group, None, topics).await
    }

    async fn subscribe_as(&self, group: &str, member: &str, topics: &[String]) -> Result<Box<dyn Consumer>> {
        self.join(group, Some(member), topics).await
    }

    async fn broadcast(&self, topic: &str) -> Result<Box<dyn Consumer>> {
        let n = self.partition_count(topic).await?;
        let shared = Arc::new(Mutex::new(Assignment::default()));
        let mut cfg = self.consumer_config(&format!("streamrl-broadcast-{}", uuid::Uuid::new_v4()));
        cfg.set("enable.auto.commit", "false");
        let consumer: StreamConsumer<RebalanceContext> = cfg
            .create_with_context(RebalanceContext {
                shared: shared.clone(),
                name: format!("broadcast {topic}"),
            })
            .map_err(kerr("creating consumer"))?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..n {
            // The newest record (the current value), then everything after it.
            tpl.add_partition_offset(topic, p as i32, Offset::OffsetTail(1))
                .map_err(kerr("assigning"))?;
            shared
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .owned
                .insert((topic.to_string(), p));
        }
        consumer.assign(&tpl).map_err(kerr("assigning"))?;
        Ok(Box::new(KafkaConsumer {
            consumer,
            shared,
            acks: HashMap::new(),
            broadcast: true,
        }))
    }

    async fn topic_partitions(&self) -> Result<std::collections::BTreeMap<String, u32>> {
        let c = self.base_consumer(None)?;
        let found = tokio::task::spawn_blocking(move || -> Result<std::collections::BTreeMap<String, u32>> {
            let md = c.fetch_metadata(None, TIMEOUT).map_err(kerr("fetching metadata"))?;
            Ok(md
                .topics()
                .iter()
                .filter(|t| !t.name().starts_with("__") && t.error().is_none() && !t.partitions().is_empty())
                .map(|t| (t.name().to_string(), t.partitions().len() as u32))
                .collect())
        })
        .await
        .map_err(|e| Error::Kafka {
            op: "fetching metadata",
            reason: e.to_string(),
        })??;
        self.partitions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(found.iter().map(|(k, v)| (k.clone(), *v)));
        Ok(found)
    }

    async fn topic_stats(&self, topic: &str, groups: &[String]) -> Result<Vec<PartitionStats>> {
        let n = self.partition_count(topic).await?;
        let mut consumers = Vec::new();
        for g in groups {
            consumers.push((g.clone(), self.base_consumer(Some(&kafka_group(g, topic)))?));
        }
        let probe = self.base_consumer(None)?;
        let topic = topic.to_string();
        tokio::task::spawn_blocking(move || -> Result<Vec<PartitionStats>> {
            let mut committed: Vec<(String, HashMap<u32, u64>)> = Vec::new();
            for (g, c) in &consumers {
                let mut tpl = TopicPartitionList::new();
                for p in 0..n {
                    tpl.add_partition(&topic, p as i32);
                }
                let got = c
                    .committed_offsets(tpl, TIMEOUT)
                    .map_err(kerr("reading committed offsets"))?;
                let mut m = HashMap::new();
                for e in got.elements() {
                    if let Offset::Offset(o) = e.offset() {
                        m.insert(e.partition() as u32, o as u64);
                    }
                }
                committed.push((g.clone(), m));
            }
            (0..n)
                .map(|p| {
                    let (lo, hi) = probe
                        .fetch_watermarks(&topic, p as i32, TIMEOUT)
                        .map_err(kerr("fetching watermarks"))?;
                    Ok(PartitionStats {
                        partition: p,
                        start_offset: lo.max(0) as u64,
                        end_offset: hi.max(0) as u64,
                        committed: committed.iter().map(|(g, m)| (g.clone(), m.get(&p).copied())).collect(),
                    })
                })
                .collect()
        })
        .await
        .map_err(|e| Error::Kafka {
            op: "topic stats",
            reason: e.to_string(),
        })?
    }

    fn buffered_bytes(&self, topic: &str) -> u64 {
        in_flight_counter(&self.in_flight, topic).load(Ordering::Relaxed)
    }
}

/// The Kafka consumer group that holds the offsets of logical group `group` on `topic`:
/// `<group>.<topic>`. A group reading several topics is one Kafka group per topic, each
/// balanced over the members on its own. In one Kafka group, `cooperative-sticky` balances
/// how many partitions each member owns in all, not per topic: a second rollout replica
/// joining a group on `prompts` and `continuations` (4 partitions each) was handed all 4 of
/// `continuations` and none of `prompts`, so it generated nothing.
pub fn kafka_group(group: &str, topic: &str) -> String {
    format!("{group}.{topic}")
}

impl KafkaBus {
    /// A group member reading `topics`; with `member`, a static one (`group.instance.id`).
    /// One Kafka consumer per topic ([`kafka_group`]), merged into one [`Consumer`].
    async fn join(&self, group: &str, member: Option<&str>, topics: &[String]) -> Result<Box<dyn Consumer>> {
        let mut parts = Vec::with_capacity(topics.len());
        for topic in topics {
            self.partition_count(topic).await?;
            let shared = Arc::new(Mutex::new(Assignment::default()));
            let ctx = RebalanceContext {
                shared: shared.clone(),
                name: format!("{}/{topic}", member.unwrap_or(group)),
            };
            let mut cfg = self.consumer_config(&kafka_group(group, topic));
            if let Some(m) = member.filter(|_| self.opts.static_membership) {
                cfg.set("group.instance.id", m);
            }
            let consumer: StreamConsumer<RebalanceContext> =
                cfg.create_with_context(ctx).map_err(kerr("creating consumer"))?;
            consumer.subscribe(&[topic.as_str()]).map_err(kerr("subscribing"))?;
            let part = KafkaConsumer {
                consumer,
                shared,
                acks: HashMap::new(),
                broadcast: false,
            };
            parts.push((topic.clone(), part));
        }
        Ok(if parts.len() == 1 {
            Box::new(parts.pop().expect("one part").1)
        } else {
            Box::new(Merged { parts, next: 0 })
        })
    }

    /// A producer of this cluster (what [`Bus::producer`] returns, with its own type).
    pub fn kafka_producer(&self, client_id: &str) -> Result<KafkaProducer> {
        let mut cfg = ClientConfig::new();
        cfg.set("bootstrap.servers", &self.opts.brokers)
            .set("client.id", client_id)
            .set("enable.idempotence", self.opts.idempotence.to_string())
            .set("acks", "all");
        if !self.opts.idempotence {
            // Without sequence numbers only one request in flight keeps retries in order.
            cfg.set("max.in.flight.requests.per.connection", "1");
        }
        cfg.set("linger.ms", "5")
            .set("compression.type", "none") // payloads are already zstd/lz4 Arrow IPC
            .set(
                "message.max.bytes",
                (self.opts.max_message_bytes + 64 * 1024).to_string(),
            )
            .set("queue.buffering.max.kbytes", self.opts.queue_kbytes.to_string())
            .set("queue.buffering.max.messages", "100000");
        let producer: FutureProducer = cfg.create().map_err(kerr("creating producer"))?;
        Ok(KafkaProducer {
            core: Arc::new(ProducerCore {
                current: Mutex::new((producer, 0)),
                config: cfg,
                bus: self.shallow(),
                resent: AtomicU64::new(0),
            }),
        })
    }

    fn shallow(&self) -> Shallow {
        Shallow {
            partitions: self.partitions.clone(),
            in_flight: self.in_flight.clone(),
            max: self.opts.max_message_bytes,
        }
    }
}

/// What a producer needs of its bus.
struct Shallow {
    partitions: Arc<Mutex<HashMap<String, u32>>>,
    in_flight: InFlight,
    max: usize,
}

/// A producer that replaces its client after a fatal error.
///
/// An idempotent producer's client can enter a fatal state (librdkafka gives up on a
/// partition's sequence bookkeeping, e.g. after the broker lost the producer's state in
/// a restart): every record in flight fails and every later send is refused. The client
/// is then re-created from the same configuration, once per fatal error however many
/// sends notice it, and each record whose delivery failed that way is sent again on the
/// new one (its fate on the broker unknown, it may be written twice: a copy the pipeline
/// reconciles like any redelivery; none is lost).
pub struct KafkaProducer {
    core: Arc<ProducerCore>,
}

struct ProducerCore {
    /// The client now, and how many times it was re-created before.
    current: Mutex<(FutureProducer, u64)>,
    config: ClientConfig,
    bus: Shallow,
    /// Records sent again after a fatal error failed them.
    resent: AtomicU64,
}

/// How often one record is sent again after fatal errors before its delivery fails.
const FATAL_RESENDS: u32 = 3;

impl ProducerCore {
    fn client(&self) -> (FutureProducer, u64) {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Re-creates the client if it is still the one of `generation` and in a fatal state
    /// (the first of several sends that notice a fatal error does it); whether that client
    /// had one.
    fn renew_if_fatal(&self, generation: u64) -> Result<bool> {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.1 != generation {
            return Ok(true);
        }
        let Some((code, reason)) = cur.0.client().fatal_error() else {
            return Ok(false);
        };
        let fresh: FutureProducer = self.config.create().map_err(kerr("re-creating producer"))?;
        tracing::warn!(error = %code, %reason, generation = generation + 1, "producer: fatal error, client re-created; records in flight are sent again");
        *cur = (fresh, generation + 1);
        Ok(true)
    }

    /// Hands `record` (checked, partition resolved) to the current client; waits while its
    /// queue is full, and moves to a new client after a fatal error.
    async fn enqueue(
        self: &Arc<Self>,
        topic: &str,
        record: &Record,
        partition: Option<i32>,
    ) -> Result<(rdkafka::producer::DeliveryFuture, u64)> {
        let mut backoff = Duration::from_micros(200);
        let mut renewals = 0;
        loop {
            let (producer, generation) = self.client();
            let mut headers = OwnedHeaders::new_with_capacity(record.headers.len());
            for (k, v) in &record.headers {
                headers = headers.insert(Header { key: k, value: Some(v) });
            }
            let mut rec: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(topic).payload(&record.payload[..]).headers(headers);
            if let Some(k) = &record.key {
                rec = rec.key(&k[..]);
            }
            if let Some(p) = partition {
                rec = rec.partition(p);
            }
            match producer.send_result(rec) {
                Ok(fut) => return Ok((fut, generation)),
                // Backpressure: the client's bounded queue is full; wait for deliveries.
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(20));
                }
                Err((e, _)) => {
                    if renewals < FATAL_RESENDS && self.renew_if_fatal(generation)? {
                        renewals += 1;
                        continue;
                    }
                    return Err(Error::Kafka {
                        op: "producing",
                        reason: format!("to `{topic}`: {e}"),
                    });
                }
            }
        }
    }

    /// Sends `record` and waits for the broker's answer, sending it again on a new client
    /// when the old one failed it with a fatal error.
    async fn deliver(
        self: Arc<Self>,
        topic: String,
        record: Record,
        partition: Option<i32>,
        first: (rdkafka::producer::DeliveryFuture, u64),
    ) -> Result<Delivery> {
        let (mut fut, mut generation) = first;
        let mut resends = 0;
        loop {
            match fut.await {
                Ok(Ok(d)) => {
                    return Ok(Delivery {
                        partition: d.partition as u32,
                        offset: d.offset as u64,
                    });
                }
                Ok(Err((e, _))) => {
                    if resends < FATAL_RESENDS && self.renew_if_fatal(generation)? {
                        resends += 1;
                        self.resent.fetch_add(1, Ordering::Relaxed);
                        (fut, generation) = self.enqueue(&topic, &record, partition).await?;
                        continue;
                    }
                    return Err(Error::Kafka {
                        op: "delivering",
                        reason: format!("to `{topic}`: {e}"),
                    });
                }
                Err(_) => return Err(Error::Closed("waiting for delivery")),
            }
        }
    }
}

impl KafkaProducer {
    async fn partitions(&self, topic: &str) -> Result<u32> {
        let p = self.core.client().0;
        cached_partition_count(&self.core.bus.partitions, topic, move |t| {
            p.client().fetch_metadata(Some(t), TIMEOUT)
        })
        .await
    }

    /// How many times the client was re-created after a fatal error.
    pub fn renewals(&self) -> u64 {
        self.core.client().1
    }

    /// How many records were sent again after a fatal error failed their delivery.
    pub fn resent(&self) -> u64 {
        self.core.resent.load(Ordering::Relaxed)
    }

    /// Puts the client in a fatal state as a real fatal error would (librdkafka's
    /// `rd_kafka_test_fatal_error`, made for testing this): for tests.
    #[doc(hidden)]
    pub fn inject_fatal_error(&self, reason: &str) {
        let (p, _) = self.core.client();
        let reason = std::ffi::CString::new(reason).unwrap_or_default();
        // SAFETY: the client pointer is valid while `p` lives; librdkafka copies `reason`.
        #[allow(unsafe_code)]
        unsafe {
            rdkafka::bindings::rd_kafka_test_fatal_error(
                p.client().native_ptr(),
                rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER,
                reason.as_ptr(),
            );
        }
    }
}

/// A topic's partition count, from the cache or else from broker metadata (fetched on a
/// blocking thread: rdkafka's metadata call blocks).
async fn cached_partition_count<F>(cache: &Mutex<HashMap<String, u32>>, topic: &str, fetch: F) -> Result<u32>
where
    F: FnOnce(&str) -> rdkafka::error::KafkaResult<rdkafka::metadata::Metadata> + Send + 'static,
{
    if let Some(n) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(topic) {
        return Ok(*n);
    }
    let t = topic.to_string();
    let n = tokio::task::spawn_blocking(move || -> Result<u32> {
        let md = fetch(&t).map_err(kerr("fetching metadata"))?;
        match md.topics().iter().find(|x| x.name() == t) {
            Some(mt) if mt.error().is_none() && !mt.partitions().is_empty() => Ok(mt.partitions().len() as u32),
            _ => Err(Error::UnknownTopic(t.clone())),
        }
    })
    .await
    .map_err(|e| Error::Kafka {
        op: "fetching metadata",
        reason: e.to_string(),
    })??;
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(topic.to_string(), n);
    Ok(n)
}

#[async_trait]
impl Producer for KafkaProducer {
    async fn send(&self, topic: &str, record: Record) -> Result<DeliveryFuture> {
        let size = record.size();
        if size > self.core.bus.max {
            return Err(Error::RecordTooLarge {
                topic: topic.to_string(),
                size,
                limit: self.core.bus.max,
            });
        }
        let n = self.partitions(topic).await?;
        let partition = match (record.partition, &record.key) {
            (Some(p), _) => Some((p % n) as i32),
            (None, Some(k)) => Some(partition_for_key(k, n) as i32),
            (None, None) => None,
        };
        let first = self.core.enqueue(topic, &record, partition).await?;
        let counter = in_flight_counter(&self.core.bus.in_flight, topic);
        counter.fetch_add(size as u64, Ordering::Relaxed);
        // The bytes leave the count when the broker answers, whether or not the caller
        // ever polls the delivery (a caller that awaits its deliveries late would
        // otherwise show them all as still in flight).
        let delivered = tokio::spawn({
            let core = self.core.clone();
            let topic = topic.to_string();
            async move {
                let r = core.deliver(topic, record, partition, first).await;
                counter.fetch_sub(size as u64, Ordering::Relaxed);
                r
            }
        });
        Ok(async move { delivered.await.unwrap_or(Err(Error::Closed("waiting for delivery"))) }.boxed())
    }

    async fn flush(&self) -> Result<()> {
        let p = self.core.client().0;
        tokio::task::spawn_blocking(move || p.flush(Duration::from_secs(60)))
            .await
            .map_err(|e| Error::Kafka {
                op: "flushing",
                reason: e.to_string(),
            })?
            .map_err(kerr("flushing"))
    }
}

/// Whether a consumer error ends the consumer (anything else is a broker outage or a
/// transient condition that librdkafka recovers from by itself).
fn is_fatal(e: &KafkaError) -> bool {
    match e.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::Fatal
            | RDKafkaErrorCode::Fenced
            | RDKafkaErrorCode::FencedInstanceId
            | RDKafkaErrorCode::InvalidConfig
            | RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::GroupAuthorizationFailed,
        ) => true,
        Some(_) => false,
        None => !matches!(e, KafkaError::MessageConsumption(_) | KafkaError::PartitionEOF(_)),
    }
}

#[derive(Default)]
struct Assignment {
    owned: HashSet<(String, u32)>,
    /// Rebalance events seen (revocations and assignments).
    rebalances: u64,
    /// Per partition, the rebalance event in which it was last assigned or revoked: its
    /// epoch. Acknowledgement trackers and deliveries of an older epoch are void; a
    /// partition kept through a (cooperative) rebalance keeps its epoch.
    epochs: HashMap<(String, u32), u64>,
}

impl Assignment {
    /// The partitions owned now, sorted, as `topic/partition` words (for logs).
    fn owned_list(&self) -> String {
        let mut owned: Vec<String> = self.owned.iter().map(|(t, p)| format!("{t}/{p}")).collect();
        owned.sort();
        owned.join(" ")
    }
}

struct RebalanceContext {
    shared: Arc<Mutex<Assignment>>,
    /// Who this consumer is, for logs.
    name: String,
}

impl ClientContext for RebalanceContext {}

impl ConsumerContext for RebalanceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Commit what was acknowledged before the partitions move (Vector does the same).
            match consumer.commit_consumer_state(CommitMode::Sync) {
                Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
                Err(e) => tracing::warn!(error = %e, "commit on revoke failed"),
            }
            let mut a = self.shared.lock().unwrap_or_else(|p| p.into_inner());
            a.rebalances += 1;
            let n = a.rebalances;
            for e in tpl.elements() {
                let key = (e.topic().to_string(), e.partition() as u32);
                a.owned.remove(&key);
                a.epochs.insert(key, n);
            }
            tracing::info!(consumer = %self.name, partitions = %a.owned_list(), "revoked");
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let mut a = self.shared.lock().unwrap_or_else(|p| p.into_inner());
            a.rebalances += 1;
            let n = a.rebalances;
            for e in tpl.elements() {
                let key = (e.topic().to_string(), e.partition() as u32);
                a.owned.insert(key.clone());
                a.epochs.insert(key, n);
            }
            tracing::info!(consumer = %self.name, partitions = %a.owned_list(), "assigned");
        }
    }
}

struct KafkaConsumer {
    consumer: StreamConsumer<RebalanceContext>,
    shared: Arc<Mutex<Assignment>>,
    acks: HashMap<(String, u32), (u64, PartitionAcks)>,
    broadcast: bool,
}

impl KafkaConsumer {
    /// The current epoch of a partition (see [`Assignment::epochs`]).
    fn epoch(&self, topic: &str, partition: u32) -> u64 {
        self.shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .epochs
            .get(&(topic.to_string(), partition))
            .copied()
            .unwrap_or(0)
    }
}

/// One logical group member over several topics: a [`KafkaConsumer`] per topic, each in
/// its topic's Kafka group ([`kafka_group`]). Receives from whichever has a message (taking
/// turns, so a busy topic cannot starve a quiet one) and routes each acknowledgement to
/// the consumer of its topic.
struct Merged {
    /// (topic, its consumer).
    parts: Vec<(String, KafkaConsumer)>,
    /// The part polled first on the next [`recv`](Consumer::recv).
    next: usize,
}

#[async_trait]
impl Consumer for Merged {
    async fn recv(&mut self) -> Result<Message> {
        let n = self.parts.len();
        let start = self.next;
        self.next = (start + 1) % n;
        // Rotated so that the part after the last winner is polled first.
        let (head, tail) = self.parts.split_at_mut(start);
        let futs = tail.iter_mut().chain(head.iter_mut()).map(|(_, p)| p.recv());
        let (m, _, _) = futures::future::select_all(futs).await;
        m
    }

    fn ack(&mut self, id: &MessageId) -> Result<()> {
        match self.parts.iter_mut().find(|(t, _)| *t == id.topic) {
            Some((_, p)) => p.ack(id),
            None => Ok(()),
        }
    }

    async fn commit(&mut self) -> Result<()> {
        for (_, p) in &mut self.parts {
            p.commit().await?;
        }
        Ok(())
    }

    fn assignment(&self) -> Vec<(String, u32)> {
        let mut v: Vec<_> = self.parts.iter().flat_map(|(_, p)| p.assignment()).collect();
        v.sort();
        v
    }

    async fn close(self: Box<Self>) -> Result<()> {
        let mut first_err = None;
        for (_, p) in self.parts {
            if let Err(e) = Box::new(p).close().await {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

#[async_trait]
impl Consumer for KafkaConsumer {
    async fn recv(&mut self) -> Result<Message> {
        let mut backoff = Duration::from_millis(100);
        let m = loop {
            match self.consumer.recv().await {
                Ok(m) => break m,
                // librdkafka reconnects by itself; a consumer outlives a broker outage.
                Err(e) if !is_fatal(&e) => {
                    tracing::warn!(error = %e, "consumer: broker unavailable, retrying in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(e) => return Err(kerr("receiving")(e)),
            }
        };
        let epoch = self.epoch(m.topic(), m.partition() as u32);
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|x| (x.key.to_string(), x.value.map(<[u8]>::to_vec).unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        let msg = Message {
            topic: m.topic().to_string(),
            partition: m.partition() as u32,
            offset: m.offset() as u64,
            key: m.key().map(<[u8]>::to_vec),
            headers,
            payload: Bytes::copy_from_slice(m.payload().unwrap_or_default()),
            timestamp_ms: m.timestamp().to_millis().unwrap_or(0),
            epoch,
        };
        drop(m);
        if !self.broadcast {
            let entry = self
                .acks
                .entry((msg.topic.clone(), msg.partition))
                .or_insert_with(|| (epoch, PartitionAcks::at(msg.offset)));
            if entry.0 != epoch {
                // The partition was revoked or reassigned since: start afresh.
                *entry = (epoch, PartitionAcks::at(msg.offset));
            }
            entry.1.delivered(msg.offset);
        }
        Ok(msg)
    }

    fn ack(&mut self, id: &MessageId) -> Result<()> {
        if self.broadcast {
            return Ok(());
        }
        let epoch = self.epoch(&id.topic, id.partition);
        let key = (id.topic.clone(), id.partition);
        let Some((e, acks)) = self.acks.get_mut(&key) else {
            return Ok(());
        };
        if id.epoch != epoch || *e != epoch {
            // Delivered before a rebalance (revoked since, or revoked and assigned back):
            // the record is delivered again from the committed offset, and only that
            // delivery's acknowledgement counts. Matching this one against the new
            // tracker would commit past the redelivered copy before it is processed.
            return Ok(());
        }
        if let Some(next) = acks.ack(id.offset) {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(&id.topic, id.partition as i32, Offset::Offset(next as i64))
                .map_err(kerr("storing offset"))?;
            match self.consumer.store_offsets(&tpl) {
                Ok(()) => {}
                // Lost the partition in a rebalance that has not reached us yet.
                Err(KafkaError::StoreOffset(RDKafkaErrorCode::State | RDKafkaErrorCode::UnknownPartition)) => {}
                Err(e) => return Err(kerr("storing offset")(e)),
            }
        }
        Ok(())
    }

    async fn commit(&mut self) -> Result<()> {
        if self.broadcast {
            return Ok(());
        }
        match self.consumer.commit_consumer_state(CommitMode::Sync) {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => Ok(()),
            Err(e) => Err(kerr("committing")(e)),
        }
    }

    fn assignment(&self) -> Vec<(String, u32)> {
        let mut v: Vec<_> = self
            .shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .owned
            .iter()
            .cloned()
            .collect();
        v.sort();
        v
    }

    async fn close(mut self: Box<Self>) -> Result<()> {
        self.commit().await?;
        if !self.broadcast {
            self.consumer.unsubscribe();
        }
        Ok(())
    }
}

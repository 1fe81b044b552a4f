//! `memory://[name][?max_unconsumed_bytes=N]` — the embedded, in-process bus.
//!
//! A partitioned log per topic, consumer groups with round-robin partition assignment
//! that is recomputed whenever a member joins or leaves, committed offsets per group,
//! acknowledgement-driven commits, and byte-bounded backpressure: a producer waits while
//! the topic holds more than `max_unconsumed_bytes` that some group has not yet committed
//! past. Records every group has committed are dropped, so memory stays bounded.
//!
//! Buses are named: every `connect("memory://x")` in one process reaches the same bus.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use async_trait::async_trait;
use bytes::Bytes;
use futures::FutureExt;
use tokio::sync::Notify;

use super::ack::PartitionAcks;
use super::{
    Bus, Capabilities, Consumer, Delivery, DeliveryFuture, Message, MessageId, PartitionStats, Producer, Record,
    TopicSpec, partition_for_key,
};
use crate::{Error, Result};

/// Default bound on a topic's unconsumed bytes: 64 MiB.
pub const DEFAULT_MAX_UNCONSUMED_BYTES: u64 = 64 << 20;
/// Largest record the memory bus accepts.
pub const MAX_RECORD_BYTES: usize = 64 << 20;

/// The in-process bus.
pub struct MemoryBus {
    url: String,
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// Woken on every append, commit, trim and membership change.
    changed: Arc<Notify>,
    default_bound: u64,
}

#[derive(Default)]
struct State {
    topics: HashMap<String, Topic>,
    groups: HashMap<String, Group>,
    next_member: u64,
}

struct Topic {
    partitions: Vec<Partition>,
    bound: u64,
}

#[derive(Default)]
struct Partition {
    start: u64,
    log: VecDeque<Arc<Stored>>,
    bytes: u64,
}

impl Partition {
    fn end(&self) -> u64 {
        self.start + self.log.len() as u64
    }
}

struct Stored {
    key: Option<Vec<u8>>,
    headers: streamrl_schemas::WireHeaders,
    payload: Bytes,
    timestamp_ms: i64,
    size: u64,
}

#[derive(Default)]
struct Group {
    /// member id → subscribed topics
    members: BTreeMap<u64, Vec<String>>,
    /// Topics this group has ever read: its commits hold back trimming of these.
    topics: BTreeSet<String>,
    committed: HashMap<(String, u32), u64>,
    generation: u64,
    /// Broadcast subscriptions are groups of one that vanish with their member.
    ephemeral: bool,
}

impl Group {
    /// The member that owns `partition` of `topic`: members subscribed to the topic, in
    /// join order, take partitions round-robin.
    fn owner(&self, topic: &str, partition: u32) -> Option<u64> {
        let subs: Vec<u64> = self
            .members
            .iter()
            .filter(|(_, t)| t.iter().any(|x| x == topic))
            .map(|(m, _)| *m)
            .collect();
        (!subs.is_empty()).then(|| subs[partition as usize % subs.len()])
    }
}

fn registry() -> &'static Mutex<HashMap<String, Arc<Inner>>> {
    static BUSES: OnceLock<Mutex<HashMap<String, Arc<Inner>>>> = OnceLock::new();
    BUSES.get_or_init(Default::default)
}

fn lock(inner: &Inner) -> MutexGuard<'_, State> {
    // A panic while holding the lock leaves the log consistent (every mutation is a
    // single step), so a poisoned lock is still usable.
    inner.state.lock().unwrap_or_else(|p| p.into_inner())
}

impl MemoryBus {
    /// Opens (or reaches) the named in-process bus of `url`.
    pub fn open(url: &str) -> Result<Arc<MemoryBus>> {
        let (base, params) = super::query_params(url)?;
        let name = base
            .strip_prefix("memory://")
            .unwrap_or("")
            .trim_end_matches('/')
            .to_string();
        let mut bound = DEFAULT_MAX_UNCONSUMED_BYTES;
        for (k, v) in params {
            match k.as_str() {
                "max_unconsumed_bytes" => {
                    bound = v.parse().map_err(|_| Error::InvalidUrl {
                        url: url.to_string(),
                        reason: format!("max_unconsumed_bytes `{v}` is not a byte count"),
                    })?
                }
                other => {
                    return Err(Error::InvalidUrl {
                        url: url.to_string(),
                        reason: format!("unknown parameter `{other}` (known: max_unconsumed_bytes)"),
                    });
                }
            }
        }
        let inner = registry()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name)
            .or_insert_with(|| {
                Arc::new(Inner {
                    state: Mutex::new(State::default()),
                    changed: Arc::new(Notify::new()),
                    default_bound: bound,
                })
            })
            .clone();
        Ok(Arc::new(MemoryBus {
            url: url.to_string(),
            inner,
        }))
    }

    async fn join(&self, group: &str, topics: &[String], ephemeral: bool) -> Result<Box<dyn Consumer>> {
        let member = {
            let mut st = lock(&self.inner);
            for t in topics {
                if !st.topics.contains_key(t) {
                    return Err(Error::UnknownTopic(t.clone()));
                }
            }
            st.next_member += 1;
            let member = st.next_member;
            // A broadcast reader starts at the newest record of each partition.
            let newest: Vec<((String, u32), u64)> =
                if ephemeral {
                    topics
                        .iter()
                        .flat_map(|t| {
                            st.topics[t].partitions.iter().enumerate().map(move |(p, part)| {
                                ((t.clone(), p as u32), part.start.max(part.end().saturating_sub(1)))
                            })
                        })
                        .collect()
                } else {
                    Vec::new()
                };
            let g = st.groups.entry(group.to_string()).or_default();
            g.ephemeral = ephemeral;
            g.committed.extend(newest);
            g.members.insert(member, topics.to_vec());
            g.topics.extend(topics.iter().cloned());
            g.generation += 1;
            member
        };
        self.inner.changed.notify_waiters();
        Ok(Box::new(MemoryConsumer {
            inner: self.inner.clone(),
            group: group.to_string(),
            member,
            generation: 0,
            owned: Vec::new(),
            acks: HashMap::new(),
            gained: HashMap::new(),
            rr: 0,
            broadcast: ephemeral,
            left: false,
        }))
    }
}

impl State {
    /// The offset every group reading `topic` has committed past on `partition`
    /// (`None`: no group reads it yet).
    fn floor(&self, topic: &str, partition: u32) -> Option<u64> {
        let key = (topic.to_string(), partition);
        self.groups
            .values()
            .filter(|g| g.topics.contains(topic))
            .map(|g| g.committed.get(&key).copied().unwrap_or(0))
            .min()
    }

    /// Bytes of `topic` some group has not committed past.
    fn unconsumed(&self, topic: &str) -> u64 {
        let Some(t) = self.topics.get(topic) else { return 0 };
        t.partitions
            .iter()
            .enumerate()
            .map(|(p, part)| match (self.floor(topic, p as u32), part.log.front()) {
                // The newest record is kept after everyone read it (see `trim`); it is
                // not unconsumed.
                (Some(floor), Some(first)) if part.start < floor => part.bytes - first.size,
                _ => part.bytes,
            })
            .sum()
    }

    /// Drops records of `topic` that every group reading it has committed past, keeping
    /// the newest record of each partition so that a late broadcast reader still learns
    /// the current value (the latest policy version). Returns whether anything was dropped.
    fn trim(&mut self, topic: &str) -> bool {
        let floors: Vec<Option<u64>> = match self.topics.get(topic) {
            Some(t) => (0..t.partitions.len() as u32).map(|p| self.floor(topic, p)).collect(),
            None => return false,
        };
        let t = self.topics.get_mut(topic).expect("checked above");
        let mut trimmed = false;
        for (part, floor) in t.partitions.iter_mut().zip(floors) {
            // No reader yet: keep everything (producers block at the bound).
            let Some(floor) = floor else { continue };
            while part.start < floor && part.log.len() > 1 {
                let Some(s) = part.log.pop_front() else { break };
                part.bytes -= s.size;
                part.start += 1;
                trimmed = true;
            }
        }
        trimmed
    }
}

#[async_trait]
impl Bus for MemoryBus {
    fn url(&self) -> &str {
        &self.url
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            blocks_on_unconsumed: true,
            max_record_bytes: MAX_RECORD_BYTES,
        }
    }

    async fn create_topic(&self, spec: &TopicSpec) -> Result<()> {
        if spec.partitions == 0 {
            return Err(Error::PartitionMismatch {
                topic: spec.name.clone(),
                existing: 0,
                wanted: 0,
            });
        }
        let mut st = lock(&self.inner);
        match st.topics.get(&spec.name) {
            Some(t) if t.partitions.len() as u32 != spec.partitions => Err(Error::PartitionMismatch {
                topic: spec.name.clone(),
                existing: t.partitions.len() as u32,
                wanted: spec.partitions,
            }),
            Some(_) => Ok(()),
            None => {
                st.topics.insert(
                    spec.name.clone(),
                    Topic {
                        partitions: (0..spec.partitions).map(|_| Partition::default()).collect(),
                        bound: spec.max_unconsumed_bytes.unwrap_or(self.inner.default_bound),
                    },
                );
                Ok(())
            }
        }
    }

    async fn topics(&self) -> Result<Vec<String>> {
        let mut v: Vec<String> = lock(&self.inner).topics.keys().cloned().collect();
        v.sort();
        Ok(v)
    }

    async fn producer(&self, _client_id: &str) -> Result<Arc<dyn Producer>> {
        Ok(Arc::new(MemoryProducer {
            inner: self.inner.clone(),
            rr: AtomicU32::new(0),
        }))
    }

    async fn subscribe(&self, group: &str, topics: &[String]) -> Result<Box<dyn Consumer>> {
        self.join(group, topics, false).await
    }

    async fn broadcast(&self, topic: &str) -> Result<Box<dyn Consumer>> {
        let group = format!("__broadcast-{}", uuid::Uuid::new_v4());
        self.join(&group, &[topic.to_string()], true).await
    }

    async fn topic_partitions(&self) -> Result<std::collections::BTreeMap<String, u32>> {
        let st = lock(&self.inner);
        Ok(st
            .topics
            .iter()
            .map(|(n, t)| (n.clone(), t.partitions.len() as u32))
            .collect())
    }

    async fn topic_stats(&self, topic: &str, groups: &[String]) -> Result<Vec<PartitionStats>> {
        let st = lock(&self.inner);
        let t = st
            .topics
            .get(topic)
            .ok_or_else(|| Error::UnknownTopic(topic.to_string()))?;
        Ok(t.partitions
            .iter()
            .enumerate()
            .map(|(p, part)| PartitionStats {
                partition: p as u32,
                start_offset: part.start,
                end_offset: part.end(),
                committed: groups
                    .iter()
                    .map(|g| {
                        let c = st
                            .groups
                            .get(g)
                            .and_then(|g| g.committed.get(&(topic.to_string(), p as u32)).copied());
                        (g.clone(), c)
                    })
                    .collect(),
            })
            .collect())
    }

    fn buffered_bytes(&self, topic: &str) -> u64 {
        lock(&self.inner).unconsumed(topic)
    }
}

struct MemoryProducer {
    inner: Arc<Inner>,
    rr: AtomicU32,
}

#[async_trait]
impl Producer for MemoryProducer {
    async fn send(&self, topic: &str, record: Record) -> Result<DeliveryFuture> {
        let size = record.size();
        if size > MAX_RECORD_BYTES {
            return Err(Error::RecordTooLarge {
                topic: topic.to_string(),
                size,
                limit: MAX_RECORD_BYTES,
            });
        }
        let Record {
            key,
            headers,
            payload,
            partition,
        } = record;
        let mut stored = Some(Stored {
            key,
            headers,
            payload,
            timestamp_ms: streamrl_schemas::now_millis(),
            size: size as u64,
        });
        loop {
            let wait = self.inner.changed.clone().notified_owned();
            tokio::pin!(wait);
            {
                let mut st = lock(&self.inner);
                let held = st.unconsumed(topic);
                let t = st
                    .topics
                    .get_mut(topic)
                    .ok_or_else(|| Error::UnknownTopic(topic.to_string()))?;
                let n = t.partitions.len() as u32;
                // An oversized record still goes through once the topic is empty.
                if held == 0 || held + size as u64 <= t.bound {
                    let s = stored.take().expect("record is stored once");
                    let p = match (partition, &s.key) {
                        (Some(p), _) => p % n,
                        (None, Some(k)) => partition_for_key(k, n),
                        (None, None) => self.rr.fetch_add(1, Ordering::Relaxed) % n,
                    };
                    let part = &mut t.partitions[p as usize];
                    part.bytes += s.size;
                    part.log.push_back(Arc::new(s));
                    let offset = part.end() - 1;
                    drop(st);
                    self.inner.changed.notify_waiters();
                    return Ok(futures::future::ready(Ok(Delivery { partition: p, offset })).boxed());
                }
                wait.as_mut().enable();
            }
            wait.await;
        }
    }

    async fn flush(&self) -> Result<()> {
        Ok(())
    }
}

struct MemoryConsumer {
    inner: Arc<Inner>,
    group: String,
    member: u64,
    generation: u64,
    owned: Vec<(String, u32)>,
    acks: HashMap<(String, u32), PartitionAcks>,
    /// Per owned partition, the group generation in which this member gained it: the
    /// epoch of its deliveries. An acknowledgement of an older epoch (a delivery from
    /// before the partition went away and came back) is ignored.
    gained: HashMap<(String, u32), u64>,
    rr: usize,
    broadcast: bool,
    left: bool,
}

impl MemoryConsumer {
    /// Re-reads the assignment after a membership change: partitions kept keep their
    /// positions (moved up to the group's commit if someone else committed further),
    /// partitions gained start at the group's committed offset, partitions lost are
    /// forgotten (their unacknowledged records go to the new owner).
    fn refresh(&mut self, st: &State) {
        let Some(g) = st.groups.get(&self.group) else { return };
        if g.generation == self.generation {
            return;
        }
        self.generation = g.generation;
        let topics = g.members.get(&self.member).cloned().unwrap_or_default();
        let mut owned = Vec::new();
        for t in &topics {
            let Some(topic) = st.topics.get(t) else { continue };
            for p in 0..topic.partitions.len() as u32 {
                if g.owner(t, p) == Some(self.member) {
                    owned.push((t.clone(), p));
                }
            }
        }
        let mut acks = HashMap::new();
        let mut gained = HashMap::new();
        for key in &owned {
            let part = &st.topics[&key.0].partitions[key.1 as usize];
            let committed = g.committed.get(key).copied().unwrap_or(part.start);
            let since = self.gained.get(key).copied().unwrap_or(g.generation);
            let mut a = self.acks.remove(key).unwrap_or_else(|| PartitionAcks::at(committed));
            a.skip_to(committed);
            acks.insert(key.clone(), a);
            gained.insert(key.clone(), since);
        }
        self.owned = owned;
        self.acks = acks;
        self.gained = gained;
    }

    fn leave(&mut self) {
        if self.left {
            return;
        }
        self.left = true;
        {
            let mut st = lock(&self.inner);
            let topics = if let Some(g) = st.groups.get_mut(&self.group) {
                g.members.remove(&self.member);
                g.generation += 1;
                let topics: Vec<String> = g.topics.iter().cloned().collect();
                if g.ephemeral && g.members.is_empty() {
                    st.groups.remove(&self.group);
                }
                topics
            } else {
                Vec::new()
            };
            for t in topics {
                st.trim(&t);
            }
        }
        self.inner.changed.notify_waiters();
    }
}

impl Drop for MemoryConsumer {
    fn drop(&mut self) {
        self.leave();
    }
}

#[async_trait]
impl Consumer for MemoryConsumer {
    async fn recv(&mut self) -> Result<Message> {
        loop {
            let wait = self.inner.changed.clone().notified_owned();
            tokio::pin!(wait);
            {
                let inner = self.inner.clone();
                let mut st = lock(&inner);
                self.refresh(&st);
                let n = self.owned.len();
                for i in 0..n {
                    let idx = (self.rr + i) % n;
                    let key = &self.owned[idx];
                    let Some(topic) = st.topics.get(&key.0) else { continue };
                    let part = &topic.partitions[key.1 as usize];
                    let acks = self.acks.get_mut(key).expect("owned partitions are tracked");
                    let pos = acks.next().max(part.start);
                    if pos >= part.end() {
                        continue;
                    }
                    let s = part.log[(pos - part.start) as usize].clone();
                    let msg = Message {
                        topic: key.0.clone(),
                        partition: key.1,
                        offset: pos,
                        key: s.key.clone(),
                        headers: s.headers.clone(),
                        payload: s.payload.clone(),
                        timestamp_ms: s.timestamp_ms,
                        epoch: self.gained.get(key).copied().unwrap_or(0),
                    };
                    self.rr = idx + 1;
                    if self.broadcast {
                        // A broadcast reader commits as it reads: nothing is redelivered.
                        *acks = PartitionAcks::at(pos + 1);
                        let key = key.clone();
                        let topic_name = key.0.clone();
                        if let Some(g) = st.groups.get_mut(&self.group) {
                            g.committed.insert(key, pos + 1);
                        }
                        if st.trim(&topic_name) {
                            self.inner.changed.notify_waiters();
                        }
                    } else {
                        acks.delivered(pos);
                    }
                    return Ok(msg);
                }
                wait.as_mut().enable();
            }
            wait.await;
        }
    }

    fn ack(&mut self, id: &MessageId) -> Result<()> {
        if self.broadcast {
            return Ok(());
        }
        let key = (id.topic.clone(), id.partition);
        let mut st = lock(&self.inner);
        let Some(g) = st.groups.get_mut(&self.group) else {
            return Ok(());
        };
        // A partition moved to another member: its new owner will see the record again.
        // Moved away and back since this delivery: only the redelivered copy counts.
        if g.owner(&id.topic, id.partition) != Some(self.member) || self.gained.get(&key) != Some(&id.epoch) {
            return Ok(());
        }
        let Some(commit) = self.acks.get_mut(&key).and_then(|a| a.ack(id.offset)) else {
            return Ok(());
        };
        let c = g.committed.entry(key).or_insert(0);
        *c = (*c).max(commit);
        if st.trim(&id.topic) {
            drop(st);
            self.inner.changed.notify_waiters();
        }
        Ok(())
    }

    async fn commit(&mut self) -> Result<()> {
        // Acknowledgements commit immediately on this bus.
        Ok(())
    }

    fn assignment(&self) -> Vec<(String, u32)> {
        let st = lock(&self.inner);
        let Some(g) = st.groups.get(&self.group) else {
            return Vec::new();
        };
        let topics = g.members.get(&self.member).cloned().unwrap_or_default();
        let mut out = Vec::new();
        for t in topics {
            if let Some(topic) = st.topics.get(&t) {
                for p in 0..topic.partitions.len() as u32 {
                    if g.owner(&t, p) == Some(self.member) {
                        out.push((t.clone(), p));
                    }
                }
            }
        }
        out
    }

    async fn close(mut self: Box<Self>) -> Result<()> {
        self.leave();
        Ok(())
    }
}

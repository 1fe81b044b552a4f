//! `streamrl bench bus`: memory bus rows/s against an mpsc channel, and Kafka MB/s
//! against raw rdkafka moving the same bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use streamrl_runtime::bus::{self, Bus, Record, TopicSpec};
use streamrl_schemas::codec::{self, Compression};
use streamrl_schemas::{Headers, MetricRow, SchemaId, TopicRow};

/// Runs the memory half (and the Kafka half when `kafka` is given) and prints both tables.
pub async fn run(kafka: Option<String>, rows_per_message: usize, messages: usize, kafka_mib: usize) -> Result<()> {
    println!(
        "streamrl bench bus (profile: {})",
        if cfg!(debug_assertions) { "debug" } else { "release" }
    );
    let batch = metric_batch(rows_per_message);
    let (bus_rps, base_rps) = memory_rows_per_sec(&batch, messages).await?;
    println!();
    println!(
        "{:<44} {:>14} {:>14} {:>7}",
        "memory bus, small records", "streamrl", "baseline", "ratio"
    );
    println!(
        "{:<44} {:>14} {:>14} {:>7.2}",
        format!("rows/s ({rows_per_message} rows × {messages} msgs, encode+decode)"),
        fmt_rate(bus_rps),
        fmt_rate(base_rps),
        bus_rps / base_rps
    );
    println!("  baseline: the same encode → tokio mpsc (bounded) → decode, no bus");
    if let Some(url) = kafka {
        let (ours, raw) = kafka_mb_per_sec(&url, kafka_mib).await?;
        println!();
        println!(
            "{:<44} {:>14} {:>14} {:>7}",
            "kafka, Arrow payloads (produce + consume)", "streamrl", "raw rdkafka", "ratio"
        );
        println!(
            "{:<44} {:>14.1} {:>14.1} {:>7.2}",
            format!("MB/s ({kafka_mib} MiB)"),
            ours,
            raw,
            ours / raw
        );
        println!("  raw: FutureProducer + StreamConsumer moving the same bytes, same client settings");
    }
    Ok(())
}

fn fmt_rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else {
        format!("{:.1} k", v / 1e3)
    }
}

fn metric_batch(rows: usize) -> arrow::record_batch::RecordBatch {
    let rows: Vec<MetricRow> = (0..rows)
        .map(|i| MetricRow {
            run_id: "bench".into(),
            step: i as u64 / 16,
            stage: "trainer".into(),
            name: ["loss", "reward", "kl", "entropy"][i % 4].into(),
            value: i as f64 * 0.001,
            created_at: 1_764_460_800_000 + i as i64,
        })
        .collect();
    MetricRow::to_batch(&rows).expect("metric rows convert")
}

/// Best of three alternating runs of each side, so that neither side gets the warm caches.
async fn memory_rows_per_sec(batch: &arrow::record_batch::RecordBatch, messages: usize) -> Result<(f64, f64)> {
    let (mut bus, mut base) = (0f64, 0f64);
    for _ in 0..3 {
        base = base.max(mpsc_rows_per_sec(batch, messages).await?);
        bus = bus.max(memory_bus_rows_per_sec(batch, messages).await?);
    }
    Ok((bus, base))
}

async fn memory_bus_rows_per_sec(batch: &arrow::record_batch::RecordBatch, messages: usize) -> Result<f64> {
    let rows = batch.num_rows();
    let url = format!("memory://bench-{}", uuid::Uuid::new_v4());
    let bus = bus::connect(&url).await?;
    bus.create_topic(&TopicSpec::new("metrics", 4)).await?;
    let mut consumer = bus.subscribe("bench", &["metrics".to_string()]).await?;
    let producer = bus.producer("bench").await?;
    let headers = Headers::data(SchemaId::Metrics, "bench").to_wire();

    let t0 = Instant::now();
    let b = batch.clone();
    let h = headers.clone();
    let prod = tokio::spawn(async move {
        let mut pending = Vec::new();
        for i in 0..messages {
            let payload = codec::encode(&b, Compression::Lz4)?;
            let rec = Record::new(payload)
                .with_key(format!("k{}", i % 64))
                .with_headers(h.clone());
            pending.push(producer.send("metrics", rec).await?);
        }
        futures::future::try_join_all(pending).await?;
        anyhow::Ok(())
    });
    let cons = tokio::spawn(async move {
        let mut got = 0usize;
        while got < rows * messages {
            let m = consumer.recv().await?;
            let b = codec::decode(SchemaId::Metrics, &m.headers, &m.payload)?;
            got += b.num_rows();
            consumer.ack(&m.id())?;
        }
        anyhow::Ok(got)
    });
    let got = cons.await??;
    prod.await??;
    Ok(got as f64 / t0.elapsed().as_secs_f64())
}

async fn mpsc_rows_per_sec(batch: &arrow::record_batch::RecordBatch, messages: usize) -> Result<f64> {
    let headers = Headers::data(SchemaId::Metrics, "bench").to_wire();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(256);
    let t0 = Instant::now();
    let b = batch.clone();
    let prod = tokio::spawn(async move {
        for _ in 0..messages {
            tx.send(codec::encode(&b, Compression::Lz4)?).await?;
        }
        anyhow::Ok(())
    });
    let cons = tokio::spawn(async move {
        let mut got = 0usize;
        while let Some(p) = rx.recv().await {
            got += codec::decode(SchemaId::Metrics, &headers, &p)?.num_rows();
        }
        anyhow::Ok(got)
    });
    let got = cons.await??;
    prod.await??;
    Ok(got as f64 / t0.elapsed().as_secs_f64())
}

/// Arrow payloads of ~64 KiB (rollout-like rows with token lists).
fn kafka_payloads(total_mib: usize) -> Result<Vec<Bytes>> {
    let rows: Vec<MetricRow> = (0..2048)
        .map(|i| MetricRow {
            run_id: format!("bench-{i:08}"),
            step: i,
            stage: "rollout".into(),
            name: format!("tokens/{}", i * 7919 % 1000),
            value: (i as f64).sin(),
            created_at: i as i64,
        })
        .collect();
    let batch = MetricRow::to_batch(&rows)?;
    let one = codec::encode(&batch, Compression::None)?;
    let n = (total_mib << 20) / one.len().max(1);
    Ok((0..n.max(1)).map(|_| one.clone()).collect())
}

async fn kafka_mb_per_sec(url: &str, mib: usize) -> Result<(f64, f64)> {
    let payloads = kafka_payloads(mib)?;
    let bytes: usize = payloads.iter().map(Bytes::len).sum();
    let tag = uuid::Uuid::new_v4().simple().to_string();

    // streamrl: KafkaBus producer + group consumer, with headers and decode + ack.
    let bus = bus::connect(url)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    let topic = format!("bench-streamrl-{tag}");
    bus.create_topic(&TopicSpec::new(&topic, 4)).await?;
    let ours = {
        let producer = bus.producer("bench").await?;
        let headers = Headers::data(SchemaId::Metrics, "bench").to_wire();
        let t0 = Instant::now();
        let mut pending = Vec::new();
        for (i, p) in payloads.iter().enumerate() {
            let rec = Record::new(p.clone())
                .with_key(format!("k{}", i % 64))
                .with_headers(headers.clone());
            pending.push(producer.send(&topic, rec).await?);
        }
        futures::future::try_join_all(pending).await?;
        let produce = t0.elapsed();
        let consume = consume_streamrl(&bus, &topic, payloads.len()).await?;
        bytes as f64 / 1e6 / (produce + consume).as_secs_f64()
    };
    let raw = raw_rdkafka(url, &tag, &payloads).await?;
    Ok((ours, bytes as f64 / 1e6 / raw.as_secs_f64()))
}

/// Time from the first message to the last (the group join delay is not throughput).
async fn consume_streamrl(bus: &Arc<dyn Bus>, topic: &str, n: usize) -> Result<Duration> {
    let mut c = bus.subscribe(&format!("{topic}-g"), &[topic.to_string()]).await?;
    let mut t0 = None;
    for _ in 0..n {
        let m = tokio::time::timeout(Duration::from_secs(60), c.recv())
            .await
            .context("consumer stalled")??;
        t0.get_or_insert_with(Instant::now);
        codec::decode(SchemaId::Metrics, &m.headers, &m.payload)?;
        c.ack(&m.id())?;
    }
    let d = t0.map(|t| t.elapsed()).unwrap_or_default();
    c.close().await?;
    Ok(d)
}

async fn raw_rdkafka(url: &str, tag: &str, payloads: &[Bytes]) -> Result<Duration> {
    use rdkafka::config::ClientConfig;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::error::{KafkaError, RDKafkaErrorCode};
    use rdkafka::message::Message;
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let brokers = url
        .strip_prefix("kafka://")
        .unwrap_or(url)
        .split('?')
        .next()
        .unwrap_or_default()
        .to_string();
    let topic = format!("bench-raw-{tag}");
    let bus = bus::connect(url).await?;
    bus.create_topic(&TopicSpec::new(&topic, 4)).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("compression.type", "none")
        .set("message.max.bytes", ((16 << 20) + 65536).to_string())
        .set("queue.buffering.max.kbytes", "65536")
        .create()?;
    let t0 = Instant::now();
    let mut pending = Vec::new();
    for (i, p) in payloads.iter().enumerate() {
        let key = format!("k{}", i % 64);
        let mut rec = FutureRecord::to(&topic).payload(&p[..]).key(&key);
        loop {
            match producer.send_result(rec) {
                Ok(f) => {
                    pending.push(f);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    rec = r;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) => bail!("raw produce: {e}"),
            }
        }
    }
    for f in pending {
        f.await?.map_err(|(e, _)| e)?;
    }
    let produce = t0.elapsed();
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("{topic}-g"))
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "50")
        .set("fetch.max.bytes", (64 << 20).to_string())
        .set("max.partition.fetch.bytes", (32 << 20).to_string())
        .create()?;
    consumer.subscribe(&[&topic])?;
    let mut t1 = None;
    for _ in 0..payloads.len() {
        let m = tokio::time::timeout(Duration::from_secs(60), consumer.recv())
            .await
            .context("raw consumer stalled")??;
        t1.get_or_insert_with(Instant::now);
        std::hint::black_box(m.payload());
        consumer.store_offset_from_message(&m)?;
    }
    Ok(produce + t1.map(|t| t.elapsed()).unwrap_or_default())
}

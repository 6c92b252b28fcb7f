//! Produce and consume load: the client library's idempotent producer with
//! flush = always brokers, ack latency in an HDR histogram.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use ferrolog_client::{
    Admin, ClientConfig, Consumer, ConsumerConfig, MetadataCache, Producer, ProducerConfig, Record, Seek,
};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;

use crate::cluster;

/// Flags of `produce` and `consume`.
#[derive(Args, Debug, Clone)]
pub struct ProduceArgs {
    /// Record value size, bytes.
    #[arg(long, default_value_t = 100)]
    record_bytes: usize,
    /// How long to produce, seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Partitions of the topic (replication factor 3).
    #[arg(long, default_value_t = 6)]
    partitions: u32,
    /// Records awaiting acknowledgement at once; 1 measures one-in-flight latency.
    #[arg(long, default_value_t = 20_000)]
    in_flight: usize,
    /// Producer linger, ms.
    #[arg(long, default_value_t = 2)]
    linger_ms: u64,
    /// Producer batch size, bytes.
    #[arg(long, default_value_t = 256 * 1024)]
    batch_bytes: usize,
    /// Most records sent per second (paced evenly); unlimited when absent.
    #[arg(long)]
    rate: Option<f64>,
    /// Brokers with `flush = { policy = "interval", interval_ms = N }`
    /// instead of the default `always`: acknowledged before any fsync, to
    /// show what the fsyncs on the path cost (not a safe setting); at
    /// least 1.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    flush_interval_ms: Option<u64>,
}

impl ProduceArgs {
    /// Pipelined produce of `record_bytes` records for `seconds` to a topic
    /// of `partitions` (20,000 in flight, 2 ms linger, 256 KiB batches).
    pub fn pipelined(record_bytes: usize, seconds: u64, partitions: u32) -> Self {
        Self {
            record_bytes,
            seconds,
            partitions,
            in_flight: 20_000,
            linger_ms: 2,
            batch_bytes: 256 * 1024,
            rate: None,
            flush_interval_ms: None,
        }
    }

    /// The same, sending at most `rate` records a second (`None`: no limit).
    pub fn at_rate(self, rate: Option<f64>) -> Self {
        Self { rate, ..self }
    }

    /// One record awaiting its acknowledgement at a time (no linger).
    pub fn one_in_flight(record_bytes: usize, seconds: u64, partitions: u32) -> Self {
        Self { in_flight: 1, linger_ms: 0, ..Self::pipelined(record_bytes, seconds, partitions) }
    }
}

/// Flags of `e2e`.
#[derive(Args, Debug, Clone)]
pub struct E2eArgs {
    /// Seconds per produce run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

/// What a produce run measured.
#[derive(Debug, Clone)]
pub struct ProduceResult {
    /// Records acknowledged.
    pub records: u64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Value bytes per record.
    pub record_bytes: usize,
    /// Ack latency, microseconds.
    pub latency_us: Histogram<u64>,
}

impl ProduceResult {
    fn print(&self, label: &str) {
        let rate = self.records as f64 / self.seconds;
        println!(
            "{label}: {} records in {:.1} s = {:.0} records/s, {:.1} MB/s; ack latency p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms",
            self.records,
            self.seconds,
            rate,
            rate * self.record_bytes as f64 / 1e6,
            self.latency_us.value_at_quantile(0.5) as f64 / 1000.0,
            self.latency_us.value_at_quantile(0.99) as f64 / 1000.0,
            self.latency_us.value_at_quantile(0.999) as f64 / 1000.0,
        );
    }
}

pub async fn topic(meta: &Arc<MetadataCache>, name: &str, partitions: u32) -> anyhow::Result<()> {
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(60));
    admin.create_topic(name, partitions, 3).await.context("creating the topic")?;
    admin.wait_for_leaders(name, Duration::from_secs(60)).await?;
    Ok(())
}

/// Produces `a.record_bytes` records to `name` for `a.seconds`.
///
/// # Errors
/// A record the producer gave up on.
pub async fn produce(
    meta: &Arc<MetadataCache>,
    name: &str,
    a: &ProduceArgs,
) -> anyhow::Result<ProduceResult> {
    let config = ProducerConfig {
        linger_ms: if a.in_flight == 1 { 0 } else { a.linger_ms },
        batch_bytes_max: a.batch_bytes,
        ..ProducerConfig::default()
    };
    let producer = Producer::new(meta.clone(), config)?;
    let value = Bytes::from(vec![b'x'; a.record_bytes]);
    let keys: Vec<Bytes> = (0..1024).map(|i| Bytes::from(format!("key-{i}"))).collect();
    let mut latency_us = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    // One task drives the load: sends while fewer than `in_flight` records
    // await their acknowledgement, else waits for the next one.
    let mut pending = FuturesUnordered::new();
    let start = Instant::now();
    let end = start + Duration::from_secs(a.seconds);
    let (mut sent, mut failed) = (0u64, 0u64);
    let mut first_error = None;
    loop {
        let sending = Instant::now() < end;
        // Paced: the next record is due at sent / rate seconds.
        if sending && let Some(rate) = a.rate.filter(|r| *r > 0.0) {
            let due = start + Duration::from_secs_f64(sent as f64 / rate);
            if due > Instant::now() && pending.len() < a.in_flight {
                tokio::select! {
                    _ = tokio::time::sleep_until(due.into()) => {}
                    Some((done, t)) = pending.next() => {
                        let done: Result<_, ferrolog_client::Error> = done;
                        match done {
                            Ok(_) => latency_us.record((Instant::elapsed(&t).as_micros() as u64).max(1))?,
                            Err(e) => {
                                failed += 1;
                                first_error.get_or_insert_with(|| e.to_string());
                            }
                        }
                    }
                }
                continue;
            }
        }
        if sending && pending.len() < a.in_flight {
            let record = Record::new(value.clone()).with_key(keys[(sent % 1024) as usize].clone());
            let delivery = producer.send(name, record);
            let t = Instant::now();
            pending.push(async move { (delivery.await, t) });
            sent += 1;
            continue;
        }
        if !sending {
            producer.flush().await;
        }
        match pending.next().await {
            Some((Ok(_), t)) => latency_us.record((t.elapsed().as_micros() as u64).max(1))?,
            Some((Err(e), _)) => {
                failed += 1;
                first_error.get_or_insert_with(|| e.to_string());
            }
            None => break,
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    anyhow::ensure!(
        failed == 0,
        "{failed} of {sent} records failed; the first: {}",
        first_error.unwrap_or_default()
    );
    Ok(ProduceResult { records: sent, seconds, record_bytes: a.record_bytes, latency_us })
}

/// Reads `name` from the start until `records` records were read; returns
/// records/s and MB/s (of values).
///
/// # Errors
/// Consumer errors.
pub async fn consume(
    meta: &Arc<MetadataCache>,
    name: &str,
    records: u64,
    record_bytes: usize,
) -> anyhow::Result<(f64, f64)> {
    let mut consumer =
        Consumer::new(meta.clone(), ConsumerConfig { fetch_max_bytes: 8 << 20, ..ConsumerConfig::default() });
    consumer.assign_topic(name, Seek::Earliest, Duration::from_secs(30)).await?;
    let start = Instant::now();
    let mut read = 0u64;
    while read < records {
        read += consumer.poll(Duration::from_millis(500)).await?.len() as u64;
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(600),
            "consumer stalled at {read} of {records}"
        );
    }
    let s = start.elapsed().as_secs_f64();
    Ok((read as f64 / s, read as f64 * record_bytes as f64 / s / 1e6))
}

/// The 3-broker cluster of `produce` and `consume`: flush = always, or
/// the interval `a.flush_interval_ms` names (with its config file, kept
/// while the cluster runs).
async fn bench_cluster(
    name: &str,
    a: &ProduceArgs,
) -> anyhow::Result<(ferrolog_tests::Cluster, Option<tempfile::TempPath>)> {
    match a.flush_interval_ms {
        None => Ok((cluster::start(name).await?, None)),
        Some(ms) => {
            println!("brokers acknowledge before any fsync (flush interval {ms} ms)");
            let config = format!("[storage]\nflush = {{ policy = \"interval\", interval_ms = {ms} }}\n");
            let (c, path) = cluster::start_configured(name, 3, &config).await?;
            Ok((c, Some(path)))
        }
    }
}

/// `produce`.
///
/// # Errors
/// As [`produce`].
pub async fn produce_only(a: ProduceArgs) -> anyhow::Result<()> {
    let (c, _config) = bench_cluster("bench-produce", &a).await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    topic(&meta, "bench", a.partitions).await?;
    produce(&meta, "bench", &a)
        .await?
        .print(&format!("produce {} B, {} in flight", a.record_bytes, a.in_flight));
    Ok(())
}

/// `consume`.
///
/// # Errors
/// As [`produce`] and [`consume`].
pub async fn produce_and_consume(a: ProduceArgs) -> anyhow::Result<()> {
    let (c, _config) = bench_cluster("bench-consume", &a).await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    topic(&meta, "bench", a.partitions).await?;
    let p = produce(&meta, "bench", &a).await?;
    p.print(&format!("produce {} B", a.record_bytes));
    let (rps, mbps) = consume(&meta, "bench", p.records, a.record_bytes).await?;
    println!("consume from the start: {rps:.0} records/s, {mbps:.1} MB/s");
    Ok(())
}

/// `e2e`: 100 B and 1 KiB pipelined, then one in flight; consume each back.
///
/// # Errors
/// As [`produce`] and [`consume`].
pub async fn e2e(a: E2eArgs) -> anyhow::Result<()> {
    let c = cluster::start("bench-e2e").await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    println!("| run | records/s | MB/s | p50 ms | p99 ms | p99.9 ms | consume records/s | consume MB/s |");
    println!("|---|---|---|---|---|---|---|---|");
    let runs =
        [("100 B pipelined", 100, 20_000), ("1 KiB pipelined", 1024, 4_000), ("100 B one in flight", 100, 1)];
    for (i, (label, bytes, in_flight)) in runs.into_iter().enumerate() {
        let name = format!("e2e-{i}");
        topic(&meta, &name, 6).await?;
        let args = ProduceArgs {
            record_bytes: bytes,
            seconds: a.seconds,
            partitions: 6,
            in_flight,
            linger_ms: 2,
            batch_bytes: 256 * 1024,
            rate: None,
            flush_interval_ms: None,
        };
        let p = produce(&meta, &name, &args).await?;
        let (rps, mbps) = consume(&meta, &name, p.records, bytes).await?;
        let rate = p.records as f64 / p.seconds;
        println!(
            "| {label} | {rate:.0} | {:.1} | {:.2} | {:.2} | {:.2} | {rps:.0} | {mbps:.1} |",
            rate * bytes as f64 / 1e6,
            p.latency_us.value_at_quantile(0.5) as f64 / 1000.0,
            p.latency_us.value_at_quantile(0.99) as f64 / 1000.0,
            p.latency_us.value_at_quantile(0.999) as f64 / 1000.0,
        );
    }
    Ok(())
}

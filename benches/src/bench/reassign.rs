//! A partition move under load (issue 11): a 4-broker cluster; topic
//! `moving` (`--partitions`, 1 by default; replication factor 3) is filled
//! with 1 KiB records, then each partition moves one replica to the broker
//! that had none of it (all in one request), while a one-in-flight producer
//! writes to topic `busy` (1 partition, replication factor 3). Prints the move's duration and MB/s
//! (the partition's record bytes over the time from the request to the
//! controller's record of completion), and `busy`'s produce p50/p99 before
//! and during the move. `--throttle` sets the brokers'
//! `reassignment.replication_throttled_rate` (0: none).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use ferrolog_client::admin::ReassignmentRequest;
use ferrolog_client::{Admin, ClientConfig, MetadataCache, Producer, ProducerConfig, Record};
use hdrhistogram::Histogram;

use crate::cluster;
use crate::load::{self, ProduceArgs};

/// Flags of `reassign`.
#[derive(Args, Debug, Clone)]
pub struct ReassignArgs {
    /// Seconds of pipelined 1 KiB produce into the partition that moves
    /// (about 1 GiB in 12 s on the reference machine; the size reached is
    /// printed).
    #[arg(long, default_value_t = 12)]
    fill_seconds: u64,
    /// The brokers' reassignment throttle, bytes/s (0: none).
    #[arg(long, default_value_t = 32 << 20)]
    throttle: u64,
    /// Seconds of one-in-flight produce to `busy` before the move.
    #[arg(long, default_value_t = 5)]
    baseline_seconds: u64,
    /// Partitions of `moving`, all moved in one request: how the move's
    /// cost grows with the number of partitions.
    #[arg(long, default_value_t = 1)]
    partitions: u32,
}

/// One record at a time to `topic` until `stop`; the acknowledgement
/// latencies, µs.
async fn one_at_a_time(
    meta: Arc<MetadataCache>,
    topic: &'static str,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Histogram<u64>> {
    let producer = Producer::new(meta, ProducerConfig { linger_ms: 0, ..ProducerConfig::default() })?;
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let value = vec![b'x'; 100];
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        producer.send(topic, Record::new(value.clone())).await?;
        h.record(t.elapsed().as_micros().max(1) as u64)?;
    }
    Ok(h)
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// `reassign`.
///
/// # Errors
/// Cluster start-up, a refused write or reassignment, or a move that does
/// not complete within 30 minutes.
pub async fn run(a: ReassignArgs) -> anyhow::Result<()> {
    let config = format!("[reassignment]\nreplication_throttled_rate = {}\n", a.throttle);
    let (c, _config) = cluster::start_configured("bench-reassign", 4, &config).await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(60));
    for (t, n) in [("moving", a.partitions), ("busy", 1)] {
        admin.create_topic(t, n, 3).await?;
        admin.wait_for_leaders(t, Duration::from_secs(120)).await?;
    }
    let filled =
        load::produce(&meta, "moving", &ProduceArgs::pipelined(1024, a.fill_seconds, a.partitions)).await?;
    let bytes = filled.records * 1024;
    println!(
        "filled {} partitions of moving with {} records of 1 KiB ({:.0} MiB) in {:.1} s",
        a.partitions,
        filled.records,
        bytes as f64 / (1 << 20) as f64,
        filled.seconds
    );

    let stop = Arc::new(AtomicBool::new(false));
    let before = tokio::spawn(one_at_a_time(meta.clone(), "busy", stop.clone()));
    tokio::time::sleep(Duration::from_secs(a.baseline_seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let before = before.await??;

    // Each partition moves its first replica to the broker without one.
    let cluster = admin.fresh_metadata().await?;
    let mut changes = Vec::new();
    for p in &cluster.topics["moving"].partitions {
        let Some(spare) = (1..=4).find(|b| !p.replicas.contains(b)) else { continue };
        let target: Vec<u32> = p.replicas.iter().copied().skip(1).chain([spare]).collect();
        changes.push(ReassignmentRequest {
            topic: "moving".into(),
            partition: p.partition,
            replicas: Some(target),
        });
    }
    anyhow::ensure!(
        changes.len() == a.partitions as usize,
        "{} of {} partitions can move",
        changes.len(),
        a.partitions
    );
    let stop = Arc::new(AtomicBool::new(false));
    let during = tokio::spawn(one_at_a_time(meta.clone(), "busy", stop.clone()));
    let started = Instant::now();
    for r in
        admin.clone().with_timeout(Duration::from_secs(600)).alter_partition_reassignments(&changes).await?
    {
        r?;
    }
    let requested = started.elapsed();
    let moving: Vec<ferrolog_client::admin::AwaitedMove> =
        changes.iter().map(|c| (c.topic.clone(), c.partition, c.replicas.clone())).collect();
    admin.wait_for_reassignments(&moving, Duration::from_secs(1800), |_| {}).await?;
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let during = during.await??;
    anyhow::ensure!(!during.is_empty(), "no write to busy was acknowledged during the move");

    println!(
        "moved one replica of each of {} partitions to the spare broker: requests committed in {:.1} s, all done in {:.1} s, {:.1} MB/s of record bytes (throttle {})",
        changes.len(),
        requested.as_secs_f64(),
        took.as_secs_f64(),
        bytes as f64 / took.as_secs_f64() / 1e6,
        if a.throttle == 0 { "none".to_owned() } else { format!("{:.1} MB/s", a.throttle as f64 / 1e6) }
    );
    println!("| busy-0, one 100 B record in flight | acks | p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|");
    for (label, h) in [("before the move", &before), ("during the move", &during)] {
        println!(
            "| {label} | {} | {:.2} | {:.2} | {:.2} |",
            h.len(),
            ms(h, 0.5),
            ms(h, 0.99),
            h.max() as f64 / 1000.0
        );
    }
    Ok(())
}

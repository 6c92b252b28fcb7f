//! Appends beside large reads of the same partition (issue 10): the p99 of
//! one-batch-in-flight appends to a one-partition topic, first alone, then
//! while another task fetches 16 MiB at a time from the same partition's
//! leader in a loop, printed side by side in one run. A fetch holds the
//! log's lock only to plan its read, and reads its files on the blocking
//! pool; what the loop still adds is CPU and disk shared on one machine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use ferrolog_client::{Admin, ClientConfig, MetadataCache};
use ferrolog_proto::client::FetchRequest;
use ferrolog_tests::{connect, raw};

use crate::cluster;
use crate::load::{self, ProduceArgs};

/// Flags of `contention`.
#[derive(Args, Debug, Clone)]
pub struct ContentionArgs {
    /// Seconds of one-in-flight appends, per phase.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Seconds of pipelined 1 KiB produce first, for the fetches to read
    /// (a few hundred MiB here).
    #[arg(long, default_value_t = 3)]
    fill_seconds: u64,
    /// Bytes per fetch.
    #[arg(long, default_value_t = 16 << 20)]
    fetch_bytes: u32,
}

/// `contention`.
///
/// # Errors
/// If the cluster cannot start, a record fails, or the fetch loop fetched
/// nothing (the comparison would be vacuous).
pub async fn run(a: ContentionArgs) -> anyhow::Result<()> {
    const TOPIC: &str = "contention";
    let c = cluster::start("bench-contention").await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(60));
    admin.create_topic(TOPIC, 1, 3).await?;
    admin.wait_for_leaders(TOPIC, Duration::from_secs(60)).await?;

    // Fill: 1 KiB records, pipelined.
    let fill = ProduceArgs::pipelined(1024, a.fill_seconds, 1);
    let filled = load::produce(&meta, TOPIC, &fill).await?;
    let filled_mib = (filled.records * 1024) >> 20;
    println!("filled {} records ({filled_mib} MiB) in {:.1} s", filled.records, filled.seconds);

    let one = ProduceArgs::one_in_flight(100, a.seconds, 1);
    let alone = load::produce(&meta, TOPIC, &one).await?;

    let leader = raw::leader(&c, TOPIC, 0, Duration::from_secs(30)).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let (fetches, bytes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // The reader is a consumer of its own, as it would be in production:
    // its own thread and runtime (its connection's tasks too), so decoding
    // 16 MiB answers does not delay the producer's acknowledgements in
    // this process. What is measured is what the reads cost the brokers.
    let reader = {
        let (stop, fetches, bytes) = (stop.clone(), fetches.clone(), bytes.clone());
        let addr = c.broker(leader).client_addr;
        let max_bytes = a.fetch_bytes;
        std::thread::spawn(move || -> anyhow::Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async move {
                let mut client = connect(addr).await?;
                let mut offset = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let req = FetchRequest {
                        topic: TOPIC.into(),
                        partition: 0,
                        offset,
                        max_bytes,
                        max_wait_ms: 0,
                        ..Default::default()
                    };
                    let r = client.fetch(req).await?.into_inner();
                    anyhow::ensure!(r.error.is_none(), "fetch failed: {:?}", r.error);
                    let got: u64 = r.batches.iter().map(|b| b.records.len() as u64).sum();
                    fetches.fetch_add(1, Ordering::Relaxed);
                    bytes.fetch_add(got, Ordering::Relaxed);
                    // Wrap round to the start before the tail, so every
                    // fetch is a full one.
                    offset = match r.batches.last() {
                        Some(b) if b.base_offset + u64::from(b.record_count) + 20_000 < r.high_watermark => {
                            b.base_offset + u64::from(b.record_count)
                        }
                        _ => 0,
                    };
                }
                anyhow::Ok(())
            })
        })
    };
    let started = Instant::now();
    let beside = load::produce(&meta, TOPIC, &one).await;
    stop.store(true, Ordering::Relaxed);
    let read_for = started.elapsed().as_secs_f64();
    reader.join().map_err(|_| anyhow::anyhow!("the fetch loop's thread panicked"))??;
    let beside = beside?;
    let (fetches, bytes) = (fetches.load(Ordering::Relaxed), bytes.load(Ordering::Relaxed));
    anyhow::ensure!(
        fetches > 0 && bytes > 0,
        "the fetch loop fetched nothing: the comparison would be vacuous"
    );

    println!("| one batch in flight, 100 B | appends | p50 ms | p99 ms | p99.9 ms |");
    println!("|---|---|---|---|---|");
    for (label, r) in
        [("alone", &alone), (&*format!("beside a {} MiB fetch loop", a.fetch_bytes >> 20), &beside)]
    {
        println!(
            "| {label} | {} | {:.2} | {:.2} | {:.2} |",
            r.records,
            r.latency_us.value_at_quantile(0.5) as f64 / 1000.0,
            r.latency_us.value_at_quantile(0.99) as f64 / 1000.0,
            r.latency_us.value_at_quantile(0.999) as f64 / 1000.0,
        );
    }
    println!(
        "fetch loop: {fetches} fetches, {:.1} MB/s of record bytes ({:.1} MiB per fetch)",
        bytes as f64 / read_for / 1e6,
        bytes as f64 / fetches as f64 / (1 << 20) as f64
    );
    let added = beside.latency_us.value_at_quantile(0.99) as f64 / 1000.0
        - alone.latency_us.value_at_quantile(0.99) as f64 / 1000.0;
    println!("the fetch loop adds {added:.2} ms to the p99 (target: ≤ 2 ms)");
    Ok(())
}

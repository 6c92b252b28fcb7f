//! `ferrolog-bench kafka`: the same produce and consume workloads through
//! the Kafka listener, driven by kcat (librdkafka, a real Kafka client),
//! and through the native gRPC client library, on one cluster in one run.
//!
//! Per record size (100 B, 1 KiB): the native producer runs pipelined for
//! `--seconds` (as `e2e` does: 20,000 records in flight, 2 ms linger,
//! 256 KiB batches); kcat then produces as many records of the same size
//! from a file (acks=all, 2 ms linger, 256 KiB batches, no idempotence, no
//! compression) to a topic of its own; each topic is then read back from
//! the start by the same kind of client (8 MiB per partition fetch both). kcat's times include its start-up
//! and metadata fetch (tens of ms beside runs of seconds). The brokers run
//! with `flush = always`, as for every benchmark here.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use ferrolog_client::{ClientConfig, MetadataCache};
use ferrolog_tests::kafka_tools::kcat;

use crate::cluster;
use crate::load::{self, ProduceArgs};

/// Flags of `kafka`.
#[derive(Args, Debug, Clone)]
pub struct KafkaArgs {
    /// Seconds of the native producer's run per record size; kcat then
    /// produces as many records.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Partitions of each topic (replication factor 3).
    #[arg(long, default_value_t = 6)]
    partitions: u32,
}

/// Runs kcat with `args`, `input` on its stdin (a file), output discarded;
/// returns its wall time, seconds.
fn timed_kcat(args: &[String], input: Option<&std::path::Path>) -> anyhow::Result<f64> {
    let mut cmd = Command::new(kcat()?);
    cmd.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
    match input {
        Some(path) => cmd.stdin(std::fs::File::open(path)?),
        None => cmd.stdin(Stdio::null()),
    };
    let start = Instant::now();
    let out = cmd.output().context("running kcat")?;
    let seconds = start.elapsed().as_secs_f64();
    anyhow::ensure!(out.status.success(), "kcat {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(seconds)
}

/// Kafka against native: prints a table.
///
/// # Errors
/// Cluster, client or kcat failures.
pub async fn kafka(a: KafkaArgs) -> anyhow::Result<()> {
    let c = cluster::start("bench-kafka").await?;
    let meta: Arc<MetadataCache> = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let bootstrap = c.kafka_bootstrap();
    let dir = tempfile::tempdir()?;
    println!("| record | path | produce records/s | produce MB/s | consume records/s | consume MB/s |");
    println!("|---|---|---|---|---|---|");
    for bytes in [100usize, 1024] {
        let native = format!("native-{bytes}");
        load::topic(&meta, &native, a.partitions).await?;
        let p =
            load::produce(&meta, &native, &ProduceArgs::pipelined(bytes, a.seconds, a.partitions)).await?;
        let (crps, cmbps) = load::consume(&meta, &native, p.records, bytes).await?;
        let rate = p.records as f64 / p.seconds;
        println!(
            "| {bytes} B | native gRPC | {rate:.0} | {:.1} | {crps:.0} | {cmbps:.1} |",
            rate * bytes as f64 / 1e6
        );

        let n = p.records;
        let kafka = format!("kafka-{bytes}");
        load::topic(&meta, &kafka, a.partitions).await?;
        let input = dir.path().join(format!("records-{bytes}.txt"));
        {
            let mut f = std::io::BufWriter::new(std::fs::File::create(&input)?);
            let line = vec![b'x'; bytes];
            for _ in 0..n {
                f.write_all(&line)?;
                f.write_all(b"\n")?;
            }
            f.flush()?;
        }
        let common = |more: &[&str]| -> Vec<String> {
            let mut v: Vec<String> = vec!["-b".into(), bootstrap.clone(), "-t".into(), kafka.clone()];
            v.extend(more.iter().map(|s| (*s).to_owned()));
            v
        };
        let produce = common(&[
            "-P",
            "-X",
            "acks=all",
            "-X",
            "linger.ms=2",
            "-X",
            "batch.size=262144",
            "-X",
            "queue.buffering.max.messages=1000000",
            "-X",
            "enable.idempotence=false",
            "-X",
            "compression.codec=none",
        ]);
        let ps = tokio::task::spawn_blocking({
            let input = input.clone();
            move || timed_kcat(&produce, Some(&input))
        })
        .await??;
        let count = n.to_string();
        // 8 MiB per partition fetch, as the native consumer asks
        // (librdkafka's default is 1 MiB), within the broker's 16 MiB per
        // response; queued.min.messages raised from librdkafka's 100,000 so
        // that 100 B records are prefetched as deep as 1 KiB ones (with the
        // defaults kcat read 100 B records at 0.38–0.48 M/s here).
        let consume = common(&[
            "-C",
            "-o",
            "beginning",
            "-e",
            "-q",
            "-c",
            &count,
            "-X",
            "fetch.max.bytes=16777216",
            "-X",
            "max.partition.fetch.bytes=8388608",
            "-X",
            "queued.min.messages=1000000",
        ]);
        let cs = tokio::task::spawn_blocking(move || timed_kcat(&consume, None)).await??;
        let (prate, crate_) = (n as f64 / ps, n as f64 / cs);
        println!(
            "| {bytes} B | Kafka (kcat) | {prate:.0} | {:.1} | {crate_:.0} | {:.1} |",
            prate * bytes as f64 / 1e6,
            crate_ * bytes as f64 / 1e6
        );
        println!(
            "| {bytes} B | Kafka / native | {:.0}% | | {:.0}% | |",
            100.0 * prate / rate,
            100.0 * crate_ / crps
        );
    }
    Ok(())
}

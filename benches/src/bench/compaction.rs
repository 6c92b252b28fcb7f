//! Compaction under load (issue 12): a changelog topic (one partition,
//! replication factor 3) is filled with pipelined 1 KiB records over 1,024
//! keys for `--seconds` while it does not compact; then its
//! `cleanup.policy` is altered to `compact` and every replica compacts it.
//! Meanwhile a one-in-flight producer writes to another topic on the same
//! brokers, before the alter (baseline) and from it on (during). Prints each
//! replica's pass, read from the brokers' logs (bytes read, time, MB/s on
//! the one core a pass runs on, segment bytes before and after), and the
//! probe's latency in both windows.

use std::time::{Duration, Instant};

use clap::Args;
use ferrolog_client::{Admin, ClientConfig, MetadataCache};

use crate::cluster;
use crate::load::{self, ProduceArgs};

/// Flags of `compaction`.
#[derive(Args, Debug, Clone)]
pub struct CompactionArgs {
    /// Seconds of pipelined produce filling the changelog.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Seconds of each one-in-flight probe window.
    #[arg(long, default_value_t = 10)]
    probe_seconds: u64,
    /// `segment.bytes` of the changelog, MiB.
    #[arg(long, default_value_t = 8)]
    segment_mib: u64,
    /// The brokers' `compaction.check_interval_ms`.
    #[arg(long, default_value_t = 1000)]
    check_interval_ms: u64,
    /// The brokers' `compaction.io_max_bytes_per_second`, MiB/s (0: no limit).
    #[arg(long, default_value_t = 0)]
    io_max_mib_per_second: u64,
}

/// One replica's compaction pass as its broker logged it.
#[derive(Debug, Default)]
struct Pass {
    read_bytes: u64,
    elapsed_ms: u64,
    bytes_before: u64,
    bytes_after: u64,
    segments: u64,
    keys: u64,
}

/// The value of `name=` in a log line, as a number.
fn field(line: &str, name: &str) -> Option<u64> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// The passes broker `log`'s log recorded for `topic` that rewrote segments.
fn passes(log: &std::path::Path, topic: &str) -> Vec<Pass> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains(" compacted") && l.contains(&format!("topic={topic}")))
        .filter_map(|l| {
            Some(Pass {
                read_bytes: field(l, "read_bytes")?,
                elapsed_ms: field(l, "elapsed_ms")?,
                bytes_before: field(l, "bytes_before")?,
                bytes_after: field(l, "bytes_after")?,
                segments: field(l, "segments")?,
                keys: field(l, "keys")?,
            })
        })
        .filter(|p| p.segments > 0)
        .collect()
}

/// `compaction`.
///
/// # Errors
/// Cluster start-up, a refused write, or replicas that do not compact
/// within two minutes.
pub async fn run(a: CompactionArgs) -> anyhow::Result<()> {
    let config = format!(
        "[compaction]\ncheck_interval_ms = {}\nio_max_bytes_per_second = {}\n",
        a.check_interval_ms,
        a.io_max_mib_per_second << 20
    );
    let (c, _config) = cluster::start_configured("bench-compaction", 3, &config).await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(60));
    let segment = a.segment_mib << 20;
    for topic in ["changelog", "probe"] {
        let config =
            [("segment.bytes".to_owned(), segment.to_string()), ("retention.ms".to_owned(), "-1".to_owned())]
                .into();
        admin.create_topic_with_config(topic, 1, 3, &config, |_| {}).await?;
        admin.wait_for_leaders(topic, Duration::from_secs(60)).await?;
    }
    let filled = load::produce(&meta, "changelog", &ProduceArgs::pipelined(1024, a.seconds, 1)).await?;
    let baseline =
        load::produce(&meta, "probe", &ProduceArgs::one_in_flight(100, a.probe_seconds, 1)).await?;

    let altered = Instant::now();
    admin
        .alter_topic_config("changelog", &[("cleanup.policy".to_owned(), "compact".to_owned())].into(), &[])
        .await?;
    let during = load::produce(&meta, "probe", &ProduceArgs::one_in_flight(100, a.probe_seconds, 1)).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let logs: Vec<_> = c.brokers.iter().map(|b| b.log.clone()).collect();
    let all = loop {
        let all: Vec<Vec<Pass>> = logs.iter().map(|l| passes(l, "changelog")).collect();
        if all.iter().all(|p| !p.is_empty()) {
            break all;
        }
        anyhow::ensure!(Instant::now() < deadline, "not every replica compacted within 2 minutes");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let done_after = altered.elapsed().as_secs_f64();

    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "changelog: {} records of 1 KiB over 1,024 keys ({:.0} MiB of values), segment.bytes {} MiB, compaction reads limited to {} MiB/s (0: none)",
        filled.records,
        mib(filled.records * 1024),
        a.segment_mib,
        a.io_max_mib_per_second
    );
    println!(
        "| broker | read | pass | MB/s (one core) | segments rewritten | segment bytes before → after | keys |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (i, ps) in all.iter().enumerate() {
        let p = &ps[0];
        println!(
            "| {} | {:.0} MiB | {:.2} s | {:.0} | {} | {:.0} → {:.1} MiB | {} |",
            i + 1,
            mib(p.read_bytes),
            p.elapsed_ms as f64 / 1000.0,
            p.read_bytes as f64 / 1e6 / (p.elapsed_ms.max(1) as f64 / 1000.0),
            p.segments,
            mib(p.bytes_before),
            mib(p.bytes_after),
            p.keys
        );
    }
    println!(
        "every replica compacted {done_after:.1} s after the alter; the probe's second window ran the first {} s of it",
        a.probe_seconds
    );
    let ms = |r: &load::ProduceResult, q: f64| r.latency_us.value_at_quantile(q) as f64 / 1000.0;
    println!("| probe (100 B, one in flight) | records | p50 ms | p99 ms | p99.9 ms |");
    println!("|---|---|---|---|---|");
    for (label, r) in [("before the alter", &baseline), ("from the alter on", &during)] {
        println!(
            "| {label} | {} | {:.2} | {:.2} | {:.2} |",
            r.records,
            ms(r, 0.5),
            ms(r, 0.99),
            ms(r, 0.999)
        );
    }
    Ok(())
}

//! Retention under a steady produce load (issue 12): two topics of one
//! partition (replication factor 3) on the same cluster, `kept` without
//! retention and `retained` with `retention.bytes` (`--retention-mib`) and
//! `segment.bytes` (`--segment-mib`); pipelined 1 KiB records go to each
//! for `--seconds`, one after the other, as fast as the cluster takes them
//! or paced at `--rate-mib-per-second`. While `retained` takes writes,
//! the disk its replica uses on each broker (segment files and snapshot
//! files, each file once however many hard links it has) is sampled every
//! 100 ms. Prints the throughput of both runs, how many times the limit was
//! written, the largest disk use seen beside the limit + 2 segments, and
//! what that largest sample held (log segments, files only snapshots hold,
//! other).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Args;
use ferrolog_client::{Admin, ClientConfig, MetadataCache};
use ferrolog_tests::Cluster;

use crate::cluster;
use crate::load::{self, ProduceArgs};

/// Flags of `retention`.
#[derive(Args, Debug, Clone)]
pub struct RetentionArgs {
    /// Seconds of produce to each topic.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// `retention.bytes` of `retained`, MiB.
    #[arg(long, default_value_t = 64)]
    retention_mib: u64,
    /// `segment.bytes` of both topics, MiB.
    #[arg(long, default_value_t = 8)]
    segment_mib: u64,
    /// The brokers' `retention.check_interval_ms`.
    #[arg(long, default_value_t = 1000)]
    check_interval_ms: u64,
    /// Most MiB of record values per second to each topic (paced); as
    /// fast as the cluster takes them when absent.
    #[arg(long)]
    rate_mib_per_second: Option<f64>,
}

/// A replica's disk use, bytes, each inode once however many hard links
/// it has.
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    /// Segment files of the log (`*.seg` outside `snapshots/`).
    segments: u64,
    /// Files only a snapshot holds (manifests, segments the log has
    /// already deleted; before snapshots linked the active segment, the
    /// copied part of it).
    snapshot_only: u64,
    /// Everything else (the replica's metadata database, ...).
    other: u64,
}

impl Usage {
    fn total(&self) -> u64 {
        self.segments + self.snapshot_only + self.other
    }
}

/// Every file under `dir`, recursively: (inode, bytes, in a snapshot, a segment).
fn files(dir: &Path, in_snapshot: bool, out: &mut Vec<((u64, u64), u64, bool, bool)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue };
        let path = e.path();
        if m.is_dir() {
            files(&path, in_snapshot || e.file_name() == "snapshots", out);
        } else {
            let seg = path.extension().is_some_and(|x| x == "seg");
            out.push(((m.dev(), m.ino()), m.len(), in_snapshot, seg));
        }
    }
}

/// Disk use of `topic`'s replica on broker `id`: an inode linked from the
/// log counts as the log's, one linked only from snapshots as theirs.
fn replica_usage(c: &Cluster, id: u32, topic: &str) -> Usage {
    let mut all = Vec::new();
    for d in c.replica_dirs(id, &format!("{topic}-0.")) {
        files(&c.data_dir(id).join("partitions").join(d), false, &mut all);
    }
    let in_log: HashSet<(u64, u64)> = all.iter().filter(|f| !f.2).map(|f| f.0).collect();
    let mut seen = HashSet::new();
    let mut u = Usage::default();
    // Log paths first, so a hard-linked segment counts once, as the log's.
    all.sort_by_key(|f| f.2);
    for (ino, len, in_snapshot, seg) in all {
        if !seen.insert(ino) {
            continue;
        }
        match (in_snapshot, seg) {
            (false, true) => u.segments += len,
            (true, _) if !in_log.contains(&ino) => u.snapshot_only += len,
            _ => u.other += len,
        }
    }
    u
}

/// Disk bytes of `topic`'s replica on broker `id`.
fn replica_bytes(c: &Cluster, id: u32, topic: &str) -> u64 {
    replica_usage(c, id, topic).total()
}

/// `retention`.
///
/// # Errors
/// Cluster start-up, or a refused write.
pub async fn run(a: RetentionArgs) -> anyhow::Result<()> {
    let config = format!("[retention]\ncheck_interval_ms = {}\n", a.check_interval_ms);
    let (c, _config) = cluster::start_configured("bench-retention", 3, &config).await?;
    let c = Arc::new(c);
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(60));
    let (retention, segment) = (a.retention_mib << 20, a.segment_mib << 20);
    for (topic, retention_bytes) in [("kept", -1i64), ("retained", retention as i64)] {
        let config = [
            ("segment.bytes".to_owned(), segment.to_string()),
            ("retention.bytes".to_owned(), retention_bytes.to_string()),
            ("retention.ms".to_owned(), "-1".to_owned()),
        ]
        .into();
        admin.create_topic_with_config(topic, 1, 3, &config, |_| {}).await?;
        admin.wait_for_leaders(topic, Duration::from_secs(60)).await?;
    }

    // 1 KiB records: MiB/s × 1,024 records a second.
    let load = ProduceArgs::pipelined(1024, a.seconds, 1).at_rate(a.rate_mib_per_second.map(|r| r * 1024.0));
    let kept = load::produce(&meta, "kept", &load).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (c, stop) = (c.clone(), stop.clone());
        tokio::spawn(async move {
            let mut max = [Usage::default(); 3];
            while !stop.load(Ordering::Relaxed) {
                for (i, m) in max.iter_mut().enumerate() {
                    let c = c.clone();
                    let u = tokio::task::spawn_blocking(move || replica_usage(&c, i as u32 + 1, "retained"))
                        .await
                        .unwrap_or_default();
                    if u.total() > m.total() {
                        *m = u;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            max
        })
    };
    let retained = load::produce(&meta, "retained", &load).await?;
    // Five more checks after the last write.
    tokio::time::sleep(Duration::from_millis(5 * a.check_interval_ms + 500)).await;
    stop.store(true, Ordering::Relaxed);
    let max = sampler.await?;
    let end: Vec<u64> = (1..=3).map(|id| replica_bytes(&c, id, "retained")).collect();
    let start =
        admin.describe_partition("retained", 0).await?.status.map(|s| s.log_start_offset).unwrap_or(0);

    let mb_s = |r: &load::ProduceResult| r.records as f64 * 1024.0 / r.seconds / 1e6;
    let written = retained.records * 1024;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "retention.bytes {} MiB, segment.bytes {} MiB, check every {} ms, {}",
        a.retention_mib,
        a.segment_mib,
        a.check_interval_ms,
        a.rate_mib_per_second.map_or("unpaced".to_owned(), |r| format!("paced at {r} MiB/s"))
    );
    println!("| topic | MB/s | written | largest replica on disk (brokers 1, 2, 3) | at the end |");
    println!("|---|---|---|---|---|");
    println!(
        "| kept (no retention) | {:.1} | {:.0} MiB | {:.0} MiB | |",
        mb_s(&kept),
        mib(kept.records * 1024),
        mib(replica_bytes(&c, 1, "kept"))
    );
    println!(
        "| retained | {:.1} | {:.0} MiB ({:.1}× the limit) | {:.0}, {:.0}, {:.0} MiB | {:.0}, {:.0}, {:.0} MiB |",
        mb_s(&retained),
        mib(written),
        written as f64 / retention as f64,
        mib(max[0].total()),
        mib(max[1].total()),
        mib(max[2].total()),
        mib(end[0]),
        mib(end[1]),
        mib(end[2]),
    );
    for (i, u) in max.iter().enumerate() {
        println!(
            "broker {} at its largest: segments {:.1} MiB, snapshot-only files {:.1} MiB, other {:.1} MiB",
            i + 1,
            mib(u.segments),
            mib(u.snapshot_only),
            mib(u.other)
        );
    }
    // Kafka's size rule keeps at least `retention.bytes` (active segment
    // included), so right after a roll the sealed segments alone can come
    // to just under limit + 2 segments: any time between that roll and the
    // deletion shows above the bound, as this many ms of writes.
    let bound = retention + 2 * segment;
    let worst = max.iter().map(Usage::total).max().unwrap_or(0);
    let over = worst.saturating_sub(bound);
    println!(
        "largest over limit + 2 segments: {:.1} MiB, {:.0} ms of writes at {:.1} MB/s",
        mib(over),
        over as f64 / (mb_s(&retained) * 1e6) * 1e3,
        mb_s(&retained)
    );
    println!(
        "limit + 2 segments: {:.0} MiB; log start offset at the end {start} of {} records; throughput with retention {:.0}% of without",
        mib(retention + 2 * segment),
        retained.records,
        100.0 * mb_s(&retained) / mb_s(&kept)
    );
    Ok(())
}

//! ListOffsets by timestamp (Kafka's rule, KIP-79) against real brokers:
//! the first record in offset order whose timestamp is at or after the
//! target, at record granularity, with timestamps out of order within and
//! across batches, and the same answers from a new leader after SIGKILL of
//! the old one, and after every broker restarted, also with its sealed
//! segments' index files deleted (a log opens without them).

use std::time::Duration;

use ferrolog_proto::client::{ProduceRequest, Record};
use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{create_topic, create_topic_with_config, offsets_for_time, produce};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const WAIT: Duration = Duration::from_secs(30);

/// One produce request to partition 0 of `topic` with a record per stamp.
fn stamped(topic: &str, stamps: &[i64]) -> ProduceRequest {
    ProduceRequest {
        topic: topic.into(),
        partition: 0,
        records: stamps
            .iter()
            .map(|t| Record {
                value: t.to_string().into_bytes().into(),
                timestamp_ms: *t,
                ..Record::default()
            })
            .collect(),
        producer_id: -1,
        producer_epoch: 0,
        base_sequence: 0,
        ..ProduceRequest::default()
    }
}

/// `(offset, record timestamp)` for `ts`, or `None` when not found (then
/// the offset must be the high watermark `hw` and no timestamp is given).
async fn at(c: &Cluster, ts: i64, hw: u64) -> anyhow::Result<(Option<(u64, i64)>, u32)> {
    let (r, by) = offsets_for_time(c, "times", 0, ts, WAIT).await?;
    if !r.found {
        assert_eq!((r.offset, r.timestamp_ms), (hw, None), "not found for {ts}: {r:?}");
        return Ok((None, by));
    }
    let stamp = r.timestamp_ms.unwrap_or_else(|| panic!("found for {ts} without a timestamp: {r:?}"));
    Ok((Some((r.offset, stamp)), by))
}

/// The answers the issue asks for, on the one 4-record batch
/// 1000, 5000, 2000, 3000 (offsets 0..4).
async fn check_issue_example(c: &Cluster) -> anyhow::Result<u32> {
    let (got, by) = at(c, 1001, 4).await?;
    assert_eq!(got, Some((1, 5000)), "1001: the first record stamped ≥ 1001, not its batch's start");
    assert_eq!(at(c, 999, 4).await?.0, Some((0, 1000)));
    assert_eq!(at(c, 5000, 4).await?.0, Some((1, 5000)));
    assert_eq!(at(c, 5001, 4).await?.0, None, "past the last record: not found, no error");
    assert_eq!(at(c, 2500, 4).await?.0, Some((1, 5000)), "first in offset order, not nearest in time");
    Ok(by)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_for_a_timestamp_are_per_record_and_survive_a_leader_kill() -> anyhow::Result<()> {
    let mut c = Cluster::start("time-offsets", BIN, 3, &[]).await?;
    create_topic(&c, "times", 1, 3).await?;
    let (r, _) = produce(&c, stamped("times", &[1000, 5000, 2000, 3000]), WAIT).await?;
    assert_eq!(r.base_offset, 0);

    let old = check_issue_example(&c).await?;

    // SIGKILL the leader; a new one answers the same from its own replica.
    c.kill(old);
    let new = check_issue_example(&c).await?;
    assert_ne!(new, old, "answered by the killed broker");

    // A later batch whose first record goes back in time and whose second
    // is the latest of all: offsets 4 (800) and 5 (6000).
    let (r, _) = produce(&c, stamped("times", &[800, 6000]), WAIT).await?;
    assert_eq!(r.base_offset, 4);
    assert_eq!(
        at(&c, 5001, 6).await?.0,
        Some((5, 6000)),
        "the answer is in the later batch, at its 2nd record"
    );
    assert_eq!(at(&c, 900, 6).await?.0, Some((0, 1000)), "800 at offset 4 comes after 1000 at offset 0");
    assert_eq!(at(&c, 6001, 6).await?.0, None);
    Ok(())
}

/// Every `.idx` file (a sealed segment's index) under `dir`, recursively.
fn index_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(index_files(&path));
        } else if path.extension().is_some_and(|e| e == "idx") {
            out.push(path);
        }
    }
    out
}

/// The answer Kafka's rule gives on `log` (timestamps in offset order):
/// the first offset whose timestamp is at or after `ts`.
fn expected(log: &[i64], ts: i64) -> Option<(u64, i64)> {
    log.iter().position(|t| *t >= ts).map(|o| (o as u64, log[o]))
}

/// Many small segments (`segment.bytes` 4 KiB), timestamps out of order
/// within and across batches: the answers are the same after every broker
/// was SIGKILLed and started again, and again after a restart with every
/// sealed segment's index file deleted (each replica then builds its
/// sparse index in memory from the segments at open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_for_a_timestamp_survive_a_restart_and_rebuilt_indexes() -> anyhow::Result<()> {
    let mut c = Cluster::start("time-restart", BIN, 3, &[]).await?;
    // Stamps here are in 1970: kept forever, not retired by retention.ms.
    let configs = [("segment.bytes", "4096"), ("retention.ms", "-1")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    create_topic_with_config(&c, "times", 1, 3, &configs).await?;
    // 30 batches of 4; each batch's stamps go back and forth, and every
    // fifth batch starts before everything written so far.
    let mut log = Vec::new();
    for b in 0..30i64 {
        let base = if b % 5 == 4 { 500 + b } else { 10_000 + b * 100 };
        let stamps = [base + 50, base, base + 90, base + 10];
        let mut req = stamped("times", &stamps);
        for r in &mut req.records {
            r.value =
                format!("{}-{}", String::from_utf8_lossy(&r.value), "p".repeat(200)).into_bytes().into();
        }
        let (r, _) = produce(&c, req, WAIT).await?;
        assert_eq!(r.base_offset, log.len() as u64);
        log.extend(stamps);
    }
    let hw = log.len() as u64;
    let mut targets: Vec<i64> = log.iter().flat_map(|t| [t - 1, *t, t + 1]).collect();
    targets.extend([0, i64::from(i32::MAX)]);
    targets.sort_unstable();
    targets.dedup();
    let check = async |c: &Cluster, when: &str| -> anyhow::Result<()> {
        for ts in &targets {
            let (got, by) = at(c, *ts, hw).await?;
            assert_eq!(got, expected(&log, *ts), "{when}: timestamp {ts} (answered by broker {by})");
        }
        Ok(())
    };
    check(&c, "before the restart").await?;

    // Every broker SIGKILLed and started again.
    for id in 1..=3 {
        c.kill(id);
    }
    for id in 1..=3 {
        c.spawn(id)?;
    }
    c.wait_ready(3, WAIT).await?;
    check(&c, "after every broker restarted").await?;

    // Again, with every sealed segment's index file deleted.
    for id in 1..=3 {
        c.kill(id);
    }
    let mut deleted = 0;
    for id in 1..=3 {
        for idx in index_files(c.data_dir(id)) {
            std::fs::remove_file(idx)?;
            deleted += 1;
        }
    }
    assert!(deleted >= 3 * 5, "only {deleted} segment indexes: the log did not roll into many segments");
    for id in 1..=3 {
        c.spawn(id)?;
    }
    c.wait_ready(3, WAIT).await?;
    check(&c, "after a restart with the indexes deleted").await?;
    eprintln!("{deleted} segment index files deleted; {} targets checked each time", targets.len());
    Ok(())
}

//! ListOffsets by timestamp (Kafka's rule, KIP-79) against real brokers:
//! the first record in offset order whose timestamp is at or after the
//! target, at record granularity, with timestamps out of order within and
//! across batches, and the same answers from a new leader after SIGKILL of
//! the old one.

use std::time::Duration;

use ferrolog_proto::client::{ProduceRequest, Record};
use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{create_topic, offsets_for_time, produce};

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

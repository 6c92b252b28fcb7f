//! Offsets for a timestamp (Kafka's ListOffsets by time, KIP-79) at record
//! granularity: the first record in offset order whose timestamp is at or
//! after the target, with timestamps out of order within and across
//! batches, across segments, after a reopen and after the sparse indexes
//! are deleted and rebuilt by a rescan.
//!
//! The store does not know the broker's record encoding, so these batches
//! use a test encoding (each record is its timestamp, 8 bytes little-endian)
//! and the lookup is given its decoder.

use std::path::Path;

use bytes::Bytes;
use ferrolog_raft_store::types::{Entry, EntryPayload, log_id};
use ferrolog_raft_store::{Flusher, PartitionLog, RecordBatch, StoreConfig, StoreError};

fn tiny() -> StoreConfig {
    // Small segments and index intervals: many segments, many index rows.
    StoreConfig { segment_bytes: 4096, index_interval_bytes: 200, ..StoreConfig::default() }
}

fn flusher() -> Flusher {
    Flusher::spawn("timestamps").expect("flusher")
}

/// A batch entry at `index` whose records carry `stamps`, in order.
fn batch(index: u64, stamps: &[i64]) -> Entry {
    let records: Vec<u8> = stamps.iter().flat_map(|t| t.to_le_bytes()).collect();
    Entry {
        log_id: log_id(1, 1, index),
        payload: EntryPayload::Normal(RecordBatch {
            record_count: stamps.len() as u32,
            first_timestamp_ms: stamps[0],
            max_timestamp_ms: stamps.iter().copied().max().expect("a record"),
            producer_id: -1,
            producer_epoch: 0,
            base_sequence: 0,
            records: Bytes::from(records),
        }),
    }
}

/// The test encoding's decoder: one little-endian i64 per record.
fn stamps_of(records: Bytes) -> Result<Vec<(u32, i64)>, String> {
    if !records.len().is_multiple_of(8) {
        return Err(format!("{} bytes is not a whole number of records", records.len()));
    }
    Ok(records
        .chunks_exact(8)
        .enumerate()
        .map(|(d, c)| (d as u32, i64::from_le_bytes(c.try_into().expect("8 bytes"))))
        .collect())
}

fn lookup(log: &PartitionLog, ts: i64, up_to: u64) -> Option<(u64, i64)> {
    log.offset_for_timestamp(ts, up_to, stamps_of).expect("lookup")
}

/// What Kafka's rule answers: the first record in offset order whose
/// timestamp is ≥ `ts`, as (offset, timestamp), below `up_to`.
fn model(all: &[i64], ts: i64, up_to: u64) -> Option<(u64, i64)> {
    all.iter().enumerate().take(up_to as usize).find(|(_, t)| **t >= ts).map(|(o, t)| (o as u64, *t))
}

fn append(log: &mut PartitionLog, entries: Vec<Entry>) {
    log.append(entries, Box::new(|r| r.expect("flush"))).expect("append");
}

#[test]
fn the_issue_example_answers_at_record_granularity() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    append(&mut log, vec![batch(0, &[1000, 5000, 2000, 3000])]);
    assert_eq!(lookup(&log, 1001, u64::MAX), Some((1, 5000)), "not the batch's first record");
    assert_eq!(lookup(&log, 999, u64::MAX), Some((0, 1000)));
    assert_eq!(lookup(&log, 1000, u64::MAX), Some((0, 1000)));
    assert_eq!(lookup(&log, 5000, u64::MAX), Some((1, 5000)));
    assert_eq!(lookup(&log, 2500, u64::MAX), Some((1, 5000)), "first in offset order, not the closest time");
    assert_eq!(lookup(&log, 5001, u64::MAX), None);
    assert_eq!(lookup(&log, i64::MAX, u64::MAX), None);
    assert_eq!(lookup(&log, i64::MIN, u64::MAX), Some((0, 1000)));
    // Records at or past `up_to` (the high watermark) are not answered.
    assert_eq!(lookup(&log, 1001, 4), Some((1, 5000)));
    assert_eq!(lookup(&log, 1001, 0), None);

    // A later batch with smaller timestamps, then one with a larger one:
    // the answer skips the earlier batches whose records are all too early.
    append(&mut log, vec![batch(1, &[1500, 900]), batch(2, &[800, 6000, 7000])]);
    assert_eq!(lookup(&log, 5001, u64::MAX), Some((7, 6000)));
    assert_eq!(lookup(&log, 6500, u64::MAX), Some((8, 7000)));
    assert_eq!(lookup(&log, 1400, u64::MAX), Some((1, 5000)), "batch 0 holds 5000 before batch 1's 1500");
    assert_eq!(lookup(&log, 7001, u64::MAX), None);
}

/// A deterministic pseudo-random sequence (64-bit LCG).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}

/// Appends `batches` random batches (1 to 6 records, timestamps jumping
/// back and forth) with blank entries among them; returns every record's
/// timestamp by offset.
fn fill(log: &mut PartitionLog, rng: &mut Lcg, batches: u64) -> Vec<i64> {
    let mut all = Vec::new();
    let mut index = log.next_index();
    for _ in 0..batches {
        if rng.next(5) == 0 {
            append(log, vec![Entry { log_id: log_id(1, 1, index), payload: EntryPayload::Blank }]);
            index += 1;
        }
        let n = 1 + rng.next(6) as usize;
        // A drifting clock with jitter both ways: out of order within and
        // across batches, sometimes far back.
        let base = 10_000 + all.len() as i64 * 7;
        let stamps: Vec<i64> = (0..n).map(|_| base + rng.next(400) as i64 - 200).collect();
        all.extend(&stamps);
        append(log, vec![batch(index, &stamps)]);
        index += 1;
    }
    all
}

fn check_against_model(log: &PartitionLog, all: &[i64], what: &str) {
    let (lo, hi) = (all.iter().min().copied().unwrap_or(0), all.iter().max().copied().unwrap_or(0));
    for ts in (lo - 3..=hi + 3).step_by(3) {
        for up_to in [u64::MAX, all.len() as u64 / 2] {
            assert_eq!(
                lookup(log, ts, up_to),
                model(all, ts, up_to),
                "{what}: timestamp {ts}, up to {up_to}"
            );
        }
    }
}

fn remove_index_files(dir: &Path) -> usize {
    let mut removed = 0;
    for e in std::fs::read_dir(dir).expect("list") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "idx") {
            std::fs::remove_file(&p).expect("remove index");
            removed += 1;
        }
    }
    removed
}

#[test]
fn out_of_order_timestamps_across_segments_reopen_and_rebuilt_indexes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("log");
    let mut rng = Lcg(7);
    let all = {
        let mut log = PartitionLog::open(&path, tiny(), flusher()).expect("open");
        let all = fill(&mut log, &mut rng, 600);
        assert!(log.segment_count() > 5, "the test needs several segments, got {}", log.segment_count());
        check_against_model(&log, &all, "written");
        log.sync().expect("sync");
        all
    };
    // Reopen: sealed segments load their index files, the tail is rescanned.
    {
        let log = PartitionLog::open(&path, tiny(), flusher()).expect("reopen");
        check_against_model(&log, &all, "reopened");
    }
    // Without index files every segment is rescanned and reindexed.
    assert!(remove_index_files(&path) > 0, "sealed segments have index files");
    let log = PartitionLog::open(&path, tiny(), flusher()).expect("reopen without indexes");
    check_against_model(&log, &all, "indexes rebuilt");
}

#[test]
fn a_batch_whose_records_contradict_its_header_is_reported_not_answered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    // The header claims a max timestamp no record has.
    let mut e = batch(0, &[1000, 2000]);
    if let EntryPayload::Normal(b) = &mut e.payload {
        b.max_timestamp_ms = 9000;
    }
    append(&mut log, vec![e]);
    let err = log.offset_for_timestamp(5000, u64::MAX, stamps_of).expect_err("inconsistent batch");
    assert!(matches!(err, StoreError::Corruption { .. }), "{err}");
    // Records the decoder cannot read are reported too, never guessed at.
    let err = log
        .offset_for_timestamp(1500, u64::MAX, |_| Err::<Vec<(u32, i64)>, _>("not records"))
        .expect_err("undecodable batch");
    assert!(matches!(err, StoreError::Corruption { .. }) && err.to_string().contains("not records"), "{err}");
}

//! Retention in the store: the log start offset moves up (never down), is
//! kept across a reopen, bounds reads and snapshots; segments go only when
//! wholly below it and wholly purged from Raft; offsets never shift. And
//! the control frame that carries the decision through Raft.

use bytes::Bytes;
use ferrolog_raft_store::format::{self, FrameKind};
use ferrolog_raft_store::snapshot;
use ferrolog_raft_store::types::{Entry, EntryPayload, SnapshotMeta, StoredMembership, log_id};
use ferrolog_raft_store::{
    Control, Flusher, PartitionLog, ProducerStates, RecordBatch, StoreConfig, StoreError,
};

fn tiny() -> StoreConfig {
    StoreConfig { segment_bytes: 4096, index_interval_bytes: 200, ..StoreConfig::default() }
}

fn flusher() -> Flusher {
    Flusher::spawn("retention").expect("flusher")
}

/// A batch of `n` records of 100 bytes each at `index`.
fn batch(index: u64, n: u32) -> Entry {
    Entry {
        log_id: log_id(1, 1, index),
        payload: EntryPayload::Normal(RecordBatch {
            record_count: n,
            first_timestamp_ms: 1,
            max_timestamp_ms: 1,
            producer_id: -1,
            records: Bytes::from(vec![7u8; 100 * n as usize]),
            ..RecordBatch::default()
        }),
    }
}

fn append(log: &mut PartitionLog, e: Entry) {
    log.append(vec![e], Box::new(|r| r.expect("flush"))).expect("append");
}

/// 60 entries of 10 records (1 KB each): 600 offsets over many 4 KiB segments.
fn filled(path: &std::path::Path) -> PartitionLog {
    let mut log = PartitionLog::open(path, tiny(), flusher()).expect("open");
    for i in 0..60 {
        append(&mut log, batch(i, 10));
    }
    assert!(log.segment_count() >= 10, "the test needs many segments, got {}", log.segment_count());
    log
}

fn seg_files(path: &std::path::Path) -> usize {
    std::fs::read_dir(path)
        .expect("list")
        .filter(|e| e.as_ref().expect("entry").path().extension().is_some_and(|x| x == "seg"))
        .count()
}

#[test]
fn the_log_start_bounds_reads_and_segments_go_only_once_raft_purged_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("log");
    let mut log = filled(&path);
    let segments = log.segment_count();
    let summaries = log.segment_summaries().expect("summaries");
    assert_eq!(summaries.len(), segments);
    // A log start inside the fourth segment.
    let start = summaries[3].base_offset + 5;

    assert!(log.advance_log_start(start).expect("advance"));
    assert!(!log.advance_log_start(start - 1).expect("never back"), "the log start moved down");
    assert_eq!(log.log_start_offset(), start);
    assert_eq!(log.segment_count(), segments, "nothing purged from Raft yet: every segment stays");
    match log.read(start - 1, 1 << 20, u64::MAX) {
        Err(StoreError::OffsetOutOfRange { log_start_offset, log_end_offset, .. }) => {
            assert_eq!((log_start_offset, log_end_offset), (start, 600));
        }
        other => panic!("a read below the log start: {other:?}"),
    }
    // Offsets do not shift: the batch holding `start` is served as stored.
    let first = log.read(start, 1, u64::MAX).expect("read at the log start");
    assert!(
        first[0].header.base_offset <= start && start < first[0].header.next_offset(),
        "{:?}",
        first[0].header
    );

    // A lookup by time answers among the records served: every record is
    // stamped 1 here, so the first one at or after the log start.
    let stamps =
        |b: Bytes| Ok::<_, String>((0..(b.len() / 100) as u32).map(|d| (d, 1i64)).collect::<Vec<_>>());
    assert_eq!(log.offset_for_timestamp(1, u64::MAX, stamps).expect("lookup"), Some((start, 1)));

    // A snapshot holds the log start and leaves out the retired segments.
    let root = dir.path().join("snapshots");
    std::fs::create_dir_all(&root).expect("snapshot root");
    let meta =
        SnapshotMeta { last_log_id: Some(log_id(1, 1, 59)), last_membership: StoredMembership::default() };
    let files = snapshot::build(
        &log,
        &root,
        meta,
        600,
        ProducerStates::default(),
        log.log_start_offset(),
        Default::default(),
    )
    .expect("build a snapshot");
    let manifest = files.manifest().expect("manifest");
    assert_eq!(manifest.log_start_offset, start);
    let retired = summaries.iter().filter(|s| s.next_offset <= start).count();
    assert_eq!(manifest.segments.len(), segments - retired, "{:?}", manifest.segments);

    // Raft purges entries 0..=19 (offsets below 200):
    // only segments wholly below both the log start and the purge go.
    log.purge(log_id(1, 1, 19)).expect("purge");
    let left = log.segment_summaries().expect("summaries");
    assert!(left.len() < segments, "no segment deleted");
    assert_eq!(seg_files(&path), left.len(), "the files went with them");
    assert!(left[0].base_offset <= start, "a segment holding records at or above the log start was deleted");
    assert!(left[0].base_offset <= 200, "a segment with entries Raft had not purged was deleted: {left:?}");
    assert_eq!(log.log_start_offset(), start);

    // Purged far enough, every segment wholly below the log start goes.
    log.purge(log_id(1, 1, 50)).expect("purge");
    let left = log.segment_summaries().expect("summaries");
    assert!(left[0].base_offset <= start && start < left[0].next_offset, "{left:?}");
    log.sync().expect("sync");
    drop(log);

    // Reopened: the log start is kept, and reads still begin there.
    let log = PartitionLog::open(&path, tiny(), flusher()).expect("reopen");
    assert_eq!(log.log_start_offset(), start);
    assert_eq!(log.log_end_offset(), 600, "offsets never shift");
    assert!(matches!(log.read(start - 1, 1, u64::MAX), Err(StoreError::OffsetOutOfRange { .. })));
    let all = log.read(start, usize::MAX, u64::MAX).expect("read the rest");
    assert_eq!(all.last().expect("batches").header.next_offset(), 600);
}

/// Kafka's rule: a segment stays within `segment.bytes`; the append that
/// would take it past rolls first, even part way through one call's
/// entries. Only a frame larger than a segment gets a segment to itself.
#[test]
fn appends_roll_before_a_frame_that_would_overfill_the_segment() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    // Calls of 7 entries of 3 records (about 2.7 KB each call): most calls
    // cross a 4 KiB segment boundary.
    for call in 0..20u64 {
        let entries = (0..7).map(|i| batch(call * 7 + i, 3)).collect();
        log.append(entries, Box::new(|r| r.expect("flush"))).expect("append");
    }
    // A frame larger than a segment, then a small one.
    append(&mut log, batch(140, 50));
    append(&mut log, batch(141, 1));
    let summaries = log.segment_summaries().expect("summaries");
    assert!(summaries.len() > 10, "the test needs many rolls, got {}", summaries.len());
    let oversized: Vec<_> = summaries.iter().filter(|s| s.size_bytes > 4096).collect();
    assert_eq!(oversized.len(), 1, "only the one large frame's segment may exceed 4096 bytes: {oversized:?}");
    assert_eq!(oversized[0].next_offset - oversized[0].base_offset, 50, "it holds that frame alone");
    // Offsets run on without a gap across every roll.
    for w in summaries.windows(2) {
        assert_eq!(w[0].next_offset, w[1].base_offset, "{summaries:?}");
    }
    assert_eq!(log.log_end_offset(), 140 * 3 + 51);
    assert_eq!(log.read(0, usize::MAX, u64::MAX).expect("read").len(), 142);
}

#[test]
fn the_active_segment_is_never_deleted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("log");
    let mut log = filled(&path);
    log.advance_log_start(600).expect("advance to the end");
    log.purge(log_id(1, 1, 59)).expect("purge everything");
    assert_eq!(log.segment_count(), 1, "only the active segment stays");
    assert_eq!(log.log_start_offset(), 600);
    assert_eq!(log.read(600, 1, u64::MAX).expect("empty read at the end"), vec![]);
    append(&mut log, batch(60, 1));
    assert_eq!(log.log_end_offset(), 601, "appends go on after everything was retired");
}

#[test]
fn a_control_frame_round_trips_and_occupies_no_offset() {
    let b = RecordBatch::control_batch(Control::LogStart(12_345));
    assert!(b.is_control());
    assert_eq!(b.control(), Ok(Some(Control::LogStart(12_345))));
    let e = Entry { log_id: log_id(3, 2, 9), payload: EntryPayload::Normal(b.clone()) };
    let mut out = Vec::new();
    let h = format::encode_entry(&e, 77, &mut out).expect("encode");
    assert_eq!((h.kind, h.record_count, h.next_offset()), (FrameKind::Control, 0, 77));
    let frame = Bytes::from(out);
    let decoded = format::decode_entry(&h, &frame).expect("decode");
    assert_eq!(decoded, e);
    // A control this version does not know is an error, never a guess.
    let unknown = RecordBatch { records: Bytes::from_static(&[9, 1, 2]), ..b };
    assert!(unknown.control().is_err());
    let mut out = Vec::new();
    let bad = Entry { log_id: log_id(3, 2, 10), payload: EntryPayload::Normal(unknown) };
    assert!(format::encode_entry(&bad, 77, &mut out).is_err());
    // A record batch is not a control.
    assert_eq!(RecordBatch { record_count: 1, ..RecordBatch::default() }.control(), Ok(None));
}

#[test]
fn a_control_entry_in_the_log_is_skipped_by_reads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    append(&mut log, batch(0, 2));
    let control = RecordBatch::control_batch(Control::LogStart(1));
    append(&mut log, Entry { log_id: log_id(1, 1, 1), payload: EntryPayload::Normal(control.clone()) });
    append(&mut log, batch(2, 3));
    assert_eq!(log.log_end_offset(), 5, "the control entry occupies no offset");
    let read = log.read(0, usize::MAX, u64::MAX).expect("read");
    assert_eq!(read.iter().map(|b| b.header.record_count).collect::<Vec<_>>(), vec![2, 3]);
    // Raft gets it back as written.
    let entries = log.entries(1, 2).expect("entries");
    assert_eq!(entries[0].payload, EntryPayload::Normal(control));
}

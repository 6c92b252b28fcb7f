//! Consumer reads off the append path (issue 10): a read holds the log's
//! lock, which appends need, only while it is planned; the files are read
//! without it. Shown by ordering, not timing: appends (rolling segments)
//! complete between the planning of a 16 MiB read and its run, and the run
//! still returns exactly the batches committed when it was planned. A
//! truncation and rewrite past the high watermark during a read never
//! shows in what it returns, and a read of 0 bytes still returns one
//! batch (KIP-74).

mod common;

use ferrolog_raft_store::types::{Entry, TypeConfig, log_id};
use ferrolog_raft_store::{Flusher, Replica, StoreConfig, StoredBatch};
use openraft::storage::{RaftLogReader, RaftLogStorage};
use openraft::type_config::TypeConfigExt;

const MIB: usize = 1 << 20;
/// Payload bytes per entry.
const ENTRY: usize = 64 * 1024;

fn config() -> StoreConfig {
    StoreConfig { segment_bytes: MIB as u64, index_interval_bytes: 4096, ..StoreConfig::default() }
}

fn open(dir: &std::path::Path) -> Replica {
    Replica::open(dir, config(), Flusher::spawn("reads").expect("flusher")).expect("open")
}

async fn append(replica: &Replica, entries: Vec<Entry>) {
    common::append_durable(&mut replica.log_store(), entries).await.expect("append");
}

async fn commit(replica: &Replica, from: u64, to: u64) {
    let entries = replica.log_store().try_get_log_entries(from..to).await.expect("entries");
    assert_eq!(entries.len() as u64, to - from);
    common::apply_all(&mut replica.state_machine(), entries).await;
}

/// Checks that `batches` are entries `first..` written by `common::entry`,
/// contiguous, and returns how many there were.
fn check(batches: &[StoredBatch], first: u64) -> u64 {
    for (i, b) in batches.iter().enumerate() {
        let index = first + i as u64;
        assert_eq!(b.header.base_offset, common::base_offset(index), "batch {i} is not entry {index}");
        assert_eq!(b.records().len(), ENTRY, "entry {index}");
        assert!(b.records().starts_with(format!("entry-{index}:").as_bytes()), "entry {index}'s bytes");
    }
    batches.len() as u64
}

#[test]
fn appends_complete_while_a_16_mib_read_is_in_progress() {
    let dir = tempfile::tempdir().expect("tempdir");
    TypeConfig::run(async {
        let replica = open(dir.path());
        for i in 0..300 {
            append(&replica, vec![common::entry(1, i, ENTRY)]).await;
        }
        commit(&replica, 0, 300).await;
        let hw = replica.high_watermark();
        assert_eq!(hw, common::base_offset(300));

        // The read begins: planned under the lock, not yet run.
        let (plan, planned_hw) = replica.plan_read(0, 16 * MIB).expect("plan");
        assert_eq!(planned_hw, hw);
        // Appends of the same partition go on meanwhile, and complete
        // (durable), rolling to new segments; they are committed too.
        let segments_before = fs_segments(dir.path());
        for i in 300..340 {
            append(&replica, vec![common::entry(1, i, ENTRY)]).await;
        }
        commit(&replica, 300, 340).await;
        assert!(fs_segments(dir.path()) > segments_before, "the appends rolled no segment");
        assert!(replica.high_watermark() > hw);

        // The read finishes after them, with what was committed when it
        // began: 16 MiB of whole batches from offset 0, nothing past `hw`.
        let batches = plan.run().expect("run");
        let n = check(&batches, 0);
        let bytes: usize = batches.iter().map(|b| b.frame.len()).sum();
        assert!(bytes <= 16 * MIB && bytes + ENTRY + 1024 > 16 * MIB, "{bytes} bytes in {n} batches");
        assert!(batches.last().is_some_and(|b| b.header.next_offset() <= hw));

        // The next read picks up where it stopped and sees the new entries.
        let mut next = n;
        loop {
            let more = replica.read(common::base_offset(next), 16 * MIB).expect("read");
            if more.is_empty() {
                break;
            }
            next += check(&more, next);
        }
        assert_eq!(next, 340, "every entry read back exactly once");
    });
}

#[test]
fn a_rewrite_past_the_high_watermark_during_a_read_never_shows() {
    let dir = tempfile::tempdir().expect("tempdir");
    TypeConfig::run(async {
        let replica = open(dir.path());
        for i in 0..40 {
            append(&replica, vec![common::entry(1, i, ENTRY)]).await;
        }
        // 30 committed; 10 more written by a leader of term 1 that lost.
        commit(&replica, 0, 30).await;
        let hw = replica.high_watermark();
        let (plan, _) = replica.plan_read(common::base_offset(25), 16 * MIB).expect("plan");
        // A new leader's entries replace the uncommitted ones, at other
        // sizes, so most old frame positions now hold parts of new ones.
        let mut store = replica.log_store();
        store.truncate_after(Some(log_id(1, 1, 29))).await.expect("truncate");
        for i in 30..45 {
            let mut e = common::entry(2, i, ENTRY / 3 + 17);
            e.log_id = log_id(2, 1, i);
            append(&replica, vec![e]).await;
        }
        // The first frame past the high watermark starts where it did before
        // the rewrite (a truncation cuts at a frame boundary at or above
        // it): the run reads it, whole and valid, and stops there.
        let batches = plan.run().expect("the lock-free run");
        assert_eq!(check(&batches, 25), 5, "the committed batches 25..30");
        assert!(batches.iter().all(|b| b.header.next_offset() <= hw));
        let batches = replica.read(common::base_offset(25), 16 * MIB).expect("read under the lock");
        assert_eq!(check(&batches, 25), 5);
    });
}

fn fs_segments(dir: &std::path::Path) -> usize {
    let log = dir.join(ferrolog_raft_store::replica::LOG_DIR);
    std::fs::read_dir(log)
        .expect("log dir")
        .filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "seg")))
        .count()
}

#[test]
fn a_read_of_zero_bytes_returns_the_first_batch_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    TypeConfig::run(async {
        let replica = open(dir.path());
        for i in 0..3 {
            append(&replica, vec![common::entry(1, i, ENTRY)]).await;
        }
        commit(&replica, 0, 3).await;
        let batches = replica.read(common::base_offset(1), 0).expect("read");
        assert_eq!(check(&batches, 1), 1, "one whole batch");
        let (batches, hw) = replica.read_with_high_watermark(0, usize::MAX).expect("read");
        assert_eq!(check(&batches, 0), 3);
        assert_eq!(hw, common::base_offset(3), "the high watermark the read stopped at");
    });
}

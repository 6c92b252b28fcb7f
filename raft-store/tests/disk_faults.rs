//! Disk errors on the fault-injecting file system: a failed fsync
//! ("fsyncgate") and a full disk (ENOSPC). In both, nothing acknowledged is
//! lost, nothing unacknowledged is reported durable, and the log works
//! again once the disk does.

mod common;

use std::path::Path;

use ferrolog_raft_store::types::{Entry, flush_signal};
use ferrolog_raft_store::vfs::{Faults, FaultyFs, PowerCut, Vfs};
use ferrolog_raft_store::{Flusher, LogStore, Replica, StoreConfig};
use openraft::storage::{RaftLogReader, RaftLogStorage};

fn dir() -> &'static Path {
    Path::new("/data/replica")
}

fn disk() -> FaultyFs {
    let disk = FaultyFs::new(42);
    let fs = disk.mount();
    fs.create_dir_all(Path::new("/data")).expect("mkdir");
    fs.sync_dir(Path::new("/")).expect("sync /");
    disk
}

fn open(disk: &FaultyFs) -> Replica {
    let flusher = Flusher::spawn_on("disk-faults", disk.mount()).expect("flusher");
    Replica::open(dir(), StoreConfig::default(), flusher).expect("open")
}

fn entries(from: u64, to: u64) -> Vec<Entry> {
    (from..to).map(|i| common::entry(1, i, 300)).collect()
}

/// Appends and waits for the flush; the flush's result.
async fn append(store: &mut LogStore, batch: Vec<Entry>) -> std::io::Result<()> {
    let (cb, done) = flush_signal();
    store.append(batch, cb).await?;
    done.await
}

fn last_index(disk: &FaultyFs) -> Option<u64> {
    let flusher = Flusher::spawn_on("disk-faults", disk.mount()).expect("flusher");
    let log = Replica::open_log(dir(), StoreConfig::default(), flusher).expect("reopen");
    let last = log.log_state().last_log_id.map(|l| l.index);
    if let Some(last) = last {
        let got = log.entries(0, last + 1).expect("read");
        assert_eq!(got, entries(0, last + 1), "the log differs from what was written");
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failed_fsync_the_unsynced_tail_is_cut_not_trusted() {
    let disk = disk();
    {
        let replica = open(&disk);
        let mut store = replica.log_store();
        append(&mut store, entries(0, 10)).await.expect("entries 0..10 durable");
        disk.set_faults(Faults { eio_on_sync: true, ..Faults::default() });
        let failed = append(&mut store, entries(10, 15)).await;
        assert!(failed.is_err(), "a failed fsync must not be acknowledged");
        disk.set_faults(Faults::default());
        // The disk works again, yet this log's next flush must not report
        // success: its "successful" fsync would not cover entries 10..15.
        let after = append(&mut store, entries(15, 16)).await;
        assert!(after.is_err(), "an append after a failed fsync must fail until the replica is reopened");
    }
    // Reopened in the same process: the page cache still shows 10..15,
    // which never reached the disk. They must be cut.
    assert_eq!(last_index(&disk), Some(9), "entries of unknown durability survived the reopen");
    {
        let replica = open(&disk);
        let mut store = replica.log_store();
        let state = store.get_log_state().await.expect("state");
        assert_eq!(state.last_log_id.map(|l| l.index), Some(9));
        // The leader sends them again; this time they are durable.
        append(&mut store, entries(10, 20)).await.expect("entries 10..20 durable");
    }
    disk.power_cut(PowerCut::Clean);
    assert_eq!(last_index(&disk), Some(19), "an acknowledged entry was lost to the power cut");
    assert!(disk.stats().injected_errors > 0, "no fault was injected: the test did not test");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_appends_clearly_and_they_resume_once_space_is_freed() {
    let disk = disk();
    let replica = open(&disk);
    let mut store = replica.log_store();
    append(&mut store, entries(0, 10)).await.expect("entries 0..10 durable");
    // Room for nothing more.
    disk.set_faults(Faults { space_bytes: Some(0), ..Faults::default() });
    let full = append(&mut store, entries(10, 20)).await.expect_err("a full disk must refuse the append");
    assert_eq!(full.kind(), std::io::ErrorKind::StorageFull, "the error must say the disk is full: {full}");
    // Space is freed: the same replica takes the appends, no reopen.
    disk.set_faults(Faults::default());
    append(&mut store, entries(10, 20)).await.expect("appends resume once space is freed");
    drop(store);
    drop(replica);
    disk.power_cut(PowerCut::Clean);
    assert_eq!(last_index(&disk), Some(19), "an acknowledged entry was lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fsync_while_sealing_a_segment_trips_the_log_too() {
    let disk = disk();
    let small = StoreConfig { segment_bytes: 4096, index_interval_bytes: 256, ..StoreConfig::default() };
    let open_small = |disk: &FaultyFs| {
        let flusher = Flusher::spawn_on("disk-faults", disk.mount()).expect("flusher");
        Replica::open(dir(), small.clone(), flusher).expect("open")
    };
    let acked = 8;
    {
        let replica = open_small(&disk);
        let mut store = replica.log_store();
        // 300-byte entries: a 4 KiB segment holds about 10.
        append(&mut store, entries(0, acked)).await.expect("entries 0..8 durable");
        disk.set_faults(Faults { eio_on_sync: true, ..Faults::default() });
        // Rolling past the segment's end seals it: that fsync fails.
        let failed = append(&mut store, entries(8, 20)).await;
        assert!(failed.is_err(), "an append whose seal failed must not be acknowledged");
        disk.set_faults(Faults::default());
        let after = append(&mut store, entries(20, 21)).await;
        assert!(after.is_err(), "after a failed seal the log must take no appends until reopened");
    }
    let last = last_index_with(&disk, &small);
    assert!(last.is_some_and(|l| l + 1 >= acked), "acknowledged entries were cut: the log ends at {last:?}");
    assert!(
        last.is_some_and(|l| l < 20),
        "entries after the failed seal were trusted: the log ends at {last:?}"
    );
    {
        let replica = open_small(&disk);
        let mut store = replica.log_store();
        let next = store.get_log_state().await.expect("state").last_log_id.map_or(0, |l| l.index + 1);
        append(&mut store, entries(next, 30)).await.expect("written again, durable");
    }
    disk.power_cut(PowerCut::Clean);
    assert_eq!(last_index_with(&disk, &small), Some(29), "an acknowledged entry was lost to the power cut");
}

fn last_index_with(disk: &FaultyFs, config: &StoreConfig) -> Option<u64> {
    let flusher = Flusher::spawn_on("disk-faults", disk.mount()).expect("flusher");
    let log = Replica::open_log(dir(), config.clone(), flusher).expect("reopen");
    let last = log.log_state().last_log_id.map(|l| l.index);
    if let Some(last) = last {
        assert_eq!(
            log.entries(0, last + 1).expect("read"),
            entries(0, last + 1),
            "the log differs from what was written"
        );
    }
    last
}

/// A replica reopened in place after a failed fsync (as the broker does for
/// its metadata group's replica, whose old handle may still be held by
/// requests under way): the new handle cuts the unsynced tail, takes the
/// appends the leader sends again, and alone owns the replica's metadata:
/// the old handle's writes are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_reopened_in_place_cuts_the_unsynced_tail_and_owns_its_metadata() {
    let disk = disk();
    let flusher = Flusher::spawn_on("disk-faults", disk.mount()).expect("flusher");
    let old = Replica::open(dir(), StoreConfig::default(), flusher.clone()).expect("open");
    let mut old_store = old.log_store();
    append(&mut old_store, entries(0, 10)).await.expect("entries 0..10 durable");
    let voted = ferrolog_raft_store::types::Vote::new(1, 1);
    old_store.save_vote(&voted).await.expect("a vote saved before the fault");
    disk.set_faults(Faults { eio_on_sync: true, ..Faults::default() });
    assert!(
        append(&mut old_store, entries(10, 15)).await.is_err(),
        "a failed fsync must not be acknowledged"
    );
    disk.set_faults(Faults::default());

    let new = old.reopen(StoreConfig::default(), flusher).expect("reopen in place");
    let mut store = new.log_store();
    let state = store.get_log_state().await.expect("state");
    assert_eq!(
        state.last_log_id.map(|l| l.index),
        Some(9),
        "entries of unknown durability survived the reopen"
    );
    assert_eq!(store.read_vote().await.expect("read vote"), Some(voted), "the vote did not carry over");
    append(&mut store, entries(10, 20)).await.expect("entries 10..20 durable through the new handle");
    let vote = ferrolog_raft_store::types::Vote::new(2, 1);
    store.save_vote(&vote).await.expect("the new handle saves a vote");
    let refused = old_store.save_vote(&ferrolog_raft_store::types::Vote::new(3, 2)).await;
    let refused = refused.expect_err("the old handle still writes the replica's metadata").to_string();
    assert!(refused.contains("removed or reopened"), "refused for another reason: {refused}");
    assert_eq!(store.read_vote().await.expect("read vote"), Some(vote));

    drop((store, old_store, new, old));
    disk.power_cut(PowerCut::Clean);
    assert_eq!(last_index(&disk), Some(19), "an acknowledged entry was lost");
}

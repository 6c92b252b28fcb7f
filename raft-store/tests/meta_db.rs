//! The shared metadata database of a directory of replicas: votes of many
//! replicas share commits, values survive reopening, removed replicas
//! leave nothing behind, and per-replica databases of the earlier layout
//! are moved in.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferrolog_raft_store::meta_db::{META_DB_FILE, MetaDb};
use ferrolog_raft_store::types::{Vote, log_id};
use ferrolog_raft_store::{Flusher, PartitionLog, Replica, StoreConfig};
use openraft::storage::{RaftLogReader, RaftLogStorage};

fn flusher() -> Flusher {
    Flusher::spawn("meta-db-test").expect("flusher")
}

fn vote(term: u64, node: u64) -> Vote {
    Vote::new(term, node)
}

fn saved_vote(r: &Replica) -> Option<Vote> {
    futures::executor::block_on(r.log_store().read_vote()).expect("read vote")
}

fn save_vote(r: &Replica, v: Vote) {
    futures::executor::block_on(r.log_store().save_vote(&v)).expect("save vote");
}

fn open(db: &Arc<MetaDb>, dir: &Path) -> Replica {
    Replica::open_in(db, dir, StoreConfig::default(), flusher(), false).expect("open replica")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn votes_of_many_replicas_share_commits_and_survive_reopening() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let n = 200u64;
    let first = {
        let db = MetaDb::open(tmp.path()).expect("db");
        let replicas: Vec<Replica> =
            (0..n).map(|i| open(&db, &tmp.path().join(format!("p-{i}.g{i}")))).collect();
        let before = db.stats().durable_commits.load(Ordering::Relaxed);
        // Saved as openraft saves them, concurrently from many groups.
        let saves: Vec<_> = replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let mut store = r.log_store();
                tokio::spawn(async move { store.save_vote(&vote(3, i as u64)).await })
            })
            .collect();
        for s in saves {
            s.await.expect("task").expect("vote saved");
        }
        let commits = db.stats().durable_commits.load(Ordering::Relaxed) - before;
        assert!(commits >= 1, "the votes were committed");
        assert!(commits < n, "{n} votes took {commits} durable commits: none were shared");
        assert!(db.stats().durable_writes.load(Ordering::Relaxed) >= n);
        Arc::downgrade(&db)
    };
    // Closed (every handle dropped) and opened again: each replica finds its own vote.
    assert!(first.upgrade().is_none(), "the database closed with its last handle");
    let db = MetaDb::open(tmp.path()).expect("db reopened");
    for i in 0..n {
        let r = open(&db, &tmp.path().join(format!("p-{i}.g{i}")));
        assert_eq!(saved_vote(&r), Some(vote(3, i)), "replica {i}");
    }
    assert!(tmp.path().join(META_DB_FILE).exists());
    // One database file for all of them: no per-replica file.
    let per_replica =
        walk(tmp.path()).into_iter().filter(|p| p.extension().is_some_and(|e| e == "redb")).count();
    assert_eq!(per_replica, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_values_are_kept_when_the_database_closes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("t-0.g1");
    {
        let db = MetaDb::open(tmp.path()).expect("db");
        let r = open(&db, &dir);
        let mut store = r.log_store();
        common::append_durable(&mut store, vec![common::entry(1, 0, 10), common::entry(1, 1, 10)])
            .await
            .expect("append");
        // Commit indexes are saved lazily: the calls return before anything is written.
        let durable_before = db.stats().durable_writes.load(Ordering::Relaxed);
        store.save_committed(Some(log_id(1, 1, 0))).await.expect("committed 0");
        store.save_committed(Some(log_id(1, 1, 1))).await.expect("committed 1");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while db.stats().lazy_writes.load(Ordering::Relaxed) == 0 {
            assert!(std::time::Instant::now() < deadline, "no lazy write was made");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(
            db.stats().durable_writes.load(Ordering::Relaxed),
            durable_before,
            "no durable put for them"
        );
    }
    let db = MetaDb::open(tmp.path()).expect("db");
    let r = open(&db, &dir);
    assert_eq!(r.log_store().read_committed().await.expect("read"), Some(log_id(1, 1, 1)));
}

/// Commit indexes saved one after another (one per record, with one batch
/// in flight) share rounds: lazy values alone start a round at most every
/// `LAZY_ROUND_EVERY`, and the last one saved is the one kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_values_saved_in_a_stream_share_rounds() {
    use ferrolog_raft_store::meta_db::LAZY_ROUND_EVERY;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("t-0.g1");
    const SAVES: u64 = 200;
    let took = {
        let db = MetaDb::open(tmp.path()).expect("db");
        let r = open(&db, &dir);
        let mut store = r.log_store();
        let entries = (0..SAVES).map(|i| common::entry(1, i, 10)).collect();
        common::append_durable(&mut store, entries).await.expect("append");
        let (commits, lazy) =
            (db.stats().commits.load(Ordering::Relaxed), db.stats().lazy_writes.load(Ordering::Relaxed));
        let started = std::time::Instant::now();
        for i in 0..SAVES {
            store.save_committed(Some(log_id(1, 1, i))).await.expect("committed");
            tokio::time::sleep(std::time::Duration::from_micros(500)).await;
        }
        let took = started.elapsed();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while db.stats().lazy_writes.load(Ordering::Relaxed) == lazy {
            assert!(std::time::Instant::now() < deadline, "no lazy write was made");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let rounds = db.stats().commits.load(Ordering::Relaxed) - commits;
        let due = (took.as_millis() / LAZY_ROUND_EVERY.as_millis().max(1)) as u64 + 2;
        assert!(
            rounds <= due && rounds * 4 <= SAVES,
            "{SAVES} lazy saves over {took:?} took {rounds} commits (at most {due} expected)"
        );
        took
    };
    assert!(took >= std::time::Duration::from_millis(100), "the saves were spread out: {took:?}");
    let db = MetaDb::open(tmp.path()).expect("db");
    let r = open(&db, &dir);
    assert_eq!(
        r.log_store().read_committed().await.expect("read"),
        Some(log_id(1, 1, SAVES - 1)),
        "the last one kept"
    );
}

#[test]
fn a_removed_replica_leaves_no_metadata_for_a_new_one_of_the_same_name() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("t-0.g1").join("replica");
    let db = MetaDb::open(tmp.path()).expect("db");
    {
        let r = open(&db, &dir);
        save_vote(&r, vote(7, 2));
    }
    Replica::remove(&db, &dir).expect("remove");
    assert!(!dir.exists());
    let r = open(&db, &dir);
    assert_eq!(saved_vote(&r), None, "a new replica under the old name starts without the old vote");
}

#[test]
fn a_replica_is_open_once_and_a_removed_ones_handle_writes_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("t-0.g1").join("replica");
    let db = MetaDb::open(tmp.path()).expect("db");
    let r = open(&db, &dir);
    let again =
        Replica::open_in(&db, &dir, StoreConfig::default(), flusher(), false).expect_err("second open");
    assert!(again.to_string().contains("open already"), "{again}");
    // Removed while a handle lingers: its later vote is refused, and a new
    // replica of the name does not see it.
    Replica::remove(&db, &dir).expect("remove");
    let late = futures::executor::block_on(r.log_store().save_vote(&vote(8, 1)));
    assert!(late.is_err(), "a removed replica's handle wrote its vote");
    drop(r);
    assert_eq!(saved_vote(&open(&db, &dir)), None);
}

#[test]
fn a_new_directory_never_takes_keys_left_under_its_name() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("t-0.g1").join("replica");
    let db = MetaDb::open(tmp.path()).expect("db");
    save_vote(&open(&db, &dir), vote(6, 1));
    // Deleted by hand while the database stays open (so no sweep runs).
    std::fs::remove_dir_all(&dir).expect("rm");
    assert_eq!(saved_vote(&open(&db, &dir)), None, "a new directory took the old vote");
}

#[test]
fn keys_of_a_directory_deleted_behind_the_databases_back_are_removed_at_open() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // The kept name extends the gone one's: its keys sort right after.
    let (gone, kept) = (tmp.path().join("t-0.g1"), tmp.path().join("t-0.g10"));
    {
        let db = MetaDb::open(tmp.path()).expect("db");
        save_vote(&open(&db, &gone), vote(4, 1));
        save_vote(&open(&db, &kept), vote(5, 2));
    }
    // As if a crash came between removing the directory and its keys.
    std::fs::remove_dir_all(&gone).expect("rm");
    let db = MetaDb::open(tmp.path()).expect("db");
    assert_eq!(saved_vote(&open(&db, &gone)), None);
    assert_eq!(saved_vote(&open(&db, &kept)), Some(vote(5, 2)));
}

#[test]
fn a_replica_outside_the_databases_directory_is_refused() {
    let (a, b) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
    let db = MetaDb::open(a.path()).expect("db");
    let err = Replica::open_in(&db, &b.path().join("x"), StoreConfig::default(), flusher(), false)
        .expect_err("outside");
    assert!(err.to_string().contains("is not inside"), "{err}");
}

#[test]
fn a_per_replica_database_of_the_earlier_layout_is_moved_in() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("old-0.g3");
    let legacy = dir.join("log").join("meta.redb");
    std::fs::create_dir_all(legacy.parent().expect("parent")).expect("mkdir");
    {
        // The earlier layout: one redb file per replica, table "replica_meta", JSON values.
        const TABLE: redb::TableDefinition<'_, &str, &[u8]> = redb::TableDefinition::new("replica_meta");
        let old = redb::Database::create(&legacy).expect("legacy db");
        let txn = old.begin_write().expect("txn");
        {
            let mut t = txn.open_table(TABLE).expect("table");
            let v = serde_json::to_vec(&vote(9, 3)).expect("json");
            t.insert("vote", v.as_slice()).expect("insert");
        }
        txn.commit().expect("commit");
    }
    let db = MetaDb::open(tmp.path()).expect("db");
    let r = open(&db, &dir);
    assert_eq!(saved_vote(&r), Some(vote(9, 3)), "the vote kept in the old file");
    assert!(!legacy.exists(), "the old file is removed once moved");
    drop(r);
    drop(db);
    let db = MetaDb::open(tmp.path()).expect("db");
    assert_eq!(saved_vote(&open(&db, &dir)), Some(vote(9, 3)), "and it stays after reopening");
}

#[test]
fn a_log_alone_keeps_its_metadata_in_its_own_directory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    {
        let mut log = PartitionLog::open(tmp.path(), StoreConfig::default(), flusher()).expect("open");
        log.save_vote(&vote(2, 1)).expect("vote");
    }
    assert!(tmp.path().join(META_DB_FILE).exists());
    let log = PartitionLog::open(tmp.path(), StoreConfig::default(), flusher()).expect("reopen");
    assert_eq!(log.vote(), Some(vote(2, 1)));
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

//! Recovery and corruption on real files: torn tails are cut, a flipped bit
//! before the tail is reported with file and position, metadata and the
//! high watermark survive a restart, snapshots carry the retained records.

mod common;

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ferrolog_raft_store::types::log_id;
use ferrolog_raft_store::{Flusher, PartitionLog, Replica, StoreConfig, StoreError};
use openraft::storage::{RaftLogStorage, RaftSnapshotBuilder, RaftStateMachine};
use openraft::type_config::TypeConfigExt;

use ferrolog_raft_store::types::{TypeConfig, Vote};

fn tiny() -> StoreConfig {
    StoreConfig { segment_bytes: 4096, index_interval_bytes: 256, ..StoreConfig::default() }
}

fn flusher() -> Flusher {
    Flusher::spawn("test").expect("flusher")
}

/// Writes entries `0..n` durably through the openraft interface.
fn write_entries(dir: &Path, config: StoreConfig, n: u64) {
    TypeConfig::run(async {
        let replica = Replica::open(dir, config, flusher()).expect("open");
        let mut store = replica.log_store();
        for i in 0..n {
            common::append_durable(&mut store, vec![common::entry(1, i, 300)]).await.expect("append");
        }
    });
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir.join("log"))
        .expect("list")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    v.sort();
    v
}

/// Opens the replica in `dir` holding entries `0..n`, applies them and
/// builds a snapshot of them, as a leader would before sending one.
async fn snapshot_of_written(dir: &Path, n: u64) -> (Replica, ferrolog_raft_store::state_machine::Snapshot) {
    let leader = Replica::open(dir, tiny(), flusher()).expect("open");
    let entries = openraft::storage::RaftLogReader::try_get_log_entries(&mut leader.log_store(), 0..n)
        .await
        .expect("entries");
    common::apply_all(&mut leader.state_machine(), entries).await;
    let snap = leader.state_machine().get_snapshot_builder().await.build_snapshot().await.expect("snapshot");
    (leader, snap)
}

#[test]
fn torn_tail_is_cut_at_every_7th_byte_and_nothing_before_it_is_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), StoreConfig::default(), 20);
    let seg = segments(dir.path()).pop().expect("segment");
    let full = fs::read(&seg).expect("read");
    // Where the last frame starts: reopen and ask for the end before it.
    let last_start = {
        let log =
            PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher()).expect("open");
        full.len() - log.read(common::base_offset(19), usize::MAX, u64::MAX).expect("read")[0].frame.len()
    };
    for cut in (last_start..full.len()).step_by(7) {
        fs::write(&seg, &full[..cut]).expect("write torn copy");
        let log = PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher())
            .unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        assert_eq!(log.log_state().last_log_id, Some(log_id(1, 1, 18)), "cut at {cut}");
        assert_eq!(log.entries(0, 100).expect("entries").len(), 19);
        assert_eq!(fs::metadata(&seg).expect("stat").len() as usize, last_start, "torn bytes left behind");
    }
    // A garbage tail (a crash while a page of zeros or junk was written) is cut too.
    let mut junk = full.clone();
    junk.extend_from_slice(&[0xAB; 100]);
    fs::write(&seg, &junk).expect("write");
    let log = PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher()).expect("open");
    assert_eq!(log.log_state().last_log_id, Some(log_id(1, 1, 19)));
}

#[test]
fn flipped_bit_in_a_sealed_segment_is_reported_with_file_and_position() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 60);
    let segs = segments(dir.path());
    assert!(segs.len() >= 4, "want several segments, got {}", segs.len());
    let victim = &segs[1];
    let len_before = fs::metadata(victim).expect("stat").len();
    // Flip one bit inside the second frame's payload of the middle segment.
    let f = OpenOptions::new().read(true).write(true).open(victim).expect("open victim");
    let position = 40 + 80 + 300 + 80 + 50;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, position).expect("read byte");
    f.write_all_at(&[b[0] ^ 0x10], position).expect("flip");
    drop(f);

    // With its index intact the segment is not rescanned on open; the bad
    // frame is caught when read, by Raft or by a consumer.
    let log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    let err = log.entries(0, 60).expect_err("corrupt entry served");
    let msg = err.to_string();
    assert!(matches!(err, StoreError::Corruption { .. }), "{msg}");
    assert!(msg.contains(&victim.display().to_string()) && msg.contains("at byte"), "{msg}");
    let err = log.read(0, usize::MAX, u64::MAX).expect_err("corrupt batch served to a consumer");
    assert!(matches!(err, StoreError::Corruption { .. }), "{err}");
    // Entries before the damage are still served.
    assert!(!log.entries(0, 2).expect("entries before the damage").is_empty());
    drop(log);

    // Reopened with every segment rescanned (as after a storage error),
    // the damage is found: the valid prefix is kept, the damaged segment is
    // copied aside whole and cut at the bad frame, every later segment is
    // moved aside, and the replica is marked recovering.
    let log = PartitionLog::open_with(&dir.path().join("log"), tiny(), flusher(), true).expect("open");
    assert_set_aside(&log, victim, len_before);
    let last = log.log_state().last_log_id.expect("a valid prefix is kept").index;
    assert!((1..59).contains(&last), "kept up to {last}");
    assert_eq!(log.entries(0, last + 1).expect("entries of the valid prefix").len() as u64, last + 1);
    assert!(segments(dir.path()).len() <= 2, "later segments were not moved aside");
    drop(log);
    // The mark is durable: a restart before a leader brought it back keeps it.
    let log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("reopen");
    assert!(log.recovering().is_some(), "recovering was forgotten across a restart");
    assert!(log.damage().is_empty(), "the repaired log reports damage again");
}

/// The scrub's check: every sealed segment reads back whole and verified,
/// byte for byte, until a bit flips in one; then that one, and only that
/// one, fails at the damaged frame.
#[test]
fn verifying_sealed_segments_finds_a_flipped_bit_in_any_of_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 60);
    let mut log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    assert!(log.committed_segment_readers().is_empty(), "entries not known committed may still change");
    let segs = segments(dir.path());
    // Committed up to entry 25: the segments before it whole, and the one
    // holding it up to its end.
    log.save_committed(Some(log_id(1, 1, 25))).expect("committed");
    let partial = log.committed_segment_readers();
    let holding = segs.iter().position(|p| *p == partial.last().expect("readers").path()).expect("a segment");
    assert_eq!(partial.len(), holding + 1, "a segment before the committed entry was left out");
    let partial_end = partial.last().expect("readers").verify(1 << 20, &mut |_| {}).expect("verifies");
    let base: u64 =
        segs[holding].file_stem().and_then(|s| s.to_str()).and_then(|s| s.parse().ok()).expect("base");
    assert_eq!(partial_end, 40 + (26 - base) * (80 + 300), "not read exactly through entry 25");
    // Committed to the end: every segment, the active one included, whole.
    log.save_committed(Some(log_id(1, 1, 59))).expect("committed");
    let readers = log.committed_segment_readers();
    assert_eq!(readers.len(), segs.len(), "every segment holds committed entries");
    for r in &readers {
        let (mut chunks, mut seen) = (0, 0);
        let verified = r
            .verify(1000, &mut |n| {
                chunks += 1;
                seen += n;
            })
            .expect("an intact segment verifies");
        assert_eq!(
            verified,
            fs::metadata(r.path()).expect("stat").len(),
            "{} not read whole",
            r.path().display()
        );
        assert_eq!(seen, verified, "the throttle was not told of every byte");
        assert!(chunks > 2, "a 1,000-byte chunk size read {} in {chunks} chunks", r.path().display());
    }
    // A sealed segment, and the active one (entries 50–59).
    for victim in [1, readers.len() - 1] {
        flip_payload_bit(&segs[victim], 3);
        for (i, r) in readers.iter().enumerate() {
            match r.verify(1 << 20, &mut |_| {}) {
                Err(StoreError::Corruption { path, position, .. }) => {
                    assert!(i == victim || i == 1, "segment {i} reported, only {victim} was damaged");
                    assert_eq!(path, segs[i]);
                    assert_eq!(position, 40 + 3 * (80 + 300), "the damaged frame's position");
                }
                Err(e) => panic!("segment {i}: {e}"),
                Ok(_) => assert!(i != victim && i != 1, "segment {i}'s flipped bit went unnoticed"),
            }
        }
    }
}

/// A frame written in the wrong place (a misdirected write: here entry 2's
/// frame copied over entry 3's) passes its own checksum; the scrub's check
/// finds it all the same, as a break in the log's continuity.
#[test]
fn verifying_a_sealed_segment_finds_a_frame_written_in_the_wrong_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 60);
    let mut log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    log.save_committed(Some(log_id(1, 1, 59))).expect("committed");
    let reader = log.committed_segment_readers().swap_remove(1);
    reader.verify(1 << 20, &mut |_| {}).expect("intact before the misdirected write");
    let f = OpenOptions::new().read(true).write(true).open(reader.path()).expect("open");
    let frame = 80 + 300;
    let mut second = vec![0u8; frame];
    f.read_exact_at(&mut second, 40 + 2 * frame as u64).expect("read entry 2");
    f.write_all_at(&second, 40 + 3 * frame as u64).expect("write it over entry 3");
    match reader.verify(1 << 20, &mut |_| {}) {
        Err(StoreError::Corruption { position, source, .. }) => {
            assert_eq!(position, 40 + 3 * frame as u64);
            assert!(source.to_string().contains("continuity"), "{source}");
        }
        other => panic!("a misplaced frame went unnoticed: {other:?}"),
    }
    // What a reader saw is the log's only while the log still holds that
    // file at that length: not once the segment was cut below the view.
    assert!(log.still_holds(&reader));
    log.save_committed(None).expect("uncommitted (a test's liberty)");
    log.truncate_after(Some(log_id(1, 1, 11))).expect("truncate before the misplaced frame");
    assert!(!log.still_holds(&reader), "a segment cut below the reader's view is still called the log's");
}

/// Asserts that opening found `victim` damaged, kept a copy of all its
/// `len_before` bytes aside, and marked the log recovering.
fn assert_set_aside(log: &PartitionLog, victim: &Path, len_before: u64) {
    let damage = log.damage();
    assert_eq!(damage.len(), 1, "{damage:?}");
    assert_eq!(damage[0].path, victim);
    let copy = damage[0].set_aside.join(victim.file_name().expect("name"));
    assert_eq!(
        fs::metadata(&copy).expect("copy set aside").len(),
        len_before,
        "the damaged bytes were not kept"
    );
    let reason = log.recovering().expect("a damaged replica is marked recovering");
    assert!(reason.contains(&victim.display().to_string()), "{reason}");
}

#[test]
fn a_segment_torn_while_being_created_is_removed() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 30);
    let last = segments(dir.path()).pop().expect("segment");
    let next_base: u64 =
        last.file_stem().and_then(|s| s.to_str()).and_then(|s| s.parse::<u64>().ok()).expect("base") + 1000;
    let torn = dir.path().join("log").join(format!("{next_base:020}.seg"));
    fs::write(&torn, b"FLOGSEG").expect("write torn header");
    let log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    assert_eq!(log.log_state().last_log_id, Some(log_id(1, 1, 29)));
    assert!(!torn.exists());
}

#[test]
fn vote_committed_purge_pointer_and_high_watermark_survive_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 40);
    let vote = Vote::new(7, 2);
    TypeConfig::run(async {
        let replica = Replica::open(dir.path(), tiny(), flusher()).expect("open");
        let mut store = replica.log_store();
        store.save_vote(&vote).await.expect("vote");
        store.save_committed(Some(log_id(1, 1, 30))).await.expect("committed");
        store.purge(log_id(1, 1, 10)).await.expect("purge");
        // A durable write after the lazy ones, as the next vote or append would be.
        store.save_vote(&vote).await.expect("vote");
    });
    let replica = Replica::open(dir.path(), tiny(), flusher()).expect("reopen");
    TypeConfig::run(async {
        let mut store = replica.log_store();
        assert_eq!(openraft::storage::RaftLogReader::read_vote(&mut store).await.expect("vote"), Some(vote));
        assert_eq!(store.read_committed().await.expect("committed"), Some(log_id(1, 1, 30)));
        let state = store.get_log_state().await.expect("state");
        assert_eq!(state.last_purged_log_id, Some(log_id(1, 1, 10)));
        assert_eq!(state.last_log_id, Some(log_id(1, 1, 39)));
    });
    // Before any apply, reads are bounded by the offset after the commit index.
    assert_eq!(replica.high_watermark(), common::base_offset(31));
    // A Raft purge does not delete records: consumers still read from offset 0.
    assert_eq!(replica.log_start_offset(), 0);
    let batches = replica.read(0, usize::MAX).expect("read");
    assert_eq!(batches.len(), 31);
    assert_eq!(batches.last().expect("last").header.next_offset(), common::base_offset(31));
    // At the high watermark a fetch is empty; past it, out of range with the
    // bounds a consumer may use (the high watermark, not the log end: the
    // records above it are not known committed).
    assert!(replica.read(common::base_offset(31), 1024).expect("fetch at the high watermark").is_empty());
    let err = replica.read(common::base_offset(31) + 1, 1024).expect_err("read past the high watermark");
    assert!(
        matches!(err, StoreError::OffsetOutOfRange { log_start_offset: 0, log_end_offset, .. } if log_end_offset == common::base_offset(31)),
        "{err}"
    );
}

#[test]
fn offset_and_timestamp_lookups_land_on_the_right_batch() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 80);
    let log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    for i in 0..80u64 {
        for inside in 0..u64::from(common::record_count(i)) {
            let got = log.read(common::base_offset(i) + inside, 1, u64::MAX).expect("read");
            assert_eq!(
                got[0].header.index(),
                i,
                "offset {} inside batch {i}",
                common::base_offset(i) + inside
            );
            assert_eq!(got[0].records(), common::payload(i, 300));
        }
        // Batch i has max timestamp 1005 + 10 i: asking for it, or anything
        // after batch i-1's, finds batch i. (Its records are opaque here:
        // stamp them all with the batch's max; tests/timestamps.rs covers
        // record granularity.)
        let ts = 1_000 + i as i64 * 10 + 5;
        let all_at_max = |r: bytes::Bytes| -> Result<Vec<(u32, i64)>, String> {
            let text = String::from_utf8_lossy(&r[..r.len().min(20)]).into_owned();
            let i: u64 = text
                .trim_start_matches("entry-")
                .split(':')
                .next()
                .unwrap_or("")
                .parse()
                .map_err(|_| text)?;
            Ok((0..common::record_count(i)).map(|d| (d, 1_000 + i as i64 * 10 + 5)).collect())
        };
        let want = Some((common::base_offset(i), ts));
        assert_eq!(log.offset_for_timestamp(ts, u64::MAX, all_at_max).expect("ts"), want);
        assert_eq!(log.offset_for_timestamp(ts - 9, u64::MAX, all_at_max).expect("ts"), want);
    }
    let never = |_| -> Result<Vec<(u32, i64)>, String> { unreachable!("no batch is that late") };
    assert_eq!(log.offset_for_timestamp(1_000_000, u64::MAX, never).expect("ts"), None);
}

#[test]
fn a_snapshot_carries_every_retained_record_to_an_empty_replica() {
    let leader_dir = tempfile::tempdir().expect("tempdir");
    let follower_dir = tempfile::tempdir().expect("tempdir");
    write_entries(leader_dir.path(), tiny(), 50);
    TypeConfig::run(async {
        let (leader, snap) = snapshot_of_written(leader_dir.path(), 50).await;
        assert_eq!(snap.meta.last_log_id, Some(log_id(1, 1, 49)));

        let follower = Replica::open(follower_dir.path(), tiny(), flusher()).expect("open follower");
        let mut fsm = follower.state_machine();
        fsm.install_snapshot(&snap.meta, snap.snapshot.clone()).await.expect("install");
        // The leader may remove its snapshot now; the follower adopted a copy.
        fs::remove_dir_all(&snap.snapshot.dir).expect("remove the leader's snapshot");
        assert_eq!(follower.high_watermark(), common::base_offset(50));
        let got = follower.read(0, usize::MAX).expect("read follower");
        let want = leader.read(0, usize::MAX).expect("read leader");
        assert_eq!(got.len(), 50);
        assert_eq!(got, want, "follower's records differ from the leader's");
        // And it continues the log right after the snapshot.
        let mut store = follower.log_store();
        store.purge(log_id(1, 1, 49)).await.expect("purge");
        common::append_durable(&mut store, vec![common::entry(1, 50, 300)])
            .await
            .expect("append after snapshot");
        assert_eq!(follower.log_end_offset(), common::base_offset(51));
    });
    // And it all survives a restart of the follower.
    let follower = Replica::open(follower_dir.path(), tiny(), flusher()).expect("reopen follower");
    assert_eq!(follower.log_end_offset(), common::base_offset(51));
    assert_eq!(follower.read(0, usize::MAX).expect("read").len(), 50);
}

/// A snapshot taken while its last entries are in the active segment
/// hard-links that segment (no copy, no disk space of its own) and holds
/// only the prefix up to its last entry: appends after it do not reach a
/// replica that installs it, and cutting the log's file below that prefix
/// (a Raft truncation, a repair) leaves the snapshot's whole.
#[test]
fn a_snapshot_links_the_active_segment_and_holds_only_its_prefix() {
    use std::os::unix::fs::MetadataExt;
    let leader_dir = tempfile::tempdir().expect("tempdir");
    let followers = [tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir")];
    write_entries(leader_dir.path(), tiny(), 25);
    let len = |p: &Path| fs::metadata(p).expect("stat").len();
    let ino = |p: &Path| fs::metadata(p).expect("stat").ino();
    TypeConfig::run(async {
        let (leader, snap) = snapshot_of_written(leader_dir.path(), 25).await;
        let want = leader.read(0, usize::MAX).expect("read leader");
        assert_eq!(want.len(), 25);
        let manifest = snap.snapshot.manifest().expect("manifest");
        assert_eq!(manifest.prefix_bytes.len(), 1, "only the active segment is a prefix: {manifest:?}");
        let (name, prefix) = manifest.prefix_bytes.iter().next().map(|(n, p)| (n.clone(), *p)).expect("one");
        assert_eq!(Some(&name), manifest.segments.last(), "the prefix is the last segment's");
        assert_eq!(manifest.version, 3, "with prefixes a manifest is version 3: older brokers refuse it");
        let sent: serde_json::Value =
            serde_json::from_slice(&snap.snapshot.manifest_for_peer().expect("peer manifest")).expect("json");
        assert_eq!(sent["version"], 2, "a peer gets a version older brokers read: {sent}");
        assert!(sent.get("prefix_bytes").is_none(), "a peer receives whole files: {sent}");
        let (in_log, in_snapshot) =
            (leader_dir.path().join("log").join(&name), snap.snapshot.dir.join(&name));
        assert_eq!(ino(&in_log), ino(&in_snapshot), "the active segment was copied, not linked");
        assert_eq!(len(&in_log), prefix);

        // The log goes on appending to the file both names share.
        let mut store = leader.log_store();
        let more: Vec<_> = (25..28).map(|i| common::entry(1, i, 300)).collect();
        common::append_durable(&mut store, more).await.expect("append");
        assert!(len(&in_snapshot) > prefix, "the appends did not reach the shared file");

        // A replica installing the snapshot gets its 25 entries, not the 3 after.
        let install = |dir: &Path| {
            let follower = Replica::open(dir, tiny(), flusher()).expect("open follower");
            let (meta, files) = (snap.meta.clone(), snap.snapshot.clone());
            async move {
                follower.state_machine().install_snapshot(&meta, files).await.expect("install");
                follower
            }
        };
        let follower = install(followers[0].path()).await;
        assert_eq!(follower.log_end_offset(), common::base_offset(25));
        assert_eq!(follower.read(0, usize::MAX).expect("read follower"), want);

        // Cutting the log's file below the prefix leaves the snapshot whole.
        // The cut is right after the segment's first entry, which the
        // snapshot's prefix holds with at least one more.
        let base: u64 = name.trim_end_matches(".seg").parse().expect("segment file name");
        assert!(base + 1 < 24, "the test needs two snapshot entries in the active segment, base {base}");
        store.truncate_after(Some(log_id(1, 1, base))).await.expect("truncate");
        assert!(len(&in_log) < prefix, "the test needs a cut below the prefix");
        assert_ne!(ino(&in_log), ino(&in_snapshot), "the shared file was cut in place");
        assert!(len(&in_snapshot) > prefix, "the snapshot's file lost bytes");
        let follower = install(followers[1].path()).await;
        assert_eq!(follower.read(0, usize::MAX).expect("read second follower"), want);
    });
}

/// A restart does not roll a log whose active segment only its own
/// snapshot links (a prefix of it): appending there is safe, and a roll at
/// every start would cost a segment and fsyncs per partition.
#[test]
fn a_restart_keeps_appending_to_an_active_segment_its_snapshot_links() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 25);
    TypeConfig::run(async {
        let (_leader, snap) = snapshot_of_written(dir.path(), 25).await;
        assert_eq!(
            snap.snapshot.manifest().expect("manifest").prefix_bytes.len(),
            1,
            "the test needs a linked active segment"
        );
    });
    let before = segments(dir.path());
    let replica = Replica::open(dir.path(), tiny(), flusher()).expect("reopen");
    assert_eq!(segments(dir.path()), before, "the restart rolled the active segment");
    TypeConfig::run(async {
        let mut store = replica.log_store();
        common::append_durable(&mut store, vec![common::entry(1, 25, 300)]).await.expect("append");
    });
    assert_eq!(replica.log_end_offset(), common::base_offset(26));
}

/// Flips a payload bit of entry `n` of a segment written by
/// [`write_entries`] (300-byte payloads, 80-byte frame headers).
fn flip_payload_bit(seg: &Path, n: u64) {
    let f = OpenOptions::new().read(true).write(true).open(seg).expect("open");
    let position = 40 + n * (80 + 300) + 80 + 10;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, position).expect("read");
    f.write_all_at(&[b[0] ^ 0x01], position).expect("flip");
}

#[test]
fn a_damaged_frame_in_the_active_segment_before_valid_ones_is_corruption_not_a_torn_tail() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), StoreConfig::default(), 20);
    let seg = segments(dir.path()).pop().expect("segment");
    let len_before = fs::metadata(&seg).expect("stat").len();
    // Flip a payload bit of entry 5; entries 6..19 after it are intact.
    flip_payload_bit(&seg, 5);
    let log = PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher()).expect("open");
    assert_set_aside(&log, &seg, len_before);
    assert_eq!(log.log_state().last_log_id, Some(log_id(1, 1, 4)), "the valid prefix is entries 0..=4");
    assert_eq!(fs::metadata(&seg).expect("stat").len(), 40 + 5 * (80 + 300), "cut at the damaged frame");
}

#[test]
fn a_complete_last_frame_that_fails_its_checksum_is_damage_not_a_torn_tail() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), StoreConfig::default(), 20);
    let seg = segments(dir.path()).pop().expect("segment");
    let len_before = fs::metadata(&seg).expect("stat").len();
    // Bit rot in the last entry: every byte of its frame is there (a torn
    // write leaves fewer), so it may have been acknowledged.
    flip_payload_bit(&seg, 19);
    let log = PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher()).expect("open");
    assert_set_aside(&log, &seg, len_before);
    assert_eq!(log.log_state().last_log_id, Some(log_id(1, 1, 18)), "the valid prefix is entries 0..=18");
}

#[test]
fn a_damaged_frame_followed_only_by_membership_frames_is_corruption_not_a_torn_tail() {
    use ferrolog_raft_store::types::{Entry, EntryPayload, Membership, Node};
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), StoreConfig::default(), 5);
    // Two membership entries (a joint configuration and its final one), as
    // a membership change leaves at a log's end.
    let nodes: std::collections::BTreeMap<u64, Node> =
        (1..=4).map(|id| (id, Node { addr: format!("10.0.0.{id}:9093") })).collect();
    let joint = Membership::new(vec![[1, 2, 3].into(), [2, 3, 4].into()], nodes.clone()).expect("joint");
    let last = Membership::new(vec![[2, 3, 4].into()], nodes).expect("final");
    TypeConfig::run(async {
        let replica = Replica::open(dir.path(), StoreConfig::default(), flusher()).expect("open");
        let mut store = replica.log_store();
        let entries = vec![
            Entry { log_id: log_id(1, 1, 5), payload: EntryPayload::Membership(joint) },
            Entry { log_id: log_id(1, 1, 6), payload: EntryPayload::Membership(last) },
        ];
        common::append_durable(&mut store, entries).await.expect("append");
    });
    let seg = segments(dir.path()).pop().expect("segment");
    let len_before = fs::metadata(&seg).expect("stat").len();
    // Flip a payload bit of entry 4: only the membership frames follow it.
    flip_payload_bit(&seg, 4);
    let log = PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher()).expect("open");
    assert_set_aside(&log, &seg, len_before);
    assert_eq!(log.log_state().last_log_id, Some(log_id(1, 1, 3)), "the valid prefix is entries 0..=3");
}

#[test]
fn a_missing_middle_segment_ends_the_log_before_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 60);
    let segs = segments(dir.path());
    assert!(segs.len() >= 4, "want several segments, got {}", segs.len());
    let last_kept = {
        let log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
        assert!(log.recovering().is_none() && log.damage().is_empty(), "an intact log is not damaged");
        let second: u64 = segs[2].file_stem().and_then(|s| s.to_str()).expect("stem").parse().expect("base");
        second - 1
    };
    fs::remove_file(&segs[1]).expect("remove a middle segment");
    let log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    let before: u64 = segs[1].file_stem().and_then(|s| s.to_str()).expect("stem").parse().expect("base");
    assert_eq!(log.log_state().last_log_id.map(|l| l.index), Some(before - 1), "kept through {last_kept}");
    assert_eq!(log.damage().len(), 1, "{:?}", log.damage());
    assert_eq!(log.damage()[0].path, segs[2], "the first segment after the gap is set aside");
    assert!(log.recovering().is_some());
    // The segment before the gap is the active one again; nothing after it stays.
    assert_eq!(segments(dir.path()), vec![segs[0].clone()]);
}

#[test]
fn a_missing_first_segment_restarts_the_log_empty() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 60);
    let segs = segments(dir.path());
    fs::remove_file(&segs[0]).expect("remove the first segment");
    let log = PartitionLog::open(&dir.path().join("log"), tiny(), flusher()).expect("open");
    assert_eq!(log.log_state().last_log_id, None, "a log without its beginning is not served");
    assert_eq!((log.next_index(), log.log_end_offset()), (0, 0));
    assert!(log.recovering().is_some());
}

#[test]
fn a_commit_index_past_a_cut_tail_is_lowered_to_the_log_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), StoreConfig::default(), 20);
    {
        let mut log =
            PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher()).expect("open");
        log.save_committed(Some(log_id(1, 1, 19))).expect("commit");
        log.sync().expect("sync");
    }
    let seg = segments(dir.path()).pop().expect("segment");
    let len = fs::metadata(&seg).expect("stat").len();
    OpenOptions::new().write(true).open(&seg).expect("open").set_len(len - 10).expect("cut 10 bytes");
    let log = PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher()).expect("open");
    assert_eq!(log.log_state().last_log_id, Some(log_id(1, 1, 18)));
    assert_eq!(log.committed(), Some(log_id(1, 1, 18)), "committed left past the end of the log");
    // The cut entry had been flushed (the sync above succeeded), so this is
    // not a torn write a crash left but an acknowledged entry lost: it looks
    // the same on disk, and only the recorded flushed index tells them
    // apart. The replica must not vote until a leader brought it back.
    assert!(log.damage().is_empty(), "a tail that ends cleanly is not set aside");
    let reason = log.recovering().expect("a log that lost a flushed entry is recovering");
    assert!(reason.contains("flushed"), "{reason}");
    drop(log);
    let log = PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher()).expect("reopen");
    assert_eq!(log.committed(), Some(log_id(1, 1, 18)), "the lowered commit index was not saved");
}

#[test]
fn an_only_segment_torn_at_creation_is_recreated() {
    for content in [&b""[..], &[0u8; 40][..], &b"FLOGSEG"[..]] {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(dir.path().join("log")).expect("mkdir");
        let seg = dir.path().join("log").join(format!("{:020}.seg", 0));
        fs::write(&seg, content).expect("write");
        let log = PartitionLog::open(&dir.path().join("log"), StoreConfig::default(), flusher())
            .unwrap_or_else(|e| panic!("{} bytes of torn header: {e}", content.len()));
        assert_eq!(log.log_state().last_log_id, None);
    }
}

#[test]
fn purge_past_a_lost_tail_rebuilds_the_log_from_the_snapshot_with_the_same_offsets() {
    let dir = tempfile::tempdir().expect("tempdir");
    TypeConfig::run(async {
        let replica = Replica::open(dir.path(), tiny(), flusher()).expect("open");
        let mut store = replica.log_store();
        let entries: Vec<_> = (0..20).map(|i| common::entry(1, i, 300)).collect();
        common::append_durable(&mut store, entries.clone()).await.expect("append");
        let mut sm = replica.state_machine();
        common::apply_all(&mut sm, entries).await;
        sm.get_snapshot_builder().await.build_snapshot().await.expect("snapshot");
        // The unsynced tail is lost (interval flush and a power cut).
        store.truncate_after(Some(log_id(1, 1, 9))).await.expect("truncate");
    });
    let replica = Replica::open(dir.path(), tiny(), flusher()).expect("reopen");
    TypeConfig::run(async {
        let mut store = replica.log_store();
        let (applied, _) = replica.state_machine().applied_state().await.expect("applied");
        assert_eq!(applied, Some(log_id(1, 1, 19)));
        // What openraft does at start when the log ends before last applied.
        store.purge(log_id(1, 1, 19)).await.expect("purge past the end");
        common::append_durable(&mut store, vec![common::entry(1, 20, 300)]).await.expect("append");
        common::apply_all(&mut replica.state_machine(), vec![common::entry(1, 20, 300)]).await;
    });
    assert_eq!(replica.log_start_offset(), 0, "retained records were dropped");
    let batches = replica.read(0, usize::MAX).expect("read");
    assert_eq!(batches.len(), 21);
    for (i, b) in batches.iter().enumerate() {
        assert_eq!(b.header.base_offset, common::base_offset(i as u64), "batch {i}");
        assert_eq!(b.records(), common::payload(i as u64, 300));
    }
}

#[test]
fn a_snapshot_manifest_naming_a_path_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let evil = tempfile::tempdir().expect("tempdir");
    write_entries(dir.path(), tiny(), 10);
    TypeConfig::run(async {
        let (_leader, snap) = snapshot_of_written(dir.path(), 10).await;
        // Rewrite the manifest to reach outside the snapshot directory.
        let manifest = snap.snapshot.dir.join("manifest.json");
        let text = fs::read_to_string(&manifest).expect("manifest");
        let text = text.replacen("\"00000000000000000000.seg\"", "\"../../log/00000000000000000000.seg\"", 1);
        fs::write(&manifest, text).expect("write manifest");
        let follower = Replica::open(evil.path(), tiny(), flusher()).expect("open follower");
        let err = follower.state_machine().install_snapshot(&snap.meta, snap.snapshot.clone()).await;
        assert!(err.is_err(), "a manifest naming a path was installed");
    });
}

#[test]
fn an_unclean_stop_under_flush_interval_marks_the_replica_recovering() {
    use ferrolog_raft_store::FlushPolicy;
    let interval =
        StoreConfig { flush: FlushPolicy::Interval { interval_ms: 60_000 }, ..StoreConfig::default() };
    let dir = tempfile::tempdir().expect("tempdir");
    let log_dir = dir.path().join("log");
    // A new, empty log has nothing to lose.
    drop(PartitionLog::open(&log_dir, interval.clone(), flusher()).expect("open"));
    assert!(PartitionLog::open(&log_dir, interval.clone(), flusher()).expect("open").recovering().is_none());
    // An empty log with a vote may have lost every entry it acknowledged
    // (nothing was fsynced before the power went): it must not vote for a
    // candidate without them either.
    let voted = tempfile::tempdir().expect("tempdir");
    let voted_log = voted.path().join("log");
    let mut log = PartitionLog::open(&voted_log, interval.clone(), flusher()).expect("open");
    log.save_vote(&Vote::new(3, 1)).expect("vote");
    drop(log);
    let log = PartitionLog::open(&voted_log, interval.clone(), flusher()).expect("open");
    assert!(
        log.recovering().is_some(),
        "an emptied log with a vote was trusted after a crash under interval"
    );
    drop(log);
    write_entries(dir.path(), interval.clone(), 5);
    let log = PartitionLog::open(&log_dir, interval.clone(), flusher()).expect("open");
    let why = log.recovering().expect("a crash under interval may have lost acknowledged entries");
    assert!(why.contains("interval"), "{why}");
    // Recovered (a leader brought it back), then stopped cleanly: not recovering.
    let mut log = log;
    log.set_recovering(None).expect("recovered");
    log.mark_clean_stop().expect("clean stop");
    drop(log);
    let log = PartitionLog::open(&log_dir, interval.clone(), flusher()).expect("open");
    assert!(log.recovering().is_none(), "a clean stop was taken for a crash");
    drop(log);
    // The marker is consumed: the next crash counts again.
    let log = PartitionLog::open(&log_dir, interval, flusher()).expect("open");
    assert!(log.recovering().is_some(), "a crash after a clean start was taken for a clean stop");
    drop(log);
    // Under flush = always an acknowledged entry was fsynced: no mark.
    let always = tempfile::tempdir().expect("tempdir");
    write_entries(always.path(), StoreConfig::default(), 5);
    let log =
        PartitionLog::open(&always.path().join("log"), StoreConfig::default(), flusher()).expect("open");
    assert!(log.recovering().is_none());
    // A clean stop under always writes no mark (nothing to lose), so the
    // same replica opened under interval is treated as after a crash: safe.
    log.mark_clean_stop().expect("clean stop");
    drop(log);
    let log = PartitionLog::open(&always.path().join("log"), interval_config(), flusher()).expect("open");
    assert!(log.recovering().is_some(), "no mark under always, so interval must assume the worst");
}

fn interval_config() -> StoreConfig {
    StoreConfig {
        flush: ferrolog_raft_store::FlushPolicy::Interval { interval_ms: 60_000 },
        ..StoreConfig::default()
    }
}

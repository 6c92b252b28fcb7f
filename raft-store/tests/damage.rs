//! Damaged replicas are repaired, not trusted, across every kind of damage
//! (issue 15), on the fault-injecting disk: a log of several sealed
//! segments gets one random damage (a byte flipped in a segment or an
//! index file, a segment or index file cut short or removed, a range
//! zeroed), then is opened as a broker would: plainly, and, when a read
//! meets corruption, again with every segment rescanned (what the broker
//! does after the storage error stops the Raft group). Then, always:
//!
//! - the open succeeds, and what the log serves verifies and is exactly a
//!   prefix of what was written (no damaged record is ever served);
//! - a log that lost entries it had acknowledged is marked *recovering*
//!   (it must not vote until a leader brought it back), and keeps that
//!   mark across a restart.
//!
//! `FERROLOG_DAMAGE_ROUNDS` sets the rounds (default 200); the seed prints.

mod common;

use std::path::{Path, PathBuf};

use ferrolog_raft_store::types::Entry;
use ferrolog_raft_store::vfs::{FaultyFs, Fs, OpenMode};
use ferrolog_raft_store::{Flusher, PartitionLog, StoreConfig};

const ENTRIES: u64 = 80;

fn config() -> StoreConfig {
    StoreConfig { segment_bytes: 4096, index_interval_bytes: 256, ..StoreConfig::default() }
}

fn dir() -> &'static Path {
    Path::new("/data/log")
}

fn expected(i: u64) -> Entry {
    common::entry(1, i, 150 + (i % 5) as usize * 40)
}

fn open(fs: &Fs, rescan: bool) -> Result<PartitionLog, String> {
    let flusher = Flusher::spawn_on("damage", fs.clone()).expect("flusher");
    PartitionLog::open_with(dir(), config(), flusher, rescan).map_err(|e| e.to_string())
}

/// Writes entries `0..ENTRIES`, each flush acknowledged, on a fresh disk.
fn written(seed: u64) -> FaultyFs {
    let disk = FaultyFs::new(seed);
    let fs: Fs = disk.mount();
    fs.create_dir_all(Path::new("/data")).expect("mkdir");
    fs.sync_dir(Path::new("/")).expect("sync /");
    let mut log = open(&fs, false).expect("open");
    for i in 0..ENTRIES {
        let (tx, rx) = std::sync::mpsc::channel();
        log.append(vec![expected(i)], Box::new(move |r| drop(tx.send(r)))).expect("append");
        rx.recv().expect("flushed").expect("flush ok");
    }
    disk
}

/// A well-mixed seed for each round (SplitMix64).
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// Applies one random damage to the log's files; says what it did.
fn damage(fs: &Fs, rng: &mut u64) -> String {
    let mut names: Vec<String> = fs
        .list(dir())
        .expect("list")
        .into_iter()
        .filter(|n| n.ends_with(".seg") || n.ends_with(".idx"))
        .collect();
    names.sort();
    let name = names[(next(rng) % names.len() as u64) as usize].clone();
    let path: PathBuf = dir().join(&name);
    let f = fs.open(&path, OpenMode::ReadWrite).expect("open victim");
    let len = f.len().expect("len");
    match next(rng) % 4 {
        0 if len > 0 => {
            let at = next(rng) % len;
            let mut b = [0u8];
            f.read_at(&mut b, at).expect("read");
            f.write_all_at(&[b[0] ^ (1 << (next(rng) % 8))], at).expect("flip");
            format!("flipped a bit of {name} at byte {at} of {len}")
        }
        1 if len > 0 => {
            let to = next(rng) % len;
            f.set_len(to).expect("cut");
            format!("cut {name} from {len} to {to} bytes")
        }
        2 if len > 0 => {
            let at = next(rng) % len;
            let n = (1 + next(rng) % 64).min(len - at);
            f.write_all_at(&vec![0u8; n as usize], at).expect("zero");
            format!("zeroed {n} bytes of {name} at {at}")
        }
        _ => {
            drop(f);
            fs.remove_file(&path).expect("remove");
            format!("removed {name}")
        }
    }
}

/// Everything the log serves, verified: entries from its first stored
/// index to its end, or the corruption error a read met.
fn served(log: &PartitionLog) -> Result<Vec<Entry>, String> {
    let Some(last) = log.log_state().last_log_id.map(|l| l.index) else { return Ok(Vec::new()) };
    let entries = log.entries(0, last + 1).map_err(|e| e.to_string())?;
    log.read(0, usize::MAX, u64::MAX).map_err(|e| e.to_string())?;
    Ok(entries)
}

#[test]
fn every_kind_of_damage_is_set_aside_never_served_and_marks_the_replica_recovering() {
    let rounds: u64 =
        std::env::var("FERROLOG_DAMAGE_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let seed: u64 = std::env::var("FERROLOG_DAMAGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(ferrolog_raft_store::runtime::random_u64);
    println!("seed {seed}");
    let (mut lost_rounds, mut rescans) = (0, 0);
    for round in 0..rounds {
        let mut rng = splitmix(seed.wrapping_add(round)) | 1;
        let disk = written(rng);
        let fs: Fs = disk.mount();
        let what = damage(&fs, &mut rng);
        let ctx = format!("round {round} (seed {seed}): {what}");
        let mut log = open(&fs, false).unwrap_or_else(|e| panic!("{ctx}: open failed: {e}"));
        let entries = match served(&log) {
            Ok(e) => e,
            Err(read_error) => {
                // A read met the damage (a sealed segment is checked when
                // read): the broker reopens with every segment rescanned.
                assert!(
                    read_error.contains("corrupt")
                        || read_error.contains("checksum")
                        || read_error.contains("byte"),
                    "{ctx}: a read failed, but not as corruption: {read_error}"
                );
                rescans += 1;
                drop(log);
                log = open(&fs, true).unwrap_or_else(|e| panic!("{ctx}: rescan open failed: {e}"));
                served(&log).unwrap_or_else(|e| panic!("{ctx}: the rescanned log still serves damage: {e}"))
            }
        };
        let first = log.log_state().last_purged_log_id.map_or(0, |p| p.index + 1);
        for (k, e) in entries.iter().enumerate() {
            assert_eq!(
                e,
                &expected(first + k as u64),
                "{ctx}: entry {} differs from what was written",
                first + k as u64
            );
        }
        let kept = entries.len() as u64;
        if kept < ENTRIES {
            lost_rounds += 1;
            assert!(
                log.recovering().is_some(),
                "{ctx}: the log lost {} acknowledged entries and is not recovering",
                ENTRIES - kept
            );
            drop(log);
            let again = open(&fs, false).unwrap_or_else(|e| panic!("{ctx}: reopen failed: {e}"));
            assert!(again.recovering().is_some(), "{ctx}: recovering was forgotten across a restart");
        }
    }
    println!(
        "{rounds} damages: {lost_rounds} lost entries (all marked recovering), {rescans} found by a read and rescanned"
    );
    assert!(lost_rounds > rounds / 10, "hardly any damage lost entries: the test did not test");
}

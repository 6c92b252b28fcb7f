//! The background scrub: now and then every hosted replica's committed
//! entries (every segment up to the commit index, the active one included)
//! are read back and every frame's checksum and place in the log verified,
//! so that bit rot in data nobody reads (a follower's, or old records no
//! consumer fetches) is found while the other replicas still hold good
//! copies.
//!
//! A read finds damage only in what it reads; Raft replication reads a
//! follower's log only when that follower leads. Rot that stays latent on
//! one replica becomes a loss the day a second fault meets it (the other
//! replicas' disks failing, or, under `flush = interval`, another
//! replica's power cut: see the README's guarantees). Storage systems
//! scrub for this reason (ZFS, Ceph's deep scrub, RAID patrol reads).
//!
//! Damage found here is handled as damage a read found
//! ([`crate::partition::Partition::report_damage`]): the replica is
//! restarted with every segment verified, keeps its valid prefix, does not
//! vote until it has caught up, and fetches the rest from its leader
//! (`ferrolog_replica::recovery`). The scrub only reads.
//!
//! Passes run one after another on a low-priority thread of their own
//! ([`Cleaner`]), at most `scrub.io_max_bytes_per_second`, with
//! `scrub.interval_ms` between the end of one and the start of the next.
//! Each pass starts at a different replica (its order rotates with the
//! time), so a broker restarted more often than a pass lasts still covers
//! all of its replicas over time. Reads go through the OS page cache: rot
//! under a cached page shows once the kernel has evicted it.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use crate::control::cleaner::Cleaner;
use crate::groups::GroupRegistry;

/// Bytes one read of a scrub reads at most (at least one frame).
const CHUNK_BYTES: usize = 1 << 20;

/// The longest wait from the broker's start to its first pass.
pub const FIRST_PASS_AFTER_MAX: Duration = Duration::from_secs(300);

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PassStats {
    /// Replicas whose committed entries were read.
    pub replicas: usize,
    /// Segments whose committed part was verified.
    pub segments: usize,
    /// Bytes read and verified.
    pub bytes: u64,
    /// Replicas found damaged (and reported for repair).
    pub damaged: usize,
    /// Segments that could not be read for another reason (an IO error):
    /// logged, and tried again next pass.
    pub errors: usize,
}

/// Runs scrub passes on this broker until the task is dropped: the first
/// `interval` after the start (at most [`FIRST_PASS_AFTER_MAX`]), then
/// each `interval` after the previous one ended. `interval` zero: no scrub.
/// `rate`: bytes per second a pass reads at most (0: no limit). Passes run
/// on a thread of their own ([`Cleaner::for_fs`] on `fs`, the data
/// directory's file system).
pub async fn run(groups: GroupRegistry, interval: Duration, rate: u64, fs: ferrolog_raft_store::Fs) {
    if interval.is_zero() {
        tracing::info!("scrub: off (scrub.interval_ms = 0)");
        return;
    }
    let cleaner = Cleaner::for_fs(fs, "ferrolog-scrub");
    tokio::time::sleep(interval.min(FIRST_PASS_AFTER_MAX)).await;
    loop {
        let started = Instant::now();
        let s = pass(&groups, rate, &cleaner).await;
        tracing::info!(
            replicas = s.replicas,
            segments = s.segments,
            bytes = s.bytes,
            damaged = s.damaged,
            errors = s.errors,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "scrub pass done"
        );
        tokio::time::sleep(interval).await;
    }
}

/// One pass over every hosted replica's committed entries
/// ([`ferrolog_raft_store::Replica::committed_segment_readers`]), in group
/// order rotated to start at a replica chosen by the time. A replica that
/// already reported damage is skipped (its restart verifies it anyway),
/// and a replica's pass ends at the first damage found.
///
/// No replica is held while its files are read (only a weak handle): a
/// replica the broker stops and opens again meanwhile (after damage, a
/// fatal error, a failed disk) must be able to claim its storage. Damage is
/// reported only if the replica still runs and its log still holds the file
/// as it was read ([`ferrolog_raft_store::Replica::still_holds`]): a
/// segment compaction or retention replaced, or Raft cut, is no longer the
/// log's. (A cut of uncommitted entries reopens the segment's file, so
/// damage in the committed part of the segment it cut waits for the next
/// pass.)
pub async fn pass(groups: &GroupRegistry, rate: u64, cleaner: &Cleaner) -> PassStats {
    let mut ids: Vec<u64> = groups.partitions().iter().map(|p| p.group).collect();
    ids.sort_unstable();
    if !ids.is_empty() {
        let start = crate::metadata::controller::now_ms().unsigned_abs() as usize % ids.len();
        ids.rotate_left(start);
    }
    let mut stats = PassStats::default();
    let mut throttle = Some(cleaner.throttle(rate));
    for group in ids {
        let Some(p) = groups.partition_of(group) else { continue };
        if p.damage().is_some() {
            continue;
        }
        stats.replicas += 1;
        let readers = p.replica.committed_segment_readers();
        let replica = Arc::downgrade(&p);
        drop(p);
        for reader in readers {
            // A replica stopped meanwhile (deleted, moved, restarted) is
            // left: its files are no longer its log's, and held open they
            // would keep their space.
            if replica.strong_count() == 0 {
                break;
            }
            let Some(mut t) = throttle.take() else { return stats };
            let job = move || {
                let verified = reader.verify(CHUNK_BYTES, &mut |n| t.read(n));
                (t, reader, verified)
            };
            let done = cleaner.run(job).await;
            // A job that panicked took the throttle with it: the pass ends.
            let Some((t, reader, verified)) = done else {
                tracing::error!(group, "scrub: a verification panicked; the pass ends");
                return stats;
            };
            throttle = Some(t);
            match verified {
                Ok(bytes) => {
                    stats.segments += 1;
                    stats.bytes += bytes;
                }
                Err(e) if e.is_damage() => {
                    if let Some(p) = replica.upgrade()
                        && p.replica.still_holds(&reader)
                        && p.report_damage(&e, "the scrub")
                    {
                        stats.damaged += 1;
                    }
                    break;
                }
                Err(e) => {
                    stats.errors += 1;
                    tracing::warn!(
                        group,
                        "scrub: cannot read {}; tried again next pass: {e}",
                        reader.path().display()
                    );
                }
            }
        }
    }
    stats
}

//! Dormant followers: an idle follower replica stops its Raft node's tasks
//! until its group's next message, so a broker's memory does not grow with
//! the partitions it only follows.
//!
//! A running Raft node costs about 65 KB of fixed state whatever its group
//! does (measured with heaptrack at 1,000 partitions, `benches/LOG.md`, "Where
//! an idle replica's memory goes"); two thirds of a broker's replicas are followers.
//! Once a follower's group has been quiet for `raft.dormant_after_ms` and
//! its leader's broker says, in its pings, that it leads the group
//! ([`Liveness::leads`]), the node is made dormant
//! (`ferrolog_replica::RaftNode::make_dormant`, which also checks that it
//! follows, is unused and has everything in its log committed and applied,
//! and fsyncs the log). A peer's message (the leader's next append, a
//! vote), a campaign (`crate::control::quiesce`) or any other call starts
//! it again first, over the same storage: as a restart would, which Raft
//! tolerates by construction (its safety rests on the persisted vote and
//! log, Raft paper §5). Leaders are never made dormant.
//!
//! The cost is the first message after a quiet spell that needs the node
//! (entries from the leader, a vote): it waits for the node to start, which
//! reads its state from the open storage (mostly memory; log entries past
//! the tail cache come from the segment files). A heartbeat from its leader
//! at the end of its log is answered without starting it
//! (`ferrolog_replica::RaftNode::handle_append`).

use std::time::Duration;

use ferrolog_raft_store::Fs;
use ferrolog_replica::Role;
use futures::StreamExt;

use crate::config::BrokerId;
use crate::control::liveness::Liveness;
use crate::groups::GroupRegistry;
use crate::partition::Partition;

/// Most nodes being made dormant at once (each waits for its tasks to end
/// and one fsync of an already-flushed file).
pub const AT_ONCE: usize = 16;

/// A round that made at least this many nodes dormant gives the freed
/// memory back to the operating system ([`crate::control::memory`]): glibc
/// keeps it in its arenas otherwise (measured at 3,000 partitions: all
/// 6,000 followers dormant and resident memory unchanged, 145 KiB per
/// replica). Fewer are left to be reused by nodes that wake.
pub const TRIM_AFTER: usize = 64;

/// How often the hosted partitions are looked at, for a broker whose
/// followers go dormant after `after`: a quarter of it, within 100 ms..2 s.
pub fn period(after: Duration) -> Duration {
    (after / 4).clamp(Duration::from_millis(100), Duration::from_secs(2))
}

/// Makes idle followers dormant, forever; returns at once if `after` is
/// zero (configured off).
/// `fs` is the data directory's file system (for [`crate::control::memory`]).
pub async fn run(me: BrokerId, groups: GroupRegistry, liveness: Liveness, after: Duration, fs: Fs) {
    if after.is_zero() {
        return;
    }
    let mut tick = tokio::time::interval(period(after));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let candidates: Vec<_> =
            groups.partitions().into_iter().filter(|p| may_sleep(p, me, &liveness)).collect();
        if candidates.is_empty() {
            continue;
        }
        let went = futures::stream::iter(candidates)
            .map(|p| async move {
                match p.raft.make_dormant(after).await {
                    Ok(went) => went,
                    Err(e) => {
                        tracing::error!(topic = %p.topic, partition = p.partition, "going dormant: {e}");
                        true
                    }
                }
            })
            .buffer_unordered(AT_ONCE)
            .filter(|went| std::future::ready(*went))
            .count()
            .await;
        if went >= TRIM_AFTER {
            crate::control::memory::release_freed(&*fs).await;
        }
        if went > 0 {
            crate::logging::every(
                "dormant.went",
                Duration::from_secs(10),
                format_args!(
                    "{went} idle follower replicas went dormant this round ({} dormant in all; woken since start: {:?})",
                    ferrolog_replica::dormant_count(),
                    ferrolog_replica::woken_by()
                ),
            );
        }
    }
}

/// Whether `p`'s replica here is a running follower, not recovering, whose
/// leader's broker (not this one) is alive and says it leads the group.
fn may_sleep(p: &Partition, me: BrokerId, liveness: &Liveness) -> bool {
    if p.raft.is_dormant() || p.replica.is_recovering() {
        return false;
    }
    let leader = p.raft.state(|s| if s.role() == Role::Follower { s.leader() } else { None });
    let Some(broker) = leader.and_then(|n| p.broker_of(n)) else { return false };
    broker != me && liveness.leads(broker, p.group)
}

//! Handing leadership over to a caught-up follower (Raft thesis §3.10),
//! and the controlled shutdown built on it (what Kafka's
//! `controlled.shutdown.enable` does through its controller; a Raft leader
//! hands over by itself).
//!
//! On SIGTERM a broker first marks itself draining
//! ([`GroupRegistry::set_draining`]): it starts no campaign, refuses
//! leaderships handed to it, and says so in its pings, so no peer picks it.
//! Then [`drain`] hands every leadership it holds, partitions and the
//! metadata group alike, to a follower on a live broker that is not
//! draining and whose log is within [`CAUGHT_UP_ENTRIES`] of the leader's
//! (the preferred replica first, then assignment order). The leader stops
//! taking writes as soon as it asks (clients are told `NOT_LEADER` and
//! follow the new leader); the follower waits until its log has the
//! leader's last entry, then wins an election its peers do not refuse
//! (a leadership-transfer vote is not held back by their leases). A
//! rolling restart then costs each partition one short hand-over instead
//! of an election timeout of unavailability.
//!
//! What cannot be handed over in time (no live follower, a follower that
//! stays behind, the deadline) is left as it is: the process exits and the
//! group elects a leader after a timeout, as after a crash. Safety does not
//! depend on any of this: votes and commits are Raft's (§5.2, §5.4).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrolog_replica::NodeId;
use futures::StreamExt;

use crate::config::BrokerId;
use crate::control::liveness::Liveness;
use crate::groups::{GroupId, GroupRegistry, HostedGroup};
use crate::metadata::METADATA_GROUP;
use crate::metadata::image::MetadataImage;

/// A follower whose log is at most this many entries behind the leader's
/// may be handed leadership: it receives the rest before it campaigns (its
/// Raft node waits up to an election timeout for it).
pub const CAUGHT_UP_ENTRIES: u64 = 64;
/// How long one attempt waits for the leadership to move before the next
/// attempt (the next candidate, in turn).
pub const ATTEMPT_WAIT: Duration = Duration::from_millis(500);
/// How often an attempt looks whether the leadership has moved, and how
/// long a leader whose followers are all behind waits between looks.
const POLL: Duration = Duration::from_millis(10);
/// Hand-overs one broker runs at once, so that thousands of leaderships
/// move in batches rather than as a storm of elections.
pub const IN_FLIGHT: usize = 32;

/// How one group's hand-over ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The leadership moved to the broker given.
    HandedOver(BrokerId),
    /// This replica did not lead (any more) when asked, without a hand-over
    /// of its own.
    NotLeader,
    /// No follower of the group is on a live broker that takes leadership.
    NoTarget,
    /// The deadline passed first; `asked`: a hand-over was begun (the
    /// leader takes no writes until one completes, see [`hand_over`]).
    TimedOut {
        /// Whether a hand-over was begun.
        asked: bool,
    },
}

/// The followers `group`'s leader may hand over to now, best first:
/// `replicas` is the group's voters in assignment order (the preferred
/// leader first) with their brokers; `me` is the leader's node; `matched`
/// tells how far each follower's log is known to match the leader's, and
/// `last` is the leader's last log index. A follower qualifies when its
/// broker takes leadership (`takes`) and it is within
/// [`CAUGHT_UP_ENTRIES`] of `last`.
pub fn candidates(
    replicas: &[(NodeId, BrokerId)],
    me: NodeId,
    matched: impl Fn(NodeId) -> Option<u64>,
    last: u64,
    takes: impl Fn(BrokerId) -> bool,
) -> Vec<(NodeId, BrokerId)> {
    replicas
        .iter()
        .copied()
        .filter(|(n, b)| *n != me && takes(*b))
        .filter(|(n, _)| matched(*n).is_some_and(|m| m + CAUGHT_UP_ENTRIES >= last))
        .collect()
}

/// Hands the leadership of `h` over, to `to` if given (it must qualify,
/// see [`candidates`]), else to the best candidate, trying the next one
/// after each [`ATTEMPT_WAIT`], until `deadline`. `replicas` is as for
/// [`candidates`].
///
/// Once asked, the Raft library's leader takes no writes and sends no
/// heartbeats until a new leader is elected: a hand-over that was begun
/// and timed out ([`Outcome::TimedOut`] with `asked`) leaves the group
/// without a writable leader until another hand-over completes, so a
/// caller that stays up must hand over to someone else.
pub async fn hand_over(
    h: &HostedGroup,
    replicas: &[(NodeId, BrokerId)],
    to: Option<BrokerId>,
    liveness: &Liveness,
    deadline: Instant,
) -> Outcome {
    let mut attempt = 0usize;
    let mut target: Option<BrokerId> = None;
    loop {
        if !h.raft.is_leader() {
            let new =
                h.raft.state(|s| s.leader()).and_then(|n| replicas.iter().find(|r| r.0 == n)).map(|r| r.1);
            return match target {
                Some(t) => Outcome::HandedOver(new.unwrap_or(t)),
                None => Outcome::NotLeader,
            };
        }
        if Instant::now() >= deadline {
            return Outcome::TimedOut { asked: target.is_some() };
        }
        let (last, matched): (u64, Vec<(NodeId, Option<u64>)>) = h.raft.state(|s| {
            let matched =
                s.matched().map(|r| r.map(|(n, m)| (n, m.map(|l| l.index))).collect()).unwrap_or_default();
            (s.last_log_index().unwrap_or(0), matched)
        });
        let matched_of = |n: NodeId| matched.iter().find(|(m, _)| *m == n).and_then(|(_, i)| *i);
        let takes = |b: BrokerId| to.is_none_or(|t| t == b) && liveness.takes_leadership(b);
        let found = candidates(replicas, h.node_id, matched_of, last, takes);
        let Some(&(node, broker)) = found.get(attempt % found.len().max(1)) else {
            // A follower on a live broker that is behind is waited for
            // (a heartbeat round tells the leader how far it got); with
            // none, nobody can take over.
            let live = replicas.iter().any(|(n, b)| *n != h.node_id && takes(*b));
            if !live {
                return Outcome::NoTarget;
            }
            h.raft.heartbeat().await;
            tokio::time::sleep(POLL * 5).await;
            continue;
        };
        target = Some(broker);
        attempt += 1;
        h.raft.transfer_leader(node).await;
        let until = (Instant::now() + ATTEMPT_WAIT).min(deadline);
        while h.raft.is_leader() && Instant::now() < until {
            tokio::time::sleep(POLL).await;
        }
    }
}

/// How a hand-over to one chosen broker ended ([`transfer_to`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transfer {
    /// The chosen broker's replica leads now.
    Moved,
    /// This replica did not lead when asked.
    NotLeader,
    /// The leadership did not move: the reason.
    NotMoved(String),
    /// The chosen replica did not take over after the hand-over began, so
    /// the leadership went to another caught-up replica, on this broker.
    Elsewhere(BrokerId),
    /// The chosen replica did not take over after the hand-over began, and
    /// no other did: the group has no writable leader until one does (the
    /// outcome of the last try).
    Stuck(Outcome),
}

/// Hands the leadership of `h` to broker `to`'s replica within `wait`
/// ([`hand_over`]). A hand-over that was begun but did not complete keeps
/// this leader from taking writes, so then the leadership is handed to any
/// other caught-up replica instead, within `wait` again.
pub async fn transfer_to(
    h: &HostedGroup,
    replicas: &[(NodeId, BrokerId)],
    to: BrokerId,
    liveness: &Liveness,
    wait: Duration,
) -> Transfer {
    match hand_over(h, replicas, Some(to), liveness, Instant::now() + wait).await {
        Outcome::HandedOver(b) if b == to => Transfer::Moved,
        Outcome::HandedOver(b) => Transfer::Elsewhere(b),
        Outcome::NotLeader => Transfer::NotLeader,
        Outcome::NoTarget => Transfer::NotMoved(format!("broker {to} is not alive or is shutting down")),
        Outcome::TimedOut { asked: false } => {
            Transfer::NotMoved(format!("broker {to}'s replica did not catch up within {wait:?}"))
        }
        Outcome::TimedOut { asked: true } => {
            let other = hand_over(h, replicas, None, liveness, Instant::now() + wait).await;
            tracing::warn!(
                to,
                ?other,
                "the chosen replica did not take the leadership over; handed to another"
            );
            match other {
                Outcome::HandedOver(b) => Transfer::Elsewhere(b),
                Outcome::NotLeader => Transfer::NotLeader,
                o => Transfer::Stuck(o),
            }
        }
    }
}

/// The voters of `group` in assignment order with their brokers: a
/// partition's replicas as assigned (the preferred leader first); the
/// metadata group's voters by node id.
pub fn voters_in_order(h: &HostedGroup, group: GroupId, image: &MetadataImage) -> Vec<(NodeId, BrokerId)> {
    let voters: Vec<NodeId> = h.raft.state(|s| s.voters().collect());
    match &h.partition {
        Some(p) => {
            p.replicas().iter().filter(|r| voters.contains(&r.node)).map(|r| (r.node, r.broker)).collect()
        }
        None => voters.iter().filter_map(|n| image.broker_of_node(group, *n).map(|b| (*n, b))).collect(),
    }
}

/// What a controlled shutdown's hand-overs came to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Partition leaderships handed over.
    pub handed_over: usize,
    /// The metadata group's leadership (the controller) was handed over.
    pub controller_handed_over: bool,
    /// Leaderships with no live follower to take them.
    pub no_target: usize,
    /// Leaderships not handed over by the deadline (or when hurried).
    pub left: usize,
    /// How long it took.
    pub took: Duration,
}

/// The controlled shutdown's hand-overs: marks the broker draining, then
/// hands over every leadership it holds ([`hand_over`], [`IN_FLIGHT`] at
/// a time) within `within`. Passes repeat while leaderships remain that
/// can move (one handed here before the peers learned this broker is
/// draining, say). Ends early when `hurry` resolves (a second SIGTERM).
pub async fn drain(
    groups: &GroupRegistry,
    image: Arc<MetadataImage>,
    liveness: &Liveness,
    within: Duration,
    hurry: impl std::future::Future<Output = ()>,
) -> DrainReport {
    let t0 = Instant::now();
    let deadline = t0 + within;
    groups.set_draining();
    let mut report = DrainReport::default();
    let passes = async {
        let mut stuck: std::collections::HashSet<GroupId> = std::collections::HashSet::new();
        loop {
            // Read from the nodes, not the cached list of
            // `GroupRegistry::leading`, which shows a move a little later.
            let led: Vec<GroupId> = groups
                .all()
                .into_iter()
                .filter(|(g, h)| !stuck.contains(g) && h.raft.is_leader())
                .map(|(g, _)| g)
                .collect();
            if led.is_empty() || Instant::now() >= deadline {
                return;
            }
            let outcomes: Vec<(GroupId, Outcome)> = futures::stream::iter(led)
                .map(|g| {
                    let image = image.clone();
                    async move {
                        let Some(h) = groups.get(g) else { return (g, Outcome::NotLeader) };
                        let replicas = voters_in_order(&h, g, &image);
                        (g, hand_over(&h, &replicas, None, liveness, deadline).await)
                    }
                })
                .buffer_unordered(IN_FLIGHT)
                .collect()
                .await;
            for (g, o) in outcomes {
                match o {
                    Outcome::HandedOver(to) if g == METADATA_GROUP => {
                        tracing::info!(to, "controller leadership handed over");
                        report.controller_handed_over = true;
                    }
                    Outcome::HandedOver(to) => {
                        tracing::debug!(group = g, to, "leadership handed over");
                        report.handed_over += 1;
                    }
                    Outcome::NoTarget => {
                        stuck.insert(g);
                        report.no_target += 1;
                    }
                    Outcome::TimedOut { .. } => {
                        stuck.insert(g);
                    }
                    Outcome::NotLeader => {}
                }
            }
        }
    };
    tokio::select! {
        () = passes => {}
        () = hurry => tracing::warn!("controlled shutdown cut short by a second signal"),
    }
    let left = groups.all().iter().filter(|(_, h)| h.raft.is_leader()).count();
    report.left = left.saturating_sub(report.no_target);
    report.took = t0.elapsed();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPLICAS: [(NodeId, BrokerId); 3] = [(11, 1), (12, 2), (13, 3)];

    #[test]
    fn caught_up_followers_on_brokers_that_take_leadership_qualify_in_assignment_order() {
        let all = |_| true;
        let matched = |n: NodeId| Some(if n == 12 { 1000 } else { 990 });
        assert_eq!(candidates(&REPLICAS, 11, matched, 1000, all), vec![(12, 2), (13, 3)]);
        // The preferred replica itself leads: the next two, in order.
        assert_eq!(candidates(&REPLICAS, 13, matched, 1000, all), vec![(11, 1), (12, 2)]);
        // A broker that is dead or draining does not take it.
        assert_eq!(candidates(&REPLICAS, 11, matched, 1000, |b| b != 2), vec![(13, 3)]);
    }

    #[test]
    fn a_follower_too_far_behind_or_never_heard_from_does_not_qualify() {
        let matched = |n: NodeId| match n {
            12 => Some(1000 - CAUGHT_UP_ENTRIES - 1),
            13 => None,
            _ => Some(1000),
        };
        assert!(candidates(&REPLICAS, 11, matched, 1000, |_| true).is_empty());
        let matched = |n: NodeId| (n == 12).then_some(1000 - CAUGHT_UP_ENTRIES);
        assert_eq!(candidates(&REPLICAS, 11, matched, 1000, |_| true), vec![(12, 2)]);
    }
}

//! Handing leadership over to a caught-up follower (Raft thesis §3.10),
//! and the controlled shutdown built on it (what Kafka's
//! `controlled.shutdown.enable` does through its controller; a Raft leader
//! hands over by itself).
//!
//! On SIGTERM a broker first marks itself draining
//! ([`GroupRegistry::set_draining`]): it starts no campaign (its metadata
//! replica's own election timer is switched off too), refuses leaderships
//! handed to it, and says so in its pings, so no peer picks it. Then
//! [`HandOver::drain`] hands every leadership it holds, partitions and the
//! metadata group alike, to a follower on a live broker that is not
//! draining, has the group open, and has stored a blank entry the leader
//! appends first (the preferred replica first, then assignment order; see
//! [`HandOver::hand_over`]). The leader stops taking writes as soon as it
//! asks (clients are told `NOT_LEADER` and follow the new leader); the
//! follower waits until its log has the leader's last entry, then wins an
//! election its peers do not refuse (a leadership-transfer vote is not held
//! back by their leases). A rolling restart then costs each partition one
//! short hand-over instead of an election timeout of unavailability.
//!
//! Once asked, the Raft library's leader takes no writes and sends no
//! heartbeats until a new leader is elected, and it cannot be called off.
//! A hand-over that was begun and did not complete is therefore never left
//! as it is: the group is marked as handed over
//! ([`GroupRegistry::set_handing_over`]), so this broker's pings stop
//! announcing it and its followers elect a leader on their own, as after
//! CheckQuorum's hand-over. What was not begun in time (no live follower, a
//! follower that stays behind, the deadline) keeps its leader until the
//! process exits; the group then elects a leader after a timeout, as after
//! a crash. Safety does not depend on any of this: votes and commits are
//! Raft's (§5.2, §5.4).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

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
/// How often an attempt looks whether the leadership has moved, and how
/// long a leader whose followers are all behind waits between looks.
const POLL: Duration = Duration::from_millis(10);
/// Hand-overs one broker runs at once, so that thousands of leaderships
/// move in batches rather than as a storm of elections.
pub const IN_FLIGHT: usize = 64;
/// Attempts ([`HandOver::attempt_wait`] each) one group gets in a drain.
pub const GROUP_ATTEMPTS: u32 = 3;

/// How one group's hand-over ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The leadership moved to the broker given: its replica was seen
    /// leading.
    HandedOver(BrokerId),
    /// This replica did not lead (any more) when asked, without a hand-over
    /// of its own.
    NotLeader,
    /// No follower of the group is on a live broker that takes leadership;
    /// nothing was asked.
    NoTarget,
    /// The deadline passed before any follower qualified; nothing was asked.
    TimedOut,
    /// A hand-over was begun and no new leader was seen by the deadline
    /// (or every candidate went away): the group has been marked as handed
    /// over, so its followers elect a leader on their own.
    Stalled,
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

/// How a hand-over to one chosen broker ended ([`HandOver::transfer_to`]).
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
    /// no other did in time: the group is marked as handed over and its
    /// followers elect a leader on their own.
    Stalled,
}

/// Hands leaderships over; cheap to clone.
#[derive(Clone, Debug)]
pub struct HandOver {
    /// The hosted groups (and the draining flag).
    pub groups: GroupRegistry,
    /// Which brokers are alive, draining, or have a group open.
    pub liveness: Liveness,
    /// How long one attempt waits for a new leader before the next (the
    /// next candidate, in turn): longer than the target may take to catch
    /// up (its Raft node waits up to the minimum election timeout) and be
    /// elected, so two candidates rarely run at once. 1.5 × the maximum
    /// election timeout.
    pub attempt_wait: Duration,
}

impl HandOver {
    /// A hand-over helper for brokers whose maximum election timeout is
    /// `election_timeout_max`.
    pub fn new(groups: GroupRegistry, liveness: Liveness, election_timeout_max: Duration) -> Self {
        Self { groups, liveness, attempt_wait: election_timeout_max * 3 / 2 }
    }

    /// Whether `broker` may be handed `group`'s leadership: alive, not
    /// draining, and with the group open.
    fn takes(&self, broker: BrokerId, group: GroupId) -> bool {
        self.liveness.takes_leadership(broker) && self.liveness.has_open(broker, group)
    }

    /// Hands the leadership of `group` over, to `to` if given (it must
    /// qualify, see [`candidates`]), else to the best candidate, trying the
    /// next one after each [`HandOver::attempt_wait`], until `deadline`.
    /// `replicas` is as for [`candidates`]. A hand-over begun and not
    /// completed by the deadline is [`Outcome::Stalled`] (see the module
    /// documentation).
    pub async fn hand_over(
        &self,
        group: GroupId,
        replicas: &[(NodeId, BrokerId)],
        to: Option<BrokerId>,
        deadline: Instant,
    ) -> Outcome {
        self.hand_over_marking(group, replicas, to, deadline, true).await
    }

    /// [`HandOver::hand_over`]; `mark`: whether a stalled hand-over is
    /// marked as handed over (not when the caller tries another target
    /// first).
    async fn hand_over_marking(
        &self,
        group: GroupId,
        replicas: &[(NodeId, BrokerId)],
        to: Option<BrokerId>,
        deadline: Instant,
        mark: bool,
    ) -> Outcome {
        let Some(h) = self.groups.get(group) else { return Outcome::NotLeader };
        if !h.raft.is_leader() {
            return Outcome::NotLeader;
        }
        let takes = |b: BrokerId| to.is_none_or(|t| t == b) && self.takes(b, group);
        if !replicas.iter().any(|(n, b)| *n != h.node_id && takes(*b)) {
            return Outcome::NoTarget;
        }
        let stalled = |h: &HostedGroup| if mark { self.stalled(group, h) } else { Outcome::Stalled };
        let mut asked = false;
        let mut attempt = 0usize;
        // A blank entry of this leader's term first: a follower whose Raft
        // node went dormant (an idle group, `crate::control::dormant`)
        // starts again to append it, and its node then knows its log is
        // flushed under this leader's vote. Woken only by the hand-over
        // request, it knew no flush point and refused the hand-over after
        // waiting an election timeout (measured at 10,000 idle partitions:
        // none of 3,335 handed over in 10 s). Only followers that have the
        // entry are candidates.
        let barrier = async {
            if !h.raft.renew_lease(self.attempt_wait).await {
                return None;
            }
            tokio::time::timeout(self.attempt_wait, h.raft.write_barrier()).await.ok()?.ok()?;
            h.raft.state(|s| s.last_log_index())
        };
        let barrier = if h.raft.is_leader() { barrier.await } else { None };
        loop {
            if !h.raft.is_leader() {
                if !asked {
                    return Outcome::NotLeader;
                }
                // Stepped down: wait until the new leader is known.
                let until = (Instant::now() + self.attempt_wait).min(deadline);
                loop {
                    let new = h.raft.state(|s| s.leader().filter(|n| *n != h.node_id));
                    if let Some(b) = new.and_then(|n| replicas.iter().find(|r| r.0 == n)).map(|r| r.1) {
                        return Outcome::HandedOver(b);
                    }
                    if h.raft.is_leader() {
                        break;
                    }
                    if Instant::now() >= until {
                        return stalled(&h);
                    }
                    tokio::time::sleep(POLL).await;
                }
                continue;
            }
            if Instant::now() >= deadline {
                return if asked { stalled(&h) } else { Outcome::TimedOut };
            }
            let (last, matched): (u64, Vec<(NodeId, Option<u64>)>) = h.raft.state(|s| {
                let matched = s
                    .matched()
                    .map(|r| r.map(|(n, m)| (n, m.map(|l| l.index))).collect())
                    .unwrap_or_default();
                (s.last_log_index().unwrap_or(0), matched)
            });
            let matched_of = |n: NodeId| {
                matched
                    .iter()
                    .find(|(m, _)| *m == n)
                    .and_then(|(_, i)| *i)
                    .filter(|i| barrier.is_none_or(|b| *i >= b))
            };
            let found = candidates(replicas, h.node_id, matched_of, last, takes);
            let Some(&(node, _)) = found.get(attempt % found.len().max(1)) else {
                // A follower on a live broker that is behind is waited for
                // (a heartbeat round tells the leader how far it got); with
                // none, nobody can take over.
                let live = replicas.iter().any(|(n, b)| *n != h.node_id && takes(*b));
                if !live {
                    return if asked { stalled(&h) } else { Outcome::NoTarget };
                }
                h.raft.heartbeat().await;
                tokio::time::sleep(POLL * 5).await;
                continue;
            };
            asked = true;
            attempt += 1;
            h.raft.transfer_leader(node).await;
            let until = (Instant::now() + self.attempt_wait).min(deadline);
            while h.raft.is_leader() && Instant::now() < until {
                tokio::time::sleep(POLL).await;
            }
        }
    }

    /// Marks a hand-over that was begun and did not complete (see the
    /// module documentation).
    fn stalled(&self, group: GroupId, h: &HostedGroup) -> Outcome {
        if let Some(term) = h.raft.leader_term() {
            tracing::warn!(group, term, "a hand-over did not complete: followers are left to elect a leader");
            self.groups.set_handing_over(group, Some(term));
        }
        Outcome::Stalled
    }

    /// Hands the leadership of `group` to broker `to`'s replica within
    /// `wait` ([`HandOver::hand_over`]). A hand-over that was begun but did
    /// not complete keeps this leader from taking writes, so it is then
    /// handed to any other caught-up replica instead, within `wait` again.
    /// Runs on a task of its own: a caller that goes away (a client that
    /// hangs up) does not leave a hand-over half done.
    pub async fn transfer_to(
        &self,
        group: GroupId,
        replicas: Vec<(NodeId, BrokerId)>,
        to: BrokerId,
        wait: Duration,
    ) -> Transfer {
        let this = self.clone();
        let task = tokio::spawn(async move { this.transfer_to_here(group, &replicas, to, wait).await });
        task.await.unwrap_or_else(|e| Transfer::NotMoved(format!("the hand-over task failed: {e}")))
    }

    async fn transfer_to_here(
        &self,
        group: GroupId,
        replicas: &[(NodeId, BrokerId)],
        to: BrokerId,
        wait: Duration,
    ) -> Transfer {
        // The broker of the replica that leads now, if it is not this one.
        let led_elsewhere = || {
            let h = self.groups.get(group)?;
            let node = h.raft.state(|s| s.leader()).filter(|n| *n != h.node_id)?;
            replicas.iter().find(|r| r.0 == node).map(|r| r.1)
        };
        match self.hand_over_marking(group, replicas, Some(to), Instant::now() + wait, false).await {
            Outcome::HandedOver(b) if b == to => Transfer::Moved,
            Outcome::HandedOver(b) => Transfer::Elsewhere(b),
            Outcome::NotLeader => Transfer::NotLeader,
            Outcome::NoTarget => Transfer::NotMoved(format!("broker {to} is not alive or is shutting down")),
            Outcome::TimedOut => {
                Transfer::NotMoved(format!("broker {to}'s replica did not catch up within {wait:?}"))
            }
            Outcome::Stalled => {
                let other = self.hand_over(group, replicas, None, Instant::now() + wait).await;
                tracing::warn!(group, to, ?other, "the chosen replica did not take the leadership over");
                match (other, led_elsewhere()) {
                    (_, Some(b)) if b == to => Transfer::Moved,
                    (Outcome::HandedOver(b), _) | (_, Some(b)) => Transfer::Elsewhere(b),
                    (Outcome::Stalled, None) => Transfer::Stalled,
                    _ => {
                        // Nothing else was asked (no other replica could
                        // take it): the first hand-over still holds writes.
                        if let Some(h) = self.groups.get(group) {
                            self.stalled(group, &h);
                        }
                        Transfer::Stalled
                    }
                }
            }
        }
    }

    /// The controlled shutdown's hand-overs: marks the broker draining
    /// (and switches its metadata replica's election timer off), then hands
    /// over every leadership it holds ([`HandOver::hand_over`],
    /// [`IN_FLIGHT`] at a time) within `within`. Passes repeat while
    /// leaderships remain that can move (one handed here before the peers
    /// learned this broker is draining, say). Ends early when `hurry`
    /// resolves (a second SIGTERM).
    pub async fn drain(
        &self,
        image: Arc<MetadataImage>,
        within: Duration,
        hurry: impl std::future::Future<Output = ()>,
    ) -> DrainReport {
        let t0 = Instant::now();
        let deadline = t0 + within;
        let groups = &self.groups;
        groups.set_draining();
        if let Some(h) = groups.get(METADATA_GROUP) {
            h.raft.set_elections(false);
        }
        let report = std::sync::Mutex::new(DrainReport::default());
        let given_up: std::sync::Mutex<HashSet<GroupId>> = std::sync::Mutex::default();
        let passes = async {
            loop {
                // Read from the nodes, not the cached list of
                // `GroupRegistry::leading`, which shows a move a little later.
                let skip = given_up.lock().unwrap_or_else(|p| p.into_inner()).clone();
                let led: Vec<GroupId> = groups
                    .all()
                    .into_iter()
                    .filter(|(g, h)| !skip.contains(g) && h.raft.is_leader())
                    .map(|(g, _)| g)
                    .collect();
                if led.is_empty() || Instant::now() >= deadline {
                    return;
                }
                futures::stream::iter(led)
                    .for_each_concurrent(IN_FLIGHT, |g| {
                        let (image, report, given_up) = (image.clone(), &report, &given_up);
                        async move {
                            let Some(h) = groups.get(g) else { return };
                            let replicas = voters_in_order(&h, g, &image);
                            // Each group gets a few attempts, not the whole
                            // drain: one that stalls is marked (its
                            // followers elect) rather than kept from writes.
                            let mine = (Instant::now() + self.attempt_wait * GROUP_ATTEMPTS).min(deadline);
                            let o = self.hand_over(g, &replicas, None, mine).await;
                            let mut r = report.lock().unwrap_or_else(|p| p.into_inner());
                            match o {
                                Outcome::HandedOver(to) if g == METADATA_GROUP => {
                                    tracing::info!(to, "controller leadership handed over");
                                    r.controller_handed_over = true;
                                }
                                Outcome::HandedOver(to) => {
                                    tracing::debug!(group = g, to, "leadership handed over");
                                    r.handed_over += 1;
                                }
                                Outcome::NoTarget | Outcome::TimedOut | Outcome::Stalled => {
                                    given_up.lock().unwrap_or_else(|p| p.into_inner()).insert(g);
                                }
                                Outcome::NotLeader => {}
                            }
                        }
                    })
                    .await;
            }
        };
        tokio::select! {
            () = passes => {}
            () = hurry => tracing::warn!("controlled shutdown cut short by a second signal"),
        }
        let mut report = report.into_inner().unwrap_or_else(|p| p.into_inner());
        let still: Vec<(GroupId, HostedGroup)> =
            groups.all().into_iter().filter(|(_, h)| h.raft.is_leader()).collect();
        let no_target = |g: &GroupId| {
            groups.get(*g).is_some_and(|h| {
                let replicas = voters_in_order(&h, *g, &image);
                !replicas.iter().any(|(n, b)| *n != h.node_id && self.takes(*b, *g))
            })
        };
        report.no_target = still.iter().filter(|(g, _)| no_target(g)).count();
        report.left = still.len() - report.no_target;
        report.took = t0.elapsed();
        report
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
    /// Partition leaderships handed over (a new leader was seen).
    pub handed_over: usize,
    /// The metadata group's leadership (the controller) was handed over.
    pub controller_handed_over: bool,
    /// Leaderships still held at the end with no follower on a live broker
    /// that takes leadership.
    pub no_target: usize,
    /// Other leaderships still held at the end (the deadline, a second
    /// signal, a follower that stayed behind).
    pub left: usize,
    /// How long it took.
    pub took: Duration,
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

//! CheckQuorum (Raft thesis §6.2): a leader (of a partition, or of the
//! metadata group) that has lost its quorum hands its leadership over.
//!
//! A Raft leader keeps its leadership until it sees a higher term. A partition can
//! keep that from happening: when a leader's messages reach its followers
//! but their answers do not come back (a one-way partition), the followers
//! keep hearing heartbeats, refuse to elect anyone, and nothing commits
//! until the network heals. Clients that still reach the old leader wait
//! on it for the whole partition.
//!
//! A leader has lost its quorum when, for `election_timeout_min` on end,
//! it has been heartbeating for a maximum election timeout, no quorum has
//! acknowledged it for that long, and some configuration of its membership
//! (both, during joint consensus) has no majority of voters whose brokers
//! answer pings ([`crate::control::liveness`]). The lease alone is not enough:
//! the Raft node bounds each heartbeat by `heartbeat_interval`, so a round trip
//! longer than that (50 ms each way, say) leaves an idle leader's lease
//! stale although every follower answers. One ping per broker pair travels
//! the same connection as the groups' Raft messages, so a partition that
//! stops one stops the other. A voter whose broker is not known yet counts
//! as answering. A round that comes late (this process was paused or
//! starved) judges nothing, so a stall of the leader itself is not taken
//! for a lost quorum.
//!
//! Such a leader, for the rest of its term:
//!
//! - asks its Raft node to transfer leadership to its most caught-up
//!   follower, again every maximum election timeout: the node then stops its
//!   heartbeats and its writes, and tells every follower to drop its leader
//!   lease; the successor elects at once if its log is up to date;
//! - is left out of the groups its broker's pings say it leads, so parked
//!   followers start their tickers and elect on their own timers when the
//!   transfer does not get through;
//! - stops naming itself leader to clients
//!   ([`crate::partition::Partition::leader_broker`]) and answers produces
//!   waiting on it.
//!
//! Safety does not depend on this: elections and commits stay Raft's.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use ferrolog_replica::{LogPosition, NodeId, RaftNode};
use tokio::sync::watch;

use crate::control::liveness::Liveness;
use crate::groups::GroupRegistry;
use crate::metadata::METADATA_GROUP;
use crate::metadata::hosted::HostedMetadata;
use crate::metadata::image::MetadataImage;

/// What the rule reads of one group, all local.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaderView {
    /// This replica leads.
    pub is_leader: bool,
    /// Voters in the group's membership (all configurations).
    pub voters: usize,
    /// How long its ticker has run (`None`: parked, no heartbeats sent).
    pub heartbeating_for: Option<Duration>,
    /// Time since a quorum last acknowledged it (`None`: never).
    pub since_quorum_ack: Option<Duration>,
    /// Every configuration has a majority of voters whose brokers answer
    /// pings (this one included).
    pub live_majority: bool,
}

/// The rule, a pure function: whether the leader looks as if it lost its
/// quorum now, with `timeout` the maximum election timeout.
pub fn lost(v: LeaderView, timeout: Duration) -> bool {
    v.is_leader
        && v.voters > 1
        && v.heartbeating_for.is_some_and(|t| t >= timeout)
        && v.since_quorum_ack.is_some_and(|t| t > timeout)
        && !v.live_majority
}

/// The voter to hand over to: the follower whose matched log is the
/// highest (ties to the lowest node id), so its log is most likely up to
/// date enough to win the election.
pub fn successor(
    me: NodeId,
    voters: &[NodeId],
    matched: &BTreeMap<NodeId, Option<LogPosition>>,
) -> Option<NodeId> {
    voters
        .iter()
        .filter(|n| **n != me)
        .max_by(|a, b| {
            let (ma, mb) = (matched.get(a).cloned().flatten(), matched.get(b).cloned().flatten());
            ma.cmp(&mb).then(b.cmp(a))
        })
        .copied()
}

/// One group's examination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exam {
    /// The term, when this replica leads.
    pub leader_term: Option<u64>,
    /// [`lost`] holds now.
    pub lost: bool,
    /// The [`successor`].
    pub successor: Option<NodeId>,
}

/// Examines `raft`, whose node here is `me`, heartbeating for
/// `heartbeating_for` (`None`: ticker parked), where `live(node)` says
/// whether a voter's broker answers pings.
pub fn examine(
    raft: &RaftNode,
    me: NodeId,
    heartbeating_for: Option<Duration>,
    live: impl Fn(NodeId) -> bool,
) -> Exam {
    let timeout = raft.timings().election_timeout_max;
    raft.state(|s| {
        if !s.is_leader() {
            return Exam { leader_term: None, lost: false, successor: None };
        }
        if heartbeating_for.is_none() {
            // Parked (an idle, quiesced leader): nothing to judge, and cheap
            // for the thousands of idle groups a broker may lead.
            return Exam { leader_term: Some(s.term()), lost: false, successor: None };
        }
        let voters: Vec<NodeId> = s.voters().collect();
        let is_live = |n: &NodeId| *n == me || live(*n);
        let live_majority = s
            .voter_sets()
            .iter()
            .all(|config: &BTreeSet<NodeId>| config.iter().filter(|n| is_live(n)).count() * 2 > config.len());
        let view = LeaderView {
            is_leader: true,
            voters: voters.len(),
            heartbeating_for,
            since_quorum_ack: s.since_quorum_ack(),
            live_majority,
        };
        let matched: BTreeMap<NodeId, Option<LogPosition>> =
            s.matched().map(|r| r.collect()).unwrap_or_default();
        Exam {
            leader_term: Some(s.term()),
            lost: lost(view, timeout),
            successor: successor(me, &voters, &matched),
        }
    })
}

/// What the checker remembers of one group between rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Judgement {
    /// Since when [`Exam::lost`] has held without a break.
    lost_since: Option<Instant>,
    /// The term handed over, and when the transfer was last asked for.
    handed_over: Option<(u64, Instant)>,
}

/// What to do about one group this round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// It leads without a quorum, or is handing over: not a leader for clients.
    pub lost: bool,
    /// Ask the Raft node to transfer leadership to this node now.
    pub transfer_to: Option<NodeId>,
}

/// Timings of the rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timings {
    /// How long [`lost`] must hold on end before a hand-over (`election_timeout_min`).
    pub confirm: Duration,
    /// How often a transfer is asked for again while the term lasts (`election_timeout_max`).
    pub resend: Duration,
}

impl Judgement {
    /// Updates the judgement with this round's `exam` at `now`.
    pub fn judge(&mut self, exam: &Exam, now: Instant, t: Timings) -> Verdict {
        let Some(term) = exam.leader_term else {
            *self = Judgement::default();
            return Verdict { lost: false, transfer_to: None };
        };
        if let Some((handed, last)) = self.handed_over {
            if handed == term {
                // Handing over: stays so until the term ends.
                let again = now.duration_since(last) >= t.resend;
                if again {
                    self.handed_over = Some((term, now));
                }
                return Verdict { lost: true, transfer_to: exam.successor.filter(|_| again) };
            }
            self.handed_over = None;
        }
        if !exam.lost {
            self.lost_since = None;
            return Verdict { lost: false, transfer_to: None };
        }
        let since = *self.lost_since.get_or_insert(now);
        if now.duration_since(since) < t.confirm {
            return Verdict { lost: false, transfer_to: None };
        }
        self.handed_over = Some((term, now));
        Verdict { lost: true, transfer_to: exam.successor }
    }

    /// Forgets how long the quorum has looked lost (after a stall of this
    /// process, when nothing it measured meanwhile can be trusted).
    pub fn restart_confirmation(&mut self) {
        self.lost_since = None;
    }

    /// The term being handed over, if any.
    pub fn handing_over(&self) -> Option<u64> {
        self.handed_over.map(|(term, _)| term)
    }
}

/// What [`run`] works with.
pub struct Checker {
    /// The metadata group's replica here (replaced in place after it
    /// stopped on an error).
    pub metadata: HostedMetadata,
    /// Every hosted group (partitions, and the metadata group, whose ping
    /// answers list the groups led here).
    pub groups: GroupRegistry,
    /// Which brokers answer pings.
    pub liveness: Liveness,
    /// The metadata image, to find the metadata group's voters' brokers.
    pub image: watch::Receiver<Arc<MetadataImage>>,
    /// Rule timings.
    pub timings: Timings,
}

/// Checks the metadata group and every hosted partition whose ticker runs
/// (or that it judged last round) every `period`, forever.
pub async fn run(c: Checker, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut judged: BTreeMap<u64, Judgement> = BTreeMap::new();
    let mut last_round = Instant::now();
    loop {
        tick.tick().await;
        let now = Instant::now();
        let stalled = now.duration_since(last_round) > period * 3;
        last_round = now;
        // Only groups with something to judge or to reset are cloned out
        // of the registry: a parked group not judged before has neither
        // (an idle broker's thousands of groups, every round). A lost
        // verdict is set only here, on a judged group, and reset when the
        // group stops being judged.
        let partitions = c.groups.partitions_matching(|p| p.is_ticking() || judged.contains_key(&p.group));
        judged.retain(|group, j| {
            let keep = *group == METADATA_GROUP || c.groups.contains(*group);
            if !keep && j.handing_over().is_some() {
                // Stopped while handing over: its registry entry goes too.
                c.groups.set_handing_over(*group, None);
            }
            keep
        });
        if stalled {
            judged.values_mut().for_each(Judgement::restart_confirmation);
            continue;
        }
        let m = &c.metadata;
        let raft = m.raft();
        let exam = {
            let image = c.image.borrow();
            let live = |node: NodeId| match image.brokers.iter().find(|(_, b)| b.metadata_node == node) {
                Some((id, _)) => c.liveness.is_alive(*id),
                None => true,
            };
            examine(&raft, m.node(), Some(m.started().elapsed()), live)
        };
        let v = judge(&mut judged, METADATA_GROUP, &exam, now, &c);
        act(&raft, METADATA_GROUP, || "metadata".to_owned(), &exam, v).await;
        for p in partitions {
            // A group whose ticker is parked (every follower, and a quiesced
            // leader) sends no heartbeats: nothing to judge, and [`judge`]
            // would only reset its judgement, which dropping it does without
            // reading the group's Raft state (thousands of idle groups).
            // One handing over is judged as before until its term ends.
            if !p.is_ticking() && judged.get(&p.group).is_none_or(|j| j.handing_over().is_none()) {
                judged.remove(&p.group);
                // Judged again from scratch: not lost (a re-elected leader
                // must not answer NOT_LEADER on an old verdict).
                if p.lost_quorum() {
                    p.set_lost_quorum(false);
                }
                continue;
            }
            let live = |node: NodeId| p.broker_of(node).is_none_or(|b| c.liveness.is_alive(b));
            let exam = examine(&p.raft, p.node_id, p.heartbeating_for(), live);
            let v = judge(&mut judged, p.group, &exam, now, &c);
            p.set_lost_quorum(v.lost);
            act(&p.raft, p.group, || format!("{}-{}", p.topic, p.partition), &exam, v).await;
        }
    }
}

/// [`Judgement::judge`] for `group`, telling the registry when its
/// hand-over starts or ends.
fn judge(
    judged: &mut BTreeMap<u64, Judgement>,
    group: u64,
    exam: &Exam,
    now: Instant,
    c: &Checker,
) -> Verdict {
    let j = judged.entry(group).or_default();
    let before = j.handing_over();
    let v = j.judge(exam, now, c.timings);
    if j.handing_over() != before {
        c.groups.set_handing_over(group, j.handing_over());
    }
    v
}

async fn act(raft: &RaftNode, group: u64, name: impl FnOnce() -> String, exam: &Exam, v: Verdict) {
    let Some(to) = v.transfer_to else { return };
    tracing::warn!(
        group,
        name = name(),
        term = exam.leader_term,
        to,
        "leader has not heard from a quorum for an election timeout: handing leadership over"
    );
    raft.transfer_leader(to).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);
    const HEALTHY: LeaderView = LeaderView {
        is_leader: true,
        voters: 3,
        heartbeating_for: Some(Duration::from_secs(10)),
        since_quorum_ack: Some(Duration::from_millis(150)),
        live_majority: true,
    };

    #[test]
    fn only_a_heartbeating_leader_without_acks_or_live_majority_looks_lost() {
        let stale = LeaderView {
            since_quorum_ack: Some(Duration::from_millis(1500)),
            live_majority: false,
            ..HEALTHY
        };
        assert!(!lost(HEALTHY, SEC));
        assert!(lost(stale, SEC));
        // Slow acknowledgements but a majority of brokers answering pings:
        // heartbeats time out on a long round trip, the quorum is there.
        assert!(!lost(LeaderView { live_majority: true, ..stale }, SEC));
        // Not a leader, or its own quorum.
        assert!(!lost(LeaderView { is_leader: false, ..stale }, SEC));
        assert!(!lost(LeaderView { voters: 1, ..stale }, SEC));
        // A parked (quiesced) leader sends no heartbeats, so silence means nothing.
        assert!(!lost(LeaderView { heartbeating_for: None, ..stale }, SEC));
        // Just unparked: give the heartbeats a timeout to be answered.
        assert!(!lost(LeaderView { heartbeating_for: Some(Duration::from_millis(300)), ..stale }, SEC));
        // Never acknowledged: not judged.
        assert!(!lost(LeaderView { since_quorum_ack: None, ..stale }, SEC));
    }

    #[test]
    fn the_successor_is_the_most_caught_up_follower() {
        let log = |term: u64, index: u64| Some(LogPosition { term, index });
        let matched: BTreeMap<NodeId, Option<LogPosition>> =
            [(2, log(3, 10)), (3, log(3, 12)), (4, None)].into();
        assert_eq!(successor(1, &[1, 2, 3, 4], &matched), Some(3));
        let tied: BTreeMap<NodeId, Option<LogPosition>> = [(2, log(3, 12)), (3, log(3, 12))].into();
        assert_eq!(successor(1, &[1, 2, 3], &tied), Some(2));
        assert_eq!(successor(1, &[1], &matched), None);
        // A voter with no replication progress yet is still a candidate.
        assert_eq!(successor(1, &[1, 5], &BTreeMap::new()), Some(5));
    }

    #[test]
    fn a_lost_quorum_is_confirmed_then_handed_over_for_the_rest_of_the_term() {
        let t = Timings { confirm: Duration::from_millis(500), resend: SEC };
        let ms = |n: u64| Duration::from_millis(n);
        let t0 = Instant::now();
        let exam = |term: Option<u64>, lost: bool| Exam { leader_term: term, lost, successor: Some(2) };
        let quiet = Verdict { lost: false, transfer_to: None };
        let mut j = Judgement::default();
        assert_eq!(j.judge(&exam(Some(5), false), t0, t), quiet);
        // Lost, but not yet for `confirm`; a healthy round in between restarts the count.
        assert_eq!(j.judge(&exam(Some(5), true), t0 + ms(100), t), quiet);
        assert_eq!(j.judge(&exam(Some(5), false), t0 + ms(200), t), quiet);
        assert_eq!(j.judge(&exam(Some(5), true), t0 + ms(300), t), quiet);
        assert_eq!(j.judge(&exam(Some(5), true), t0 + ms(700), t), quiet);
        // Confirmed: hand over.
        let handed = Verdict { lost: true, transfer_to: Some(2) };
        assert_eq!(j.judge(&exam(Some(5), true), t0 + ms(800), t), handed);
        assert_eq!(j.handing_over(), Some(5));
        // The rest of the term stays lost, even when the quorum looks back (the
        // transfer stopped the heartbeats); the transfer is asked for again later.
        let holding = Verdict { lost: true, transfer_to: None };
        assert_eq!(j.judge(&exam(Some(5), false), t0 + ms(900), t), holding);
        assert_eq!(j.judge(&exam(Some(5), false), t0 + ms(1800), t), handed);
        assert_eq!(j.judge(&exam(Some(5), false), t0 + ms(1900), t), holding);
        // A new term (or no longer leading) ends it.
        assert_eq!(j.judge(&exam(Some(7), false), t0 + ms(2000), t), quiet);
        assert_eq!(j.handing_over(), None);
        assert_eq!(j.judge(&exam(Some(7), true), t0 + ms(2100), t), quiet);
        assert_eq!(j.judge(&exam(None, false), t0 + ms(2200), t), quiet);
        assert_eq!(j, Judgement::default());
        // A stall restarts the confirmation.
        j.judge(&exam(Some(8), true), t0 + ms(3000), t);
        j.restart_confirmation();
        assert_eq!(j.judge(&exam(Some(8), true), t0 + ms(3600), t), quiet);
    }
}

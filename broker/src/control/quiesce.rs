//! Quiescing idle partitions and scheduling elections, so a broker hosting
//! thousands of Raft groups spends its CPU neither on idle heartbeats (as
//! CockroachDB quiesces ranges) nor on election storms.
//!
//! With the Raft library's per-group ticker, 1,000 idle groups at a 100 ms heartbeat
//! keep two cores busy. Instead, failure detection is done once per broker
//! pair ([`crate::control::liveness`]), and each group's ticker (which drives a
//! leader's heartbeats) runs only while it is needed:
//!
//! - a **leader** ticks while it wrote within [`ACTIVE_AFTER_WRITE`], or while a
//!   follower whose broker is alive and has the group open has not matched
//!   its log yet. Otherwise it parks its ticker; while a follower's broker
//!   came back (restarted) and that follower has not acknowledged a
//!   heartbeat since, a parked leader sends one heartbeat round every
//!   [`RECHECK_EVERY`] ([`Decision::Heartbeat`]): the answer tells the
//!   leader where the follower's log really ends, so one that lost its tail
//!   is caught up (and the leader ticks) without waiting for the next write.
//! - a **follower** never ticks: the node's own election timer is switched
//!   off for partition groups (`RaftNode::set_elections(false)`) and this module
//!   decides every election. A follower stays quiet while it presumes a
//!   live leader ([`presumed_leader`]): some live broker says it leads the
//!   group (its own idea of the leader, or, after a restart when it knows
//!   none yet, any replica's broker that claims it), or the leader it has
//!   just learned of has not had [`ANNOUNCE_GRACE`] to say so in its pings.
//!   Such a follower also refuses other candidates' pre-votes.
//!
//! When no live leader is left, one replica campaigns (with pre-vote, so a
//! leader still healthy for a quorum is not disrupted): the first live
//! replica in assignment order (the preferred leader first; [`first_live`]
//! passes over the leader the replica remembers) at once, any
//! other live replica only after [`FALLBACK_AFTER`], longer while its
//! broker has many campaigns due ([`fallback_after`]), and once the first
//! one's broker has won no group for [`FALLBACK_AFTER`] ([`Awaited`]; at
//! most [`FALLBACK_MAX`]) (for when the first cannot win, e.g. its log is
//! shorter). Campaigns are spread out: each
//! group waits a randomised back-off that doubles with each campaign that
//! did not make it leader (up to [`BACKOFF_MAX`]); a broker starts at most
//! [`CAMPAIGNS_PER_ROUND`] per round and keeps at most
//! [`CAMPAIGNS_IN_FLIGHT`] unresolved, so a broker's restart among
//! thousands of partitions costs one election per partition it led,
//! batched, instead of a storm of timed-out votes. First
//! replicas' campaigns go before fallbacks, which get what is left of the
//! budget ([`admit`]): when thousands of groups elect at once, the budget's
//! own delay would otherwise make every group's other replicas campaign as
//! often as its first, splitting each other's votes.
//! Nothing is concluded from silence until every broker has had time to
//! answer a ping ([`Liveness::settled`]), and a replica campaigns only once
//! a majority of its group's replicas have the group open, as their pings
//! say ([`Liveness::has_open`]; at most [`OPEN_WAIT_MAX`]): when thousands
//! of partitions are created, a campaign sent before the voters had opened
//! the group would fail and hold the budget through its back-off.
//!
//! Safety does not depend on this: it only decides when the nodes' timers
//! run and when elections start; votes and commits are Raft's (§5.2, §5.4).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

use ferrolog_replica::NodeId;
use tracing::Instrument;

use crate::config::BrokerId;
use crate::control::liveness::Liveness;
use crate::metadata::command::ReplicaAssignment;
use crate::partition::Partition;

/// How long a leader keeps ticking after its last write, so followers learn
/// the final commit index from heartbeats.
pub const ACTIVE_AFTER_WRITE: Duration = Duration::from_secs(2);

/// How long a replica that is not the first live one waits, without a live
/// leader, before it campaigns too.
pub const FALLBACK_AFTER: Duration = Duration::from_secs(5);

/// How long a fallback waits, without a live leader, when this broker has
/// `backlog` campaigns due (the last round's count): [`FALLBACK_AFTER`],
/// plus the time this broker's budget ([`CAMPAIGNS_PER_ROUND`] per `period`)
/// takes to start that many. The first live replica, on a broker with a
/// similar backlog, may only be waiting for its own budget: when thousands
/// of groups elect at once (a topic of thousands of partitions created, a
/// broker leading thousands restarted), fallbacks after a fixed 5 s
/// collided with the first replicas' campaigns (every founding member can
/// campaign) and split their votes, and the failed campaigns and their
/// retries kept the CPU saturated.
pub fn fallback_after(backlog: usize, period: Duration) -> Duration {
    let rounds = backlog.div_ceil(CAMPAIGNS_PER_ROUND) as u32;
    FALLBACK_AFTER + period.saturating_mul(rounds)
}

/// How long a replica that is not the first live one waits for the first
/// one's broker to stop winning groups ([`Awaited`]), at most, counted from
/// when it found no live leader: a first replica that cannot win this
/// group (its log is behind, it is recovering) may be winning others. (Its
/// own broker's backlog, [`fallback_after`], may still hold it longer.)
pub const FALLBACK_MAX: Duration = Duration::from_secs(30);

/// Longest back-off between two campaigns of one group.
pub const BACKOFF_MAX: Duration = Duration::from_secs(8);

/// Most campaigns a broker starts per round (a round is one heartbeat
/// interval, 100 ms by default: 320 per second).
pub const CAMPAIGNS_PER_ROUND: usize = 32;

/// Most campaigns a broker keeps unresolved (see [`Campaign`]: started,
/// not leader, back-off not over).
pub const CAMPAIGNS_IN_FLIGHT: usize = 256;

/// How long [`run`] lets one campaign take to be sent, at most: waking a
/// dormant node waits up to 5 s for it to start (`ferrolog_replica`'s
/// lifecycle), then the Raft core takes the command.
pub const CAMPAIGN_SEND_MAX: Duration = Duration::from_secs(10);

/// How long a leaderless replica waits, at most, for a majority of its
/// group's replicas to have the group open (as their pings say,
/// [`Liveness::has_open`]) before it campaigns anyway.
pub const OPEN_WAIT_MAX: Duration = Duration::from_secs(30);

/// How long a leader wakes for a follower whose broker came back, at most,
/// if that follower never acknowledges a heartbeat.
pub const RETURN_WINDOW: Duration = Duration::from_secs(30);

/// How long a replica that has just learned its group's leader (from the
/// leader's own messages) takes it for alive while the leader's broker
/// answers pings without saying so yet: a broker announces what it leads
/// about [`crate::groups::LEADERSHIP_COALESCE`] after it won, in the
/// answer to the next ping (100 ms apart by default), later when it is
/// loaded; this is a guess, not a bound. Without it a
/// follower that had just accepted a new leader's entries could count the
/// group leaderless and campaign against it (at 10,000 partitions, two
/// replicas of 2,906 groups took turns campaigning, some groups ten times
/// or more, which this and the pre-vote rule in
/// `crate::network::server` are meant to prevent).
pub const ANNOUNCE_GRACE: Duration = Duration::from_secs(1);

/// Now, ms since the campaigns' clocks' origin
/// ([`ferrolog_raft_store::runtime::monotonic_ms`]: one for the process, so
/// a round of [`run`] reads the clock once, not once per group; a
/// simulation's own), at least 1: 0 means "never" below.
fn now_ms() -> u64 {
    ferrolog_raft_store::runtime::monotonic_ms().max(1)
}

/// One group's election bookkeeping on this replica.
#[derive(Debug)]
pub struct Campaign {
    /// Campaigns since this replica last knew a live leader.
    attempts: AtomicU32,
    /// No campaign before this, ms on [`now_ms`]'s clock (0 until one is started).
    not_before_ms: AtomicU64,
    /// Since when this replica has known no live leader, ms on [`now_ms`]'s clock
    /// (0: it knows one).
    leaderless_since_ms: AtomicU64,
    /// Whether this replica may campaign at all (`crate::control::recovery` clears it
    /// while a recovering replica's log may be behind what was acknowledged).
    allowed: AtomicBool,
    /// The last look at the group decided to campaign, and none was
    /// started (the broker's budget was spent).
    waiting: AtomicBool,
    /// The leader this replica knows (its node id and term), and since
    /// when.
    known_leader: Mutex<Option<((NodeId, u64), Instant)>>,
    /// Since when this replica has presumed its founding leader alive only
    /// because that leader's broker had not opened the group yet, ms on
    /// [`now_ms`]'s clock (0: never). Bounded by [`OPEN_WAIT_MAX`].
    founder_wait_since_ms: AtomicU64,
    /// Leader: no heartbeat round for a returned follower
    /// ([`Decision::Heartbeat`]) before this, ms on [`now_ms`]'s clock.
    heartbeat_after_ms: AtomicU64,
}

impl Default for Campaign {
    fn default() -> Self {
        Self {
            attempts: AtomicU32::new(0),
            not_before_ms: AtomicU64::new(0),
            leaderless_since_ms: AtomicU64::new(0),
            allowed: AtomicBool::new(true),
            waiting: AtomicBool::new(false),
            known_leader: Mutex::new(None),
            founder_wait_since_ms: AtomicU64::new(0),
            heartbeat_after_ms: AtomicU64::new(0),
        }
    }
}

impl Campaign {
    /// Allows or forbids campaigning (see `crate::control::recovery`).
    pub fn set_allowed(&self, allowed: bool) {
        self.allowed.store(allowed, Ordering::Relaxed);
    }

    /// Whether campaigning is allowed.
    pub fn allowed(&self) -> bool {
        self.allowed.load(Ordering::Relaxed)
    }

    /// Records that this replica knows `leader` (node id, term) as its
    /// group's leader now (`None`: none); returns since when it has known
    /// that one. A node that leads again in a later term is a new leader
    /// here: its broker needs the time to announce it again.
    pub fn leader_known_since(&self, leader: Option<(NodeId, u64)>) -> Option<Instant> {
        let mut known = self.known_leader.lock().unwrap_or_else(|p| p.into_inner());
        match (leader, *known) {
            (None, _) => {
                *known = None;
                None
            }
            (Some(n), Some((k, since))) if k == n => Some(since),
            (Some(n), _) => {
                let now = Instant::now();
                *known = Some((n, now));
                Some(now)
            }
        }
    }

    /// How long this replica has waited for its founding leader's broker
    /// to open the group, since it first did (see [`presumed_leader`]).
    fn waited_for_founder(&self) -> Duration {
        let now = now_ms();
        let since =
            match self.founder_wait_since_ms.compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => now,
                Err(t) => t,
            };
        Duration::from_millis(now.saturating_sub(since))
    }

    /// Restarts the time since which the leader it knows has been known
    /// (see [`presumed_leader`]): its broker could not announce it yet.
    pub fn leader_seen_now(&self) {
        let mut known = self.known_leader.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, since)) = known.as_mut() {
            *since = Instant::now();
        }
    }

    /// Records that a live leader is known (or this replica leads).
    fn led(&self) {
        self.attempts.store(0, Ordering::Relaxed);
        self.leaderless_since_ms.store(0, Ordering::Relaxed);
        self.not_before_ms.store(0, Ordering::Relaxed);
    }

    /// Records that no live leader is known; returns for how long.
    fn leaderless(&self) -> Duration {
        let now = now_ms();
        let since =
            match self.leaderless_since_ms.compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => now,
                Err(t) => t,
            };
        Duration::from_millis(now.saturating_sub(since))
    }

    /// Whether the back-off since the last campaign has passed at `now`
    /// (ms on [`now_ms`]'s clock).
    fn due(&self, now: u64) -> bool {
        now >= self.not_before_ms.load(Ordering::Relaxed)
    }

    /// Whether a campaign was started and its back-off has not passed yet
    /// at `now` (it may still win, or it failed and waits). [`run`] keeps
    /// its own record of these to count them against the broker's
    /// [`CAMPAIGNS_IN_FLIGHT`] without looking at each group.
    fn in_flight(&self, now: u64) -> bool {
        !self.due(now)
    }

    /// Whether a heartbeat round for a returned follower is due at `now`
    /// (ms on [`now_ms`]'s clock); if so, the next is due [`RECHECK_EVERY`]
    /// later. A group is looked at whenever its node's state changes, and
    /// a heartbeat round and each answer change it: without this, rounds
    /// followed each other every few hundred ms, not once a second.
    fn heartbeat_due(&self, now: u64) -> bool {
        let after = self.heartbeat_after_ms.load(Ordering::Relaxed);
        if now < after {
            return false;
        }
        self.heartbeat_after_ms.store(now + RECHECK_EVERY.as_millis() as u64, Ordering::Relaxed);
        true
    }

    /// Pushes the end of the back-off of a campaign started earlier to
    /// `until` (ms on [`now_ms`]'s clock), once it was sent (it first waited
    /// for its node to wake); not if a live leader was known meanwhile
    /// ([`Campaign::led`] cleared it). Returns whether it did.
    fn not_before(&self, until: u64) -> bool {
        self.not_before_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| (t != 0).then_some(t.max(until)))
            .is_ok()
    }

    /// Records a campaign started now; the next one waits a randomised
    /// back-off of `base` × 2^attempts (capped at [`BACKOFF_MAX`]), between
    /// half and all of it.
    /// Returns the end of that back-off, ms on [`now_ms`]'s clock.
    fn started(&self, base: Duration) -> u64 {
        let now = now_ms();
        self.waiting.store(false, Ordering::Relaxed);
        let attempts = self.attempts.fetch_add(1, Ordering::Relaxed);
        let full = base.saturating_mul(1 << attempts.min(8)).min(BACKOFF_MAX).as_millis() as u64;
        let wait = full / 2 + jitter(full / 2 + 1);
        self.not_before_ms.store(now + wait, Ordering::Relaxed);
        now + wait
    }
}

/// A pseudo-random number below `n` (back-off jitter only).
fn jitter(n: u64) -> u64 {
    ferrolog_raft_store::runtime::random_u64() % n.max(1)
}

/// What a group should do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run the ticker (a leader's heartbeats).
    Tick,
    /// Park the ticker and send one heartbeat round, at most one per
    /// [`RECHECK_EVERY`] (`Campaign::heartbeat_due`), for a leader whose
    /// follower's broker came back. Ticking instead, every leader of a
    /// restarted broker's followers sent ten heartbeats a second until the
    /// follower answered one: at 10,000 partitions, 6,667 leaders kept the
    /// restarted broker too busy to answer, 1.3 million heartbeats timed
    /// out in a minute, and the election votes it was asked for timed out
    /// with them (measured 2026-12-02: every partition led again 49.1 s
    /// after the restart, 11.0 s without that ticking).
    Heartbeat,
    /// Park it.
    Park,
    /// Start a campaign (pre-vote, then vote), if the back-off and the
    /// broker's budget allow.
    Campaign,
}

/// Inputs of the decision for one group, all read from local state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupView {
    /// This replica leads.
    pub is_leader: bool,
    /// A write was proposed within [`ACTIVE_AFTER_WRITE`].
    pub recently_written: bool,
    /// Leader: every follower matched the last log index, except those
    /// whose broker is alive but has not opened the group yet (as its
    /// pings say; see `followers_opening`). A follower on a dead broker
    /// counts: it keeps the leader ticking, for CheckQuorum.
    pub followers_caught_up: bool,
    /// Leader: a follower's broker came back and that follower has not
    /// acknowledged a heartbeat since.
    pub follower_returned: bool,
    /// Follower: it presumes a live leader ([`presumed_leader`]).
    pub leader_alive: bool,
    /// Follower: the leader it presumes says so in its pings (it is not
    /// presumed only for a while: [`ANNOUNCE_GRACE`], [`OPEN_WAIT_MAX`]).
    pub leader_announced: bool,
    /// Leader: a follower that has not matched its log is left out of
    /// `followers_caught_up` only because its broker, alive, has not
    /// opened the group yet (its pings will say when it has).
    pub followers_opening: bool,
    /// Follower: this is the first live replica ([`first_live`]: in
    /// assignment order, whose broker has opened its replicas, passing over
    /// the leader it remembers); it campaigns when the leader dies.
    pub first_live_follower: bool,
    /// Follower without a live leader: the broker of the first live
    /// replica ([`first_live`]) when that is another, whose campaign this
    /// one waits for.
    pub awaited: Option<BrokerId>,
    /// How long the `awaited` broker has won no group ([`Awaited`]);
    /// `Duration::MAX` when none is awaited.
    pub awaited_idle_for: Duration,
    /// Follower: how long it has known no live leader.
    pub leaderless_for: Duration,
    /// Follower that is not the first live replica: how long without a
    /// live leader before it campaigns too ([`fallback_after`]).
    pub fallback_after: Duration,
    /// Every broker has had time to answer a ping ([`Liveness::settled`]).
    pub settled: bool,
    /// Campaigning is allowed ([`Campaign::allowed`]) and possible: the
    /// group has a configuration here (a replica without one waits for its
    /// leader's entries: its campaigns would do nothing but hold the
    /// broker's budget).
    pub may_campaign: bool,
    /// Follower: a majority of the group's replicas have it open (this one
    /// and those whose brokers' pings say so, [`Liveness::has_open`]), so
    /// they can vote.
    pub majority_open: bool,
}

/// The quiescence and election rule, a pure function.
pub fn decide(v: GroupView) -> Decision {
    if v.is_leader {
        return if v.recently_written || !v.followers_caught_up {
            Decision::Tick
        } else if v.follower_returned {
            Decision::Heartbeat
        } else {
            Decision::Park
        };
    }
    if v.leader_alive || !v.settled || !v.may_campaign {
        return Decision::Park;
    }
    // A campaign before the voters have opened the group fails, and its
    // back-off doubles (thousands of partitions just created).
    if !v.majority_open && v.leaderless_for < OPEN_WAIT_MAX {
        return Decision::Park;
    }
    let first_stalled = v.leaderless_for >= v.fallback_after
        && (v.awaited_idle_for >= FALLBACK_AFTER || v.leaderless_for >= FALLBACK_MAX);
    if v.first_live_follower || first_stalled { Decision::Campaign } else { Decision::Park }
}

/// A replica's idea of its group's leader, as [`presumed_leader`] reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KnownLeader {
    /// The leader's node id and term (learned from the leader's messages,
    /// or from the founding vote).
    pub leader: Option<(NodeId, u64)>,
    /// The group is as founded: the leader is the founding leader of term
    /// `FOUNDING_TERM` and this replica's log holds only the founding
    /// entry, so that leader may not have started yet.
    pub founding: bool,
    /// The node id of the leader that appended the last entry this replica
    /// applied.
    pub last_applied_by: Option<NodeId>,
}

impl KnownLeader {
    /// Reads it from a node's state.
    pub fn of(s: &ferrolog_replica::State<'_>) -> Self {
        let leader = s.leader().map(|n| (n, s.term()));
        let founding = leader.is_some_and(|(_, t)| t == ferrolog_raft_store::FOUNDING_TERM)
            && s.last_log_index() == Some(0);
        let last_applied_by = s.last_applied_leadership().map(|(_, n)| n);
        KnownLeader { leader, founding, last_applied_by }
    }

    /// The leader this replica remembers, even when it knows none now: the
    /// one it knows, else the one that appended the last entry it applied.
    /// A leader that restarts knows none (the library demotes its own
    /// committed vote at start), but its last applied entry is its own,
    /// usually: the blank entry it appended when it won, or a later write.
    pub fn remembered(&self) -> Option<NodeId> {
        self.leader.map(|(n, _)| n).or(self.last_applied_by)
    }
}

/// The broker this replica takes for the live leader of its group, other
/// than its own: one whose pings say it leads the group, or the leader this
/// replica knows (`current_leader`: node id and term, learned from the
/// leader's messages)
/// while its broker answers pings and has not had [`ANNOUNCE_GRACE`] to
/// say so. A follower with a presumed leader does not campaign, and refuses
/// others' pre-votes (`crate::network::server`): a quiet leader sends no
/// heartbeats, so its followers' leader leases lapse and the Raft node's
/// own pre-vote check would let any candidate depose it; the pings stand
/// in for the heartbeats (Raft thesis §4.2.3, disruptive servers; §9.6).
///
/// A group founded with a leader (`Replica::found`) knows it from its
/// first start; while that leader's broker, alive, has not opened the
/// group yet (as its pings say), it is presumed alive too, for
/// [`OPEN_WAIT_MAX`] at most.
pub fn presumed_leader(
    p: &Partition,
    liveness: &Liveness,
    me: BrokerId,
    known: KnownLeader,
) -> Option<BrokerId> {
    let current_leader = known.leader;
    let learned = p.campaign.leader_known_since(current_leader);
    let own_idea = current_leader.and_then(|(n, _)| p.broker_of(n)).filter(|b| *b != me);
    if let (Some(b), Some(learned)) = (own_idea, learned) {
        // A founding leader whose live broker has not opened the group yet
        // (brokers open thousands of new replicas each at its own pace)
        // cannot have announced it: its grace starts once it has; for
        // [`OPEN_WAIT_MAX`] at most (an open stuck on its disk).
        if known.founding
            && liveness.is_alive(b)
            && !liveness.has_open(b, p.group)
            && p.campaign.waited_for_founder() < OPEN_WAIT_MAX
        {
            p.campaign.leader_seen_now();
            return Some(b);
        }
        let announced = liveness.leads(b, p.group);
        let not_yet_denied =
            liveness.is_alive(b) && !liveness.denies_leading(b, p.group, learned + ANNOUNCE_GRACE);
        if announced || not_yet_denied {
            return Some(b);
        }
    }
    p.replicas().iter().map(|r| r.broker).find(|b| *b != me && liveness.leads(*b, p.group))
}

fn view(
    p: &Partition,
    liveness: &Liveness,
    me: u32,
    fallback_after: Duration,
    idle_for: impl Fn(BrokerId) -> Duration,
) -> GroupView {
    // Borrowed, not cloned: this runs for thousands of groups in a round,
    // and a clone of the metrics (maps of replication and heartbeat
    // progress, the membership) was most of an idle broker's CPU.
    let (is_leader, followers_caught_up, followers_opening, follower_returned, known, configured) =
        p.raft.state(|s| {
            let is_leader = s.is_leader();
            let last = s.last_log_index();
            // A follower whose broker is alive but has not opened the group yet
            // cannot take heartbeats: the leader does not tick for it. When
            // thousands of partitions are created, every founding leader would
            // otherwise heartbeat, ten times a second, followers still being
            // opened, and the failed heartbeats saturated the brokers. The next
            // look after its broker's pings say it has the group open
            // ([`Rest::For`]) wakes the leader. A follower whose broker
            // is dead still keeps the leader ticking: CheckQuorum judges only a
            // heartbeating leader (`crate::control::checkquorum`).
            let opening = |node: NodeId| {
                p.broker_of(node)
                    .is_some_and(|b| b != me && liveness.is_alive(b) && !liveness.has_open(b, p.group))
            };
            let (followers_caught_up, followers_opening) = match s.matched() {
                None => (false, false),
                Some(r) => r.fold((true, false), |(caught_up, waiting), (node, matched)| {
                    if matched.map(|l| l.index) == last {
                        (caught_up, waiting)
                    } else if opening(node) {
                        (caught_up, true)
                    } else {
                        (false, waiting)
                    }
                }),
            };
            let follower_returned = is_leader
                && s.acknowledged_ago().is_some_and(|mut acks| {
                    acks.any(|(node, acked_ago)| {
                        if node == p.node_id {
                            return false;
                        }
                        let Some(back) = p.broker_of(node).and_then(|b| liveness.returned_at(b)) else {
                            return false;
                        };
                        // Acknowledged after it came back: acknowledged more recently.
                        back.elapsed() < RETURN_WINDOW && acked_ago.is_none_or(|ago| ago >= back.elapsed())
                    })
                });
            (
                is_leader,
                followers_caught_up,
                is_leader && followers_opening,
                follower_returned,
                KnownLeader::of(&s),
                s.has_membership(),
            )
        });
    let presumed = if is_leader { None } else { presumed_leader(p, liveness, me, known) };
    let leader_alive = presumed.is_some();
    let leader_announced = presumed.is_some_and(|b| liveness.leads(b, p.group));
    if is_leader || leader_alive {
        p.campaign.led();
    }
    // Only looked at without a leader (this runs for every group).
    let (first_live_follower, awaited, majority_open, leaderless_for) = if is_leader || leader_alive {
        (false, None, true, Duration::ZERO)
    } else {
        // Ready: done opening its replicas (not whether a broker has this
        // group open yet, which each broker learns from the pings at its
        // own time: replicas would disagree on which is first and both
        // campaign).
        let replicas = p.electable_replicas();
        let remembered = known.remembered().and_then(|n| p.broker_of(n));
        // A broker in a controlled shutdown is passed over: it will not
        // campaign (see `run`).
        let first = first_live(&replicas, remembered, |b| {
            b == me || (liveness.is_ready(b) && liveness.takes_leadership(b))
        });
        let awaited = first.filter(|r| r.node != p.node_id).map(|r| r.broker);
        // A candidate whose log was found behind this replica's cannot win
        // with its vote (in a group with one voter down, cannot win at
        // all): the first live replica after it goes first, without
        // waiting out the fallback delay for it (which left the group
        // without a leader for 5 s). Every replica that refused it names
        // the same one.
        let outran = p.outran_candidate_within(FALLBACK_AFTER);
        let after_outran = outran.and_then(|c| {
            let ready = |b: u32| b == me || (liveness.is_ready(b) && liveness.takes_leadership(b));
            replicas.iter().find(|r| r.node != c && ready(r.broker))
        });
        let first =
            first.is_some_and(|r| r.node == p.node_id) || after_outran.is_some_and(|r| r.node == p.node_id);
        let open = |b: u32| b == me || (liveness.is_ready(b) && liveness.has_open(b, p.group));
        let majority = replicas.iter().filter(|r| open(r.broker)).count() > replicas.len() / 2;
        (first, awaited, majority, p.campaign.leaderless())
    };
    let awaited_idle_for = awaited.map_or(Duration::MAX, idle_for);
    GroupView {
        is_leader,
        recently_written: p.written_within(ACTIVE_AFTER_WRITE),
        followers_caught_up,
        follower_returned,
        leader_alive,
        leader_announced,
        followers_opening,
        first_live_follower,
        awaited,
        awaited_idle_for,
        leaderless_for,
        fallback_after,
        settled: liveness.settled(),
        may_campaign: p.campaign.allowed() && configured,
        majority_open,
    }
}

/// The replica that campaigns at once when its group has no live leader
/// (the others wait [`fallback_after`]): the first in assignment order (the
/// preferred leader first) whose broker is `ready` (alive and done opening
/// its replicas after a start), passing over the broker of the leader the
/// asking replica remembers (`remembered`), unless no other is ready.
///
/// Every replica must name the same one, or two campaign at once and split
/// the votes. The remembered leader is passed over whether it is another
/// broker (it died: its followers move on to the next replica) or the
/// asking broker itself: a leader that restarts remembers its own
/// leadership ([`KnownLeader::remembered`]), and if it took back first
/// place once it had opened its replicas, it campaigned against the next
/// replica, which its followers had already moved on to (measured 2026-12-02 on one broker's restart among 5,000
/// partitions: 798 of 2,098 campaigns were such collisions).
pub fn first_live(
    replicas: &[ReplicaAssignment],
    remembered: Option<BrokerId>,
    ready: impl Fn(BrokerId) -> bool,
) -> Option<&ReplicaAssignment> {
    let mut fallback = None;
    for r in replicas.iter().filter(|r| ready(r.broker)) {
        if Some(r.broker) != remembered {
            return Some(r);
        }
        fallback.get_or_insert(r);
    }
    fallback
}

/// How long after a replica last heard from its leader it waits, beyond
/// the lease (one maximum election timeout), before campaigning: the other
/// voters heard from the leader a little later or earlier.
pub const LEASE_MARGIN: Duration = Duration::from_millis(50);

/// How often every hosted group is looked at even when nothing stirred
/// it (see [`run`]): a backstop, not how the rule is kept.
pub const FULL_ROUND_EVERY: Duration = Duration::from_secs(10);

/// How often a group whose decision can change with time alone is looked
/// at again ([`Rest::For`]).
pub const RECHECK_EVERY: Duration = Duration::from_secs(1);

/// Until when a group need not be looked at again, after a decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rest {
    /// Every round: it is leaderless (campaigning, waiting for its
    /// campaign to resolve or for the broker's campaign budget), or a
    /// leader written recently or catching a follower up.
    Awake,
    /// Until something stirs it: its Raft node's state changes (a write,
    /// a follower's progress, a new role or leader:
    /// [`GroupRegistry::take_stirred`](crate::groups::GroupRegistry::take_stirred)),
    /// a broker begins or stops leading it ([`Liveness::take_stirred`]), or
    /// what the pings say about brokers changes ([`Liveness::changes`]).
    /// A parked leader, or a parked follower whose leader announces itself.
    UntilStirred,
    /// For a while: its decision can change with time alone, and the
    /// pings' next word is not counted as a change (a leader presumed
    /// only within [`ANNOUNCE_GRACE`] or [`OPEN_WAIT_MAX`]; a leader
    /// waiting for a follower's broker to open the group; a leader sending
    /// heartbeat rounds to a returned follower, [`Decision::Heartbeat`]).
    For(Duration),
}

/// How long a group decided as `decision` may rest ([`Rest`]).
pub fn rest(v: &GroupView, decision: Decision) -> Rest {
    match decision {
        Decision::Heartbeat => Rest::For(RECHECK_EVERY),
        Decision::Park if v.is_leader && v.followers_opening => Rest::For(RECHECK_EVERY),
        Decision::Park if v.is_leader => Rest::UntilStirred,
        Decision::Park if v.leader_alive && v.leader_announced => Rest::UntilStirred,
        Decision::Park if v.leader_alive => Rest::For(RECHECK_EVERY),
        _ => Rest::Awake,
    }
}

/// Applies [`decide`] to the hosted partitions every `period`, forever.
/// `election_timeout` is the base of the campaigns' back-off.
///
/// An idle cluster's groups are nearly all at rest, and looking at each
/// one every round costs a cache miss or two per group: 1,000 groups at
/// 100 ms made this the largest part of an idle broker's CPU, and at
/// 10,000 a once-a-second look at every group (and listing them every
/// round) was still over a third of it.
/// So a round looks only at the groups that are awake, whose rest ended,
/// or that something stirred ([`Rest`]); every group only when what the
/// pings say about brokers changes, and every [`FULL_ROUND_EVERY`].
pub async fn run(
    me: u32,
    groups: crate::groups::GroupRegistry,
    liveness: Liveness,
    period: Duration,
    election_timeout: Duration,
) {
    let mut tick = tokio::time::interval(period);
    // Rounds stay on their grid: a round that starts late (its task woken
    // late on a busy runtime) does not push every later one back. With
    // tokio's `Delay`, a wake-up more than 5 ms late set the next round a
    // whole period after it, so under the load of thousands of elections
    // rounds came every 110-140 ms and the campaign budget, counted per
    // round, shrank just when it was needed: one broker's restart among
    // 10,000 partitions ran at 273 elections a second, 5,000 at 292
    // (budget 320), and the time grew faster than the partitions. With
    // `Skip` each slot of the grid has at most one round: a late round may
    // be followed closely by the next (two budgets within a few ms), but
    // a round missed altogether is not made up, so the budget holds per
    // period on average.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut schedule = Schedule::default();
    // The groups whose campaign was started here, and when its back-off
    // ends (ms on now_ms's clock): at most CAMPAIGNS_IN_FLIGHT unresolved.
    let mut backing_off: BTreeMap<u64, u64> = BTreeMap::new();
    // Campaigns being sent, each on a task of its own (a campaign may first
    // wake a dormant node), by task: unresolved until sent, and their
    // back-off counted from then. Dropped with this loop, which aborts the
    // ones not sent yet (a broker stopping sends none).
    // Each task answers when it sent its campaign (ms on now_ms's clock).
    let mut sending: tokio::task::JoinSet<u64> = tokio::task::JoinSet::new();
    let mut sending_groups: BTreeMap<tokio::task::Id, (u64, u64)> = BTreeMap::new();
    let mut changes = None;
    let mut full_at = Instant::now();
    // Fallbacks wait longer while this broker has many campaigns due.
    let mut fallback_wait = FALLBACK_AFTER;
    let mut awaited = Awaited::default();
    loop {
        tick.tick().await;
        let now_changes = liveness.changes();
        let full = changes != Some(now_changes) || full_at.elapsed() >= FULL_ROUND_EVERY;
        let mut look = groups.take_stirred();
        look.extend(liveness.take_stirred());
        if full {
            changes = Some(now_changes);
            full_at = Instant::now();
            schedule.clear();
        }
        // One clock read for the round. While thousands of groups elect at
        // once, looking at every one each round (a clock read and a few
        // cache misses each, twice) was a quarter of a broker's CPU at
        // 10,000 partitions.
        let now = now_ms();
        // Campaigns sent since the last round: their back-off runs from
        // when each was sent (a slow wake must not let it end before, and a
        // second campaign of the group follow the first at once).
        while let Some(done) = sending.try_join_next_with_id() {
            let (id, sent) = match done {
                Ok((id, sent)) => (id, sent),
                Err(e) => {
                    if e.is_panic() {
                        tracing::error!("a campaign's task panicked: {e}");
                    }
                    (e.id(), now)
                }
            };
            if let Some((group, wait)) = sending_groups.remove(&id) {
                let until = sent + wait;
                // Not for a group resolved meanwhile (a live leader known)
                // or no longer hosted: it would hold a slot for nothing.
                if groups.partition_of(group).is_some_and(|p| p.campaign.not_before(until)) {
                    let e = backing_off.entry(group).or_insert(until);
                    *e = (*e).max(until);
                } else {
                    backing_off.remove(&group);
                }
            }
        }
        // Unresolved campaigns: started here, back-off not over or not sent
        // yet, and not leading here (as this broker's leadership watcher
        // has it, `GroupRegistry::is_led`). They count against the broker's
        // CAMPAIGNS_IN_FLIGHT and are not looked at: such a group cannot
        // start another campaign before its back-off ends.
        backing_off.retain(|_, until| *until > now);
        let unresolved: BTreeSet<u64> = backing_off
            .keys()
            .copied()
            .chain(sending_groups.values().map(|(g, _)| *g))
            .filter(|g| !groups.is_led(*g))
            .collect();
        let in_flight = unresolved.len();
        // Not looked at while unresolved, and awake once resolved.
        schedule.keep_awake(unresolved.iter().copied());
        let visit = if full {
            groups.partitions_where(|g| !unresolved.contains(&g))
        } else {
            schedule.due(now, &mut look);
            groups.partitions_among(look.into_iter().filter(|g| !unresolved.contains(g)))
        };
        // Campaigns where this replica is the first live one go first;
        // fallbacks get what they leave ([`admit`]).
        let mut first = Vec::new();
        let mut fallbacks = Vec::new();
        // Parked leaders to send one heartbeat round.
        let mut heartbeats = Vec::new();
        // Brokers whose campaigns groups here wait for.
        let mut waiting_for: BTreeSet<BrokerId> = BTreeSet::new();
        // Groups skipped below that still wait for the budget.
        let mut skipped_waiting = 0usize;
        for p in visit {
            // One that waited for the budget last round cannot start once
            // this round has enough first campaigns: looked at again when
            // that changes (a group led here is never skipped).
            let stalled = first.len() >= CAMPAIGNS_PER_ROUND && p.campaign.waiting.load(Ordering::Relaxed);
            if stalled && !groups.is_led(p.group) {
                schedule.keep_awake([p.group]);
                skipped_waiting += 1;
                continue;
            }
            // Still backing off, for a group looked at because it leads here
            // now (then it will not campaign anyway).
            let campaigning = p.campaign.in_flight(now);
            let v = view(&p, &liveness, me, fallback_wait, |b| awaited.idle_for(b, now));
            if v.is_leader || v.leader_alive {
                // Resolved: it no longer holds the budget.
                backing_off.remove(&p.group);
            }
            let decision = decide(v);
            if let Some(b) = v.awaited {
                waiting_for.insert(b);
            }
            p.campaign.waiting.store(decision == Decision::Campaign, Ordering::Relaxed);
            // Only a leader's ticker does anything (heartbeats): elections
            // are started here, the node's own timer is off.
            p.set_ticking(decision == Decision::Tick);
            // A write that came after `view` read the group (its own
            // `set_ticking(true)` may have been undone just above) wakes it
            // again now rather than when something next stirs it.
            let written_since = v.is_leader && !v.recently_written && p.written_within(ACTIVE_AFTER_WRITE);
            if written_since {
                p.set_ticking(true);
            }
            let rest = if written_since { Rest::Awake } else { rest(&v, decision) };
            schedule.record(p.group, rest, now);
            // The voters' leases from the leader's last AppendEntries
            // still run (one maximum election timeout, Raft thesis §4.2.3):
            // a campaign now would be refused and back off for an election
            // timeout or two. Looked at again next round.
            let leases_run = || p.since_leader_contact().is_some_and(|d| d < election_timeout + LEASE_MARGIN);
            match decision {
                Decision::Campaign if !campaigning && leases_run() => {}
                Decision::Campaign if !campaigning && v.first_live_follower => first.push(p),
                Decision::Campaign if !campaigning => fallbacks.push(p),
                Decision::Heartbeat if p.campaign.heartbeat_due(now) => heartbeats.push(p),
                _ => {}
            }
        }
        for p in heartbeats {
            p.raft.heartbeat().await;
        }
        // A broker in a controlled shutdown starts no campaign: it is
        // handing its leaderships over (`crate::control::handover`).
        if groups.draining() {
            first.clear();
            fallbacks.clear();
            // Nor sends one started before (still waking its node).
            sending.abort_all();
        }
        let (first_n, fallback_n) = admit(first.len(), fallbacks.len(), in_flight);
        fallback_wait = fallback_after(first.len() + fallbacks.len() + skipped_waiting, period);
        awaited.after_round(&waiting_for, |b| liveness.led_count(b), now);
        let deferred = first.len() + fallbacks.len() - first_n - fallback_n;
        let started = first_n + fallback_n;
        let first = first.into_iter().take(first_n).map(|p| (p, "no live leader: campaigning"));
        let fallbacks = fallbacks
            .into_iter()
            .take(fallback_n)
            .map(|p| (p, "no live leader, and the first live replica did not win: campaigning"));
        for (p, why) in first.chain(fallbacks) {
            let until = p.campaign.started(election_timeout);
            backing_off.insert(p.group, until);
            tracing::debug!(topic = %p.topic, partition = p.partition, "{why}");
            // Each on a task of its own: a campaign first wakes a dormant
            // follower (`crate::control::dormant`), which starts its Raft
            // node, and awaited here one after another those wakes made a
            // round last tens of milliseconds under load, so rounds came
            // late or were skipped and the budget was not spent (one
            // broker's restart among 10,000 partitions: 176-348 campaigns
            // a second instead of 320). Until it is sent the group counts
            // as unresolved (against CAMPAIGNS_IN_FLIGHT, not looked at),
            // and its back-off is counted again from when it was.
            let group = p.group;
            let task = sending.spawn(
                async move {
                    // A wake or a Raft core that hangs must not hold the
                    // group (never looked at while being sent) for good.
                    let _ = tokio::time::timeout(CAMPAIGN_SEND_MAX, p.raft.campaign()).await;
                    now_ms()
                }
                .in_current_span(),
            );
            sending_groups.insert(task.id(), (group, until.saturating_sub(now_ms())));
        }
        if started > 0 || deferred > 0 {
            crate::logging::every(
                "quiesce.campaigns",
                Duration::from_secs(5),
                format_args!(
                    "no live leader: started {started} campaigns this round, {deferred} wait for the budget"
                ),
            );
        }
    }
}

/// How long ago each broker whose campaigns this one waits for last won a
/// group, so fallbacks do not contest a first live replica that is still
/// working through its backlog.
///
/// After one broker's death, one survivor is the first live replica of
/// every group the dead broker led (placement makes it so), and its budget
/// starts [`CAMPAIGNS_PER_ROUND`] a round, fewer while the CPU is
/// saturated. Fallbacks after a fixed wait, or one computed from the
/// backlog, collided with the tail of its campaigns and split their votes:
/// on one broker's restart among 10,000 partitions (2026-12-02), 5,632 of
/// 11,901 campaigns were fallbacks. So a fallback also waits until the
/// broker it waits for has won no group for [`FALLBACK_AFTER`] (the count
/// of groups it says it leads in its pings has not grown): a first replica
/// that cannot win stops winning, one that is only busy does not. Wins by
/// anyone else, this broker's fallbacks included, are not its progress.
/// One that keeps winning other groups while it cannot win this one holds
/// this group's fallback back for [`FALLBACK_MAX`] at most.
#[derive(Debug, Default)]
struct Awaited {
    /// Per broker: how many groups it led at the last fresh look, when that
    /// count last grew (or the broker was first awaited), and when a group
    /// here last waited for it, ms on [`now_ms`]'s clock.
    brokers: BTreeMap<BrokerId, AwaitedBroker>,
}

/// One broker's entry in [`Awaited`].
#[derive(Debug, Clone, Copy)]
struct AwaitedBroker {
    led: usize,
    won_at: u64,
    awaited_at: u64,
}

impl Awaited {
    /// How long `broker` has won no group at `now` (ms on [`now_ms`]'s clock);
    /// zero for one not awaited before this round.
    fn idle_for(&self, broker: BrokerId, now: u64) -> Duration {
        let since = self.brokers.get(&broker).map_or(now, |b| b.won_at);
        Duration::from_millis(now.saturating_sub(since))
    }

    /// Records a round: the brokers groups here waited for, and how many
    /// groups each leads now (`led`: `None` when its pings are not fresh,
    /// which is no news). A broker no group has waited for in
    /// [`FALLBACK_AFTER`] is forgotten: groups waiting in their campaign's
    /// back-off are not looked at, and forgetting the broker at once would
    /// restart its idle time at each of their retries.
    fn after_round(
        &mut self,
        awaited: &BTreeSet<BrokerId>,
        led: impl Fn(BrokerId) -> Option<usize>,
        now: u64,
    ) {
        let keep = FALLBACK_AFTER.as_millis() as u64;
        self.brokers.retain(|b, e| awaited.contains(b) || now.saturating_sub(e.awaited_at) < keep);
        for b in awaited {
            let n = led(*b);
            let e = self.brokers.entry(*b).or_insert(AwaitedBroker {
                led: n.unwrap_or(0),
                won_at: now,
                awaited_at: now,
            });
            e.awaited_at = now;
            if let Some(n) = n {
                if n > e.led {
                    e.won_at = now;
                }
                e.led = n;
            }
        }
    }
}

/// Which groups [`run`] looks at in a round that is not a full one: the
/// awake ones, and those whose timed rest ended (times in ms on now_ms's clock).
#[derive(Debug, Default)]
struct Schedule {
    awake: BTreeSet<u64>,
    /// Ends of timed rests; an entry is live only while `rest_until` names
    /// it (a group looked at again meanwhile leaves a stale one behind).
    resting: BinaryHeap<Reverse<(u64, u64)>>,
    rest_until: BTreeMap<u64, u64>,
}

impl Schedule {
    /// Forgets everything (a full round looks at every group anyway).
    fn clear(&mut self) {
        *self = Schedule::default();
    }

    /// Has `groups` looked at every round until recorded otherwise.
    fn keep_awake(&mut self, groups: impl IntoIterator<Item = u64>) {
        self.awake.extend(groups);
    }

    /// Records the rest `group` was given at `now`. A timed rest already
    /// running keeps its end: a group looked at again (stirred) before
    /// then would otherwise never reach it.
    fn record(&mut self, group: u64, rest: Rest, now: u64) {
        match rest {
            Rest::For(d) => {
                self.awake.remove(&group);
                if let std::collections::btree_map::Entry::Vacant(e) = self.rest_until.entry(group) {
                    let until = now + d.as_millis() as u64;
                    e.insert(until);
                    self.resting.push(Reverse((until, group)));
                }
            }
            Rest::Awake => {
                self.rest_until.remove(&group);
                self.awake.insert(group);
            }
            Rest::UntilStirred => {
                self.rest_until.remove(&group);
                self.awake.remove(&group);
            }
        }
    }

    /// Adds to `look` the awake groups and those whose rest ended by `now`.
    fn due(&mut self, now: u64, look: &mut BTreeSet<u64>) {
        while let Some(Reverse((until, g))) = self.resting.peek().copied() {
            if until > now {
                break;
            }
            self.resting.pop();
            if self.rest_until.get(&g) == Some(&until) {
                self.rest_until.remove(&g);
                look.insert(g);
            }
        }
        look.extend(&self.awake);
    }
}

/// How many of the `first` due campaigns (this replica is the group's
/// first live one) and of the `fallbacks` to start this round, with
/// `in_flight` unresolved: at most [`CAMPAIGNS_PER_ROUND`] in all, and no
/// more than [`CAMPAIGNS_IN_FLIGHT`] unresolved. First replicas go first
/// and fallbacks get what they leave: a fallback competes with the first
/// live replica's own campaign, which may only be waiting for its broker's
/// budget, and when thousands of groups elect at once (a topic of thousands
/// of partitions created), fallbacks that took a share of the budget held
/// it through their back-offs while splitting the votes of the groups they
/// ran for (measured at 10,000 partitions: three quarters of the budget
/// reserved for first replicas still left them starved whenever a quarter
/// of the slots was held, and most groups were elected by fallbacks). A
/// first replica that cannot win (a log behind) backs off, doubling, and
/// leaves the budget to fallbacks meanwhile.
fn admit(first: usize, fallbacks: usize, in_flight: usize) -> (usize, usize) {
    let free = CAMPAIGNS_IN_FLIGHT.saturating_sub(in_flight);
    let first = first.min(CAMPAIGNS_PER_ROUND).min(free);
    let fallbacks = fallbacks.min(CAMPAIGNS_PER_ROUND - first).min(free - first);
    (first, fallbacks)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FOLLOWER: GroupView = GroupView {
        is_leader: false,
        recently_written: false,
        followers_caught_up: true,
        follower_returned: false,
        leader_alive: true,
        leader_announced: true,
        followers_opening: false,
        first_live_follower: false,
        // No first live replica awaited (see
        // `fallbacks_wait_while_the_first_live_replica_wins_groups`).
        awaited: None,
        awaited_idle_for: Duration::MAX,
        leaderless_for: Duration::ZERO,
        fallback_after: FALLBACK_AFTER,
        settled: true,
        may_campaign: true,
        majority_open: true,
    };

    #[test]
    fn every_replica_names_the_same_first_live_one_when_the_leader_restarts() {
        let replicas: Vec<ReplicaAssignment> =
            (1..=3).map(|b| ReplicaAssignment { broker: b, node: u64::from(b) * 10 }).collect();
        let first = |remembered, ready: &[u32]| {
            first_live(&replicas, remembered, |b| ready.contains(&b)).map(|r| r.broker)
        };
        // Broker 1 led and died: its followers remember it and pass it over.
        assert_eq!(first(Some(1), &[2, 3]), Some(2));
        // Back and done opening, broker 1 remembers its own leadership and
        // passes itself over too: the same answer as the followers'.
        assert_eq!(first(Some(1), &[1, 2, 3]), Some(2));
        // A replica that remembers no leader takes the preferred one.
        assert_eq!(first(None, &[1, 2, 3]), Some(1));
        // Brokers not ready are passed over.
        assert_eq!(first(Some(1), &[1, 3]), Some(3));
        assert_eq!(first(None, &[3]), Some(3));
        // The remembered leader's broker is first when no other is ready
        // (one replica, or the others down), rather than none.
        assert_eq!(first(Some(1), &[1]), Some(1));
        assert_eq!(first(Some(2), &[]), None);
    }

    #[test]
    fn only_parked_groups_with_a_leader_rest_and_for_a_while_if_time_can_change_them() {
        let leader = GroupView { is_leader: true, ..FOLLOWER };
        for v in [FOLLOWER, leader] {
            assert_eq!(rest(&v, decide(v)), Rest::UntilStirred, "{v:?}");
        }
        let for_a_while = [
            GroupView { leader_announced: false, ..FOLLOWER },
            GroupView { followers_opening: true, ..leader },
            GroupView { follower_returned: true, ..leader },
        ];
        for v in for_a_while {
            assert_eq!(rest(&v, decide(v)), Rest::For(RECHECK_EVERY), "{v:?}");
        }
        let unsettled = [
            GroupView { recently_written: true, ..leader },
            GroupView { followers_caught_up: false, ..leader },
            GroupView { leader_alive: false, ..FOLLOWER },
            GroupView { leader_alive: false, first_live_follower: true, ..FOLLOWER },
        ];
        for v in unsettled {
            assert_eq!(rest(&v, decide(v)), Rest::Awake, "{v:?}");
        }
    }

    fn due(s: &mut Schedule, now: u64) -> Vec<u64> {
        let mut look = BTreeSet::new();
        s.due(now, &mut look);
        let mut look: Vec<u64> = look.into_iter().collect();
        look.sort_unstable();
        look
    }

    #[test]
    fn a_round_looks_at_awake_groups_and_at_rests_that_ended_once() {
        let mut s = Schedule::default();
        let second = Rest::For(Duration::from_secs(1));
        s.record(1, Rest::Awake, 0);
        s.record(2, second, 0);
        s.record(3, Rest::UntilStirred, 0);
        assert_eq!(due(&mut s, 999), vec![1]);
        assert_eq!(due(&mut s, 1000), vec![1, 2], "the rest ended");
        assert_eq!(due(&mut s, 5000), vec![1], "once");
        // Stirred meanwhile and given the same rest: the first end holds.
        s.record(2, second, 5000);
        s.record(2, second, 5900);
        assert_eq!(due(&mut s, 6000), vec![1, 2]);
        // Woken, then at rest until stirred: the old end is stale.
        s.record(2, second, 7000);
        s.record(2, Rest::Awake, 7100);
        s.record(2, Rest::UntilStirred, 7200);
        assert_eq!(due(&mut s, 9000), vec![1]);
        // A rest after being awake takes the group out of the awake ones.
        s.record(1, second, 9000);
        assert_eq!(due(&mut s, 9500), Vec::<u64>::new());
        assert_eq!(due(&mut s, 10_000), vec![1]);
        s.keep_awake([4]);
        assert_eq!(due(&mut s, 10_000), vec![4]);
        s.clear();
        assert_eq!(due(&mut s, 20_000), Vec::<u64>::new());
    }

    #[test]
    fn idle_leaders_park_and_wake_for_writes_lagging_or_returned_followers() {
        let leader = GroupView { is_leader: true, ..FOLLOWER };
        assert_eq!(decide(leader), Decision::Park);
        assert_eq!(decide(GroupView { recently_written: true, ..leader }), Decision::Tick);
        assert_eq!(decide(GroupView { followers_caught_up: false, ..leader }), Decision::Tick);
        // One heartbeat round now and then, not ten a second.
        assert_eq!(decide(GroupView { follower_returned: true, ..leader }), Decision::Heartbeat);
        let lagging = GroupView { follower_returned: true, followers_caught_up: false, ..leader };
        assert_eq!(decide(lagging), Decision::Tick);
    }

    #[test]
    fn followers_never_tick_and_only_one_campaigns_at_first() {
        assert_eq!(decide(FOLLOWER), Decision::Park);
        let dead = GroupView { leader_alive: false, ..FOLLOWER };
        assert_eq!(decide(dead), Decision::Park, "not the first live replica: waits");
        assert_eq!(decide(GroupView { first_live_follower: true, ..dead }), Decision::Campaign);
        assert_eq!(
            decide(GroupView { leaderless_for: FALLBACK_AFTER, ..dead }),
            Decision::Campaign,
            "fallback"
        );
    }

    #[test]
    fn campaigns_wait_for_a_majority_to_have_the_group_open_within_bounds() {
        let first = GroupView { leader_alive: false, first_live_follower: true, ..FOLLOWER };
        let unopened = GroupView { majority_open: false, ..first };
        assert_eq!(decide(unopened), Decision::Park, "the voters cannot answer yet");
        assert_eq!(
            decide(GroupView { leaderless_for: FALLBACK_AFTER, first_live_follower: false, ..unopened }),
            Decision::Park
        );
        assert_eq!(
            decide(GroupView { leaderless_for: OPEN_WAIT_MAX, ..unopened }),
            Decision::Campaign,
            "waits at most OPEN_WAIT_MAX"
        );
        assert_eq!(decide(first), Decision::Campaign);
    }

    #[test]
    fn fallbacks_wait_longer_while_many_campaigns_are_due() {
        let period = Duration::from_millis(100);
        assert_eq!(fallback_after(0, period), FALLBACK_AFTER);
        assert_eq!(fallback_after(1, period), FALLBACK_AFTER + period);
        assert_eq!(fallback_after(CAMPAIGNS_PER_ROUND * 30, period), FALLBACK_AFTER + Duration::from_secs(3));
        let dead = GroupView { leader_alive: false, ..FOLLOWER };
        let busy = GroupView { fallback_after: fallback_after(3200, period), ..dead };
        assert_eq!(decide(GroupView { leaderless_for: FALLBACK_AFTER, ..busy }), Decision::Park);
        assert_eq!(decide(GroupView { leaderless_for: busy.fallback_after, ..busy }), Decision::Campaign);
        assert_eq!(
            decide(GroupView { first_live_follower: true, ..busy }),
            Decision::Campaign,
            "first replicas do not wait"
        );
    }

    #[test]
    fn fallbacks_wait_while_the_first_live_replica_wins_groups() {
        let mut awaited = Awaited::default();
        let three = BTreeSet::from([3]);
        // Broker 3 is awaited from 1,000 ms on, leading 100 groups.
        assert_eq!(awaited.idle_for(3, 1_000), Duration::ZERO);
        awaited.after_round(&three, |_| Some(100), 1_000);
        assert_eq!(awaited.idle_for(3, 7_000), Duration::from_secs(6));
        // It wins groups: its idle time starts again.
        awaited.after_round(&three, |_| Some(400), 7_000);
        assert_eq!(awaited.idle_for(3, 7_100), Duration::from_millis(100));
        // Fewer, or as many, is not progress (groups here won by this
        // broker's own fallbacks do not change its count).
        awaited.after_round(&three, |_| Some(390), 7_100);
        awaited.after_round(&three, |_| Some(390), 9_000);
        assert_eq!(awaited.idle_for(3, 12_000), Duration::from_secs(5));
        // Its pings are not fresh: no news, not a win when they are again.
        awaited.after_round(&three, |_| None, 9_100);
        awaited.after_round(&three, |_| Some(390), 9_200);
        assert_eq!(awaited.idle_for(3, 12_000), Duration::from_secs(5));
        // Not awaited for a while (the groups waiting for it back off): kept.
        awaited.after_round(&BTreeSet::new(), |_| Some(390), 13_000);
        assert_eq!(awaited.idle_for(3, 13_000), Duration::from_secs(6));
        // Awaited by no group for FALLBACK_AFTER: forgotten, and a new
        // episode starts afresh.
        awaited.after_round(&BTreeSet::new(), |_| Some(390), 14_200);
        assert_eq!(awaited.idle_for(3, 20_000), Duration::ZERO);

        let waiting = GroupView {
            leader_alive: false,
            awaited: Some(3),
            leaderless_for: FALLBACK_AFTER * 3,
            awaited_idle_for: FALLBACK_AFTER - Duration::from_millis(1),
            ..FOLLOWER
        };
        assert_eq!(decide(waiting), Decision::Park, "the first live replica still wins groups");
        assert_eq!(decide(GroupView { awaited_idle_for: FALLBACK_AFTER, ..waiting }), Decision::Campaign);
        assert_eq!(
            decide(GroupView { leaderless_for: FALLBACK_MAX, ..waiting }),
            Decision::Campaign,
            "not for longer than FALLBACK_MAX"
        );
        let fresh = GroupView { leaderless_for: FALLBACK_AFTER - Duration::from_millis(1), ..waiting };
        assert_eq!(
            decide(GroupView { awaited_idle_for: FALLBACK_AFTER, ..fresh }),
            Decision::Park,
            "a group leaderless for less than the wait does not fall back"
        );
    }

    #[test]
    fn a_returned_follower_gets_a_heartbeat_round_once_a_second() {
        let c = Campaign::default();
        assert!(c.heartbeat_due(5_000));
        assert!(!c.heartbeat_due(5_200), "looked at again when the round changed the node");
        assert!(!c.heartbeat_due(5_999));
        assert!(c.heartbeat_due(6_000));
    }

    #[test]
    fn nothing_is_concluded_before_pings_settle_or_while_recovering() {
        let dead_first = GroupView { leader_alive: false, first_live_follower: true, ..FOLLOWER };
        assert_eq!(decide(GroupView { settled: false, ..dead_first }), Decision::Park);
        assert_eq!(decide(GroupView { may_campaign: false, ..dead_first }), Decision::Park);
    }

    #[test]
    fn first_replicas_campaign_first_and_fallbacks_take_what_is_left() {
        let (round, flight) = (CAMPAIGNS_PER_ROUND, CAMPAIGNS_IN_FLIGHT);
        assert_eq!(admit(1000, 0, 0), (round, 0), "the whole round");
        assert_eq!(admit(1000, 1000, 0), (round, 0), "fallbacks wait while first replicas are due");
        assert_eq!(admit(5, 1000, 0), (5, round - 5), "fallbacks take what first replicas leave");
        assert_eq!(admit(0, 1000, 0), (0, round));
        assert_eq!(admit(1000, 1000, flight - 3), (3, 0), "within the unresolved budget");
        assert_eq!(admit(2, 1000, flight - 3), (2, 1));
        assert_eq!(admit(1000, 1000, flight), (0, 0), "nothing while the budget is full");
        assert_eq!(admit(1000, 1000, flight + 5), (0, 0));
    }

    #[test]
    fn a_leader_is_known_since_it_was_first_seen_and_forgotten_when_none_is() {
        let c = Campaign::default();
        assert_eq!(c.leader_known_since(None), None);
        let first = c.leader_known_since(Some((5, 1))).expect("known");
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(
            c.leader_known_since(Some((5, 1))),
            Some(first),
            "the same leader: since it was first seen"
        );
        let again = c.leader_known_since(Some((5, 2))).expect("known");
        assert!(again > first, "the same node leading a later term: since now");
        let other = c.leader_known_since(Some((6, 3))).expect("known");
        assert!(other >= again, "another leader: since now");
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(c.leader_known_since(None), None);
        assert!(c.leader_known_since(Some((6, 3))).expect("known") > other, "seen again after none: anew");
    }

    #[test]
    fn backoff_doubles_with_attempts_within_bounds() {
        let c = Campaign::default();
        assert!(c.due(now_ms()));
        c.started(Duration::from_millis(1000));
        assert!(!c.due(now_ms()), "waits at least half the base");
        assert!(c.in_flight(now_ms()));
        let first = c.not_before_ms.load(Ordering::Relaxed);
        assert!((500..=1001 + now_ms()).contains(&first), "{first}");
        for _ in 0..19 {
            c.started(Duration::from_millis(1000));
        }
        let started = now_ms();
        c.started(Duration::from_millis(1000));
        let wait = c.not_before_ms.load(Ordering::Relaxed) - started;
        assert!(
            wait >= BACKOFF_MAX.as_millis() as u64 / 2 && wait <= BACKOFF_MAX.as_millis() as u64 + 1,
            "{wait}"
        );
        c.led();
        assert!(c.due(now_ms()));
        assert_eq!(c.attempts.load(Ordering::Relaxed), 0);
    }
}

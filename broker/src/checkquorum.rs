//! CheckQuorum (Raft thesis §6.2): a leader (of a partition, or of the
//! metadata group) that has not heard from a quorum for a maximum election
//! timeout hands its leadership over.
//!
//! openraft keeps a leader until it sees a higher term. A partition can
//! keep that from happening: when a leader's messages reach its followers
//! but their answers do not come back (a one-way partition), the followers
//! keep hearing heartbeats, refuse to elect anyone, and nothing commits
//! until the network heals. Clients that still reach the old leader wait
//! on it for the whole partition. So a leader that has been heartbeating
//! for a maximum election timeout without a quorum's acknowledgement is
//! judged to have lost its quorum.
//!
//! The lease alone is not enough to judge: openraft bounds each heartbeat
//! by `heartbeat_interval`, so a network whose round trip exceeds it (50 ms
//! each way, say) leaves an idle leader's lease stale although every
//! follower is reachable. So the leader must also have lost a majority of
//! its voters' brokers by the brokers' own pings ([`crate::liveness`],
//! answered within `election_timeout_min`); one ping per broker pair
//! travels the same connection as the group's Raft messages, so a
//! partition that stops one stops the other. Such a leader:
//!
//! - stops naming itself leader to clients ([`crate::partition::Partition::leader_broker`])
//!   and answers produces waiting on it;
//! - asks openraft to transfer leadership to its most caught-up follower:
//!   it stops heartbeating and accepting writes, and tells every follower to
//!   drop its leader lease, so the followers (which can talk to each other)
//!   elect a new leader at once, or after their election timeout if the
//!   request did not reach them.
//!
//! Safety does not depend on this: elections and commits stay Raft's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ferrolog_raft_store::state_machine::PartitionRaft;
use ferrolog_raft_store::types::{LogId, NodeId};

use tokio::sync::watch;

use crate::liveness::Liveness;
use crate::metadata::METADATA_GROUP;
use crate::metadata::image::MetadataImage;
use crate::partitions::PartitionTable;

/// What the rule reads of one group, all local.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaderView {
    /// This replica leads.
    pub is_leader: bool,
    /// Voters in the group's membership.
    pub voters: usize,
    /// How long its ticker has run (`None`: parked, no heartbeats sent).
    pub heartbeating_for: Option<Duration>,
    /// Time since a quorum last acknowledged it (`None`: never).
    pub since_quorum_ack: Option<Duration>,
    /// Voters whose broker answers pings (this one included).
    pub live_voters: usize,
}

/// The rule, a pure function: whether the leader has lost its quorum,
/// with `timeout` the maximum election timeout.
pub fn lost(v: LeaderView, timeout: Duration) -> bool {
    v.is_leader
        && v.voters > 1
        && v.heartbeating_for.is_some_and(|t| t >= timeout)
        && v.since_quorum_ack.is_some_and(|t| t > timeout)
        && v.live_voters * 2 <= v.voters
}

/// The voter to hand over to: the follower whose matched log is the
/// highest (ties to the lowest node id), so its log is most likely up to
/// date enough to win the election.
pub fn successor(me: NodeId, voters: &[NodeId], matched: &BTreeMap<NodeId, Option<LogId>>) -> Option<NodeId> {
    voters
        .iter()
        .filter(|n| **n != me)
        .max_by(|a, b| {
            let (ma, mb) = (matched.get(a).cloned().flatten(), matched.get(b).cloned().flatten());
            ma.cmp(&mb).then(b.cmp(a))
        })
        .copied()
}

/// Applies [`lost`] to `raft`, whose node here is `me`, heartbeating for
/// `heartbeating_for` (`None`: ticker parked), where `live(node)` says
/// whether a voter's broker answers pings. Returns `None` when the quorum
/// is fine, else `Some` of the [`successor`] (if any).
pub fn examine(
    raft: &PartitionRaft,
    me: NodeId,
    heartbeating_for: Option<Duration>,
    live: impl Fn(NodeId) -> bool,
) -> Option<Option<NodeId>> {
    use openraft::Instant as _;
    use openraft::async_runtime::watch::WatchReceiver;
    use openraft::type_config::TypeConfigExt;
    type C = ferrolog_raft_store::types::TypeConfig;
    let timeout = Duration::from_millis(raft.config().election_timeout_max);
    let metrics = raft.metrics();
    let m = metrics.borrow_watched();
    let voters: Vec<NodeId> = m.membership_config.membership().voter_ids().collect();
    let now = C::now();
    let view = LeaderView {
        is_leader: m.state.is_leader(),
        voters: voters.len(),
        heartbeating_for,
        since_quorum_ack: m
            .last_quorum_acked
            .as_ref()
            .map(|t| now.saturating_duration_since((*t).into_inner())),
        live_voters: voters.iter().filter(|n| **n == me || live(**n)).count(),
    };
    if !lost(view, timeout) {
        return None;
    }
    Some(successor(me, &voters, &m.replication.clone().unwrap_or_default()))
}

/// The metadata group as this broker hosts it: its Raft node, its node id
/// here, and when it started (it never parks its ticker).
#[derive(Clone)]
pub struct MetadataGroup {
    /// The Raft node.
    pub raft: PartitionRaft,
    /// This broker's node id in it.
    pub node: NodeId,
    /// When it started.
    pub started: std::time::Instant,
}

/// Checks the metadata group and every hosted partition every `period`,
/// forever, judging brokers alive by `liveness` and finding the metadata
/// group's voters' brokers in `image`.
pub async fn run(
    metadata: MetadataGroup,
    table: PartitionTable,
    liveness: Liveness,
    image: watch::Receiver<Arc<MetadataImage>>,
    period: Duration,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Hand-offs made, by group: one per term is enough (later ones would
    // only repeat the request to the same followers).
    let mut handed_off: BTreeMap<u64, u64> = BTreeMap::new();
    loop {
        tick.tick().await;
        let partitions = table.all();
        handed_off
            .retain(|group, _| *group == METADATA_GROUP || partitions.iter().any(|p| p.group == *group));
        let m = &metadata;
        let verdict = {
            let image = image.borrow();
            let live = |node: NodeId| {
                image.brokers.iter().any(|(id, b)| b.metadata_node == node && liveness.is_alive(*id))
            };
            examine(&m.raft, m.node, Some(m.started.elapsed()), live)
        };
        if let Some(Some(to)) = verdict {
            hand_off(&m.raft, METADATA_GROUP, to, "metadata", &mut handed_off).await;
        }
        for p in partitions {
            let live = |node: NodeId| p.broker_of(node).is_some_and(|b| liveness.is_alive(b));
            let verdict = examine(&p.raft, p.node_id, p.heartbeating_for(), live);
            p.set_lost_quorum(verdict.is_some());
            if let Some(Some(to)) = verdict {
                hand_off(&p.raft, p.group, to, &format!("{}-{}", p.topic, p.partition), &mut handed_off)
                    .await;
            }
        }
    }
}

async fn hand_off(
    raft: &PartitionRaft,
    group: u64,
    to: NodeId,
    name: &str,
    handed_off: &mut BTreeMap<u64, u64>,
) {
    use openraft::async_runtime::watch::WatchReceiver;
    let term = raft.metrics().borrow_watched().current_term;
    if handed_off.insert(group, term) == Some(term) {
        return;
    }
    tracing::warn!(
        group,
        name,
        term,
        to,
        "leader has not heard from a quorum for an election timeout: handing leadership over"
    );
    let _ = raft.trigger().transfer_leader(to).await;
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
        live_voters: 3,
    };

    #[test]
    fn only_a_heartbeating_leader_without_acks_for_a_timeout_has_lost_its_quorum() {
        let stale =
            LeaderView { since_quorum_ack: Some(Duration::from_millis(1500)), live_voters: 1, ..HEALTHY };
        assert!(!lost(HEALTHY, SEC));
        assert!(lost(stale, SEC));
        assert!(lost(LeaderView { voters: 5, live_voters: 2, ..stale }, SEC));
        // Slow acknowledgements but a majority of brokers answering pings:
        // heartbeats time out on a long round trip, the quorum is there.
        assert!(!lost(LeaderView { live_voters: 2, ..stale }, SEC));
        assert!(!lost(LeaderView { voters: 5, live_voters: 3, ..stale }, SEC));
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
        let log = |term: u64, index: u64| Some(ferrolog_raft_store::types::log_id(term, 1, index));
        let matched: BTreeMap<NodeId, Option<LogId>> = [(2, log(3, 10)), (3, log(3, 12)), (4, None)].into();
        assert_eq!(successor(1, &[1, 2, 3, 4], &matched), Some(3));
        let tied: BTreeMap<NodeId, Option<LogId>> = [(2, log(3, 12)), (3, log(3, 12))].into();
        assert_eq!(successor(1, &[1, 2, 3], &tied), Some(2));
        assert_eq!(successor(1, &[1], &matched), None);
        // A voter with no replication progress yet is still a candidate.
        assert_eq!(successor(1, &[1, 5], &BTreeMap::new()), Some(5));
    }
}

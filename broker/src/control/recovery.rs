//! Replicas that may have lost entries they had acknowledged: opening their
//! log found damage and set it aside (`ferrolog_raft_store::PartitionLog::recovering`).
//!
//! Raft's election rule (§5.4.1) assumes a voter's log still holds every
//! entry it acknowledged; a voter that lost some could elect a leader
//! without them, and a committed record would be gone. So a recovering
//! replica neither campaigns (its group's elections are switched off) nor
//! votes (`crate::network::server` refuses its vote and pre-vote requests,
//! and leader transfers to it), until a leader of the current term has
//! brought it back: it has applied an entry of that leader's term, so by
//! Leader Completeness (§5.4.3) it holds every entry committed before that
//! term. Meanwhile it takes appends like any follower, and its
//! acknowledgements count only for the entries it has stored again.
//!
//! The one exception is a replica that is its group's only voter: no other
//! copy exists to fetch from, so it goes on with its valid prefix (logged).
//!
//! Replicas are marked recovering when their log was found damaged, and
//! under `flush = interval` after any unclean stop. Then a group can have no
//! voter left that may elect (all lost power, or one lost its tail while the
//! other lagged). As Kafka's unclean recovery (KIP-966) does, a recovering
//! replica of a group asks every voter for its last log id
//! ([`seek_vote_floor`], the `LogState` peer RPC) and, once *all* have
//! answered, votes only for a candidate whose log is at least the most
//! up-to-date of them ([`may_vote`]), and campaigns itself if it holds that
//! log. So the longest log of all voters is elected, never a shorter one
//! that a lagging replica and one that lost its tail would agree on. With a
//! voter unreachable it waits.

use ferrolog_raft_store::Replica;

use crate::groups::GroupRegistry;
use crate::network::PeerAddresses;
use ferrolog_replica::{NodeId, RaftNode};

/// Whether a recovering replica has been brought back: it knows the leader
/// of its current term, and it has applied an entry of that leadership
/// (appended in `current_term` by that `leader`: `applied_by`, the term and
/// leader's node id of its last applied entry) that reached it after it
/// opened (`applied_index` past `opened_last`, the last index of its log
/// when it opened). The leader may be itself only if it was elected under
/// the vote floor, as the most up-to-date log of all voters.
///
/// Keyed on the leadership, not the term alone: one term can see two
/// leaderships (the Raft library orders leader ids by term, then node id),
/// and only an entry of the leader it now follows shows that this leader
/// has brought it back (as `Partition::ready_leader` does).
///
/// An entry of the current term it already held when it opened proves
/// nothing: a follower restarts with its persisted vote for the leader of
/// that term, and re-applies that term's entries from its own log, although
/// that leader may be dead and its log may have lost the tail the leader
/// had committed (seen in `t11_interval_power_loss` when the replica that
/// lost its tail was a follower: it voted again at once and elected the
/// lagging replica without 50 acknowledged records).
pub fn caught_up(
    current_term: u64,
    leader: Option<NodeId>,
    applied_by: Option<(u64, NodeId)>,
    applied_index: Option<u64>,
    opened_last: Option<u64>,
) -> bool {
    leader.is_some_and(|l| applied_by == Some((current_term, l))) && applied_index > opened_last
}

/// Whether a replica may grant its vote to a candidate whose last log id is
/// `candidate` (term, index): always when not recovering; when recovering,
/// only once the vote floor is known (`floor`: the most up-to-date last log
/// id of all voters) and the candidate's log reaches it.
pub fn may_vote(recovering: bool, floor: Option<Option<(u64, u64)>>, candidate: Option<(u64, u64)>) -> bool {
    !recovering || floor.is_some_and(|f| candidate >= f)
}

/// The vote floor: the most up-to-date of all voters' last log ids, once
/// every voter has answered (`None` while one has not).
pub fn vote_floor(answers: &[Option<Option<(u64, u64)>>]) -> Option<Option<(u64, u64)>> {
    answers.iter().try_fold(None, |max, a| a.map(|last| max.max(last)))
}

/// Asks every other voter of the recovering replica `p` for its last log
/// id and records the vote floor (or clears it while a voter does not
/// answer). If this replica holds the most up-to-date log, it may campaign.
pub async fn seek_vote_floor(p: &crate::partition::Partition, groups: &GroupRegistry, peers: &PeerAddresses) {
    use ferrolog_proto::raft::LogStateRequest;
    let own = p.replica.last_log_id().map(|l| (l.leader_id.term, l.index));
    // The voters as the metadata assigns them (a replica that lost its log
    // may no longer know its group's membership from it), less learners
    // and leaving replicas of a reassignment when the membership is known.
    let voters: Vec<NodeId> = p.electable_replicas().iter().map(|r| r.node).collect();
    if voters.len() < 2 {
        return;
    }
    let mut answers = vec![Some(own)];
    for node in voters.into_iter().filter(|n| *n != p.node_id) {
        let addr = peers.address_of(node, "");
        let answer = async {
            let channel = peers.channel(&addr).ok()?;
            let req = LogStateRequest { group_id: p.group, target_node: node };
            let mut client = crate::network::peer_client(channel);
            let call = client.log_state(req);
            let r =
                tokio::time::timeout(std::time::Duration::from_secs(1), call).await.ok()?.ok()?.into_inner();
            if r.error.is_some() {
                return None;
            }
            Some(r.has_last.then_some((r.last_term, r.last_index)))
        };
        answers.push(answer.await);
    }
    let floor = vote_floor(&answers);
    let before = groups.vote_floor(p.group);
    groups.set_vote_floor(p.group, floor);
    let may_campaign = floor.is_some_and(|f| own >= f);
    if floor != before {
        tracing::warn!(topic = %p.topic, partition = p.partition, ?floor, ?own, may_campaign,
            "recovering replica: every voter answered; voting only for the most up-to-date log (KIP-966 unclean recovery)");
    }
    p.campaign.set_allowed(may_campaign);
}

/// Whether `me` is the only voter of the group.
pub fn sole_voter(me: NodeId, voters: &[NodeId]) -> bool {
    voters == [me]
}

/// Called when a group starts: if its replica is recovering, switches its
/// elections off (or, for a sole voter, ends the recovery). Returns whether
/// the group is held.
pub fn hold_if_recovering(raft: &RaftNode, replica: &Replica, me: NodeId) -> bool {
    let Some(reason) = replica.recovering() else { return false };
    let voters: Vec<NodeId> = raft.state(|s| s.voters().collect());
    if sole_voter(me, &voters) {
        tracing::error!(%reason, "the only voter of its group lost entries: going on with its valid prefix");
        if let Err(e) = replica.finish_recovery() {
            tracing::error!("cannot record the end of recovery: {e}");
        }
        return false;
    }
    tracing::warn!(%reason, "replica recovering: it neither votes nor campaigns until a leader has brought it back");
    raft.set_elections(false);
    true
}

/// Ends the recovery of `replica` once [`caught_up`]: records it durably
/// and, if `timer_elections` (the group's elections are its node's own timer's, as
/// the metadata group's), switches its election timer back on; a partition
/// group's campaigns are the caller's to allow again (`crate::control::quiesce`).
/// Returns whether it ended now.
pub fn release_if_caught_up(raft: &RaftNode, replica: &Replica, timer_elections: bool) -> bool {
    if !replica.is_recovering() {
        return false;
    }
    let (term, leader, applied_by, applied) =
        raft.state(|s| (s.term(), s.leader(), s.last_applied_leadership(), s.last_applied()));
    if !caught_up(term, leader, applied_by, applied.map(|l| l.index), replica.opened_last_index()) {
        return false;
    }
    if let Err(e) = replica.finish_recovery() {
        tracing::error!("cannot record the end of recovery: {e}");
        return false;
    }
    if timer_elections {
        raft.set_elections(true);
    }
    tracing::info!(term, applied = ?applied, "replica recovered: brought back by the leader, votes again");
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caught_up_needs_an_applied_entry_of_the_leader_it_follows() {
        // Leader 1 of term 5; the last applied entry and the index it held at open.
        assert!(caught_up(5, Some(1), Some((5, 1)), Some(10), Some(9)));
        assert!(caught_up(5, Some(1), Some((5, 1)), Some(10), None), "an empty log at open");
        assert!(
            !caught_up(5, Some(1), Some((4, 1)), Some(10), Some(9)),
            "an entry of an earlier term proves nothing"
        );
        assert!(
            !caught_up(5, Some(2), Some((5, 1)), Some(10), Some(9)),
            "an entry of another leadership of the same term proves nothing about the leader it follows"
        );
        assert!(!caught_up(5, None, Some((5, 1)), Some(10), Some(9)), "no leader known");
        assert!(
            !caught_up(5, Some(1), Some((5, 1)), Some(10), Some(10)),
            "an entry it held when it opened (re-applied after a restart, with the persisted vote's leader) proves nothing"
        );
        assert!(!caught_up(5, Some(1), None, None, None));
    }

    #[test]
    fn a_recovering_replica_votes_only_for_the_most_up_to_date_log() {
        assert!(may_vote(false, None, None), "not recovering: Raft's own rule");
        assert!(!may_vote(true, None, Some((9, 9))), "floor unknown: no vote");
        let floor = Some(Some((3, 55)));
        assert!(may_vote(true, floor, Some((3, 55))));
        assert!(may_vote(true, floor, Some((4, 1))), "a later term is more up to date");
        assert!(!may_vote(true, floor, Some((3, 6))), "a shorter log would lose acknowledged entries");
        assert!(!may_vote(true, floor, None));
        assert!(may_vote(true, Some(None), None), "no voter holds anything");
    }

    #[test]
    fn the_floor_waits_for_every_voter_and_takes_the_maximum() {
        assert_eq!(vote_floor(&[Some(Some((3, 6))), Some(Some((3, 55))), Some(None)]), Some(Some((3, 55))));
        assert_eq!(vote_floor(&[Some(Some((3, 6))), None]), None, "a voter that did not answer");
        assert_eq!(vote_floor(&[Some(None), Some(None)]), Some(None));
    }

    #[test]
    fn only_a_sole_voter_skips_recovery() {
        assert!(sole_voter(3, &[3]));
        assert!(!sole_voter(3, &[1, 3]));
        assert!(!sole_voter(3, &[]));
    }
}

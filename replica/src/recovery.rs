//! Replicas that may have lost entries they had acknowledged: opening their
//! log found damage and set it aside (`ferrolog_raft_store::PartitionLog::recovering`),
//! or, under `flush = interval`, they stopped uncleanly.
//!
//! Raft's election rule (§5.4.1) assumes a voter's log still holds every
//! entry it acknowledged; a voter that lost some could elect a leader
//! without them, and a committed record would be gone. So a recovering
//! replica neither campaigns ([`RaftNode::hold_if_recovering`] switches its
//! elections off) nor votes ([`RaftNode::handle_vote`] refuses) nor takes
//! a leadership handed over to it, until a leader has brought it back
//! ([`caught_up`]): it has applied an entry of the current leader's term,
//! and either that term is later than any it had acknowledged entries in
//! (by Leader Completeness, §5.4.3, that leader holds every entry
//! committed before it), or it holds everything that leader held when it
//! asked, after it opened ([`RaftNode::release_if_caught_up`]).
//! Meanwhile it takes appends like any follower, and its acknowledgements
//! count only for the entries it has stored again.
//!
//! The one exception is a replica that is its group's only voter: no other
//! copy exists to fetch from, so it goes on with its valid prefix (logged).
//!
//! A group can then have no voter left that may elect (all lost power
//! under `flush = interval`, or one lost its tail while the other lagged).
//! As Kafka's unclean recovery (KIP-966) does, a recovering replica asks
//! every voter for its last log id ([`RaftNode::seek_vote_floor`], the
//! `LogState` peer message) and, once *all* have answered, votes only for
//! a candidate whose log is at least the most up-to-date of them
//! ([`may_vote`]), and may campaign itself if it holds that log. So the
//! longest log of all voters is elected, never a shorter one that a lagging
//! replica and one that lost its tail would agree on. With a voter
//! unreachable it waits.
//!
//! Who drives it: whoever hosts the node calls [`RaftNode::hold_if_recovering`]
//! once it started, and, while [`RaftNode::is_recovering`], calls
//! [`RaftNode::release_if_caught_up`] and [`RaftNode::seek_vote_floor`] now
//! and then (the broker's reconciler once a second; the simulation's
//! driver likewise); the node itself refuses votes and hand-overs.

use std::time::Duration;

use ferrolog_proto::raft as pb;

use crate::{HandleError, NodeId, RaftNode};

/// A last log id as (term, index); `None`: an empty log.
pub type LastLog = Option<(u64, u64)>;

/// How long a voter has to answer a `LogState` question.
pub const LOG_STATE_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether a recovering replica has been brought back: it knows the leader
/// of its current term, and it has applied an entry of that leadership
/// (appended in `current_term` by that `leader`: `applied_by`, the term and
/// leader's node id of its last applied entry) that reached it after it
/// opened (`applied`, its log id as (term, index), past `opened_last`, the
/// last log id of its log when it opened: an entry of a later term at the
/// same index counts, as after a new leader replaced an uncommitted tail); and either `current_term` is later than `opened_term`
/// (the term of its vote when it opened: it acknowledged no entry of a
/// later term), or `applied`'s index reaches `leader_last` (the last index
/// of that leader's log, as the leader answered in this term after the
/// replica opened). The leader may be itself only if it was elected under
/// the vote floor, as the most up-to-date log of all voters.
///
/// Why both: a leader of a later term holds every entry committed before
/// its term (Leader Completeness), so an entry of its term shows the
/// replica holds them too (Log Matching); but in the term the replica was
/// in, an entry of that term proves nothing about the later entries of the
/// same term it had acknowledged and lost. Those came from this same
/// leader, which never drops entries of its own log, so its log's end as
/// it answered after the replica opened covers them all. (Found by the
/// simulation, seed 8607: a follower that lost entries 16..153 of term 1
/// to bit rot was released on applying entry 20 of term 1, its stale
/// leader died, and it voted for a lagging replica, which overwrote
/// committed entries.)
///
/// Keyed on the leadership, not the term alone: one term can see two
/// leaderships (the Raft library orders leader ids by term, then node id),
/// and only an entry of the leader it now follows shows that this leader
/// has brought it back.
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
    applied: Option<(u64, u64)>,
    opened_last: Option<(u64, u64)>,
    opened_term: u64,
    leader_last: Option<u64>,
) -> bool {
    leader.is_some_and(|l| applied_by == Some((current_term, l)))
        && applied > opened_last
        && (current_term > opened_term
            || leader_last.is_some_and(|last| applied.is_some_and(|a| a.1 >= last)))
}

/// Whether a replica may grant its vote to a candidate whose last log id is
/// `candidate`: always when not recovering; when recovering, only once the
/// vote floor is known (`floor`: the most up-to-date last log id of all
/// voters) and the candidate's log reaches it.
pub fn may_vote(recovering: bool, floor: Option<LastLog>, candidate: LastLog) -> bool {
    !recovering || floor.is_some_and(|f| candidate >= f)
}

/// The vote floor: the most up-to-date of all voters' last log ids, once
/// every voter has answered (`None` while one has not).
pub fn vote_floor(answers: &[Option<LastLog>]) -> Option<LastLog> {
    answers.iter().try_fold(None, |max, a| a.map(|last| max.max(last)))
}

/// Whether `me` is the only voter of the group.
pub fn sole_voter(me: NodeId, voters: &[NodeId]) -> bool {
    voters == [me]
}

impl RaftNode {
    /// Whether the replica may have lost entries it acknowledged (see the
    /// module's documentation). Lock-free.
    pub fn is_recovering(&self) -> bool {
        self.life.replica().is_recovering()
    }

    /// Called once the node started: if its replica is recovering, switches
    /// its elections off (or, for a sole voter `me`, ends the recovery).
    /// Returns whether the node is held.
    pub fn hold_if_recovering(&self, me: NodeId) -> bool {
        let replica = self.life.replica();
        let Some(reason) = replica.recovering() else { return false };
        let voters: Vec<NodeId> = self.state(|s| s.voters().collect());
        if sole_voter(me, &voters) {
            tracing::error!(%reason, "the only voter of its group lost entries: going on with its valid prefix");
            if let Err(e) = replica.finish_recovery() {
                tracing::error!("cannot record the end of recovery: {e}");
            }
            return false;
        }
        tracing::warn!(%reason, "replica recovering: it neither votes nor campaigns until a leader has brought it back");
        self.set_elections(false);
        true
    }

    /// Ends the recovery once [`caught_up`]: records it durably, forgets
    /// the vote floor and, if `timer_elections` (the node's own election
    /// timer elects, not its host), switches its elections back on; a host
    /// that schedules campaigns itself allows them again. Returns whether
    /// it ended now.
    pub fn release_if_caught_up(&self, timer_elections: bool) -> bool {
        let replica = self.life.replica();
        if !replica.is_recovering() {
            return false;
        }
        let (term, leader, applied_by, applied) =
            self.state(|s| (s.term(), s.leader(), s.last_applied_leadership(), s.last_applied()));
        let (opened_last, opened_term) = (replica.opened_last_log_id(), replica.opened_term());
        let applied_id = applied.map(|l| (l.term, l.index));
        let answered = *self.leader_last.lock().unwrap_or_else(|p| p.into_inner());
        let leader_last = answered.and_then(|(t, l, i)| (t == term && Some(l) == leader).then_some(i));
        if !caught_up(term, leader, applied_by, applied_id, opened_last, opened_term, leader_last) {
            return false;
        }
        if let Err(e) = replica.finish_recovery() {
            tracing::error!("cannot record the end of recovery: {e}");
            return false;
        }
        *self.vote_floor.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self.leader_last.lock().unwrap_or_else(|p| p.into_inner()) = None;
        if timer_elections {
            self.set_elections(true);
        }
        tracing::info!(term, applied = ?applied, "replica recovered: brought back by the leader, votes again");
        true
    }

    /// The vote floor last found by [`RaftNode::seek_vote_floor`] (`None`
    /// while unknown).
    pub fn vote_floor(&self) -> Option<LastLog> {
        *self.vote_floor.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// For a recovering replica: asks every other of `voters` (the group's
    /// voters as its host knows them: a replica that lost its log may no
    /// longer know the membership from it) for its last log id, each within
    /// [`LOG_STATE_TIMEOUT`], and records the vote floor (or clears it while
    /// a voter does not answer), and the answer of the leader it follows,
    /// if that leader's log ends in the current term (for [`caught_up`]).
    /// Returns whether this replica may campaign (it holds the most
    /// up-to-date log of all); `None` when it is not recovering or is its
    /// group's only voter.
    pub async fn seek_vote_floor(&self, me: NodeId, voters: &[NodeId]) -> Option<bool> {
        if !self.is_recovering() || voters.len() < 2 {
            return None;
        }
        let own = self.life.replica().last_log_id().map(|l| (l.leader_id.term, l.index));
        let (term, leader) = self.state(|s| (s.term(), s.leader()));
        let mut answers = vec![Some(own)];
        for node in voters.iter().copied().filter(|n| *n != me) {
            let addr = self.state(|s| s.members().find(|(n, _)| *n == node).map(|(_, a)| a.to_owned()));
            let ask = (self.ask_log_state)(node, addr.unwrap_or_default());
            let answer = match tokio::time::timeout(LOG_STATE_TIMEOUT, ask).await {
                Ok(Ok(r)) if r.error.is_none() => Some(r.has_last.then_some((r.last_term, r.last_index))),
                _ => None,
            };
            // A leader's log ends in its own term (its first entry as
            // leader); an answer that does not comes from a stale leader.
            if Some(node) == leader
                && let Some(Some((last_term, last_index))) = answer
                && last_term == term
            {
                *self.leader_last.lock().unwrap_or_else(|p| p.into_inner()) = Some((term, node, last_index));
            }
            answers.push(answer);
        }
        let floor = vote_floor(&answers);
        let before =
            std::mem::replace(&mut *self.vote_floor.lock().unwrap_or_else(|p| p.into_inner()), floor);
        let may_campaign = floor.is_some_and(|f| own >= f);
        if floor != before {
            tracing::warn!(
                ?floor,
                ?own,
                may_campaign,
                "recovering replica: every voter answered; voting only for the most up-to-date log (KIP-966 unclean recovery)"
            );
        }
        Some(may_campaign)
    }

    /// The answer to a peer's `LogState` question about this replica.
    pub fn log_state(&self) -> pb::LogStateResponse {
        let replica = self.life.replica();
        let last = replica.last_log_id().map(|l| (l.leader_id.term, l.index));
        pb::LogStateResponse {
            error: None,
            has_last: last.is_some(),
            last_term: last.map_or(0, |l| l.0),
            last_index: last.map_or(0, |l| l.1),
            recovering: replica.is_recovering(),
        }
    }

    /// Refuses the vote (or pre-vote) `req` if the replica is recovering and
    /// [`may_vote`] says no. [`RaftNode::handle_vote`] checks it first; a
    /// host that looks at a vote request before handing it to the node may
    /// ask too.
    ///
    /// # Errors
    /// [`HandleError::Recovering`] with the floor and the candidate's log.
    pub fn refuse_vote_if_recovering(&self, req: &pb::VoteRequest) -> Result<(), HandleError> {
        let candidate = crate::candidate_last_log(req).map(|l| (l.term, l.index));
        let injected = self.life.vote_while_recovering.load(std::sync::atomic::Ordering::Relaxed);
        let recovering = self.is_recovering() && !injected;
        let floor = self.vote_floor();
        if may_vote(recovering, floor, candidate) {
            return Ok(());
        }
        Err(HandleError::Recovering(format!(
            "this replica may have lost acknowledged entries; it votes only for a log at least as up to \
             date as every voter's ({floor:?}), not {candidate:?}"
        )))
    }

    /// Refuses a leadership handed over while recovering.
    /// [`RaftNode::handle_transfer`] checks it first; a host may ask too.
    ///
    /// # Errors
    /// [`HandleError::Recovering`].
    pub fn refuse_transfer_if_recovering(&self) -> Result<(), HandleError> {
        if self.is_recovering() {
            return Err(HandleError::Recovering(
                "this replica may have lost acknowledged entries and takes no leadership until a leader \
                 has brought it back"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caught_up_needs_an_applied_entry_of_the_leader_it_follows() {
        // Leader 1 of term 5; the last applied entry's log id and the last
        // one it held at open; it had voted in term 4; the leader's log
        // ended at 30.
        let up =
            |term, leader, by, applied, opened| caught_up(term, leader, by, applied, opened, 4, Some(30));
        assert!(up(5, Some(1), Some((5, 1)), Some((5, 10)), Some((4, 9))));
        assert!(up(5, Some(1), Some((5, 1)), Some((5, 10)), None), "an empty log at open");
        assert!(
            !up(5, Some(1), Some((4, 1)), Some((4, 10)), Some((4, 9))),
            "an entry of an earlier term proves nothing"
        );
        assert!(
            !up(5, Some(2), Some((5, 1)), Some((5, 10)), Some((4, 9))),
            "an entry of another leadership of the same term proves nothing about the leader it follows"
        );
        assert!(!up(5, None, Some((5, 1)), Some((5, 10)), Some((4, 9))), "no leader known");
        assert!(
            !up(5, Some(1), Some((5, 1)), Some((5, 10)), Some((5, 10))),
            "an entry it held when it opened (re-applied after a restart, with the persisted vote's leader) proves nothing"
        );
        assert!(
            up(5, Some(1), Some((5, 1)), Some((5, 10)), Some((4, 10))),
            "an entry of a later term at the index it ended at (a new leader replaced its uncommitted tail) is new"
        );
        assert!(!up(5, Some(1), None, None, None));
    }

    #[test]
    fn in_the_term_it_lost_entries_in_it_must_hold_what_its_leader_held() {
        // It had voted in term 5 and opened holding up to (5, 15); it
        // follows leader 1 of term 5 again, whose log ended at 153 when it
        // answered.
        let same_term =
            |applied| caught_up(5, Some(1), Some((5, 1)), Some((5, applied)), Some((5, 15)), 5, Some(153));
        assert!(!same_term(20), "an entry of the same term below the leader's end proves nothing");
        assert!(!same_term(152));
        assert!(same_term(153));
        assert!(
            caught_up(6, Some(2), Some((6, 2)), Some((6, 20)), Some((5, 15)), 5, None),
            "a leader of a later term holds every entry committed before it"
        );
        assert!(
            !caught_up(5, Some(1), Some((5, 1)), Some((5, 20)), Some((5, 15)), 5, None),
            "in the same term, without the leader's answer, nothing proves it"
        );
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

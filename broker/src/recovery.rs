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
//! If every voter of a group is recovering, the group has no leader until an
//! operator acts; `ferrolog cluster status` shows each replica as recovering.

use ferrolog_raft_store::Replica;
use ferrolog_raft_store::state_machine::PartitionRaft;
use ferrolog_raft_store::types::{LogId, NodeId};
use openraft::async_runtime::watch::WatchReceiver;

/// Whether a recovering replica has been brought back: it follows a leader
/// (another node) of its current term and has applied an entry of that term.
pub fn caught_up(me: NodeId, current_term: u64, leader: Option<NodeId>, last_applied: Option<LogId>) -> bool {
    leader.is_some_and(|l| l != me) && last_applied.is_some_and(|l| l.leader_id.term == current_term)
}

/// Whether `me` is the only voter of the group.
pub fn sole_voter(me: NodeId, voters: &[NodeId]) -> bool {
    voters == [me]
}

/// Called when a group starts: if its replica is recovering, switches its
/// elections off (or, for a sole voter, ends the recovery). Returns whether
/// the group is held.
pub fn hold_if_recovering(raft: &PartitionRaft, replica: &Replica, me: NodeId) -> bool {
    let Some(reason) = replica.recovering() else { return false };
    let voters: Vec<NodeId> =
        raft.metrics().borrow_watched().membership_config.membership().voter_ids().collect();
    if sole_voter(me, &voters) {
        tracing::error!(%reason, "the only voter of its group lost entries: going on with its valid prefix");
        if let Err(e) = replica.finish_recovery() {
            tracing::error!("cannot record the end of recovery: {e}");
        }
        return false;
    }
    tracing::warn!(%reason, "replica recovering: it neither votes nor campaigns until a leader has brought it back");
    raft.runtime_config().elect(false);
    true
}

/// Ends the recovery of `replica` once [`caught_up`]: records it durably
/// and switches elections back on. Returns whether it ended now.
pub fn release_if_caught_up(raft: &PartitionRaft, replica: &Replica, me: NodeId) -> bool {
    if !replica.is_recovering() {
        return false;
    }
    let (term, leader, applied) = {
        let metrics = raft.metrics();
        let m = metrics.borrow_watched();
        (m.current_term, m.current_leader, m.last_applied)
    };
    if !caught_up(me, term, leader, applied) {
        return false;
    }
    if let Err(e) = replica.finish_recovery() {
        tracing::error!("cannot record the end of recovery: {e}");
        return false;
    }
    raft.runtime_config().elect(true);
    tracing::info!(term, applied = ?applied, "replica recovered: brought back by the leader, votes again");
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolog_raft_store::types::log_id;

    #[test]
    fn caught_up_needs_another_leader_and_an_applied_entry_of_its_term() {
        assert!(caught_up(2, 5, Some(1), Some(log_id(5, 1, 10))));
        assert!(
            !caught_up(2, 5, Some(1), Some(log_id(4, 1, 10))),
            "an entry of an earlier term proves nothing"
        );
        assert!(!caught_up(2, 5, None, Some(log_id(5, 1, 10))), "no leader known");
        assert!(!caught_up(2, 5, Some(2), Some(log_id(5, 2, 10))), "itself as leader");
        assert!(!caught_up(2, 5, Some(1), None));
    }

    #[test]
    fn only_a_sole_voter_skips_recovery() {
        assert!(sole_voter(3, &[3]));
        assert!(!sole_voter(3, &[1, 3]));
        assert!(!sole_voter(3, &[]));
    }
}

//! Drives the recovery of replicas that may have lost entries they had
//! acknowledged (the rules are the replica's own: `ferrolog_replica::recovery`,
//! where a recovering node refuses votes and hand-overs itself).
//!
//! The broker's part: a group is held when it starts
//! (`RaftNode::hold_if_recovering`, from `crate::partitions` and
//! `crate::server`); once a second the reconciler asks each recovering
//! replica's voters for their logs ([`seek_vote_floor`]: the vote floor,
//! and the end of its leader's log) and releases those a leader has
//! brought back (`RaftNode::release_if_caught_up`). A partition group's
//! campaigns are scheduled by `crate::control::quiesce`, so the replica's
//! verdict allows or forbids them there; the metadata group's elections
//! are its node's own timer's.

use crate::groups::HostedGroup;
use ferrolog_replica::NodeId;

/// Asks every voter of the recovering replica `h` for its last log id (the
/// replica records the vote floor and its leader's answer) and allows its
/// campaigns only if it holds the most up-to-date log of all.
pub async fn seek_vote_floor(h: &HostedGroup) {
    match &h.partition {
        Some(p) => {
            // The voters as the metadata assigns them (a replica that lost
            // its log may no longer know its group's membership from it),
            // less learners and leaving replicas of a reassignment when
            // the membership is known.
            let voters: Vec<NodeId> = p.electable_replicas().iter().map(|r| r.node).collect();
            if let Some(may_campaign) = p.raft.seek_vote_floor(p.node_id, &voters).await {
                p.campaign.set_allowed(may_campaign);
            }
        }
        None => {
            // The metadata group: its voters as its own log knows them.
            let voters: Vec<NodeId> = h.raft.state(|s| s.voters().collect());
            if let Some(may_campaign) = h.raft.seek_vote_floor(h.node_id, &voters).await {
                h.raft.set_elections(may_campaign);
            }
        }
    }
}

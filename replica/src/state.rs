//! What a replica's Raft node knows now, read without copying: the broker's
//! loops look at thousands of groups per round, so [`State`] borrows the
//! node's latest state and answers in Ferrolog's own types.

use std::collections::BTreeSet;
use std::time::Duration;

use ferrolog_raft_store::types::{LogId, NodeId, TypeConfig};
use openraft::Instant as _;
use openraft::type_config::TypeConfigExt;

/// A log position, `(term, index)`: ordered as Raft compares logs for
/// up-to-dateness, term first (Raft paper §5.4.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogPosition {
    /// The term of the entry.
    pub term: u64,
    /// The entry's Raft log index.
    pub index: u64,
}

/// The leadership (term, leader's node id) that appended `l`.
fn leadership(l: &LogId) -> (u64, NodeId) {
    (l.leader_id.term, l.leader_id.node_id)
}

impl LogPosition {
    pub(crate) fn of(l: &LogId) -> Self {
        Self { term: l.leader_id.term, index: l.index }
    }
}

/// A replica's role in its group (Raft paper §5.1; learners, thesis §4.2.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// It leads its group.
    Leader,
    /// It is campaigning.
    Candidate,
    /// A voter following a leader (or waiting for one).
    Follower,
    /// A non-voting member, catching up.
    Learner,
    /// Its node has stopped.
    Shutdown,
}

/// A borrowed view of a replica's Raft state; see [`crate::RaftNode::state`].
/// Hold it briefly: the node waits to publish newer state meanwhile. While
/// holding it, take no other lock or channel borrow that someone may hold
/// while reading a node's state, and do not call back into the node: the
/// view sits on a read lock whose writer (the node) queues readers behind it.
pub struct State<'a> {
    pub(crate) m: &'a openraft::RaftMetrics<TypeConfig>,
}

impl State<'_> {
    /// This replica's role.
    pub fn role(&self) -> Role {
        use openraft::ServerState as S;
        match self.m.state {
            S::Leader => Role::Leader,
            S::Candidate => Role::Candidate,
            S::Follower => Role::Follower,
            S::Learner => Role::Learner,
            S::Shutdown => Role::Shutdown,
        }
    }

    /// Whether this replica leads its group.
    pub fn is_leader(&self) -> bool {
        self.m.state.is_leader()
    }

    /// The current term.
    pub fn term(&self) -> u64 {
        self.m.current_term
    }

    /// The leader's node id as this replica knows it.
    pub fn leader(&self) -> Option<NodeId> {
        self.m.current_leader
    }

    /// Why the group's node stopped, if it stopped on an error (a storage
    /// failure, or a fatal error inside Raft); `None` while it runs.
    pub fn fatal(&self) -> Option<String> {
        self.m.running_state.as_ref().err().map(ToString::to_string)
    }

    /// Whether the node runs (has not stopped on an error).
    pub fn is_running(&self) -> bool {
        self.m.running_state.is_ok()
    }

    /// Index of the last entry in the local log.
    pub fn last_log_index(&self) -> Option<u64> {
        self.m.last_log_index
    }

    /// The last entry applied to the state machine.
    pub fn last_applied(&self) -> Option<LogPosition> {
        self.m.last_applied.as_ref().map(LogPosition::of)
    }

    /// The leadership that appended the last entry known committed: its
    /// term and its leader's node id (see [`State::last_applied_leadership`]).
    pub fn committed_leadership(&self) -> Option<(u64, NodeId)> {
        self.m.local_committed.as_ref().map(leadership)
    }

    /// The leadership that appended the last entry applied: its term and
    /// its leader's node id. One term can see two leaderships (the library
    /// orders leader ids by term, then node id, and a voter may grant a
    /// higher id of the same term), so a leader knows it has applied an
    /// entry of its own leadership only by both.
    pub fn last_applied_leadership(&self) -> Option<(u64, NodeId)> {
        self.m.last_applied.as_ref().map(leadership)
    }

    /// The commit index as this replica knows it.
    pub fn committed(&self) -> Option<LogPosition> {
        self.m.local_committed.as_ref().map(LogPosition::of)
    }

    /// The last entry the newest snapshot covers.
    pub fn snapshot(&self) -> Option<LogPosition> {
        self.m.snapshot.as_ref().map(LogPosition::of)
    }

    /// The last entry purged from the log (covered by a snapshot).
    pub fn purged(&self) -> Option<LogPosition> {
        self.m.purged.as_ref().map(LogPosition::of)
    }

    /// The voters of every configuration (both of a joint one).
    pub fn voters(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.m.membership_config.membership().voter_ids()
    }

    /// The learners.
    pub fn learners(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.m.membership_config.membership().learner_ids()
    }

    /// Every member (voters and learners) with the peer address recorded
    /// when it joined.
    pub fn members(&self) -> impl Iterator<Item = (NodeId, &str)> + '_ {
        self.m.membership_config.membership().nodes().map(|(n, node)| (*n, node.addr.as_str()))
    }

    /// Whether the membership in force is committed (Raft paper §6: a
    /// configuration takes effect when appended, but only a committed one
    /// survives a change of leader).
    pub fn membership_committed(&self) -> bool {
        match self.m.membership_config.log_id() {
            None => true,
            Some(at) => self.m.local_committed.as_ref().is_some_and(|c| c.index >= at.index),
        }
    }

    /// The voter sets of the configuration: one, or two while a joint
    /// consensus change is in progress (Raft paper §6).
    pub fn voter_sets(&self) -> &[BTreeSet<NodeId>] {
        self.m.membership_config.membership().get_joint_config()
    }

    /// Whether the group has a membership yet (it was initialized, or this
    /// replica heard from a member).
    pub fn has_membership(&self) -> bool {
        // Not `voters()`, which collects every voter set into a new one:
        // this is asked of every hosted group every round.
        self.voter_sets().iter().any(|set| !set.is_empty())
    }

    /// Leader only: each replica's matched log position (the leader's own
    /// included); `None` on other replicas.
    pub fn matched(&self) -> Option<impl Iterator<Item = (NodeId, Option<LogPosition>)> + '_> {
        self.m.replication.as_ref().map(|r| r.iter().map(|(n, l)| (*n, l.as_ref().map(LogPosition::of))))
    }

    /// Leader only: how long ago each replica last acknowledged a heartbeat
    /// or an append (`None` inside: never); `None` on other replicas.
    pub fn acknowledged_ago(&self) -> Option<impl Iterator<Item = (NodeId, Option<Duration>)> + '_> {
        let now = TypeConfig::now();
        self.m.heartbeat.as_ref().map(move |acks| {
            acks.iter().map(move |(n, at)| (*n, at.as_ref().map(|t| now.saturating_duration_since(**t))))
        })
    }

    /// Leader only: how long ago a quorum last acknowledged this leader
    /// (its lease, Raft thesis §6.4); `None`: never, or not a leader.
    pub fn since_quorum_ack(&self) -> Option<Duration> {
        let now = TypeConfig::now();
        self.m.last_quorum_acked.as_ref().map(|t| now.saturating_duration_since(**t))
    }
}

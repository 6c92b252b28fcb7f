//! The openraft type configuration of one partition's Raft group, and the
//! aliases the rest of Ferrolog uses instead of naming openraft's generics.
//!
//! openraft is pinned at an alpha (`=0.10.0-alpha.37`). These names, the two
//! trait implementations (`log_store.rs`, `state_machine.rs`) and `wire.rs`
//! are this crate's side of it; `ferrolog-replica` drives the node, and the
//! broker sees neither.

use crate::batch::{AppendResult, RecordBatch};

openraft::declare_raft_types!(
    /// Type configuration of a partition replica's Raft group: application
    /// data is a [`RecordBatch`], the applied result an [`AppendResult`].
    pub TypeConfig:
        D = RecordBatch,
        R = AppendResult,
        AsyncRuntime = crate::runtime::RaftRuntime,
);

/// A replica's Raft node id. Unique within its group and never reused.
pub type NodeId = u64;
/// A Raft node's address book entry.
pub type Node = openraft::impls::BasicNode;
/// A Raft term.
pub type Term = u64;
/// The (term, leader node) pair that proposed an entry.
pub type LeaderId = openraft::alias::CommittedLeaderIdOf<TypeConfig>;
/// A Raft log id: (term, leader node, index) — Raft paper §5.3.
pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
/// A Raft log entry.
pub type Entry = openraft::alias::EntryOf<TypeConfig>;
/// An entry's payload: blank, a record batch, or a membership change.
pub type EntryPayload = openraft::alias::EntryPayloadOf<TypeConfig>;
/// A persisted vote: (term, candidate, committed) — Raft paper §5.2, Figure 2.
pub type Vote = openraft::alias::VoteOf<TypeConfig>;
/// A cluster membership configuration (joint consensus, Raft paper §6).
pub type Membership = openraft::Membership<NodeId, Node>;
/// A membership configuration with the log id that introduced it.
pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
/// Metadata of a snapshot: last included log id and membership.
pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;
/// The callback openraft hands to `append`, completed once entries are durable.
pub type IoFlushed = openraft::storage::IOFlushed<TypeConfig>;
/// openraft's log state: last purged and last log ids.
pub type LogState = openraft::storage::LogState<TypeConfig>;

/// Builds a log id from its parts.
pub fn log_id(term: Term, leader_node: NodeId, index: u64) -> LogId {
    LogId::new(LeaderId { term, node_id: leader_node }, index)
}

/// A flush callback for [`openraft::storage::RaftLogStorage::append`] and a
/// future that resolves once the store completes it: for callers that append
/// outside a running Raft (tools, tests, benchmarks).
///
/// The future yields the store's flush result, or an error if the callback
/// was dropped without being completed.
pub fn flush_signal() -> (IoFlushed, impl std::future::Future<Output = std::io::Result<()>> + Send) {
    use openraft::type_config::TypeConfigExt;
    let (tx, rx) = TypeConfig::oneshot();
    let done = async move { rx.await.map_err(|_| std::io::Error::other("flush callback dropped"))? };
    (IoFlushed::signal(tx), done)
}

/// Raft AppendEntries (Raft paper §5.3), also the heartbeat.
pub type AppendEntriesRequest = openraft::raft::AppendEntriesRequest<TypeConfig>;
/// The answer to an AppendEntries.
pub type AppendEntriesResponse = openraft::raft::AppendEntriesResponse<TypeConfig>;
/// Raft RequestVote (Raft paper §5.2), also the pre-vote (thesis §9.6).
pub type VoteRequest = openraft::raft::VoteRequest<TypeConfig>;
/// The answer to a RequestVote.
pub type VoteResponse = openraft::raft::VoteResponse<TypeConfig>;
/// A leader's request that a follower take over (Raft thesis §3.10).
pub type TransferLeaderRequest = openraft::raft::TransferLeaderRequest<TypeConfig>;
/// Why a follower refused a leadership transfer.
pub type TransferLeaderError = openraft::raft::TransferLeaderError<TypeConfig>;
/// The answer to a leadership transfer.
pub type TransferLeaderResponse = openraft::raft::TransferLeaderResponse<TypeConfig>;
/// The answer to an installed snapshot: the receiver's vote.
pub type SnapshotResponse = openraft::raft::SnapshotResponse<TypeConfig>;

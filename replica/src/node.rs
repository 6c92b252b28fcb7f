//! [`RaftNode`]: one replica's Raft node, driven through Ferrolog's own
//! interface.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ferrolog_proto::raft as pb;
use ferrolog_raft_store::state_machine::{PartitionRaft, Snapshot};
use ferrolog_raft_store::types::{Node, NodeId, TypeConfig};
use ferrolog_raft_store::{AppendResult, RecordBatch, Replica, wire};
use openraft::async_runtime::watch::WatchReceiver;
use openraft::error::ClientWriteError;
use openraft::impls::ProgressResponder;
use openraft::type_config::TypeConfigExt;

use crate::settings::{Timings, ValidSettings};
use crate::snapshot::Received;
use crate::state::{LogPosition, State};
use crate::transport::{GroupNetwork, PeerTransport};

/// One replica's Raft node: a partition's (or the metadata group's) member
/// on this broker, over its storage ([`Replica`]). Cheap to clone; clones
/// drive the same node.
#[derive(Clone)]
pub struct RaftNode {
    raft: PartitionRaft,
    timings: Timings,
}

impl std::fmt::Debug for RaftNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftNode").field("timings", &self.timings).finish_non_exhaustive()
    }
}

/// Why a node could not start or change.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The node has stopped (on an error or a shutdown).
    #[error("raft stopped: {0}")]
    Stopped(String),
    /// This replica does not lead (membership changes need the leader).
    #[error("not the leader (leader: {leader:?})")]
    NotLeader {
        /// The leader's node id as this replica knows it.
        leader: Option<NodeId>,
    },
    /// The change was refused (e.g. another membership change in progress).
    #[error("refused: {0}")]
    Refused(String),
}

/// Why a proposal did not commit.
#[derive(Debug, thiserror::Error)]
pub enum ProposeError {
    /// This replica does not lead.
    #[error("not the leader (leader: {leader:?})")]
    NotLeader {
        /// The leader's node id as this replica knows it.
        leader: Option<NodeId>,
    },
    /// The node has stopped, or the proposal was dropped (the leader
    /// stepped down before it committed: it may still commit under the
    /// next leader).
    #[error("{0}")]
    Unavailable(String),
}

/// A proposal accepted by the leader, waiting to commit and apply.
#[derive(Debug)]
pub struct Pending {
    rx: openraft::alias::OneshotReceiverOf<
        TypeConfig,
        Result<openraft::raft::ClientWriteResponse<TypeConfig>, ClientWriteError<TypeConfig>>,
    >,
}

impl Pending {
    /// Waits until the batch is committed by a majority and applied here;
    /// returns where it landed.
    ///
    /// # Errors
    /// [`ProposeError::NotLeader`] if leadership moved first;
    /// [`ProposeError::Unavailable`] if the node stopped or dropped it.
    pub async fn committed(self) -> Result<AppendResult, ProposeError> {
        match self.rx.await {
            Ok(Ok(resp)) => Ok(resp.data),
            Ok(Err(ClientWriteError::ForwardToLeader(f))) => {
                Err(ProposeError::NotLeader { leader: f.leader_id })
            }
            Ok(Err(other)) => Err(ProposeError::Unavailable(other.to_string())),
            Err(_) => Err(ProposeError::Unavailable("the write was dropped (leader stepped down)".into())),
        }
    }
}

/// A peer message this node could not handle.
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    /// The message does not decode.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The node has stopped.
    #[error("raft stopped: {0}")]
    Stopped(String),
}

/// A peer's AppendEntries handled: the answer, and whether it accepted
/// every entry (the sender is the leader it follows).
#[derive(Debug)]
pub struct Appended {
    /// The answer to send back.
    pub response: pb::AppendEntriesResponse,
    /// The entries were all stored.
    pub success: bool,
}

impl RaftNode {
    /// Starts the node `node` of `group` over `replica`, reaching peers
    /// through `transport`.
    ///
    /// # Errors
    /// [`NodeError::Stopped`] if the storage cannot be read.
    pub async fn start<T: PeerTransport>(
        group: u64,
        node: NodeId,
        settings: &ValidSettings,
        replica: &Replica,
        transport: T,
    ) -> Result<Self, NodeError> {
        let network = GroupNetwork { group, transport };
        let raft = PartitionRaft::new(
            node,
            settings.raft.clone(),
            network,
            replica.log_store(),
            replica.state_machine(),
        )
        .await
        .map_err(|e| NodeError::Stopped(e.to_string()))?;
        Ok(Self { raft, timings: settings.timings })
    }

    /// The timings it runs with.
    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// Calls `f` with the node's latest state, borrowed (see [`State`]).
    pub fn state<R>(&self, f: impl FnOnce(State<'_>) -> R) -> R {
        let metrics = self.raft.metrics();
        let m = metrics.borrow_watched();
        f(State { m: &m })
    }

    /// A stream that yields whenever the node's state may have changed
    /// (several changes between two polls yield once), and ends when the
    /// node stops. It costs nothing while the node is quiet: for watching
    /// many groups from one task without reading each one periodically.
    pub fn changes(&self) -> impl futures::Stream<Item = ()> + Send + Unpin + 'static + use<> {
        let rx = self.raft.metrics();
        Box::pin(futures::stream::unfold(rx, |mut rx| async move {
            rx.changed().await.ok()?;
            Some(((), rx))
        }))
    }

    /// Whether this replica leads its group now.
    pub fn is_leader(&self) -> bool {
        self.raft.is_leader()
    }

    /// The term this replica leads, if it leads (its vote for itself was
    /// granted by a quorum).
    pub fn leader_term(&self) -> Option<u64> {
        self.raft.as_leader().ok().map(|l| l.to_committed_leader_id().term)
    }

    /// Waits up to `timeout` until `until` holds of the node's state.
    /// Returns whether it did.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        what: &str,
        until: impl Fn(State<'_>) -> bool + Send,
    ) -> bool {
        self.raft.wait(Some(timeout)).metrics(move |m| until(State { m }), what).await.is_ok()
    }

    /// Waits up to `timeout` until the entry at `index` is applied here.
    /// Returns whether it was.
    pub async fn wait_applied(&self, index: u64, timeout: Duration) -> bool {
        self.raft.wait(Some(timeout)).applied_index_at_least(Some(index), "applied").await.is_ok()
    }

    /// Proposes `batch` as the leader of `term`: accepted only if this
    /// replica still leads that term, so a batch checked against one term's
    /// state is never appended under another's.
    ///
    /// # Errors
    /// [`ProposeError::NotLeader`] if it does not lead;
    /// [`ProposeError::Unavailable`] if it leads another term (retry) or
    /// the node has stopped.
    pub async fn propose(&self, batch: RecordBatch, term: u64) -> Result<Pending, ProposeError> {
        let leader_id = match self.raft.as_leader() {
            Ok(l) if l.to_committed_leader_id().term == term => l.to_committed_leader_id(),
            Ok(l) => {
                let now = l.to_committed_leader_id().term;
                return Err(ProposeError::Unavailable(format!(
                    "this replica leads term {now} now, not {term}: retry"
                )));
            }
            Err(f) => return Err(ProposeError::NotLeader { leader: f.leader_id }),
        };
        let (responder, rx) = ProgressResponder::complete_only();
        self.raft
            .write(batch)
            .with_leader(leader_id)
            .responder(responder)
            .await
            .map_err(|e| ProposeError::Unavailable(format!("raft stopped: {e}")))?;
        Ok(Pending { rx })
    }

    /// Proposes `batch` and waits until it is committed and applied.
    ///
    /// # Errors
    /// As [`RaftNode::propose`] and [`Pending::committed`].
    pub async fn write(&self, batch: RecordBatch) -> Result<AppendResult, ProposeError> {
        match self.raft.client_write(batch).await {
            Ok(resp) => Ok(resp.data),
            Err(e) => Err(client_write_error(e)),
        }
    }

    /// Commits a blank entry of this leader's term and waits until it is
    /// applied here: everything committed before is applied then (a read
    /// barrier, Raft paper §8). Returns where it landed (a blank entry
    /// holds no records: its offsets are the log end).
    ///
    /// # Errors
    /// As [`RaftNode::write`].
    pub async fn write_barrier(&self) -> Result<AppendResult, ProposeError> {
        match self.raft.write_blank().await {
            Ok(resp) => Ok(resp.data),
            Err(e) => Err(client_write_error(e)),
        }
    }

    /// The leader's node id and the peer address its membership records,
    /// as this replica knows them.
    pub fn leader_address(&self) -> Option<(NodeId, String)> {
        self.state(|s| {
            let leader = s.leader()?;
            s.members().find(|(n, _)| *n == leader).map(|(n, addr)| (n, addr.to_owned()))
        })
    }

    /// Makes sure this leader's lease is fresh before it proposes: a leader
    /// whose ticker was parked (an idle, quiesced group) has not heard from
    /// a quorum lately, and the node refuses writes and membership changes
    /// until it has (the lease, one maximum election timeout; Raft thesis
    /// §6.4). Sends a heartbeat and waits up to `wait` for a quorum to
    /// acknowledge one sent after now. Returns whether the lease is fresh.
    pub async fn renew_lease(&self, wait: Duration) -> bool {
        let lease = self.timings.election_timeout_max;
        let now = TypeConfig::now();
        let (voters, fresh) =
            self.state(|s| (s.voters().count(), s.since_quorum_ack().is_some_and(|d| d < lease / 2)));
        // A group of one voter is its own quorum: its lease is always valid.
        if voters <= 1 || fresh {
            return true;
        }
        if self.raft.trigger().heartbeat().await.is_err() {
            return false;
        }
        self.raft
            .wait(Some(wait))
            .metrics(|m| m.last_quorum_acked.as_ref().is_some_and(|t| **t >= now), "quorum acked a heartbeat")
            .await
            .is_ok()
    }

    /// Runs or parks the node's ticker (a leader's heartbeats, a follower's
    /// election timer where elections are on).
    pub fn set_ticking(&self, on: bool) {
        self.raft.runtime_config().tick(on);
    }

    /// Switches the node's own election timer on or off. Off, it campaigns
    /// only when told ([`RaftNode::campaign`]).
    pub fn set_elections(&self, on: bool) {
        self.raft.runtime_config().elect(on);
    }

    /// Starts an election now (with a pre-vote first, thesis §9.6).
    pub async fn campaign(&self) {
        let _ = self.raft.trigger().elect(true).await;
    }

    /// Asks this leader to hand leadership to `to` (Raft thesis §3.10).
    pub async fn transfer_leader(&self, to: NodeId) {
        let _ = self.raft.trigger().transfer_leader(to).await;
    }

    /// Starts building a snapshot now (the settings build one every
    /// `snapshot_after_entries` on their own); see [`State::snapshot`].
    ///
    /// # Errors
    /// [`NodeError::Stopped`].
    pub async fn build_snapshot(&self) -> Result<(), NodeError> {
        self.raft.trigger().snapshot().await.map_err(|e| NodeError::Stopped(e.to_string()))
    }

    /// Purges the log up to and including `index`, which a snapshot must
    /// cover; see [`State::purged`]. (Under load the settings' own policy
    /// is safer: openraft issue #2116.)
    ///
    /// # Errors
    /// [`NodeError::Stopped`].
    pub async fn purge_log(&self, index: u64) -> Result<(), NodeError> {
        self.raft.trigger().purge_log(index).await.map_err(|e| NodeError::Stopped(e.to_string()))
    }

    /// Whether the group has ever been initialized (on this replica's log).
    ///
    /// # Errors
    /// [`NodeError::Stopped`].
    pub async fn is_initialized(&self) -> Result<bool, NodeError> {
        self.raft.is_initialized().await.map_err(|e| NodeError::Stopped(e.to_string()))
    }

    /// Founds the group with `voters` (node id → peer address) as its first
    /// configuration; refused if the group already has a log.
    ///
    /// # Errors
    /// [`NodeError::Refused`]: already initialized, or the node could not
    /// (it stopped).
    pub async fn initialize(&self, voters: BTreeMap<NodeId, String>) -> Result<(), NodeError> {
        let members: BTreeMap<NodeId, Node> =
            voters.into_iter().map(|(n, addr)| (n, Node { addr })).collect();
        self.raft.initialize(members).await.map_err(|e| NodeError::Refused(e.to_string()))
    }

    /// Adds `node` at `addr` as a learner (it receives the log but does not
    /// vote; Raft thesis §4.2.1), without waiting for it to catch up.
    ///
    /// # Errors
    /// [`NodeError::NotLeader`], [`NodeError::Refused`], [`NodeError::Stopped`].
    pub async fn add_learner(&self, node: NodeId, addr: String) -> Result<(), NodeError> {
        self.raft.add_learner(node, Node { addr }, false).await.map(|_| ()).map_err(membership_error)
    }

    /// Changes the voters to `voters` through joint consensus (Raft paper
    /// §6): every new voter must already be a learner.
    ///
    /// # Errors
    /// [`NodeError::NotLeader`], [`NodeError::Refused`], [`NodeError::Stopped`].
    pub async fn change_voters(&self, voters: BTreeSet<NodeId>) -> Result<(), NodeError> {
        self.raft.change_membership(voters, false).await.map(|_| ()).map_err(membership_error)
    }

    /// Stops the node and waits for its tasks.
    ///
    /// # Errors
    /// A task that panicked or could not be joined.
    pub async fn shutdown(&self) -> Result<(), NodeError> {
        self.raft.shutdown().await.map_err(|e| NodeError::Stopped(e.to_string()))
    }

    /// Answers a peer's RequestVote, or pre-vote.
    ///
    /// # Errors
    /// [`HandleError`].
    pub async fn handle_vote(
        &self,
        req: &pb::VoteRequest,
        pre_vote: bool,
    ) -> Result<pb::VoteResponse, HandleError> {
        let v = wire::vote_request_from_wire(req).map_err(|e| HandleError::Invalid(e.to_string()))?;
        let answer = if pre_vote { self.raft.pre_vote(v).await } else { self.raft.vote(v).await };
        answer.map(|a| wire::vote_response_to_wire(&a)).map_err(|e| HandleError::Stopped(e.to_string()))
    }

    /// Answers a peer's AppendEntries.
    ///
    /// # Errors
    /// [`HandleError`].
    pub async fn handle_append(&self, req: pb::AppendEntriesRequest) -> Result<Appended, HandleError> {
        let rpc = wire::append_request_from_wire(req).map_err(|e| HandleError::Invalid(e.to_string()))?;
        let a = self.raft.append_entries(rpc).await.map_err(|e| HandleError::Stopped(e.to_string()))?;
        Ok(Appended { response: wire::append_response_to_wire(&a), success: a.is_success() })
    }

    /// Answers a leader's request to take over.
    ///
    /// # Errors
    /// [`HandleError`].
    pub async fn handle_transfer(
        &self,
        req: &pb::TransferLeaderRequest,
    ) -> Result<pb::TransferLeaderResponse, HandleError> {
        let rpc = wire::transfer_request_from_wire(req).map_err(|e| HandleError::Invalid(e.to_string()))?;
        let a =
            self.raft.handle_transfer_leader(rpc).await.map_err(|e| HandleError::Stopped(e.to_string()))?;
        Ok(wire::transfer_response_to_wire(&a))
    }

    /// Installs a received snapshot ([`crate::snapshot::receive`]) and
    /// removes its staging directory, installed or not (unless this future
    /// is dropped midway: [`crate::snapshot::clear_staging`] sweeps it).
    /// Answers with this node's vote.
    ///
    /// # Errors
    /// [`HandleError::Stopped`].
    pub async fn install_snapshot(&self, received: Received) -> Result<pb::SnapshotResponse, HandleError> {
        let staged = received.files.dir.clone();
        let snapshot = Snapshot { meta: received.meta, snapshot: received.files };
        let result = self.raft.install_full_snapshot(received.vote, snapshot).await;
        // The state machine adopted its own copy (hard links); the staging
        // directory is no longer needed either way.
        let _ = std::fs::remove_dir_all(&staged);
        let r = result.map_err(|e| HandleError::Stopped(e.to_string()))?;
        Ok(pb::SnapshotResponse { error: None, vote: Some(wire::vote_to_wire(&r.vote)) })
    }
}

fn client_write_error(
    e: openraft::error::RaftError<TypeConfig, openraft::error::ClientWriteError<TypeConfig>>,
) -> ProposeError {
    match e.api_error() {
        Some(ClientWriteError::ForwardToLeader(f)) => ProposeError::NotLeader { leader: f.leader_id },
        _ => ProposeError::Unavailable(e.to_string()),
    }
}

fn membership_error(
    e: openraft::error::RaftError<TypeConfig, openraft::error::ClientWriteError<TypeConfig>>,
) -> NodeError {
    match e.api_error() {
        Some(ClientWriteError::ForwardToLeader(f)) => NodeError::NotLeader { leader: f.leader_id },
        Some(other) => NodeError::Refused(other.to_string()),
        None => NodeError::Stopped(e.to_string()),
    }
}

/// The log position a candidate's vote request carries, for a recovering
/// replica's check (the broker's recovery); `None`: an empty log.
pub fn candidate_last_log(req: &pb::VoteRequest) -> Option<LogPosition> {
    req.last_log_id.as_ref().map(|l| LogPosition { term: l.term, index: l.index })
}

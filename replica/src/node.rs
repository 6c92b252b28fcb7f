//! [`RaftNode`]: one replica's Raft node, driven through Ferrolog's own
//! interface.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ferrolog_proto::raft as pb;
use ferrolog_raft_store::state_machine::{PartitionRaft, Snapshot};
use ferrolog_raft_store::types::{Node, NodeId, TypeConfig, Vote};
use ferrolog_raft_store::{AppendResult, FOUNDING_TERM, ProposalKey, RecordBatch, Replica, wire};
use openraft::async_runtime::watch::WatchReceiver;
use openraft::error::ClientWriteError;
use openraft::impls::ProgressResponder;
use openraft::type_config::TypeConfigExt;

use crate::lifecycle::{InUse, Lifecycle};
use crate::settings::{Timings, ValidSettings};
use crate::snapshot::Received;
use crate::state::{LogPosition, State};
use crate::transport::{GroupNetwork, PeerTransport, PeerUnreachable, SharedTransport};

/// One replica's Raft node: a partition's (or the metadata group's) member
/// on this broker, over its storage ([`Replica`]). Cheap to clone; clones
/// drive the same node. An idle follower's node may be made dormant
/// ([`RaftNode::make_dormant`]; [`crate::lifecycle`]): every method works
/// the same, starting the node again first where it needs to.
#[derive(Clone)]
pub struct RaftNode {
    pub(crate) life: Arc<Lifecycle>,
    timings: Timings,
    /// A recovering replica's vote floor (see [`crate::recovery`]).
    pub(crate) vote_floor: Arc<std::sync::Mutex<Option<crate::recovery::LastLog>>>,
    /// A recovering replica's latest answer from its leader: (term, leader,
    /// the leader's last log index) (see [`crate::recovery`]).
    pub(crate) leader_last: Arc<std::sync::Mutex<Option<(u64, NodeId, u64)>>>,
    /// Asks a peer replica (node id, address) for its log state, through
    /// the node's transport (see [`crate::recovery`]).
    pub(crate) ask_log_state: AskLogState,
}

/// [`RaftNode::ask_log_state`]'s type: the transport's `log_state`, with
/// the group filled in.
pub(crate) type AskLogState = Arc<
    dyn Fn(
            NodeId,
            String,
        ) -> futures::future::BoxFuture<'static, Result<pb::LogStateResponse, PeerUnreachable>>
        + Send
        + Sync,
>;

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
    /// With [`crate::InjectedBug::AckBeforeCommit`] on: the answer it
    /// gives if the commit takes longer than [`crate::inject::ACK_EARLY_MS`].
    early: Option<AppendResult>,
    /// An idempotent batch's key and its replica: a refusal is marked in
    /// the replica's [`ferrolog_raft_store::AppendWatch`] as soon as it is
    /// known, before the caller hears of it.
    watched: Option<(Replica, ProposalKey)>,
}

impl Pending {
    /// Waits until the batch is committed by a majority and applied here;
    /// returns where it landed.
    ///
    /// # Errors
    /// [`ProposeError::NotLeader`] if leadership moved first;
    /// [`ProposeError::Unavailable`] if the node stopped or dropped it.
    pub async fn committed(self) -> Result<AppendResult, ProposeError> {
        let Pending { mut rx, early, watched } = self;
        let answer = match early {
            None => rx.await,
            Some(guess) => {
                let early = Duration::from_millis(crate::inject::ACK_EARLY_MS);
                match tokio::time::timeout(early, &mut rx).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        // The injected bug answers now; the real answer
                        // still reaches the watch.
                        if let Some((replica, key)) = watched {
                            tokio::spawn(async move {
                                if !matches!(rx.await, Ok(Ok(_))) {
                                    replica.append_watch().fail(key);
                                }
                            });
                        }
                        return Ok(guess);
                    }
                }
            }
        };
        if !matches!(answer, Ok(Ok(_)))
            && let Some((replica, key)) = &watched
        {
            replica.append_watch().fail(*key);
        }
        match answer {
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
    /// The replica may have lost entries it acknowledged: it refuses votes
    /// and leadership until it has caught up ([`crate::recovery`]).
    #[error("recovering: {0}")]
    Recovering(String),
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
        Self::start_with(group, node, settings, replica, Arc::new(transport), false).await
    }

    /// Starts the founding leader of a group founded just now
    /// ([`Replica::found`] answered `Founding::Founded` naming `node`):
    /// it leads term [`FOUNDING_TERM`] from its start, with every voter's
    /// vote recorded by the founding, and appends its blank entry at once,
    /// without a pre-vote or a vote round. Otherwise as [`RaftNode::start`].
    ///
    /// Only this first start restores leadership from the stored vote: a
    /// leader started again later (after a crash, or out of dormancy) must
    /// win an election, since its commit index is saved lazily
    /// ([`crate::settings`]). Here nothing was ever committed.
    ///
    /// # Errors
    /// [`NodeError::Stopped`] if the replica is not in the founded state
    /// (its log is more than the founding configuration, its vote is not
    /// the committed founding vote for `node`, or it is recovering), or the
    /// storage cannot be read.
    pub async fn start_founding_leader<T: PeerTransport>(
        group: u64,
        node: NodeId,
        settings: &ValidSettings,
        replica: &Replica,
        transport: T,
    ) -> Result<Self, NodeError> {
        if let Some(why) = replica.recovering() {
            return Err(NodeError::Stopped(format!(
                "not a founding leader: the replica is recovering: {why}"
            )));
        }
        let founded = Vote::new_committed(FOUNDING_TERM, node);
        let last = replica.last_log_id().map(|l| l.index);
        let vote = replica.vote();
        if vote != Some(founded) || last != Some(0) {
            return Err(NodeError::Stopped(format!(
                "not a founding leader: vote {vote:?} (expected {founded:?}), last log index {last:?} (expected 0)"
            )));
        }
        Self::start_with(group, node, settings, replica, Arc::new(transport), true).await
    }

    /// [`RaftNode::start`], restoring a leader from its stored vote on
    /// this first start if `restore_leader`. Not generic: the Raft core is
    /// built here, over `Arc<dyn PeerTransport>`, once for every transport.
    async fn start_with(
        group: u64,
        node: NodeId,
        settings: &ValidSettings,
        replica: &Replica,
        transport: SharedTransport,
        restore_leader: bool,
    ) -> Result<Self, NodeError> {
        let config = settings.raft.clone();
        let store = replica.clone();
        let hold = settings.commit_notice_hold;
        let asker = transport.clone();
        let ask_log_state: AskLogState = Arc::new(move |target, addr| {
            let transport = asker.clone();
            Box::pin(async move {
                let req = pb::LogStateRequest { group_id: group, target_node: target };
                transport.log_state(target, &addr, req, crate::recovery::LOG_STATE_TIMEOUT).await
            })
        });
        let first_network = GroupNetwork { group, transport: transport.clone(), hold };
        let start: crate::lifecycle::Starter = Box::new(move |tick, elect| {
            let network = GroupNetwork { group, transport: transport.clone(), hold };
            let store = store.clone();
            let config = if config.enable_tick == tick && config.enable_elect == elect {
                config.clone()
            } else {
                Arc::new(openraft::Config { enable_tick: tick, enable_elect: elect, ..(*config).clone() })
            };
            Box::pin(async move {
                PartitionRaft::new(node, config, network, store.log_store(), store.state_machine())
                    .await
                    .map_err(|e| NodeError::Stopped(e.to_string()))
            })
        });
        let raft = if restore_leader {
            // The first start only; `start` (kept for restarts out of
            // dormancy) keeps the settings' rule.
            let config =
                Arc::new(openraft::Config { enable_leader_restore: Some(true), ..(*settings.raft).clone() });
            PartitionRaft::new(node, config, first_network, replica.log_store(), replica.state_machine())
                .await
                .map_err(|e| NodeError::Stopped(e.to_string()))?
        } else {
            start(settings.raft.enable_tick, settings.raft.enable_elect).await?
        };
        let life = Lifecycle::new(raft, start, replica.clone(), &settings.raft);
        Ok(Self {
            life: Arc::new(life),
            timings: settings.timings,
            vote_floor: Arc::default(),
            leader_last: Arc::default(),
            ask_log_state,
        })
    }

    /// The running instance of the Raft library, started again first if
    /// the node is dormant.
    async fn running(&self, why: &'static str) -> Result<InUse<'_>, String> {
        self.life.running(why).await
    }

    /// Stops the node's Raft library instance, keeping its last state, if
    /// it is a follower of a known leader with everything in its log
    /// committed and applied, unused for `idle` (see [`crate::lifecycle`]).
    /// Its next use starts it again. Returns whether it went dormant.
    ///
    /// # Errors
    /// [`NodeError::Stopped`]: its log could not be fsynced.
    pub async fn make_dormant(&self, idle: Duration) -> Result<bool, NodeError> {
        self.life.make_dormant(idle).await
    }

    /// Whether the node is dormant now.
    pub fn is_dormant(&self) -> bool {
        self.life.is_dormant()
    }

    /// A refusal of a pre-vote, answered from a dormant node's kept state
    /// (its vote and last log id) without starting it: for a broker that
    /// refuses the pre-vote whatever the node would say (a follower that
    /// presumes a live leader, Raft thesis §9.6). `None` if the node runs.
    pub fn dormant_pre_vote_refusal(&self) -> Option<pb::VoteResponse> {
        let (vote, last) = self.life.with_dormant(|m| (m.vote, self.life.last_log_id()))?;
        let refused = openraft::raft::VoteResponse::<TypeConfig>::new(vote, last, false);
        Some(wire::vote_response_to_wire(&refused))
    }

    /// Turns `bug` on for this node and its clones, for a checker's
    /// negative control ([`crate::inject`]); says so at error level.
    /// Returns whether it is on: only debug builds honour it.
    pub fn inject(&self, bug: crate::InjectedBug) -> bool {
        if !cfg!(debug_assertions) {
            tracing::error!(?bug, "a release build injects no bug");
            return false;
        }
        match bug {
            crate::InjectedBug::AckBeforeCommit => self.life.ack_before_commit.store(true, Ordering::Relaxed),
            crate::InjectedBug::VoteWhileRecovering => {
                self.life.vote_while_recovering.store(true, Ordering::Relaxed)
            }
        }
        tracing::error!(?bug, "AN INJECTED BUG IS ACTIVE: this replica breaks its guarantees on purpose");
        true
    }

    /// The timings it runs with.
    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// Calls `f` with the node's latest state, borrowed (see [`State`]).
    pub fn state<R>(&self, f: impl FnOnce(State<'_>) -> R) -> R {
        self.life.with(|node| match node {
            Ok(raft) => {
                let metrics = raft.metrics();
                let m = metrics.borrow_watched();
                f(State { m: &m })
            }
            Err(m) => f(State { m }),
        })
    }

    /// A stream that yields whenever the node's state may have changed
    /// (several changes between two polls yield once; going dormant and
    /// waking count as changes), and ends when the node stops for good. It
    /// costs nothing while the node is quiet: for watching many groups
    /// from one task without reading each one periodically.
    pub fn changes(&self) -> impl futures::Stream<Item = ()> + Send + Unpin + 'static + use<> {
        self.life.changes()
    }

    /// Whether this replica leads its group now (a dormant node never does).
    pub fn is_leader(&self) -> bool {
        self.life.with(|node| node.is_ok_and(|raft| raft.is_leader()))
    }

    /// The term this replica leads, if it leads (its vote for itself was
    /// granted by a quorum and it acts as leader).
    ///
    /// Both the role and the flushed vote are read, from one snapshot of
    /// the node's state: the library reports the last flushed vote, and a
    /// leader started again keeps its committed vote for itself on disk
    /// while it starts as a follower (leadership is not restored,
    /// [`crate::settings`]), so the vote alone named it leader of its old
    /// term until it next voted.
    pub fn leader_term(&self) -> Option<u64> {
        self.life.with(|node| {
            let raft = node.ok()?;
            let metrics = raft.metrics();
            let m = metrics.borrow_watched();
            let (vote, leader) = (&m.vote, &m.vote.leader_id);
            let leads = vote.committed && m.state == openraft::ServerState::Leader && leader.node_id == m.id;
            leads.then_some(leader.term)
        })
    }

    /// Waits up to `timeout` until `until` holds of the node's state.
    /// Returns whether it did.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        what: &str,
        until: impl Fn(State<'_>) -> bool + Send,
    ) -> bool {
        if self.state(&until) {
            return true;
        }
        let Ok(raft) = self.running("wait_for").await else { return false };
        raft.wait(Some(timeout)).metrics(move |m| until(State { m }), what).await.is_ok()
    }

    /// Waits up to `timeout` until the entry at `index` is applied here.
    /// Returns whether it was.
    pub async fn wait_applied(&self, index: u64, timeout: Duration) -> bool {
        if self.state(|s| s.last_applied().is_some_and(|a| a.index >= index)) {
            return true;
        }
        let Ok(raft) = self.running("wait_applied").await else { return false };
        raft.wait(Some(timeout)).applied_index_at_least(Some(index), "applied").await.is_ok()
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
        // A dormant node is a follower: it leads no term.
        let leader = self.life.with(|node| match node {
            Ok(raft) => Ok(raft.clone()),
            Err(m) => Err(ProposeError::NotLeader { leader: m.current_leader }),
        })?;
        let leader_id = match leader.as_leader() {
            Ok(l) if l.to_committed_leader_id().term == term => l.to_committed_leader_id(),
            Ok(l) => {
                let now = l.to_committed_leader_id().term;
                return Err(ProposeError::Unavailable(format!(
                    "this replica leads term {now} now, not {term}: retry"
                )));
            }
            Err(f) => return Err(ProposeError::NotLeader { leader: f.leader_id }),
        };
        // Only the injected bug needs it (it takes the log's lock).
        let early = self.life.ack_before_commit.load(Ordering::Relaxed).then(|| AppendResult {
            base_offset: self.life.replica().log_end_offset(),
            record_count: batch.record_count,
        });
        let watched = ProposalKey::of(&batch).map(|key| (self.life.replica().clone(), key));
        let (responder, rx) = ProgressResponder::complete_only();
        leader
            .write(batch)
            .with_leader(leader_id)
            .responder(responder)
            .await
            .map_err(|e| ProposeError::Unavailable(format!("raft stopped: {e}")))?;
        Ok(Pending { rx, early, watched })
    }

    /// Proposes `batch` and waits until it is committed and applied.
    ///
    /// # Errors
    /// As [`RaftNode::propose`] and [`Pending::committed`].
    pub async fn write(&self, batch: RecordBatch) -> Result<AppendResult, ProposeError> {
        let raft = self.running("write").await.map_err(ProposeError::Unavailable)?;
        match raft.client_write(batch).await {
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
        let raft = self.running("write_barrier").await.map_err(ProposeError::Unavailable)?;
        match raft.write_blank().await {
            Ok(resp) => Ok(resp.data),
            Err(e) => Err(client_write_error(e)),
        }
    }

    /// ReadIndex (Raft thesis §6.4): confirms that this replica still leads
    /// its group (a heartbeat round acknowledged by a quorum, with no log
    /// entry written) and waits until everything committed before the call
    /// is applied here. Returns the log index it read at; the replica's
    /// high watermark then covers every record up to it. Bounded by
    /// `timeout`.
    ///
    /// # Errors
    /// [`ProposeError::NotLeader`] if it does not lead (or was deposed);
    /// [`ProposeError::Unavailable`] if no quorum answered within `timeout`
    /// or the node has stopped.
    pub async fn read_index(&self, timeout: Duration) -> Result<u64, ProposeError> {
        let raft = self.running("read_index").await.map_err(ProposeError::Unavailable)?;
        let read = raft.ensure_linearizable(openraft::raft::ReadPolicy::ReadIndex);
        match tokio::time::timeout(timeout, read).await {
            Ok(Ok(read)) => Ok(read.log_id().index),
            Ok(Err(e)) => match e.api_error() {
                Some(openraft::error::LinearizableReadError::ForwardToLeader(f)) => {
                    Err(ProposeError::NotLeader { leader: f.leader_id })
                }
                _ => Err(ProposeError::Unavailable(e.to_string())),
            },
            Err(_) => Err(ProposeError::Unavailable(format!(
                "no quorum confirmed the leadership within {timeout:?}"
            ))),
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
        let Ok(raft) = self.running("renew_lease").await else { return false };
        if raft.trigger().heartbeat().await.is_err() {
            return false;
        }
        raft.wait(Some(wait))
            .metrics(|m| m.last_quorum_acked.as_ref().is_some_and(|t| **t >= now), "quorum acked a heartbeat")
            .await
            .is_ok()
    }

    /// Runs or parks the node's ticker (a leader's heartbeats, a follower's
    /// election timer where elections are on).
    pub fn set_ticking(&self, on: bool) {
        self.life.set_ticking(on);
    }

    /// Switches the node's own election timer on or off. Off, it campaigns
    /// only when told ([`RaftNode::campaign`]).
    pub fn set_elections(&self, on: bool) {
        self.life.set_elections(on);
    }

    /// Sends one round of heartbeats now, if this replica leads, whether or
    /// not its ticker runs ([`RaftNode::set_ticking`]); does not wait for
    /// the answers. A stopped node does nothing.
    pub async fn heartbeat(&self) {
        if let Ok(raft) = self.running("heartbeat").await {
            let _ = raft.trigger().heartbeat().await;
        }
    }

    /// Starts an election now (with a pre-vote first, thesis §9.6).
    pub async fn campaign(&self) {
        if let Ok(raft) = self.running("campaign").await {
            let _ = raft.trigger().elect(true).await;
        }
    }

    /// Asks this leader to hand leadership to `to` (Raft thesis §3.10).
    pub async fn transfer_leader(&self, to: NodeId) {
        if let Ok(raft) = self.running("transfer_leader").await {
            let _ = raft.trigger().transfer_leader(to).await;
        }
    }

    /// Starts building a snapshot now (the settings build one every
    /// `snapshot_after_entries` on their own); see [`State::snapshot`].
    ///
    /// # Errors
    /// [`NodeError::Stopped`].
    pub async fn build_snapshot(&self) -> Result<(), NodeError> {
        self.running("build_snapshot")
            .await
            .map_err(NodeError::Stopped)?
            .trigger()
            .snapshot()
            .await
            .map_err(|e| NodeError::Stopped(e.to_string()))
    }

    /// Purges the log up to and including `index`, which a snapshot must
    /// cover; see [`State::purged`]. Only through entries Raft has
    /// applied ([`State::last_applied`]): openraft issue #2116's race needs
    /// a purge past applied entries.
    ///
    /// # Errors
    /// [`NodeError::Stopped`].
    pub async fn purge_log(&self, index: u64) -> Result<(), NodeError> {
        self.running("purge_log")
            .await
            .map_err(NodeError::Stopped)?
            .trigger()
            .purge_log(index)
            .await
            .map_err(|e| NodeError::Stopped(e.to_string()))
    }

    /// Whether the group has ever been initialized (on this replica's log).
    ///
    /// # Errors
    /// [`NodeError::Stopped`].
    pub async fn is_initialized(&self) -> Result<bool, NodeError> {
        self.running("is_initialized")
            .await
            .map_err(NodeError::Stopped)?
            .is_initialized()
            .await
            .map_err(|e| NodeError::Stopped(e.to_string()))
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
        let raft = self.running("initialize").await.map_err(NodeError::Stopped)?;
        raft.initialize(members).await.map_err(|e| NodeError::Refused(e.to_string()))
    }

    /// Adds `node` at `addr` as a learner (it receives the log but does not
    /// vote; Raft thesis §4.2.1), without waiting for it to catch up.
    ///
    /// # Errors
    /// [`NodeError::NotLeader`], [`NodeError::Refused`], [`NodeError::Stopped`].
    pub async fn add_learner(&self, node: NodeId, addr: String) -> Result<(), NodeError> {
        let raft = self.running("add_learner").await.map_err(NodeError::Stopped)?;
        raft.add_learner(node, Node { addr }, false).await.map(|_| ()).map_err(membership_error)
    }

    /// Changes the voters to `voters` through joint consensus (Raft paper
    /// §6): every new voter must already be a learner. Returns once both
    /// the joint and the final configuration are committed.
    ///
    /// # Errors
    /// [`NodeError::NotLeader`], [`NodeError::Refused`], [`NodeError::Stopped`].
    pub async fn change_voters(&self, voters: BTreeSet<NodeId>) -> Result<(), NodeError> {
        let raft = self.running("change_voters").await.map_err(NodeError::Stopped)?;
        raft.change_membership(voters, false).await.map(|_| ()).map_err(membership_error)
    }

    /// As [`RaftNode::change_voters`], but the voters it drops stay in the
    /// group as learners (they keep receiving the log, and never vote or
    /// campaign), in one change.
    ///
    /// # Errors
    /// As [`RaftNode::change_voters`].
    pub async fn change_voters_keeping_learners(&self, voters: BTreeSet<NodeId>) -> Result<(), NodeError> {
        let raft = self.running("change_voters").await.map_err(NodeError::Stopped)?;
        raft.change_membership(voters, true).await.map(|_| ()).map_err(membership_error)
    }

    /// Removes `nodes`, which must be learners, from the membership: the
    /// leader stops replicating to them. Returns once the change is
    /// committed.
    ///
    /// # Errors
    /// [`NodeError::NotLeader`], [`NodeError::Refused`] (one is a voter),
    /// [`NodeError::Stopped`].
    pub async fn remove_learners(&self, nodes: BTreeSet<NodeId>) -> Result<(), NodeError> {
        let raft = self.running("remove_learners").await.map_err(NodeError::Stopped)?;
        raft.change_membership(openraft::ChangeMembers::RemoveNodes(nodes), false)
            .await
            .map(|_| ())
            .map_err(membership_error)
    }

    /// Stops the node and waits for its tasks.
    ///
    /// # Errors
    /// A task that panicked or could not be joined.
    pub async fn shutdown(&self) -> Result<(), NodeError> {
        self.life.shutdown().await
    }

    /// Answers a peer's RequestVote, or pre-vote.
    ///
    /// # Errors
    /// [`HandleError::Recovering`]: a recovering replica refuses a
    /// candidate whose log may lack entries it had acknowledged
    /// ([`crate::recovery::may_vote`]); otherwise [`HandleError`].
    pub async fn handle_vote(
        &self,
        req: &pb::VoteRequest,
        pre_vote: bool,
    ) -> Result<pb::VoteResponse, HandleError> {
        let v = wire::vote_request_from_wire(req).map_err(|e| HandleError::Invalid(e.to_string()))?;
        self.refuse_vote_if_recovering(req)?;
        // A dormant follower that acknowledged its leader's heartbeat
        // within the lease refuses other candidates, as a running one does;
        // a leadership transfer is not refused (Raft thesis §3.10).
        if !req.leadership_transfer
            && self.life.leased()
            && let Some(refused) = self.dormant_pre_vote_refusal()
        {
            return Ok(refused);
        }
        let raft = self.running("vote").await.map_err(HandleError::Stopped)?;
        let answer = if pre_vote { raft.pre_vote(v).await } else { raft.vote(v).await };
        answer.map(|a| wire::vote_response_to_wire(&a)).map_err(|e| HandleError::Stopped(e.to_string()))
    }

    /// Answers a peer's AppendEntries.
    ///
    /// # Errors
    /// [`HandleError`].
    pub async fn handle_append(&self, req: pb::AppendEntriesRequest) -> Result<Appended, HandleError> {
        if let Some(answered) = self.dormant_heartbeat(&req) {
            return Ok(answered);
        }
        let rpc = wire::append_request_from_wire(req).map_err(|e| HandleError::Invalid(e.to_string()))?;
        let raft = self.running("handle_append").await.map_err(HandleError::Stopped)?;
        let a = raft.append_entries(rpc).await.map_err(|e| HandleError::Stopped(e.to_string()))?;
        Ok(Appended { response: wire::append_response_to_wire(&a), success: a.is_success() })
    }

    /// A heartbeat a dormant node answers from its kept state without
    /// starting: from the leader it follows (the same vote), ending where
    /// its log ends (the same last log id) and with the commit index it
    /// knows. The node's own answer would be the same (Raft paper §5.3:
    /// the logs match there, nothing to store, commit or apply), and it
    /// keeps the leader's lease as the node would (refusing other
    /// candidates' votes for one maximum election timeout, see
    /// [`RaftNode::handle_vote`]); any other message starts it. Answered
    /// only while the node is neither starting nor stopping, and not
    /// after it stopped for good. Leaders send heartbeats to idle groups' followers
    /// when they renew their lease (a first write after a quiet spell) or
    /// when a broker seemed to come back, and, while thousands of groups
    /// elect at once, woke nearly every dormant follower again (measured
    /// at 10,000 partitions: 10,156 wakes in four minutes on one broker).
    fn dormant_heartbeat(&self, req: &pb::AppendEntriesRequest) -> Option<Appended> {
        if !req.entries.is_empty() {
            return None;
        }
        let same = self.life.with_dormant(|m| {
            let Some(last) = self.life.last_log_id() else { return false };
            req.vote.as_ref() == Some(&wire::vote_to_wire(&m.vote))
                && req.prev_log_id.as_ref() == Some(&wire::log_id_to_wire(&last))
                && req.leader_commit.as_ref() == m.local_committed.as_ref().map(wire::log_id_to_wire).as_ref()
        })?;
        if !same {
            return None;
        }
        self.life.lease_for(self.timings.election_timeout_max);
        let success = openraft::raft::AppendEntriesResponse::<TypeConfig>::Success;
        Some(Appended { response: wire::append_response_to_wire(&success), success: true })
    }

    /// Answers a leader's request to take over.
    ///
    /// # Errors
    /// [`HandleError::Recovering`] while the replica is recovering (it
    /// takes no leadership, [`crate::recovery`]); otherwise [`HandleError`].
    pub async fn handle_transfer(
        &self,
        req: &pb::TransferLeaderRequest,
    ) -> Result<pb::TransferLeaderResponse, HandleError> {
        let rpc = wire::transfer_request_from_wire(req).map_err(|e| HandleError::Invalid(e.to_string()))?;
        self.refuse_transfer_if_recovering()?;
        let raft = self.running("handle_transfer").await.map_err(HandleError::Stopped)?;
        let a = raft.handle_transfer_leader(rpc).await.map_err(|e| HandleError::Stopped(e.to_string()))?;
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
        let (fs, staged) = (received.files.fs.clone(), received.files.dir.clone());
        let snapshot = Snapshot { meta: received.meta, snapshot: received.files };
        let result = match self.running("install_snapshot").await {
            Ok(raft) => raft.install_full_snapshot(received.vote, snapshot).await.map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        // The state machine adopted its own copy (hard links); the staging
        // directory is no longer needed either way.
        let _ = fs.remove_dir_all(&staged);
        let r = result.map_err(HandleError::Stopped)?;
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
/// replica's check ([`crate::recovery`]); `None`: an empty log.
pub fn candidate_last_log(req: &pb::VoteRequest) -> Option<LogPosition> {
    req.last_log_id.as_ref().map(|l| LogPosition { term: l.term, index: l.index })
}

//! How a group's node reaches its peers: the broker implements
//! [`PeerTransport`] (one connection per peer broker, shared by every
//! group), and this module adapts it to what the Raft library asks for.
//! Only the peer protocol's own messages (`ferrolog.raft.v1`) cross this
//! edge; the library's types never do.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ferrolog_proto::raft as pb;
use ferrolog_raft_store::state_machine::Snapshot;
use ferrolog_raft_store::types::{
    AppendEntriesRequest, AppendEntriesResponse, Node, NodeId, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, TypeConfig, Vote, VoteRequest, VoteResponse,
};
use ferrolog_raft_store::wire;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::v2::RaftNetworkV2;
use openraft::network::{RPCOption, RaftNetworkFactory};
use openraft::raft::StreamAppendResult;

/// A peer could not be asked: no connection, a timeout, a transport error.
/// The node backs off from an unreachable peer before it asks again.
#[derive(Debug, thiserror::Error)]
#[error("peer unreachable: {0}")]
pub struct PeerUnreachable(pub String);

/// Sends peer protocol messages to the replica `target` of a group on
/// another broker, at `addr` (the address its group membership recorded;
/// the transport may know a newer one). `timeout` is the Raft library's
/// limit for the request (the transport may raise it to a floor of its
/// own). Every request names its group and target inside.
///
/// An answer carrying a `PeerError` is returned as is: the node treats it
/// as a refusal. A request's future does nothing until first polled (as an
/// `async` block's does): the node may drop one unpolled, as when a
/// snapshot transfer is cancelled before it starts.
///
/// The futures are boxed so that the node holds its transport as
/// `Arc<dyn PeerTransport>`: every node's Raft core is then built over
/// that one type, and the Raft library's generic code is compiled once, in
/// this crate, whatever transport the broker (or a test) brings; debug
/// builds optimize it there (`opt-level = 1` for this crate in the
/// workspace's `[profile.dev]`). Each peer request pays one small
/// allocation for it (the boxed future).
pub trait PeerTransport: Send + Sync + 'static {
    /// AppendEntries (Raft paper §5.3), also the heartbeat.
    fn append_entries<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        req: pb::AppendEntriesRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::AppendEntriesResponse, PeerUnreachable>>;

    /// RequestVote (Raft paper §5.2), or the pre-vote (thesis §9.6) that
    /// changes nothing on the receiver.
    fn vote<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        req: pb::VoteRequest,
        pre_vote: bool,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::VoteResponse, PeerUnreachable>>;

    /// A leader's request that `target` take over (Raft thesis §3.10).
    fn transfer_leader<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        req: pb::TransferLeaderRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::TransferLeaderResponse, PeerUnreachable>>;

    /// Asks `target` for its last log id and whether it is recovering
    /// (for a recovering replica's vote floor, [`crate::recovery`]).
    fn log_state<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        req: pb::LogStateRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::LogStateResponse, PeerUnreachable>>;

    /// Streams a snapshot's chunks to `target` (the node cuts a snapshot's
    /// files into chunks; the receiver takes them with
    /// [`crate::snapshot::receive`]).
    fn install_snapshot<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        chunks: BoxStream<'static, pb::SnapshotChunk>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::SnapshotResponse, PeerUnreachable>>;
}

/// The transport a node holds: shared by its group network, its links and
/// its recovery's log-state asks.
pub(crate) type SharedTransport = Arc<dyn PeerTransport>;

/// The network of one group: the library asks it for a link per peer.
#[derive(Clone)]
pub(crate) struct GroupNetwork {
    pub(crate) group: u64,
    pub(crate) transport: SharedTransport,
    /// How long a commit notice waits to ride along ([`crate::commit_notice`]).
    pub(crate) hold: Duration,
}

impl RaftNetworkFactory<TypeConfig> for GroupNetwork {
    type Network = Link;

    async fn new_client(&mut self, target: NodeId, node: &Node) -> Self::Network {
        Link {
            group: self.group,
            target,
            addr: node.addr.clone(),
            transport: self.transport.clone(),
            hold: self.hold,
        }
    }
}

/// One group's link to one peer replica.
pub(crate) struct Link {
    group: u64,
    target: NodeId,
    /// The target's address in the group's membership.
    addr: String,
    transport: SharedTransport,
    /// How long a commit notice waits to ride along ([`crate::commit_notice`]).
    hold: Duration,
}

fn unreachable(e: impl std::fmt::Display) -> RPCError<TypeConfig> {
    RPCError::Unreachable(Unreachable::from_string(e))
}

fn network_error(e: impl std::fmt::Display) -> RPCError<TypeConfig> {
    RPCError::Network(NetworkError::from_string(e.to_string()))
}

/// A refusal the peer sent instead of an answer.
fn refused(e: Option<&pb::PeerError>) -> Result<(), RPCError<TypeConfig>> {
    match e {
        None => Ok(()),
        Some(e) => Err(network_error(format!("peer refused: {:?}: {}", e.code(), e.message))),
    }
}

impl Link {
    async fn send_vote(
        &self,
        rpc: VoteRequest,
        option: RPCOption,
        pre_vote: bool,
    ) -> Result<VoteResponse, RPCError<TypeConfig>> {
        let req = wire::vote_request_to_wire(self.group, self.target, &rpc);
        let reply = self
            .transport
            .vote(self.target, &self.addr, req, pre_vote, option.hard_ttl())
            .await
            .map_err(unreachable)?;
        refused(reply.error.as_ref())?;
        wire::vote_response_from_wire(&reply).map_err(network_error)
    }
}

impl RaftNetworkV2<TypeConfig> for Link {
    type SnapshotData = ferrolog_raft_store::snapshot::SnapshotFiles;

    /// Sends a replication stream's AppendEntries one at a time, as the
    /// library's default does, except that a commit notice rides along with
    /// the request after it if that comes within the group's hold
    /// ([`crate::commit_notice`]; a zero hold sends each at once).
    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> BoxFuture<
        's,
        Result<
            BoxStream<'s, Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>>,
            RPCError<TypeConfig>,
        >,
    >
    where
        S: Stream<Item = AppendEntriesRequest> + Send + Unpin + 'static,
    {
        let requests = if self.hold.is_zero() {
            input.boxed()
        } else {
            crate::commit_notice::ride_along(input, self.hold)
        };
        let responses = futures::stream::unfold(Some((self, requests)), move |state| {
            let option = option.clone();
            async move {
                let (link, mut requests) = state?;
                let req = requests.next().await?;
                let prev = req.prev_log_id;
                let last = req.entries.last().map(|e| e.log_id).or(prev);
                match link.append_entries(req, option).await {
                    Ok(resp) => {
                        // A partial success stops the stream, as a refusal
                        // does: the library starts another from where the
                        // follower's log ends.
                        let partial = match &resp {
                            AppendEntriesResponse::PartialSuccess(matched) => *matched != last,
                            _ => false,
                        };
                        let result = resp.into_stream_result(prev, last);
                        let go_on = result.is_ok() && !partial;
                        Some((Ok(result), go_on.then_some((link, requests))))
                    }
                    Err(e) => Some((Err(e), None)),
                }
            }
        });
        Box::pin(async move { Ok(Box::pin(responses) as BoxStream<'s, _>) })
    }

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse, RPCError<TypeConfig>> {
        let req = wire::append_request_to_wire(self.group, self.target, &rpc).map_err(network_error)?;
        let reply = self
            .transport
            .append_entries(self.target, &self.addr, req, option.hard_ttl())
            .await
            .map_err(unreachable)?;
        refused(reply.error.as_ref())?;
        wire::append_response_from_wire(&reply).map_err(network_error)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest,
        option: RPCOption,
    ) -> Result<VoteResponse, RPCError<TypeConfig>> {
        self.send_vote(rpc, option, false).await
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest,
        option: RPCOption,
    ) -> Result<VoteResponse, RPCError<TypeConfig>> {
        self.send_vote(rpc, option, true).await
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse, RPCError<TypeConfig>> {
        let req = wire::transfer_request_to_wire(self.group, self.target, &req);
        let reply = self
            .transport
            .transfer_leader(self.target, &self.addr, req, option.hard_ttl())
            .await
            .map_err(unreachable)?;
        refused(reply.error.as_ref())?;
        wire::transfer_response_from_wire(&reply).map_err(network_error)
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse, StreamingError<TypeConfig>> {
        let unreachable = |e: RPCError<TypeConfig>| StreamingError::Unreachable(Unreachable::new(&e));
        let chunks = crate::snapshot::chunks(self.group, self.target, &vote, &snapshot)
            .map_err(|e| StreamingError::Unreachable(Unreachable::new(&e)))?;
        let send =
            self.transport.install_snapshot(self.target, &self.addr, chunks.boxed(), option.hard_ttl());
        let reply = tokio::select! {
            biased;
            closed = cancel => return Err(StreamingError::Closed(closed)),
            r = send => r.map_err(|e| StreamingError::Unreachable(Unreachable::from_string(e)))?,
        };
        refused(reply.error.as_ref()).map_err(unreachable)?;
        let vote = reply.vote.as_ref().ok_or_else(|| network_error("snapshot answer without a vote"));
        Ok(SnapshotResponse::new(wire::vote_from_wire(vote.map_err(unreachable)?)))
    }
}

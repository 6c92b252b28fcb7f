//! The sending side: openraft's `RaftNetworkV2` for one group, over a gRPC
//! channel per peer broker shared by every group.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use ferrolog_proto::raft as pb;
use ferrolog_proto::raft::peer_client::PeerClient;
use ferrolog_raft_store::snapshot::SnapshotFiles;
use ferrolog_raft_store::state_machine::Snapshot;
use ferrolog_raft_store::types::{
    AppendEntriesRequest, AppendEntriesResponse, Node, NodeId, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, TypeConfig, Vote, VoteRequest, VoteResponse,
};
use ferrolog_raft_store::wire;
use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::v2::RaftNetworkV2;
use openraft::network::{RPCOption, RaftNetworkFactory};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use super::protocol::{Stamp, peer_client};
use super::snapshot;
use crate::groups::GroupId;

/// Reset streams a peer channel remembers (h2's default is 10).
const PEER_RESETS_REMEMBERED: usize = 10_000;

/// Lazily connected gRPC channels to peer brokers, by address, shared by
/// all groups of a broker: one HTTP/2 connection per peer.
#[derive(Clone, Debug)]
pub struct PeerAddresses {
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    /// Raft node id → its broker's peer address as the metadata records it
    /// now (see [`PeerAddresses::set_node_addresses`]).
    nodes: Arc<std::sync::RwLock<Arc<HashMap<NodeId, String>>>>,
    /// Peer address → address dialled instead (`peer_routes` of the config).
    routes: Arc<HashMap<SocketAddr, SocketAddr>>,
    /// Shortest timeout of a Raft RPC, whatever openraft asks for; also the
    /// connect timeout.
    min_rpc_timeout: std::time::Duration,
}

impl PeerAddresses {
    /// Channels that dial `routes[addr]` instead of `addr` where a route is
    /// given (peer address → address of, e.g., a proxy in front of it).
    ///
    /// A connection attempt gives up after `min_rpc_timeout`, and Raft
    /// RPCs wait at least that long for an answer. openraft asks for
    /// `heartbeat_interval` on replication's AppendEntries, which would fail
    /// every replication request once a round trip (network plus the
    /// follower's fsync) exceeds it; an answer is still useful until an
    /// election timeout has passed, so brokers pass `election_timeout_min_ms`.
    /// (openraft bounds heartbeats by `heartbeat_interval` itself; votes
    /// already get the election timeout.)
    pub fn new(
        routes: impl IntoIterator<Item = (SocketAddr, SocketAddr)>,
        min_rpc_timeout: std::time::Duration,
    ) -> Self {
        Self {
            channels: Arc::default(),
            nodes: Arc::default(),
            routes: Arc::new(routes.into_iter().collect()),
            min_rpc_timeout,
        }
    }

    /// Replaces the map of Raft node ids to their brokers' current peer
    /// addresses, built from the metadata image on every change. A group's
    /// membership records each node's address when the node joined; a
    /// broker that came back on another address re-registers it with the
    /// controller, and every group dials the address recorded there, not
    /// the one in its membership.
    pub fn set_node_addresses(&self, nodes: HashMap<NodeId, String>) {
        *self.nodes.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(nodes);
    }

    /// The address to dial for Raft node `target`: its broker's current
    /// peer address, else `recorded` (the address in the group's membership).
    pub fn address_of(&self, target: NodeId, recorded: &str) -> String {
        let nodes = self.nodes.read().unwrap_or_else(|p| p.into_inner());
        nodes.get(&target).cloned().unwrap_or_else(|| recorded.to_owned())
    }

    /// The channel to the peer at `addr` (`host:port`), created on first use.
    ///
    /// # Errors
    /// [`Unreachable`] if the address (or its route) is not a valid URI.
    pub fn channel(&self, addr: &str) -> Result<Channel, Unreachable<TypeConfig>> {
        let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let route = addr.parse::<SocketAddr>().ok().and_then(|a| self.routes.get(&a));
        let dial = route.map_or_else(|| addr.to_owned(), SocketAddr::to_string);
        if route.is_some() {
            tracing::info!(peer = addr, via = %dial, "dialling a peer through its route");
        }
        let mut endpoint = Endpoint::from_shared(format!("http://{dial}"))
            .map_err(|e| Unreachable::from_string(format!("bad peer address {dial}: {e}")))?
            .tcp_nodelay(true)
            .http2_keep_alive_interval(std::time::Duration::from_secs(10))
            // See super::PEER_RESETS_MAX: remember more resets, tolerate more.
            .http2_max_concurrent_reset_streams(PEER_RESETS_REMEMBERED)
            .http2_max_local_error_reset_streams(super::PEER_RESETS_MAX);
        if !self.min_rpc_timeout.is_zero() {
            endpoint = endpoint.connect_timeout(self.min_rpc_timeout);
        }
        let channel = endpoint.connect_lazy();
        map.insert(addr.to_owned(), channel.clone());
        Ok(channel)
    }
}

/// Creates the network of one group: openraft asks it for a client per peer.
#[derive(Clone, Debug)]
pub struct PeerNetworkFactory {
    group: GroupId,
    peers: PeerAddresses,
}

impl PeerNetworkFactory {
    /// The network of `group`, using the broker's shared `peers`.
    pub fn new(group: GroupId, peers: PeerAddresses) -> Self {
        Self { group, peers }
    }
}

impl RaftNetworkFactory<TypeConfig> for PeerNetworkFactory {
    type Network = PeerNetwork;

    async fn new_client(&mut self, target: NodeId, node: &Node) -> Self::Network {
        PeerNetwork {
            group: self.group,
            target,
            recorded_addr: node.addr.clone(),
            peers: Some(self.peers.clone()),
            min_timeout: self.peers.min_rpc_timeout,
        }
    }
}

/// One group's link to one peer replica.
#[derive(Debug)]
pub struct PeerNetwork {
    group: GroupId,
    target: NodeId,
    /// The target's address in the group's membership.
    recorded_addr: String,
    /// Channels, and the target's current address (looked up on every RPC,
    /// so a broker that moved is reached by links made before it moved).
    /// `None` only in unit tests (no channels).
    peers: Option<PeerAddresses>,
    /// See [`PeerAddresses::new`].
    min_timeout: std::time::Duration,
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

impl PeerNetwork {
    fn client(&self) -> Result<PeerClient<InterceptedService<Channel, Stamp>>, RPCError<TypeConfig>> {
        let peers = self.peers.as_ref().ok_or_else(|| unreachable("no peer channels"))?;
        let channel = peers.channel(&peers.address_of(self.target, &self.recorded_addr))?;
        Ok(peer_client(channel).max_decoding_message_size(usize::MAX))
    }

    /// `message` as a request whose deadline is openraft's, but at least
    /// the floor of [`PeerAddresses::new`].
    fn request<T>(&self, message: T, option: &RPCOption) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        req.set_timeout(option.hard_ttl().max(self.min_timeout));
        req
    }

    /// RequestVote, or PreVote (which changes no state on the receiver).
    async fn send_vote(
        &self,
        rpc: VoteRequest,
        option: RPCOption,
        pre_vote: bool,
    ) -> Result<VoteResponse, RPCError<TypeConfig>> {
        let req = self.request(wire::vote_request_to_wire(self.group, self.target, &rpc), &option);
        let mut client = self.client()?;
        let reply = if pre_vote { client.pre_vote(req).await } else { client.vote(req).await };
        let reply = reply.map_err(unreachable)?.into_inner();
        refused(reply.error.as_ref())?;
        wire::vote_response_from_wire(&reply).map_err(network_error)
    }
}

impl RaftNetworkV2<TypeConfig> for PeerNetwork {
    type SnapshotData = SnapshotFiles;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse, RPCError<TypeConfig>> {
        let message = wire::append_request_to_wire(self.group, self.target, &rpc).map_err(network_error)?;
        let req = self.request(message, &option);
        let reply = self.client()?.append_entries(req).await.map_err(unreachable)?.into_inner();
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
        let req = self.request(wire::transfer_request_to_wire(self.group, self.target, &req), &option);
        let reply = self.client()?.transfer_leader(req).await.map_err(unreachable)?.into_inner();
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
        let mut client = self.client().map_err(|e| StreamingError::Unreachable(Unreachable::new(&e)))?;
        let chunks = snapshot::chunks(self.group, self.target, &vote, &snapshot)
            .map_err(|e| StreamingError::Unreachable(Unreachable::new(&e)))?;
        let mut req = tonic::Request::new(chunks);
        req.set_timeout(option.hard_ttl());
        let send = client.install_snapshot(req);
        let reply = tokio::select! {
            closed = cancel => return Err(StreamingError::Closed(closed)),
            r = send => r.map_err(|e| StreamingError::Unreachable(Unreachable::from_string(e)))?,
        };
        let reply = reply.into_inner();
        let unreachable = |e: RPCError<TypeConfig>| StreamingError::Unreachable(Unreachable::new(&e));
        refused(reply.error.as_ref()).map_err(unreachable)?;
        let vote = reply.vote.as_ref().ok_or_else(|| network_error("snapshot answer without a vote"));
        Ok(SnapshotResponse::new(wire::vote_from_wire(vote.map_err(unreachable)?)))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn network(min_timeout: Duration) -> PeerNetwork {
        PeerNetwork { group: 1, target: 2, recorded_addr: String::new(), peers: None, min_timeout }
    }

    /// The deadline a request carries on the wire (gRPC's `grpc-timeout`).
    fn deadline<T>(req: &tonic::Request<T>) -> Option<String> {
        req.metadata().get("grpc-timeout").and_then(|v| v.to_str().ok()).map(str::to_owned)
    }

    #[test]
    fn rpc_timeout_is_at_least_the_floor() {
        // openraft asks for heartbeat_interval (100 ms) on replication's
        // AppendEntries; a 150 ms round trip must not fail every one.
        let n = network(Duration::from_millis(500));
        let short = n.request((), &RPCOption::new(Duration::from_millis(100)));
        assert_eq!(deadline(&short).as_deref(), Some("500000u"));
        // A longer ask (snapshots) is kept.
        let long = n.request((), &RPCOption::new(Duration::from_secs(20)));
        assert_eq!(deadline(&long).as_deref(), Some("20000000u"));
    }

    #[tokio::test]
    async fn routes_replace_the_dialled_address() {
        // A stand-in for a proxy: it only needs to see the connection.
        let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let via = proxy.local_addr().expect("addr");
        let peer: SocketAddr = "192.0.2.7:9093".parse().expect("addr"); // TEST-NET-1, RFC 5737
        let peers = PeerAddresses::new([(peer, via)], Duration::from_secs(2));
        let mut client = PeerClient::new(peers.channel(&peer.to_string()).expect("channel"));
        let call =
            tokio::spawn(async move { client.append_entries(pb::AppendEntriesRequest::default()).await });
        let accepted = tokio::time::timeout(Duration::from_secs(5), proxy.accept()).await;
        assert!(matches!(accepted, Ok(Ok(_))), "the route was not dialled: {accepted:?}");
        call.abort();
    }
}

//! The sending side: openraft's `RaftNetworkV2` for one group, over a gRPC
//! channel per peer broker shared by every group.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use ferrolog_proto::raft::raft_peer_client::RaftPeerClient;
use ferrolog_proto::raft::{RaftRequest, RaftResponse};
use ferrolog_raft_store::snapshot::SnapshotFiles;
use ferrolog_raft_store::state_machine::Snapshot;
use ferrolog_raft_store::types::{Node, NodeId, TypeConfig, Vote};
use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::v2::RaftNetworkV2;
use openraft::network::{RPCOption, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, VoteRequest, VoteResponse,
};
use serde::de::DeserializeOwned;
use tonic::transport::{Channel, Endpoint};

use super::codec;
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
    /// `None` only in unit tests of the encoding.
    peers: Option<PeerAddresses>,
    /// See [`PeerAddresses::new`].
    min_timeout: std::time::Duration,
}

fn unreachable(e: impl std::fmt::Display) -> RPCError<TypeConfig> {
    RPCError::Unreachable(Unreachable::from_string(e))
}

/// Turns a peer's reply into openraft's result type.
fn decode_reply<T: DeserializeOwned>(r: RaftResponse) -> Result<T, RPCError<TypeConfig>> {
    if let Some(e) = r.error {
        return Err(RPCError::Network(NetworkError::from_string(format!(
            "peer refused: {:?}: {}",
            e.code(),
            e.message
        ))));
    }
    serde_json::from_slice(&r.body_json).map_err(|e| RPCError::Network(NetworkError::new(&e)))
}

impl PeerNetwork {
    fn client(&self) -> Result<RaftPeerClient<Channel>, RPCError<TypeConfig>> {
        let peers = self.peers.as_ref().ok_or_else(|| unreachable("no peer channels"))?;
        let channel = peers.channel(&peers.address_of(self.target, &self.recorded_addr))?;
        Ok(RaftPeerClient::new(channel).max_decoding_message_size(usize::MAX))
    }

    fn request(
        &self,
        header_json: Vec<u8>,
        entries: Vec<u8>,
        option: &RPCOption,
    ) -> tonic::Request<RaftRequest> {
        let mut req = tonic::Request::new(RaftRequest {
            group_id: self.group,
            target_node: self.target,
            header_json: header_json.into(),
            entries: entries.into(),
        });
        req.set_timeout(option.hard_ttl().max(self.min_timeout));
        req
    }
}

impl PeerNetwork {
    /// RequestVote, or PreVote (which changes no state on the receiver).
    async fn send_vote(
        &self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
        pre_vote: bool,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        let body = serde_json::to_vec(&rpc).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let req = self.request(body, Vec::new(), &option);
        let mut client = self.client()?;
        let reply = if pre_vote { client.pre_vote(req).await } else { client.vote(req).await };
        decode_reply(reply.map_err(unreachable)?.into_inner())
    }
}

impl RaftNetworkV2<TypeConfig> for PeerNetwork {
    type SnapshotData = SnapshotFiles;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        let (header, frames) =
            codec::encode_append(&rpc).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let req = self.request(header, frames, &option);
        let reply = self.client()?.append_entries(req).await.map_err(unreachable)?;
        decode_reply(reply.into_inner())
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.send_vote(rpc, option, false).await
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.send_vote(rpc, option, true).await
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        let body = serde_json::to_vec(&req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let req = self.request(body, Vec::new(), &option);
        let reply = self.client()?.transfer_leader(req).await.map_err(unreachable)?;
        decode_reply(reply.into_inner())
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
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
        decode_reply(reply.into_inner()).map_err(|e| StreamingError::Unreachable(Unreachable::new(&e)))
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
    fn deadline(req: &tonic::Request<RaftRequest>) -> Option<String> {
        req.metadata().get("grpc-timeout").and_then(|v| v.to_str().ok()).map(str::to_owned)
    }

    #[test]
    fn rpc_timeout_is_at_least_the_floor() {
        // openraft asks for heartbeat_interval (100 ms) on replication's
        // AppendEntries; a 150 ms round trip must not fail every one.
        let n = network(Duration::from_millis(500));
        let short = n.request(Vec::new(), Vec::new(), &RPCOption::new(Duration::from_millis(100)));
        assert_eq!(deadline(&short).as_deref(), Some("500000u"));
        // A longer ask (snapshots) is kept.
        let long = n.request(Vec::new(), Vec::new(), &RPCOption::new(Duration::from_secs(20)));
        assert_eq!(deadline(&long).as_deref(), Some("20000000u"));
    }

    #[tokio::test]
    async fn routes_replace_the_dialled_address() {
        // A stand-in for a proxy: it only needs to see the connection.
        let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let via = proxy.local_addr().expect("addr");
        let peer: SocketAddr = "192.0.2.7:9093".parse().expect("addr"); // TEST-NET-1, RFC 5737
        let peers = PeerAddresses::new([(peer, via)], Duration::from_secs(2));
        let mut client = RaftPeerClient::new(peers.channel(&peer.to_string()).expect("channel"));
        let call = tokio::spawn(async move { client.append_entries(RaftRequest::default()).await });
        let accepted = tokio::time::timeout(Duration::from_secs(5), proxy.accept()).await;
        assert!(matches!(accepted, Ok(Ok(_))), "the route was not dialled: {accepted:?}");
        call.abort();
    }
}

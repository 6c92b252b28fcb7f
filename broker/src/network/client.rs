//! The sending side: openraft's `RaftNetworkV2` for one group, over a gRPC
//! channel per peer broker shared by every group.

use std::collections::HashMap;
use std::future::Future;
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
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use serde::de::DeserializeOwned;
use tonic::transport::{Channel, Endpoint};

use super::codec;
use super::snapshot;
use crate::groups::GroupId;

/// Lazily connected gRPC channels to peer brokers, by address, shared by
/// all groups of a broker: one HTTP/2 connection per peer.
#[derive(Clone, Debug, Default)]
pub struct PeerAddresses {
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    /// Peer address → address dialled instead (`peer_routes` of the config).
    routes: Arc<HashMap<String, String>>,
    /// Shortest timeout of a Raft RPC, whatever openraft asks for.
    min_rpc_timeout: std::time::Duration,
}

impl PeerAddresses {
    /// Channels that dial `routes[addr]` instead of `addr` where a route is
    /// given (peer address → address of, e.g., a proxy in front of it).
    ///
    /// Raft RPCs wait at least `min_rpc_timeout` for an answer. openraft
    /// asks for `heartbeat_interval` on AppendEntries, which would make
    /// every replication request fail once a round trip (network plus the
    /// follower's fsync) exceeds it; a reply is still useful until an
    /// election timeout has passed, so brokers pass `election_timeout_min_ms`.
    pub fn new(
        routes: impl IntoIterator<Item = (String, String)>,
        min_rpc_timeout: std::time::Duration,
    ) -> Self {
        Self { channels: Arc::default(), routes: Arc::new(routes.into_iter().collect()), min_rpc_timeout }
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
        let dial = self.routes.get(addr).map_or(addr, String::as_str);
        let endpoint = Endpoint::from_shared(format!("http://{dial}"))
            .map_err(|e| Unreachable::from_string(format!("bad peer address {dial}: {e}")))?
            .tcp_nodelay(true)
            .http2_keep_alive_interval(std::time::Duration::from_secs(10));
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
            channel: self.peers.channel(&node.addr),
            min_timeout: self.peers.min_rpc_timeout,
        }
    }
}

/// One group's link to one peer replica.
#[derive(Debug)]
pub struct PeerNetwork {
    group: GroupId,
    target: NodeId,
    channel: Result<Channel, Unreachable<TypeConfig>>,
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
        let channel = self.channel.as_ref().map_err(|e| RPCError::Unreachable(e.clone()))?;
        Ok(RaftPeerClient::new(channel.clone()).max_decoding_message_size(usize::MAX))
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
        PeerNetwork { group: 1, target: 2, channel: Err(Unreachable::from_string("unused")), min_timeout }
    }

    /// The deadline a request carries on the wire (gRPC's `grpc-timeout`).
    fn deadline(req: &tonic::Request<RaftRequest>) -> Option<String> {
        req.metadata().get("grpc-timeout").and_then(|v| v.to_str().ok()).map(str::to_owned)
    }

    #[test]
    fn rpc_timeout_is_at_least_the_floor() {
        // openraft asks for heartbeat_interval (100 ms) on AppendEntries; a
        // 150 ms round trip must not fail every replication request.
        let n = network(Duration::from_millis(500));
        let short = n.request(Vec::new(), Vec::new(), &RPCOption::new(Duration::from_millis(100)));
        assert_eq!(deadline(&short).as_deref(), Some("500000u"));
        // A longer ask (snapshots) is kept.
        let long = n.request(Vec::new(), Vec::new(), &RPCOption::new(Duration::from_secs(20)));
        assert_eq!(deadline(&long).as_deref(), Some("20000000u"));
    }

    #[tokio::test]
    async fn routes_replace_the_dialled_address() {
        let peers =
            PeerAddresses::new([("10.0.0.2:9093".to_owned(), "bad address".to_owned())], Duration::ZERO);
        // The route is what gets dialled: an invalid one fails, the peer's own address is not used.
        let err = peers.channel("10.0.0.2:9093").expect_err("the route is not a valid URI");
        assert!(err.to_string().contains("bad address"), "{err}");
        assert!(peers.channel("10.0.0.3:9093").is_ok());
    }
}

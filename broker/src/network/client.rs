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
}

impl PeerAddresses {
    /// The channel to `addr` (`host:port`), created on first use.
    ///
    /// # Errors
    /// [`Unreachable`] if the address is not a valid URI.
    pub fn channel(&self, addr: &str) -> Result<Channel, Unreachable<TypeConfig>> {
        let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Unreachable::from_string(format!("bad peer address {addr}: {e}")))?
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
        PeerNetwork { group: self.group, target, channel: self.peers.channel(&node.addr) }
    }
}

/// One group's link to one peer replica.
#[derive(Debug)]
pub struct PeerNetwork {
    group: GroupId,
    target: NodeId,
    channel: Result<Channel, Unreachable<TypeConfig>>,
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
        req.set_timeout(option.hard_ttl());
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

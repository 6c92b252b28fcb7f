//! The sending side: the broker's [`PeerTransport`], a gRPC channel per
//! peer broker shared by every group.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrolog_proto::raft as pb;
use ferrolog_proto::raft::peer_client::PeerClient;
use ferrolog_replica::{NodeId, PeerTransport, PeerUnreachable};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use super::batch::{Lane, PeerQueue};
use super::protocol::{self, Stamp, peer_client};

/// Reset streams a peer channel remembers (h2's default is 10).
const PEER_RESETS_REMEMBERED: usize = 10_000;

/// Lazily connected gRPC channels to peer brokers, by address, shared by
/// all groups of a broker: one HTTP/2 connection per peer.
#[derive(Clone, Debug)]
pub struct PeerAddresses {
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    /// The batch queues of each peer, by address and lane (see [`super::batch`]).
    queues: Arc<Mutex<HashMap<(String, Lane), PeerQueue>>>,
    /// Raft node id → its broker's peer address as the metadata records it
    /// now (see [`PeerAddresses::set_node_addresses`]).
    nodes: Arc<std::sync::RwLock<Arc<HashMap<NodeId, String>>>>,
    /// Peer address → address dialled instead (`peer_routes` of the config).
    routes: Arc<HashMap<SocketAddr, SocketAddr>>,
    /// Shortest timeout of a Raft RPC, whatever the node asks for; also the
    /// connect timeout.
    min_rpc_timeout: std::time::Duration,
    /// The reassignment throttle on traffic to replicas being added.
    throttle: super::throttle::Throttle,
    /// The in-memory network peers are dialled on, as the node listening
    /// on the address given; `None`: the operating system's TCP.
    network: Option<(super::memory::MemoryNetwork, SocketAddr)>,
}

impl PeerAddresses {
    /// Channels that dial `routes[addr]` instead of `addr` where a route is
    /// given (peer address → address of, e.g., a proxy in front of it).
    ///
    /// A connection attempt gives up after `min_rpc_timeout`, and Raft
    /// RPCs wait at least that long for an answer. The Raft node asks for
    /// `heartbeat_interval` on replication's AppendEntries, which would fail
    /// every replication request once a round trip (network plus the
    /// follower's fsync) exceeds it; an answer is still useful until an
    /// election timeout has passed, so brokers pass `election_timeout_min_ms`.
    /// (The node bounds heartbeats by `heartbeat_interval` itself; votes
    /// already get the election timeout.)
    pub fn new(
        routes: impl IntoIterator<Item = (SocketAddr, SocketAddr)>,
        min_rpc_timeout: std::time::Duration,
    ) -> Self {
        Self {
            channels: Arc::default(),
            queues: Arc::default(),
            nodes: Arc::default(),
            routes: Arc::new(routes.into_iter().collect()),
            min_rpc_timeout,
            throttle: super::throttle::Throttle::new(0),
            network: None,
        }
    }

    /// Dials peers on `network` (an in-memory network, as the node
    /// listening on `me`, whose cut isolates it) instead of TCP; `None`
    /// changes nothing.
    #[must_use]
    pub fn with_network(mut self, network: Option<super::memory::MemoryNetwork>, me: SocketAddr) -> Self {
        if let Some(n) = network {
            self.network = Some((n, me));
        }
        self
    }

    /// Limits entries and snapshot chunks sent to replicas that
    /// reassignments add to `bytes_per_sec` in all (0: no limit); see
    /// [`super::throttle`].
    #[must_use]
    pub fn with_reassignment_throttle(mut self, bytes_per_sec: u64) -> Self {
        self.throttle = super::throttle::Throttle::new(bytes_per_sec);
        self
    }

    /// The reassignment throttle (its nodes are set from the metadata image).
    pub fn throttle(&self) -> &super::throttle::Throttle {
        &self.throttle
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
    /// [`PeerUnreachable`] if the address (or its route) is not a valid URI.
    pub fn channel(&self, addr: &str) -> Result<Channel, PeerUnreachable> {
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
            .map_err(|e| PeerUnreachable(format!("bad peer address {dial}: {e}")))?
            .tcp_nodelay(true)
            .http2_keep_alive_interval(std::time::Duration::from_secs(10))
            // See super::PEER_RESETS_MAX: remember more resets, tolerate more.
            .http2_max_concurrent_reset_streams(PEER_RESETS_REMEMBERED)
            .http2_max_local_error_reset_streams(super::PEER_RESETS_MAX);
        if !self.min_rpc_timeout.is_zero() {
            endpoint = endpoint.connect_timeout(self.min_rpc_timeout);
        }
        let channel = match &self.network {
            Some((network, me)) => endpoint.connect_with_connector_lazy(network.connector(Some(*me))),
            None => endpoint.connect_lazy(),
        };
        map.insert(addr.to_owned(), channel.clone());
        Ok(channel)
    }
}

/// The broker's [`PeerTransport`]: every group's peer requests over the
/// shared channels of [`PeerAddresses`], stamped with this broker's
/// protocol version ([`super::protocol`]).
impl PeerAddresses {
    fn client(
        &self,
        target: NodeId,
        recorded: &str,
    ) -> Result<PeerClient<InterceptedService<Channel, Stamp>>, PeerUnreachable> {
        let channel = self.channel(&self.address_of(target, recorded))?;
        Ok(peer_client(channel).max_decoding_message_size(usize::MAX))
    }

    /// Batched calls of `lane` sent so far to all peers: (batches, calls
    /// in them).
    pub fn batch_stats(&self, lane: Lane) -> (u64, u64) {
        let queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        queues
            .iter()
            .filter(|((_, l), _)| *l == lane)
            .map(|(_, q)| q.sent())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// The batch queue of `lane` to the broker of Raft node `target`, if
    /// this broker and that peer take such batches ([`super::batch`]).
    fn queue(
        &self,
        target: NodeId,
        recorded: &str,
        lane: Lane,
    ) -> Result<Option<PeerQueue>, PeerUnreachable> {
        let speaks = match lane {
            Lane::Small => protocol::speaks_batch(),
            Lane::Votes => protocol::speaks_batched_votes(),
        };
        if !speaks {
            return Ok(None);
        }
        let addr = self.address_of(target, recorded);
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        let key = (addr, lane);
        let queue = match queues.get(&key) {
            Some(q) if q.is_open() => q.clone(),
            _ => {
                let q = PeerQueue::spawn(key.0.clone(), self.channel(&key.0)?);
                queues.insert(key, q.clone());
                q
            }
        };
        Ok(queue.batches().then_some(queue))
    }

    /// `message` as a request whose deadline is the node's `timeout`, but at
    /// least the floor of [`PeerAddresses::new`].
    fn request<T>(&self, message: T, timeout: Duration) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        req.set_timeout(timeout.max(self.min_rpc_timeout));
        req
    }
}

fn unreachable(e: tonic::Status) -> PeerUnreachable {
    PeerUnreachable(e.to_string())
}

impl PeerTransport for PeerAddresses {
    fn append_entries<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        req: pb::AppendEntriesRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::AppendEntriesResponse, PeerUnreachable>> {
        Box::pin(async move {
            if req.entries.is_empty()
                && let Some(queue) = self.queue(target, addr, Lane::Small)?
            {
                let call = pb::batch_call::Call::AppendEntries(req);
                return match queue.call(call, timeout.max(self.min_rpc_timeout)).await? {
                    pb::batch_answer::Answer::AppendEntries(r) => Ok(r),
                    pb::batch_answer::Answer::Vote(_) => {
                        Err(PeerUnreachable("the peer answered a heartbeat with a vote".into()))
                    }
                };
            }
            if !req.entries.is_empty() && self.throttle.applies(target) {
                self.throttle.charge(prost::Message::encoded_len(&req) as u64).await;
            }
            let req = self.request(req, timeout);
            Ok(self.client(target, addr)?.append_entries(req).await.map_err(unreachable)?.into_inner())
        })
    }

    fn vote<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        req: pb::VoteRequest,
        pre_vote: bool,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::VoteResponse, PeerUnreachable>> {
        Box::pin(async move {
            if let Some(queue) = self.queue(target, addr, Lane::Votes)? {
                use pb::batch_call::Call;
                let call = if pre_vote { Call::PreVote(req) } else { Call::Vote(req) };
                match queue.call(call, timeout.max(self.min_rpc_timeout)).await? {
                    pb::batch_answer::Answer::Vote(r) => return Ok(r),
                    // A 1.2 broker answers a call it does not know so.
                    pb::batch_answer::Answer::AppendEntries(_) => queue.refused_by_peer(
                        &self.address_of(target, addr),
                        "the peer does not take batched votes (peer protocol older than 1.3)",
                    ),
                }
            }
            let req = self.request(req, timeout);
            let mut client = self.client(target, addr)?;
            let reply = if pre_vote { client.pre_vote(req).await } else { client.vote(req).await };
            Ok(reply.map_err(unreachable)?.into_inner())
        })
    }

    fn transfer_leader<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        req: pb::TransferLeaderRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::TransferLeaderResponse, PeerUnreachable>> {
        Box::pin(async move {
            let req = self.request(req, timeout);
            Ok(self.client(target, addr)?.transfer_leader(req).await.map_err(unreachable)?.into_inner())
        })
    }

    fn log_state<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        req: pb::LogStateRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::LogStateResponse, PeerUnreachable>> {
        Box::pin(async move {
            let req = self.request(req, timeout);
            Ok(self.client(target, addr)?.log_state(req).await.map_err(unreachable)?.into_inner())
        })
    }

    fn install_snapshot<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        chunks: BoxStream<'static, pb::SnapshotChunk>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::SnapshotResponse, PeerUnreachable>> {
        Box::pin(async move {
            let throttle = self.throttle.applies(target).then(|| self.throttle.clone());
            let req = self.request(throttled(chunks, throttle), timeout);
            Ok(self.client(target, addr)?.install_snapshot(req).await.map_err(unreachable)?.into_inner())
        })
    }
}

/// `chunks`, each sent once `throttle` (if any) allows its bytes.
fn throttled(
    chunks: BoxStream<'static, pb::SnapshotChunk>,
    throttle: Option<super::throttle::Throttle>,
) -> Chunks {
    Chunks(Box::pin(futures::StreamExt::then(chunks, move |c| {
        let throttle = throttle.clone();
        async move {
            if let Some(t) = throttle {
                t.charge(prost::Message::encoded_len(&c) as u64).await;
            }
            c
        }
    })))
}

/// A snapshot's chunk stream as a named type: tonic's client-streaming
/// future over a boxed `dyn Stream` directly is not proven `Send` when it
/// is itself boxed (a higher-ranked lifetime error of the compiler).
struct Chunks(BoxStream<'static, pb::SnapshotChunk>);

impl futures::Stream for Chunks {
    type Item = pb::SnapshotChunk;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.as_mut().poll_next(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The deadline a request carries on the wire (gRPC's `grpc-timeout`).
    fn deadline<T>(req: &tonic::Request<T>) -> Option<String> {
        req.metadata().get("grpc-timeout").and_then(|v| v.to_str().ok()).map(str::to_owned)
    }

    #[test]
    fn rpc_timeout_is_at_least_the_floor() {
        // The node asks for heartbeat_interval (100 ms) on replication's
        // AppendEntries; a 150 ms round trip must not fail every one.
        let n = PeerAddresses::new([], Duration::from_millis(500));
        let short = n.request((), Duration::from_millis(100));
        assert_eq!(deadline(&short).as_deref(), Some("500000u"));
        // A longer ask (snapshots) is kept.
        let long = n.request((), Duration::from_secs(20));
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

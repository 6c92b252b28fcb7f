//! The in-process peer transport the replica tests share: peer messages are
//! delivered by calling the target node's handlers (the same ones the
//! broker's gRPC service calls), in their protobuf form, and snapshots
//! through the real chunk streaming and staging. A node can be cut off
//! (every message to or from it fails as unreachable), as by a network
//! partition.
#![allow(dead_code, missing_docs)]

use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrolog_proto::raft as pb;
use ferrolog_replica::{NodeId, PeerTransport, PeerUnreachable, RaftNode, snapshot};
use futures::{Stream, StreamExt};

/// Nodes by id, each with its snapshot staging directory. Clones share
/// them; [`Local::as_node`] gives the transport one node sends with.
#[derive(Clone, Default)]
pub struct Local {
    pub nodes: Arc<Mutex<HashMap<NodeId, (RaftNode, PathBuf)>>>,
    /// Vote and pre-vote requests sent through it.
    pub votes: Arc<AtomicUsize>,
    /// AppendEntries without entries sent through it (heartbeats and
    /// commit notices).
    pub empty_appends: Arc<AtomicUsize>,
    /// Nodes cut off from every other.
    pub cut_off: Arc<Mutex<BTreeSet<NodeId>>>,
    /// The sending node, for a transport given to one node.
    me: Option<NodeId>,
}

impl Local {
    /// The transport node `me` sends with (so that cutting `me` off also
    /// drops what it sends).
    pub fn as_node(&self, me: NodeId) -> Self {
        Self { me: Some(me), ..self.clone() }
    }

    pub fn node(&self, target: NodeId) -> Result<(RaftNode, PathBuf), PeerUnreachable> {
        let cut = self.cut_off.lock().unwrap_or_else(|p| p.into_inner());
        if cut.contains(&target) || self.me.is_some_and(|me| cut.contains(&me)) {
            return Err(PeerUnreachable(format!("node {target} is cut off")));
        }
        drop(cut);
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        nodes.get(&target).cloned().ok_or_else(|| PeerUnreachable(format!("node {target} is not running")))
    }
}

fn refused(e: impl std::fmt::Display) -> pb::PeerError {
    pb::PeerError { code: pb::PeerErrorCode::GroupStopped as i32, message: e.to_string() }
}

impl PeerTransport for Local {
    async fn append_entries(
        &self,
        target: NodeId,
        _addr: &str,
        req: pb::AppendEntriesRequest,
        _timeout: Duration,
    ) -> Result<pb::AppendEntriesResponse, PeerUnreachable> {
        if req.entries.is_empty() {
            self.empty_appends.fetch_add(1, Ordering::Relaxed);
        }
        let (node, _) = self.node(target)?;
        let response = match node.handle_append(req).await {
            Ok(a) => a.response,
            Err(e) => pb::AppendEntriesResponse { error: Some(refused(e)), result: None },
        };
        // A partition that began meanwhile loses the answer.
        self.node(target)?;
        Ok(response)
    }

    async fn vote(
        &self,
        target: NodeId,
        _addr: &str,
        req: pb::VoteRequest,
        pre_vote: bool,
        _timeout: Duration,
    ) -> Result<pb::VoteResponse, PeerUnreachable> {
        self.votes.fetch_add(1, Ordering::Relaxed);
        let (node, _) = self.node(target)?;
        Ok(node
            .handle_vote(&req, pre_vote)
            .await
            .unwrap_or_else(|e| pb::VoteResponse { error: Some(refused(e)), ..pb::VoteResponse::default() }))
    }

    async fn transfer_leader(
        &self,
        target: NodeId,
        _addr: &str,
        req: pb::TransferLeaderRequest,
        _timeout: Duration,
    ) -> Result<pb::TransferLeaderResponse, PeerUnreachable> {
        let (node, _) = self.node(target)?;
        Ok(node
            .handle_transfer(&req)
            .await
            .unwrap_or_else(|e| pb::TransferLeaderResponse { error: Some(refused(e)), refused: None }))
    }

    async fn install_snapshot(
        &self,
        target: NodeId,
        _addr: &str,
        chunks: impl Stream<Item = pb::SnapshotChunk> + Send + 'static,
        _timeout: Duration,
    ) -> Result<pb::SnapshotResponse, PeerUnreachable> {
        let (node, staging) = self.node(target)?;
        let stream = Box::pin(chunks.map(Ok::<_, Infallible>));
        let received = snapshot::receive(stream, move |_| Some(staging.clone()))
            .await
            .map_err(|e| PeerUnreachable(e.to_string()))?;
        Ok(node
            .install_snapshot(received)
            .await
            .unwrap_or_else(|e| pb::SnapshotResponse { error: Some(refused(e)), vote: None }))
    }
}

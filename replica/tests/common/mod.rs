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
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

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
    /// Network delay: each message waits a random time up to this many ms
    /// (a seeded sequence, so a simulation replays it), on the way there
    /// and on the way back. `None`: delivered at once.
    pub delay: Arc<Mutex<Option<(u64, u64)>>>,
    /// When set, every AppendEntries sent (reaching its target or not) is
    /// noted here, for a simulation's trace.
    pub noted: Arc<Mutex<Option<Vec<String>>>>,
    /// The sending node, for a transport given to one node.
    me: Option<NodeId>,
}

impl Local {
    /// The transport node `me` sends with (so that cutting `me` off also
    /// drops what it sends).
    pub fn as_node(&self, me: NodeId) -> Self {
        Self { me: Some(me), ..self.clone() }
    }

    /// Cuts the power of node `id` (running `node`) on `disk`: the disk
    /// keeps only what was fsynced, the node leaves the network and stops;
    /// nothing of its process reaches the disk any more.
    pub async fn power_cut(
        &self,
        id: NodeId,
        node: &RaftNode,
        disk: &ferrolog_raft_store::vfs::FaultyFs,
        how: ferrolog_raft_store::vfs::PowerCut,
    ) {
        disk.power_cut(how);
        self.nodes.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        let _ = node.shutdown().await;
    }

    /// Notes `what` if noting is on.
    pub fn note(&self, what: impl FnOnce() -> String) {
        if let Some(n) = self.noted.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            n.push(what());
        }
    }

    /// Waits the network's delay, if one is set.
    pub async fn travel(&self) {
        let wait = {
            let mut delay = self.delay.lock().unwrap_or_else(|p| p.into_inner());
            delay.as_mut().map(|(rng, max_ms)| xorshift(rng) % (*max_ms + 1))
        };
        if let Some(ms) = wait {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
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

/// The next number of the xorshift64 sequence in `state` (never 0 unless
/// `state` is).
pub fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// `call`, or unreachable once `timeout` passed (as a real connection's
/// deadline: a node that stopped mid-call never answers).
async fn within<T>(
    timeout: Duration,
    target: NodeId,
    call: impl std::future::Future<Output = Result<T, PeerUnreachable>>,
) -> Result<T, PeerUnreachable> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| Err(PeerUnreachable(format!("node {target} did not answer within {timeout:?}"))))
}

fn refused(e: impl std::fmt::Display) -> pb::PeerError {
    pb::PeerError { code: pb::PeerErrorCode::GroupStopped as i32, message: e.to_string() }
}

impl PeerTransport for Local {
    fn append_entries<'a>(
        &'a self,
        target: NodeId,
        _addr: &'a str,
        req: pb::AppendEntriesRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::AppendEntriesResponse, PeerUnreachable>> {
        Box::pin(async move {
            if req.entries.is_empty() {
                self.empty_appends.fetch_add(1, Ordering::Relaxed);
            }
            let call = async {
                self.travel().await;
                self.note(|| {
                    format!(
                        "append {:?}->{target} {} entries, commit {:?}",
                        self.me,
                        req.entries.len(),
                        req.leader_commit
                    )
                });
                let (node, _) = self.node(target)?;
                let response = match node.handle_append(req).await {
                    Ok(a) => a.response,
                    Err(e) => pb::AppendEntriesResponse { error: Some(refused(e)), result: None },
                };
                self.travel().await;
                // A partition that began meanwhile loses the answer.
                self.node(target)?;
                Ok(response)
            };
            within(timeout, target, call).await
        })
    }

    fn vote<'a>(
        &'a self,
        target: NodeId,
        _addr: &'a str,
        req: pb::VoteRequest,
        pre_vote: bool,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::VoteResponse, PeerUnreachable>> {
        Box::pin(async move {
            self.votes.fetch_add(1, Ordering::Relaxed);
            let call = async {
                self.travel().await;
                let (node, _) = self.node(target)?;
                let response = node.handle_vote(&req, pre_vote).await.unwrap_or_else(|e| pb::VoteResponse {
                    error: Some(refused(e)),
                    ..pb::VoteResponse::default()
                });
                self.travel().await;
                self.node(target)?;
                Ok(response)
            };
            within(timeout, target, call).await
        })
    }

    fn transfer_leader<'a>(
        &'a self,
        target: NodeId,
        _addr: &'a str,
        req: pb::TransferLeaderRequest,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::TransferLeaderResponse, PeerUnreachable>> {
        Box::pin(async move {
            let (node, _) = self.node(target)?;
            Ok(node
                .handle_transfer(&req)
                .await
                .unwrap_or_else(|e| pb::TransferLeaderResponse { error: Some(refused(e)), refused: None }))
        })
    }

    fn log_state<'a>(
        &'a self,
        target: NodeId,
        _addr: &'a str,
        _req: pb::LogStateRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::LogStateResponse, PeerUnreachable>> {
        Box::pin(async move {
            let call = async {
                self.travel().await;
                let (node, _) = self.node(target)?;
                let response = node.log_state();
                self.travel().await;
                self.node(target)?;
                Ok(response)
            };
            within(timeout, target, call).await
        })
    }

    fn install_snapshot<'a>(
        &'a self,
        target: NodeId,
        _addr: &'a str,
        chunks: BoxStream<'static, pb::SnapshotChunk>,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::SnapshotResponse, PeerUnreachable>> {
        Box::pin(async move {
            let (node, staging) = self.node(target)?;
            let stream = Box::pin(chunks.map(Ok::<_, Infallible>));
            // Staged on the OS's file system, as the harness's staging
            // directories are.
            let os = ferrolog_raft_store::vfs::real();
            let received = snapshot::receive(stream, move |_| Some((os.clone(), staging.clone())))
                .await
                .map_err(|e| PeerUnreachable(e.to_string()))?;
            Ok(node
                .install_snapshot(received)
                .await
                .unwrap_or_else(|e| pb::SnapshotResponse { error: Some(refused(e)), vote: None }))
        })
    }
}

/// A batch that carries `value` (1 to 3 records, 12 to 480 bytes), for
/// the tests that check where each acknowledged value ended up.
pub fn value_batch(value: u64) -> ferrolog_raft_store::RecordBatch {
    ferrolog_raft_store::RecordBatch {
        record_count: 1 + (value % 3) as u32,
        first_timestamp_ms: value as i64,
        max_timestamp_ms: value as i64,
        producer_id: -1,
        records: bytes::Bytes::from(format!("v{value:010}:").repeat(1 + (value % 40) as usize)),
        ..ferrolog_raft_store::RecordBatch::default()
    }
}

/// The value a [`value_batch`]'s records carry.
pub fn value_of(records: &[u8]) -> Option<u64> {
    let digits = records.strip_prefix(b"v")?;
    let end = digits.iter().position(|b| *b == b':')?;
    std::str::from_utf8(&digits[..end]).ok()?.parse().ok()
}

/// Raft settings for groups on fault-injecting disks: elections within
/// 300 to 600 ms, and no snapshots (their transfer stages through the OS's
/// file system, and these tests keep every replica on its own disk).
pub fn disk_settings() -> ferrolog_replica::ValidSettings {
    ferrolog_replica::Settings {
        heartbeat_interval_ms: 50,
        election_timeout_min_ms: 300,
        election_timeout_max_ms: 600,
        snapshot_after_entries: None,
        max_payload_entries: 16,
    }
    .validate()
    .expect("settings")
}

/// Where a replica lives on its fault-injecting disk.
pub fn replica_dir() -> &'static std::path::Path {
    std::path::Path::new("/data/replica")
}

//! The receiving side: the `RaftPeer` gRPC service, dispatching each RPC to
//! the hosted group it names.

use ferrolog_proto::raft as pb;
use ferrolog_proto::raft::peer_server::Peer;
use ferrolog_proto::raft::{PeerError, PeerErrorCode, SnapshotChunk};
use ferrolog_replica::{HandleError, snapshot};
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status, Streaming};

use super::protocol;
use crate::control::liveness::Liveness;
use crate::error::ApiError;
use crate::groups::{GroupRegistry, HostedGroup};
use crate::metadata::command::ControllerRequest;
use crate::metadata::controller::Controller;
use ferrolog_proto::raft::{
    ControllerAnswer, ControllerCall, LogStateRequest, LogStateResponse, PingRequest, PingResponse,
};
use futures::StreamExt;
use std::sync::{Arc, OnceLock};
use tracing::Instrument;

/// The `RaftPeer` service of a broker.
#[derive(Clone, Debug)]
pub struct RaftPeerServer {
    broker_id: u32,
    message_bytes_max: usize,
    groups: GroupRegistry,
    controller: Arc<OnceLock<Controller>>,
    liveness: Liveness,
    /// This start's boot id (see `PingResponse.boot_id`): random, non-zero,
    /// drawn when the broker starts. Per server, not per process: a broker
    /// restarted inside one process (a simulation, an embedding) gets a
    /// new one, so its peers see the restart.
    boot_id: u64,
}

impl RaftPeerServer {
    /// A service of broker `broker_id` answering for the groups in `groups`.
    pub fn new(broker_id: u32, groups: GroupRegistry) -> Self {
        Self {
            broker_id,
            groups,
            controller: Arc::default(),
            message_bytes_max: 64 << 20,
            liveness: Liveness::default(),
            boot_id: crate::identity::random_id(),
        }
    }

    /// This start's boot id, as pings answer it.
    pub fn boot_id(&self) -> u64 {
        self.boot_id
    }

    /// Judges pre-votes with what `liveness` (this broker's pings) says of
    /// the groups' leaders (see [`RaftPeerServer::handle_vote`]); without
    /// it no leader is presumed alive and pre-votes are the Raft node's.
    pub fn with_liveness(mut self, liveness: Liveness) -> Self {
        self.liveness = liveness;
        self
    }

    /// Refuses peer messages larger than `bytes` (default 64 MiB).
    pub fn with_message_bytes_max(mut self, bytes: usize) -> Self {
        self.message_bytes_max = bytes;
        self
    }

    /// A handle to install the controller once it exists (it needs the
    /// metadata group, which needs this server to be reachable).
    pub fn controller_slot(&self) -> Arc<OnceLock<Controller>> {
        self.controller.clone()
    }

    /// The tonic service, ready to add to a server: requests of another
    /// major protocol version are refused before they reach it
    /// ([`protocol::check`]).
    pub fn into_service(
        self,
    ) -> InterceptedService<ferrolog_proto::raft::peer_server::PeerServer<Self>, protocol::Check> {
        let max = self.message_bytes_max;
        let server = ferrolog_proto::raft::peer_server::PeerServer::new(self).max_decoding_message_size(max);
        InterceptedService::new(server, protocol::check as protocol::Check)
    }

    fn hosted(&self, group: u64, target: u64) -> Result<HostedGroup, PeerError> {
        let Some(h) = self.groups.get(group) else {
            return Err(refuse(PeerErrorCode::UnknownGroup, format!("group {group} is not hosted here")));
        };
        if h.node_id != target {
            return Err(refuse(
                PeerErrorCode::WrongNode,
                format!("group {group} is hosted here as node {}, not {target}", h.node_id),
            ));
        }
        Ok(h)
    }
}

impl RaftPeerServer {
    /// AppendEntries for the named group.
    async fn handle_append(&self, req: pb::AppendEntriesRequest) -> pb::AppendEntriesResponse {
        let refused = |error| pb::AppendEntriesResponse { error: Some(error), result: None };
        let group = req.group_id;
        let h = match self.hosted(group, req.target_node) {
            Ok(h) => h,
            Err(e) => return refused(e),
        };
        match h.raft.handle_append(req).await {
            Ok(a) => {
                // From the current leader (not a deposed one answered with
                // a higher vote): the voters' leases run from now.
                let current =
                    !matches!(a.response.result, Some(pb::append_entries_response::Result::HigherVote(_)));
                if current && let Some(p) = &h.partition {
                    p.note_leader_contact();
                }
                a.response
            }
            Err(e) => refused(handle_error(e)),
        }
    }

    /// One call of a [`pb::BatchRequest`], answered as the single RPC would
    /// be; `None` once its sender stopped waiting (`timeout_ms`).
    async fn handle_batch_call(&self, index: u32, call: pb::BatchCall) -> Option<pb::BatchAnswer> {
        let answer = self.answer_batch_call(index, call.call);
        match call.timeout_ms {
            0 => Some(answer.await),
            ms => tokio::time::timeout(std::time::Duration::from_millis(ms.into()), answer).await.ok(),
        }
    }

    async fn answer_batch_call(&self, index: u32, call: Option<pb::batch_call::Call>) -> pb::BatchAnswer {
        use pb::batch_answer::Answer;
        use pb::batch_call::Call;
        let answer = match call {
            Some(Call::AppendEntries(req)) if req.entries.is_empty() => {
                Answer::AppendEntries(self.handle_append(req).await)
            }
            Some(Call::Vote(req)) if protocol::speaks_batched_votes() => {
                Answer::Vote(self.handle_vote(req, false).await)
            }
            Some(Call::PreVote(req)) if protocol::speaks_batched_votes() => {
                Answer::Vote(self.handle_vote(req, true).await)
            }
            Some(Call::AppendEntries(_)) => Answer::AppendEntries(pb::AppendEntriesResponse {
                error: Some(refuse(
                    PeerErrorCode::InvalidRequest,
                    "entries go in their own AppendEntries RPC, not in a batch".into(),
                )),
                result: None,
            }),
            // As a 1.2 broker reads a call it does not know.
            None | Some(Call::Vote(_) | Call::PreVote(_)) => {
                Answer::AppendEntries(pb::AppendEntriesResponse {
                    error: Some(refuse(
                        PeerErrorCode::InvalidRequest,
                        "a batch call without a request".into(),
                    )),
                    result: None,
                })
            }
        };
        pb::BatchAnswer { index, answer: Some(answer) }
    }

    /// RequestVote or PreVote for the named group.
    async fn handle_vote(&self, req: pb::VoteRequest, pre_vote: bool) -> pb::VoteResponse {
        let refused = |error| pb::VoteResponse { error: Some(error), ..pb::VoteResponse::default() };
        let h = match self.hosted(req.group_id, req.target_node) {
            Ok(h) => h,
            Err(e) => return refused(e),
        };
        // A recovering replica votes only for the most up-to-date log of
        // all voters, once it knows it: its node refuses the others
        // (ferrolog_replica::recovery), before any look at leases here.
        if let Err(e) = h.raft.refuse_vote_if_recovering(&req) {
            return refused(handle_error(e));
        }
        let candidate = ferrolog_replica::candidate_last_log(&req).map(|l| (l.term, l.index));
        // A dormant follower that refuses anyway answers without starting
        // its node (crate::control::dormant).
        if pre_vote
            && h.raft.is_dormant()
            && self.refuses_pre_vote(&h, &req).await
            && let Some(refused) = h.raft.dormant_pre_vote_refusal()
        {
            return refused;
        }
        let mut answer = match h.raft.handle_vote(&req, pre_vote).await {
            Ok(a) => a,
            Err(e) => return refused(handle_error(e)),
        };
        if pre_vote && answer.vote_granted && self.refuses_pre_vote(&h, &req).await {
            answer.vote_granted = false;
            tracing::debug!(
                group = req.group_id,
                "pre-vote refused: this replica leads with a fresh lease, or presumes another live leader"
            );
        } else if !answer.vote_granted {
            let ours = answer.last_log_id.as_ref().map(|l| (l.term, l.index));
            if ours > candidate
                && let Some(p) = &h.partition
                && let Some(v) = &req.vote
            {
                // The candidate cannot win with this vote: the next replica
                // after it campaigns without waiting for it (control::quiesce).
                p.note_outran_candidate(v.node);
                self.groups.stir([req.group_id]);
            }
            tracing::debug!(
                group = req.group_id,
                pre_vote,
                candidate = ?req.vote.as_ref().map(|v| (v.term, v.node)),
                candidate_last_log = ?candidate,
                ours = ?answer.vote.as_ref().map(|v| (v.term, v.node, v.committed)),
                our_last_log = ?answer.last_log_id.as_ref().map(|l| (l.term, l.index)),
                "vote refused by the Raft node"
            );
        }
        answer
    }

    /// Whether this replica of a partition refuses a pre-vote whatever its
    /// Raft node would say: while it leads and a quorum has just
    /// acknowledged it (it has not lost its quorum, is not handing over, and
    /// a parked leader first renews its lease with one heartbeat round,
    /// which also ends a leadership whose term a follower has passed), or
    /// while it presumes a live leader other than the candidate
    /// ([`crate::control::quiesce::presumed_leader`]). A quiet leader sends
    /// no heartbeats, so the leases that make Raft nodes refuse pre-votes
    /// lapse, and a candidate whose pings had not caught up with the leader
    /// would depose it. A pre-vote changes nothing and a refused one only
    /// delays an election, so this can cost availability, never safety; a
    /// leadership transfer skips pre-votes and is not affected (Raft thesis
    /// §4.2.3, §9.6).
    async fn refuses_pre_vote(&self, h: &HostedGroup, req: &pb::VoteRequest) -> bool {
        let Some(p) = &h.partition else { return false };
        if let Some(term) = h.raft.leader_term() {
            if p.lost_quorum() || self.groups.hands_over(req.group_id, term) {
                return false;
            }
            return h.raft.renew_lease(h.raft.timings().election_timeout_min / 2).await;
        }
        let known = h.raft.state(|s| crate::control::quiesce::KnownLeader::of(&s));
        let candidate = req.vote.as_ref().and_then(|v| p.broker_of(v.node));
        crate::control::quiesce::presumed_leader(p, &self.liveness, self.broker_id, known)
            .is_some_and(|b| Some(b) != candidate)
    }
}

fn refuse(code: PeerErrorCode, message: String) -> PeerError {
    PeerError { code: code as i32, message }
}

/// The group's Raft node could not handle the request: it does not
/// decode, or the node has stopped.
fn handle_error(e: HandleError) -> PeerError {
    match e {
        HandleError::Invalid(m) => refuse(PeerErrorCode::InvalidRequest, m),
        HandleError::Stopped(m) => refuse(PeerErrorCode::GroupStopped, m),
        HandleError::Recovering(m) => refuse(PeerErrorCode::Recovering, m),
    }
}

#[tonic::async_trait]
impl Peer for RaftPeerServer {
    async fn append_entries(
        &self,
        request: Request<pb::AppendEntriesRequest>,
    ) -> Result<Response<pb::AppendEntriesResponse>, Status> {
        Ok(Response::new(self.handle_append(request.into_inner()).await))
    }

    type BatchStream = futures::stream::BoxStream<'static, Result<pb::BatchAnswer, Status>>;

    /// Handles every call at once and streams each answer as it is ready,
    /// so a slow group delays only its own answer; a call whose sender
    /// stopped waiting is dropped unanswered.
    async fn batch(&self, request: Request<pb::BatchRequest>) -> Result<Response<Self::BatchStream>, Status> {
        if !protocol::speaks_batch() {
            return Err(Status::unimplemented("this broker speaks peer protocol 1.1: no Batch"));
        }
        let calls = request.into_inner().calls;
        if calls.len() > super::batch::BATCH_CALLS_MAX {
            return Err(Status::invalid_argument(format!(
                "a batch of {} calls: at most {} are taken",
                calls.len(),
                super::batch::BATCH_CALLS_MAX
            )));
        }
        let answers: futures::stream::FuturesUnordered<_> = calls
            .into_iter()
            .zip(0u32..)
            .map(|(call, index)| {
                let this = self.clone();
                async move { this.handle_batch_call(index, call).await.map(Ok) }
            })
            .collect();
        Ok(Response::new(Box::pin(answers.filter_map(std::future::ready))))
    }

    async fn vote(&self, request: Request<pb::VoteRequest>) -> Result<Response<pb::VoteResponse>, Status> {
        Ok(Response::new(self.handle_vote(request.into_inner(), false).await))
    }

    async fn pre_vote(
        &self,
        request: Request<pb::VoteRequest>,
    ) -> Result<Response<pb::VoteResponse>, Status> {
        Ok(Response::new(self.handle_vote(request.into_inner(), true).await))
    }

    async fn transfer_leader(
        &self,
        request: Request<pb::TransferLeaderRequest>,
    ) -> Result<Response<pb::TransferLeaderResponse>, Status> {
        let refused =
            |error| Ok(Response::new(pb::TransferLeaderResponse { error: Some(error), refused: None }));
        let req = request.into_inner();
        let h = match self.hosted(req.group_id, req.target_node) {
            Ok(h) => h,
            Err(e) => return refused(e),
        };
        // A recovering replica takes no leadership (ferrolog_replica::recovery).
        if let Err(e) = h.raft.refuse_transfer_if_recovering() {
            return refused(handle_error(e));
        }
        // A broker in a controlled shutdown takes no leadership: it would
        // only have to hand it over again. (Copies of the request to the
        // group's other voters only tell them to drop their lease.)
        if self.groups.draining() && req.to_node == req.target_node {
            return refused(refuse(
                PeerErrorCode::ShuttingDown,
                format!("broker {} is shutting down: it takes no leadership", self.broker_id),
            ));
        }
        match h.raft.handle_transfer(&req).await {
            Ok(a) => Ok(Response::new(a)),
            Err(e) => refused(handle_error(e)),
        }
    }

    async fn install_snapshot(
        &self,
        request: Request<Streaming<SnapshotChunk>>,
    ) -> Result<Response<pb::SnapshotResponse>, Status> {
        let refused = |error| Ok(Response::new(pb::SnapshotResponse { error: Some(error), vote: None }));
        let groups = self.groups.clone();
        let received = snapshot::receive(request.into_inner(), |g| {
            groups.get(g).map(|h| (h.replica.fs().clone(), h.staging_dir))
        })
        .await;
        let received = match received {
            Ok(r) => r,
            Err(e) => return refused(refuse(PeerErrorCode::InvalidRequest, e.to_string())),
        };
        let h = match self.hosted(received.group, received.target) {
            Ok(h) => h,
            Err(e) => {
                let _ = received.fs().remove_dir_all(received.staged_dir());
                return refused(e);
            }
        };
        match h.raft.install_snapshot(received).await {
            Ok(r) => Ok(Response::new(r)),
            Err(e) => refused(handle_error(e)),
        }
    }

    async fn controller(
        &self,
        request: Request<ControllerCall>,
    ) -> Result<Response<ControllerAnswer>, Status> {
        let result: Result<_, ApiError> =
            match serde_json::from_slice::<ControllerRequest>(&request.into_inner().request_json) {
                Err(e) => Err(ApiError::Invalid(format!("controller request does not decode: {e}"))),
                Ok(req) => match self.controller.get() {
                    None => Err(ApiError::Unavailable("this broker is still starting".into())),
                    Some(c) => c.handle(req).await,
                },
            };
        let result_json = serde_json::to_vec(&result).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(ControllerAnswer { result_json: result_json.into() }))
    }

    async fn log_state(
        &self,
        request: Request<LogStateRequest>,
    ) -> Result<Response<LogStateResponse>, Status> {
        let req = request.into_inner();
        let h = match self.hosted(req.group_id, req.target_node) {
            Ok(h) => h,
            Err(e) => {
                return Ok(Response::new(LogStateResponse { error: Some(e), ..LogStateResponse::default() }));
            }
        };
        let state = h.raft.log_state();
        if h.raft.is_leader() {
            // Only a recovering replica asks (`RaftNode::seek_vote_floor`).
            // It is released once it applies an entry of this leader's
            // term past what this answer names, and an idle partition
            // appends none: a blank entry gives it one (it holds no
            // records, so no offset moves). Not awaited; a failure (lost
            // leadership) leaves the next question to try again.
            let raft = h.raft.clone();
            let span = tracing::info_span!("barrier for a recovering replica", group = req.group_id);
            tokio::spawn(
                async move {
                    if let Err(e) = raft.write_barrier().await {
                        tracing::debug!("blank entry for a recovering replica not written: {e}");
                    }
                }
                .instrument(span),
            );
        }
        Ok(Response::new(state))
    }

    async fn ping(&self, request: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        let from = request.into_inner().from_broker;
        let metadata = self.groups.get(crate::metadata::METADATA_GROUP);
        let (metadata_initialized, metadata_last_index) = metadata
            .map_or((false, 0), |h| h.raft.state(|s| (s.has_membership(), s.last_log_index().unwrap_or(0))));
        let (your_incarnation, image_caught_up) = match self.controller.get() {
            Some(c) => (c.image().brokers.get(&from).map_or(0, |b| b.incarnation), c.image_caught_up()),
            None => (0, false),
        };
        Ok(Response::new(PingResponse {
            broker_id: self.broker_id,
            leading_groups: self.groups.leading().to_vec(),
            metadata_initialized,
            your_incarnation,
            image_caught_up,
            metadata_last_index,
            boot_id: self.boot_id,
            replicas_open: self.groups.replicas_open(),
            protocol_major: protocol::ours().major,
            protocol_minor: protocol::ours().minor,
            opening_floor: self.groups.opening_floor(),
            draining: self.groups.draining(),
        }))
    }
}

//! Handlers of the client API.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ferrolog_proto::TopicId;
use ferrolog_proto::client::ferrolog_server::{Ferrolog, FerrologServer};
use ferrolog_proto::client::{
    AddRaftVoterRequest, AdminResponse, AlterPartitionReassignmentsRequest,
    AlterPartitionReassignmentsResponse, AlterTopicConfigRequest, BrokerInfo, ConfigEntry,
    ConfigSource as WireSource, CreatePartitionsRequest, CreateTopicRequest, DecommissionBrokerRequest,
    DeleteTopicRequest, DescribeTopicConfigRequest, DescribeTopicConfigResponse, Error, FetchRequest,
    FetchResponse, FollowerStatus, InitProducerIdRequest, InitProducerIdResponse, ListOffsetsRequest,
    ListOffsetsResponse, MetadataRequest, MetadataResponse, OffsetSpec, PartitionInfo,
    PartitionStatusRequest, PartitionStatusResponse, ProduceRequest, ProduceResponse, ReassignmentResult,
    RecordBatch as WireBatch, RemoveRaftVoterRequest, ReplicaState, SubscribeRequest, TopicInfo,
    TransferLeaderRequest, TransferLeaderResponse,
};
use ferrolog_proto::client::{
    CommittedOffset as WireCommitted, DeleteGroupRequest, DescribeGroupRequest, DescribeGroupResponse,
    FindCoordinatorRequest, FindCoordinatorResponse, GroupListing, ListGroupsRequest, ListGroupsResponse,
    OffsetCommitRequest, OffsetCommitResponse, OffsetCommitResult, OffsetFetchRequest, OffsetFetchResponse,
};
use ferrolog_proto::client::{
    GroupMember, HeartbeatRequest, HeartbeatResponse, JoinGroupMember, JoinGroupRequest, JoinGroupResponse,
    LeaveGroupRequest, LeaveGroupResponse, SyncGroupRequest, SyncGroupResponse, TopicPartition,
};
use futures::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::errors::to_wire;
use super::fetch_wire::ClientRoutes;
use crate::config::{BrokerId, Limits};
use crate::control::handover;
use crate::control::liveness::Liveness;
use crate::coordinator::{self, CommitRequest, Coordinator, GroupDescription, OFFSETS_TOPIC};
use crate::error::ApiError;
use crate::groups::GroupRegistry;
use crate::metadata::command::{ControllerReply, ControllerRequest, PartitionAssignment, PartitionMove};
use crate::metadata::controller::{Controller, now_ms};
use crate::metadata::image::MetadataImage;
use crate::metadata::topic_config::{self, ConfigSource, TopicDefaults};
use crate::partition::kafka_batch;
use crate::partition::records::{self, BatchError, ProducerFields};
use crate::partition::{FetchOutcome, Partition};
use crate::partitions::Failures;

/// Bytes of a message beyond the batches it carries (topic name, other
/// fields, gRPC framing).
const REQUEST_OVERHEAD_BYTES: usize = 64 << 10;

/// Largest message the client port decodes, bytes: twice the largest
/// batch it stores ([`records::batch_encoded_bytes_max`]) plus 1 MiB, so
/// that a request somewhat over a limit is answered `RECORD_TOO_LARGE` by
/// [`records::build_batch`], naming the limit, rather than refused by the
/// transport (`OUT_OF_RANGE`, which the client library reports as
/// `RECORD_TOO_LARGE` too).
pub fn request_bytes_max(limits: &Limits) -> usize {
    records::batch_encoded_bytes_max(limits.max_batch_bytes).saturating_mul(2).saturating_add(1 << 20)
}

/// How long a TransferLeader request waits for the leadership to move.
pub const TRANSFER_LEADER_WAIT: Duration = Duration::from_secs(5);
/// Most partitions one AlterPartitionReassignments request may name (each
/// is one controller commit, made in turn).
pub const MAX_REASSIGNMENTS_PER_REQUEST: usize = 10_000;

/// How long a Subscribe stream waits on the high watermark per round, ms.
const SUBSCRIBE_WAIT: Duration = Duration::from_millis(500);

/// The client API of one broker.
#[derive(Clone, Debug)]
pub struct ClientService {
    /// This broker.
    pub broker: BrokerId,
    /// Limits from the config.
    pub limits: Limits,
    /// Metadata and administrative requests.
    pub controller: Controller,
    /// Consumer groups this broker coordinates.
    pub coordinator: Coordinator,
    /// Hosted groups.
    pub groups: GroupRegistry,
    /// Replicas that failed (shown by partition status).
    pub failures: Failures,
    /// Why this broker's metadata replica is not running, if it is not
    /// (reported in its own entry of `Metadata`'s brokers).
    pub metadata_failure: crate::control::metadata_restart::MetadataFailure,
    /// Peer liveness.
    pub liveness: Liveness,
    /// Leadership transfers.
    pub hand_over: handover::HandOver,
    /// This broker's defaults for topic configuration keys.
    pub topic_defaults: Arc<TopicDefaults>,
}

impl ClientService {
    /// The client API's routes (the tonic service, `Fetch` answered
    /// without copying records: [`super::fetch_wire`]), with message
    /// limits from the config.
    pub fn into_service(self) -> ClientRoutes {
        let max = request_bytes_max(&self.limits);
        // A fetch answers up to max_fetch_bytes, or one batch larger (KIP-74).
        let out = self
            .limits
            .max_fetch_bytes
            .max(records::batch_encoded_bytes_max(self.limits.max_batch_bytes))
            .saturating_add(REQUEST_OVERHEAD_BYTES);
        let generated =
            FerrologServer::new(self.clone()).max_decoding_message_size(max).max_encoding_message_size(out);
        ClientRoutes::new(generated, self, max, out)
    }

    fn wire(&self, e: &ApiError) -> Option<Error> {
        Some(to_wire(e, &self.controller.image()))
    }

    /// The hosted replica of the current incarnation of `topic`, or the
    /// reason it cannot be served here. With `topic_id` (KIP-516), a topic
    /// of that name with another id, or none at all, is
    /// [`ApiError::UnknownTopicId`]. A hosted replica of an older
    /// incarnation (not stopped yet by the reconciler) is never served.
    ///
    /// Saying that a topic, a partition or an id does not exist is final
    /// for a client (it stops), and this broker's image may lag the
    /// controller (after a restart, for a while); so such an answer is
    /// given only from an image confirmed current with the controller
    /// ([`Controller::current_image`]), and is `Unavailable` (retriable)
    /// when that cannot be confirmed. Only the way to an error pays for
    /// it: produce and fetch do not.
    pub(crate) async fn partition(
        &self,
        topic: &str,
        partition: u32,
        topic_id: Option<TopicId>,
    ) -> Result<Arc<Partition>, ApiError> {
        self.served(topic, partition, topic_id).await.map(|s| s.partition)
    }

    /// [`ClientService::partition`], with the topic's produce limit.
    pub(crate) async fn served(
        &self,
        topic: &str,
        partition: u32,
        topic_id: Option<TopicId>,
    ) -> Result<Served, ApiError> {
        let found = self.partition_in(&self.controller.image(), topic, partition, topic_id);
        if !matches!(found, Err(ApiError::UnknownTopic(_) | ApiError::UnknownTopicId { .. })) {
            return found;
        }
        match self.controller.current_image().await {
            Ok(confirmed) => self.partition_in(&confirmed.image, topic, partition, topic_id),
            Err(e) => Err(ApiError::Unavailable(format!("this broker's metadata may be behind: {e}"))),
        }
    }

    /// [`ClientService::partition`] as `image` has it, whether or not the
    /// image is current.
    fn partition_in(
        &self,
        image: &MetadataImage,
        topic: &str,
        partition: u32,
        topic_id: Option<TopicId>,
    ) -> Result<Served, ApiError> {
        let Some(t) = image.topics.get(topic) else {
            return Err(match topic_id {
                Some(id) => {
                    ApiError::UnknownTopicId { topic: topic.to_owned(), id: id.to_string(), current: None }
                }
                None => ApiError::UnknownTopic(topic.to_owned()),
            });
        };
        if let Some(id) = topic_id
            && id != t.topic_id
        {
            return Err(ApiError::UnknownTopicId {
                topic: topic.to_owned(),
                id: id.to_string(),
                current: Some(t.topic_id.to_string()),
            });
        }
        let Some(a) = t.partitions.get(partition as usize) else {
            return Err(ApiError::UnknownTopic(format!("{topic} has no partition {partition}")));
        };
        if let Some(p) = self.groups.partition(topic, partition)
            && p.group == a.group
        {
            // The topic's max.message.bytes, never above what this broker's
            // transport and storage take.
            let max_batch_bytes = topic_config::max_message_bytes(&t.config)
                .map_or(self.limits.max_batch_bytes, |m| {
                    usize::try_from(m).unwrap_or(usize::MAX).min(self.limits.max_batch_bytes)
                });
            let log_append_time = self.topic_defaults.log_append_time(&t.config);
            let compacted = self.topic_defaults.compacts(&t.config);
            let compression = kafka_batch::Codec::for_topic(self.topic_defaults.compression_type(&t.config));
            return Ok(Served { partition: p, max_batch_bytes, log_append_time, compacted, compression });
        }
        // Not hosted here (or not started yet): point at a replica.
        let other = a.replicas.iter().map(|r| r.broker).find(|b| *b != self.broker);
        Err(ApiError::NotLeader { leader: other })
    }

    /// The partition's leader ([`GroupRegistry::leader_of`]); 0 when unknown.
    pub(crate) fn leader_of(&self, a: &PartitionAssignment) -> BrokerId {
        self.groups.leader_of(&self.liveness, self.broker, a)
    }

    /// The batches as the gRPC API serves them: Ferrolog's encoding byte
    /// for byte; batches produced through the Kafka listener decompressed
    /// and re-encoded ([`records::as_record_set`]).
    /// Stops once the served bytes pass `max_bytes` (at least one batch,
    /// KIP-74): a compressed Kafka batch may grow many times when decoded.
    fn batches(out: &FetchOutcome, max_bytes: usize) -> Result<Vec<WireBatch>, ApiError> {
        let mut served = Vec::with_capacity(out.batches.len());
        let mut total = 0usize;
        for b in &out.batches {
            let records = records::as_record_set(b.records()).map_err(|e| {
                ApiError::Storage(format!("batch at offset {} does not decode: {e}", b.header.base_offset))
            })?;
            total = total.saturating_add(records.len());
            if !served.is_empty() && total > max_bytes {
                break;
            }
            served.push(WireBatch {
                base_offset: b.header.base_offset,
                record_count: b.header.record_count,
                records,
            });
        }
        Ok(served)
    }

    fn fetch_response(&self, r: Result<FetchOutcome, ApiError>, max_bytes: usize) -> FetchResponse {
        match r.and_then(|out| Ok((Self::batches(&out, max_bytes)?, out))) {
            Ok((batches, out)) => FetchResponse {
                error: None,
                batches,
                high_watermark: out.high_watermark,
                log_start_offset: out.log_start_offset,
            },
            Err(e) => FetchResponse { error: self.wire(&e), ..FetchResponse::default() },
        }
    }

    /// The answer to a Fetch (errors inside it, as the client API
    /// carries them): committed batches of one partition from
    /// `req.offset`, waiting up to `max_wait_ms` (capped by
    /// `limits.max_fetch_wait_ms`) for some. Used by the `Fetch` route
    /// ([`super::fetch_wire`]) and by the generated trait method.
    pub(crate) async fn fetch_answer(&self, req: FetchRequest) -> FetchResponse {
        let wait = Duration::from_millis(u64::from(req.max_wait_ms).min(self.limits.max_fetch_wait_ms));
        let span = tracing::debug_span!("fetch", node = self.broker, partition = %format!("{}-{}", req.topic, req.partition));
        let partition = match TopicId::from_wire(&req.topic_id).map_err(ApiError::Invalid) {
            Ok(id) => self.partition(&req.topic, req.partition, id).await,
            Err(e) => Err(e),
        };
        let max_bytes = self.max_bytes(req.max_bytes);
        let result = match partition {
            Ok(p) => p.fetch(req.offset, max_bytes, wait).instrument(span).await,
            Err(e) => Err(e),
        };
        self.fetch_response(result, max_bytes)
    }

    fn max_bytes(&self, asked: u32) -> usize {
        let asked = if asked == 0 { usize::MAX } else { asked as usize };
        asked.min(self.limits.max_fetch_bytes)
    }

    /// Hands `req` to the controller (this broker's, or forwarded).
    ///
    /// # Errors
    /// The controller's answer.
    pub(crate) async fn admin(&self, req: ControllerRequest) -> Result<ControllerReply, ApiError> {
        self.controller.handle(req).await
    }

    /// Creates a topic (both listeners). A bad name is refused here,
    /// whether or not a controller is reachable (the controller checks it
    /// again); `__consumer_offsets` is created by the coordinator only.
    ///
    /// # Errors
    /// As the controller's `CreateTopic`.
    pub(crate) async fn create_topic_op(
        &self,
        name: String,
        partitions: u32,
        replication_factor: u32,
        config: std::collections::BTreeMap<String, String>,
    ) -> Result<(), ApiError> {
        crate::metadata::controller::validate_topic_name(&name)?;
        if name == OFFSETS_TOPIC {
            return Err(ApiError::Invalid(format!(
                "{OFFSETS_TOPIC} is internal: it is created on the first group call"
            )));
        }
        self.admin(ControllerRequest::CreateTopic { name, partitions, replication_factor, config })
            .await
            .map(|_| ())
    }

    /// Deletes a topic (both listeners); never `__consumer_offsets`.
    ///
    /// # Errors
    /// As the controller's `DeleteTopic`.
    pub(crate) async fn delete_topic_op(&self, name: String) -> Result<(), ApiError> {
        if name == OFFSETS_TOPIC {
            return Err(ApiError::Invalid(format!(
                "{OFFSETS_TOPIC} is internal: deleting it would lose every group's offsets"
            )));
        }
        self.admin(ControllerRequest::DeleteTopic { name }).await.map(|_| ())
    }

    /// Grows a topic to `count` partitions (both listeners); never
    /// `__consumer_offsets`, whose count places every group's coordinator.
    ///
    /// # Errors
    /// As the controller's `CreatePartitions`.
    pub(crate) async fn create_partitions_op(&self, name: String, count: u32) -> Result<(), ApiError> {
        if name == OFFSETS_TOPIC {
            return Err(ApiError::InvalidPartitions(format!(
                "{OFFSETS_TOPIC} keeps its partition count: every group's coordinator would move"
            )));
        }
        self.admin(ControllerRequest::CreatePartitions { name, count }).await.map(|_| ())
    }

    /// A topic's configuration overrides, from an image confirmed current
    /// with the controller, so that a describe after an alter shows it
    /// whichever broker answers; when the controller cannot be reached,
    /// from this broker's own image, which then does not say that a topic
    /// does not exist.
    ///
    /// # Errors
    /// `UnknownTopic`; `Unavailable` when the topic is not in this broker's
    /// image and the controller cannot confirm.
    pub(crate) async fn topic_overrides(
        &self,
        topic: String,
    ) -> Result<std::collections::BTreeMap<String, String>, ApiError> {
        match self.controller.current_image().await {
            Ok(confirmed) => confirmed
                .image
                .topics
                .get(&topic)
                .map(|t| t.config.clone())
                .ok_or(ApiError::UnknownTopic(topic)),
            Err(e) => {
                self.controller.image().topics.get(&topic).map(|t| t.config.clone()).ok_or_else(|| {
                    ApiError::Unavailable(format!("this broker's metadata may be behind: {e}"))
                })
            }
        }
    }

    /// An admin request whose answer is only its error, if any.
    async fn admin_response(&self, req: ControllerRequest) -> Result<Response<AdminResponse>, Status> {
        let error = self.admin(req).await.err().and_then(|e| self.wire(&e));
        Ok(Response::new(AdminResponse { error }))
    }
}

/// A hosted replica found for a request ([`ClientService::served`]).
pub(crate) struct Served {
    /// The replica.
    pub(crate) partition: Arc<Partition>,
    /// Largest produce batch its topic takes here, bytes: the topic's
    /// `max.message.bytes`, capped by the broker's `limits.max_batch_bytes`.
    pub(crate) max_batch_bytes: usize,
    /// The topic's `message.timestamp.type` is `LogAppendTime`: records are
    /// stamped with the leader's clock when appended, whatever the producer set.
    pub(crate) log_append_time: bool,
    /// The topic's `cleanup.policy` compacts: every record needs a key.
    pub(crate) compacted: bool,
    /// The codec its `compression.type` stores batches with; `None` for
    /// `producer` (as the producer sent them).
    pub(crate) compression: Option<kafka_batch::Codec>,
}

type SubscribeStream = Pin<Box<dyn Stream<Item = Result<FetchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Ferrolog for ClientService {
    async fn join_group(
        &self,
        request: Request<JoinGroupRequest>,
    ) -> Result<Response<JoinGroupResponse>, Status> {
        let r = request.into_inner();
        let req = crate::coordinator::membership::JoinRequest {
            member_id: r.member_id,
            instance_id: r.group_instance_id,
            client_id: r.client_id,
            session_timeout_ms: r.session_timeout_ms,
            rebalance_timeout_ms: r.rebalance_timeout_ms,
            protocol_type: r.protocol_type,
            protocols: r.protocols.into_iter().map(|p| (p.name, p.metadata)).collect(),
        };
        Ok(Response::new(match self.coordinator.join(&r.group_id, req).await {
            Ok(j) => JoinGroupResponse {
                error: None,
                generation_id: j.generation,
                protocol_name: j.protocol,
                leader: j.leader,
                member_id: j.member_id,
                members: j
                    .members
                    .into_iter()
                    .map(|(member_id, group_instance_id, metadata)| JoinGroupMember {
                        member_id,
                        group_instance_id,
                        metadata,
                    })
                    .collect(),
            },
            Err(e) => JoinGroupResponse { error: self.wire(&e), ..JoinGroupResponse::default() },
        }))
    }

    async fn sync_group(
        &self,
        request: Request<SyncGroupRequest>,
    ) -> Result<Response<SyncGroupResponse>, Status> {
        let r = request.into_inner();
        let assignments = r.assignments.into_iter().map(|a| (a.member_id, a.assignment)).collect();
        let result = self
            .coordinator
            .sync(&r.group_id, r.generation_id, &r.member_id, r.group_instance_id.as_deref(), assignments)
            .await;
        Ok(Response::new(match result {
            Ok(s) => SyncGroupResponse { error: None, protocol_name: s.protocol, assignment: s.assignment },
            Err(e) => SyncGroupResponse { error: self.wire(&e), ..SyncGroupResponse::default() },
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let r = request.into_inner();
        let result = self
            .coordinator
            .heartbeat(&r.group_id, r.generation_id, &r.member_id, r.group_instance_id.as_deref())
            .await;
        Ok(Response::new(HeartbeatResponse { error: result.err().and_then(|e| self.wire(&e)) }))
    }

    async fn leave_group(
        &self,
        request: Request<LeaveGroupRequest>,
    ) -> Result<Response<LeaveGroupResponse>, Status> {
        let r = request.into_inner();
        let result = self.coordinator.leave(&r.group_id, &r.member_id, r.group_instance_id.as_deref()).await;
        Ok(Response::new(LeaveGroupResponse { error: result.err().and_then(|e| self.wire(&e)) }))
    }

    async fn find_coordinator(
        &self,
        request: Request<FindCoordinatorRequest>,
    ) -> Result<Response<FindCoordinatorResponse>, Status> {
        let group = request.into_inner().group_id;
        Ok(Response::new(match self.coordinator.find(&group).await {
            Ok((partition, broker)) => FindCoordinatorResponse {
                error: None,
                broker_id: broker,
                address: self
                    .controller
                    .image()
                    .brokers
                    .get(&broker)
                    .map(|b| b.client_addr.clone())
                    .unwrap_or_default(),
                partition,
            },
            Err(e) => FindCoordinatorResponse { error: self.wire(&e), ..FindCoordinatorResponse::default() },
        }))
    }

    async fn offset_commit(
        &self,
        request: Request<OffsetCommitRequest>,
    ) -> Result<Response<OffsetCommitResponse>, Status> {
        let r = request.into_inner();
        let offsets = r
            .offsets
            .into_iter()
            .map(|o| {
                Ok(CommitRequest {
                    topic_id: TopicId::from_wire(&o.topic_id).map_err(ApiError::Invalid)?,
                    topic: o.topic,
                    partition: o.partition,
                    offset: o.offset,
                    metadata: o.metadata,
                })
            })
            .collect::<Result<Vec<_>, ApiError>>();
        let member = (r.member_id.as_str(), r.group_instance_id.as_deref());
        let result = match offsets {
            Ok(offsets) => {
                self.coordinator
                    .commit(&r.group_id, r.generation_id, member, offsets, r.allow_backwards)
                    .await
            }
            Err(e) => Err(e),
        };
        Ok(Response::new(match result {
            Ok(results) => OffsetCommitResponse {
                error: None,
                results: results
                    .into_iter()
                    .map(|(c, e)| OffsetCommitResult {
                        topic: c.topic,
                        partition: c.partition,
                        error: e.and_then(|e| self.wire(&e)),
                    })
                    .collect(),
            },
            Err(e) => OffsetCommitResponse { error: self.wire(&e), results: Vec::new() },
        }))
    }

    async fn offset_fetch(
        &self,
        request: Request<OffsetFetchRequest>,
    ) -> Result<Response<OffsetFetchResponse>, Status> {
        let r = request.into_inner();
        let partitions = r
            .partitions
            .into_iter()
            .map(|p| Ok((p.topic, p.partition, TopicId::from_wire(&p.topic_id).map_err(ApiError::Invalid)?)))
            .collect::<Result<Vec<_>, ApiError>>();
        let result = match partitions {
            Ok(partitions) => self.coordinator.fetch(&r.group_id, partitions).await,
            Err(e) => Err(e),
        };
        Ok(Response::new(match result {
            Ok(offsets) => OffsetFetchResponse {
                error: None,
                offsets: offsets.into_iter().map(wire_committed).collect(),
            },
            Err(e) => OffsetFetchResponse { error: self.wire(&e), offsets: Vec::new() },
        }))
    }

    async fn list_groups(
        &self,
        _request: Request<ListGroupsRequest>,
    ) -> Result<Response<ListGroupsResponse>, Status> {
        let (listed, error) = self.coordinator.list().await;
        let groups = listed
            .into_iter()
            .map(|g| GroupListing {
                group_id: g.group,
                state: g.state.into(),
                members: g.members.len() as u32,
            })
            .collect();
        Ok(Response::new(ListGroupsResponse { error: error.and_then(|e| self.wire(&e)), groups }))
    }

    async fn describe_group(
        &self,
        request: Request<DescribeGroupRequest>,
    ) -> Result<Response<DescribeGroupResponse>, Status> {
        let group = request.into_inner().group_id;
        Ok(Response::new(match self.coordinator.describe(&group).await {
            Ok(d) => wire_description(d, self.broker),
            Err(e) => DescribeGroupResponse {
                error: self.wire(&e),
                group_id: group,
                ..DescribeGroupResponse::default()
            },
        }))
    }

    async fn delete_group(
        &self,
        request: Request<DeleteGroupRequest>,
    ) -> Result<Response<AdminResponse>, Status> {
        let group = request.into_inner().group_id;
        let error = self.coordinator.delete(&group).await.err().and_then(|e| self.wire(&e));
        Ok(Response::new(AdminResponse { error }))
    }

    async fn produce(&self, request: Request<ProduceRequest>) -> Result<Response<ProduceResponse>, Status> {
        let req = request.into_inner();
        let span = tracing::debug_span!("produce", node = self.broker, partition = %format!("{}-{}", req.topic, req.partition));
        let result = async {
            if req.topic == OFFSETS_TOPIC {
                return Err(ApiError::InternalTopic(req.topic));
            }
            let topic_id = TopicId::from_wire(&req.topic_id).map_err(ApiError::Invalid)?;
            let Served { partition, max_batch_bytes, log_append_time, compacted, compression } =
                self.served(&req.topic, req.partition, topic_id).await?;
            let mut rows = req.records;
            if compacted && let Some(i) = rows.iter().position(|r| r.key.is_none()) {
                // Kafka refuses these too: compaction keeps a record per key.
                return Err(ApiError::InvalidRecord(format!(
                    "record {i} has no key, and topic {:?} is compacted (cleanup.policy=compact): every \
                     record needs a key (an empty key is a key)",
                    req.topic
                )));
            }
            if log_append_time {
                // Unset: build_batch stamps them with now (Kafka's LogAppendTime).
                for r in &mut rows {
                    r.timestamp_ms = 0;
                }
            }
            let epoch = i16::try_from(req.producer_epoch).map_err(|_| {
                ApiError::Invalid(format!("producer epoch {} out of range", req.producer_epoch))
            })?;
            let producer = ProducerFields {
                producer_id: req.producer_id,
                producer_epoch: epoch,
                base_sequence: req.base_sequence,
            };
            let mut batch = records::build_batch(
                rows,
                producer,
                now_ms(),
                self.limits.max_record_bytes.min(max_batch_bytes),
                max_batch_bytes,
            )
            .map_err(|e| match e {
                BatchError::TooLarge(m) => ApiError::RecordTooLarge(m),
                BatchError::Invalid(m) => ApiError::Invalid(m),
            })?;
            if let Some(codec) = compression {
                // The topic's codec: stored as a Kafka batch of that codec.
                batch.records = records::decode(&batch.records)
                    .and_then(|rows| {
                        kafka_batch::payload_of(
                            &rows,
                            batch.producer_id,
                            batch.producer_epoch,
                            batch.base_sequence,
                            codec,
                            log_append_time,
                        )
                    })
                    .map_err(|e| ApiError::Invalid(format!("compression.type={}: {e}", codec.name())))?;
                let max = records::batch_encoded_bytes_max(max_batch_bytes);
                if batch.records.len() > max {
                    return Err(ApiError::RecordTooLarge(format!(
                        "the batch is {} bytes compressed with the topic's compression.type={}; at most {max} \
                         are stored",
                        batch.records.len(),
                        codec.name()
                    )));
                }
            }
            partition.produce(batch).await
        }
        .instrument(span)
        .await;
        Ok(Response::new(match result {
            Ok((base_offset, duplicate)) => ProduceResponse { error: None, base_offset, duplicate },
            Err(e) => ProduceResponse { error: self.wire(&e), ..ProduceResponse::default() },
        }))
    }

    async fn fetch(&self, request: Request<FetchRequest>) -> Result<Response<FetchResponse>, Status> {
        Ok(Response::new(self.fetch_answer(request.into_inner()).await))
    }

    type SubscribeStream = SubscribeStream;

    async fn subscribe(
        &self,
        request: Request<SubscribeRequest>,
    ) -> Result<Response<SubscribeStream>, Status> {
        let req = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<FetchResponse, Status>>(4);
        let this = self.clone();
        // A stream without an id is pinned to the incarnation it starts on,
        // so it never goes on reading a topic re-created under the name.
        let topic_id = match TopicId::from_wire(&req.topic_id) {
            Ok(Some(id)) => Ok(Some(id)),
            Ok(None) => Ok(self.controller.image().topics.get(&req.topic).map(|t| t.topic_id)),
            Err(e) => Err(ApiError::Invalid(e)),
        };
        tokio::spawn(
            async move {
                let mut offset = req.offset;
                let max_bytes = this.max_bytes(req.max_bytes);
                loop {
                    let partition = match &topic_id {
                        Ok(id) => this.partition(&req.topic, req.partition, *id).await,
                        Err(e) => Err(e.clone()),
                    };
                    let result = match partition {
                        Ok(p) => p.fetch(offset, max_bytes, SUBSCRIBE_WAIT).await,
                        Err(e) => Err(e),
                    };
                    let failed = result.is_err();
                    if let Ok(out) = &result
                        && out.batches.is_empty()
                    {
                        if tx.is_closed() {
                            return;
                        }
                        continue;
                    }
                    let response = this.fetch_response(result, max_bytes);
                    // Past what was sent (the decoded batches may have been cut short).
                    if let Some(last) = response.batches.last() {
                        offset = last.base_offset + u64::from(last.record_count);
                    }
                    let failed = failed || response.error.is_some();
                    if tx.send(Ok(response)).await.is_err() || failed {
                        return;
                    }
                }
            }
            .in_current_span(),
        );
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn list_offsets(
        &self,
        request: Request<ListOffsetsRequest>,
    ) -> Result<Response<ListOffsetsResponse>, Status> {
        let req = request.into_inner();
        let result = async {
            let topic_id = TopicId::from_wire(&req.topic_id).map_err(ApiError::Invalid)?;
            let p = self.partition(&req.topic, req.partition, topic_id).await?;
            let (start, hw) = p.offsets().await?;
            match OffsetSpec::try_from(req.spec) {
                Ok(OffsetSpec::Earliest) => Ok((start, true, None)),
                Ok(OffsetSpec::Latest) => Ok((hw, true, None)),
                Ok(OffsetSpec::Timestamp) => Ok(match p.offset_for_timestamp(req.timestamp_ms).await? {
                    Some((offset, timestamp_ms)) => (offset, true, Some(timestamp_ms)),
                    None => (hw, false, None),
                }),
                Err(_) => Err(ApiError::Invalid(format!("unknown offset spec {}", req.spec))),
            }
        }
        .await;
        Ok(Response::new(match result {
            Ok((offset, found, timestamp_ms)) => {
                ListOffsetsResponse { error: None, offset, found, timestamp_ms }
            }
            Err(e) => ListOffsetsResponse { error: self.wire(&e), ..ListOffsetsResponse::default() },
        }))
    }

    async fn metadata(
        &self,
        request: Request<MetadataRequest>,
    ) -> Result<Response<MetadataResponse>, Status> {
        let req = request.into_inner();
        let image = self.controller.image();
        let (open_files, open_files_limit) = crate::control::files::last_usage().unwrap_or_default();
        let replicas = self.groups.partition_count() as u64;
        let dormant_replicas = ferrolog_replica::dormant_count() as u64;
        let dormant_wakes = ferrolog_replica::woken_count();
        let metadata_failure = self.metadata_failure.get().unwrap_or_default();
        let brokers = image
            .brokers
            .iter()
            .map(|(id, b)| {
                let own = *id == self.broker;
                BrokerInfo {
                    id: *id,
                    address: b.client_addr.clone(),
                    peer_address: b.peer_addr.clone(),
                    alive: own || self.liveness.is_alive(*id),
                    open_files: if own { open_files } else { 0 },
                    open_files_limit: if own { open_files_limit } else { 0 },
                    replicas: if own { replicas } else { 0 },
                    dormant_replicas: if own { dormant_replicas } else { 0 },
                    dormant_wakes: if own { dormant_wakes } else { 0 },
                    decommissioned: b.decommissioned,
                    metadata_replica_failure: if own { metadata_failure.clone() } else { String::new() },
                }
            })
            .collect();
        let mut error = None;
        let mut topics = Vec::new();
        for (name, t) in &image.topics {
            if !req.topics.is_empty() && !req.topics.contains(name) {
                continue;
            }
            let partitions = t
                .partitions
                .iter()
                .enumerate()
                .map(|(i, a)| PartitionInfo {
                    partition: i as u32,
                    group_id: a.group,
                    leader: self.leader_of(a),
                    replicas: a.replicas.iter().map(|r| r.broker).collect(),
                    adding_replicas: a.adding(),
                    removing_replicas: a.removing(),
                    reassignment_cancelled: a.reassignment.as_ref().is_some_and(|r| r.cancelled),
                    reassigning: a.reassignment.is_some(),
                })
                .collect();
            topics.push(TopicInfo {
                topic_id: t.topic_id.to_wire(),
                name: name.clone(),
                partitions,
                replication_factor: t.replication_factor,
            });
        }
        if let Some(missing) = req.topics.iter().find(|t| !image.topics.contains_key(*t)) {
            error = self.wire(&ApiError::UnknownTopic(missing.clone()));
        }
        // A broker whose image does not even list itself (one that just
        // joined, before the metadata log reached it, or a new cluster
        // before registrations commit) knows nothing a client could use:
        // its empty topic list must not read as "no such topic".
        if !image.brokers.contains_key(&self.broker) {
            error = self.wire(&ApiError::Unavailable(
                "this broker has not received the cluster metadata yet (it just started or joined)".into(),
            ));
        }
        let controller = self.controller.leader().unwrap_or(0);
        let cluster_brokers = self.controller.cluster_brokers().into_iter().collect();
        Ok(Response::new(MetadataResponse {
            error,
            brokers,
            topics,
            controller,
            max_record_bytes: self.limits.max_record_bytes as u64,
            max_batch_bytes: self.limits.max_batch_bytes as u64,
            cluster_brokers,
            controller_voters: self.controller.voter_brokers().into_iter().collect(),
        }))
    }

    async fn create_topic(
        &self,
        request: Request<CreateTopicRequest>,
    ) -> Result<Response<AdminResponse>, Status> {
        let r = request.into_inner();
        let result = self
            .create_topic_op(r.name, r.partitions, r.replication_factor, r.configs.into_iter().collect())
            .await;
        Ok(Response::new(AdminResponse { error: result.err().and_then(|e| self.wire(&e)) }))
    }

    async fn alter_topic_config(
        &self,
        request: Request<AlterTopicConfigRequest>,
    ) -> Result<Response<AdminResponse>, Status> {
        let r = request.into_inner();
        const KEPT: [&str; 3] = ["cleanup.policy", "retention.ms", "retention.bytes"];
        if r.topic == OFFSETS_TOPIC
            && let Some(k) = r.set.keys().chain(r.delete.iter()).find(|k| KEPT.contains(&k.as_str()))
        {
            let e = ApiError::InvalidConfig(format!(
                "{k} of {OFFSETS_TOPIC} is fixed: it is compacted and keeps every group's last commit"
            ));
            return Ok(Response::new(AdminResponse { error: self.wire(&e) }));
        }
        let req = ControllerRequest::AlterTopicConfig {
            name: r.topic,
            set: r.set.into_iter().collect(),
            delete: r.delete,
        };
        self.admin_response(req).await
    }

    async fn describe_topic_config(
        &self,
        request: Request<DescribeTopicConfigRequest>,
    ) -> Result<Response<DescribeTopicConfigResponse>, Status> {
        let topic = request.into_inner().topic;
        let result = self.topic_overrides(topic).await;
        Ok(Response::new(match result {
            Ok(overrides) => DescribeTopicConfigResponse {
                error: None,
                entries: self
                    .topic_defaults
                    .effective(&overrides)
                    .into_iter()
                    .map(|e| ConfigEntry {
                        name: e.name.to_owned(),
                        doc: topic_config::spec(e.name).map(|s| s.doc.to_owned()).unwrap_or_default(),
                        value: e.value,
                        source: match e.source {
                            ConfigSource::Topic => WireSource::Topic,
                            ConfigSource::Broker => WireSource::Broker,
                            ConfigSource::Default => WireSource::Default,
                        } as i32,
                    })
                    .collect(),
            },
            Err(e) => DescribeTopicConfigResponse { error: self.wire(&e), entries: Vec::new() },
        }))
    }

    async fn decommission_broker(
        &self,
        request: Request<DecommissionBrokerRequest>,
    ) -> Result<Response<AdminResponse>, Status> {
        let id = request.into_inner().broker_id;
        self.admin_response(ControllerRequest::DecommissionBroker { id }).await
    }

    async fn add_raft_voter(
        &self,
        request: Request<AddRaftVoterRequest>,
    ) -> Result<Response<AdminResponse>, Status> {
        let id = request.into_inner().broker_id;
        self.admin_response(ControllerRequest::AddControllerVoter { id }).await
    }

    async fn remove_raft_voter(
        &self,
        request: Request<RemoveRaftVoterRequest>,
    ) -> Result<Response<AdminResponse>, Status> {
        let id = request.into_inner().broker_id;
        self.admin_response(ControllerRequest::RemoveControllerVoter { id }).await
    }

    async fn create_partitions(
        &self,
        request: Request<CreatePartitionsRequest>,
    ) -> Result<Response<AdminResponse>, Status> {
        let r = request.into_inner();
        let result = self.create_partitions_op(r.topic, r.count).await;
        Ok(Response::new(AdminResponse { error: result.err().and_then(|e| self.wire(&e)) }))
    }

    async fn delete_topic(
        &self,
        request: Request<DeleteTopicRequest>,
    ) -> Result<Response<AdminResponse>, Status> {
        let name = request.into_inner().name;
        let result = self.delete_topic_op(name).await;
        Ok(Response::new(AdminResponse { error: result.err().and_then(|e| self.wire(&e)) }))
    }

    async fn init_producer_id(
        &self,
        _request: Request<InitProducerIdRequest>,
    ) -> Result<Response<InitProducerIdResponse>, Status> {
        Ok(Response::new(match self.admin(ControllerRequest::AllocateProducerId).await {
            Ok(ControllerReply::ProducerId { producer_id }) => {
                InitProducerIdResponse { error: None, producer_id, producer_epoch: 0 }
            }
            Ok(other) => InitProducerIdResponse {
                error: self.wire(&ApiError::Unavailable(format!("unexpected controller reply {other:?}"))),
                ..InitProducerIdResponse::default()
            },
            Err(e) => InitProducerIdResponse { error: self.wire(&e), ..InitProducerIdResponse::default() },
        }))
    }

    async fn partition_status(
        &self,
        request: Request<PartitionStatusRequest>,
    ) -> Result<Response<PartitionStatusResponse>, Status> {
        let req = request.into_inner();
        if let Some(f) = self.failures.failure(&req.topic, req.partition) {
            return Ok(Response::new(PartitionStatusResponse {
                replica_state: ReplicaState::Failed as i32,
                replica_detail: f.to_string(),
                ..PartitionStatusResponse::default()
            }));
        }
        Ok(Response::new(match self.partition(&req.topic, req.partition, None).await {
            Ok(p) => {
                let s = p.status();
                let (replica_state, replica_detail) = match p.replica.recovering() {
                    Some(reason) => (ReplicaState::Recovering, reason),
                    None => (ReplicaState::Running, String::new()),
                };
                PartitionStatusResponse {
                    replica_state: replica_state as i32,
                    replica_detail,
                    error: None,
                    leader: s.leader.unwrap_or(0),
                    term: s.term,
                    commit_index: s.commit_index,
                    last_log_index: s.last_log_index,
                    high_watermark: s.high_watermark,
                    log_start_offset: s.log_start_offset,
                    followers: s
                        .followers
                        .into_iter()
                        .map(|f| FollowerStatus {
                            broker_id: f.broker,
                            node_id: f.node,
                            matched_index: f.matched,
                            lag: s.last_log_index.saturating_sub(f.matched.unwrap_or(0)),
                            learner: f.learner,
                        })
                        .collect(),
                }
            }
            Err(e) => PartitionStatusResponse { error: self.wire(&e), ..PartitionStatusResponse::default() },
        }))
    }

    async fn alter_partition_reassignments(
        &self,
        request: Request<AlterPartitionReassignmentsRequest>,
    ) -> Result<Response<AlterPartitionReassignmentsResponse>, Status> {
        let req = request.into_inner();
        if req.partitions.len() > MAX_REASSIGNMENTS_PER_REQUEST {
            let e = ApiError::Invalid(format!(
                "{} partitions in one request; at most {MAX_REASSIGNMENTS_PER_REQUEST}",
                req.partitions.len()
            ));
            return Ok(Response::new(AlterPartitionReassignmentsResponse {
                error: self.wire(&e),
                results: vec![],
            }));
        }
        // One controller request (one commit) for all of them; a
        // controller older than 1.6 does not know it: one each then.
        let moves: Vec<PartitionMove> = req
            .partitions
            .iter()
            .map(|p| PartitionMove {
                topic: p.topic.clone(),
                partition: p.partition,
                replicas: (!p.cancel).then(|| p.replicas.clone()),
            })
            .collect();
        let outcomes: Vec<Result<(), ApiError>> = match self
            .controller
            .handle(ControllerRequest::ReassignPartitions { moves: moves.clone() })
            .await
        {
            Ok(ControllerReply::Each { results }) if results.len() == req.partitions.len() => results,
            Ok(other) => {
                let e = ApiError::Unavailable(format!("unexpected controller answer {other:?}"));
                vec![Err(e); req.partitions.len()]
            }
            Err(ApiError::Invalid(m)) if m.contains("does not decode") => {
                let mut each = Vec::with_capacity(moves.len());
                for m in moves {
                    each.push(self.controller.handle(m.into_request()).await.map(|_| ()));
                }
                each
            }
            Err(e) => vec![Err(e); req.partitions.len()],
        };
        let mut results = Vec::with_capacity(req.partitions.len());
        for (p, outcome) in req.partitions.into_iter().zip(outcomes) {
            match &outcome {
                Ok(_) => tracing::info!(topic = %p.topic, partition = p.partition, replicas = ?p.replicas,
                    cancel = p.cancel, "reassignment request committed"),
                Err(e) => {
                    tracing::info!(topic = %p.topic, partition = p.partition, "reassignment refused: {e}")
                }
            }
            results.push(ReassignmentResult {
                topic: p.topic,
                partition: p.partition,
                error: outcome.err().and_then(|e| self.wire(&e)),
            });
        }
        Ok(Response::new(AlterPartitionReassignmentsResponse { error: None, results }))
    }

    async fn transfer_leader(
        &self,
        request: Request<TransferLeaderRequest>,
    ) -> Result<Response<TransferLeaderResponse>, Status> {
        let req = request.into_inner();
        let span = tracing::info_span!("transfer_leader", node = self.broker, partition = %format!("{}-{}", req.topic, req.partition));
        let result = self.transfer_leadership(&req).instrument(span).await;
        Ok(Response::new(match result {
            Ok((leader, term)) => TransferLeaderResponse { error: None, leader, term },
            Err(e) => TransferLeaderResponse { error: self.wire(&e), ..TransferLeaderResponse::default() },
        }))
    }
}

impl ClientService {
    /// TransferLeader on the partition's leader: hands the leadership to
    /// the requested replica (the preferred one by default) and returns the
    /// new leader's broker and term.
    ///
    /// # Errors
    /// Not leader / unknown topic; `INVALID_REQUEST` for a broker without
    /// a voting replica; `ELECTION_NOT_NEEDED` when the replica leads
    /// already; `PREFERRED_LEADER_NOT_AVAILABLE` when it cannot take over
    /// within [`TRANSFER_LEADER_WAIT`] (the leadership then stays, or moves
    /// to another caught-up replica if the hand-over was begun: see
    /// [`handover::HandOver::transfer_to`]).
    async fn transfer_leadership(&self, req: &TransferLeaderRequest) -> Result<(BrokerId, u64), ApiError> {
        let name = format!("{}-{}", req.topic, req.partition);
        let p = self.partition(&req.topic, req.partition, None).await?;
        p.ready_leader().await?;
        let h = self
            .groups
            .get(p.group)
            .ok_or_else(|| ApiError::Unavailable(format!("{name} is not open here")))?;
        let replicas = handover::voters_in_order(&h, p.group, &self.controller.image());
        let to = match req.to_broker {
            0 => replicas
                .first()
                .map(|r| r.1)
                .ok_or_else(|| ApiError::Unavailable(format!("{name} has no voters")))?,
            b => b,
        };
        if !replicas.iter().any(|r| r.1 == to) {
            let brokers: Vec<String> = replicas.iter().map(|r| r.1.to_string()).collect();
            return Err(ApiError::Invalid(format!(
                "broker {to} holds no voting replica of {name} (its voters are on brokers {})",
                brokers.join(", ")
            )));
        }
        if to == self.broker {
            return Err(ApiError::ElectionNotNeeded(format!("broker {to} leads {name} already")));
        }
        if self.groups.draining() {
            return Err(ApiError::Unavailable(format!("broker {} is shutting down", self.broker)));
        }
        match self.hand_over.transfer_to(p.group, replicas, to, TRANSFER_LEADER_WAIT).await {
            handover::Transfer::Moved => {
                tracing::info!(to, "leadership handed over on request");
                Ok((to, h.raft.state(|s| s.term())))
            }
            handover::Transfer::NotLeader => Err(ApiError::NotLeader { leader: p.leader_broker() }),
            handover::Transfer::NotMoved(why) => Err(ApiError::PreferredLeaderNotAvailable(why)),
            handover::Transfer::Elsewhere(b) => Err(ApiError::PreferredLeaderNotAvailable(format!(
                "broker {to} did not take {name} over within {TRANSFER_LEADER_WAIT:?}; broker {b} leads it now"
            ))),
            handover::Transfer::Stalled => Err(ApiError::PreferredLeaderNotAvailable(format!(
                "broker {to} did not take {name} over within {TRANSFER_LEADER_WAIT:?}, nor did another replica: its replicas are electing a leader"
            ))),
        }
    }
}

/// A committed offset on the wire.
fn wire_committed(c: coordinator::CommittedOffset) -> WireCommitted {
    let (offset, metadata, commit_timestamp_ms) = match c.committed {
        Some(v) => (Some(v.offset), v.metadata, v.commit_timestamp_ms),
        None => (None, String::new(), 0),
    };
    WireCommitted { topic: c.topic, partition: c.partition, offset, metadata, commit_timestamp_ms }
}

/// A group's description on the wire, as answered by `coordinator`.
fn wire_description(d: GroupDescription, coordinator: BrokerId) -> DescribeGroupResponse {
    let consumer = d.protocol_type == "consumer";
    DescribeGroupResponse {
        error: None,
        group_id: d.group,
        state: d.state.into(),
        generation_id: d.generation,
        protocol: d.protocol,
        members: d
            .members
            .into_iter()
            .map(|m| GroupMember {
                member_id: m.id,
                client_id: m.client_id,
                group_instance_id: m.instance_id.unwrap_or_default(),
                // A consumer's partitions, as far as its assignment decodes.
                assignment: consumer
                    .then(|| coordinator::consumer_protocol::assigned_partitions(&m.assignment))
                    .flatten()
                    .unwrap_or_default()
                    .into_iter()
                    .flat_map(|(topic, partitions)| {
                        partitions.into_iter().map(move |partition| TopicPartition {
                            topic: topic.clone(),
                            partition,
                            topic_id: Default::default(),
                        })
                    })
                    .collect(),
            })
            .collect(),
        offsets: d.offsets.into_iter().map(wire_committed).collect(),
        coordinator,
    }
}

//! The producer against a fake broker that misbehaves on purpose: it
//! answers NOT_LEADER and UNAVAILABLE, drops the answer to batches it did
//! store (so they are sent again), delays requests so they arrive out of
//! order, and enforces KIP-98 sequences the way the real broker does (a gap
//! waits briefly, then OUT_OF_ORDER_SEQUENCE; a stored batch sent again is
//! a duplicate with its original offset).
//!
//! Whatever the faults, every record must be delivered, stored exactly
//! once, in send order within its partition, at the offset its delivery
//! reported.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrolog_client::{ClientConfig, MetadataCache, Producer, ProducerConfig, Record};
use ferrolog_proto::client as pb;
use ferrolog_proto::client::ferrolog_server::{Ferrolog, FerrologServer};
use tonic::{Request, Response, Status};

const PARTITIONS: u32 = 3;
const TOPIC: &str = "t";

/// Per-partition log and idempotence state of the fake broker.
#[derive(Default)]
struct Log {
    /// Stored record values, offset = index.
    values: Vec<Vec<u8>>,
    /// (producer id) → next expected sequence.
    next_sequence: HashMap<i64, i32>,
    /// (producer id, base sequence) → base offset of a stored batch.
    stored: HashMap<(i64, i32), u64>,
}

#[derive(Default)]
struct State {
    logs: HashMap<u32, Log>,
    /// A deterministic source of faults.
    rng: u64,
    requests: u64,
    faults: HashMap<&'static str, u64>,
    /// While set, every produce request fails without an answer, half of
    /// them after storing the batch.
    blackout: bool,
}

impl State {
    /// True with probability `percent` %.
    fn chance(&mut self, percent: u64, what: &'static str) -> bool {
        // xorshift64
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let hit = self.rng % 100 < percent;
        if hit {
            *self.faults.entry(what).or_default() += 1;
        }
        hit
    }
}

#[derive(Clone)]
struct FakeBroker {
    address: String,
    state: Arc<Mutex<State>>,
    next_producer_id: Arc<Mutex<i64>>,
    /// How long a batch after a sequence gap waits for it to fill (the real
    /// broker waits 500 ms).
    gap_wait: Duration,
}

fn error(code: pb::ErrorCode, message: &str) -> Option<pb::Error> {
    Some(pb::Error { code: code as i32, message: message.into(), ..Default::default() })
}

impl FakeBroker {
    /// Appends the batch if its sequence is the next expected one, answers
    /// a duplicate or a sequence below the expected one; `None` for a gap.
    fn try_append(&self, req: &pb::ProduceRequest) -> Option<Result<Response<pb::ProduceResponse>, Status>> {
        let mut s = self.state.lock().expect("lock");
        let log = s.logs.entry(req.partition).or_default();
        let expected = *log.next_sequence.get(&req.producer_id).unwrap_or(&0);
        if req.base_sequence < expected {
            let answer = match log.stored.get(&(req.producer_id, req.base_sequence)) {
                Some(&base) => {
                    pb::ProduceResponse { base_offset: base, duplicate: true, ..Default::default() }
                }
                None => pb::ProduceResponse {
                    error: error(pb::ErrorCode::OutOfOrderSequence, "below the expected sequence"),
                    ..Default::default()
                },
            };
            return Some(Ok(Response::new(answer)));
        }
        if req.base_sequence > expected {
            return None;
        }
        let base = log.values.len() as u64;
        log.values.extend(req.records.iter().map(|r| r.value.to_vec()));
        log.next_sequence.insert(req.producer_id, expected + req.records.len() as i32);
        log.stored.insert((req.producer_id, req.base_sequence), base);
        if s.chance(10, "answer lost after storing") {
            return Some(Err(Status::unavailable("connection reset (injected)")));
        }
        Some(Ok(Response::new(pb::ProduceResponse { base_offset: base, ..Default::default() })))
    }
}

type SubscribeStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::FetchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Ferrolog for FakeBroker {
    async fn produce(
        &self,
        request: Request<pb::ProduceRequest>,
    ) -> Result<Response<pb::ProduceResponse>, Status> {
        let req = request.into_inner();
        let (delay_ms, refuse) = {
            let mut s = self.state.lock().expect("lock");
            s.requests += 1;
            if s.blackout {
                drop(s);
                if let Some(Ok(_)) = self.try_append(&req) {
                    *self.state.lock().expect("lock").faults.entry("stored in the blackout").or_default() +=
                        1;
                }
                return Err(Status::unavailable("blackout (injected)"));
            }
            let delay = if s.chance(20, "delayed") { 1 + s.rng % 15 } else { 0 };
            let refuse = if s.chance(8, "not leader") {
                Some(error(pb::ErrorCode::NotLeader, "moved"))
            } else if s.chance(4, "unavailable") {
                Some(error(pb::ErrorCode::Unavailable, "electing"))
            } else {
                None
            };
            (delay, refuse)
        };
        // Delays let later batches overtake earlier ones.
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        if let Some(e) = refuse {
            let mut e = e;
            if let Some(err) = &mut e
                && err.code == pb::ErrorCode::NotLeader as i32
            {
                err.leader = Some(pb::LeaderHint { broker_id: 1, address: self.address.clone() });
            }
            return Ok(Response::new(pb::ProduceResponse { error: e, ..Default::default() }));
        }
        if req.records.iter().any(|r| r.value.starts_with(b"poison")) {
            let e = error(pb::ErrorCode::RecordTooLarge, "poisoned batch (injected)");
            return Ok(Response::new(pb::ProduceResponse { error: e, ..Default::default() }));
        }
        // Wait a while for a sequence gap to fill, as the real broker does.
        let deadline = tokio::time::Instant::now() + self.gap_wait;
        loop {
            if let Some(answer) = self.try_append(&req) {
                return answer;
            }
            if tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(Response::new(pb::ProduceResponse {
            error: error(pb::ErrorCode::OutOfOrderSequence, "gap not filled"),
            ..Default::default()
        }))
    }

    async fn metadata(
        &self,
        _: Request<pb::MetadataRequest>,
    ) -> Result<Response<pb::MetadataResponse>, Status> {
        Ok(Response::new(pb::MetadataResponse {
            error: None,
            brokers: vec![pb::BrokerInfo {
                id: 1,
                address: self.address.clone(),
                peer_address: String::new(),
                alive: true,
                ..Default::default()
            }],
            topics: vec![pb::TopicInfo {
                name: TOPIC.into(),
                partitions: (0..PARTITIONS)
                    .map(|p| pb::PartitionInfo {
                        partition: p,
                        group_id: u64::from(p),
                        leader: 1,
                        replicas: vec![1],
                        ..pb::PartitionInfo::default()
                    })
                    .collect(),
                replication_factor: 1,
                // A broker from before topic ids (KIP-516): none sent.
                topic_id: Default::default(),
            }],
            controller: 1,
            cluster_brokers: vec![1],
            ..pb::MetadataResponse::default()
        }))
    }

    async fn init_producer_id(
        &self,
        _: Request<pb::InitProducerIdRequest>,
    ) -> Result<Response<pb::InitProducerIdResponse>, Status> {
        let mut id = self.next_producer_id.lock().expect("lock");
        *id += 1;
        Ok(Response::new(pb::InitProducerIdResponse { error: None, producer_id: *id, producer_epoch: 0 }))
    }

    async fn fetch(&self, _: Request<pb::FetchRequest>) -> Result<Response<pb::FetchResponse>, Status> {
        Err(Status::unimplemented("fetch"))
    }

    type SubscribeStream = SubscribeStream;

    async fn subscribe(&self, _: Request<pb::SubscribeRequest>) -> Result<Response<SubscribeStream>, Status> {
        Err(Status::unimplemented("subscribe"))
    }

    async fn list_offsets(
        &self,
        _: Request<pb::ListOffsetsRequest>,
    ) -> Result<Response<pb::ListOffsetsResponse>, Status> {
        Err(Status::unimplemented("list offsets"))
    }

    async fn create_topic(
        &self,
        _: Request<pb::CreateTopicRequest>,
    ) -> Result<Response<pb::AdminResponse>, Status> {
        Err(Status::unimplemented("create topic"))
    }

    async fn delete_topic(
        &self,
        _: Request<pb::DeleteTopicRequest>,
    ) -> Result<Response<pb::AdminResponse>, Status> {
        Err(Status::unimplemented("delete topic"))
    }

    async fn partition_status(
        &self,
        _: Request<pb::PartitionStatusRequest>,
    ) -> Result<Response<pb::PartitionStatusResponse>, Status> {
        Err(Status::unimplemented("partition status"))
    }

    async fn transfer_leader(
        &self,
        _: Request<pb::TransferLeaderRequest>,
    ) -> Result<Response<pb::TransferLeaderResponse>, Status> {
        Err(Status::unimplemented("transfer leader"))
    }

    async fn decommission_broker(
        &self,
        _: Request<pb::DecommissionBrokerRequest>,
    ) -> Result<Response<pb::AdminResponse>, Status> {
        Err(Status::unimplemented("decommission broker"))
    }

    async fn add_raft_voter(
        &self,
        _: Request<pb::AddRaftVoterRequest>,
    ) -> Result<Response<pb::AdminResponse>, Status> {
        Err(Status::unimplemented("add raft voter"))
    }

    async fn remove_raft_voter(
        &self,
        _: Request<pb::RemoveRaftVoterRequest>,
    ) -> Result<Response<pb::AdminResponse>, Status> {
        Err(Status::unimplemented("remove raft voter"))
    }

    async fn create_partitions(
        &self,
        _: Request<pb::CreatePartitionsRequest>,
    ) -> Result<Response<pb::AdminResponse>, Status> {
        Err(Status::unimplemented("create partitions"))
    }

    async fn alter_topic_config(
        &self,
        _: Request<pb::AlterTopicConfigRequest>,
    ) -> Result<Response<pb::AdminResponse>, Status> {
        Err(Status::unimplemented("alter topic config"))
    }

    async fn describe_topic_config(
        &self,
        _: Request<pb::DescribeTopicConfigRequest>,
    ) -> Result<Response<pb::DescribeTopicConfigResponse>, Status> {
        Err(Status::unimplemented("describe topic config"))
    }

    async fn find_coordinator(
        &self,
        _: Request<pb::FindCoordinatorRequest>,
    ) -> Result<Response<pb::FindCoordinatorResponse>, Status> {
        Err(Status::unimplemented("find coordinator"))
    }

    async fn offset_commit(
        &self,
        _: Request<pb::OffsetCommitRequest>,
    ) -> Result<Response<pb::OffsetCommitResponse>, Status> {
        Err(Status::unimplemented("offset commit"))
    }

    async fn offset_fetch(
        &self,
        _: Request<pb::OffsetFetchRequest>,
    ) -> Result<Response<pb::OffsetFetchResponse>, Status> {
        Err(Status::unimplemented("offset fetch"))
    }

    async fn list_groups(
        &self,
        _: Request<pb::ListGroupsRequest>,
    ) -> Result<Response<pb::ListGroupsResponse>, Status> {
        Err(Status::unimplemented("list groups"))
    }

    async fn describe_group(
        &self,
        _: Request<pb::DescribeGroupRequest>,
    ) -> Result<Response<pb::DescribeGroupResponse>, Status> {
        Err(Status::unimplemented("describe group"))
    }

    async fn delete_group(
        &self,
        _: Request<pb::DeleteGroupRequest>,
    ) -> Result<Response<pb::AdminResponse>, Status> {
        Err(Status::unimplemented("delete group"))
    }

    async fn join_group(
        &self,
        _: Request<pb::JoinGroupRequest>,
    ) -> Result<Response<pb::JoinGroupResponse>, Status> {
        Err(Status::unimplemented("join group"))
    }

    async fn sync_group(
        &self,
        _: Request<pb::SyncGroupRequest>,
    ) -> Result<Response<pb::SyncGroupResponse>, Status> {
        Err(Status::unimplemented("sync group"))
    }

    async fn heartbeat(
        &self,
        _: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        Err(Status::unimplemented("heartbeat"))
    }

    async fn leave_group(
        &self,
        _: Request<pb::LeaveGroupRequest>,
    ) -> Result<Response<pb::LeaveGroupResponse>, Status> {
        Err(Status::unimplemented("leave group"))
    }

    async fn alter_partition_reassignments(
        &self,
        _: Request<pb::AlterPartitionReassignmentsRequest>,
    ) -> Result<Response<pb::AlterPartitionReassignmentsResponse>, Status> {
        Err(Status::unimplemented("alter partition reassignments"))
    }
}

/// Starts a fake broker on a free port; returns its address and state.
async fn start_fake(
    gap_wait: Duration,
) -> (String, Arc<Mutex<State>>, tokio::task::JoinHandle<Result<(), tonic::transport::Error>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("addr").to_string();
    let state = Arc::new(Mutex::new(State { rng: 0x9e37_79b9_7f4a_7c15, ..State::default() }));
    let broker = FakeBroker {
        address: address.clone(),
        state: state.clone(),
        next_producer_id: Arc::default(),
        gap_wait,
    };
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(FerrologServer::new(broker))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (address, state, server)
}

fn stored(s: &State, partition: u32) -> Vec<String> {
    s.logs.get(&partition).map_or_else(Vec::new, |l| {
        l.values.iter().map(|v| String::from_utf8(v.clone()).expect("utf-8")).collect()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_never_lose_duplicate_or_reorder_records() {
    let (address, state, server) = start_fake(Duration::from_millis(200)).await;
    let meta = MetadataCache::new(ClientConfig::from_list(&address)).expect("meta");
    // Small batches and a short linger: many batches in flight per partition.
    let config = ProducerConfig { batch_bytes_max: 512, linger_ms: 1, ..ProducerConfig::default() };
    let producer = Producer::new(meta, config).expect("producer");
    const RECORDS: usize = 4000;
    let mut sent: HashMap<u32, Vec<String>> = HashMap::new();
    let mut deliveries = Vec::with_capacity(RECORDS);
    for i in 0..RECORDS {
        let value = format!("record-{i:05}");
        let key = format!("key-{}", i % 17);
        let partition = ferrolog_client::partitioner::partition_for_key(key.as_bytes(), PARTITIONS);
        sent.entry(partition).or_default().push(value.clone());
        deliveries.push((partition, value.clone(), producer.send(TOPIC, Record::new(value).with_key(key))));
        if i % 200 == 0 {
            tokio::task::yield_now().await;
        }
    }
    let outcome = tokio::time::timeout(Duration::from_secs(120), async {
        let mut acked = Vec::with_capacity(RECORDS);
        for (partition, value, delivery) in deliveries {
            let meta = delivery.await.unwrap_or_else(|e| panic!("{value} not delivered: {e}"));
            assert_eq!(meta.partition, partition, "{value}");
            acked.push((partition, meta.offset, value));
        }
        acked
    })
    .await
    .expect("every delivery resolves within 120 s");
    producer.close().await;

    let s = state.lock().expect("lock");
    println!("{} produce requests; injected faults: {:?}", s.requests, s.faults);
    for fault in ["not leader", "unavailable", "answer lost after storing", "delayed"] {
        assert!(s.faults.get(fault).copied().unwrap_or(0) > 0, "no {fault:?} fault was injected");
    }
    for p in 0..PARTITIONS {
        let log = stored(&s, p);
        let want = sent.remove(&p).unwrap_or_default();
        assert_eq!(log.len(), want.len(), "partition {p}: stored {} of {} records", log.len(), want.len());
        assert_eq!(log, want, "partition {p}: stored once each, in send order");
    }
    for (partition, offset, value) in outcome {
        let stored = &s.logs[&partition].values[offset as usize];
        assert_eq!(stored.as_slice(), value.as_bytes(), "the offset reported for {value} holds it");
    }
    server.abort();
}

/// A batch the broker refuses for good (RECORD_TOO_LARGE) leaves a gap in
/// the sequence: its records fail, and the partition goes on under a new
/// producer id, with every later record stored once and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_batch_fails_alone_and_the_partition_goes_on() {
    let (address, state, server) = start_fake(Duration::from_millis(200)).await;
    let meta = MetadataCache::new(ClientConfig::from_list(&address)).expect("meta");
    let config = ProducerConfig { batch_bytes_max: 256, linger_ms: 1, ..ProducerConfig::default() };
    let producer = Producer::new(meta, config).expect("producer");
    let mut deliveries = Vec::new();
    for i in 0..1500 {
        let value = if i % 500 == 250 { format!("poison-{i:05}") } else { format!("record-{i:05}") };
        deliveries.push((value.clone(), producer.send(TOPIC, Record::new(value).with_partition(0))));
    }
    let mut delivered = Vec::new();
    let mut refused = Vec::new();
    for (value, delivery) in deliveries {
        let result =
            tokio::time::timeout(Duration::from_secs(120), delivery).await.expect("resolves in time");
        match result {
            Ok(m) => delivered.push((m.offset, value)),
            Err(ferrolog_client::Error::RecordTooLarge { .. }) => refused.push(value),
            Err(e) => panic!("{value}: unexpected {e}"),
        }
    }
    producer.close().await;
    assert!(refused.iter().filter(|v| v.starts_with("poison")).count() == 3, "{refused:?}");
    assert!(refused.len() < 60, "only the poisoned batches fail: {refused:?}");
    let s = state.lock().expect("lock");
    let log = stored(&s, 0);
    let want: Vec<String> = delivered.iter().map(|(_, v)| v.clone()).collect();
    assert_eq!(log, want, "every other record stored once, in send order");
    for (offset, value) in &delivered {
        assert_eq!(&log[*offset as usize], value);
    }
    server.abort();
}

/// A blackout longer than the delivery timeout: batches expire while some
/// of them were stored with their answers lost. Every record is delivered
/// or times out; none is stored twice; what is stored keeps the send order;
/// every delivered record is at the offset reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiries_in_a_blackout_never_store_a_record_twice() {
    // RUST_LOG=ferrolog_client=trace shows every request and expiry.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let (address, state, server) = start_fake(Duration::from_millis(200)).await;
    // Backoff well under the delivery timeout, so recovery is quick.
    let client = ClientConfig {
        backoff: ferrolog_client::retry::Backoff { initial_ms: 5, max_ms: 50 },
        ..ClientConfig::from_list(&address)
    };
    let meta = MetadataCache::new(client).expect("meta");
    let config = ProducerConfig {
        batch_bytes_max: 256,
        linger_ms: 1,
        delivery_timeout_ms: 1000,
        ..ProducerConfig::default()
    };
    let producer = Producer::new(meta, config).expect("producer");
    let switch = state.clone();
    let blackout = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(150)).await;
        switch.lock().expect("lock").blackout = true;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        switch.lock().expect("lock").blackout = false;
    });
    let mut deliveries = Vec::new();
    for i in 0..3000 {
        let value = format!("record-{i:05}");
        deliveries.push((value.clone(), producer.send(TOPIC, Record::new(value).with_partition(0))));
        // About 3 s of sending: before, during and after the blackout.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    blackout.await.expect("blackout task");
    let mut delivered = Vec::new();
    let mut timed_out = 0;
    for (value, delivery) in deliveries {
        match tokio::time::timeout(Duration::from_secs(60), delivery).await.expect("resolves in time") {
            Ok(m) => delivered.push((m.offset, value)),
            Err(ferrolog_client::Error::DeliveryTimeout { .. }) => timed_out += 1,
            Err(e) => panic!("{value}: unexpected {e}"),
        }
    }
    producer.close().await;
    let s = state.lock().expect("lock");
    println!("{} delivered, {timed_out} timed out; faults: {:?}", delivered.len(), s.faults);
    assert!(timed_out > 0, "the blackout outlasted the delivery timeout");
    assert!(
        s.faults.get("stored in the blackout").copied().unwrap_or(0) > 0,
        "answers were lost in the blackout"
    );
    // Liveness: once the blackout is over, the producer catches up; every
    // record of the last 40 % (sent seconds after it) is delivered.
    let delivered_values: std::collections::HashSet<&str> =
        delivered.iter().map(|(_, v)| v.as_str()).collect();
    let missing: Vec<String> = (1800..3000)
        .map(|i| format!("record-{i:05}"))
        .filter(|v| !delivered_values.contains(v.as_str()))
        .collect();
    assert!(missing.is_empty(), "not delivered after the blackout: {missing:?}");
    assert!(!delivered.is_empty());
    let log = stored(&s, 0);
    let mut seen = std::collections::HashSet::new();
    for v in &log {
        assert!(seen.insert(v.clone()), "{v} stored twice");
    }
    let mut sorted = log.clone();
    sorted.sort();
    assert_eq!(log, sorted, "stored in send order");
    for (offset, value) in &delivered {
        assert_eq!(&log[*offset as usize], value, "offset reported for {value}");
    }
    server.abort();
}

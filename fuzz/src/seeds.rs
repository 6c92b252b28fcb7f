//! Seed inputs for every target, made by Ferrolog's own encoders (segment
//! frames, index files, peer messages, manifests, Kafka batches and
//! requests), so a fuzzer starts from what the code really reads. Written
//! to `fuzz/corpus/<target>/` by `cargo run --example seeds` (see
//! `fuzz/README.md`); each input's layout is the one its target's doc
//! comment describes.

use std::collections::BTreeMap;
use std::path::Path;

use bytes::{Bytes, BytesMut};
use ferrolog_broker::metadata::command::{ControllerRequest, MetadataCommand};
use ferrolog_broker::partition::kafka_batch::{self, BatchFields};
use ferrolog_proto::client::{Header, ProduceRequest, Record};
use ferrolog_proto::raft as pb;
use ferrolog_raft_store::compaction::CompactionTarget;
use ferrolog_raft_store::format::{self, SegmentHeader};
use ferrolog_raft_store::segment::{Segment, segment_file_name};
use ferrolog_raft_store::snapshot::{MANIFEST_FILE, SnapshotManifest};
use ferrolog_raft_store::types::{
    AppendEntriesRequest, AppendEntriesResponse, Entry, EntryPayload, Membership, Node, SnapshotMeta,
    StoredMembership, TransferLeaderError, TransferLeaderRequest, Vote, VoteRequest, VoteResponse, log_id,
};
use ferrolog_raft_store::vfs::{FaultyFs, Fs, OpenMode};
use ferrolog_raft_store::{Control, RecordBatch, wire};
use kafka_protocol::messages::{ApiKey, RequestHeader, RequestKind};
use kafka_protocol::protocol::{Encodable, StrBytes};
use prost::Message;

use crate::kafka::codec;

/// Base index of the sample segment.
pub const SEGMENT_BASE_INDEX: u64 = 1;
/// Base offset of the sample segment.
pub const SEGMENT_BASE_OFFSET: u64 = 0;

/// One seed: the target it is for, its file name, its bytes.
pub type Seed = (&'static str, String, Vec<u8>);

/// A three-voter membership with addresses.
pub fn membership() -> Membership {
    let nodes: BTreeMap<u64, Node> =
        (1..=3).map(|id| (id, Node { addr: format!("10.0.0.{id}:9501") })).collect();
    Membership::new(vec![[1, 2, 3].into()], nodes).expect("membership")
}

fn records_entry(index: u64, n: u32, records: &'static [u8]) -> Entry {
    Entry {
        log_id: log_id(2, 1, index),
        payload: EntryPayload::Normal(RecordBatch {
            record_count: n,
            first_timestamp_ms: 1_700_000_000_000,
            max_timestamp_ms: 1_700_000_000_500,
            producer_id: 7,
            producer_epoch: 0,
            base_sequence: 10,
            records: Bytes::from_static(records),
        }),
    }
}

/// Sample entries of every frame kind, from Raft index `base_index` on.
pub fn entries(base_index: u64) -> Vec<Entry> {
    let i = base_index;
    let control = |index, c| Entry {
        log_id: log_id(2, 1, index),
        payload: EntryPayload::Normal(RecordBatch::control_batch(c)),
    };
    vec![
        Entry { log_id: log_id(2, 1, i), payload: EntryPayload::Blank },
        records_entry(i + 1, 3, b"three records"),
        Entry { log_id: log_id(2, 1, i + 2), payload: EntryPayload::Membership(membership()) },
        control(i + 3, Control::LogStart(2)),
        control(i + 4, Control::Compact(CompactionTarget { through: 3, tombstones_below: 1 })),
        control(i + 5, Control::ExpireProducers { now_ms: 1_700_000_000_000, expiration_ms: 86_400_000 }),
        records_entry(i + 6, 1, b"one"),
    ]
}

/// The frames of [`entries`] back to back, offsets from `base_offset`.
pub fn frames(base_index: u64, base_offset: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let mut offset = base_offset;
    for e in entries(base_index) {
        let h = format::encode_entry(&e, offset, &mut out).expect("encode_entry");
        offset = h.next_offset();
    }
    out
}

/// A whole segment file: header, then [`frames`].
pub fn segment_file(base_index: u64, base_offset: u64) -> Vec<u8> {
    let mut f = SegmentHeader { base_index, base_offset }.encode().to_vec();
    f.extend_from_slice(&frames(base_index, base_offset));
    f
}

/// The index file the store writes when it seals [`segment_file`]
/// (`Segment::seal`), with an index row every `interval` bytes.
pub fn index_file(interval: u64) -> Vec<u8> {
    let fs: Fs = FaultyFs::new(1).mount();
    let dir = Path::new("/p");
    fs.create_dir_all(dir).expect("mkdir");
    let path = dir.join(segment_file_name(SEGMENT_BASE_INDEX));
    let seg = segment_file(SEGMENT_BASE_INDEX, SEGMENT_BASE_OFFSET);
    fs.open(&path, OpenMode::CreateTruncate).expect("create").write_all_at(&seg, 0).expect("write");
    let (mut s, _) = Segment::open(&fs, &path, true, false, interval).expect("open");
    s.seal().expect("seal");
    let f = fs.open(&path.with_extension("idx"), OpenMode::Read).expect("idx");
    let mut b = vec![0u8; usize::try_from(f.len().expect("len")).expect("small")];
    f.read_at(&mut b, 0).expect("read");
    b
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

fn segment_frame() -> Vec<Seed> {
    let mut out = Vec::new();
    let all = frames(SEGMENT_BASE_INDEX, SEGMENT_BASE_OFFSET);
    out.push(("segment_frame", "all-kinds".into(), cat(&[&[0], &all])));
    out.push(("segment_frame", "all-kinds-fixcrc".into(), cat(&[&[1], &all])));
    for (i, e) in entries(SEGMENT_BASE_INDEX).iter().enumerate() {
        let mut f = Vec::new();
        format::encode_entry(e, 5, &mut f).expect("encode");
        out.push(("segment_frame", format!("frame-{i}"), cat(&[&[1], &f])));
    }
    // A membership frame as the first brokers wrote it: kind 3, the Raft library's JSON.
    let mut old = Vec::new();
    format::encode_entry(&entries(1)[2], 0, &mut old).expect("encode");
    old.truncate(format::FRAME_HEADER_BYTES);
    old[8] = 3;
    old.extend_from_slice(&serde_json::to_vec(&membership()).expect("json"));
    let len = u32::try_from(old.len() - 4).expect("small");
    old[0..4].copy_from_slice(&len.to_le_bytes());
    out.push(("segment_frame", "membership-json".into(), cat(&[&[1], &old])));
    let head = SegmentHeader { base_index: 9, base_offset: 77 }.encode();
    out.push(("segment_frame", "segment-header".into(), cat(&[&[0], &head])));
    out
}

fn segment_file_seed(flags: u8, interval: u16, body: &[u8]) -> Vec<u8> {
    let mut b = vec![flags];
    b.extend_from_slice(&SEGMENT_BASE_INDEX.to_le_bytes());
    b.extend_from_slice(&SEGMENT_BASE_OFFSET.to_le_bytes());
    b.extend_from_slice(&interval.to_le_bytes());
    for q in [3u64, 2, 1_700_000_000_100] {
        b.extend_from_slice(&q.to_le_bytes());
    }
    b.extend_from_slice(body);
    b
}

fn segment_file_seeds() -> Vec<Seed> {
    let all = frames(SEGMENT_BASE_INDEX, SEGMENT_BASE_OFFSET);
    let torn = &all[..all.len() - 5];
    let mut damaged = all.clone();
    damaged[100] ^= 1;
    vec![
        ("segment_file", "intact".into(), segment_file_seed(1, 4095, &all)),
        ("segment_file", "intact-small-interval".into(), segment_file_seed(0, 63, &all)),
        ("segment_file", "torn-tail".into(), segment_file_seed(1, 255, torn)),
        ("segment_file", "damaged-before-valid".into(), segment_file_seed(0, 255, &damaged)),
        ("segment_file", "empty".into(), segment_file_seed(0, 255, &[])),
    ]
}

fn index_file_seeds() -> Vec<Seed> {
    let q: Vec<u8> = [4u64, 3, 1_700_000_000_100].iter().flat_map(|q| q.to_le_bytes()).collect();
    let mut out = Vec::new();
    for (name, interval) in [("one-row", 1 << 20), ("row-per-frame", 1)] {
        let idx = index_file(interval);
        out.push(("index_file", format!("{name}"), cat(&[&[4], &q, &idx])));
        out.push(("index_file", format!("{name}-fixed"), cat(&[&[7], &q, &idx])));
    }
    out
}

fn vote() -> Vote {
    Vote::new_committed(2, 1)
}

fn peer_message() -> Vec<Seed> {
    let mut out = Vec::new();
    let mut push = |sel: u8, name: &str, body: Vec<u8>| {
        out.push(("peer_message", name.to_owned(), cat(&[&[sel], &body])))
    };
    let append = AppendEntriesRequest {
        vote: vote(),
        prev_log_id: Some(log_id(1, 1, 0)),
        leader_commit: Some(log_id(1, 1, 0)),
        entries: entries(1),
    };
    let wire_append = wire::append_request_to_wire(9, 2, &append).expect("wire");
    push(0x80, "append-entries", wire_append.encode_to_vec());
    let heartbeat = AppendEntriesRequest { entries: Vec::new(), ..append };
    let wire_heartbeat = wire::append_request_to_wire(9, 2, &heartbeat).expect("wire");
    push(0, "heartbeat", wire_heartbeat.encode_to_vec());
    for (i, r) in [
        AppendEntriesResponse::Success,
        AppendEntriesResponse::Conflict,
        AppendEntriesResponse::PartialSuccess(Some(log_id(2, 1, 4))),
        AppendEntriesResponse::HigherVote(Vote::new(3, 2)),
    ]
    .iter()
    .enumerate()
    {
        push(1, &format!("append-response-{i}"), wire::append_response_to_wire(r).encode_to_vec());
    }
    let vote_request =
        wire::vote_request_to_wire(9, 2, &VoteRequest::new(Vote::new(3, 2), Some(log_id(2, 1, 7))));
    push(2, "vote-request", vote_request.encode_to_vec());
    let vote_response = VoteResponse::new(vote(), Some(log_id(2, 1, 7)), true);
    push(3, "vote-response", wire::vote_response_to_wire(&vote_response).encode_to_vec());
    let transfer = TransferLeaderRequest::new(vote(), 3, Some(log_id(2, 1, 7)));
    push(4, "transfer-request", wire::transfer_request_to_wire(9, 3, &transfer).encode_to_vec());
    let refused: Result<(), TransferLeaderError> =
        Err(TransferLeaderError::VoteChanged { expected: vote(), actual: Vote::new(3, 3) });
    push(5, "transfer-refused", wire::transfer_response_to_wire(&refused).encode_to_vec());
    let (meta, first) = first_snapshot_chunk();
    push(6, "snapshot-first-chunk", first.encode_to_vec());
    push(7, "membership", wire::membership_to_wire(&membership()).encode_to_vec());
    push(8, "stored-membership", wire::stored_membership_to_wire(&meta.last_membership).encode_to_vec());
    let batch = pb::BatchRequest {
        calls: vec![
            pb::BatchCall {
                call: Some(pb::batch_call::Call::AppendEntries(wire_heartbeat)),
                timeout_ms: 500,
            },
            pb::BatchCall { call: Some(pb::batch_call::Call::PreVote(vote_request)), timeout_ms: 500 },
        ],
    };
    push(9, "batch", batch.encode_to_vec());
    let create = ControllerRequest::CreateTopic {
        name: "events".into(),
        partitions: 3,
        replication_factor: 3,
        config: [("cleanup.policy".to_owned(), "compact".to_owned())].into(),
    };
    let call = pb::ControllerCall { request_json: serde_json::to_vec(&create).expect("json").into() };
    push(10, "controller-create-topic", call.encode_to_vec());
    let registered = MetadataCommand::BrokerRegistered {
        id: 2,
        client_addr: "10.0.0.2:9401".into(),
        peer_addr: "10.0.0.2:9501".into(),
        incarnation: 5,
        kafka_addr: "10.0.0.2:9092".into(),
    };
    push(11, "metadata-broker-registered", serde_json::to_vec(&registered).expect("json"));
    out
}

fn manifest(version: u32, prefix: bool) -> SnapshotManifest {
    let seg = segment_file_name(1);
    SnapshotManifest {
        version,
        meta: SnapshotMeta {
            last_log_id: Some(log_id(2, 1, 7)),
            last_membership: StoredMembership::new(Some(log_id(2, 1, 3)), membership()),
        },
        next_offset: 4,
        segments: vec![seg.clone(), segment_file_name(8)],
        compaction: None,
        producers: Default::default(),
        log_start_offset: 2,
        compaction_target: Some(CompactionTarget { through: 3, tombstones_below: 1 }),
        prefix_bytes: if prefix { [(seg, 200)].into() } else { BTreeMap::new() },
    }
}

fn snapshot_manifest() -> Vec<Seed> {
    let lengths = [20u8, 1, 0, 0, 0, 0, 0, 0];
    let v2 = serde_json::to_vec_pretty(&manifest(2, false)).expect("json");
    let v3 = serde_json::to_vec(&manifest(3, true)).expect("json");
    // Version 1 held the Raft library's own JSON of the metadata.
    let mut v1: serde_json::Value = serde_json::to_value(manifest(1, false)).expect("json");
    v1["meta"] = serde_json::to_value(manifest(1, false).meta).expect("json");
    let v1 = serde_json::to_vec(&v1).expect("json");
    vec![
        ("snapshot_manifest", "v2".into(), cat(&[&[0], &lengths, &v2])),
        ("snapshot_manifest", "v3-prefix".into(), cat(&[&[1], &lengths, &v3])),
        ("snapshot_manifest", "v1-raft-json".into(), cat(&[&[1], &lengths, &v1])),
    ]
}

fn chunk_seed(chunks: &[pb::SnapshotChunk]) -> Vec<u8> {
    let mut b = vec![0u8];
    for c in chunks {
        let m = c.encode_to_vec();
        b.extend_from_slice(&u16::try_from(m.len()).expect("small").to_le_bytes());
        b.extend_from_slice(&m);
    }
    b
}

/// A snapshot's metadata and the first chunk of its stream, which carries it.
fn first_snapshot_chunk() -> (SnapshotMeta, pb::SnapshotChunk) {
    let meta = SnapshotMeta {
        last_log_id: Some(log_id(2, 1, 7)),
        last_membership: StoredMembership::new(Some(log_id(2, 1, 3)), membership()),
    };
    let first = pb::SnapshotChunk {
        group_id: 9,
        target_node: 2,
        vote: Some(wire::vote_to_wire(&vote())),
        meta: Some(wire::snapshot_meta_to_wire(&meta)),
        ..pb::SnapshotChunk::default()
    };
    (meta, first)
}

fn snapshot_stream() -> Vec<Seed> {
    let (_, first) = first_snapshot_chunk();
    let data = |name: &str, offset: u64, bytes: &[u8]| pb::SnapshotChunk {
        group_id: 9,
        file_name: name.into(),
        file_offset: offset,
        data: bytes.to_vec().into(),
        ..pb::SnapshotChunk::default()
    };
    let done = pb::SnapshotChunk { group_id: 9, done: true, ..pb::SnapshotChunk::default() };
    let mut m = manifest(2, false);
    m.segments.truncate(1);
    let json = serde_json::to_vec(&m).expect("json");
    let seg = segment_file(SEGMENT_BASE_INDEX, SEGMENT_BASE_OFFSET);
    let name = segment_file_name(1);
    let whole = chunk_seed(&[
        first.clone(),
        data(MANIFEST_FILE, 0, &json),
        data(&name, 0, &seg[..200]),
        data(&name, 200, &seg[200..]),
        done.clone(),
    ]);
    let unfinished = chunk_seed(&[first.clone(), data(&name, 0, &seg[..100])]);
    let escaping = chunk_seed(&[first, data("../x.seg", 0, b"x"), done]);
    vec![
        ("snapshot_stream", "whole".into(), whole),
        ("snapshot_stream", "unfinished".into(), unfinished),
        ("snapshot_stream", "escaping-name".into(), escaping),
    ]
}

/// Sample records: keys, a null key, a tombstone, headers with a null value.
pub fn records() -> Vec<Record> {
    let header = |k: &str, v: Option<&'static [u8]>| Header {
        key: k.into(),
        value: Bytes::from_static(v.unwrap_or_default()),
        null_value: v.is_none(),
    };
    vec![
        Record {
            key: Some(Bytes::from_static(b"k1")),
            value: Bytes::from_static(b"hello"),
            headers: vec![header("trace", Some(b"abc")), header("empty", None)],
            timestamp_ms: 1_700_000_000_000,
            offset_delta: None,
            null_value: false,
        },
        Record {
            key: None,
            value: Bytes::from_static(b"no key"),
            timestamp_ms: 1_700_000_000_007,
            ..Default::default()
        },
        Record {
            key: Some(Bytes::from_static(b"k1")),
            null_value: true,
            timestamp_ms: 1_699_999_999_000,
            ..Default::default()
        },
    ]
}

/// [`records`] as a Kafka batch compressed with `codec_id`, as a producer sends it.
pub fn kafka_batch_bytes(codec_id: u8) -> Bytes {
    let fields = BatchFields {
        base_offset: 0,
        offsets: 3,
        leader_epoch: -1,
        producer_id: 42,
        producer_epoch: 0,
        base_sequence: 0,
        codec: codec(codec_id),
    };
    let mut b = BytesMut::new();
    kafka_batch::encode_batch(&records(), &fields, &mut b).expect("encode_batch");
    b.freeze()
}

fn kafka_record_batch() -> Vec<Seed> {
    let ctl = 0b101u64 | (2 << 8);
    let mut out = Vec::new();
    for c in 0..5u8 {
        let b = kafka_batch_bytes(c);
        let name = codec(c).name();
        out.push((
            "kafka_record_batch",
            format!("batch-{name}"),
            cat(&[&[2], &(ctl | u64::from(c)).to_le_bytes(), &b]),
        ));
    }
    let b = kafka_batch_bytes(0);
    out.push(("kafka_record_batch", "batch-fixed".into(), cat(&[&[1], &ctl.to_le_bytes(), &b])));
    let packed = kafka_batch::payload_of(&records(), -1, 0, -1, codec(4), true).expect("payload_of");
    out.push((
        "kafka_record_batch",
        "codec-zstd".into(),
        cat(&[&[4], &(4u64 | 4096 << 8).to_le_bytes(), &packed]),
    ));
    out
}

/// A sample request of `api` at `version`: defaults, with a record batch
/// for Produce and a topic for the requests that name topics.
fn sample_request(api: ApiKey, version: i16) -> Option<RequestKind> {
    use kafka_protocol::messages::*;
    let topic = || TopicName(StrBytes::from_static_str("events"));
    Some(match api {
        ApiKey::Produce => RequestKind::Produce(
            ProduceRequest::default().with_acks(-1).with_timeout_ms(30_000).with_topic_data(vec![
                produce_request::TopicProduceData::default().with_name(topic()).with_partition_data(vec![
                    produce_request::PartitionProduceData::default()
                        .with_index(0)
                        .with_records(Some(kafka_batch_bytes(u8::try_from(version % 5).unwrap_or(0)))),
                ]),
            ]),
        ),
        ApiKey::Fetch => RequestKind::Fetch(FetchRequest::default().with_max_wait_ms(500).with_topics(vec![
            fetch_request::FetchTopic::default().with_topic(topic()).with_partitions(vec![
                fetch_request::FetchPartition::default().with_partition_max_bytes(1 << 20),
            ]),
        ])),
        ApiKey::ListOffsets => RequestKind::ListOffsets(ListOffsetsRequest::default().with_topics(vec![
            list_offsets_request::ListOffsetsTopic::default().with_name(topic()).with_partitions(vec![
                list_offsets_request::ListOffsetsPartition::default().with_timestamp(-1),
            ]),
        ])),
        ApiKey::Metadata => RequestKind::Metadata(MetadataRequest::default().with_topics(Some(vec![
            metadata_request::MetadataRequestTopic::default().with_name(Some(topic())),
        ]))),
        ApiKey::OffsetCommit => RequestKind::OffsetCommit(OffsetCommitRequest::default()),
        ApiKey::OffsetFetch => RequestKind::OffsetFetch(OffsetFetchRequest::default()),
        ApiKey::FindCoordinator => RequestKind::FindCoordinator(FindCoordinatorRequest::default()),
        ApiKey::JoinGroup => RequestKind::JoinGroup(JoinGroupRequest::default()),
        ApiKey::Heartbeat => RequestKind::Heartbeat(HeartbeatRequest::default()),
        ApiKey::LeaveGroup => RequestKind::LeaveGroup(LeaveGroupRequest::default()),
        ApiKey::SyncGroup => RequestKind::SyncGroup(SyncGroupRequest::default()),
        ApiKey::DescribeGroups => RequestKind::DescribeGroups(DescribeGroupsRequest::default()),
        ApiKey::ListGroups => RequestKind::ListGroups(ListGroupsRequest::default()),
        ApiKey::ApiVersions => RequestKind::ApiVersions(ApiVersionsRequest::default()),
        ApiKey::CreateTopics => RequestKind::CreateTopics(CreateTopicsRequest::default().with_topics(vec![
                create_topics_request::CreatableTopic::default()
                    .with_name(topic())
                    .with_num_partitions(3)
                    .with_replication_factor(3),
            ])),
        ApiKey::DeleteTopics => RequestKind::DeleteTopics(DeleteTopicsRequest::default()),
        ApiKey::InitProducerId => RequestKind::InitProducerId(InitProducerIdRequest::default()),
        ApiKey::DescribeConfigs => RequestKind::DescribeConfigs(DescribeConfigsRequest::default()),
        ApiKey::CreatePartitions => RequestKind::CreatePartitions(CreatePartitionsRequest::default()),
        ApiKey::DeleteGroups => RequestKind::DeleteGroups(DeleteGroupsRequest::default()),
        ApiKey::OffsetDelete => RequestKind::OffsetDelete(OffsetDeleteRequest::default()),
        _ => return None,
    })
}

fn kafka_request() -> Vec<Seed> {
    let mut out = Vec::new();
    for (api, lo, hi) in ferrolog_broker::kafka::versions::SUPPORTED {
        let versions = if lo == hi { vec![*lo] } else { vec![*lo, *hi] };
        for v in versions {
            let Some(body) = sample_request(*api, v) else { continue };
            let header = RequestHeader::default()
                .with_request_api_key(*api as i16)
                .with_request_api_version(v)
                .with_correlation_id(1)
                .with_client_id(Some(StrBytes::from_static_str("fuzz")));
            let mut b = BytesMut::new();
            header.encode(&mut b, api.request_header_version(v)).expect("header");
            body.encode(&mut b, v).expect("body");
            out.push(("kafka_request", format!("{api:?}-v{v}"), b.to_vec()));
        }
    }
    out
}

fn grpc_produce() -> Vec<Seed> {
    let req = ProduceRequest {
        topic: "events".into(),
        partition: 1,
        records: records(),
        producer_id: 42,
        producer_epoch: 0,
        base_sequence: 0,
        topic_id: ferrolog_proto::TopicId::v4_from_random(0x1234).to_wire(),
    };
    let plain = ProduceRequest { producer_id: -1, base_sequence: 0, topic_id: Bytes::new(), ..req.clone() };
    let ctl = 0b110u64.to_le_bytes();
    vec![
        ("grpc_produce", "idempotent-uncompressed-topic".into(), cat(&[&[5], &ctl, &req.encode_to_vec()])),
        ("grpc_produce", "plain-zstd-topic".into(), cat(&[&[4], &ctl, &plain.encode_to_vec()])),
        ("grpc_produce", "gzip-logappendtime".into(), cat(&[&[1 | 8], &ctl, &req.encode_to_vec()])),
    ]
}

/// Every seed of every target.
pub fn all() -> Vec<Seed> {
    let mut out = Vec::new();
    out.extend(segment_frame());
    out.extend(segment_file_seeds());
    out.extend(index_file_seeds());
    out.extend(peer_message());
    out.extend(snapshot_manifest());
    out.extend(snapshot_stream());
    out.extend(kafka_request());
    out.extend(kafka_record_batch());
    out.extend(grpc_produce());
    out
}

//! The Kafka listener at the protocol level (issue 14), on a 1-broker
//! cluster: every advertised API answers at its lowest and its highest
//! advertised version; ApiVersions at an unknown version is answered
//! `UNSUPPORTED_VERSION` at version 0 (KIP-511); an unknown API key, a
//! version not advertised, an empty, oversized or negative-size frame, a
//! frame that claims 54 million topics, and a client that disconnects
//! mid-request each close only their own connection, and the broker goes on
//! answering. A topic's `compression.type` recompresses batches from both
//! APIs. The idle timeout closes a connection that owes nothing, never one
//! waiting for a long answer (a JoinGroup through a rebalance delay).
//! CreateTopics and CreatePartitions answer once the new partitions have
//! leaders: a Metadata request right after names them.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use ferrolog_tests::Cluster;
use kafka_protocol::messages::api_versions_response::ApiVersionsResponse;
use kafka_protocol::messages::*;
use kafka_protocol::protocol::{Decodable, Encodable, StrBytes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");

/// A request frame: size, header, body.
fn frame(api: ApiKey, version: i16, correlation_id: i32, body: &RequestKind) -> Bytes {
    let mut b = BytesMut::new();
    b.put_i32(0);
    RequestHeader::default()
        .with_request_api_key(api as i16)
        .with_request_api_version(version)
        .with_correlation_id(correlation_id)
        .with_client_id(Some(StrBytes::from_static_str("t27")))
        .encode(&mut b, api.request_header_version(version))
        .expect("header");
    body.encode(&mut b, version).expect("body");
    let n = (b.len() - 4) as i32;
    b[..4].copy_from_slice(&n.to_be_bytes());
    b.freeze()
}

/// Sends `bytes`, then reads one response frame; `None` when the broker
/// closes the connection instead.
async fn exchange(addr: SocketAddr, bytes: &[u8]) -> anyhow::Result<Option<Bytes>> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(bytes).await?;
    read_frame(&mut s).await
}

async fn read_frame(s: &mut TcpStream) -> anyhow::Result<Option<Bytes>> {
    let n = match tokio::time::timeout(Duration::from_secs(60), s.read_i32()).await? {
        Ok(n) => n,
        Err(_) => return Ok(None),
    };
    let mut buf = vec![0u8; usize::try_from(n)?];
    s.read_exact(&mut buf).await?;
    Ok(Some(Bytes::from(buf)))
}

/// Whether the broker closed the connection (rather than answering).
async fn closed(addr: SocketAddr, bytes: &[u8]) -> anyhow::Result<bool> {
    Ok(exchange(addr, bytes).await?.is_none())
}

/// One uncompressed Kafka batch (magic 2, CreateTime) of one record.
fn one_record_batch(key: Option<Bytes>, value: Bytes) -> anyhow::Result<Bytes> {
    let record = kafka_protocol::records::Record {
        transactional: false,
        control: false,
        delete_horizon: false,
        partition_leader_epoch: -1,
        producer_id: -1,
        producer_epoch: -1,
        timestamp_type: kafka_protocol::records::TimestampType::Creation,
        offset: 0,
        sequence: -1,
        timestamp: 1_700_000_000_000,
        key,
        value: Some(value),
        headers: Default::default(),
    };
    let mut batch = BytesMut::new();
    kafka_protocol::records::RecordBatchEncoder::encode(
        &mut batch,
        [&record],
        &kafka_protocol::records::RecordEncodeOptions {
            version: 2,
            compression: kafka_protocol::records::Compression::None,
        },
    )?;
    Ok(batch.freeze())
}

/// A Produce request (acks=all) of `batch` to partition 0 of `topic`.
fn produce_to(topic: &str, batch: Bytes) -> RequestKind {
    RequestKind::Produce(ProduceRequest::default().with_acks(-1).with_timeout_ms(10_000).with_topic_data(
        vec![
            produce_request::TopicProduceData::default()
                .with_name(TopicName(StrBytes::from_string(topic.to_owned())))
                .with_partition_data(vec![
                    produce_request::PartitionProduceData::default().with_records(Some(batch)),
                ]),
        ],
    ))
}

fn api_versions(addr_resp: Bytes) -> anyhow::Result<(i32, ApiVersionsResponse)> {
    let mut b = addr_resp;
    let correlation = b.get_i32();
    Ok((correlation, ApiVersionsResponse::decode(&mut b, 0)?))
}

/// A minimal request of `api`: defaults, which every version encodes.
fn minimal(api: ApiKey) -> RequestKind {
    let t = || TopicName(StrBytes::from_static_str("p"));
    match api {
        ApiKey::Produce => {
            RequestKind::Produce(ProduceRequest::default().with_acks(-1).with_timeout_ms(1000))
        }
        ApiKey::Fetch => {
            RequestKind::Fetch(FetchRequest::default().with_replica_id(BrokerId(-1)).with_max_bytes(1 << 20))
        }
        ApiKey::ListOffsets => {
            RequestKind::ListOffsets(ListOffsetsRequest::default().with_replica_id(BrokerId(-1)))
        }
        ApiKey::Metadata => {
            RequestKind::Metadata(MetadataRequest::default().with_topics(Some(vec![
                metadata_request::MetadataRequestTopic::default().with_name(Some(t())),
            ])))
        }
        ApiKey::OffsetCommit => RequestKind::OffsetCommit(OffsetCommitRequest::default()),
        ApiKey::OffsetFetch => {
            RequestKind::OffsetFetch(OffsetFetchRequest::default().with_topics(Some(vec![])))
        }
        ApiKey::FindCoordinator => RequestKind::FindCoordinator(FindCoordinatorRequest::default()),
        ApiKey::JoinGroup => {
            RequestKind::JoinGroup(JoinGroupRequest::default().with_session_timeout_ms(10_000))
        }
        ApiKey::Heartbeat => RequestKind::Heartbeat(HeartbeatRequest::default()),
        ApiKey::LeaveGroup => RequestKind::LeaveGroup(LeaveGroupRequest::default()),
        ApiKey::SyncGroup => RequestKind::SyncGroup(SyncGroupRequest::default()),
        ApiKey::DescribeGroups => RequestKind::DescribeGroups(DescribeGroupsRequest::default()),
        ApiKey::ListGroups => RequestKind::ListGroups(ListGroupsRequest::default()),
        ApiKey::ApiVersions => RequestKind::ApiVersions(ApiVersionsRequest::default()),
        ApiKey::CreateTopics => RequestKind::CreateTopics(CreateTopicsRequest::default()),
        ApiKey::DeleteTopics => RequestKind::DeleteTopics(DeleteTopicsRequest::default()),
        ApiKey::InitProducerId => RequestKind::InitProducerId(InitProducerIdRequest::default()),
        ApiKey::DescribeConfigs => RequestKind::DescribeConfigs(DescribeConfigsRequest::default()),
        ApiKey::CreatePartitions => RequestKind::CreatePartitions(CreatePartitionsRequest::default()),
        ApiKey::DeleteGroups => RequestKind::DeleteGroups(DeleteGroupsRequest::default()),
        ApiKey::OffsetDelete => RequestKind::OffsetDelete(OffsetDeleteRequest::default()),
        other => panic!("no minimal request for {other:?}"),
    }
}

/// A request of `api` at version `v` naming one topic that does not exist
/// (or one group, on a cluster too small for `__consumer_offsets`), so the
/// handler answers each element with an error: the error paths of every
/// response encode at every served version.
fn failing(api: ApiKey, v: i16) -> RequestKind {
    let t = || TopicName(StrBytes::from_static_str("nope"));
    let g = || GroupId(StrBytes::from_static_str("g"));
    let name = || StrBytes::from_static_str("nope");
    match api {
        ApiKey::Produce => {
            RequestKind::Produce(ProduceRequest::default().with_acks(-1).with_topic_data(vec![
                produce_request::TopicProduceData::default().with_name(t()).with_partition_data(vec![
                    produce_request::PartitionProduceData::default()
                        .with_records(Some(Bytes::from_static(b"junk"))),
                ]),
            ]))
        }
        ApiKey::Fetch => RequestKind::Fetch(
            FetchRequest::default().with_replica_id(BrokerId(-1)).with_max_bytes(1 << 20).with_topics(vec![
                fetch_request::FetchTopic::default().with_topic(t()).with_partitions(vec![
                    fetch_request::FetchPartition::default().with_partition_max_bytes(1 << 20),
                ]),
            ]),
        ),
        ApiKey::ListOffsets => {
            RequestKind::ListOffsets(ListOffsetsRequest::default().with_replica_id(BrokerId(-1)).with_topics(
                vec![list_offsets_request::ListOffsetsTopic::default().with_name(t()).with_partitions(vec![
                    list_offsets_request::ListOffsetsPartition::default().with_timestamp(-1),
                ])],
            ))
        }
        ApiKey::OffsetCommit => {
            RequestKind::OffsetCommit(OffsetCommitRequest::default().with_group_id(g()).with_topics(vec![
            offset_commit_request::OffsetCommitRequestTopic::default()
                .with_name(t())
                .with_partitions(vec![offset_commit_request::OffsetCommitRequestPartition::default()]),
        ]))
        }
        ApiKey::OffsetFetch => RequestKind::OffsetFetch(
            OffsetFetchRequest::default().with_group_id(g()).with_topics(Some(vec![
                offset_fetch_request::OffsetFetchRequestTopic::default()
                    .with_name(t())
                    .with_partition_indexes(vec![0]),
            ])),
        ),
        ApiKey::FindCoordinator => RequestKind::FindCoordinator(if v >= 4 {
            FindCoordinatorRequest::default().with_coordinator_keys(vec![StrBytes::from_static_str("g")])
        } else {
            FindCoordinatorRequest::default().with_key(StrBytes::from_static_str("g"))
        }),
        ApiKey::JoinGroup => RequestKind::JoinGroup(
            JoinGroupRequest::default()
                .with_group_id(g())
                .with_session_timeout_ms(10_000)
                .with_protocol_type(StrBytes::from_static_str("consumer"))
                .with_protocols(vec![
                    join_group_request::JoinGroupRequestProtocol::default()
                        .with_name(StrBytes::from_static_str("range")),
                ]),
        ),
        ApiKey::Heartbeat => RequestKind::Heartbeat(HeartbeatRequest::default().with_group_id(g())),
        ApiKey::LeaveGroup => RequestKind::LeaveGroup(if v >= 3 {
            LeaveGroupRequest::default()
                .with_group_id(g())
                .with_members(vec![leave_group_request::MemberIdentity::default().with_member_id(name())])
        } else {
            LeaveGroupRequest::default().with_group_id(g()).with_member_id(name())
        }),
        ApiKey::SyncGroup => RequestKind::SyncGroup(SyncGroupRequest::default().with_group_id(g())),
        ApiKey::DescribeGroups => {
            RequestKind::DescribeGroups(DescribeGroupsRequest::default().with_groups(vec![g()]))
        }
        ApiKey::DeleteGroups => {
            RequestKind::DeleteGroups(DeleteGroupsRequest::default().with_groups_names(vec![g()]))
        }
        ApiKey::CreateTopics => RequestKind::CreateTopics(CreateTopicsRequest::default().with_topics(vec![
            create_topics_request::CreatableTopic::default()
                .with_name(TopicName(StrBytes::from_static_str("bad/name")))
                .with_num_partitions(1)
                .with_replication_factor(1),
        ])),
        ApiKey::DeleteTopics => RequestKind::DeleteTopics(if v >= 6 {
            DeleteTopicsRequest::default()
                .with_topics(vec![delete_topics_request::DeleteTopicState::default().with_name(Some(t()))])
        } else {
            DeleteTopicsRequest::default().with_topic_names(vec![t()])
        }),
        ApiKey::DescribeConfigs => {
            RequestKind::DescribeConfigs(DescribeConfigsRequest::default().with_resources(vec![
                describe_configs_request::DescribeConfigsResource::default()
                    .with_resource_type(2)
                    .with_resource_name(name()),
            ]))
        }
        ApiKey::CreatePartitions => {
            RequestKind::CreatePartitions(CreatePartitionsRequest::default().with_topics(vec![
                create_partitions_request::CreatePartitionsTopic::default().with_name(t()).with_count(5),
            ]))
        }
        ApiKey::OffsetDelete => {
            RequestKind::OffsetDelete(OffsetDeleteRequest::default().with_group_id(g()).with_topics(vec![
                offset_delete_request::OffsetDeleteRequestTopic::default()
                    .with_name(t())
                    .with_partitions(vec![offset_delete_request::OffsetDeleteRequestPartition::default()]),
            ]))
        }
        other => minimal(other),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_advertised_api_answers_and_bad_frames_close_only_their_connection() -> anyhow::Result<()> {
    let c = Cluster::start("kafka-protocol", BIN, 1, &[]).await?;
    let addr = c.broker(1).kafka_addr;
    let ok = frame(ApiKey::ApiVersions, 3, 7, &RequestKind::ApiVersions(ApiVersionsRequest::default()));

    // ApiVersions lists what is served.
    let resp = exchange(addr, &ok).await?.expect("an answer");
    let mut b = resp.clone();
    assert_eq!(b.get_i32(), 7, "correlation id");
    // ApiVersions answers with response header v0 whatever its version.
    let mut b = resp.slice(4..);
    let listed = ApiVersionsResponse::decode(&mut b, 3)?;
    assert_eq!(listed.error_code, 0);
    let served: Vec<(ApiKey, i16, i16)> = listed
        .api_keys
        .iter()
        .map(|k| (ApiKey::try_from(k.api_key).expect("known key"), k.min_version, k.max_version))
        .collect();
    assert!(served.len() >= 20, "{served:?}");

    // Every served API, at its lowest and highest version, answers with a
    // response of that version and the request's correlation id.
    let mut answered = 0;
    for (api, lo, hi) in &served {
        for v in [*lo, *hi] {
            let id = 1000 + answered;
            let resp = exchange(addr, &frame(*api, v, id, &minimal(*api))).await?;
            let resp = resp.unwrap_or_else(|| panic!("{api:?} v{v}: the connection was closed"));
            let mut b = resp.clone();
            assert_eq!(b.get_i32(), id, "{api:?} v{v}: correlation id");
            if api.response_header_version(v) >= 1 {
                assert_eq!(b.get_u8(), 0, "{api:?} v{v}: no tagged fields in the header");
            }
            ResponseKind::decode(*api, &mut b, v).unwrap_or_else(|e| panic!("{api:?} v{v}: {e}"));
            answered += 1;
        }
    }
    assert_eq!(answered as usize, served.len() * 2);

    // And with one element each that fails: every error path encodes.
    let mut errors_seen = 0;
    for (api, lo, hi) in &served {
        for v in [*lo, *hi] {
            let resp = exchange(addr, &frame(*api, v, 77, &failing(*api, v))).await?;
            let resp =
                resp.unwrap_or_else(|| panic!("{api:?} v{v}: the connection was closed on an error path"));
            let mut b = resp.clone();
            assert_eq!(b.get_i32(), 77);
            if api.response_header_version(v) >= 1 {
                b.get_u8();
            }
            let decoded =
                ResponseKind::decode(*api, &mut b, v).unwrap_or_else(|e| panic!("{api:?} v{v}: {e}"));
            if format!("{decoded:?}")
                .split("error_code: ")
                .skip(1)
                .any(|rest| !rest.starts_with("0,") && !rest.starts_with("0 "))
            {
                errors_seen += 1;
            }
        }
    }
    assert!(errors_seen >= 30, "{errors_seen} responses carried an error code");

    // ApiVersions at a version not served: UNSUPPORTED_VERSION, at v0 (KIP-511).
    let mut future = BytesMut::from(&ok[..]);
    future[6..8].copy_from_slice(&99i16.to_be_bytes());
    let (correlation, r) = api_versions(exchange(addr, &future).await?.expect("answered"))?;
    assert_eq!((correlation, r.error_code), (7, 35));
    assert!(!r.api_keys.is_empty(), "the versions served come with the error");

    // Frames that close their connection, each alone.
    let metadata = frame(ApiKey::Metadata, 12, 1, &minimal(ApiKey::Metadata));
    let mut unknown_key = BytesMut::from(&metadata[..]);
    unknown_key[4..6].copy_from_slice(&9999i16.to_be_bytes());
    let mut unserved_version = BytesMut::from(&metadata[..]);
    unserved_version[6..8].copy_from_slice(&200i16.to_be_bytes());
    let mut transactions = BytesMut::from(&metadata[..]);
    transactions[4..6].copy_from_slice(&(ApiKey::EndTxn as i16).to_be_bytes());
    let huge_array: Vec<u8> = {
        // Metadata v0 claiming 54 million topics in a few bytes.
        let mut b = BytesMut::new();
        b.put_i32(0);
        b.put_i16(3);
        b.put_i16(0);
        b.put_i32(9);
        b.put_i16(-1);
        b.put_slice(&[0x03, 0x3c, 0x0c, 0x00, 0xb6]);
        let n = (b.len() - 4) as i32;
        b[..4].copy_from_slice(&n.to_be_bytes());
        b.to_vec()
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("unknown API key", unknown_key.to_vec()),
        ("a version not advertised", unserved_version.to_vec()),
        ("a transaction API", transactions.to_vec()),
        ("an empty frame", 0i32.to_be_bytes().to_vec()),
        ("a negative size", (-5i32).to_be_bytes().to_vec()),
        ("200 MiB announced", (200i32 << 20).to_be_bytes().to_vec()),
        ("a frame claiming 54 million topics", huge_array),
    ];
    for (what, bytes) in &cases {
        assert!(closed(addr, bytes).await?, "{what}: expected the connection closed");
        assert!(exchange(addr, &ok).await?.is_some(), "after {what}, the broker answers");
    }

    // A client that disconnects mid-request.
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(&metadata[..metadata.len() / 2]).await?;
    drop(s);
    assert!(exchange(addr, &ok).await?.is_some(), "after a half request, the broker answers");

    // Pipelined produces are proposed and answered in order, and a request
    // after them sees their effects (ListOffsets latest = all of them).
    let create = CreateTopicsRequest::default().with_timeout_ms(10_000).with_topics(vec![
        create_topics_request::CreatableTopic::default()
            .with_name(TopicName(StrBytes::from_static_str("pipe")))
            .with_num_partitions(1)
            .with_replication_factor(-1),
        create_topics_request::CreatableTopic::default()
            .with_name(TopicName(StrBytes::from_static_str("pipe2")))
            .with_num_partitions(2)
            .with_replication_factor(-1),
    ]);
    exchange(addr, &frame(ApiKey::CreateTopics, 7, 1, &RequestKind::CreateTopics(create)))
        .await?
        .expect("created");
    // CreateTopics answered once every partition of both topics had a
    // leader: the very next Metadata names them (without the wait they
    // would be LEADER_NOT_AVAILABLE while the partitions' Raft groups
    // elect). The same for CreatePartitions (the checks below use
    // partition 0 only).
    let metadata_of = |topics: Vec<metadata_request::MetadataRequestTopic>| {
        frame(
            ApiKey::Metadata,
            12,
            700,
            &RequestKind::Metadata(MetadataRequest::default().with_topics(Some(topics))),
        )
    };
    let leaders_of = |topic: &'static str| async move {
        let ask = metadata_of(vec![
            metadata_request::MetadataRequestTopic::default()
                .with_name(Some(TopicName(StrBytes::from_static_str(topic)))),
        ]);
        let mut r = exchange(addr, &ask).await?.expect("answered");
        r.get_i32();
        r.get_u8();
        let ResponseKind::Metadata(m) = ResponseKind::decode(ApiKey::Metadata, &mut r, 12)? else {
            panic!("metadata")
        };
        anyhow::Ok(
            m.topics[0].partitions.iter().map(|p| (p.error_code, p.leader_id.0 > 0)).collect::<Vec<_>>(),
        )
    };
    assert_eq!(leaders_of("pipe").await?, [(0, true)], "a leader as soon as CreateTopics answered");
    assert_eq!(leaders_of("pipe2").await?, [(0, true); 2], "leaders for the request's second topic too");
    let grow = CreatePartitionsRequest::default().with_timeout_ms(10_000).with_topics(vec![
        create_partitions_request::CreatePartitionsTopic::default()
            .with_name(TopicName(StrBytes::from_static_str("pipe")))
            .with_count(3)
            .with_assignments(None),
    ]);
    let mut r = exchange(addr, &frame(ApiKey::CreatePartitions, 3, 2, &RequestKind::CreatePartitions(grow)))
        .await?
        .expect("grown");
    r.get_i32();
    r.get_u8();
    let ResponseKind::CreatePartitions(g) = ResponseKind::decode(ApiKey::CreatePartitions, &mut r, 3)? else {
        panic!("create partitions")
    };
    assert_eq!(g.results[0].error_code, 0, "{:?}", g.results[0].error_message);
    assert_eq!(
        leaders_of("pipe").await?,
        [(0, true); 3],
        "leaders for the new partitions as soon as CreatePartitions answered"
    );
    let latest = ListOffsetsRequest::default().with_replica_id(BrokerId(-1)).with_topics(vec![
        list_offsets_request::ListOffsetsTopic::default()
            .with_name(TopicName(StrBytes::from_static_str("pipe")))
            .with_partitions(vec![list_offsets_request::ListOffsetsPartition::default().with_timestamp(-1)]),
    ]);
    let list = frame(ApiKey::ListOffsets, 6, 605, &RequestKind::ListOffsets(latest));
    // Until the new partition has a leader.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut r = exchange(addr, &list).await?.expect("answered");
        r.get_i32();
        r.get_u8();
        let ResponseKind::ListOffsets(l) = ResponseKind::decode(ApiKey::ListOffsets, &mut r, 6)? else {
            panic!("list")
        };
        if l.topics[0].partitions[0].error_code == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no leader for pipe-0");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut pipelined = BytesMut::new();
    for i in 0..5 {
        let batch = one_record_batch(None, Bytes::from(format!("v{i}")))?;
        pipelined.put_slice(&frame(ApiKey::Produce, 9, 600 + i, &produce_to("pipe", batch)));
    }
    pipelined.put_slice(&list);
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(&pipelined).await?;
    for i in 0..5 {
        let mut r = read_frame(&mut s).await?.expect("a produce answer");
        assert_eq!(r.get_i32(), 600 + i, "answers in request order");
        r.get_u8();
        let ResponseKind::Produce(p) = ResponseKind::decode(ApiKey::Produce, &mut r, 9)? else {
            panic!("produce")
        };
        let part = &p.responses[0].partition_responses[0];
        assert_eq!((part.error_code, part.base_offset), (0, i64::from(i)), "proposed in request order");
    }
    let mut r = read_frame(&mut s).await?.expect("the list answer");
    assert_eq!(r.get_i32(), 605);
    r.get_u8();
    let ResponseKind::ListOffsets(l) = ResponseKind::decode(ApiKey::ListOffsets, &mut r, 6)? else {
        panic!("list")
    };
    assert_eq!(l.topics[0].partitions[0].offset, 5, "the request after the produces sees all of them");

    // Metadata by topic id alone (v10+, KIP-516): the id a by-name answer
    // gave finds the topic; an unknown id is UNKNOWN_TOPIC_ID.
    let by_name = metadata_of(vec![
        metadata_request::MetadataRequestTopic::default()
            .with_name(Some(TopicName(StrBytes::from_static_str("pipe")))),
    ]);
    let mut r = exchange(addr, &by_name).await?.expect("answered");
    r.get_i32();
    r.get_u8();
    let ResponseKind::Metadata(m) = ResponseKind::decode(ApiKey::Metadata, &mut r, 12)? else {
        panic!("metadata")
    };
    let id = m.topics[0].topic_id;
    assert_ne!(id, uuid::Uuid::nil(), "a topic id is answered");
    let unknown = uuid::Uuid::from_u128(42);
    let by_id = metadata_of(vec![
        metadata_request::MetadataRequestTopic::default().with_name(None).with_topic_id(id),
        metadata_request::MetadataRequestTopic::default().with_name(None).with_topic_id(unknown),
    ]);
    let mut r = exchange(addr, &by_id).await?.expect("answered");
    r.get_i32();
    r.get_u8();
    let ResponseKind::Metadata(m) = ResponseKind::decode(ApiKey::Metadata, &mut r, 12)? else {
        panic!("metadata")
    };
    let named: Vec<(Option<String>, i16, usize)> = m
        .topics
        .iter()
        .map(|t| (t.name.as_ref().map(|n| n.to_string()), t.error_code, t.partitions.len()))
        .collect();
    assert!(named.contains(&(Some("pipe".into()), 0, 3)), "{named:?}");
    assert!(
        m.topics.iter().any(|t| t.topic_id == unknown && t.error_code == 100),
        "UNKNOWN_TOPIC_ID for an unknown id: {named:?}"
    );

    // Several requests on one connection are answered in order.
    let mut s = TcpStream::connect(addr).await?;
    let mut many = BytesMut::new();
    for id in 0..5 {
        many.put_slice(&frame(
            ApiKey::ApiVersions,
            3,
            500 + id,
            &RequestKind::ApiVersions(ApiVersionsRequest::default()),
        ));
    }
    s.write_all(&many).await?;
    for id in 0..5 {
        let r = read_frame(&mut s).await?.expect("answered");
        assert_eq!(r.clone().get_i32(), 500 + id);
    }
    Ok(())
}

/// The codec of every batch in a Kafka fetch answer's records (attribute
/// bits 0–2 of each batch), and how many batches there were.
fn batch_codecs(mut records: Bytes) -> Vec<i16> {
    let mut out = Vec::new();
    while records.len() >= 61 {
        let length = i32::from_be_bytes(records[8..12].try_into().expect("4 bytes")) as usize;
        out.push(i16::from_be_bytes(records[21..23].try_into().expect("2 bytes")) & 0x07);
        records.advance(12 + length);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_compression_type_recompresses_what_either_api_writes() -> anyhow::Result<()> {
    let c = Cluster::start("kafka-compression", BIN, 1, &[]).await?;
    let addr = c.broker(1).kafka_addr;
    // (compression.type, the codec's id in the batch attributes)
    for (codec, id) in [("gzip", 1i16), ("snappy", 2), ("lz4", 3), ("zstd", 4)] {
        let topic = format!("z-{codec}");
        let name = || TopicName(StrBytes::from_string(topic.clone()));
        let config = [("compression.type".to_owned(), codec.to_owned())].into_iter().collect();
        ferrolog_tests::raw::create_topic_with_config(&c, &topic, 1, 1, &config).await?;
        // Through gRPC, then an uncompressed Kafka batch.
        ferrolog_tests::raw::produce(
            &c,
            ferrolog_tests::raw::batch(&topic, -1, 0, "from-grpc"),
            Duration::from_secs(30),
        )
        .await?;
        let batch = one_record_batch(Some(Bytes::from_static(b"k")), Bytes::from_static(b"from-kafka"))?;
        assert_eq!(batch_codecs(batch.clone()), vec![0], "the producer's batch is uncompressed");
        let produce = produce_to(&topic, batch);
        let mut r = exchange(addr, &frame(ApiKey::Produce, 9, 1, &produce)).await?.expect("answer");
        r.get_i32();
        r.get_u8();
        let ResponseKind::Produce(p) = ResponseKind::decode(ApiKey::Produce, &mut r, 9)? else {
            panic!("produce")
        };
        let part = &p.responses[0].partition_responses[0];
        assert_eq!((part.error_code, part.base_offset), (0, 1), "{codec}: {part:?}");

        // A Kafka fetch serves both batches in the topic's codec.
        let fetch = FetchRequest::default()
            .with_replica_id(BrokerId(-1))
            .with_max_bytes(1 << 20)
            .with_min_bytes(1)
            .with_topics(vec![fetch_request::FetchTopic::default().with_topic(name()).with_partitions(
                vec![fetch_request::FetchPartition::default().with_partition_max_bytes(1 << 20)],
            )]);
        let mut r =
            exchange(addr, &frame(ApiKey::Fetch, 12, 2, &RequestKind::Fetch(fetch))).await?.expect("answer");
        r.get_i32();
        r.get_u8();
        let ResponseKind::Fetch(f) = ResponseKind::decode(ApiKey::Fetch, &mut r, 12)? else {
            panic!("fetch")
        };
        let part = &f.responses[0].partitions[0];
        assert_eq!((part.error_code, part.high_watermark), (0, 2), "{codec}: {part:?}");
        let codecs = batch_codecs(part.records.clone().expect("records"));
        assert_eq!(codecs, vec![id, id], "{codec}: both batches stored in the topic's codec");

        // And the gRPC API reads both back decompressed.
        let values = ferrolog_tests::raw::read_values(c.broker(1).client_addr, &topic).await?;
        assert_eq!(values, vec!["from-grpc", "from-kafka"], "{codec}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_connection_with_nothing_owed_goes_idle() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    std::fs::write(
        &config,
        "[kafka]\nconnections_max_idle_ms = 1000\n[groups]\noffsets_topic_num_partitions = 1\n\
         offsets_topic_replication_factor = 1\ninitial_rebalance_delay_ms = 3000\n",
    )?;
    let c = Cluster::start("kafka-idle", BIN, 1, &[("FERROLOG_CONFIG", &config.to_string_lossy())]).await?;
    let addr = c.broker(1).kafka_addr;
    let versions = frame(ApiKey::ApiVersions, 3, 9, &RequestKind::ApiVersions(ApiVersionsRequest::default()));

    // A connection that asks nothing for longer than the idle timeout is closed.
    let mut quiet = TcpStream::connect(addr).await?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(10), quiet.read(&mut byte)).await?;
    assert!(matches!(read, Ok(0) | Err(_)), "an idle connection is closed: {read:?}");

    // The group's coordinator is ready (the first group call creates
    // __consumer_offsets).
    let find = frame(
        ApiKey::FindCoordinator,
        4,
        1,
        &RequestKind::FindCoordinator(
            FindCoordinatorRequest::default()
                .with_coordinator_keys(vec![StrBytes::from_static_str("idle-g")]),
        ),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut r = exchange(addr, &find).await?.expect("answered");
        r.get_i32();
        r.get_u8();
        let ResponseKind::FindCoordinator(f) = ResponseKind::decode(ApiKey::FindCoordinator, &mut r, 4)?
        else {
            panic!("find")
        };
        if f.coordinators[0].error_code == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no coordinator: {f:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A JoinGroup waits out the 3 s rebalance delay, three idle timeouts:
    // its connection stays open, answers it, and answers the next request.
    let join = JoinGroupRequest::default()
        .with_group_id(GroupId(StrBytes::from_static_str("idle-g")))
        .with_session_timeout_ms(10_000)
        .with_rebalance_timeout_ms(10_000)
        .with_protocol_type(StrBytes::from_static_str("consumer"))
        .with_protocols(vec![
            join_group_request::JoinGroupRequestProtocol::default()
                .with_name(StrBytes::from_static_str("range"))
                .with_metadata(Bytes::from_static(&[0, 0, 0, 0, 0, 0, 255, 255, 255, 255])),
        ]);
    let mut s = TcpStream::connect(addr).await?;
    let started = std::time::Instant::now();
    s.write_all(&frame(ApiKey::JoinGroup, 9, 2, &RequestKind::JoinGroup(join))).await?;
    let mut r = read_frame(&mut s).await?.expect("the join is answered");
    let waited = started.elapsed();
    assert_eq!(r.get_i32(), 2);
    r.get_u8();
    let ResponseKind::JoinGroup(j) = ResponseKind::decode(ApiKey::JoinGroup, &mut r, 9)? else {
        panic!("join")
    };
    assert_eq!((j.error_code, j.generation_id), (0, 1), "{j:?}");
    assert!(
        waited >= Duration::from_millis(2500),
        "the join waited {waited:?}, not the rebalance delay: {j:?}"
    );
    s.write_all(&versions).await?;
    let r = read_frame(&mut s).await?.expect("the connection still answers after a long request");
    assert_eq!(r.clone().get_i32(), 9);
    Ok(())
}

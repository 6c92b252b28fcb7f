//! The Kafka listener at the protocol level (issue 14), on a 1-broker
//! cluster: every advertised API answers at its lowest and its highest
//! advertised version; ApiVersions at an unknown version is answered
//! `UNSUPPORTED_VERSION` at version 0 (KIP-511); an unknown API key, a
//! version not advertised, an empty, oversized or negative-size frame, a
//! frame that claims 54 million topics, and a client that disconnects
//! mid-request each close only their own connection, and the broker goes on
//! answering.

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
        other => panic!("no minimal request for {other:?}"),
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

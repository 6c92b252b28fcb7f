//! The client API against a real 3-broker cluster: topics, produce, fetch,
//! offsets, and each kind of bad input getting its own error code while the
//! cluster keeps serving.

use std::time::Duration;

use ferrolog_proto::client::{
    CreateTopicRequest, ErrorCode, FetchRequest, ListOffsetsRequest, OffsetSpec, ProduceRequest, Record,
};
use ferrolog_tests::{Cluster, connect};
use tokio::io::AsyncWriteExt;

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");

fn rec(v: &str) -> Record {
    Record {
        key: Some(b"k".to_vec().into()),
        value: v.as_bytes().to_vec().into(),
        headers: vec![],
        timestamp_ms: 0,
        ..Record::default()
    }
}

fn code(e: &Option<ferrolog_proto::client::Error>) -> ErrorCode {
    e.as_ref().map_or(ErrorCode::None, |e| e.code())
}

/// Produces to the leader of `topic`/`partition`, following NOT_LEADER hints.
async fn produce(c: &Cluster, topic: &str, partition: u32, values: &[&str]) -> anyhow::Result<u64> {
    let mut addr = c.broker(1).client_addr;
    for _ in 0..100 {
        let mut client = connect(addr).await?;
        let r = client
            .produce(ProduceRequest {
                topic: topic.into(),
                partition,
                records: values.iter().map(|v| rec(v)).collect(),
                producer_id: -1,
                ..ProduceRequest::default()
            })
            .await?
            .into_inner();
        match code(&r.error) {
            ErrorCode::None => return Ok(r.base_offset),
            ErrorCode::NotLeader | ErrorCode::Unavailable => {
                if let Some(h) = r.error.and_then(|e| e.leader) {
                    addr = h.address.parse()?;
                } else {
                    let next =
                        (addr.ip().to_string().rsplit('.').next().unwrap_or("2").parse::<u32>()? - 1) % 3 + 1;
                    addr = c.broker(next).client_addr;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => anyhow::bail!("produce failed: {other:?} {:?}", r.error),
        }
    }
    anyhow::bail!("no leader accepted the produce")
}

async fn leader_addr(c: &Cluster, topic: &str, partition: u32) -> anyhow::Result<std::net::SocketAddr> {
    for _ in 0..100 {
        for b in &c.brokers {
            let m = ferrolog_tests::metadata(b.client_addr).await?;
            if let Some(t) = m.topics.iter().find(|t| t.name == topic)
                && let Some(p) = t.partitions.get(partition as usize)
                && p.leader != 0
            {
                return Ok(c.broker(p.leader).client_addr);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("no leader for {topic}/{partition}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn produce_fetch_and_bad_input() -> anyhow::Result<()> {
    let c = Cluster::start("api", BIN, 3, &[]).await?;
    // Retries while the controller still waits for brokers to answer pings.
    ferrolog_tests::raw::create_topic(&c, "events", 2, 3).await?;
    let mut admin = connect(c.broker(2).client_addr).await?;
    // Broker 2 may not know the controller yet (its metadata replica has
    // not heard from the leader since the cluster formed): the admin checks
    // below go through it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while ferrolog_tests::metadata(c.broker(2).client_addr).await?.controller == 0 {
        anyhow::ensure!(std::time::Instant::now() < deadline, "broker 2 never learned the controller");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Bad topic names and duplicate creation.
    for bad in ["", "a b", "sl/ash", &"x".repeat(250)] {
        let r = admin
            .create_topic(CreateTopicRequest {
                name: bad.into(),
                partitions: 1,
                replication_factor: 1,
                ..Default::default()
            })
            .await?
            .into_inner();
        assert_eq!(code(&r.error), ErrorCode::InvalidRequest, "name {bad:?}: {:?}", r.error);
    }
    let r = admin
        .create_topic(CreateTopicRequest {
            name: "events".into(),
            partitions: 1,
            replication_factor: 1,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(code(&r.error), ErrorCode::TopicAlreadyExists);
    let r = admin
        .create_topic(CreateTopicRequest {
            name: "wide".into(),
            partitions: 1,
            replication_factor: 4,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(code(&r.error), ErrorCode::InvalidReplicationFactor);

    let first = produce(&c, "events", 0, &["a", "b", "c"]).await?;
    assert_eq!(first, 0);
    let second = produce(&c, "events", 0, &["d"]).await?;
    assert_eq!(second, 3);

    let leader = leader_addr(&c, "events", 0).await?;
    let mut client = connect(leader).await?;
    let f = client
        .fetch(FetchRequest {
            topic: "events".into(),
            partition: 0,
            offset: 1,
            max_bytes: 1 << 20,
            max_wait_ms: 0,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(code(&f.error), ErrorCode::None, "{:?}", f.error);
    assert_eq!(f.high_watermark, 4);
    let offsets: Vec<(u64, u32)> = f.batches.iter().map(|b| (b.base_offset, b.record_count)).collect();
    assert_eq!(offsets, vec![(0, 3), (3, 1)]);

    // Subscribe starts with the batch holding the requested offset.
    let mut stream = client
        .subscribe(ferrolog_proto::client::SubscribeRequest {
            topic: "events".into(),
            partition: 0,
            offset: 2,
            max_bytes: 1 << 20,
            ..Default::default()
        })
        .await?
        .into_inner();
    let first = stream.message().await?.expect("a batch");
    assert_eq!(first.batches.first().map(|b| b.base_offset), Some(0), "the batch holding offset 2");

    // Unknown topic, fetch past the end, oversized record.
    let r = client
        .produce(ProduceRequest {
            topic: "nope".into(),
            records: vec![rec("x")],
            producer_id: -1,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(code(&r.error), ErrorCode::UnknownTopic);
    let f = client
        .fetch(FetchRequest {
            topic: "events".into(),
            partition: 0,
            offset: 99,
            max_bytes: 1024,
            max_wait_ms: 0,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(code(&f.error), ErrorCode::OffsetOutOfRange);
    let e = f.error.expect("error");
    assert_eq!((e.log_start_offset, e.log_end_offset), (0, 4));

    // A Fetch that is not a FetchRequest (field 1, the topic, sent as a
    // number) gets a gRPC error from the broker's own Fetch route, and the
    // connection goes on serving.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{leader}"))?.connect().await?;
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await?;
    let not_a_fetch = ferrolog_proto::client::RecordBatch { base_offset: 5, ..Default::default() };
    let answer: Result<tonic::Response<ferrolog_proto::client::FetchResponse>, tonic::Status> = grpc
        .unary(
            tonic::Request::new(not_a_fetch),
            tonic::codegen::http::uri::PathAndQuery::from_static("/ferrolog.client.v1.Ferrolog/Fetch"),
            tonic_prost::ProstCodec::default(),
        )
        .await;
    let status = answer.expect_err("an undecodable request is refused");
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    let mut same = ferrolog_proto::client::ferrolog_client::FerrologClient::new(channel);
    let f = same
        .fetch(FetchRequest { topic: "events".into(), partition: 0, offset: 3, ..Default::default() })
        .await?
        .into_inner();
    assert_eq!(f.batches.iter().map(|b| (b.base_offset, b.record_count)).collect::<Vec<_>>(), vec![(3, 1)]);
    let big = "x".repeat((1 << 20) + 1);
    let r = client
        .produce(ProduceRequest {
            topic: "events".into(),
            partition: 0,
            records: vec![rec(&big)],
            producer_id: -1,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(code(&r.error), ErrorCode::RecordTooLarge, "{:?}", r.error);
    let r = client
        .produce(ProduceRequest {
            topic: "events".into(),
            partition: 0,
            records: vec![],
            producer_id: -1,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(code(&r.error), ErrorCode::InvalidRequest);

    // Garbage on the peer port and the client port.
    for addr in [c.broker(1).peer_addr, c.broker(1).client_addr] {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n\x00\x01\x02garbage garbage garbage").await?;
        let _ = s.shutdown().await;
    }

    // Replication factor 1: each partition lives on one broker, and the
    // others point at it (metadata from pings, NOT_LEADER hints).
    ferrolog_tests::raw::create_topic(&c, "single", 3, 1).await?;
    for p in 0..3 {
        let req = ProduceRequest {
            topic: "single".into(),
            partition: p,
            records: vec![rec("one")],
            producer_id: -1,
            ..Default::default()
        };
        let (r, _) = ferrolog_tests::raw::produce(&c, req.clone(), Duration::from_secs(30)).await?;
        assert_eq!(r.base_offset, 0);
        for b in &c.brokers {
            let r = connect(b.client_addr).await?.produce(req.clone()).await?.into_inner();
            match code(&r.error) {
                ErrorCode::None => {}
                ErrorCode::NotLeader => assert!(r.error.and_then(|e| e.leader).is_some(), "a hint"),
                other => panic!("partition {p} via broker {}: {other:?}", b.id),
            }
        }
    }

    // A connection that never speaks is closed (it would hold a
    // max_connections slot forever).
    let mut silent = tokio::net::TcpStream::connect(c.broker(3).client_addr).await?;
    let mut buf = [0u8; 1];
    let closed =
        tokio::time::timeout(Duration::from_secs(30), tokio::io::AsyncReadExt::read(&mut silent, &mut buf))
            .await
            .expect("the broker closes a silent connection");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");

    // Still serving.
    assert_eq!(produce(&c, "events", 0, &["e"]).await?, 4);
    let l = connect(leader_addr(&c, "events", 0).await?)
        .await?
        .list_offsets(ListOffsetsRequest {
            topic: "events".into(),
            partition: 0,
            spec: OffsetSpec::Latest as i32,
            timestamp_ms: 0,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(l.offset, 5);
    Ok(())
}

//! Size limits against a real 3-broker cluster with the default limits
//! (`max_record_bytes` = `max_batch_bytes` = 1 MiB): a record of exactly
//! `max_record_bytes` is stored alone and read back, through the client
//! library and the raw gRPC API, and replicated over the peer channel; a
//! record or batch over a limit gets `RECORD_TOO_LARGE` naming the limit
//! and the size, never a transport error, from both.

use std::time::Duration;

use bytes::Bytes;
use ferrolog_client::{
    ClientConfig, Consumer, ConsumerConfig, Error, MetadataCache, Producer, ProducerConfig,
};
use ferrolog_proto::client::{ErrorCode, FetchRequest, ProduceRequest, Record, RecordSet};
use ferrolog_tests::raw::{code, create_topic, leader, produce, produce_once, status};
use ferrolog_tests::{Cluster, connect};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const MIB: usize = 1 << 20;

fn raw_record(key: Option<usize>, value: usize) -> Record {
    Record {
        key: key.map(|n| Bytes::from(vec![b'k'; n])),
        value: Bytes::from(vec![b'v'; value]),
        headers: vec![],
        timestamp_ms: 0,
        ..Record::default()
    }
}

fn request(topic: &str, records: Vec<Record>) -> ProduceRequest {
    ProduceRequest { topic: topic.into(), partition: 0, records, producer_id: -1, ..Default::default() }
}

/// The value lengths of partition 0 of `topic` from `offset` on, as the
/// leader serves them (a batch larger than `max_bytes` still comes whole).
async fn value_lengths(
    c: &Cluster,
    topic: &str,
    mut offset: u64,
    count: usize,
) -> anyhow::Result<Vec<usize>> {
    let id = leader(c, topic, 0, Duration::from_secs(10)).await?;
    let mut client = connect(c.broker(id).client_addr).await?;
    let mut out = Vec::new();
    while out.len() < count {
        let f = client
            .fetch(FetchRequest {
                topic: topic.into(),
                partition: 0,
                offset,
                max_bytes: 1,
                max_wait_ms: 0,
                ..Default::default()
            })
            .await?
            .into_inner();
        anyhow::ensure!(f.error.is_none(), "fetch: {:?}", f.error);
        anyhow::ensure!(!f.batches.is_empty(), "no batch at offset {offset}");
        for b in &f.batches {
            for r in <RecordSet as prost::Message>::decode(b.records.clone())?.records {
                out.push(r.value.len());
            }
            offset = b.base_offset + u64::from(b.record_count);
        }
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_up_to_the_limit_are_stored_and_larger_ones_refused_by_name() -> anyhow::Result<()> {
    let c = Cluster::start("limits", BIN, 3, &[]).await?;
    create_topic(&c, "big", 1, 3).await?;

    // The raw API: one record of exactly max_record_bytes (no key, no
    // headers) is stored alone; so is one of key + value = 1 MiB.
    let (r, _) = produce(&c, request("big", vec![raw_record(None, MIB)]), Duration::from_secs(30)).await?;
    assert_eq!(r.base_offset, 0);
    let (r, _) =
        produce(&c, request("big", vec![raw_record(Some(100), MIB - 100)]), Duration::from_secs(30)).await?;
    assert_eq!(r.base_offset, 1);

    // Over the limits: RECORD_TOO_LARGE naming the limit and the size, also
    // for about 2 MiB (which the transport used to refuse) and for a batch
    // whose records are each within the record limit.
    let id = leader(&c, "big", 0, Duration::from_secs(10)).await?;
    let addr = c.broker(id).client_addr;
    for (records, size, limit) in [
        (vec![raw_record(None, MIB + 1)], MIB + 1, "max_record_bytes"),
        (vec![raw_record(None, 2 * MIB)], 2 * MIB, "max_record_bytes"),
        (vec![raw_record(None, 2 * MIB + (100 << 10))], 2 * MIB + (100 << 10), "max_record_bytes"),
        (vec![raw_record(None, 4 * MIB)], 4 * MIB, "max_record_bytes"),
        (vec![raw_record(Some(10), 2 * MIB + 100)], 2 * MIB + 110, "max_record_bytes"),
        (vec![raw_record(None, 600 << 10), raw_record(None, 600 << 10)], 1200 << 10, "max_batch_bytes"),
    ] {
        let r = produce_once(addr, request("big", records))
            .await
            .map_err(|e| anyhow::anyhow!("{size} bytes: not an in-band error: {e:#}"))?;
        assert_eq!(code(&r.error), ErrorCode::RecordTooLarge, "{size}: {:?}", r.error);
        let message = r.error.map(|e| e.message).unwrap_or_default();
        assert!(
            message.contains(limit)
                && message.contains(&size.to_string())
                && message.contains(&MIB.to_string()),
            "{size} bytes: the message names neither the limit nor the size: {message}"
        );
    }

    // The client library, default settings: the same.
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let producer = Producer::new(meta.clone(), ProducerConfig::default())?;
    let at_limit = producer.send("big", ferrolog_client::Record::new(vec![b'c'; MIB]));
    let with_headers = producer.send(
        "big",
        ferrolog_client::Record::new(vec![b'c'; MIB - 20])
            .with_key("0123456789")
            .with_header("h", "012345678"),
    );
    assert_eq!(at_limit.await?.offset, 2);
    assert_eq!(with_headers.await?.offset, 3);
    for size in [MIB + 1, 2 * MIB, 5 * MIB, 70 * MIB] {
        match producer.send("big", ferrolog_client::Record::new(vec![b'c'; size])).await {
            Err(Error::RecordTooLarge { message, .. }) => {
                assert!(
                    message.contains("max_record_bytes")
                        && message.contains(&size.to_string())
                        && message.contains(&MIB.to_string()),
                    "{size} bytes: {message}"
                );
            }
            other => panic!("{size} bytes: expected RECORD_TOO_LARGE, got {other:?}"),
        }
    }
    // A record at the limit after refused ones: the producer goes on.
    assert_eq!(producer.send("big", ferrolog_client::Record::new(vec![b'd'; MIB])).await?.offset, 4);
    producer.close().await;

    // Every record at the limit reads back whole, through the raw API and
    // the consumer.
    assert_eq!(value_lengths(&c, "big", 0, 5).await?, vec![MIB, MIB - 100, MIB, MIB - 20, MIB]);
    let mut consumer = Consumer::new(meta, ConsumerConfig::default());
    consumer.assign("big", [0], ferrolog_client::Seek::Earliest);
    let mut lengths = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while lengths.len() < 5 && tokio::time::Instant::now() < deadline {
        lengths.extend(consumer.poll(Duration::from_secs(1)).await?.iter().map(|r| r.value.len()));
    }
    assert_eq!(lengths, vec![MIB, MIB - 100, MIB, MIB - 20, MIB]);

    // The peer channel carried them: both followers matched the leader's log.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let id = leader(&c, "big", 0, Duration::from_secs(10)).await?;
        let s = status(&c, id, "big", 0).await?;
        if s.high_watermark == 5 && s.followers.len() == 2 && s.followers.iter().all(|f| f.lag == 0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{s:?}\n{}", c.logs_tail(20));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

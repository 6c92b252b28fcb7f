//! Partitions between real broker processes, through `ferrolog-jepsen`'s
//! TCP proxy on every broker link.

use std::time::Duration;

use ferrolog_proto::client::{FetchRequest, ProduceRequest};
use ferrolog_tests::raw::{create_topic, leader, produce, record, values};
use ferrolog_tests::{Cluster, connect};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");

/// Batch number `seq` of idempotent producer `pid` (KIP-98): a retry of a
/// batch that did commit is answered with its original offset.
fn req(pid: i64, seq: i32, v: &str) -> ProduceRequest {
    ProduceRequest {
        topic: "cdc".into(),
        partition: 0,
        records: vec![record("k", v)],
        producer_id: pid,
        producer_epoch: 0,
        base_sequence: seq,
    }
}

/// A leader whose followers' answers are lost (it still reaches them, so
/// they keep hearing heartbeats and would not elect anyone) hands over
/// (CheckQuorum), and writes are acknowledged again while the cut lasts.
///
/// Without the hand-off nothing commits until the leader's HTTP/2
/// keepalive gives up on its connections (10 s interval + 20 s timeout,
/// measured: 34 s) and the followers stop hearing it. The 20 s bound below
/// tells the two apart with a wide margin (the hand-off takes 2–4 s here):
/// it is not a speed target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_cannot_hear_its_followers_is_replaced_while_the_cut_lasts() -> anyhow::Result<()> {
    let (c, proxy) = Cluster::start_through_proxy("one-way", BIN, 3).await?;
    create_topic(&c, "cdc", 1, 3).await?;
    let pid = connect(c.broker(1).client_addr)
        .await?
        .init_producer_id(ferrolog_proto::client::InitProducerIdRequest {})
        .await?
        .into_inner()
        .producer_id;
    let (r, old) = produce(&c, req(pid, 0, "before"), Duration::from_secs(30)).await?;
    assert_eq!(r.base_offset, 0);

    for follower in (1..=3).filter(|b| *b != old) {
        proxy.cut(follower, old);
    }
    // The cut-off leader may append this batch and reach the followers with
    // it before handing over: then the new leader commits it, and the retry
    // is answered as a duplicate with the same offset.
    let (r, new) = produce(&c, req(pid, 1, "during"), Duration::from_secs(20)).await.map_err(|e| {
        e.context(format!(
            "no write acknowledged while broker {old} could not hear its followers\n{}",
            c.logs_tail(30)
        ))
    })?;
    assert_ne!(new, old, "the cut-off leader acknowledged a write it could not have replicated");
    assert_eq!(r.base_offset, 1);

    // After healing, the old leader follows the new one and the log is one.
    proxy.heal();
    let (r, _) = produce(&c, req(pid, 2, "after"), Duration::from_secs(30)).await?;
    assert_eq!(r.base_offset, 2);
    let now = leader(&c, "cdc", 0, Duration::from_secs(30)).await?;
    let fetched = connect(c.broker(now).client_addr)
        .await?
        .fetch(FetchRequest {
            topic: "cdc".into(),
            partition: 0,
            offset: 0,
            max_bytes: 1 << 20,
            max_wait_ms: 0,
        })
        .await?
        .into_inner();
    assert_eq!(values(&fetched)?, ["before", "during", "after"]);
    Ok(())
}

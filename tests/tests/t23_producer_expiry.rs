//! Idempotent producer state expiry (issue 12, Kafka's
//! `producer.id.expiration.ms`): on a 3-replica partition, a producer id
//! that stops writing is forgotten once the expiration passes (a retry of
//! its last batch is no longer recognised: `OUT_OF_ORDER_SEQUENCE`,
//! expected 0, and nothing is appended), while one that keeps writing still
//! has its retries answered as duplicates. Every replica forgot the same
//! id: each answers so as leader in turn (leadership moved to each).

use std::collections::BTreeSet;
use std::fs;
use std::time::{Duration, Instant};

use ferrolog_proto::client::{ErrorCode, ProduceRequest, ProduceResponse, TransferLeaderRequest};
use ferrolog_tests::raw::{code, create_topic, leader, produce, produce_once, record};
use ferrolog_tests::{Cluster, connect};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const CONFIG: &str = "[producers]\nid_expiration_ms = 3000\nid_expiration_check_interval_ms = 300\n";
const IDLE: i64 = 7;
const ACTIVE: i64 = 8;

fn batch(producer_id: i64, sequence: i32) -> ProduceRequest {
    ProduceRequest {
        topic: "t".into(),
        partition: 0,
        records: vec![record("k", &format!("{producer_id}-{sequence}"))],
        producer_id,
        producer_epoch: 0,
        base_sequence: sequence,
        ..ProduceRequest::default()
    }
}

/// Sends `req` to the current leader once; the answer and that leader.
async fn once(c: &Cluster, req: ProduceRequest) -> anyhow::Result<(ProduceResponse, u32)> {
    let at = leader(c, "t", 0, Duration::from_secs(30)).await?;
    Ok((produce_once(c.broker(at).client_addr, req).await?, at))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_producer_ids_expire_on_every_replica_and_active_ones_keep_deduplicating() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    fs::write(&config, CONFIG)?;
    let c =
        Cluster::start("producer-expiry", BIN, 3, &[("FERROLOG_CONFIG", &config.to_string_lossy())]).await?;
    create_topic(&c, "t", 1, 3).await?;

    // The idle producer writes two batches; a retry of the second is a duplicate.
    produce(&c, batch(IDLE, 0), Duration::from_secs(30)).await?;
    let (first, _) = produce(&c, batch(IDLE, 1), Duration::from_secs(30)).await?;
    let (retry, _) = produce(&c, batch(IDLE, 1), Duration::from_secs(30)).await?;
    assert!(retry.duplicate && retry.base_offset == first.base_offset, "{retry:?}");

    // The active producer writes on; the idle one's retry is recognised until its id expires.
    let mut seq = 0;
    let mut last_active;
    let mut answered_by = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while answered_by.len() < 3 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the idle producer's id was forgotten by leaders {answered_by:?} only\n{}",
            c.logs_tail(30)
        );
        let (r, _) = produce(&c, batch(ACTIVE, seq), Duration::from_secs(30)).await?;
        anyhow::ensure!(!r.duplicate, "a new batch of the active producer was taken for a duplicate: {r:?}");
        last_active = r;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
        let (probe, at) = once(&c, batch(IDLE, 1)).await?;
        match code(&probe.error) {
            ErrorCode::None => {
                // Not expired on this leader yet: still the duplicate, never appended again.
                assert!(probe.duplicate && probe.base_offset == first.base_offset, "{probe:?}");
                anyhow::ensure!(answered_by.is_empty(), "leader {at} remembers an id another forgot");
            }
            ErrorCode::OutOfOrderSequence => {
                let e = probe.error.expect("an error");
                assert!(e.message.contains("expected 0,"), "{e:?}");
                // The active producer's retry of its last batch is still a duplicate here.
                let (dup, _) = once(&c, batch(ACTIVE, seq - 1)).await?;
                if code(&dup.error) == ErrorCode::None {
                    assert!(dup.duplicate && dup.base_offset == last_active.base_offset, "{dup:?}");
                    answered_by.insert(at);
                    eprintln!("leader {at} forgot producer {IDLE} and deduplicates producer {ACTIVE}");
                    // Next: a replica that has not answered leads (it applied the same decision).
                    if let Some(next) = (1..=3).find(|b| !answered_by.contains(b)) {
                        let r = connect(c.broker(at).client_addr)
                            .await?
                            .transfer_leader(TransferLeaderRequest {
                                topic: "t".into(),
                                partition: 0,
                                to_broker: next,
                            })
                            .await?
                            .into_inner();
                        eprintln!("leadership to {next}: {:?}, leader {}", r.error, r.leader);
                    }
                }
            }
            ErrorCode::NotLeader | ErrorCode::Unavailable => {}
            other => anyhow::bail!("probe answered {other:?}: {:?}", probe.error),
        }
    }
    Ok(())
}

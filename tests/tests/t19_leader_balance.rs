//! Preferred-leader balancing (Kafka's `auto.leader.rebalance.enable`):
//! leaderships moved away from the partitions' preferred replicas (here by
//! hand, to one broker) go back to them on their own, by hand-over, while
//! a producer keeps writing: every acknowledged record is read back.

use std::time::{Duration, Instant};

use ferrolog_proto::client::{ErrorCode, TransferLeaderRequest};
use ferrolog_tests::raw::{code, create_topic, leader, produce, read_values, record};
use ferrolog_tests::{Cluster, connect, metadata};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const PARTITIONS: u32 = 6;
/// Checks every second instead of Kafka's 300 s.
const CONFIG: &str = "[balance]\nleader_imbalance_check_interval_ms = 1000\n";

/// Each partition's leader and preferred replica (its first), as broker 1's
/// metadata has them.
async fn leaders_and_preferred(c: &Cluster) -> anyhow::Result<Vec<(u32, u32)>> {
    let m = metadata(c.broker(1).client_addr).await?;
    let t = m.topics.iter().find(|t| t.name == "t").ok_or_else(|| anyhow::anyhow!("no topic t"))?;
    Ok(t.partitions.iter().map(|p| (p.leader, p.replicas.first().copied().unwrap_or(0))).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaderships_go_back_to_preferred_replicas() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    std::fs::write(&config, CONFIG)?;
    let config = config.to_string_lossy().into_owned();
    let c = Cluster::start("balance", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    create_topic(&c, "t", PARTITIONS, 3).await?;

    // Every leadership to broker 3, by hand.
    let mut moved = 0;
    for p in 0..PARTITIONS {
        // The leader as the metadata has it may have moved on (the balancer
        // runs every second): follow NOT_LEADER.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let l = leader(&c, "t", p, Duration::from_secs(30)).await?;
            let r = connect(c.broker(l).client_addr)
                .await?
                .transfer_leader(TransferLeaderRequest { topic: "t".into(), partition: p, to_broker: 3 })
                .await?
                .into_inner();
            match code(&r.error) {
                ErrorCode::None => {
                    assert_eq!(r.leader, 3, "partition {p}");
                    moved += 1;
                    break;
                }
                ErrorCode::ElectionNotNeeded => {
                    assert_eq!(l, 3, "partition {p}: {:?}", r.error);
                    break;
                }
                // Right after the start, the leader's broker may not have
                // heard broker 3's pings yet ("not alive").
                ErrorCode::NotLeader | ErrorCode::PreferredLeaderNotAvailable
                    if Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                _ => anyhow::bail!("partition {p}: transfer to broker 3 refused: {:?}", r.error),
            }
        }
    }
    let preferred_elsewhere =
        leaders_and_preferred(&c).await?.iter().filter(|(_, preferred)| *preferred != 3).count();
    println!(
        "{moved} leaderships moved to broker 3 by hand; {preferred_elsewhere} partitions prefer another broker"
    );
    assert!(moved >= 3 && preferred_elsewhere >= 3, "too little was out of balance to show anything");

    // Back to the preferred replicas on their own, while writes go on.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut written = 0u32;
    loop {
        for p in 0..PARTITIONS {
            let req = ferrolog_proto::client::ProduceRequest {
                topic: "t".into(),
                partition: p,
                records: vec![record("k", &format!("{p}-{written}"))],
                producer_id: -1,
                ..Default::default()
            };
            produce(&c, req, Duration::from_secs(10)).await?;
        }
        written += 1;
        let now = leaders_and_preferred(&c).await?;
        if now.iter().all(|(l, preferred)| l == preferred) {
            println!(
                "every partition led by its preferred replica again after {written} rounds of writes: {now:?}"
            );
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "leaders not back on preferred replicas: {now:?}\n{}",
            c.logs_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Broker 3's summary line of a check that moved something. The line
    // follows the transfers, so it may land a moment after the leaders are
    // back: read the log until it appears.
    let log_deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let moved_by_3: u64 = std::fs::read_to_string(&c.broker(3).log)?
            .lines()
            .filter(|l| l.contains("leaderships handed back to preferred replicas"))
            .filter_map(|l| l.split(" moved=").nth(1)?.split(' ').next()?.parse::<u64>().ok())
            .sum();
        if moved_by_3 > 0 {
            break;
        }
        assert!(
            Instant::now() < log_deadline,
            "broker 3 never logged a preferred leader election that moved something"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Partition 0's writes, all there, in order. They are not idempotent:
    // one retried across a hand-over may be stored twice, next to itself.
    let l = leader(&c, "t", 0, Duration::from_secs(10)).await?;
    let mut values = read_values(c.broker(l).client_addr, "t").await?;
    values.dedup();
    let expected: Vec<String> = (0..written).map(|i| format!("0-{i}")).collect();
    assert_eq!(values, expected);
    Ok(())
}

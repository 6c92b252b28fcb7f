//! Leader failover and idempotent retries with real processes and SIGKILL.

use std::time::{Duration, Instant};

use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{
    batch, code, create_topic, init_producer_id, leader, produce, read_values, status,
};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
/// The brokers' default election timeout range, ms (deploy/broker.toml).
const ELECTION_TIMEOUT_MAX_MS: u64 = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_leader_is_replaced_and_retries_are_not_duplicated() -> anyhow::Result<()> {
    let mut c = Cluster::start("failover", BIN, 3, &[]).await?;
    create_topic(&c, "orders", 1, 3).await?;
    let pid = init_producer_id(c.broker(1).client_addr).await?;

    let (r, _) = produce(&c, batch("orders", pid, 0, "a"), Duration::from_secs(30)).await?;
    assert_eq!((r.base_offset, r.duplicate), (0, false));
    // A retry of the same batch is answered with its original offset.
    let (r, _) = produce(&c, batch("orders", pid, 0, "a"), Duration::from_secs(30)).await?;
    assert_eq!((r.base_offset, r.duplicate), (0, true));
    // A gap in the sequence is refused.
    let old = leader(&c, "orders", 0, Duration::from_secs(10)).await?;
    let gap =
        ferrolog_tests::raw::produce_once(c.broker(old).client_addr, batch("orders", pid, 5, "x")).await?;
    assert_eq!(code(&gap.error), ferrolog_proto::client::ErrorCode::OutOfOrderSequence, "{:?}", gap.error);

    let (r, _) = produce(&c, batch("orders", pid, 1, "b"), Duration::from_secs(30)).await?;
    assert_eq!(r.base_offset, 1);

    // Kill the leader; writes must resume on a new one.
    let killed_at = Instant::now();
    c.kill(old);
    let (r, new) = produce(&c, batch("orders", pid, 2, "c"), Duration::from_secs(30)).await?;
    let failover = killed_at.elapsed();
    assert_ne!(new, old);
    assert_eq!((r.base_offset, r.duplicate), (2, false));
    println!(
        "failover: writes accepted again {} ms after SIGKILL of the leader (target: within 2 x election timeout = {} ms)",
        failover.as_millis(),
        2 * ELECTION_TIMEOUT_MAX_MS
    );

    // Administration still works: the controller may have been on the
    // killed broker too.
    create_topic(&c, "after-failover", 1, 2).await?;

    // The producer state survived the failover: the retry of "b" is a duplicate.
    let (r, _) = produce(&c, batch("orders", pid, 1, "b"), Duration::from_secs(30)).await?;
    assert_eq!((r.base_offset, r.duplicate), (1, true));

    // The killed broker comes back as a follower and catches up.
    c.spawn(old)?;
    let (r, leader_now) = produce(&c, batch("orders", pid, 3, "d"), Duration::from_secs(30)).await?;
    assert_eq!(r.base_offset, 3);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(&c, old, "orders", 0).await;
        if let Ok(s) = &s
            && s.high_watermark == 4
        {
            break;
        }
        assert!(Instant::now() < deadline, "restarted broker did not catch up: {s:?}\n{}", c.logs_tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Exactly four records, in order.
    assert_eq!(read_values(c.broker(leader_now).client_addr, "orders").await?, vec!["a", "b", "c", "d"]);
    Ok(())
}

//! Partitions between real broker processes, through `ferrolog-jepsen`'s
//! TCP proxy on every broker link.

use std::time::Duration;

use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{batch, create_topic, init_producer_id, leader, produce, read_values};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");

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
    let pid = init_producer_id(c.broker(1).client_addr).await?;
    let (r, old) = produce(&c, batch("cdc", pid, 0, "before"), Duration::from_secs(30)).await?;
    assert_eq!(r.base_offset, 0);

    for follower in (1..=3).filter(|b| *b != old) {
        proxy.cut(follower, old);
    }
    // The cut-off leader may append this batch and reach the followers with
    // it before handing over: then the new leader commits it, and the retry
    // is answered as a duplicate with the same offset.
    let (r, new) =
        produce(&c, batch("cdc", pid, 1, "during"), Duration::from_secs(20)).await.map_err(|e| {
            e.context(format!(
                "no write acknowledged while broker {old} could not hear its followers\n{}",
                c.logs_tail(30)
            ))
        })?;
    assert_ne!(new, old, "the cut-off leader acknowledged a write it could not have replicated");
    assert_eq!(r.base_offset, 1);

    // After healing, the old leader follows the new one and the log is one.
    proxy.heal();
    let (r, _) = produce(&c, batch("cdc", pid, 2, "after"), Duration::from_secs(30)).await?;
    assert_eq!(r.base_offset, 2);
    let now = leader(&c, "cdc", 0, Duration::from_secs(30)).await?;
    assert_eq!(read_values(c.broker(now).client_addr, "cdc").await?, ["before", "during", "after"]);
    Ok(())
}

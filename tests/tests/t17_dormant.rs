//! Dormant followers (`control::dormant` of the broker): a follower whose
//! group has been idle stops its Raft node, and starts it again when the
//! group needs it. Real brokers with `raft.dormant_after_ms = 300`.
//!
//! Every follower of every partition is made dormant first (counted by the
//! brokers themselves, in their `Metadata` answers), so what follows cannot
//! pass without waking one: a write commits only once a follower's node
//! has stored it (a majority of 3), and after SIGKILL of the broker leading
//! most partitions their new leaders can only come from dormant followers.
//! Every record is then read back, exactly once and in order. A pre-vote
//! the follower refuses anyway is answered without waking it.

use std::time::{Duration, Instant};

use ferrolog_proto::client::{FetchRequest, MetadataRequest};
use ferrolog_tests::{Cluster, connect, raw};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const CONFIG: &str = "[raft]\ndormant_after_ms = 300\n";
const PARTITIONS: u32 = 6;

/// Dormant replicas, and wakes of dormant replicas since start, summed over
/// the running brokers as each reports itself.
async fn dormant_and_wakes(c: &Cluster) -> anyhow::Result<(u64, u64)> {
    let (mut dormant, mut wakes) = (0, 0);
    for b in c.brokers.iter().filter(|b| c.is_running(b.id)) {
        let m = connect(b.client_addr).await?.metadata(MetadataRequest { topics: vec![] }).await?;
        let own = m.into_inner().brokers.into_iter().find(|i| i.id == b.id);
        let own = own.ok_or_else(|| anyhow::anyhow!("broker {} does not report itself", b.id))?;
        dormant += own.dormant_replicas;
        wakes += own.dormant_wakes;
    }
    Ok((dormant, wakes))
}

/// Dormant replicas summed over the running brokers (0 for a broker that
/// does not answer now: the caller waits for the count it wants).
async fn dormant(c: &Cluster) -> u64 {
    dormant_and_wakes(c).await.map_or(0, |(d, _)| d)
}

/// Waits until `want` replicas are dormant in all.
async fn wait_dormant(c: &Cluster, want: u64, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = dormant(c).await;
        if now == want {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{what}: {now} dormant replicas, not {want}, after 60 s\n{}",
            c.logs_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Produces `value` to partition `p` of "d", following leaders.
async fn write(c: &Cluster, p: u32, value: &str) -> anyhow::Result<()> {
    let mut req = raw::batch("d", -1, 0, value);
    req.partition = p;
    raw::produce(c, req, Duration::from_secs(60)).await?;
    Ok(())
}

/// The values of partition `p` as its leader serves them.
async fn read(c: &Cluster, p: u32) -> anyhow::Result<Vec<String>> {
    let leader = raw::leader(c, "d", p, Duration::from_secs(30)).await?;
    let req =
        FetchRequest { topic: "d".into(), partition: p, offset: 0, max_bytes: 1 << 20, ..Default::default() };
    raw::values(&connect(c.broker(leader).client_addr).await?.fetch(req).await?.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dormant_followers_wake_for_writes_and_elections() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    std::fs::write(&config, CONFIG)?;
    let config = config.to_string_lossy().into_owned();
    let mut c = Cluster::start("dormant", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    raw::create_topic(&c, "d", PARTITIONS, 3).await?;
    for p in 0..PARTITIONS {
        write(&c, p, &format!("a{p}")).await?;
    }
    // Two followers per partition; leaders never go dormant.
    let followers = 2 * u64::from(PARTITIONS);
    wait_dormant(&c, followers, "after the first writes").await?;

    // A pre-vote that a dormant follower refuses anyway (it presumes a
    // live leader, other than the candidate) is answered without waking
    // it; the control, the leader itself as candidate, wakes it and is
    // granted (the request is well formed, and the rule is what refuses).
    let leader = raw::leader(&c, "d", 0, Duration::from_secs(30)).await?;
    let led = raw::status(&c, leader, "d", 0).await?;
    anyhow::ensure!(led.followers.len() == 2, "the leader reports {} followers", led.followers.len());
    let (f1, f2) = (&led.followers[0], &led.followers[1]);
    let meta =
        connect(c.broker(leader).client_addr).await?.metadata(MetadataRequest { topics: vec![] }).await?;
    let group = meta.into_inner().topics.iter().find(|t| t.name == "d").map(|t| t.partitions[0].group_id);
    let group = group.ok_or_else(|| anyhow::anyhow!("no topic d"))?;
    let leader_node = raw::node_on(&c, leader, group).await?;
    let (_, wakes) = dormant_and_wakes(&c).await?;
    let refused = raw::pre_vote(&c, f2.broker_id, group, f2.node_id, f1.node_id, led.term + 1).await?;
    assert!(
        !refused.vote_granted,
        "a dormant follower of a live leader granted another candidate's pre-vote"
    );
    assert_eq!(dormant_and_wakes(&c).await?.1, wakes, "a refused pre-vote woke a dormant follower");
    let control = raw::pre_vote(&c, f2.broker_id, group, f2.node_id, leader_node, led.term + 1).await?;
    assert!(
        control.vote_granted,
        "the leader's own pre-vote was refused: the refusal above may be for another reason"
    );
    assert!(dormant_and_wakes(&c).await?.1 > wakes, "the control was answered without waking the follower");
    wait_dormant(&c, followers, "after the pre-votes").await?;

    // Every follower is dormant: each of these commits needs one to wake.
    for p in 0..PARTITIONS {
        write(&c, p, &format!("b{p}")).await?;
    }
    wait_dormant(&c, followers, "after the second writes").await?;

    // SIGKILL of the broker leading most partitions: their next leaders
    // are dormant followers, which must wake and campaign.
    let mut led = [0u32; 4];
    for p in 0..PARTITIONS {
        led[raw::leader(&c, "d", p, Duration::from_secs(30)).await? as usize] += 1;
    }
    let victim = (1..=3).max_by_key(|b| led[*b as usize]).unwrap_or(1);
    assert!(led[victim as usize] > 0, "broker {victim} leads nothing: {led:?}");
    c.kill(victim);
    for p in 0..PARTITIONS {
        write(&c, p, &format!("c{p}")).await?;
    }
    for p in 0..PARTITIONS {
        let want: Vec<String> = ["a", "b", "c"].iter().map(|v| format!("{v}{p}")).collect();
        assert_eq!(read(&c, p).await?, want, "partition {p}");
    }
    Ok(())
}

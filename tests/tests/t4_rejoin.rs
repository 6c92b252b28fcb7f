//! Brokers coming back: one that was down while the leaders moved on (and
//! snapshotted and purged their logs) catches up; one whose data directory
//! was wiped is rebuilt from the others under new Raft node ids and then
//! counts toward the majority, in its partitions and in the metadata group.

use std::time::{Duration, Instant};

use ferrolog_proto::client::ProduceRequest;
use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{caught_up, create_topic, leader, produce, produce_once, record, status};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const CONFIG: &str = "[raft]\nsnapshot_after_entries = 50\n\n[storage]\nsegment_bytes = 65536\n";

async fn write(c: &Cluster, partition: u32, n: usize, tag: &str) -> anyhow::Result<()> {
    let mut to = None;
    for i in 0..n {
        let req = ProduceRequest {
            topic: "t".into(),
            partition,
            records: vec![record("k", &format!("{tag}-{i}"))],
            producer_id: -1,
            ..ProduceRequest::default()
        };
        // The last leader first; look it up again only when that fails.
        if let Some(id) = to
            && let Ok(r) = produce_once(c.broker(id).client_addr, req.clone()).await
            && r.error.is_none()
        {
            continue;
        }
        to = Some(produce(c, req, Duration::from_secs(30)).await?.1);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lagging_and_wiped_brokers_are_rebuilt() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    std::fs::write(&config, CONFIG)?;
    let config = config.to_string_lossy().into_owned();
    let mut c = Cluster::start("rejoin", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    create_topic(&c, "t", 2, 3).await?;
    write(&c, 0, 20, "a").await?;
    write(&c, 1, 20, "a").await?;

    // Down while the leaders write, snapshot and purge (1,000 entries are
    // kept after a snapshot, so 1,300 more force a snapshot transfer).
    c.kill(3);
    write(&c, 0, 1300, "b").await?;
    write(&c, 1, 50, "b").await?;
    c.spawn(3)?;
    caught_up(&c, "t", 3, 2).await?;
    println!("broker 3 caught up after being down for 1,350 writes");

    // Wiped: rebuilt under new node ids.
    let before = status(&c, leader(&c, "t", 0, Duration::from_secs(30)).await?, "t", 0).await?;
    c.wipe(2);
    write(&c, 0, 10, "c").await?;
    c.spawn(2)?;
    caught_up(&c, "t", 2, 2).await?;
    // The leader's followers are the new node ids once the voters changed.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
        let s = status(&c, l, "t", 0).await?;
        let old: Vec<u64> = before.followers.iter().map(|f| f.node_id).collect();
        let on_2: Vec<u64> = s.followers.iter().filter(|f| f.broker_id == 2).map(|f| f.node_id).collect();
        if s.followers.len() == 2 && on_2.len() == 1 && !old.contains(&on_2[0]) && l != 2 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "membership not changed: {s:?}\n{}", c.logs_tail(40));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The metadata group swaps the retired node id too (its leader logs the
    // voter change for group 0 once both phases of the joint change are
    // committed); only then is the rebuilt broker a voter there. Until then
    // the old voter set still has a say, and with its retired node id gone
    // one more broker down would leave the group without a majority.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !c.brokers.iter().any(|b| {
        std::fs::read_to_string(&b.log)
            .unwrap_or_default()
            .lines()
            .any(|l| l.contains("voters changed group=0"))
    }) {
        anyhow::ensure!(Instant::now() < deadline, "metadata voters not changed\n{}", c.logs_tail(40));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // With the rebuilt broker as one of the two live voters, writes commit.
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let other = [1, 3].into_iter().find(|b| *b != l).unwrap_or(1);
    c.kill(other);
    write(&c, 0, 5, "d").await?;
    println!("writes commit with broker {other} down and the rebuilt broker 2 voting");
    // The metadata group also counts the rebuilt broker: topics can still
    // be created with one of the two other brokers down.
    create_topic(&c, "after-wipe", 1, 2).await?;
    Ok(())
}

//! The versioned peer protocol (issue 10) between real broker processes:
//! a broker minor versions ahead replicates with the others (a rolling
//! upgrade's middle state: this build among brokers announcing 1.1, which
//! refuse its `Batch` calls as a 1.1 build does, so it falls back to single
//! RPCs), and elects with brokers announcing 1.2 (which answer its batched
//! votes as calls they do not know, so it sends its votes singly), and a
//! broker of another major version is
//! refused on both sides with the documented error while the rest of the
//! cluster carries on. The version a broker announces is set for one broker
//! with `FERROLOG_TEST_PEER_PROTOCOL`, which only the tests' broker program
//! reads (tests/src/bin; broker/src/network/protocol.rs).

use std::time::{Duration, Instant};

use ferrolog_broker::network::protocol::{MAJOR, MINOR};
use ferrolog_client::{ClientConfig, MetadataCache, Producer, ProducerConfig, Record};
use ferrolog_proto::client::ErrorCode;
use ferrolog_tests::raw::{caught_up, code, create_topic, self_claimed_leaders, status};
use ferrolog_tests::{Cluster, connect, metadata};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const OVERRIDE: &str = "FERROLOG_TEST_PEER_PROTOCOL";

fn log_of(c: &Cluster, id: u32) -> String {
    std::fs::read_to_string(&c.broker(id).log).unwrap_or_default()
}

/// Waits up to 30 s for broker `id`'s log to contain `needle`.
async fn wait_for_log(c: &Cluster, id: u32, needle: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !log_of(c, id).contains(needle) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "broker {id} never logged {needle:?}\n{}",
            c.logs_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Produces `n` records to every partition of `topic` and waits for them.
async fn produce_everywhere(c: &Cluster, topic: &str, partitions: u32, n: usize) -> anyhow::Result<()> {
    let cache = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let producer = Producer::new(cache, ProducerConfig::default())?;
    let mut deliveries = Vec::new();
    for p in 0..partitions {
        for i in 0..n {
            deliveries.push(producer.send(topic, Record::new(format!("p{p}-{i}")).with_partition(p)));
        }
    }
    for d in deliveries {
        d.await?;
    }
    producer.close().await;
    Ok(())
}

/// Waits up to 30 s until every partition of `topic` has a leader that
/// claims it.
async fn all_led(c: &Cluster, topic: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let leaders = self_claimed_leaders(c, topic).await?;
        if leaders.iter().all(Option::is_some) {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{topic} not all led: {leaders:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_broker_one_minor_version_ahead_replicates_with_the_others() -> anyhow::Result<()> {
    let mut c = Cluster::prepare("t15-minor", BIN, 3, &[])?;
    c.set_env(1, OVERRIDE, "1.1");
    c.set_env(2, OVERRIDE, "1.1");
    c.launch().await?;
    // The override took effect (else this test would show nothing).
    for id in [1, 2] {
        assert!(log_of(&c, id).contains("announcing another peer protocol version"), "{}", c.logs_tail(20));
    }
    assert!(!log_of(&c, 3).contains("announcing another peer protocol version"), "{}", c.logs_tail(20));
    assert!(!log_of(&c, 1).contains("refused a peer request"), "{}", c.logs_tail(20));

    // Six partitions: preferred leaders are spread, so the newer broker
    // leads some (sending appends and heartbeats to 1.1 brokers) and
    // follows others. On a
    // loaded machine a preferred leader may lose its first election: then
    // the broker leading most partitions is stopped until they have new
    // leaders, and started again (up to five times).
    let (topic, partitions, batch) = ("mixed", 6, 20);
    create_topic(&c, topic, partitions, 3).await?;
    produce_everywhere(&c, topic, partitions, batch).await?;
    let mut n = batch;
    let mut leaders = self_claimed_leaders(&c, topic).await?;
    let mixed = |l: &[Option<u32>]| l.contains(&Some(3)) && l.iter().any(|b| b.is_some_and(|b| b != 3));
    for _ in 0..5 {
        if mixed(&leaders) {
            break;
        }
        let busiest = (1..=3)
            .max_by_key(|b| leaders.iter().filter(|l| **l == Some(*b)).count())
            .expect("three brokers");
        c.kill(busiest);
        all_led(&c, topic).await?;
        c.spawn(busiest)?;
        c.wait_ready(3, Duration::from_secs(30)).await?;
        produce_everywhere(&c, topic, partitions, batch).await?;
        n += batch;
        leaders = self_claimed_leaders(&c, topic).await?;
    }
    assert!(mixed(&leaders), "the newer broker does not lead some and follow others: {leaders:?}");
    // It tried to batch its small calls to the 1.1 brokers, was refused,
    // and sent them singly.
    wait_for_log(&c, 3, "the peer does not take batched calls (peer protocol older than 1.2)").await?;

    // Every replica on every broker holds every record.
    let deadline = Instant::now() + Duration::from_secs(30);
    for id in 1..=3 {
        for p in 0..partitions {
            loop {
                let s = status(&c, id, topic, p).await?;
                if s.error.is_none() && s.high_watermark == n as u64 {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "broker {id} partition {p}: high watermark {} of {n} ({:?})",
                    s.high_watermark,
                    s.error
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    for id in 1..=3 {
        let log = log_of(&c, id);
        assert!(!log.contains("refused a peer request"), "broker {id} refused a peer: {log}");
    }
    Ok(())
}

#[tokio::test]
async fn a_broker_one_minor_version_ahead_elects_with_older_voters() -> anyhow::Result<()> {
    // This build (1.3 or later) among brokers announcing 1.2, which take
    // batched heartbeats but answer batched votes as calls they do not know.
    let mut c = Cluster::prepare("t15-votes", BIN, 3, &[])?;
    c.set_env(1, OVERRIDE, "1.2");
    c.set_env(2, OVERRIDE, "1.2");
    c.launch().await?;
    let (topic, partitions) = ("votes", 3);
    create_topic(&c, topic, partitions, 3).await?;
    all_led(&c, topic).await?;
    produce_everywhere(&c, topic, partitions, 5).await?;
    // Broker 3 has every partition's records: it can win an election (a
    // replica whose log is behind cannot, and the other one would).
    caught_up(&c, topic, 3, partitions).await?;

    // A partition whose leader is another broker and in which broker 3 is
    // the next replica: when that leader dies, broker 3 campaigns first
    // (crate::control::quiesce::first_live), asking a 1.2 broker's vote.
    let m = metadata(c.broker(1).client_addr).await?;
    let placement = &m.topics.iter().find(|t| t.name == topic).expect("the topic").partitions;
    let leaders = self_claimed_leaders(&c, topic).await?;
    let (p, dead) = (0..partitions)
        .find_map(|p| {
            let leader = leaders[p as usize]?;
            let replicas = &placement.iter().find(|x| x.partition == p)?.replicas;
            let next = replicas.iter().find(|b| **b != leader)?;
            (leader != 3 && *next == 3).then_some((p, leader))
        })
        .ok_or_else(|| anyhow::anyhow!("no partition with broker 3 next after its leader: {leaders:?}"))?;
    c.kill(dead);
    let deadline = Instant::now() + Duration::from_secs(30);
    while self_claimed_leaders(&c, topic).await?[p as usize] != Some(3) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "partition {p} not led by broker 3 after broker {dead}'s death\n{}",
            c.logs_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // It tried to batch its votes to the 1.2 broker, was answered as a 1.2
    // broker answers, and won with single votes.
    wait_for_log(&c, 3, "the peer does not take batched votes (peer protocol older than 1.3)").await?;
    let survivor = if dead == 1 { 2 } else { 1 };
    let log = log_of(&c, survivor);
    assert!(!log.contains("refused a peer request"), "broker {survivor} refused a peer: {log}");
    produce_everywhere(&c, topic, partitions, 5).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(&c, survivor, topic, p).await?;
        if s.high_watermark == 10 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "partition {p} on broker {survivor}: {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

#[tokio::test]
async fn a_broker_of_another_major_version_is_refused_and_the_rest_carry_on() -> anyhow::Result<()> {
    // A botched upgrade: broker 3 of a formed cluster comes back speaking 2.0.
    let mut c = Cluster::start("t15-major", BIN, 3, &[]).await?;
    let (topic, partitions) = ("before", 2);
    create_topic(&c, topic, partitions, 3).await?;
    produce_everywhere(&c, topic, partitions, 10).await?;
    c.kill(3);
    c.set_env(3, OVERRIDE, "2.0");
    c.spawn(3)?;

    // Both sides say why, naming both versions.
    for id in [1, 2] {
        let why = format!(
            "refused a peer request: peer protocol 2.0 is not spoken here: this broker speaks {MAJOR}.{MINOR}"
        );
        wait_for_log(&c, id, &why).await?;
    }
    let why = format!(
        "refused a peer request: peer protocol {MAJOR}.{MINOR} is not spoken here: this broker speaks 2.0"
    );
    wait_for_log(&c, 3, &why).await?;

    // The 1.x brokers do not count the 2.0 broker as alive, and carry on
    // without it: its partitions have a majority on them.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = metadata(c.broker(1).client_addr).await?;
        if m.brokers.iter().any(|b| b.id == 3 && !b.alive) {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "broker 3 still counts as alive: {:?}", m.brokers);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // (Broker 1 may still forward to broker 3 as the controller it knew,
    // and be refused, until the metadata group elects a 1.x leader.)
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = connect(c.broker(1).client_addr)
            .await?
            .create_topic(ferrolog_proto::client::CreateTopicRequest {
                name: "wide".into(),
                partitions: 1,
                replication_factor: 3,
                ..Default::default()
            })
            .await?
            .into_inner();
        assert_eq!(code(&r.error), ErrorCode::Unavailable, "{:?}", r.error);
        let why = r.error.map(|e| e.message).unwrap_or_default();
        if why.contains("not answering: 3") {
            break;
        }
        // Or, while the metadata group elects a 1.x leader, no controller
        // at all (seen once in CI under load).
        assert!(
            why.contains(&format!("peer protocol {MAJOR}.{MINOR} is not spoken here"))
                || why.contains("no controller elected yet"),
            "{why}"
        );
        anyhow::ensure!(Instant::now() < deadline, "still: {why}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    produce_everywhere(&c, topic, partitions, 10).await?;
    // Cut off: broker 3's replicas got none of the new records.
    for p in 0..partitions {
        // (Refused by the metadata leader too, it cannot even catch up its
        // metadata and open its replicas: it says so.)
        let s = status(&c, 3, topic, p).await?;
        let catching_up = s.error.as_ref().is_some_and(|e| e.message.contains("metadata is catching up"));
        assert!(catching_up || s.high_watermark <= 10, "broker 3 partition {p} while cut off: {s:?}");
    }

    // Rolled back to this build's version, broker 3 catches up with what it missed.
    c.kill(3);
    c.clear_env(3);
    c.spawn(3)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    for p in 0..partitions {
        loop {
            let s = status(&c, 3, topic, p).await;
            if s.as_ref().is_ok_and(|s| s.error.is_none() && s.high_watermark == 20) {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "broker 3 partition {p} did not catch up: {s:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

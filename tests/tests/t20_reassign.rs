//! Partition reassignment under live traffic (issue 11, tests 1–3): a
//! partition on three of four brokers moves to another three while an
//! idempotent producer writes to it. New replicas join as learners, one
//! joint-consensus change makes the target the voters, and the replica left
//! out deletes its data. Every acknowledged record is read back once, in
//! order, from the new replicas. The move completes when the controller's
//! leader is SIGKILLed in the middle of it, and a cancelled move goes back
//! to the original replicas without losing anything.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferrolog_client::admin::ReassignmentRequest;
use ferrolog_client::{Admin, ClientConfig, MetadataCache};
use ferrolog_proto::client::{
    AlterPartitionReassignmentsRequest, ErrorCode, PartitionInfo, ReassignablePartition,
};
use ferrolog_tests::load::{Acks, check_partition, produce_loop};
use ferrolog_tests::raw::{code, create_topic, init_producer_id, leader, status};
use ferrolog_tests::{Cluster, connect, metadata};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");

/// Partition 0 of "t" as any running broker's metadata shows it, and the
/// controller's broker id.
async fn partition_info(c: &Cluster) -> anyhow::Result<(PartitionInfo, u32)> {
    for id in (1..=c.size()).filter(|id| c.is_running(*id)) {
        let Ok(m) = metadata(c.broker(id).client_addr).await else { continue };
        if let Some(p) = m.topics.iter().find(|t| t.name == "t").and_then(|t| t.partitions.first()) {
            return Ok((p.clone(), m.controller));
        }
    }
    anyhow::bail!("no broker describes t-0")
}

/// Asks for partition 0 of "t" to move to `replicas` (or, if `None`, for
/// its move to be cancelled), through the client library, which retries
/// while the controller fails over; `via` is the bootstrap broker.
async fn reassign(c: &Cluster, via: u32, replicas: Option<&[u32]>) -> anyhow::Result<()> {
    let meta = MetadataCache::new(ClientConfig::from_list(&c.broker(via).client_addr.to_string()))?;
    let admin = Admin::new(meta).with_timeout(Duration::from_secs(30));
    let change =
        ReassignmentRequest { topic: "t".into(), partition: 0, replicas: replicas.map(<[u32]>::to_vec) };
    let results = admin.alter_partition_reassignments(&[change]).await?;
    anyhow::ensure!(results.len() == 1, "{} results for one partition", results.len());
    Ok(results.into_iter().next().unwrap_or(Ok(()))?)
}

/// Partition 0 of "t" once a running broker's metadata shows a
/// reassignment under way (brokers apply the controller's records each at
/// its own pace: the one asked may not have yet).
async fn reassigning(c: &Cluster) -> anyhow::Result<PartitionInfo> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (p, _) = partition_info(c).await?;
        if p.reassigning {
            return Ok(p);
        }
        anyhow::ensure!(Instant::now() < deadline, "no reassignment under way after 10 s: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until partition 0 of "t" has no reassignment under way and its
/// replicas are `want`, up to `within`.
async fn moved(c: &Cluster, want: &[u32], within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok((p, _)) = partition_info(c).await
            && !p.reassigning
            && p.replicas == want
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "t-0 did not reach replicas {want:?} within {within:?}: {:?}\n{}",
            partition_info(c).await.ok(),
            c.logs_tail(60)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until broker `id` holds no replica directory of t-0 (or does).
async fn replica_dir_is(c: &Cluster, id: u32, present: bool, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    while c.replica_dirs(id, "t-0.").is_empty() == present {
        anyhow::ensure!(
            Instant::now() < deadline,
            "broker {id}: replica directory of t-0 {} after {within:?}\n{}",
            if present { "never appeared" } else { "still there" },
            c.logs_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Waits until the leader of t-0 reports broker `id`'s replica as a
/// learner (the move is in its catch-up phase).
async fn learner_on(c: &Cluster, id: u32, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let l = leader(c, "t", 0, Duration::from_secs(30)).await?;
        if let Ok(s) = status(c, l, "t", 0).await
            && s.followers.iter().any(|f| f.broker_id == id && f.learner)
        {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "broker {id} never became a learner\n{}", c.logs_tail(40));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A 4-broker cluster with topic "t" (1 partition, replication factor `rf`)
/// under a steady idempotent load; returns the cluster, the replicas, the
/// broker without one, and the load's handles.
async fn loaded(name: &str, rf: u32) -> anyhow::Result<(Cluster, Vec<u32>, u32, Load)> {
    let c = Cluster::start(name, BIN, 4, &[]).await?;
    create_topic(&c, "t", 1, rf).await?;
    leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let (p, _) = partition_info(&c).await?;
    let spare = (1..=4).find(|b| !p.replicas.contains(b)).expect("one broker has no replica");
    let addrs: Vec<SocketAddr> = (1..=4).map(|id| c.broker(id).client_addr).collect();
    let load = Load::start(addrs).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok((c, p.replicas, spare, load))
}

/// The producer of the load.
struct Load {
    stop: Arc<AtomicBool>,
    acks: Arc<Mutex<Acks>>,
    task: JoinHandle<()>,
}

impl Load {
    async fn start(addrs: Vec<SocketAddr>) -> anyhow::Result<Self> {
        let pid = init_producer_id(addrs[0]).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let acks = Arc::new(Mutex::new(Acks::default()));
        let task = tokio::spawn(produce_loop(addrs, "t".into(), 0, pid, stop.clone(), acks.clone()));
        Ok(Self { stop, acks, task })
    }

    async fn acked(&self) -> usize {
        self.acks.lock().await.offsets.len()
    }

    /// Stops the producer and checks every acknowledged record.
    async fn finish(self, c: &Cluster) -> anyhow::Result<usize> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?;
        let checked = check_partition(c, "t", 0, &*self.acks.lock().await).await?;
        anyhow::ensure!(checked > 50, "only {checked} acknowledged records: the load was too light");
        Ok(checked)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_moves_to_a_new_broker_under_load() -> anyhow::Result<()> {
    let (c, old, spare, load) = loaded("reassign", 3).await?;
    // Drop the leader's replica, add the spare: the leader hands over first.
    let leaving = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let target: Vec<u32> = old.iter().copied().filter(|b| *b != leaving).chain([spare]).collect();
    let before = load.acked().await;
    reassign(&c, leaving, Some(&target)).await?;
    // The metadata shows the move: all four host the partition.
    let during = reassigning(&c).await?;
    assert_eq!(during.replicas.len(), 4, "{during:?}");
    moved(&c, &target, Duration::from_secs(60)).await?;
    let after = load.acked().await;
    assert!(after > before, "no write was acknowledged during the move");
    replica_dir_is(&c, leaving, false, Duration::from_secs(30)).await?;
    assert!(!c.replica_dirs(spare, "t-0.").is_empty(), "the new replica has no directory");
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    assert!(target.contains(&l), "broker {l} leads, not one of the target {target:?}");
    let log = std::fs::read_to_string(&c.broker(leaving).log)?;
    assert!(
        log.contains("this replica leaves the group: handed its leadership over first"),
        "broker {leaving} led t-0 and was dropped, but did not hand over first"
    );
    let s = status(&c, l, "t", 0).await?;
    let mut members: Vec<u32> = s.followers.iter().map(|f| f.broker_id).chain([l]).collect();
    members.sort_unstable();
    let mut want = target.clone();
    want.sort_unstable();
    assert_eq!(members, want, "the group's members are the target's");
    assert!(s.followers.iter().all(|f| !f.learner), "a learner is left: {:?}", s.followers);
    // Broker `leaving` now has no replica: it answers as for a partition it does not host.
    let on_old = status(&c, leaving, "t", 0).await?;
    assert_ne!(code(&on_old.error), ErrorCode::None, "broker {leaving} still serves t-0: {on_old:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let checked = load.finish(&c).await?;
    println!(
        "moved t-0 from {old:?} to {target:?}: {checked} acknowledged records read back once each, in order ({} during the move)",
        after - before
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_completes_when_the_controller_is_killed_in_the_middle() -> anyhow::Result<()> {
    // Replication factor 2 on 4 brokers: two spares, so the replica added
    // can be on a broker that is not the controller (the controller's
    // failover, not the learner's restart, is what is tested).
    let (mut c, old, _, load) = loaded("reassign-ctl", 2).await?;
    let (_, controller) = partition_info(&c).await?;
    assert_ne!(controller, 0, "no controller known");
    let new =
        (1..=4).find(|b| !old.contains(b) && *b != controller).expect("a spare that is not the controller");
    let target = vec![old[1], new];
    reassign(&c, old[1], Some(&target)).await?;
    learner_on(&c, new, Duration::from_secs(30)).await?;
    c.kill(controller);
    println!(
        "killed the controller, broker {controller}, with broker {new} learning t-0 (moving from {old:?})"
    );
    // A killed replica of the partition (the group has two voters) comes
    // back after a while; the move waits for it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.spawn(controller)?;
    moved(&c, &target, Duration::from_secs(90)).await?;
    replica_dir_is(&c, old[0], false, Duration::from_secs(60)).await?;
    let (_, now) = partition_info(&c).await?;
    println!("controller now: broker {now}");
    let checked = load.finish(&c).await?;
    println!("moved t-0 to {target:?} across the controller's death: {checked} acknowledged records intact");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_move_goes_back_without_loss() -> anyhow::Result<()> {
    let (mut c, old, spare, load) = loaded("reassign-cancel", 3).await?;
    // The new replica's broker is down: the move cannot get past catch-up.
    c.kill(spare);
    let target = vec![old[1], old[2], spare];
    reassign(&c, old[1], Some(&target)).await?;
    let during = reassigning(&c).await?;
    assert_eq!(during.adding_replicas, [spare], "{during:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (still, _) = partition_info(&c).await?;
    assert!(still.reassigning, "the move completed without its new replica: {still:?}");
    // A second move meanwhile is refused with Kafka's code.
    let again = AlterPartitionReassignmentsRequest {
        partitions: vec![ReassignablePartition {
            topic: "t".into(),
            partition: 0,
            replicas: old.clone(),
            cancel: false,
        }],
    };
    let r =
        connect(c.broker(old[1]).client_addr).await?.alter_partition_reassignments(again).await?.into_inner();
    assert_eq!(code(&r.results[0].error), ErrorCode::ReassignmentInProgress, "{r:?}");
    // The leader has added the new replica as a learner (its broker down).
    learner_on(&c, spare, Duration::from_secs(30)).await?;
    reassign(&c, old[2], None).await?;
    moved(&c, &old, Duration::from_secs(60)).await?;
    c.spawn(spare)?;
    // Its broker back, the replica the cancelled move placed there is not kept.
    tokio::time::sleep(Duration::from_secs(3)).await;
    replica_dir_is(&c, spare, false, Duration::from_secs(30)).await?;
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let s = status(&c, l, "t", 0).await?;
    assert!(
        s.followers.iter().all(|f| f.broker_id != spare),
        "broker {spare} is still a member of the group: {:?}",
        s.followers
    );
    let checked = load.finish(&c).await?;
    println!(
        "cancelled the move of t-0 to {target:?}: back on {old:?}, {checked} acknowledged records intact"
    );
    Ok(())
}

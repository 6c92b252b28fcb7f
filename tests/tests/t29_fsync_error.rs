//! An fsync that fails with EIO under a real broker process (issue 15):
//! the partition leader's disk (the in-memory disk over FUSE of
//! [`ferrolog_tests::fuse_disk`]) keeps taking writes but fails every
//! fsync, and, as Linux does since the "fsyncgate" discussion (2018), the
//! writes a failed fsync covered never reach the disk though reads still
//! see them. A broker that retried the fsync and trusted those writes
//! would count them durable; the power cut of the whole cluster at the
//! end would then lose acknowledged records.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferrolog_proto::client::ReplicaState;
use ferrolog_raft_store::vfs::{Faults, PowerCut};
use ferrolog_tests::fuse_disk::DiskCluster;
use ferrolog_tests::raw::{
    Sent, caught_up, create_topic, init_producer_id, produce_to_leader, read_partition, status,
};
use ferrolog_tests::{Cluster, metadata};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const TOPIC: &str = "t";

/// The leader of partition 0 that broker `id` names (0: none; `None` if it
/// does not answer).
async fn leader_named_by(c: &Cluster, id: u32) -> Option<u32> {
    let m = metadata(c.broker(id).client_addr).await.ok()?;
    m.topics.iter().find(|t| t.name == TOPIC)?.partitions.first().map(|p| p.leader)
}

/// Polls `check` every 100 ms until it gives a value, for at most `secs`.
async fn wait_for<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    secs: u64,
    mut check: impl FnMut() -> F,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        anyhow::ensure!(Instant::now() < deadline, "{what}: not within {secs} s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// EIO on every fsync at the leader of a partition under load: its
/// replica stops and says why, every broker names a leader elsewhere and
/// produces go on there; once the disk's fsync works again the replica
/// comes back by itself and catches up. Then the whole cluster loses
/// power: every acknowledged record is there once, in order, and every
/// replica catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eio_on_fsync_at_the_leader_moves_it_and_loses_no_acknowledged_record() -> anyhow::Result<()> {
    let mut rig = DiskCluster::prepare("fsynceio", BIN, 3, &[])?;
    let DiskCluster { disks, cluster: c } = &mut rig;
    c.launch().await?;
    create_topic(c, TOPIC, 1, 3).await?;
    let addrs: Vec<SocketAddr> = c.brokers.iter().map(|b| b.client_addr).collect();
    let pid = init_producer_id(addrs[0]).await?;
    let (stop, total) = (AtomicBool::new(false), AtomicUsize::new(0));
    let producing = async {
        let mut acked = Vec::new();
        let mut seq = 0;
        while !stop.load(Ordering::Relaxed) {
            let value = format!("v{seq}");
            match produce_to_leader(&addrs, TOPIC, (0, pid, seq), &value, Duration::from_secs(60)).await? {
                Sent::Acked => acked.push(value),
                Sent::OutOfOrder(e) => anyhow::bail!("acknowledged batches lost: {e}"),
            }
            total.fetch_add(1, Ordering::Relaxed);
            seq += 1;
        }
        anyhow::Ok(acked)
    };
    let script = async {
        let result = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let failing =
                wait_for("a leader", 30, || async { leader_named_by(c, 1).await.filter(|l| *l != 0) })
                    .await?;
            let disk = &disks[failing as usize - 1];
            disk.set_faults(Faults { eio_on_sync: true, ..Faults::default() });
            let failed_at = total.load(Ordering::Relaxed);
            // Every broker, the failing one too, names another leader.
            wait_for("every broker naming a leader other than the failing one", 30, || async {
                let mut named = Vec::new();
                for id in 1..=3 {
                    named.push(leader_named_by(c, id).await);
                }
                named.iter().all(|l| l.is_some_and(|l| l != 0 && l != failing)).then_some(())
            })
            .await?;
            // The failing broker says why its replica is out of service.
            let detail = wait_for("the failing broker reporting its replica failed", 30, || async {
                let s = status(c, failing, TOPIC, 0).await.ok()?;
                (s.replica_state == ReplicaState::Failed as i32).then_some(s.replica_detail)
            })
            .await?;
            anyhow::ensure!(
                detail.contains("Input/output error"),
                "the failure must name the error: {detail}"
            );
            // Load at the new leader, then the disk heals.
            let moved_at = total.load(Ordering::Relaxed);
            wait_for("produces acknowledged at the new leader", 30, || async {
                (total.load(Ordering::Relaxed) >= moved_at + 20).then_some(())
            })
            .await?;
            let injected = disk.stats().injected_errors;
            disk.set_faults(Faults::default());
            wait_for("the failed replica back, running and caught up", 60, || async {
                let l = leader_named_by(c, 1).await.filter(|l| *l != 0)?;
                let want = status(c, l, TOPIC, 0).await.ok()?.last_log_index;
                let s = status(c, failing, TOPIC, 0).await.ok()?;
                (s.replica_state == ReplicaState::Running as i32 && s.last_log_index >= want).then_some(())
            })
            .await?;
            eprintln!(
                "broker {failing}'s fsyncs failed after {failed_at} records ({injected} EIO answers): \
                 replica failed with {detail:?}; it returned once the disk healed"
            );
            anyhow::ensure!(injected > 0, "no fsync failed: the test injected nothing");
            // The whole cluster loses power: what any replica counted
            // durable must be.
            tokio::time::sleep(Duration::from_secs(1)).await;
            for id in 1..=3 {
                c.kill(id);
            }
            for d in disks.iter() {
                d.power_cut(PowerCut::Torn);
            }
            for id in 1..=3 {
                c.spawn(id)?;
            }
            let cut_at = total.load(Ordering::Relaxed);
            wait_for("produces acknowledged after the power cut", 60, || async {
                (total.load(Ordering::Relaxed) >= cut_at + 20).then_some(())
            })
            .await?;
            anyhow::Ok(())
        }
        .await;
        stop.store(true, Ordering::Relaxed);
        result
    };
    let (acked, scripted) = tokio::join!(producing, script);
    if let Err(e) = scripted.as_ref().map(|_| ()).and(acked.as_ref().map(|_| ())) {
        anyhow::bail!("{e:#}\n{}", c.logs_tail(60));
    }
    let acked = acked?;
    let l = wait_for("a leader at the end", 30, || async { leader_named_by(c, 1).await.filter(|l| *l != 0) })
        .await?;
    assert_eq!(read_partition(c.broker(l).client_addr, TOPIC, 0).await?, acked);
    for id in 1..=3 {
        caught_up(c, TOPIC, id, 1).await?;
    }
    drop(rig);
    Ok(())
}

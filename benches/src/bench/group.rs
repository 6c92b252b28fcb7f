//! Consumer groups (issue 13): how long a group takes to consume again the
//! partitions of a member that died, and how fast a group of three reads a
//! topic beside one consumer alone.
//!
//! - Rebalance: three members (the client library's `GroupConsumer`,
//!   in-process) read a 6-partition topic that a producer writes to all
//!   the time; a member is killed (its task aborted: no LeaveGroup, no more
//!   heartbeats, as a process killed by SIGKILL), and the run measures the
//!   time from the kill until every partition it owned has a record read
//!   by another member. A new member then joins, and the next round starts
//!   once the group owns every partition again. Prints p50 and max over
//!   `--kills` rounds, with the session timeout they are bound by.
//! - Throughput: `--records` records of `--record-bytes` written first,
//!   then read from the start by one member alone (its own group) and by a
//!   group of three (another group): records/s and MB/s of each, from the
//!   first record read to the moment every partition had been read to its
//!   end by some member (the join, with the brokers' initial rebalance
//!   delay of 500 ms here, and the members' leaving are not counted; a
//!   record read again after a rebalance is not counted twice).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use ferrolog_client::assignor::Assignor;
use ferrolog_client::{
    Admin, AutoOffsetReset, ClientConfig, GroupConsumer, GroupConsumerConfig, MetadataCache, Producer,
    ProducerConfig, Record,
};

use crate::cluster;

/// Flags of `group`.
#[derive(Args, Debug)]
pub struct GroupArgs {
    /// Members killed, one per round.
    #[arg(long, default_value_t = 10)]
    kills: usize,
    /// The members' session timeout, ms (the brokers take 1,000 and up here).
    #[arg(long, default_value_t = 6_000)]
    session_timeout_ms: u32,
    /// Records written before the throughput runs.
    #[arg(long, default_value_t = 1_000_000)]
    records: usize,
    /// Their value size, bytes.
    #[arg(long, default_value_t = 100)]
    record_bytes: usize,
    /// The assignor: range, roundrobin or cooperative-sticky.
    #[arg(long, default_value = "range")]
    assignor: String,
}

const PARTITIONS: u32 = 6;

/// What the members tell the bench: who owns what, and when each member
/// last read from each partition.
#[derive(Default)]
struct Board {
    owned: HashMap<usize, Vec<u32>>,
    last_read: HashMap<(usize, u32), Instant>,
}

fn member(
    meta: Arc<MetadataCache>,
    group: &str,
    topic: &str,
    session_ms: u32,
    assignor: Assignor,
) -> anyhow::Result<GroupConsumer> {
    let mut config = GroupConsumerConfig::new(group);
    config.session_timeout_ms = session_ms;
    config.heartbeat_interval_ms = (session_ms / 6).max(100);
    config.assignors = vec![assignor];
    config.auto_offset_reset = AutoOffsetReset::Earliest;
    config.auto_commit_interval_ms = 1_000;
    Ok(GroupConsumer::new(meta, config, &[topic])?)
}

/// Runs a member that reports to `board` as member `n`, until aborted.
fn spawn_member(mut m: GroupConsumer, n: usize, board: Arc<Mutex<Board>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let Ok(records) = m.poll(Duration::from_millis(100)).await else { continue };
            let now = Instant::now();
            let mut b = board.lock().unwrap_or_else(|p| p.into_inner());
            for r in &records {
                b.last_read.insert((n, r.partition), now);
            }
            b.owned.insert(n, m.assignment().into_iter().map(|(_, p)| p).collect());
        }
    })
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Runs `group`.
///
/// # Errors
/// Cluster or client failures, or a group that does not recover within 60 s.
pub async fn run(a: GroupArgs) -> anyhow::Result<()> {
    let assignor = Assignor::from_name(&a.assignor).ok_or_else(|| {
        anyhow::anyhow!("unknown assignor {:?} (range, roundrobin, cooperative-sticky)", a.assignor)
    })?;
    let config = "[groups]\nmin_session_timeout_ms = 1000\ninitial_rebalance_delay_ms = 500\n";
    let (c, _config) = cluster::start_configured("bench-group", 3, config).await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta.clone());

    // Throughput: one member alone, then three, each its own group.
    admin.create_topic("bulk", PARTITIONS, 3).await?;
    admin.wait_for_leaders("bulk", Duration::from_secs(30)).await?;
    let producer = Producer::new(meta.clone(), ProducerConfig::default())?;
    let value = "x".repeat(a.record_bytes);
    let mut deliveries = Vec::with_capacity(a.records);
    for i in 0..a.records {
        deliveries.push(producer.send("bulk", Record::new(value.clone()).with_key(i.to_string())));
        if deliveries.len() >= 50_000 {
            for d in deliveries.drain(..) {
                d.await?;
            }
        }
    }
    for d in deliveries {
        d.await?;
    }
    producer.close().await;
    println!(
        "group: {} records of {} B in {PARTITIONS} partitions; session timeout {} ms; assignor {}",
        a.records, a.record_bytes, a.session_timeout_ms, a.assignor
    );
    println!(
        "| readers | seconds (first record read to every partition read to its end) | records/s | MB/s |\n|---|---|---|---|"
    );
    for (readers, group) in [(1usize, "solo"), (3, "trio")] {
        // Each partition's next offset to read, over all members: a record
        // read again after a rebalance is not counted twice.
        let next: Arc<Mutex<HashMap<u32, u64>>> = Arc::default();
        let first = Arc::new(std::sync::OnceLock::<Instant>::new());
        let last = Arc::new(std::sync::OnceLock::<Instant>::new());
        let mut tasks = Vec::new();
        for _ in 0..readers {
            let mut m = member(meta.clone(), group, "bulk", a.session_timeout_ms, assignor)?;
            let (next, first, last) = (next.clone(), first.clone(), last.clone());
            let total = a.records as u64;
            tasks.push(tokio::spawn(async move {
                while last.get().is_none() {
                    if let Ok(r) = m.poll(Duration::from_millis(100)).await
                        && !r.is_empty()
                    {
                        first.get_or_init(Instant::now);
                        let mut n = next.lock().unwrap_or_else(|p| p.into_inner());
                        for rec in &r {
                            let e = n.entry(rec.partition).or_insert(0);
                            *e = (*e).max(rec.offset + 1);
                        }
                        if n.values().sum::<u64>() >= total {
                            last.get_or_init(Instant::now);
                        }
                    }
                }
                let _ = m.close().await;
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(600), t).await??;
        }
        let (Some(first), Some(last)) = (first.get(), last.get()) else {
            anyhow::bail!("{group}: nothing read");
        };
        let s = last.duration_since(*first).as_secs_f64().max(1e-9);
        let n = a.records;
        println!(
            "| {readers} | {s:.3} | {:.0} | {:.2} |",
            n as f64 / s,
            (n * a.record_bytes) as f64 / s / 1e6
        );
    }

    // Rebalance after a member's death, under a steady producer.
    admin.create_topic("live", PARTITIONS, 3).await?;
    admin.wait_for_leaders("live", Duration::from_secs(30)).await?;
    let producer = Producer::new(meta.clone(), ProducerConfig::default())?;
    let writing = tokio::spawn(async move {
        let mut i = 0u64;
        loop {
            for p in 0..PARTITIONS {
                drop(producer.send("live", Record::new(i.to_string()).with_partition(p)));
                i += 1;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let board = Arc::new(Mutex::new(Board::default()));
    let mut members: HashMap<usize, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut next = 0usize;
    for _ in 0..3 {
        let m = member(meta.clone(), "live-readers", "live", a.session_timeout_ms, assignor)?;
        members.insert(next, spawn_member(m, next, board.clone()));
        next += 1;
    }
    let settled = |board: &Arc<Mutex<Board>>, live: &[usize]| {
        let b = board.lock().unwrap_or_else(|p| p.into_inner());
        let mut all: Vec<u32> =
            live.iter().flat_map(|n| b.owned.get(n).cloned().unwrap_or_default()).collect();
        all.sort_unstable();
        all == (0..PARTITIONS).collect::<Vec<_>>()
    };
    let mut took = Vec::new();
    for round in 0..a.kills {
        let live: Vec<usize> = members.keys().copied().collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !settled(&board, &live) {
            anyhow::ensure!(Instant::now() < deadline, "round {round}: the group did not settle within 60 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The member with the most partitions dies.
        let victim = {
            let b = board.lock().unwrap_or_else(|p| p.into_inner());
            *live.iter().max_by_key(|n| b.owned.get(n).map_or(0, Vec::len)).expect("members")
        };
        let orphans =
            board.lock().unwrap_or_else(|p| p.into_inner()).owned.remove(&victim).unwrap_or_default();
        members.remove(&victim).expect("a member").abort();
        let killed = Instant::now();
        let deadline = killed + Duration::from_secs(60);
        loop {
            let done = {
                let b = board.lock().unwrap_or_else(|p| p.into_inner());
                orphans
                    .iter()
                    .all(|p| b.last_read.iter().any(|((n, q), t)| q == p && *n != victim && *t > killed))
            };
            if done {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "round {round}: partitions {orphans:?} not read again within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        took.push(killed.elapsed());
        let m = member(meta.clone(), "live-readers", "live", a.session_timeout_ms, assignor)?;
        members.insert(next, spawn_member(m, next, board.clone()));
        next += 1;
    }
    writing.abort();
    for m in members.values() {
        m.abort();
    }
    took.sort();
    println!(
        "\nrebalance after a member's death (kill → its partitions read again), {} kills, session timeout {} ms: \
         p50 {:.2} s, max {:.2} s, min {:.2} s",
        took.len(),
        a.session_timeout_ms,
        percentile(&took, 0.5).as_secs_f64(),
        took.last().map_or(0.0, Duration::as_secs_f64),
        took.first().map_or(0.0, Duration::as_secs_f64),
    );
    Ok(())
}

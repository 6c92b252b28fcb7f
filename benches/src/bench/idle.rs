//! CPU of an idle cluster: create a topic with many partitions (replication
//! factor 3), wait until every partition has a leader and the cluster is
//! quiet, then measure the brokers' CPU time over a window.

use std::time::{Duration, Instant};

use clap::Args;
use ferrolog_client::{Admin, ClientConfig, MetadataCache};

use crate::cluster::{self, cpu_seconds, open_files, resident_bytes};

/// How long all partitions may take to elect their leaders.
const ELECTION_WAIT: Duration = Duration::from_secs(300);

/// Flags of `idle`.
#[derive(Args, Debug)]
pub struct IdleArgs {
    /// Partitions of the idle topic.
    #[arg(long, default_value_t = 1000)]
    partitions: u32,
    /// Measurement window, seconds.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Time to let the cluster settle after the leaders are elected, seconds.
    #[arg(long, default_value_t = 15)]
    settle_seconds: u64,
    /// The brokers' `raft.dormant_after_ms` (idle followers' Raft nodes
    /// stop after this long; 0: never); the broker's default if not given.
    #[arg(long)]
    dormant_after_ms: Option<u64>,
}

/// Runs the idle benchmark.
///
/// # Errors
/// Cluster start-up or topic creation failures.
pub async fn run(a: IdleArgs) -> anyhow::Result<()> {
    let (c, _config) = cluster::start_with_dormant("idle", a.dormant_after_ms).await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(120));
    let t0 = Instant::now();
    admin.create_topic("idle", a.partitions, 3).await?;
    // Progress every 10 s, so a slow election shows its shape.
    let mut next_report = Duration::from_secs(10);
    loop {
        let led = match meta.refresh().await {
            Ok(cluster) => cluster
                .topics
                .get("idle")
                .map_or(0, |t| t.partitions.iter().filter(|p| p.leader != 0).count()),
            Err(_) => 0,
        };
        if led == a.partitions as usize {
            break;
        }
        anyhow::ensure!(
            t0.elapsed() < ELECTION_WAIT,
            "only {led} of {} partitions have a leader after {ELECTION_WAIT:?}",
            a.partitions
        );
        if t0.elapsed() >= next_report {
            println!(
                "  {:>4.0} s: {led} of {} partitions have a leader",
                t0.elapsed().as_secs_f64(),
                a.partitions
            );
            next_report += Duration::from_secs(10);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "{} partitions x 3 replicas: all leaders elected in {:.1} s",
        a.partitions,
        t0.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(a.settle_seconds)).await;
    let pids: Vec<u32> = (1..=3).filter_map(|id| c.pid(id)).collect();
    let before: Vec<f64> = pids.iter().map(|p| cpu_seconds(*p).unwrap_or(0.0)).collect();
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.seconds)).await;
    let wall = start.elapsed().as_secs_f64();
    let mut total = 0.0;
    // Replication factor 3 on 3 brokers: every broker hosts every partition.
    let replicas = u64::from(a.partitions).max(1);
    for (i, p) in pids.iter().enumerate() {
        let used = cpu_seconds(*p).unwrap_or(0.0) - before[i];
        let rss = resident_bytes(*p).unwrap_or(0);
        let files = open_files(*p).unwrap_or(0);
        let id = i as u32 + 1;
        let dormant = match dormant_replicas(&c, id).await {
            Some(n) => n.to_string(),
            None => "?".into(),
        };
        println!(
            "broker {id} (pid {p}): {:.1}% of one core, {:.0} MiB resident ({:.0} KiB per replica, target <= 100), {files} open files ({:.2} per replica), {dormant} dormant replicas",
            100.0 * used / wall,
            rss as f64 / (1 << 20) as f64,
            rss as f64 / 1024.0 / replicas as f64,
            files as f64 / replicas as f64
        );
        total += used;
    }
    println!(
        "idle cluster, {} partitions, replication factor 3: {:.1}% of one core in total over {:.0} s (target <= 25%)",
        a.partitions,
        100.0 * total / wall,
        wall
    );
    Ok(())
}

/// How many of broker `id`'s replicas are dormant, as its `Metadata`
/// answer says of itself; `None` if it does not answer.
async fn dormant_replicas(c: &ferrolog_tests::Cluster, id: u32) -> Option<u64> {
    let mut client = ferrolog_tests::connect(c.broker(id).client_addr).await.ok()?;
    let answer = client.metadata(ferrolog_proto::client::MetadataRequest { topics: vec![] }).await.ok()?;
    answer.into_inner().brokers.iter().find(|b| b.id == id).map(|b| b.dormant_replicas)
}

//! Memory across topic churn: create a topic with many partitions
//! (replication factor 3), wait for its leaders, delete it, wait until
//! every broker has removed its replica directories, and print each
//! broker's resident memory (VmRSS), loop after loop. Memory of deleted
//! replicas should be given back, so RSS after each deletion should stay
//! near its level after the first one.

use std::time::{Duration, Instant};

use clap::Args;
use ferrolog_client::{Admin, ClientConfig, MetadataCache};
use ferrolog_tests::Cluster;

/// Flags of `churn`.
#[derive(Args, Debug)]
pub struct ChurnArgs {
    /// Partitions of the topic created and deleted each loop.
    #[arg(long, default_value_t = 500)]
    partitions: u32,
    /// Create/delete loops.
    #[arg(long, default_value_t = 4)]
    loops: u32,
    /// Time to let the brokers settle before each measurement, seconds.
    #[arg(long, default_value_t = 5)]
    settle_seconds: u64,
}

const TOPIC: &str = "churn";

fn rss_line(c: &Cluster) -> String {
    (1..=3)
        .map(|id| format!("broker {id} {:>7.1} MB", c.rss(id).unwrap_or(0) as f64 / 1e6))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs the churn benchmark.
///
/// # Errors
/// Cluster start-up, topic creation or deletion failures, or replica
/// directories left behind for 5 minutes.
pub async fn run(a: ChurnArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?.to_string_lossy().into_owned();
    // The reconciler logs, at info, what is still alive after it removed
    // the replicas of a deleted topic; the rest stays at warn.
    let env = [("RUST_LOG", "warn,ferrolog_broker::partitions=info")];
    let c = Cluster::start_with("churn", &exe, &["broker"], 3, &env).await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta).with_timeout(Duration::from_secs(120));
    let settle = Duration::from_secs(a.settle_seconds);
    tokio::time::sleep(settle).await;
    println!("before any topic: {}", rss_line(&c));
    for l in 1..=a.loops {
        let t0 = Instant::now();
        admin.create_topic(TOPIC, a.partitions, 3).await?;
        admin.wait_for_leaders(TOPIC, Duration::from_secs(300)).await?;
        let dirs: usize = (1..=3).map(|id| c.replica_dirs(id, &format!("{TOPIC}-")).len()).sum();
        println!(
            "loop {l}: {} partitions x 3 replicas ({dirs} replica directories) led in {:.1} s: {}",
            a.partitions,
            t0.elapsed().as_secs_f64(),
            rss_line(&c)
        );
        admin.delete_topic(TOPIC).await?;
        let deadline = Instant::now() + Duration::from_secs(300);
        while (1..=3).any(|id| !c.replica_dirs(id, &format!("{TOPIC}-")).is_empty()) {
            anyhow::ensure!(Instant::now() < deadline, "replica directories left after 300 s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(settle).await;
        println!("loop {l}: deleted: {}", rss_line(&c));
        for b in &c.brokers {
            let log = std::fs::read_to_string(&b.log).unwrap_or_default();
            if let Some(last) = log.lines().rev().find(|l| l.contains("replicas of deleted topics removed")) {
                let fields = last.split_once("topics removed").map_or(last, |(_, f)| f).trim();
                println!("  broker {} after removal: {fields}", b.id);
            }
        }
    }
    Ok(())
}

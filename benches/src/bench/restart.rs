//! One broker's restart in a cluster with many partitions (issue 9, item 8):
//! create a topic with `--partitions` partitions (replication factor 3),
//! wait until every partition has a leader, SIGKILL one broker and start it
//! again a second later, and measure until every partition has a leader
//! again: how long that took, how many partitions had none along the way,
//! how many elections it cost (the sum of the partitions' term increases),
//! how many partitions the restart disturbed although their leader was on
//! another broker, the brokers' CPU and log volume meanwhile, and finally
//! how long each broker takes to stop on SIGINT.

use std::time::{Duration, Instant};

use clap::Args;
use ferrolog_client::{Admin, ClientConfig, MetadataCache};
use ferrolog_tests::raw;

use crate::cluster::{self, cpu_seconds};

/// Flags of `restart`.
#[derive(Args, Debug)]
pub struct RestartArgs {
    /// Partitions of the topic.
    #[arg(long, default_value_t = 2000)]
    partitions: u32,
    /// The broker to SIGKILL and restart (1–3).
    #[arg(long, default_value_t = 2)]
    broker: u32,
    /// Seconds between the SIGKILL and the restart.
    #[arg(long, default_value_t = 1)]
    down_seconds: u64,
    /// Seconds to let the cluster settle after the first leaders.
    #[arg(long, default_value_t = 10)]
    settle_seconds: u64,
    /// Give up waiting for leaders after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout_seconds: u64,
    /// The brokers' `raft.dormant_after_ms` (idle followers' Raft nodes
    /// stop after this long; 0: never); the broker's default if not given.
    #[arg(long)]
    dormant_after_ms: Option<u64>,
}

const TOPIC: &str = "restart";

fn leaderless(leaders: &[Option<u32>]) -> usize {
    leaders.iter().filter(|l| l.is_none()).count()
}

fn cpu_of(c: &ferrolog_tests::Cluster, brokers: &[u32]) -> f64 {
    brokers.iter().filter_map(|id| c.pid(*id)).filter_map(cpu_seconds).sum()
}

/// Runs the restart benchmark.
///
/// # Errors
/// Cluster start-up or topic creation failures, or partitions still
/// without a leader after `--timeout-seconds`.
pub async fn run(a: RestartArgs) -> anyhow::Result<()> {
    anyhow::ensure!((1..=3).contains(&a.broker), "--broker must be 1, 2 or 3");
    let (mut c, _config) = cluster::start_with_dormant("restart", a.dormant_after_ms).await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta).with_timeout(Duration::from_secs(120));
    let t = Instant::now();
    admin.create_topic(TOPIC, a.partitions, 3).await?;
    admin.wait_for_leaders(TOPIC, Duration::from_secs(a.timeout_seconds)).await?;
    println!(
        "{} partitions x 3 replicas: all leaders elected in {:.1} s",
        a.partitions,
        t.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(a.settle_seconds)).await;

    let before = raw::self_claimed_leaders(&c, TOPIC).await?;
    let survivor = if a.broker == 1 { 2 } else { 1 };
    let terms_before = raw::terms(&c, survivor, TOPIC, a.partitions).await?;
    let led_by_victim = before.iter().filter(|l| **l == Some(a.broker)).count();
    println!(
        "before: {} leaderless; broker {} leads {led_by_victim} partitions",
        leaderless(&before),
        a.broker
    );

    // CPU of the two brokers that keep running, plus the restarted one's own.
    let survivors: Vec<u32> = (1..=3).filter(|id| *id != a.broker).collect();
    let cpu0: Vec<f64> = survivors.iter().map(|id| cpu_of(&c, &[*id])).collect();
    let logs0: u64 = (1..=3).map(|id| c.log_bytes(id)).sum();
    let killed = Instant::now();
    c.kill(a.broker);
    tokio::time::sleep(Duration::from_secs(a.down_seconds)).await;
    c.spawn(a.broker)?;
    let restarted = Instant::now();
    // Poll until no partition has lacked a leader for STABLE on end.
    const STABLE: Duration = Duration::from_secs(5);
    let mut marks = vec![(3u64, None), (10, None), (30, None)];
    let mut worst = 0usize;
    let mut last_leaderless: Option<Duration> = None;
    let deadline = restarted + Duration::from_secs(a.timeout_seconds);
    let after = loop {
        let now = raw::self_claimed_leaders(&c, TOPIC).await?;
        let missing = leaderless(&now);
        worst = worst.max(missing);
        let since = restarted.elapsed();
        for (s, seen) in &mut marks {
            if seen.is_none() && since >= Duration::from_secs(*s) {
                *seen = Some(missing);
            }
        }
        if missing > 0 {
            last_leaderless = Some(since);
        }
        let quiet_since = last_leaderless.unwrap_or(Duration::ZERO);
        if missing == 0 && since >= quiet_since + STABLE {
            break now;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{missing} partitions still without a leader {:.0} s after the restart",
            since.as_secs_f64()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // Per broker: the survivors' since the kill, the restarted one's own.
    let mut cpu_each: Vec<(u32, f64)> =
        survivors.iter().zip(&cpu0).map(|(id, before)| (*id, cpu_of(&c, &[*id]) - before)).collect();
    cpu_each.push((a.broker, cpu_of(&c, &[a.broker])));
    let cpu_used: f64 = cpu_each.iter().map(|(_, s)| s).sum();
    let wall = killed.elapsed().as_secs_f64();
    let logs = (1..=3).map(|id| c.log_bytes(id)).sum::<u64>() - logs0;
    let terms_after = raw::terms(&c, survivor, TOPIC, a.partitions).await?;
    let raw::RestartCost { elections, disturbed, max_term, .. } =
        raw::restart_cost(&before, &terms_before, &terms_after, a.broker);
    match last_leaderless {
        Some(t) => println!(
            "SIGKILL broker {}, restart {} s later: every partition led again within {:.1} s of the restart",
            a.broker,
            a.down_seconds,
            t.as_secs_f64() + 0.25
        ),
        None => println!(
            "SIGKILL broker {}, restart {} s later: no partition was seen without a leader after the restart",
            a.broker, a.down_seconds
        ),
    }
    let mark = |m: &Option<usize>| m.map_or("-".to_owned(), |n| n.to_string());
    println!(
        "leaderless partitions: at most {worst}; 3 s after the restart {}, 10 s {}, 30 s {}",
        mark(&marks[0].1),
        mark(&marks[1].1),
        mark(&marks[2].1)
    );
    println!(
        "elections (sum of term increases): {elections} for {led_by_victim} partitions the broker led; \
         {disturbed} partitions led elsewhere changed term; highest term {max_term}; \
         now {} leaderless, {} led by broker {}",
        leaderless(&after),
        after.iter().filter(|l| **l == Some(a.broker)).count(),
        a.broker
    );
    println!(
        "meanwhile ({wall:.1} s): CPU {:.1} core-seconds ({:.0}% of the machine's 2 cores), logs grew {:.1} KB",
        cpu_used,
        100.0 * cpu_used / wall / 2.0,
        logs as f64 / 1e3
    );
    let each: Vec<String> = cpu_each.iter().map(|(id, s)| format!("broker {id} {s:.1}")).collect();
    println!(
        "CPU per broker (core-seconds): {} (the restarted one's from its start: opening its replicas included)",
        each.join(", ")
    );
    for id in 1..=3 {
        match c.interrupt(id, Duration::from_secs(30)) {
            Some(d) => println!("broker {id} stopped {:.2} s after SIGINT", d.as_secs_f64()),
            None => println!("broker {id} did NOT stop within 30 s of SIGINT (killed)"),
        }
    }
    Ok(())
}

//! Failover as a producer sees it (issue 11): the client library's
//! idempotent producer writes one record at a time to a 1-partition,
//! replication-factor-3 topic; the partition's leader gets SIGKILL (or
//! SIGTERM: a controlled shutdown), and the run measures, at the client,
//! the time from the signal to the acknowledgement of the first write sent
//! after it, and
//! the longest pause between two acknowledgements around it. The stopped
//! broker is started again and caught up before the next round. Prints
//! p50 and max over `--rounds` rounds of each kind.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use ferrolog_client::{Admin, ClientConfig, MetadataCache, Producer, ProducerConfig, Record};
use ferrolog_tests::raw;
use tokio::sync::Mutex;

use crate::cluster;

/// Flags of `failover`.
#[derive(Args, Debug)]
pub struct FailoverArgs {
    /// Rounds of each kind (SIGKILL, then SIGTERM).
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Seconds of steady writes before each signal.
    #[arg(long, default_value_t = 1)]
    steady_seconds: u64,
}

const TOPIC: &str = "failover";

/// One round's figures: from the signal to the first acknowledgement after
/// it, and the longest time without one from the last before the signal
/// until 5 s after it.
#[derive(Clone, Copy, Debug)]
struct Round {
    first_ack: Duration,
    longest_pause: Duration,
}

async fn round(
    c: &mut ferrolog_tests::Cluster,
    acks: &Arc<Mutex<Vec<(Instant, Instant)>>>,
    kill: bool,
) -> anyhow::Result<(Round, u32)> {
    let leader = raw::leader(c, TOPIC, 0, Duration::from_secs(30)).await?;
    let signalled = Instant::now();
    if kill {
        c.kill(leader);
    } else {
        // `terminate` waits for the process with sleeps: off the runtime's workers.
        let stopped = tokio::task::block_in_place(|| c.terminate(leader, Duration::from_secs(30)));
        anyhow::ensure!(stopped.is_some(), "broker {leader} did not stop within 30 s of SIGTERM");
    }
    let deadline = signalled + Duration::from_secs(60);
    // The first write sent after the signal (one the old leader had
    // committed before it died says nothing about the failover).
    let first = loop {
        if let Some((_, t)) = acks.lock().await.iter().copied().find(|(sent, _)| *sent > signalled) {
            break t;
        }
        anyhow::ensure!(Instant::now() < deadline, "no write acknowledged within 60 s of the signal");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    tokio::time::sleep((signalled + Duration::from_secs(5)).saturating_duration_since(Instant::now())).await;
    let window_end = signalled + Duration::from_secs(5);
    let longest_pause = {
        let a = acks.lock().await;
        let mut last = a.iter().map(|(_, t)| *t).rfind(|t| *t <= signalled).unwrap_or(signalled);
        let mut longest = Duration::ZERO;
        for t in a.iter().map(|(_, t)| *t).filter(|t| *t > signalled && *t <= window_end) {
            longest = longest.max(t - last);
            last = t;
        }
        longest.max(window_end.saturating_duration_since(last))
    };
    c.spawn(leader)?;
    raw::caught_up(c, TOPIC, leader, 1).await?;
    Ok((Round { first_ack: first - signalled, longest_pause }, leader))
}

fn quantiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (v.get(v.len() / 2).map_or(0.0, |d| ms(*d)), v.last().map_or(0.0, |d| ms(*d)))
}

/// Runs the failover benchmark.
///
/// # Errors
/// Cluster start-up, a write refused, or no write acknowledged within 60 s
/// of a signal.
pub async fn run(a: FailoverArgs) -> anyhow::Result<()> {
    let mut c = cluster::start("failover").await?;
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(60));
    admin.create_topic(TOPIC, 1, 3).await?;
    admin.wait_for_leaders(TOPIC, Duration::from_secs(60)).await?;
    let producer = Producer::new(meta, ProducerConfig { linger_ms: 0, ..ProducerConfig::default() })?;
    // (sent, acknowledged) of every write, in order.
    let acks: Arc<Mutex<Vec<(Instant, Instant)>>> = Arc::default();
    let writer = {
        let acks = acks.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            loop {
                let sent = Instant::now();
                producer.send(TOPIC, Record::new(format!("record {n}").into_bytes())).await?;
                acks.lock().await.push((sent, Instant::now()));
                n += 1;
            }
            #[allow(unreachable_code)]
            Ok::<(), ferrolog_client::Error>(())
        })
    };
    println!("1 partition x 3 replicas; one record in flight; {} rounds of each kind", a.rounds);
    let mut results: Vec<(bool, Round)> = Vec::new();
    for kill in [true, false] {
        for i in 0..a.rounds {
            tokio::time::sleep(Duration::from_secs(a.steady_seconds)).await;
            anyhow::ensure!(!writer.is_finished(), "the producer stopped: {:?}", writer.await);
            let (r, leader) = round(&mut c, &acks, kill).await?;
            println!(
                "{} {:>2}: leader broker {leader}: first acknowledgement {:>6.1} ms after the signal, longest pause {:>6.1} ms",
                if kill { "SIGKILL" } else { "SIGTERM" },
                i + 1,
                r.first_ack.as_secs_f64() * 1e3,
                r.longest_pause.as_secs_f64() * 1e3
            );
            results.push((kill, r));
        }
    }
    writer.abort();
    for kill in [true, false] {
        let of = |f: fn(&Round) -> Duration| {
            results.iter().filter(|(k, _)| *k == kill).map(|(_, r)| f(r)).collect()
        };
        let (p50, max) = quantiles(of(|r| r.first_ack));
        let (pause50, pause_max) = quantiles(of(|r| r.longest_pause));
        println!(
            "{}: first acknowledgement after the signal p50 {p50:.0} ms, max {max:.0} ms; longest pause p50 {pause50:.0} ms, max {pause_max:.0} ms",
            if kill { "SIGKILL of the leader" } else { "SIGTERM of the leader (controlled shutdown)" }
        );
    }
    println!("acknowledged writes in all: {}", acks.lock().await.len());
    Ok(())
}

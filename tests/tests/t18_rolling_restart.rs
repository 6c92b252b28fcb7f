//! A rolling restart under a steady produce load (issue 11, test 4): each
//! broker in turn gets SIGTERM, hands every leadership it holds to a
//! caught-up follower (controlled shutdown), exits, and is started again.
//! Every leadership moves by hand-over and none by an election after a
//! timeout: the partitions' terms rise by exactly the number of hand-overs
//! the brokers report. No acknowledged record is lost or duplicated. The
//! same rolling restart with SIGKILL follows, and the longest gap between
//! acknowledgements of each is printed side by side.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferrolog_tests::Cluster;
use ferrolog_tests::load::{Acks, check_partition, produce_loop};
use ferrolog_tests::raw::{caught_up, create_topic, init_producer_id, leader, self_claimed_leaders};
use tokio::sync::Mutex;

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const PARTITIONS: u32 = 6;

/// Every partition's highest term, as any running broker sees it.
async fn terms(c: &Cluster) -> anyhow::Result<Vec<u64>> {
    let mut out = vec![0u64; PARTITIONS as usize];
    for id in (1..=c.size()).filter(|id| c.is_running(*id)) {
        for (i, t) in ferrolog_tests::raw::terms(c, id, "t", PARTITIONS).await?.into_iter().enumerate() {
            out[i] = out[i].max(t.unwrap_or(0));
        }
    }
    Ok(out)
}

/// The numbers of broker `id`'s last "leaderships handed over" log line:
/// (partitions handed over, left, no live follower).
fn last_drain_report(c: &Cluster, id: u32) -> Option<(u64, u64, u64)> {
    let log = std::fs::read_to_string(&c.broker(id).log).ok()?;
    let line = log.lines().rev().find(|l| l.contains("controlled shutdown: leaderships handed over"))?;
    let field = |name: &str| -> Option<u64> {
        let at = line.find(&format!(" {name}="))? + name.len() + 2;
        line[at..].split(|ch: char| !ch.is_ascii_digit()).next()?.parse().ok()
    };
    Some((field("handed_over")?, field("left")?, field("no_live_follower")?))
}

/// The longest time between two acknowledgements of one partition within
/// `from..to`.
async fn longest_gap(acks: &[Arc<Mutex<Acks>>], from: Instant, to: Instant) -> Duration {
    let mut gap = Duration::ZERO;
    for a in acks {
        let a = a.lock().await;
        let mut last = from;
        for t in a.at.iter().copied().filter(|t| *t >= from && *t <= to) {
            gap = gap.max(t - last);
            last = t;
        }
        gap = gap.max(to.saturating_duration_since(last));
    }
    gap
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_with_sigterm_hands_every_leadership_over() -> anyhow::Result<()> {
    // Balancing off: only the shutdowns move leaderships here.
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    std::fs::write(&config, "[balance]\nauto_leader_rebalance_enable = false\n")?;
    let config = config.to_string_lossy().into_owned();
    let mut c = Cluster::start("rolling", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    create_topic(&c, "t", PARTITIONS, 3).await?;
    for p in 0..PARTITIONS {
        leader(&c, "t", p, Duration::from_secs(30)).await?;
    }
    let addrs: Vec<SocketAddr> = (1..=3).map(|id| c.broker(id).client_addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let mut acks = Vec::new();
    let mut producers = Vec::new();
    for p in 0..PARTITIONS {
        let a = Arc::new(Mutex::new(Acks::default()));
        let pid = init_producer_id(addrs[0]).await?;
        producers.push(tokio::spawn(produce_loop(
            addrs.clone(),
            "t".into(),
            p,
            pid,
            stop.clone(),
            a.clone(),
        )));
        acks.push(a);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    // SIGTERM, one broker at a time.
    let terms_before = terms(&c).await?;
    let sigterm_from = Instant::now();
    let mut handed_over = 0u64;
    for id in 1..=3 {
        let led = self_claimed_leaders(&c, "t").await?.iter().filter(|l| **l == Some(id)).count() as u64;
        let took = c.terminate(id, Duration::from_secs(40));
        assert!(
            took.is_some(),
            "broker {id} did not stop within 40 s of SIGTERM (controlled shutdown may take 30 s)\n{}",
            c.logs_tail(40)
        );
        let (moved, left, no_target) =
            last_drain_report(&c, id).expect("the broker logs what its hand-overs came to");
        println!(
            "broker {id}: led {led}, handed {moved} over, {left} left, {no_target} without a live follower; stopped {:.2} s after SIGTERM",
            took.unwrap_or_default().as_secs_f64()
        );
        assert_eq!((left, no_target), (0, 0), "broker {id} left leaderships behind\n{}", c.logs_tail(40));
        assert_eq!(moved, led, "broker {id} handed over other than the {led} partitions it led");
        handed_over += moved;
        c.spawn(id)?;
        caught_up(&c, "t", id, PARTITIONS).await?;
    }
    let sigterm_to = Instant::now();
    let terms_after = terms(&c).await?;
    let elections: u64 = terms_before.iter().zip(&terms_after).map(|(b, a)| a.saturating_sub(*b)).sum();
    println!("SIGTERM rolling restart: {handed_over} hand-overs, terms rose by {elections} in all");
    // Every broker led partitions at its turn: at least one each.
    assert!(handed_over >= 3, "only {handed_over} leaderships moved: the test saw too little");
    assert_eq!(
        elections,
        handed_over,
        "terms rose by {elections} for {handed_over} hand-overs: some leadership moved by an election\nbefore {terms_before:?}\nafter {terms_after:?}\n{}",
        c.logs_tail(60)
    );

    // The same with SIGKILL, for comparison.
    let sigkill_from = Instant::now();
    for id in 1..=3 {
        c.kill(id);
        for p in 0..PARTITIONS {
            leader(&c, "t", p, Duration::from_secs(30)).await?;
        }
        c.spawn(id)?;
        caught_up(&c, "t", id, PARTITIONS).await?;
    }
    let sigkill_to = Instant::now();
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        p.await?;
    }
    let gap_term = longest_gap(&acks, sigterm_from, sigterm_to).await;
    let gap_kill = longest_gap(&acks, sigkill_from, sigkill_to).await;
    println!(
        "longest gap between acknowledgements of a partition: {} ms with SIGTERM (controlled shutdown), {} ms with SIGKILL",
        gap_term.as_millis(),
        gap_kill.as_millis()
    );

    // Every acknowledged record is there once, at its offset, in order.
    let mut checked = 0usize;
    for (p, a) in acks.iter().enumerate() {
        checked += check_partition(&c, "t", p as u32, &*a.lock().await).await?;
    }
    assert!(checked > 100, "only {checked} acknowledged records: the load was too light to show anything");
    println!("{checked} acknowledged records read back once each, in order");
    Ok(())
}

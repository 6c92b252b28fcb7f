//! A rolling restart under a steady produce load (issue 11, test 4): each
//! broker in turn gets SIGTERM, hands every leadership it holds to a
//! caught-up follower (controlled shutdown), exits, and is started again.
//! Every leadership moves by hand-over and none by an election after a
//! timeout: the partitions' terms rise by exactly the number of hand-overs
//! the brokers report. No acknowledged record is lost or duplicated. The
//! same rolling restart with SIGKILL follows, and the longest gap between
//! acknowledgements of each is printed side by side.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferrolog_proto::client::{ErrorCode, FetchRequest};
use ferrolog_tests::raw::{
    batch, caught_up, code, create_topic, init_producer_id, leader, self_claimed_leaders, values,
};
use ferrolog_tests::{Cluster, connect};
use tokio::sync::Mutex;

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const PARTITIONS: u32 = 6;

/// What one partition's producer saw: acknowledged sequence numbers with
/// their offsets, and when each acknowledgement came.
#[derive(Debug, Default)]
struct Acks {
    offsets: BTreeMap<i32, u64>,
    at: Vec<Instant>,
}

/// Produces `p-<seq>` to partition `p` with idempotent producer `pid`, one
/// record at a time, trying brokers in turn until one acknowledges, until
/// `stop`.
async fn produce_loop(
    addrs: Vec<SocketAddr>,
    p: u32,
    pid: i64,
    stop: Arc<AtomicBool>,
    acks: Arc<Mutex<Acks>>,
) {
    let mut to = 0usize;
    let mut seq = 0i32;
    let mut clients = BTreeMap::new();
    while !stop.load(Ordering::Relaxed) {
        let mut req = batch("t", pid, seq, &format!("{p}-{seq}"));
        req.partition = p;
        let addr = addrs[to % addrs.len()];
        if !clients.contains_key(&addr)
            && let Ok(c) = connect(addr).await
        {
            clients.insert(addr, c);
        }
        let answer = match clients.get_mut(&addr) {
            Some(c) => c.produce(req).await.map(tonic::Response::into_inner).map_err(|e| e.to_string()),
            None => Err("connect".into()),
        };
        match answer {
            Ok(r) if r.error.is_none() => {
                let mut a = acks.lock().await;
                a.offsets.insert(seq, r.base_offset);
                a.at.push(Instant::now());
                seq += 1;
            }
            Ok(r)
                if matches!(
                    code(&r.error),
                    ErrorCode::NotLeader
                        | ErrorCode::Unavailable
                        | ErrorCode::DuplicateInFlight
                        | ErrorCode::UnknownTopic
                ) =>
            {
                to += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok(r) => panic!("partition {p}: produce refused: {:?}", r.error),
            Err(_) => {
                clients.remove(&addr);
                to += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

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
        producers.push(tokio::spawn(produce_loop(addrs.clone(), p, pid, stop.clone(), a.clone())));
        acks.push(a);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    // SIGTERM, one broker at a time.
    let terms_before = terms(&c).await?;
    let sigterm_from = Instant::now();
    let mut handed_over = 0u64;
    for id in 1..=3 {
        let led = self_claimed_leaders(&c, "t").await?.iter().filter(|l| **l == Some(id)).count() as u64;
        let took = c.terminate(id, Duration::from_secs(20));
        assert!(took.is_some(), "broker {id} did not stop within 20 s of SIGTERM\n{}", c.logs_tail(40));
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
        let a = a.lock().await;
        let l = leader(&c, "t", p as u32, Duration::from_secs(30)).await?;
        let mut client = connect(c.broker(l).client_addr).await?;
        let mut read = Vec::new();
        loop {
            let f = client
                .fetch(FetchRequest {
                    topic: "t".into(),
                    partition: p as u32,
                    offset: read.len() as u64,
                    max_bytes: 1 << 20,
                    max_wait_ms: 0,
                    ..Default::default()
                })
                .await?
                .into_inner();
            anyhow::ensure!(f.error.is_none(), "fetch partition {p}: {:?}", f.error);
            let v = values(&f)?;
            if v.is_empty() || read.len() as u64 + v.len() as u64 >= f.high_watermark {
                read.extend(v);
                break;
            }
            read.extend(v);
        }
        let expected: Vec<String> = (0..read.len()).map(|i| format!("{p}-{i}")).collect();
        assert_eq!(read, expected, "partition {p}: records lost, duplicated or out of order");
        for (seq, offset) in &a.offsets {
            assert_eq!(
                read.get(*offset as usize),
                Some(&format!("{p}-{seq}")),
                "partition {p}: acknowledged {seq}"
            );
            checked += 1;
        }
    }
    assert!(checked > 100, "only {checked} acknowledged records: the load was too light to show anything");
    println!("{checked} acknowledged records read back once each, in order");
    Ok(())
}

//! `flush = interval` and one replica losing power (issue 9, item 9): a
//! replica loses its unsynced tail (the leader, or a follower), the other
//! up-to-date replica is killed, and the one that lagged comes back. The
//! replica that lost its tail must
//! not help the lagging one win an election (together they are a majority
//! without the acknowledged records); once the intact replica returns, the
//! most up-to-date log of all voters is elected (KIP-966's unclean
//! recovery) and every acknowledged record is there.

use std::fs::{self, OpenOptions};
use std::path::PathBuf;
use std::time::Duration;

use ferrolog_proto::client::ProduceRequest;
use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{create_topic, leader, produce, read_values, record, self_claimed_leaders, status};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
/// Nothing is fsynced in the test's time: what a power cut keeps is what
/// the test leaves of the files.
const CONFIG: &str = "[storage]\nflush = { policy = \"interval\", interval_ms = 600000 }\n";

fn req(value: &str) -> ProduceRequest {
    ProduceRequest {
        topic: "t".into(),
        partition: 0,
        records: vec![record("k", value)],
        producer_id: -1,
        ..ProduceRequest::default()
    }
}

fn active_segment(c: &Cluster, id: u32) -> anyhow::Result<PathBuf> {
    let mut segs = Vec::new();
    for e in fs::read_dir(c.data_dir(id).join("partitions"))? {
        let log = e?.path().join("replica").join("log");
        if !log.is_dir() {
            continue;
        }
        for f in fs::read_dir(&log)? {
            let p = f?.path();
            if p.extension().is_some_and(|x| x == "seg") {
                segs.push(p);
            }
        }
    }
    segs.sort();
    segs.pop().ok_or_else(|| anyhow::anyhow!("broker {id} has no segment"))
}

fn signal(c: &Cluster, id: u32, sig: i32) -> anyhow::Result<()> {
    let pid = c.pid(id).ok_or_else(|| anyhow::anyhow!("broker {id} is not running"))?;
    // SAFETY: kill(2) with a pid of our own child and a valid signal number.
    let r = unsafe { libc::kill(pid as i32, sig) };
    anyhow::ensure!(r == 0, "kill({pid}, {sig}) failed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_losing_its_unsynced_tail_loses_no_acknowledged_record() -> anyhow::Result<()> {
    scenario("interval-loss", true).await
}

/// The replica that loses its tail is a follower: it restarts with its
/// persisted vote for the (now dead) leader and that leader's entries in
/// its log, which once let it count as brought back at once, vote, and
/// elect the lagging replica without the 50 acknowledged records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_losing_its_unsynced_tail_loses_no_acknowledged_record() -> anyhow::Result<()> {
    scenario("interval-loss-follower", false).await
}

/// Runs the scenario with the replica that loses power being the leader
/// (`tail_loser_leads`) or a follower.
async fn scenario(name: &str, tail_loser_leads: bool) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    fs::write(&config, CONFIG)?;
    let config = config.to_string_lossy().into_owned();
    let mut c = Cluster::start(name, BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    create_topic(&c, "t", 1, 3).await?;
    let mut written = Vec::new();
    for i in 0..5 {
        let v = format!("early-{i}");
        produce(&c, req(&v), Duration::from_secs(30)).await?;
        written.push(v);
    }
    // Roles from the broker that says it leads (not the metadata, which
    // may lag behind an election).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let current = loop {
        if let Some(Some(b)) = self_claimed_leaders(&c, "t").await?.first() {
            break *b;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "no broker claims partition 0");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let followers: Vec<u32> = (1..=3).filter(|b| *b != current).collect();
    // `l` loses its unsynced tail, `intact` keeps everything, `lagging`
    // misses the 50 records.
    let (l, intact, lagging) = if tail_loser_leads {
        (current, followers[0], followers[1])
    } else {
        (followers[0], current, followers[1])
    };
    // Both followers hold the early records before one is paused.
    for _ in 0..100 {
        let want = status(&c, current, "t", 0).await?.last_log_index;
        if status(&c, lagging, "t", 0).await?.last_log_index == want
            && status(&c, followers[0], "t", 0).await?.last_log_index == want
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    signal(&c, lagging, libc::SIGSTOP)?;
    let seg = active_segment(&c, l)?;
    let synced_len = fs::metadata(&seg)?.len();
    for i in 0..50 {
        let v = format!("acked-{i}");
        produce(&c, req(&v), Duration::from_secs(30)).await?;
        written.push(v);
    }
    assert!(fs::metadata(&seg)?.len() > synced_len, "the 50 records did not reach broker {l}'s segment");

    // Broker `l` loses power: its segment goes back to what was on disk
    // before the 50 records. The intact replica is killed, the lagging one
    // resumes, `l` comes back.
    c.kill(l);
    OpenOptions::new().write(true).open(&seg)?.set_len(synced_len)?;
    c.kill(intact);
    signal(&c, lagging, libc::SIGCONT)?;
    c.spawn(l)?;

    // The two of them must not elect a leader without the 50 records.
    let refused = produce(&c, req("must-not-be-stored"), Duration::from_secs(8)).await;
    assert!(
        refused.is_err(),
        "a write was accepted by a leader elected by the replica that lost its tail and the lagging one\n{}",
        c.logs_tail(30)
    );

    // The intact replica returns: its log, the most up-to-date, is elected.
    c.spawn(intact)?;
    for i in 0..5 {
        let v = format!("after-{i}");
        produce(&c, req(&v), Duration::from_secs(60)).await?;
        written.push(v);
    }
    let now = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let values = read_values(c.broker(now).client_addr, "t").await?;
    assert_eq!(values, written, "acknowledged records lost or reordered (leader {now})");
    let log = fs::read_to_string(&c.broker(l).log)?;
    assert!(
        log.contains("stopped uncleanly under flush = interval"),
        "the replica that lost power was not held back"
    );
    // The intact replica was killed too, so it was recovering as well: the
    // election went through the vote floor of every voter's log.
    let all_logs: String =
        (1..=3).map(|b| fs::read_to_string(&c.broker(b).log).unwrap_or_default()).collect();
    assert!(all_logs.contains("KIP-966 unclean recovery"), "no vote floor was set\n{}", c.logs_tail(20));
    Ok(())
}

//! `flush = interval` and one replica losing power (issue 9, item 9): the
//! leader loses its unsynced tail, the other up-to-date replica is killed,
//! and the one that lagged comes back. The replica that lost its tail must
//! not help the lagging one win an election (together they are a majority
//! without the acknowledged records); once the intact replica returns, the
//! most up-to-date log of all voters is elected (KIP-966's unclean
//! recovery) and every acknowledged record is there.

use std::fs::{self, OpenOptions};
use std::path::PathBuf;
use std::time::Duration;

use ferrolog_proto::client::ProduceRequest;
use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{create_topic, leader, produce, read_values, record, status};

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
async fn one_replica_losing_its_unsynced_tail_loses_no_acknowledged_record() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    fs::write(&config, CONFIG)?;
    let config = config.to_string_lossy().into_owned();
    let mut c = Cluster::start("interval-loss", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    create_topic(&c, "t", 1, 3).await?;
    let mut written = Vec::new();
    for i in 0..5 {
        let v = format!("early-{i}");
        produce(&c, req(&v), Duration::from_secs(30)).await?;
        written.push(v);
    }
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let others: Vec<u32> = (1..=3).filter(|b| *b != l).collect();
    let (intact, lagging) = (others[0], others[1]);
    // Both followers hold the early records before one is paused.
    for _ in 0..100 {
        let want = status(&c, l, "t", 0).await?.last_log_index;
        if status(&c, lagging, "t", 0).await?.last_log_index == want
            && status(&c, intact, "t", 0).await?.last_log_index == want
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
    assert!(fs::metadata(&seg)?.len() > synced_len, "the 50 records did not reach the leader's segment");

    // The leader loses power: its segment goes back to what was on disk
    // before the 50 records. The intact replica is killed, the lagging one
    // resumes, the leader comes back.
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
        "the leader that lost power was not held back"
    );
    // The intact replica was killed too, so it was recovering as well: the
    // election went through the vote floor of every voter's log.
    let all_logs: String =
        (1..=3).map(|b| fs::read_to_string(&c.broker(b).log).unwrap_or_default()).collect();
    assert!(all_logs.contains("KIP-966 unclean recovery"), "no vote floor was set\n{}", c.logs_tail(20));
    Ok(())
}

//! Damaged replicas come back by themselves (issue 9, item 1): a follower
//! whose segment files were cut, bit-flipped or lost while it was down
//! keeps its valid prefix, fetches the rest from the leader and is back at
//! lag 0; while it may lack acknowledged records it does not vote, so it
//! never helps elect a leader without them; a replica that cannot start is
//! reported as failed, never with lag 0.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferrolog_client::admin::ReplicaHealth;
use ferrolog_client::{Admin, ClientConfig, MetadataCache};
use ferrolog_proto::client::{ProduceRequest, ReplicaState};
use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{create_topic, leader, produce, read_values, record, status};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
/// Small segments, so a few dozen records span several segment files.
const CONFIG: &str = "[storage]\nsegment_bytes = 4096\nindex_interval_bytes = 256\n";

/// [`CONFIG`] with the background scrub off: these tests show what reads
/// and restarts find, which a scrub pass must not find first.
fn config_file(dir: &Path) -> anyhow::Result<String> {
    config_file_with(dir, "[scrub]\ninterval_ms = 0\n")
}

/// [`CONFIG`] and `more`, as a config file in `dir`.
fn config_file_with(dir: &Path, more: &str) -> anyhow::Result<String> {
    let path = dir.join("broker.toml");
    fs::write(&path, format!("{CONFIG}{more}"))?;
    Ok(path.to_string_lossy().into_owned())
}

async fn write(c: &Cluster, tag: &str, n: usize) -> anyhow::Result<Vec<String>> {
    let mut values = Vec::new();
    for i in 0..n {
        let value = format!("{tag}-{i:04}-{}", "x".repeat(60));
        let req = ProduceRequest {
            topic: "t".into(),
            partition: 0,
            records: vec![record("k", &value)],
            producer_id: -1,
            ..ProduceRequest::default()
        };
        produce(c, req, Duration::from_secs(30)).await?;
        values.push(value);
    }
    Ok(values)
}

/// The segment files of broker `id`'s replica of `t`-0, in log order.
fn segments(c: &Cluster, id: u32) -> anyhow::Result<Vec<PathBuf>> {
    let root = c.data_dir(id).join("partitions");
    let mut out = Vec::new();
    for e in fs::read_dir(&root)? {
        let log = e?.path().join("replica").join("log");
        if log.is_dir() {
            for f in fs::read_dir(&log)? {
                let p = f?.path();
                if p.extension().is_some_and(|x| x == "seg") {
                    out.push(p);
                }
            }
        }
    }
    out.sort();
    anyhow::ensure!(!out.is_empty(), "broker {id} has no segment of t-0 under {}", root.display());
    Ok(out)
}

fn cut_end(path: &Path, bytes: u64) -> anyhow::Result<()> {
    let f = OpenOptions::new().write(true).open(path)?;
    let len = f.metadata()?.len();
    f.set_len(len - bytes)?;
    Ok(())
}

fn flip_byte(path: &Path, position: u64) -> anyhow::Result<()> {
    let f = OpenOptions::new().read(true).write(true).open(path)?;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, position)?;
    f.write_all_at(&[b[0] ^ 0x5a], position)?;
    Ok(())
}

/// Waits until broker `id`'s replica of `t`-0 runs (not recovering) with
/// the leader's last log index and high watermark.
async fn back_in_sync(c: &Cluster, id: u32, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < deadline {
        let l = leader(c, "t", 0, Duration::from_secs(30)).await?;
        if let (Ok(want), Ok(got)) = (status(c, l, "t", 0).await, status(c, id, "t", 0).await) {
            if got.replica_state == ReplicaState::Running as i32
                && got.last_log_index == want.last_log_index
                && got.high_watermark == want.high_watermark
                && want.high_watermark > 0
            {
                return Ok(());
            }
            last = format!(
                "state {:?} ({}), log {} / {}, high watermark {} / {}",
                got.replica_state(),
                got.replica_detail,
                got.last_log_index,
                want.last_log_index,
                got.high_watermark,
                want.high_watermark
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("{what}: broker {id} not back in sync after 60 s: {last}\n{}", c.logs_tail(30))
}

/// The values broker `id` holds for `t`-0, read from its stopped data
/// directory with `ferrolog-broker dump-log`.
fn dumped_values(c: &Cluster, id: u32) -> anyhow::Result<Vec<String>> {
    let out =
        std::process::Command::new(BIN).arg("dump-log").arg("--data-dir").arg(c.data_dir(id)).output()?;
    anyhow::ensure!(out.status.success(), "dump-log: {}", String::from_utf8_lossy(&out.stderr));
    let mut values = Vec::new();
    for line in String::from_utf8(out.stdout)?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        if v["topic"] == "t"
            && let Some(s) = v["value"].as_str()
        {
            values.push(s.to_owned());
        }
    }
    Ok(values)
}

/// One more record after a follower restarted, so each kind of damage is
/// also followed by an append the repaired follower must take. (Catching
/// up with no write at all is shown by
/// `an_idle_partitions_torn_follower_catches_up_with_no_write`.)
async fn wake(c: &Cluster) -> anyhow::Result<Vec<String>> {
    write(c, "wake", 1).await
}

/// A 1-partition topic `t` of 80 records (several sealed segments with
/// [`CONFIG`]), every follower in sync: the records written, the leader
/// and one follower.
async fn sealed_segments_on_every_replica(c: &Cluster) -> anyhow::Result<(Vec<String>, u32, u32)> {
    create_topic(c, "t", 1, 3).await?;
    let written = write(c, "a", 80).await?;
    let l = leader(c, "t", 0, Duration::from_secs(30)).await?;
    let f = (1..=3).find(|b| *b != l).expect("a follower");
    for b in (1..=3).filter(|b| *b != l) {
        back_in_sync(c, b, "before any damage").await?;
    }
    Ok((written, l, f))
}

/// Every replica in sync, then stopped: each broker's dumped copy of `t`
/// is exactly `written`.
async fn copies_end_identical(c: &mut Cluster, written: &[String]) -> anyhow::Result<()> {
    for b in 1..=3 {
        back_in_sync(c, b, "at the end").await?;
    }
    for b in 1..=3 {
        c.kill(b);
    }
    for b in 1..=3 {
        assert_eq!(dumped_values(c, b)?, written, "broker {b}'s copy differs from what was acknowledged");
    }
    Ok(())
}

fn count(log: &Path, needle: &str) -> usize {
    fs::read_to_string(log).unwrap_or_default().matches(needle).count()
}

/// Issue 9's own case, with nothing written after the damage: one record,
/// a follower stopped and the last 10 bytes of its only segment cut off (a
/// torn last entry), the follower started again. The partition stays idle
/// (its leader's heartbeats are parked), yet the follower gets the record
/// back: the leader wakes when the follower's broker returns with its
/// replicas open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_partitions_torn_follower_catches_up_with_no_write() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = config_file(dir.path())?;
    let mut c = Cluster::start("damaged-idle", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    create_topic(&c, "t", 1, 3).await?;
    let written = write(&c, "a", 1).await?;
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let f = (1..=3).find(|b| *b != l).expect("a follower");
    back_in_sync(&c, f, "before the damage").await?;
    c.kill(f);
    assert_eq!(dumped_values(&c, f)?, written, "the follower had the record before the cut");
    let segs = segments(&c, f)?;
    assert_eq!(segs.len(), 1, "{segs:?}");
    cut_end(&segs[0], 10)?;
    // The cut took the record: otherwise this test would show nothing.
    assert!(
        dumped_values(&c, f).map_or(true, |v| v.is_empty()),
        "the record is still in the follower's log after the cut"
    );
    c.spawn(f)?;
    back_in_sync(&c, f, "torn last entry, idle partition").await?;
    c.kill(f);
    assert_eq!(dumped_values(&c, f)?, written, "the follower did not get the record back");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_follower_keeps_its_valid_prefix_and_catches_up() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = config_file(dir.path())?;
    let mut c = Cluster::start("damaged", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    create_topic(&c, "t", 1, 3).await?;
    let mut written = write(&c, "a", 1).await?;
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let f = (1..=3).find(|b| *b != l).expect("a follower");
    back_in_sync(&c, f, "before any damage").await?;

    // 1. The last 10 bytes of its only segment cut off (a torn last entry):
    // its recorded commit index is past the end of what is left.
    c.kill(f);
    let segs = segments(&c, f)?;
    assert_eq!(segs.len(), 1, "{segs:?}");
    cut_end(&segs[0], 10)?;
    c.spawn(f)?;
    written.extend(wake(&c).await?);
    back_in_sync(&c, f, "torn last entry").await?;

    // 2. A byte flipped in the middle of a segment, valid entries after it.
    written.extend(write(&c, "b", 30).await?);
    back_in_sync(&c, f, "after more writes").await?;
    c.kill(f);
    let segs = segments(&c, f)?;
    let victim = segs.last().expect("segment");
    let len = fs::metadata(victim)?.len();
    flip_byte(victim, len / 2)?;
    c.spawn(f)?;
    written.extend(wake(&c).await?);
    back_in_sync(&c, f, "flipped byte").await?;

    // 3. A sealed segment lost, and 4. one cut in half.
    written.extend(write(&c, "c", 60).await?);
    back_in_sync(&c, f, "after more writes").await?;
    c.kill(f);
    let segs = segments(&c, f)?;
    assert!(segs.len() >= 4, "want several segments: {segs:?}");
    fs::remove_file(&segs[1])?;
    c.spawn(f)?;
    written.extend(wake(&c).await?);
    back_in_sync(&c, f, "missing segment").await?;
    written.extend(write(&c, "d", 60).await?);
    back_in_sync(&c, f, "after more writes").await?;
    c.kill(f);
    let segs = segments(&c, f)?;
    assert!(segs.len() >= 3, "want several segments: {segs:?}");
    let half = fs::metadata(&segs[1])?.len() / 2;
    cut_end(&segs[1], half)?;
    c.spawn(f)?;
    written.extend(wake(&c).await?);
    back_in_sync(&c, f, "segment cut in half").await?;

    // The damage was found, set aside and recovered from, each time it
    // could have cost acknowledged entries (kinds 2-4).
    let log = &c.broker(f).log;
    assert!(count(log, "damaged log: keeping its valid prefix") >= 3, "{}", c.logs_tail(40));
    assert!(count(log, "replica recovered") >= 3, "{}", c.logs_tail(40));

    // Every acknowledged record, once, in order, on the leader and on the
    // repaired follower's disk.
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    assert_eq!(read_values(c.broker(l).client_addr, "t").await?, written);
    c.kill(f);
    assert_eq!(dumped_values(&c, f)?, written, "the repaired follower's log differs from the leader's");

    // A replica that cannot start (its metadata file destroyed) is reported
    // as failed, with no lag, and retried.
    let meta = segments(&c, f)?[0].with_file_name("meta.redb");
    fs::write(&meta, b"not a database")?;
    c.spawn(f)?;
    let admin = Admin::new(MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = admin.cluster_status().await?;
        let p = s.partitions.iter().find(|p| p.topic == "t").expect("t-0 in status");
        if let Ok(st) = &p.status
            && let Some(fs) = st.followers.iter().find(|x| x.broker_id == f)
            && let ReplicaHealth::Failed(why) = &fs.state
        {
            assert_eq!(fs.lag, None, "a failed replica has no lag");
            // Until the restarted broker's metadata has caught up it may
            // fail the question for another reason.
            if why.contains("meta.redb") {
                break;
            }
        }
        assert!(Instant::now() < deadline, "broker {f}'s replica not reported failed: {p:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Ok(())
}

/// Broker `keep` has every record; `behind` missed the last ones; `damaged`
/// had them all but loses most of its log. With `keep` down, `damaged` must
/// not vote for `behind`: together they would elect a leader without the
/// records only `keep` and `damaged` acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovering_replica_does_not_vote() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = config_file(dir.path())?;
    let mut c = Cluster::start("recovering-vote", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    create_topic(&c, "t", 1, 3).await?;
    let mut written = write(&c, "a", 5).await?;
    let keep = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let others: Vec<u32> = (1..=3).filter(|b| *b != keep).collect();
    let (damaged, behind) = (others[0], others[1]);
    back_in_sync(&c, behind, "before the writes it misses").await?;

    c.kill(behind);
    written.extend(write(&c, "b", 20).await?);
    back_in_sync(&c, damaged, "before it is damaged").await?;
    c.kill(keep);
    c.kill(damaged);
    // Damage the damaged broker's log early: its valid prefix is shorter
    // than what `behind` holds, so `behind`'s log looks up to date to it.
    let segs = segments(&c, damaged)?;
    flip_byte(&segs[0], 200)?;

    c.spawn(damaged)?;
    c.spawn(behind)?;
    // `behind` campaigns; `damaged` refuses; neither can be elected: neither
    // says it leads. (What a restarted replica names as leader may be stale:
    // openraft restores the last leader it knew from its persisted vote, and
    // a pre-vote that fails changes no term; it may be `keep` or `damaged`.)
    let mut answers = 0;
    for _ in 0..25 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        for b in [damaged, behind] {
            if let Ok(s) = status(&c, b, "t", 0).await {
                answers += 1;
                assert!(
                    s.leader != b,
                    "broker {b} leads without the acknowledged records (it names leader {})\n{}",
                    s.leader,
                    c.logs_tail(40)
                );
            }
        }
    }
    assert!(answers > 0, "no broker answered for the partition");
    assert!(
        count(&c.broker(damaged).log, "replica recovering") > 0,
        "the damaged replica was not held back\n{}",
        c.logs_tail(30)
    );

    // With `keep` back, it leads, and nothing acknowledged is lost.
    c.spawn(keep)?;
    back_in_sync(&c, damaged, "after the intact replica returned").await?;
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    assert_eq!(read_values(c.broker(l).client_addr, "t").await?, written);
    Ok(())
}

/// Makes broker `f` the leader of `t`-0 by killing the others in turn:
/// the leader is killed; if `f` is not elected, the killed broker comes
/// back, catches up, and the new leader is killed next. Returns the broker
/// killed last, left down (so `f` leads with one other replica).
async fn lead_by_killing_others(c: &mut Cluster, f: u32) -> anyhow::Result<u32> {
    for _round in 0..12 {
        let x = leader(c, "t", 0, Duration::from_secs(30)).await?;
        anyhow::ensure!(x != f, "broker {f} already leads: nobody to kill");
        c.kill(x);
        let y = leader(c, "t", 0, Duration::from_secs(30)).await?;
        if y == f {
            return Ok(x);
        }
        c.spawn(x)?;
        back_in_sync(c, x, "a killed leader back").await?;
    }
    anyhow::bail!("broker {f} was not elected in 12 rounds of killing the leader\n{}", c.logs_tail(40))
}

/// Bit rot that nobody has read yet: a byte flipped in a sealed segment of
/// a running follower (it verified that segment when it wrote or opened
/// it, and checks it again only when it reads it), then that follower made
/// leader by killing the others in turn. Its first read of the damaged
/// range fails its CRC: the record is never served, the replica is
/// restarted with every segment verified, keeps its valid prefix, refuses
/// to vote until it has caught up from a healthy replica, and ends with
/// every acknowledged record; led by it again, it serves them all, and
/// every replica's copy is identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bit_rot_in_a_sealed_segment_of_a_follower_made_leader() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = config_file(dir.path())?;
    let mut c = Cluster::start("bit-rot-leader", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    let (mut written, _, f) = sealed_segments_on_every_replica(&c).await?;
    let segs = segments(&c, f)?;
    assert!(segs.len() >= 4, "want several sealed segments: {segs:?}");
    let victim = &segs[1];
    flip_byte(victim, fs::metadata(victim)?.len() / 2)?;
    written.extend(write(&c, "b", 5).await?);
    back_in_sync(&c, f, "with undetected bit rot").await?;
    assert_eq!(count(&c.broker(f).log, "damaged log"), 0, "the damage was found before any read");

    // Led by the damaged replica, a read from offset 0 crosses the flipped
    // byte: it fails, or (had the replica already repaired itself) returns
    // exactly what was written; never other data.
    let down = lead_by_killing_others(&mut c, f).await?;
    match read_values(c.broker(f).client_addr, "t").await {
        Ok(v) => assert_eq!(v, written, "the damaged leader served other data"),
        Err(e) => eprintln!("read from the damaged leader refused, as it should be: {e:#}"),
    }
    // The read itself reported the damage (not a Raft error elsewhere),
    // and the restart verified the log and kept its valid prefix.
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(&c.broker(f).log, "a read found the log damaged") == 0
        || count(&c.broker(f).log, "damaged log: keeping its valid prefix") == 0
    {
        assert!(
            Instant::now() < deadline,
            "the damage a read found did not make broker {f} verify and repair its log\n{}",
            c.logs_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The broker left down returns; the damaged replica is repaired.
    c.spawn(down)?;
    written.extend(wake(&c).await?);
    back_in_sync(&c, f, "after its damage was found").await?;
    assert!(count(&c.broker(f).log, "replica recovered") >= 1, "{}", c.logs_tail(40));

    // Led by it again, it serves every acknowledged record and takes writes.
    if leader(&c, "t", 0, Duration::from_secs(30)).await? != f {
        let down = lead_by_killing_others(&mut c, f).await?;
        c.spawn(down)?;
    }
    assert_eq!(read_values(c.broker(f).client_addr, "t").await?, written);
    written.extend(write(&c, "c", 5).await?);
    copies_end_identical(&mut c, &written).await
}

/// Bit rot in a sealed segment of a follower that no read touches (no
/// consumer reads a follower, and Raft reads a follower's log only once it
/// leads) is found by the background scrub (`[scrub]`, here a pass every
/// 300 ms), and the replica repairs itself from the leader as after damage
/// a read found: without any leader change or read, every replica's copy
/// ends identical to what was acknowledged. Without the scrub the damage
/// would stay latent until a second fault met it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrub_finds_bit_rot_nobody_reads_and_the_replica_repairs_itself() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = config_file_with(dir.path(), "[scrub]\ninterval_ms = 300\n")?;
    let mut c = Cluster::start("scrub", BIN, 3, &[("FERROLOG_CONFIG", &config)]).await?;
    let (mut written, l, f) = sealed_segments_on_every_replica(&c).await?;
    // Passes over the intact segments find nothing.
    let passes = count(&c.broker(f).log, "scrub pass done");
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(&c.broker(f).log, "scrub pass done") < passes + 2 {
        anyhow::ensure!(Instant::now() < deadline, "no scrub pass on broker {f}\n{}", c.logs_tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(count(&c.broker(f).log, "found the log damaged"), 0, "an intact log reported damaged");

    let segs = segments(&c, f)?;
    assert!(segs.len() >= 4, "want several sealed segments: {segs:?}");
    let victim = &segs[1];
    flip_byte(victim, fs::metadata(victim)?.len() / 2)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(&c.broker(f).log, "the scrub found the log damaged") == 0
        || count(&c.broker(f).log, "damaged log: keeping its valid prefix") == 0
    {
        assert!(
            Instant::now() < deadline,
            "the scrub did not find the flipped byte in {} on broker {f}\n{}",
            victim.display(),
            c.logs_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        leader(&c, "t", 0, Duration::from_secs(30)).await?,
        l,
        "the leader changed: not what this tests"
    );

    written.extend(wake(&c).await?);
    back_in_sync(&c, f, "after the scrub found its damage").await?;
    assert!(count(&c.broker(f).log, "replica recovered") >= 1, "{}", c.logs_tail(40));
    copies_end_identical(&mut c, &written).await
}

//! Log compaction on a 3-replica topic (issue 12): a changelog of 100,000
//! updates to 1,000 keys, then tombstones for 100 keys and new values for
//! 10 of those. Every replica, read from its stopped data directory with
//! `dump-log`, ends with the same records at the same offsets: each key's
//! latest record at the offset it was written at, nothing older. Tombstones
//! stay while `delete.retention.ms` has not passed and go once it has
//! (altered to 0); a broker wiped and rebuilt from a snapshot ends with the
//! same compacted log. A record without a key is refused `INVALID_RECORD`.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use ferrolog_proto::client::{AlterTopicConfigRequest, ErrorCode, ProduceRequest, Record};
use ferrolog_tests::raw::{code, create_topic_with_config, leader, produce, produce_once, record};
use ferrolog_tests::{Cluster, connect};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
/// Compaction checked every 300 ms (Kafka's cleaner backs off 15 s).
/// Snapshots every 200 entries, so a replica rebuilt after 1,500 more
/// entries gets one (Raft keeps 1,000 entries after a snapshot).
const CONFIG: &str = "[storage]\nindex_interval_bytes = 1024\n[compaction]\ncheck_interval_ms = 300\n[raft]\nsnapshot_after_entries = 200\n";
const KEYS: usize = 1000;
const UPDATES: usize = 100_000;
const PER_BATCH: usize = 1000;
/// Keys deleted (`k0000` .. `k0099`), and of those rewritten (`k0000` .. `k0009`).
const DELETED: usize = 100;
const REWRITTEN: usize = 10;

fn key(k: usize) -> String {
    format!("k{k:04}")
}

/// One record as a dump shows it: key, and value (`None`: a tombstone).
type Dumped = (String, Option<String>);

/// Every record broker `id` holds for `t`-0, by offset, from its stopped
/// data directory.
fn dumped(id: u32, dir: &Path) -> anyhow::Result<BTreeMap<u64, Dumped>> {
    let out = std::process::Command::new(BIN).arg("dump-log").arg("--data-dir").arg(dir).output()?;
    anyhow::ensure!(
        out.status.success(),
        "dump-log of broker {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut records = BTreeMap::new();
    for line in String::from_utf8(out.stdout)?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        if v["topic"] == "t" {
            let offset = v["offset"].as_u64().ok_or_else(|| anyhow::anyhow!("no offset: {line}"))?;
            let k = v["key"].as_str().ok_or_else(|| anyhow::anyhow!("no key: {line}"))?.to_owned();
            let value = v["value"].as_str().map(str::to_owned);
            anyhow::ensure!(records.insert(offset, (k, value)).is_none(), "offset {offset} twice: {line}");
        }
    }
    Ok(records)
}

/// Produces `records` to `t`-0 as one batch; returns its base offset.
async fn send(c: &Cluster, records: Vec<Record>) -> anyhow::Result<u64> {
    let req =
        ProduceRequest { topic: "t".into(), partition: 0, records, producer_id: -1, ..Default::default() };
    let (r, _) = produce(c, req, Duration::from_secs(30)).await?;
    anyhow::ensure!(r.error.is_none(), "produce: {:?}", r.error);
    Ok(r.base_offset)
}

/// What was written: every record by offset, and each key's latest offset.
#[derive(Default)]
struct Written {
    at: HashMap<u64, Dumped>,
    latest: HashMap<String, u64>,
}

impl Written {
    async fn send(&mut self, c: &Cluster, rows: Vec<(String, Option<String>)>) -> anyhow::Result<()> {
        let records = rows
            .iter()
            .map(|(k, v)| match v {
                Some(v) => record(k, v),
                None => {
                    Record { key: Some(k.clone().into_bytes().into()), null_value: true, ..Record::default() }
                }
            })
            .collect();
        let base = send(c, records).await?;
        for (i, row) in rows.into_iter().enumerate() {
            let o = base + i as u64;
            self.latest.insert(row.0.clone(), o);
            self.at.insert(o, row);
        }
        Ok(())
    }
}

/// The value of ` name=` in a log line, as a number.
fn field(line: &str, name: &str) -> Option<u64> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// Lines of broker `id`'s log after its first `since` bytes.
fn log_since(c: &Cluster, id: u32, since: u64) -> String {
    let text = fs::read(&c.broker(id).log).unwrap_or_default();
    String::from_utf8_lossy(text.get(since as usize..).unwrap_or_default()).into_owned()
}

/// Bytes of each broker's log so far.
fn log_marks(c: &Cluster) -> Vec<u64> {
    (1..=3).map(|id| fs::metadata(&c.broker(id).log).map_or(0, |m| m.len())).collect()
}

/// `(through, tombstones_below)` of a log line of topic `t`.
fn target_of(line: &str) -> Option<(u64, u64)> {
    if !line.contains("topic=t ") {
        return None;
    }
    Some((field(line, "through")?, field(line, "tombstones_below")?))
}

/// Waits, with the brokers running, until every broker logged a finished
/// compaction pass (after `marks`) to the latest target any leader decided,
/// that target is `wanted`, and no new target came for two checks; then
/// stops them all and reads each one's dump, which must be the same
/// everywhere and pass `done`. Returns that log and the target.
async fn converged(
    c: &mut Cluster,
    what: &str,
    marks: &[u64],
    wanted: impl Fn((u64, u64)) -> bool,
    done: impl Fn(&BTreeMap<u64, Dumped>) -> bool,
) -> anyhow::Result<(BTreeMap<u64, Dumped>, (u64, u64))> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut settled: Option<((u64, u64), Instant)> = None;
    loop {
        let decided = decided_target(c);
        let finished: Vec<Option<(u64, u64)>> = (1..=3)
            .map(|id| {
                log_since(c, id, marks[id as usize - 1])
                    .lines()
                    .rev()
                    .filter(|l| l.contains(" compacted ") && l.contains("complete=true"))
                    .find_map(target_of)
            })
            .collect();
        let all = decided.is_some_and(&wanted) && finished.iter().all(|f| *f == decided);
        match (all, settled) {
            (true, Some((t, since)))
                if Some(t) == decided && since.elapsed() > Duration::from_millis(700) =>
            {
                break;
            }
            (true, Some((t, _))) if Some(t) == decided => {}
            (true, _) => settled = decided.map(|t| (t, Instant::now())),
            (false, _) => settled = None,
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{what}: latest target {decided:?}, last finished pass per broker {finished:?}\n{}",
            c.logs_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for id in 1..=3 {
        c.kill(id);
    }
    let dumps: Vec<BTreeMap<u64, Dumped>> =
        (1..=3).map(|id| dumped(id, c.data_dir(id))).collect::<anyhow::Result<_>>()?;
    let sizes: Vec<usize> = dumps.iter().map(BTreeMap::len).collect();
    eprintln!("{what}: records per replica {sizes:?}");
    for (i, d) in dumps.iter().enumerate().skip(1) {
        if *d != dumps[0] {
            let diff: Vec<_> = d.iter().filter(|(o, r)| dumps[0].get(o) != Some(r)).take(5).collect();
            anyhow::bail!(
                "{what}: broker {} holds another log than broker 1 ({sizes:?}); first differences {diff:?}",
                i + 1
            );
        }
    }
    anyhow::ensure!(
        done(&dumps[0]),
        "{what}: the common log is not as expected ({} records)",
        dumps[0].len()
    );
    let target = decided_target(c).unwrap_or_default();
    Ok((dumps.into_iter().next().unwrap_or_default(), target))
}

/// The latest target any leader logged deciding for `t`.
fn decided_target(c: &Cluster) -> Option<(u64, u64)> {
    (1..=3)
        .flat_map(|id| {
            log_since(c, id, 0)
                .lines()
                .filter(|l| l.contains("compaction target moved"))
                .filter_map(target_of)
                .collect::<Vec<_>>()
        })
        .max()
}

/// Starts every broker again and waits until they answer.
async fn restart_all(c: &mut Cluster) -> anyhow::Result<()> {
    for id in 1..=3 {
        if !c.is_running(id) {
            c.spawn(id)?;
        }
    }
    c.wait_ready(3, Duration::from_secs(60)).await
}

/// Every record of `log` is the one written at its offset, and no key
/// appears but at its latest offset (or in the uncompacted tail, at most
/// `tail` records).
fn check_against(log: &BTreeMap<u64, Dumped>, w: &Written, tail: usize) -> anyhow::Result<()> {
    let mut stale = 0;
    for (o, rec) in log {
        anyhow::ensure!(w.at.get(o) == Some(rec), "offset {o} holds {rec:?}, written {:?}", w.at.get(o));
        if w.latest.get(&rec.0) != Some(o) {
            stale += 1;
        }
    }
    anyhow::ensure!(stale <= tail, "{stale} superseded records survived compaction");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_changelog_compacts_to_the_same_latest_values_on_every_replica() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    fs::write(&config, CONFIG)?;
    let mut c =
        Cluster::start("compaction", BIN, 3, &[("FERROLOG_CONFIG", &config.to_string_lossy())]).await?;
    let configs: BTreeMap<String, String> =
        [("cleanup.policy", "compact"), ("segment.bytes", "65536"), ("min.cleanable.dirty.ratio", "0.1")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
    create_topic_with_config(&c, "t", 1, 3, &configs).await?;

    // A compacted topic refuses a record without a key, and writes nothing of its batch.
    let keyless = vec![record("a", "1"), Record { value: b"no key".to_vec().into(), ..Record::default() }];
    let req = ProduceRequest {
        topic: "t".into(),
        partition: 0,
        records: keyless,
        producer_id: -1,
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let r = loop {
        // The leader may move right after creation: ask again until one answers.
        let at = leader(&c, "t", 0, Duration::from_secs(30)).await?;
        let r = produce_once(c.broker(at).client_addr, req.clone()).await?;
        match code(&r.error) {
            ErrorCode::NotLeader | ErrorCode::Unavailable if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            _ => break r,
        }
    };
    assert_eq!(code(&r.error), ErrorCode::InvalidRecord, "{:?}", r.error);
    assert!(r.error.as_ref().is_some_and(|e| e.message.contains("record 1 has no key")), "{:?}", r.error);

    let mut w = Written::default();
    for b in 0..UPDATES / PER_BATCH {
        let rows = (0..PER_BATCH)
            .map(|j| {
                let i = b * PER_BATCH + j;
                (key(i % KEYS), Some(format!("{}-v{i}", key(i % KEYS))))
            })
            .collect();
        w.send(&c, rows).await?;
    }
    w.send(&c, (0..DELETED).map(|k| (key(k), None)).collect()).await?;
    w.send(&c, (0..REWRITTEN).map(|k| (key(k), Some(format!("{}-again", key(k))))).collect()).await?;
    // An empty value is a value, an empty key a key.
    w.send(&c, vec![("".into(), Some(String::new()))]).await?;
    // Fillers of 64 KiB roll the active segment: everything above is in sealed segments.
    for n in 0..2 {
        w.send(&c, vec![("filler".into(), Some(format!("{n}{}", "f".repeat(65 << 10))))]).await?;
    }

    // Compacted: each key's latest record at its offset, nothing older
    // (bar the filler in the active segment), tombstones still there.
    let live = KEYS + 2;
    let marks = log_marks(&c);
    let (log, first) = converged(&mut c, "compaction", &marks, |_| true, |log| log.len() <= live + 1).await?;
    check_against(&log, &w, 1)?;
    assert!(log.len() >= live, "{} records: a key's latest value went", log.len());
    for k in 0..KEYS {
        let want = w.latest[&key(k)];
        assert!(log.contains_key(&want), "{}'s latest record (offset {want}) went", key(k));
    }
    let tombstones = log.values().filter(|r| r.1.is_none()).count();
    assert_eq!(tombstones, DELETED - REWRITTEN, "tombstones stay for delete.retention.ms (1 day)");
    assert_eq!(log.get(&w.latest[""]), Some(&(String::new(), Some(String::new()))), "empty key and value");

    // delete.retention.ms = 0: the tombstones go; nothing else does.
    restart_all(&mut c).await?;
    let marks = log_marks(&c);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = connect(c.broker(1).client_addr)
            .await?
            .alter_topic_config(AlterTopicConfigRequest {
                topic: "t".into(),
                set: [("delete.retention.ms".to_owned(), "0".to_owned())].into(),
                delete: vec![],
            })
            .await?
            .into_inner();
        match code(&r.error) {
            ErrorCode::None => break,
            ErrorCode::Unavailable | ErrorCode::NotLeader if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            _ => anyhow::bail!("alter topic config: {:?}", r.error),
        }
    }
    let (log, _) = converged(
        &mut c,
        "tombstone removal",
        &marks,
        |t| t.1 > first.1,
        |log| log.values().all(|r| r.1.is_some()),
    )
    .await?;
    check_against(&log, &w, 1)?;
    let latest = log.iter().filter(|(o, r)| w.latest.get(&r.0) == Some(*o)).count();
    assert_eq!(latest, live - (DELETED - REWRITTEN), "every live key once, the deleted ones gone");
    for k in 0..REWRITTEN {
        assert_eq!(log[&w.latest[&key(k)]].1.as_deref(), Some(format!("{}-again", key(k)).as_str()));
    }

    // A broker wiped, while 1,500 more entries are written, is rebuilt from
    // a snapshot (Raft purged what it would need) and ends with the same log.
    for id in 1..=2 {
        c.spawn(id)?;
    }
    c.wait_ready(2, Duration::from_secs(60)).await?;
    c.wipe(3);
    let marks = log_marks(&c);
    for i in 0..1500 {
        let k = KEYS / 2 + i % 100;
        w.send(&c, vec![(key(k), Some(format!("{}-late-{i}", key(k))))]).await?;
    }
    for n in 0..2 {
        w.send(&c, vec![("filler".into(), Some(format!("{n}{}", "g".repeat(65 << 10))))]).await?;
    }
    restart_all(&mut c).await?;
    let (rebuilt, _) = converged(&mut c, "rebuilt replica", &marks, |_| true, |_| true).await?;
    check_against(&rebuilt, &w, 1)?;
    for k in REWRITTEN..DELETED {
        assert!(!rebuilt.values().any(|r| r.0 == key(k)), "deleted {} came back", key(k));
    }
    for k in (0..REWRITTEN).chain(DELETED..KEYS) {
        let want = w.latest[&key(k)];
        assert!(rebuilt.contains_key(&want), "{}'s latest record (offset {want}) went", key(k));
    }
    let installed = log_since(&c, 3, marks[2]).lines().filter(|l| l.contains("installed snapshot")).count();
    assert!(installed > 0, "the wiped broker was not rebuilt from a snapshot");
    Ok(())
}

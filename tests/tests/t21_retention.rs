//! Retention by size on a 3-replica topic (issue 12): while records are
//! produced, the leader moves the log start offset through Raft; every
//! replica then serves from the same offset, holds the same records at the
//! same offsets (read from the stopped brokers with `dump-log`), and keeps
//! far less on disk than was written. A read below the log start is
//! refused `OFFSET_OUT_OF_RANGE` with the log start, and `ListOffsets`
//! earliest follows it.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use ferrolog_proto::client::{ErrorCode, FetchRequest, ListOffsetsRequest, OffsetSpec, ProduceRequest};
use ferrolog_tests::raw::{code, create_topic_with_config, leader, produce, record, values};
use ferrolog_tests::{Cluster, connect};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
/// Retention checked every 300 ms (Kafka's default is 5 minutes).
const CONFIG: &str = "[storage]\nindex_interval_bytes = 256\n[retention]\ncheck_interval_ms = 300\n";
const RECORDS: usize = 4000;
const RETENTION_BYTES: u64 = 32 << 10;
/// `segment.bytes` of the topic.
const SEGMENT_BYTES: u64 = 4096;

fn value(i: usize) -> String {
    format!("v-{i:05}-{}", "x".repeat(60))
}

/// A produce of record `i` (key `k`, [`value`]) to `t`-0, one Raft entry.
fn request(i: usize) -> ProduceRequest {
    ProduceRequest {
        topic: "t".into(),
        partition: 0,
        records: vec![record("k", &value(i))],
        producer_id: -1,
        ..ProduceRequest::default()
    }
}

/// Bytes of segment files of broker `id`'s replica of `t`-0. Retention
/// deletes segments while this runs: a file listed and gone before its
/// size is read counts as 0 bytes (it is gone), any other error is one.
fn segment_bytes(c: &Cluster, id: u32) -> anyhow::Result<u64> {
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let mut total = 0;
    for e in fs::read_dir(c.data_dir(id).join("partitions"))? {
        let log = e?.path().join("replica").join("log");
        if log.is_dir() {
            for f in fs::read_dir(&log)? {
                let f = f?;
                if f.path().extension().is_some_and(|x| x == "seg") {
                    match f.metadata() {
                        Ok(m) => total += m.len(),
                        Err(e) if gone(&e) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    }
    Ok(total)
}

/// `(offset, value)` of every record broker `id` holds for `t`-0, from its
/// stopped data directory.
fn dumped(id: u32, dir: &Path) -> anyhow::Result<Vec<(u64, String)>> {
    let out = std::process::Command::new(BIN).arg("dump-log").arg("--data-dir").arg(dir).output()?;
    anyhow::ensure!(
        out.status.success(),
        "dump-log of broker {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut records = Vec::new();
    for line in String::from_utf8(out.stdout)?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        if v["topic"] == "t" {
            let offset = v["offset"].as_u64().ok_or_else(|| anyhow::anyhow!("no offset: {line}"))?;
            records.push((offset, v["value"].as_str().unwrap_or_default().to_owned()));
        }
    }
    Ok(records)
}

async fn earliest(c: &Cluster, id: u32) -> anyhow::Result<u64> {
    let r = connect(c.broker(id).client_addr)
        .await?
        .list_offsets(ListOffsetsRequest {
            topic: "t".into(),
            partition: 0,
            spec: OffsetSpec::Earliest as i32,
            ..ListOffsetsRequest::default()
        })
        .await?
        .into_inner();
    anyhow::ensure!(r.error.is_none(), "list offsets: {:?}", r.error);
    Ok(r.offset)
}

/// Three brokers with `broker_config` (kept in the returned directory) and
/// topic `t`: one partition, 3 replicas, 4 KiB segments, `retention.bytes`
/// [`RETENTION_BYTES`].
async fn start(name: &str, broker_config: &str) -> anyhow::Result<(tempfile::TempDir, Cluster)> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    fs::write(&config, broker_config)?;
    let c = Cluster::start(name, BIN, 3, &[("FERROLOG_CONFIG", &config.to_string_lossy())]).await?;
    let configs: BTreeMap<String, String> = [
        ("segment.bytes".to_owned(), SEGMENT_BYTES.to_string()),
        ("retention.bytes".to_owned(), RETENTION_BYTES.to_string()),
    ]
    .into();
    create_topic_with_config(&c, "t", 1, 3, &configs).await?;
    Ok((dir, c))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_by_size_moves_every_replica_to_the_same_log_start() -> anyhow::Result<()> {
    let (_dir, mut c) = start("retention", CONFIG).await?;

    // One record per request: one Raft entry each, many 4 KiB segments.
    let mut written = 0u64;
    let mut at = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    let mut client = connect(c.broker(at).client_addr).await?;
    for i in 0..RECORDS {
        let req = request(i);
        let r = client.produce(req.clone()).await?.into_inner();
        let offset = if r.error.is_none() {
            r.base_offset
        } else {
            let (r, id) = produce(&c, req, Duration::from_secs(30)).await?;
            at = id;
            client = connect(c.broker(at).client_addr).await?;
            r.base_offset
        };
        assert_eq!(offset, i as u64, "a fresh topic with one producer: offset = sequence");
        written += value(i).len() as u64;
    }

    // The log start moves, and old segments leave every replica's disk.
    let deadline = Instant::now() + Duration::from_secs(60);
    let start = loop {
        let start = earliest(&c, at).await.unwrap_or(0);
        let sizes: Vec<u64> = (1..=3).map(|id| segment_bytes(&c, id)).collect::<anyhow::Result<_>>()?;
        // Retention's limit (the oldest segments go while the rest stays at
        // or above it), the active segment and one being cut, with room for
        // segments past 4 KiB (a follower appends what it receives at once
        // to one segment): the whole log is about 640 KB.
        let bound = RETENTION_BYTES + 6 * SEGMENT_BYTES;
        if start > 0 && sizes.iter().all(|s| *s <= bound) {
            eprintln!(
                "log start {start}; segment bytes per replica {sizes:?} (bound {bound}); record bytes written {written}"
            );
            break start;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "retention did not advance: log start {start}, segment bytes {sizes:?} of {written} written\n{}",
            c.logs_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(start < RECORDS as u64, "the log start passed the end");

    // A read below the log start is refused with the log start; one at it is served.
    let mut client = connect(c.broker(at).client_addr).await?;
    let below = client
        .fetch(FetchRequest { topic: "t".into(), partition: 0, offset: 0, ..FetchRequest::default() })
        .await?
        .into_inner();
    assert_eq!(code(&below.error), ErrorCode::OffsetOutOfRange, "{:?}", below.error);
    let e = below.error.expect("an error");
    assert!(e.log_start_offset >= start, "{e:?}");
    let first = client
        .fetch(FetchRequest {
            topic: "t".into(),
            partition: 0,
            offset: e.log_start_offset,
            max_bytes: 1,
            ..FetchRequest::default()
        })
        .await?
        .into_inner();
    assert!(first.error.is_none(), "{:?}", first.error);
    let got = values(&first)?;
    assert!(
        got.contains(&value(e.log_start_offset as usize)),
        "the record at the log start keeps its offset"
    );

    // Stopped, every replica holds the same records at the same offsets,
    // from the same log start on, each at the offset it was written at.
    for id in 1..=3 {
        c.kill(id);
    }
    let dumps: Vec<Vec<(u64, String)>> =
        (1..=3).map(|id| dumped(id, c.data_dir(id))).collect::<anyhow::Result<_>>()?;
    for (i, d) in dumps.iter().enumerate() {
        let first = d.first().map(|(o, _)| *o);
        assert!(first.is_some_and(|o| o >= start && o > 0), "broker {}: dump begins at {first:?}", i + 1);
        assert_eq!(d.last().map(|(o, _)| *o), Some(RECORDS as u64 - 1), "broker {}", i + 1);
        assert!(d.iter().all(|(o, v)| *v == value(*o as usize)), "broker {}: a record moved", i + 1);
    }
    // A replica killed before it applied the last log start move still
    // holds the segments below it: compared from the highest first offset.
    let common = dumps.iter().filter_map(|d| d.first().map(|(o, _)| *o)).max().unwrap_or(0);
    let from = |d: &Vec<(u64, String)>| d.iter().filter(|(o, _)| *o >= common).cloned().collect::<Vec<_>>();
    assert!(from(&dumps[0]).len() > 1, "the common range holds records");
    assert_eq!(from(&dumps[0]), from(&dumps[1]), "brokers 1 and 2 differ");
    assert_eq!(from(&dumps[0]), from(&dumps[2]), "brokers 1 and 3 differ");
    eprintln!("every replica serves offsets {}..{}", dumps[0][0].0, RECORDS);

    // After a restart the log start holds, and earliest follows it.
    for id in 1..=3 {
        c.spawn(id)?;
    }
    c.wait_ready(3, Duration::from_secs(60)).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let after = loop {
        // Whichever broker leads once an election settled.
        let id = leader(&c, "t", 0, Duration::from_secs(30)).await?;
        match earliest(&c, id).await {
            Ok(o) => break o,
            Err(e) if Instant::now() < deadline => {
                eprintln!("earliest from broker {id}: {e:#}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    };
    // Retention goes on after the restart (a new leader has its own segment
    // boundaries, so it may move the log start further), never back.
    assert!(
        after >= dumps[0][0].0 && after < RECORDS as u64,
        "ListOffsets earliest {after}: the replicas kept {}",
        dumps[0][0].0
    );
    Ok(())
}

/// Retention checked once an hour: only a segment roll (on any replica)
/// and a new log start applied (on each follower) can start it.
const CONFIG_HOURLY: &str =
    "[storage]\nindex_interval_bytes = 256\n[retention]\ncheck_interval_ms = 3600000\n";

/// Retention does not wait for its check: with the check an hour away, the
/// log start moves and every replica's disk comes back within the bound
/// once the writes end, which only the reaction to rolls can do. Prints
/// (does not check: it depends on timing) the most segment bytes a replica
/// held while writing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_follows_segment_rolls_without_waiting_for_its_check() -> anyhow::Result<()> {
    let (_dir, c) = start("retention-rolls", CONFIG_HOURLY).await?;
    let records = 2000;
    let mut most = [0u64; 3];
    let mut written = 0u64;
    for i in 0..records {
        let req = request(i);
        produce(&c, req, Duration::from_secs(30)).await?;
        written += value(i).len() as u64;
        if i % 50 == 0 {
            for id in 1..=3 {
                most[id as usize - 1] = most[id as usize - 1].max(segment_bytes(&c, id)?);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let bound = RETENTION_BYTES + 6 * SEGMENT_BYTES;
    loop {
        let at = leader(&c, "t", 0, Duration::from_secs(30)).await?;
        let start = earliest(&c, at).await.unwrap_or(0);
        let sizes: Vec<u64> = (1..=3).map(|id| segment_bytes(&c, id)).collect::<anyhow::Result<_>>()?;
        if start > 0 && sizes.iter().all(|s| *s <= bound) {
            eprintln!(
                "log start {start}; segment bytes per replica {sizes:?} (bound {bound}); most while writing \
                 {most:?}; record bytes written {written}"
            );
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "retention did not follow the rolls: log start {start}, segment bytes {sizes:?} of {written} \
             written\n{}",
            c.logs_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

//! `ferrolog-broker dump-log --data-dir DIR`: prints every record of every
//! partition replica in a **stopped** broker's data directory, one JSON
//! object per line, for operators and for the fault-injection checker
//! (`jepsen/`), which compares the brokers' copies.
//!
//! Each line: `topic`, `partition`, `group`, `offset`, the Raft log id of
//! its batch (`term`, `leader`, `index`), `committed` (below the replica's
//! persisted commit point; the commit point is made durable lazily, so the
//! last second of committed records may show `false` after a crash),
//! `timestamp_ms`, `key` and `value` (UTF-8 when valid, else base-16 in
//! `key_hex`/`value_hex`; a null value, a tombstone, is JSON `null`), and
//! `headers` when the record has any: `[{"key": …, "value"|"value_hex": …}]`.
//!
//! After a replica's records (also for a replica without any), one line
//! `{"replica": {topic, partition, group, log_start_offset, log_end_offset,
//! committed_end}}`: the replica's **committed marker**, where
//! `committed_end` is the offset after its persisted commit point (0 when
//! it has none): records below it are the ones shown `committed`. It has
//! no top-level `topic`, so readers that pick record lines by `topic` skip
//! it; the fault-injection checker (`jepsen/`) requires it.
//!
//! Opening a log is what a starting broker does: a torn tail left by a
//! crash is cut. Never run it on the data directory of a running broker.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use ferrolog_raft_store::meta_db::MetaDb;
use ferrolog_raft_store::vfs::{self, Fs};
use ferrolog_raft_store::{Flusher, Replica, StoreConfig};
use serde_json::json;

use crate::partition::records;

/// Bytes read per call while walking a log.
const READ_BYTES_MAX: usize = 1 << 20;

/// A replica directory under `<data_dir>/partitions`: `<topic>-<partition>.g<group>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaDir {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// Raft group id.
    pub group: u64,
    /// The directory.
    pub path: PathBuf,
}

/// Parses a replica directory name (see [`crate::partitions::partition_dir`]).
pub fn parse_replica_dir_name(name: &str) -> Option<(String, u32, u64)> {
    let (rest, group) = name.rsplit_once(".g")?;
    let (topic, partition) = rest.rsplit_once('-')?;
    Some((topic.to_owned(), partition.parse().ok()?, group.parse().ok()?))
}

/// The partition replicas stored in `data_dir` on the OS's file system,
/// sorted by topic and partition (as [`replica_dirs_on`]).
///
/// # Errors
/// An unreadable directory.
pub fn replica_dirs(data_dir: &Path) -> anyhow::Result<Vec<ReplicaDir>> {
    replica_dirs_on(&vfs::real(), data_dir)
}

/// The partition replicas stored in `data_dir` on `fs`, sorted by topic
/// and partition; none when `data_dir` has no `partitions` directory.
///
/// # Errors
/// An unreadable directory.
pub fn replica_dirs_on(fs: &Fs, data_dir: &Path) -> anyhow::Result<Vec<ReplicaDir>> {
    let root = data_dir.join("partitions");
    let names = match fs.list(&root) {
        Ok(names) => names,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", root.display())),
    };
    let mut out: Vec<ReplicaDir> = names
        .into_iter()
        .filter_map(|name| {
            let (topic, partition, group) = parse_replica_dir_name(&name)?;
            Some(ReplicaDir { topic, partition, group, path: root.join(name) })
        })
        .collect();
    out.sort_by(|a, b| (&a.topic, a.partition, a.group).cmp(&(&b.topic, b.partition, b.group)));
    Ok(out)
}

fn text_or_hex(name: &str, bytes: &[u8], line: &mut serde_json::Map<String, serde_json::Value>) {
    match std::str::from_utf8(bytes) {
        Ok(s) => {
            line.insert(name.to_owned(), json!(s));
        }
        Err(_) => {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            line.insert(format!("{name}_hex"), json!(hex));
        }
    }
}

/// Writes every record of one replica to `out` as JSON lines, then its
/// committed marker; returns how many records.
///
/// # Errors
/// A log that cannot be opened or read (corruption is reported with file
/// and position), an undecodable batch, or a write error.
pub fn dump_replica(
    r: &ReplicaDir,
    meta_db: &Arc<MetaDb>,
    flusher: &Flusher,
    out: &mut impl Write,
) -> anyhow::Result<u64> {
    let replica_dir = r.path.join(crate::partitions::REPLICA_DIR);
    let log_dir = replica_dir.join(ferrolog_raft_store::replica::LOG_DIR);
    let log = Replica::open_log_in(meta_db, &replica_dir, StoreConfig::default(), flusher.clone())
        .with_context(|| format!("opening {}", log_dir.display()))?;
    let committed_end = match log.committed() {
        Some(c) => log.next_offset_after(c.index)?.unwrap_or(0),
        None => 0,
    };
    let mut offset = log.log_start_offset();
    let end = log.log_end_offset();
    let mut n = 0;
    while offset < end {
        let batches = log.read(offset, READ_BYTES_MAX, u64::MAX)?;
        if batches.is_empty() {
            break;
        }
        for b in batches {
            let h = &b.header;
            let recs = records::decode(&b.records())
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("{}: batch at offset {}", log_dir.display(), h.base_offset))?;
            let deltas = records::offset_deltas(&recs);
            for (rec, delta) in recs.iter().zip(deltas) {
                // Compacted batches: records after removed ones carry their delta.
                let o = h.base_offset + u64::from(delta);
                if o < offset {
                    continue;
                }
                let mut line = serde_json::Map::new();
                line.insert("topic".into(), json!(r.topic));
                line.insert("partition".into(), json!(r.partition));
                line.insert("group".into(), json!(r.group));
                line.insert("offset".into(), json!(o));
                line.insert("term".into(), json!(h.log_id.leader_id.term));
                line.insert("leader".into(), json!(h.log_id.leader_id.node_id));
                line.insert("index".into(), json!(h.log_id.index));
                line.insert("committed".into(), json!(o < committed_end));
                line.insert("timestamp_ms".into(), json!(rec.timestamp_ms));
                if h.producer_id >= 0 {
                    // The idempotent producer's fields (KIP-98), as Kafka's
                    // kafka-dump-log prints them, and the record's own
                    // sequence: the batch's base sequence plus the record's
                    // offset delta, wrapping past i32::MAX to 0 as Kafka's do.
                    line.insert("producer_id".into(), json!(h.producer_id));
                    line.insert("producer_epoch".into(), json!(h.producer_epoch));
                    line.insert("base_sequence".into(), json!(h.base_sequence));
                    let seq = (i64::from(h.base_sequence) + i64::from(delta)) % (i64::from(i32::MAX) + 1);
                    line.insert("sequence".into(), json!(seq));
                }
                if let Some(k) = &rec.key {
                    text_or_hex("key", k, &mut line);
                }
                if rec.null_value {
                    line.insert("value".into(), serde_json::Value::Null);
                } else {
                    text_or_hex("value", &rec.value, &mut line);
                }
                if !rec.headers.is_empty() {
                    let headers: Vec<serde_json::Value> = rec
                        .headers
                        .iter()
                        .map(|h| {
                            let mut m = serde_json::Map::new();
                            m.insert("key".into(), json!(h.key));
                            text_or_hex("value", &h.value, &mut m);
                            serde_json::Value::Object(m)
                        })
                        .collect();
                    line.insert("headers".into(), json!(headers));
                }
                serde_json::to_writer(&mut *out, &line)?;
                out.write_all(b"\n")?;
                n += 1;
            }
            offset = offset.max(h.next_offset());
        }
    }
    let marker = json!({"replica": {
        "topic": r.topic, "partition": r.partition, "group": r.group,
        "log_start_offset": log.log_start_offset(), "log_end_offset": end, "committed_end": committed_end,
    }});
    serde_json::to_writer(&mut *out, &marker)?;
    out.write_all(b"\n")?;
    Ok(n)
}

/// The `dump-log` command: every replica under `data_dir` to stdout.
///
/// # Errors
/// As [`dump_on`].
pub fn run(data_dir: &Path) -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    dump_on(&vfs::real(), data_dir, &mut out)?;
    out.flush()?;
    Ok(())
}

/// Writes every replica stored in `data_dir` on `fs` (a stopped broker's)
/// to `out`, as [`dump_replica`] does; returns how many records in all.
/// On a simulation's file system ([`ferrolog_raft_store::vfs::Vfs::background_on_runtime`])
/// it must run inside a tokio runtime, as the broker did.
///
/// # Errors
/// As [`dump_replica`], and a metadata database that cannot be opened.
pub fn dump_on(fs: &Fs, data_dir: &Path, out: &mut impl Write) -> anyhow::Result<u64> {
    let replicas = replica_dirs_on(fs, data_dir)?;
    if replicas.is_empty() {
        return Ok(0);
    }
    let flusher = Flusher::spawn_on("dump-log", fs.clone()).context("starting the flusher")?;
    let root = data_dir.join("partitions");
    let meta_db = MetaDb::open_on(fs, &root)
        .with_context(|| format!("opening the metadata database in {}", root.display()))?;
    let mut n = 0;
    for r in replicas {
        n += dump_replica(&r, &meta_db, &flusher, out)?;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_dir_names() {
        assert_eq!(parse_replica_dir_name("orders-3.g17"), Some(("orders".into(), 3, 17)));
        assert_eq!(parse_replica_dir_name("a-b-0.g2"), Some(("a-b".into(), 0, 2)));
        assert_eq!(parse_replica_dir_name("metadata"), None);
    }
}

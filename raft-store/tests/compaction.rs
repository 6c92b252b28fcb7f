//! Compaction in the store, against a model of its rule: two replicas of the
//! same log with different segment sizes (so different segment boundaries)
//! compact to the same records at the same offsets, whether one pass with
//! an unbounded key map or many chunks of a one-key map, whether straight
//! to a target or through an earlier one first, and again after a reopen;
//! a second pass finds nothing to do. Readers, offsets and time lookups
//! step over the gaps.

mod common;

use std::collections::{BTreeMap, HashMap};

use bytes::{BufMut, Bytes, BytesMut};
use ferrolog_raft_store::types::{Entry, EntryPayload, LogId, TypeConfig, log_id};
use ferrolog_raft_store::{
    CompactionTarget, Control, Flusher, KeyedRecord, LogStore, PartitionStateMachine, RecordBatch,
    RecordCodec, Replica, StoreConfig,
};
use openraft::storage::RaftLogStorage;
use openraft::type_config::TypeConfigExt;

/// One test record: key (`None`: keyless), value (`None`: tombstone).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Rec {
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
}

/// A small record encoding with the broker's delta rule: a record after
/// removed ones carries its delta; else it follows the previous record.
struct TestCodec;

fn encode(records: &[(Option<u32>, Rec)]) -> Bytes {
    let mut b = BytesMut::new();
    for (delta, r) in records {
        match delta {
            Some(d) => {
                b.put_u8(1);
                b.put_u32(*d);
            }
            None => b.put_u8(0),
        }
        for part in [&r.key, &r.value] {
            match part {
                Some(p) => {
                    b.put_u8(1);
                    b.put_u16(p.len() as u16);
                    b.put_slice(p);
                }
                None => b.put_u8(0),
            }
        }
    }
    b.freeze()
}

fn decode(mut b: &[u8]) -> Result<Vec<(u32, Rec)>, String> {
    use bytes::Buf;
    let mut out = Vec::new();
    let mut next = 0u32;
    while b.has_remaining() {
        let d = if b.get_u8() == 1 { b.try_get_u32().map_err(|e| e.to_string())? } else { next };
        let mut parts = [None, None];
        for p in &mut parts {
            if b.try_get_u8().map_err(|e| e.to_string())? == 1 {
                let n = b.try_get_u16().map_err(|e| e.to_string())? as usize;
                if b.remaining() < n {
                    return Err("short".into());
                }
                *p = Some(b[..n].to_vec());
                b.advance(n);
            }
        }
        let [key, value] = parts;
        out.push((d, Rec { key, value }));
        next = d + 1;
    }
    Ok(out)
}

impl RecordCodec for TestCodec {
    fn keyed(&self, records: &Bytes) -> Result<Vec<KeyedRecord>, String> {
        Ok(decode(records)?
            .into_iter()
            .map(|(d, r)| KeyedRecord {
                offset_delta: d,
                key: r.key.map(Bytes::from),
                tombstone: r.value.is_none(),
            })
            .collect())
    }

    fn retain(&self, records: &Bytes, keep: &[bool]) -> Result<Bytes, String> {
        let mut next = 0;
        let mut out = Vec::new();
        for ((d, r), k) in decode(records)?.into_iter().zip(keep) {
            if *k {
                out.push(((d != next).then_some(d), r));
                next = d + 1;
            }
        }
        Ok(encode(&out))
    }
}

/// A pseudo-random changelog: batches of 1 to 12 records over 40 keys, some
/// tombstones, a few keyless records, and empty values and an empty key.
fn workload() -> Vec<Vec<Rec>> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    // First, keys deleted once and never written again: their tombstones
    // are their latest records, removed only below `tombstones_below`.
    let deleted =
        (0..3).map(|i| Rec { key: Some(format!("deleted-{i}").into_bytes()), value: None }).collect();
    std::iter::once(deleted)
        .chain((0..400).map(|_| {
            (0..1 + rnd(12))
                .map(|_| {
                    let k = rnd(40);
                    let key = match rnd(50) {
                        0 => None,
                        1 => Some(Vec::new()),
                        _ => Some(format!("key-{k}").into_bytes()),
                    };
                    let value = match rnd(10) {
                        0 => None,
                        1 => Some(Vec::new()),
                        _ => Some(format!("value-{}", rnd(1_000_000)).into_bytes()),
                    };
                    Rec { key, value }
                })
                .collect()
        }))
        .collect()
}

/// What the rule keeps of `log` (records by offset) for `target`.
fn model(log: &BTreeMap<u64, Rec>, t: CompactionTarget) -> BTreeMap<u64, Rec> {
    let mut latest: HashMap<&[u8], u64> = HashMap::new();
    for (o, r) in log.range(..t.through) {
        if let Some(k) = &r.key {
            latest.insert(k, *o);
        }
    }
    log.iter()
        .filter(|(o, r)| {
            let Some(k) = &r.key else { return true };
            **o >= t.through
                || (latest[k.as_slice()] == **o && !(r.value.is_none() && **o < t.tombstones_below))
        })
        .map(|(o, r)| (*o, r.clone()))
        .collect()
}

struct Node {
    replica: Replica,
    store: LogStore,
    sm: PartitionStateMachine,
    index: u64,
}

impl Node {
    fn open(dir: &std::path::Path, segment_bytes: u64, flusher: &Flusher) -> Node {
        let config = StoreConfig { segment_bytes, index_interval_bytes: 512, ..StoreConfig::default() };
        let replica = Replica::open(dir, config, flusher.clone()).expect("open");
        let index = replica.last_log_id().map_or(0, |l| l.index + 1);
        Node { store: replica.log_store(), sm: replica.state_machine(), replica, index }
    }

    /// Appends, commits and applies one entry.
    async fn commit(&mut self, batch: RecordBatch) {
        let e = Entry { log_id: log_id(1, 1, self.index), payload: EntryPayload::Normal(batch) };
        let id: LogId = e.log_id;
        common::append_durable(&mut self.store, vec![e.clone()]).await.expect("append");
        self.store.save_committed(Some(id)).await.expect("commit");
        common::apply_all(&mut self.sm, vec![e]).await;
        self.index += 1;
    }

    fn compact(&self, map_bytes_max: usize) -> Option<ferrolog_raft_store::CompactionStats> {
        self.compact_capped(map_bytes_max, u64::MAX)
    }

    /// A pass removing tombstones only below `tombstones_below_max` too.
    fn compact_capped(
        &self,
        map_bytes_max: usize,
        tombstones_below_max: u64,
    ) -> Option<ferrolog_raft_store::CompactionStats> {
        self.replica.compact(&TestCodec, map_bytes_max, tombstones_below_max, &mut |_| {}).expect("compact")
    }

    /// Every record served, by offset.
    fn records(&self) -> BTreeMap<u64, Rec> {
        let mut out = BTreeMap::new();
        for b in self.replica.read(0, usize::MAX).expect("read") {
            for (d, r) in decode(&b.records()).expect("decode") {
                assert!(d < b.header.record_count, "delta past the batch");
                assert!(out.insert(b.header.base_offset + u64::from(d), r).is_none(), "an offset twice");
            }
        }
        out
    }
}

fn batch(records: &[Rec], ts: i64) -> RecordBatch {
    let with: Vec<_> = records.iter().map(|r| (None, r.clone())).collect();
    RecordBatch {
        record_count: records.len() as u32,
        first_timestamp_ms: ts,
        max_timestamp_ms: ts,
        producer_id: -1,
        records: encode(&with),
        ..RecordBatch::default()
    }
}

#[test]
fn replicas_with_different_segments_compact_to_the_same_records_by_the_rule() {
    let flusher = Flusher::spawn("compaction-test").expect("flusher");
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().expect("tempdir")).collect();
    TypeConfig::run(async {
        // A: 4 KiB segments, one unbounded pass per target; B: 16 KiB
        // segments, a one-byte map (a chunk per batch); C: 8 KiB, straight
        // to the last target.
        let mut nodes = vec![
            Node::open(dirs[0].path(), 4096, &flusher),
            Node::open(dirs[1].path(), 16384, &flusher),
            Node::open(dirs[2].path(), 8192, &flusher),
        ];
        let mut log = BTreeMap::new();
        let mut offset = 0u64;
        for (i, records) in workload().iter().enumerate() {
            for n in &mut nodes {
                n.commit(batch(records, 1_000 + i as i64)).await;
            }
            for r in records {
                log.insert(offset, r.clone());
                offset += 1;
            }
        }
        assert!(nodes.iter().all(|n| n.replica.high_watermark() == offset));
        assert_ne!(
            nodes[0].replica.segment_summaries().expect("segments").len(),
            nodes[1].replica.segment_summaries().expect("segments").len(),
            "the test needs different segment boundaries"
        );

        let first = CompactionTarget { through: offset * 6 / 10, tombstones_below: offset * 3 / 10 };
        let second = CompactionTarget { through: offset * 9 / 10, tombstones_below: offset * 8 / 10 };
        for n in &mut nodes[..2] {
            n.commit(RecordBatch::control_batch(Control::Compact(first))).await;
        }
        let a = nodes[0].compact(usize::MAX).expect("a pass");
        let b = nodes[1].compact(1).expect("a pass");
        assert_eq!(a.chunks, 1);
        assert!(b.chunks > 10, "{} chunks", b.chunks);
        assert!(a.records_removed > 0 && a.segments_rewritten > 0, "{a:?}");
        assert_eq!(a.records_removed, b.records_removed);
        assert!(nodes[0].compact(usize::MAX).is_none(), "a finished target is not compacted again");
        let want = model(&log, first);
        assert!(
            want.len() < log.len() / 2,
            "the model removes most records: {} of {}",
            want.len(),
            log.len()
        );
        assert_eq!(nodes[0].records(), want);
        assert_eq!(nodes[1].records(), want);

        for n in &mut nodes {
            n.commit(RecordBatch::control_batch(Control::Compact(second))).await;
        }
        nodes[0].compact(usize::MAX).expect("a pass");
        nodes[1].compact(1).expect("a pass");
        // C never compacted: its own tombstone horizon is 0 (KIP-534), so
        // its first pass keeps every tombstone, and a later one, once its
        // horizon reaches the target's, removes them like the others.
        let capped = model(&log, second.capped(0));
        nodes[2].compact_capped(usize::MAX, 0).expect("a capped pass");
        assert_eq!(nodes[2].records(), capped);
        assert!(nodes[2].compact_capped(usize::MAX, 0).is_none(), "the capped target is done");
        assert!(!nodes[2].replica.compaction_pending(0));
        assert!(nodes[2].replica.compaction_pending(u64::MAX), "the full target is not");
        nodes[2].compact(usize::MAX).expect("a pass");
        let want = model(&log, second);
        assert!(capped.len() > want.len(), "the capped pass kept tombstones the target removes");
        for (i, n) in nodes.iter().enumerate() {
            assert_eq!(n.records(), want, "node {i}");
        }
        // Reopened (Raft replays apply from the log), the compacted log is
        // still there, and the pass redone after the reopen removes nothing.
        drop(nodes.remove(1));
        let mut reopened = Node::open(dirs[1].path(), 16384, &flusher);
        let entries = {
            use openraft::storage::RaftLogReader;
            reopened.store.try_get_log_entries(0..reopened.index).await.expect("entries")
        };
        common::apply_all(&mut reopened.sm, entries).await;
        assert_eq!(reopened.records(), want);
        let again = reopened.compact(1).expect("a pass after the reopen");
        assert_eq!((again.records_removed, again.segments_rewritten), (0, 0), "{again:?}");
        assert!(reopened.compact(1).is_none());
    });
}

//! Property test: random sequences of append / truncate / purge / reopen /
//! read / offset lookups against a plain in-memory model of the log.

use bytes::Bytes;
use proptest::prelude::*;

use ferrolog_raft_store::types::{Entry, EntryPayload, log_id};
use ferrolog_raft_store::{Flusher, PartitionLog, RecordBatch, StoreConfig};

#[derive(Clone, Debug)]
enum Op {
    /// Append entries: (record count, payload bytes, max timestamp); count 0 = blank.
    Append(u64, Vec<(u32, usize, i64)>),
    /// Truncate after the entry this many from the end.
    Truncate(usize),
    /// Purge up to this fraction (per mille) of the log.
    Purge(u32),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1u64..4, prop::collection::vec((0u32..4, 0usize..700, 0i64..1000), 1..6)).prop_map(|(t, v)| Op::Append(t, v)),
        2 => (0usize..8).prop_map(Op::Truncate),
        1 => (0u32..1000).prop_map(Op::Purge),
        1 => Just(Op::Reopen),
    ]
}

/// One entry of the model: log id parts and what it holds.
#[derive(Clone, Debug)]
struct M {
    term: u64,
    count: u32,
    len: usize,
    ts: i64,
}

/// Per-record timestamps of the batch at `index`: `m.ts` is the largest,
/// at a position that depends on the index; the others are earlier, out of
/// order.
fn stamps(index: u64, m: &M) -> Vec<i64> {
    let top = (index % u64::from(m.count.max(1))) as u32;
    (0..m.count)
        .map(|k| if k == top { m.ts } else { m.ts - i64::from((k * 13 + index as u32 * 7) % 50 + 1) })
        .collect()
}

/// The records: a count (u32) and one i64 timestamp per record, little
/// endian, then filler up to `m.len` bytes.
fn make_entry(index: u64, m: &M) -> Entry {
    let payload = if m.count == 0 {
        EntryPayload::Blank
    } else {
        let stamps = stamps(index, m);
        let mut records = m.count.to_le_bytes().to_vec();
        records.extend(stamps.iter().flat_map(|t| t.to_le_bytes()));
        records.resize(records.len().max(m.len), (index % 251) as u8);
        EntryPayload::Normal(RecordBatch {
            record_count: m.count,
            first_timestamp_ms: stamps[0],
            max_timestamp_ms: m.ts,
            producer_id: -1,
            producer_epoch: 0,
            base_sequence: 0,
            records: Bytes::from(records),
        })
    };
    Entry { log_id: log_id(m.term, 1, index), payload }
}

/// Decodes [`make_entry`]'s records into their timestamps.
fn record_stamps(records: Bytes) -> Result<Vec<(u32, i64)>, String> {
    let n = u32::from_le_bytes(records.get(..4).ok_or("short")?.try_into().map_err(|_| "short")?) as usize;
    let body = records.get(4..4 + 8 * n).ok_or("short")?;
    Ok(body
        .chunks_exact(8)
        .enumerate()
        .map(|(d, c)| (d as u32, i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))))
        .collect())
}

fn config() -> StoreConfig {
    StoreConfig { segment_bytes: 4096, index_interval_bytes: 700, ..StoreConfig::default() }
}

fn check(log: &PartitionLog, model: &[M], purged: Option<u64>) {
    let last = model.len().checked_sub(1).map(|i| i as u64);
    let state = log.log_state();
    assert_eq!(state.last_purged_log_id.map(|l| l.index), purged);
    assert_eq!(state.last_log_id.map(|l| l.index), last.max(purged));
    let from = purged.map_or(0, |p| p + 1);
    let got = log.entries(0, model.len() as u64 + 5).expect("entries");
    let want: Vec<Entry> = (from..model.len() as u64).map(|i| make_entry(i, &model[i as usize])).collect();
    assert_eq!(got, want);
    // Offsets: prefix sums of record counts over the whole physical log.
    let mut offset = 0u64;
    let mut batches = Vec::new();
    for (i, m) in model.iter().enumerate() {
        if m.count > 0 {
            batches.push((i as u64, offset, m));
        }
        offset += u64::from(m.count);
    }
    assert_eq!(log.log_end_offset(), offset);
    for (i, base, m) in &batches {
        for o in *base..*base + u64::from(m.count) {
            let r = log.read(o, 1, u64::MAX).expect("read");
            assert_eq!((r[0].header.index(), r[0].header.base_offset), (*i, *base), "offset {o}");
        }
    }
    let all = log.read(0, usize::MAX, u64::MAX).expect("read all");
    assert_eq!(all.len(), batches.len());
    // A consumer fetching with small budgets, continuing after the last
    // batch it got, sees every batch once, in order, within budget.
    for max_bytes in [1usize, 500, 1500, 5000] {
        let mut seen = Vec::new();
        let mut from = 0;
        while from < offset {
            let got = log.read(from, max_bytes, u64::MAX).expect("fetch");
            assert!(!got.is_empty(), "no progress at offset {from}");
            let bytes: usize = got.iter().map(|b| b.frame.len()).sum();
            assert!(got.len() == 1 || bytes <= max_bytes, "fetch of {max_bytes} returned {bytes} bytes");
            from = got.last().expect("batch").header.next_offset();
            seen.extend(got.into_iter().map(|b| b.header.index()));
        }
        let want: Vec<u64> = batches.iter().map(|(i, _, _)| *i).collect();
        assert_eq!(seen, want, "consumer with max_bytes {max_bytes}");
    }
    // Offsets for a timestamp: the first record in offset order at or
    // after it (KIP-79), also below a high watermark.
    let records: Vec<(u64, i64)> = batches
        .iter()
        .flat_map(|(i, base, m)| {
            stamps(*i, m).into_iter().enumerate().map(move |(k, t)| (base + k as u64, t))
        })
        .collect();
    for ts in [-60i64, 0, 1, 250, 500, 970, 999, 1000] {
        for up_to in [u64::MAX, offset / 2] {
            let want = records.iter().copied().find(|(o, t)| *t >= ts && *o < up_to);
            // A batch is answered only when wholly below `up_to`.
            let want = want.filter(|(o, _)| {
                batches.iter().any(|(_, b, m)| {
                    *b <= *o && *o < b + u64::from(m.count) && b + u64::from(m.count) <= up_to
                })
            });
            let got = log.offset_for_timestamp(ts, up_to, record_stamps).expect("ts");
            assert_eq!(got, want, "timestamp {ts} up to {up_to}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn log_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        let flusher = Flusher::spawn("model").expect("flusher");
        let mut log = PartitionLog::open(&path, config(), flusher.clone()).expect("open");
        let mut model: Vec<M> = Vec::new();
        let mut purged: Option<u64> = None;
        let mut term = 1u64;
        for op in ops {
            match op {
                Op::Append(dt, items) => {
                    term += dt - 1;
                    let start = model.len() as u64;
                    let new: Vec<M> = items.into_iter().map(|(count, len, ts)| M { term, count, len, ts }).collect();
                    let entries = new.iter().enumerate().map(|(k, m)| make_entry(start + k as u64, m)).collect();
                    log.append(entries, Box::new(|r| r.expect("flush"))).expect("append");
                    model.extend(new);
                }
                Op::Truncate(back) => {
                    let keep = model.len().saturating_sub(back).max(purged.map_or(0, |p| p as usize + 1));
                    if keep < model.len() {
                        let last = keep.checked_sub(1).map(|i| log_id(model[i].term, 1, i as u64));
                        log.truncate_after(last).expect("truncate");
                        model.truncate(keep);
                    }
                }
                Op::Purge(per_mille) => {
                    if !model.is_empty() {
                        let upto = (model.len() - 1) * per_mille as usize / 1000;
                        if purged.is_none_or(|p| upto as u64 > p) {
                            log.purge(log_id(model[upto].term, 1, upto as u64)).expect("purge");
                            purged = Some(upto as u64);
                        }
                    }
                }
                Op::Reopen => {
                    log.sync().expect("sync");
                    drop(log);
                    log = PartitionLog::open(&path, config(), flusher.clone()).expect("reopen");
                }
            }
            check(&log, &model, purged);
        }
    }
}

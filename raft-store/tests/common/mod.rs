//! Helpers shared by the raft-store integration tests.
#![allow(dead_code, missing_docs)]

use bytes::Bytes;
use ferrolog_raft_store::types::{Entry, EntryPayload, log_id};
use ferrolog_raft_store::{LogStore, RecordBatch};
use openraft::storage::RaftLogStorage;

/// Records in the batch at `index`: 1 to 5, a pure function of the index.
pub fn record_count(index: u64) -> u32 {
    1 + (index % 5) as u32
}

/// The payload bytes of the batch at `index`: recognisable and index-specific.
pub fn payload(index: u64, len: usize) -> Bytes {
    let mut v = format!("entry-{index}:").into_bytes();
    while v.len() < len {
        v.push(b'a' + (v.len() as u64 * 7 + index).rem_euclid(26) as u8);
    }
    v.truncate(len.max(8));
    Bytes::from(v)
}

/// A deterministic record-batch entry for `index` in `term`.
pub fn entry(term: u64, index: u64, len: usize) -> Entry {
    Entry {
        log_id: log_id(term, 1, index),
        payload: EntryPayload::Normal(RecordBatch {
            record_count: record_count(index),
            first_timestamp_ms: 1_000 + index as i64 * 10,
            max_timestamp_ms: 1_000 + index as i64 * 10 + 5,
            producer_id: -1,
            producer_epoch: 0,
            base_sequence: 0,
            records: payload(index, len),
        }),
    }
}

/// Offset of the first record of the batch at `index` when the log starts
/// at index 0 and every entry is `entry(_, i, _)`.
pub fn base_offset(index: u64) -> u64 {
    (0..index).map(|i| u64::from(record_count(i))).sum()
}

/// Appends and waits until the flusher reports the entries durable.
pub async fn append_durable(store: &mut LogStore, entries: Vec<Entry>) -> std::io::Result<()> {
    let (cb, done) = ferrolog_raft_store::types::flush_signal();
    store.append(entries, cb).await?;
    done.await
}

/// Applies entries to a state machine as openraft would, without responders.
pub async fn apply_all(sm: &mut ferrolog_raft_store::PartitionStateMachine, entries: Vec<Entry>) {
    use openraft::storage::RaftStateMachine;
    let stream = futures::stream::iter(entries.into_iter().map(|e| Ok((e, None))));
    sm.apply(stream).await.expect("apply");
}

/// A record batch identified by a number, for Raft-level tests.
pub struct Batch(pub RecordBatch);

impl Batch {
    pub fn numbered(id: u64) -> Self {
        Batch(RecordBatch {
            record_count: 1 + (id % 3) as u32,
            first_timestamp_ms: id as i64,
            max_timestamp_ms: id as i64,
            producer_id: -1,
            producer_epoch: 0,
            base_sequence: 0,
            records: payload(id, 64 + (id % 5) as usize * 100),
        })
    }
}

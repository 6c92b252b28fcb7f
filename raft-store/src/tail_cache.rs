//! A bounded in-memory copy of the newest log entries, so Raft replication
//! and apply read recent entries without touching disk.

use std::collections::VecDeque;

use crate::types::{Entry, EntryPayload};

/// The newest entries of the log, contiguous by index, within a byte budget.
#[derive(Debug)]
pub struct TailCache {
    entries: VecDeque<Entry>,
    bytes: u64,
    bytes_max: u64,
}

fn weight(e: &Entry) -> u64 {
    match &e.payload {
        EntryPayload::Normal(b) => b.records.len() as u64 + 64,
        _ => 64,
    }
}

impl TailCache {
    /// An empty cache holding at most `bytes_max` bytes of payload.
    pub fn new(bytes_max: u64) -> Self {
        Self { entries: VecDeque::new(), bytes: 0, bytes_max }
    }

    /// Adds an entry; it must directly follow the newest cached one (the
    /// cache is emptied otherwise, which is always safe). Evicts the oldest
    /// entries to stay within budget.
    pub fn push(&mut self, e: Entry) {
        if self.entries.back().is_some_and(|b| b.log_id.index + 1 != e.log_id.index) {
            self.clear();
        }
        self.bytes += weight(&e);
        self.entries.push_back(e);
        while self.bytes > self.bytes_max {
            match self.entries.pop_front() {
                Some(old) => self.bytes -= weight(&old),
                None => break,
            }
        }
    }

    /// Index of the oldest cached entry.
    pub fn first_index(&self) -> Option<u64> {
        self.entries.front().map(|e| e.log_id.index)
    }

    /// Clones of the cached entries with index in `start..end`.
    pub fn range(&self, start: u64, end: u64) -> impl Iterator<Item = Entry> + '_ {
        let first = self.first_index().unwrap_or(u64::MAX);
        let skip = start.saturating_sub(first) as usize;
        self.entries.iter().skip(skip).take_while(move |e| e.log_id.index < end).cloned()
    }

    /// Drops entries with index ≥ `index` (log truncation).
    pub fn truncate_from(&mut self, index: u64) {
        while self.entries.back().is_some_and(|e| e.log_id.index >= index) {
            if let Some(e) = self.entries.pop_back() {
                self.bytes -= weight(&e);
            }
        }
    }

    /// Drops entries with index ≤ `index` (purge).
    pub fn purge_to(&mut self, index: u64) {
        while self.entries.front().is_some_and(|e| e.log_id.index <= index) {
            if let Some(e) = self.entries.pop_front() {
                self.bytes -= weight(&e);
            }
        }
    }

    /// Empties the cache.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }
}

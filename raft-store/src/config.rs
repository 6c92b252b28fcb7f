//! Configuration of one partition replica's storage.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// When appended entries are made durable before openraft is told so.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "policy")]
pub enum FlushPolicy {
    /// fsync before every append is acknowledged to Raft (group-committed
    /// with other partitions of the same data directory). The default: an
    /// acknowledged record survives the simultaneous loss of power of every
    /// replica.
    Always,
    /// Acknowledge appends once written to the page cache, and fsync at most
    /// every `interval_ms` milliseconds. **Unsafe against simultaneous power
    /// loss of a majority**: acknowledged records that were not yet flushed on
    /// a majority can be lost. Kafka's default (`flush.messages` unset)
    /// carries the same caveat and relies on replication alone. A replica
    /// that reopens after an unclean stop under this policy is marked
    /// recovering (see `PartitionLog::recovering`): it cannot prove it kept
    /// what it acknowledged.
    Interval {
        /// Maximum time between fsyncs, ms.
        interval_ms: u64,
    },
}

/// Storage settings of one partition replica. Units are in the names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// Roll to a new segment file once the active one reaches this size,
    /// bytes. Default 1 GiB (Kafka's `segment.bytes`).
    pub segment_bytes: u64,
    /// Roll to a new segment file once the active one is this old, ms.
    /// Default 7 days (Kafka's `segment.ms`).
    pub segment_ms: u64,
    /// Add a sparse index row after at least this many bytes of frames,
    /// bytes. Default 4 KiB (Kafka's `index.interval.bytes`).
    pub index_interval_bytes: u64,
    /// How appends are made durable.
    pub flush: FlushPolicy,
    /// Budget of the in-memory cache of the log tail, bytes of payload. Raft
    /// replication and apply read recent entries from it, not from disk.
    pub tail_cache_bytes: u64,
    /// Once fsynced, the active segment's bytes more than this far behind
    /// its end are dropped from the OS page cache (`posix_fadvise(2)`
    /// `POSIX_FADV_DONTNEED`, by the flusher after the sync, at least
    /// [`crate::segment::CACHE_DROP_STEP_BYTES`] at a time), bytes; 0:
    /// never. Consumers within this distance of the end read from memory,
    /// further behind from disk. The page cache then recycles pages instead
    /// of growing with every byte written, which costs little on bare metal
    /// but a page fault of the hypervisor per new page on a virtual machine
    /// that returns free memory to its host (`benches/LOG.md`, 2026-12-05).
    /// Apache BookKeeper drops its journal's pages the same way
    /// (`journalRemoveFromPageCache`). Default 64 MiB.
    pub page_cache_drop_behind_bytes: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            segment_bytes: 1 << 30,
            segment_ms: 7 * 24 * 3600 * 1000,
            index_interval_bytes: 4096,
            flush: FlushPolicy::Always,
            tail_cache_bytes: 8 << 20,
            page_cache_drop_behind_bytes: 64 << 20,
        }
    }
}

/// A configuration value outside its allowed range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid storage config: {0}")]
pub struct ConfigError(pub String);

impl StoreConfig {
    /// Checks every value is in range.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.segment_bytes < 4096 {
            return Err(ConfigError(format!("segment_bytes = {} is below 4096", self.segment_bytes)));
        }
        if self.segment_ms == 0 {
            return Err(ConfigError("segment_ms must be > 0".into()));
        }
        if self.index_interval_bytes == 0 {
            return Err(ConfigError("index_interval_bytes must be > 0".into()));
        }
        if let FlushPolicy::Interval { interval_ms: 0 } = self.flush {
            return Err(ConfigError("flush interval_ms must be > 0".into()));
        }
        Ok(())
    }

    /// `segment_ms` as a duration.
    pub fn segment_age_max(&self) -> Duration {
        Duration::from_millis(self.segment_ms)
    }
}

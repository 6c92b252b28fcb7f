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
    /// `POSIX_FADV_DONTNEED`, by the flusher after the sync, in whole
    /// [`crate::segment::CACHE_DROP_STEP_BYTES`]), bytes; 0: never, as
    /// Kafka, whose readers count on the page cache. `None` (the default,
    /// the key left out): [`AUTO_DROP_BEHIND_BYTES`] on a machine that
    /// returns free memory to its host ([`host_reclaims_free_memory`]),
    /// else 0. There each page the page cache takes that was not used
    /// recently is a fault in the hypervisor, and dropping lets it reuse
    /// pages instead of growing with every byte written (`benches/LOG.md`,
    /// 2026-12-05: 57–59% of a 1 KiB produce run's CPU went to copying
    /// written bytes into new page-cache pages). Consumers within this
    /// distance of the active segment's end read from memory, further back
    /// from the disk. Not dropped: the end of each sealed segment (up to
    /// this much, more when a flush request's range, at most
    /// [`crate::segment::CACHE_DROP_MAX_BYTES`], fell behind: under `flush =
    /// interval` with more written per interval, or a large segment
    /// reopened), left to the kernel to evict; a segment that never grows
    /// past this plus 1 MiB (`segment.bytes` ≤ 65 MiB at 64 MiB) drops
    /// nothing. Apache BookKeeper drops the pages of its journal, which
    /// nobody reads, the same way (`journalRemoveFromPageCache`); here the
    /// segments also serve reads.
    pub page_cache_drop_behind_bytes: Option<u64>,
}

/// The drop distance of [`StoreConfig::page_cache_drop_behind_bytes`] left
/// out on a machine that returns free memory to its host, bytes.
pub const AUTO_DROP_BEHIND_BYTES: u64 = 64 << 20;

/// Whether this machine hands free memory back to its host: a virtio
/// balloon device whose driver negotiated free page reporting
/// (`VIRTIO_BALLOON_F_PAGE_REPORTING`, feature bit 5, virtio 1.2 §5.5.3;
/// Linux's `VIRTIO_BALLOON_F_REPORTING`; sysfs `features` lists the
/// negotiated bits as `0`/`1`, bit 0 first). Read once per process; logged
/// once when true.
pub fn host_reclaims_free_memory() -> bool {
    static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DETECTED.get_or_init(|| {
        let Ok(devices) = std::fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon") else {
            return false;
        };
        let reporting = devices.filter_map(|d| d.ok()).any(|d| {
            std::fs::read_to_string(d.path().join("features"))
                .is_ok_and(|f| f.as_bytes().get(5) == Some(&b'1'))
        });
        if reporting {
            tracing::info!(
                drop_behind_bytes = AUTO_DROP_BEHIND_BYTES,
                "this machine returns free memory to its host (virtio-balloon free page reporting): fsynced \
                 segment pages further behind the end leave the page cache; \
                 storage.page_cache_drop_behind_bytes sets this (0: never)"
            );
        }
        reporting
    })
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            segment_bytes: 1 << 30,
            segment_ms: 7 * 24 * 3600 * 1000,
            index_interval_bytes: 4096,
            flush: FlushPolicy::Always,
            tail_cache_bytes: 8 << 20,
            page_cache_drop_behind_bytes: None,
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
        if let Some(n) = self.page_cache_drop_behind_bytes
            && n != 0
            && n < crate::segment::CACHE_DROP_STEP_BYTES
        {
            return Err(ConfigError(format!(
                "page_cache_drop_behind_bytes = {n} must be 0 (never) or at least {}",
                crate::segment::CACHE_DROP_STEP_BYTES
            )));
        }
        Ok(())
    }

    /// The page-cache drop distance in force, bytes (0: never): as
    /// configured, or where left out as [`host_reclaims_free_memory`]
    /// decides.
    pub fn page_cache_drop_behind(&self) -> u64 {
        self.page_cache_drop_behind_bytes
            .unwrap_or_else(|| if host_reclaims_free_memory() { AUTO_DROP_BEHIND_BYTES } else { 0 })
    }

    /// `segment_ms` as a duration.
    pub fn segment_age_max(&self) -> Duration {
        Duration::from_millis(self.segment_ms)
    }
}

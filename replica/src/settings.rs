//! The Raft settings every group on a broker runs with, validated once.

use std::sync::Arc;
use std::time::Duration;

/// Raft entries kept after a snapshot, so a briefly lagging follower
/// catches up from the log instead of a snapshot (and a workaround for
/// openraft issue #2116: no purge past what Raft has applied; retention's
/// purges, `broker::control::retention`, stop at applied entries).
pub const LOG_KEPT_AFTER_SNAPSHOT: u64 = 1000;

/// How long a leader waits for a follower to install a snapshot, ms.
pub const INSTALL_SNAPSHOT_TIMEOUT_MS: u64 = 60_000;

/// Raft timings and limits of a group, in Ferrolog's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// A leader's heartbeat period, ms (Raft paper §5.2).
    pub heartbeat_interval_ms: u64,
    /// Shortest randomised election timeout, ms (Raft paper §5.2).
    pub election_timeout_min_ms: u64,
    /// Longest randomised election timeout, ms; also the leader lease.
    pub election_timeout_max_ms: u64,
    /// Build a snapshot after this many applied entries; `None`: never.
    pub snapshot_after_entries: Option<u64>,
    /// Most entries in one AppendEntries request.
    pub max_payload_entries: u64,
}

/// Settings that passed validation, shared by every group of a broker.
#[derive(Clone, Debug)]
pub struct ValidSettings {
    pub(crate) raft: Arc<openraft::Config>,
    pub(crate) timings: Timings,
    /// How long a commit notice waits for the next AppendEntries of its
    /// stream to carry it (`commit_notice`).
    pub(crate) commit_notice_hold: Duration,
}

/// The timings a running group uses, for the broker's own loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timings {
    /// A leader's heartbeat period.
    pub heartbeat_interval: Duration,
    /// Shortest election timeout.
    pub election_timeout_min: Duration,
    /// Longest election timeout: also how long a leader's lease lasts after
    /// a quorum acknowledged it (Raft thesis §6.4).
    pub election_timeout_max: Duration,
}

/// Settings the Raft library refuses.
#[derive(Debug, thiserror::Error)]
#[error("raft settings: {0}")]
pub struct SettingsError(String);

impl Settings {
    /// Checks the settings and fixes the behaviour every Ferrolog group
    /// relies on (pre-vote, no restored leadership, accepted log reversion).
    ///
    /// # Errors
    /// [`SettingsError`] for inconsistent timings (e.g. an election timeout
    /// not above the heartbeat interval, or a minimum not below the maximum).
    pub fn validate(self) -> Result<ValidSettings, SettingsError> {
        let config = openraft::Config {
            cluster_name: "ferrolog".into(),
            heartbeat_interval: self.heartbeat_interval_ms,
            election_timeout_min: self.election_timeout_min_ms,
            election_timeout_max: self.election_timeout_max_ms,
            snapshot_policy: match self.snapshot_after_entries {
                Some(n) => openraft::SnapshotPolicy::LogsSinceLast(n),
                None => openraft::SnapshotPolicy::Never,
            },
            max_in_snapshot_log_to_keep: LOG_KEPT_AFTER_SNAPSHOT,
            install_snapshot_timeout: INSTALL_SNAPSHOT_TIMEOUT_MS,
            max_payload_entries: self.max_payload_entries,
            // Pre-vote (Raft thesis §9.6): a node that cannot win does not bump
            // terms and depose a healthy leader.
            enable_pre_vote: Some(true),
            // A restarted leader must win a new election (and commit a blank
            // entry of its new term) before it serves: restored as leader of its
            // old term it would serve a high watermark from its lazily saved
            // commit index, behind what it had acknowledged.
            enable_leader_restore: Some(false),
            // A follower whose log was found damaged keeps only its valid
            // prefix (the broker's recovery): its leader must accept that its
            // log went back and send the rest again, instead of treating it as
            // a bug. Such a follower does not vote meanwhile, so a reverted log
            // never decides an election.
            allow_log_reversion: Some(true),
            // Ring buffers of per-entry latency the library keeps only for
            // its `runtime-stats` feature (not built), allocated per group
            // all the same: the smallest allowed.
            log_stage_capacity: Some(1),
            ..openraft::Config::default()
        };
        let raft = config.validate().map_err(|e| SettingsError(e.to_string()))?;
        let timings = Timings {
            heartbeat_interval: Duration::from_millis(self.heartbeat_interval_ms),
            election_timeout_min: Duration::from_millis(self.election_timeout_min_ms),
            election_timeout_max: Duration::from_millis(self.election_timeout_max_ms),
        };
        Ok(ValidSettings { raft: Arc::new(raft), timings, commit_notice_hold: crate::commit_notice::HOLD })
    }
}

impl ValidSettings {
    /// The timings.
    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// These settings with commit notices (AppendEntries that only carry a
    /// new commit index) held up to `hold` for the next AppendEntries of
    /// their replication stream to carry them, instead of 10 ms; zero sends
    /// each at once. A follower learns the commit index up to `hold` later
    /// when no write follows: for a group whose followers answer reads from
    /// what they applied (the metadata group: every broker answers Metadata
    /// from its own image), use zero.
    #[must_use]
    pub fn with_commit_notice_hold(mut self, hold: Duration) -> Self {
        self.commit_notice_hold = hold;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            heartbeat_interval_ms: 100,
            election_timeout_min_ms: 500,
            election_timeout_max_ms: 1000,
            snapshot_after_entries: Some(10),
            max_payload_entries: 64,
        }
    }

    #[test]
    fn inconsistent_timings_are_refused() {
        assert!(settings().validate().is_ok());
        let bad = Settings { election_timeout_min_ms: 2000, ..settings() };
        assert!(bad.validate().is_err());
        let bad = Settings { heartbeat_interval_ms: 600, ..settings() };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn timings_are_the_settings_in_durations() {
        let t = settings().validate().expect("valid").timings();
        assert_eq!(t.heartbeat_interval, Duration::from_millis(100));
        assert_eq!(t.election_timeout_max, Duration::from_secs(1));
    }
}

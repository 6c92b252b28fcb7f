//! Retention (Kafka's `cleanup.policy=delete` with `retention.ms` and
//! `retention.bytes`): every `retention.check_interval_ms`, the leader of
//! each partition whose topic deletes decides a new log start offset on a
//! segment boundary of its own log and replicates the decision through the
//! partition's Raft log as a control entry ([`Control::LogStart`]). Every
//! replica applies it at the same log position, so all serve from the same
//! offset; offsets never shift.
//!
//! A segment wholly below the log start is deleted once Raft no longer
//! needs its entries (a follower that needs them gets a snapshot, which
//! holds only retained segments): a replica that holds retired segments
//! builds a snapshot (which leaves them out, and replaces the one that
//! linked them), waits for it, and purges Raft's log through them, which
//! deletes them.
//!
//! Besides the check every `retention.check_interval_ms`, the task looks,
//! as soon as it is woken and at least every [`EVENT_POLL`], for
//! partitions whose log rolled its active segment
//! or moved its log start ([`Replica::segment_events`], a lock-free counter
//! per replica, and a watched one for the whole process so an idle broker
//! scans nothing) and runs
//! the same steps for them at once: the leader decides when a segment
//! seals, a follower deletes when the new log start applies. Partitions
//! of one round step side by side (up to [`STEPS_AT_ONCE`]), so a stuck
//! one does not delay the others of its round (the next round waits for
//! the slowest step of this one: at most a proposal's 5 s). A step that cannot finish (followers behind, a snapshot still
//! building) is retried a second later, then less often while it keeps
//! failing (up to [`RETRY_MAX`] apart). So disk use follows the limits
//! within about a segment and a snapshot's time, not a few check intervals.
//!
//! ```text
//!  leader, each check or roll: segments ─decide─> new log start ─propose─> Raft commit
//!  every replica: apply control entry ─> log start (persisted)
//!  every replica, each check, roll or log start move:
//!      retired segments? ─> snapshot, wait for it ─> Raft purge through them ─> deleted
//! ```
//!

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use ferrolog_raft_store::{Control, SegmentSummary};
use futures::StreamExt;
use tokio::sync::watch;

use crate::control::liveness::Liveness;
use crate::groups::GroupRegistry;
use crate::metadata::image::MetadataImage;
use crate::metadata::topic_config::TopicDefaults;
use crate::partition::Partition;

/// The minor peer protocol version every broker needs before a leader
/// writes control entries (a 1.8 follower does not decode the frame).
pub const CONTROL_ENTRIES_MINOR: u32 = 9;

/// A topic's retention limits, from its effective configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `retention.ms`: ms a segment is kept after its newest record; -1: no limit.
    pub retention_ms: i64,
    /// `retention.bytes`: bytes a partition keeps; -1: no limit.
    pub retention_bytes: i64,
}

impl Limits {
    /// The limits of a topic with `overrides` on a broker with `defaults`;
    /// `None` when its `cleanup.policy` does not delete or neither limit is set.
    pub fn of(
        defaults: &TopicDefaults,
        overrides: &std::collections::BTreeMap<String, String>,
    ) -> Option<Self> {
        if !defaults.value(overrides, "cleanup.policy").split(',').any(|p| p == "delete") {
            return None;
        }
        let get = |k: &str| defaults.value(overrides, k).parse::<i64>().unwrap_or(-1);
        let limits = Limits { retention_ms: get("retention.ms"), retention_bytes: get("retention.bytes") };
        (limits.retention_ms >= 0 || limits.retention_bytes >= 0).then_some(limits)
    }
}

/// The log start offset retention moves a partition to, if it moves:
/// the end of the last of the oldest sealed segments that are all over a
/// limit (never the active segment, the last of `segments`). By time, a
/// segment is over when its newest record is older than `retention_ms`;
/// its newest record's time is its largest timestamp, but never later than
/// the file's last write, so a future-dated timestamp cannot keep a segment
/// forever. By size, the oldest segments go while the partition stays at or
/// above `retention_bytes` without them (Kafka's rule). Independent of
/// timestamps.
pub fn new_log_start(segments: &[SegmentSummary], now_ms: i64, limits: Limits, current: u64) -> Option<u64> {
    let sealed = &segments[..segments.len().saturating_sub(1)];
    let mut cut = 0;
    if limits.retention_ms >= 0 {
        cut = sealed
            .iter()
            .take_while(|s| {
                now_ms.saturating_sub(s.max_timestamp_ms.min(s.modified_ms)) > limits.retention_ms
            })
            .count();
    }
    if limits.retention_bytes >= 0 {
        let total: u64 = segments.iter().map(|s| s.size_bytes).sum();
        let mut excess = i128::from(total) - i128::from(limits.retention_bytes);
        let mut by_size = 0;
        for s in sealed {
            if excess - i128::from(s.size_bytes) < 0 {
                break;
            }
            excess -= i128::from(s.size_bytes);
            by_size += 1;
        }
        cut = cut.max(by_size);
    }
    let start = sealed.get(cut.checked_sub(1)?)?.next_offset;
    (start > current).then_some(start)
}

/// How often the retention task looks whether a retry is due, or whether
/// any log rolled a segment or moved its log start (one counter per data
/// directory, `Flusher::segment_events_total`; the task is also woken at
/// once on each such event by `Flusher::segment_event_after`); only when
/// the counter moved does it look for which partitions did.
pub const EVENT_POLL: Duration = Duration::from_millis(25);

/// After a step that could not finish (followers not caught up, a snapshot
/// still building, a proposal that failed), the partition is looked at
/// again this much later, writes or not (longer after several in a row:
/// [`Retry::delay`]).
const RETRY: Duration = Duration::from_secs(1);

/// Runs retention on this broker until the task is dropped: every
/// `interval` for every hosted partition, and within [`EVENT_POLL`] for one
/// whose log rolled a segment or moved its log start (or whose last step
/// asked to be retried). For each, decides if it leads the partition (while
/// every live broker speaks [`CONTROL_ENTRIES_MINOR`] or later), then lets
/// Raft purge any retired segments ([`purge_retired`]). `flusher` is the
/// data directory's, whose count of segment events wakes it.
pub async fn run(
    groups: GroupRegistry,
    image: watch::Receiver<Arc<MetadataImage>>,
    defaults: Arc<TopicDefaults>,
    liveness: Liveness,
    interval: Duration,
    flusher: ferrolog_raft_store::Flusher,
) {
    // The first check one interval after start (Kafka waits
    // `log.initial.task.delay.ms`): a broker that just started has other work.
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut poll = tokio::time::interval(EVENT_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Per Raft group: the segment event count last seen, the purge asked
    // for and not seen done, and when to retry a step that did not finish
    // (with how many in a row did not).
    let mut seen: BTreeMap<u64, u64> = BTreeMap::new();
    let mut purges: BTreeMap<u64, AskedPurge> = BTreeMap::new();
    let mut retry: BTreeMap<u64, Retry> = BTreeMap::new();
    let mut total_seen = flusher.segment_events_total();
    loop {
        let every = tokio::select! {
            _ = tick.tick() => true,
            _ = poll.tick() => false,
            () = flusher.segment_event_after(total_seen) => false,
        };
        let now = Instant::now();
        let partitions = if every {
            let all = groups.partitions();
            let hosted: std::collections::BTreeSet<u64> = all.iter().map(|p| p.group).collect();
            seen.retain(|g, _| hosted.contains(g));
            purges.retain(|g, _| hosted.contains(g));
            retry.retain(|g, _| hosted.contains(g));
            all
        } else {
            let total = flusher.segment_events_total();
            if total == total_seen && !retry.values().any(|r| r.at <= now) {
                continue;
            }
            total_seen = total;
            let found = groups.partitions_matching(|p| {
                seen.get(&p.group) != Some(&p.replica.segment_events())
                    || retry.get(&p.group).is_some_and(|r| r.at <= now)
            });
            // A due retry of a partition no longer hosted would make every
            // poll scan again: it goes.
            retry.retain(|g, r| r.at > now || found.iter().any(|p| p.group == *g));
            found
        };
        let img = image.borrow().clone();
        let old = liveness.older_than(CONTROL_ENTRIES_MINOR);
        let due: Vec<(Arc<Partition>, Option<AskedPurge>)> = partitions
            .into_iter()
            .filter_map(|p| {
                let first_sight = seen.insert(p.group, p.replica.segment_events()).is_none();
                // A replica just opened: its first check comes with the next interval's.
                (every || !first_sight).then(|| {
                    let asked = purges.remove(&p.group);
                    (p, asked)
                })
            })
            .collect();
        // Partitions step side by side, so one that waits (a proposal
        // without a quorum, a slow snapshot) holds back no other of this
        // round; the next round starts when the slowest is done.
        let (img, defaults, old) = (&img, &defaults, &old);
        let outcomes: Vec<(u64, bool, Option<AskedPurge>)> = futures::stream::iter(due)
            .map(|(p, mut asked)| async move {
                let started = Instant::now();
                let decided = !(old.is_empty() && p.raft.is_leader()) || decide(&p, img, defaults).await;
                let decide_took = started.elapsed();
                // A periodic pass over every partition does not wait for
                // snapshots; a partition that needs one comes back by `retry`.
                let done = purge_retired(&p, &mut asked, !every).await;
                tracing::debug!(topic = %p.topic, partition = p.partition, decided, done,
                    decide_ms = decide_took.as_millis() as u64,
                    purge_ms = (started.elapsed() - decide_took).as_millis() as u64, "retention step");
                (p.group, decided && done, asked)
            })
            .buffer_unordered(STEPS_AT_ONCE)
            .collect()
            .await;
        for (group, finished, asked) in outcomes {
            if let Some(a) = asked {
                purges.insert(group, a);
            }
            if finished {
                retry.remove(&group);
            } else {
                let failed = retry.get(&group).map_or(0, |r| r.failed.saturating_add(1));
                retry.insert(group, Retry { at: Instant::now() + Retry::delay(failed), failed });
            }
        }
    }
}

/// How many partitions' retention steps run at once.
const STEPS_AT_ONCE: usize = 16;

/// A partition whose last retention step did not finish.
#[derive(Clone, Copy, Debug)]
struct Retry {
    /// When to look at it again, writes or not.
    at: Instant,
    /// Unfinished steps in a row, less one.
    failed: u32,
}

impl Retry {
    /// [`RETRY`] after the first unfinished step, doubling with each
    /// further one up to [`RETRY_MAX`]: a partition that stays stuck
    /// (followers down, no quorum) is not retried every second for ever.
    /// A segment roll or log start move still brings it back at once.
    fn delay(failed: u32) -> Duration {
        RETRY.saturating_mul(1 << failed.min(5)).min(RETRY_MAX)
    }
}

/// The longest wait between retries of a step that keeps not finishing.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// A purge asked of Raft and not seen done yet.
#[derive(Clone, Copy, Debug)]
struct AskedPurge {
    /// Through this log index.
    index: u64,
    /// When.
    at: Instant,
}

/// A follower silent this long does not hold a leader's retention purge back.
const SILENT_FOLLOWER: Duration = Duration::from_secs(10);

/// How long [`purge_retired`] waits for a purge asked of Raft earlier.
const PURGE_WAIT: Duration = Duration::from_millis(500);

/// How long [`purge_retired`] waits for the snapshot it started.
const SNAPSHOT_WAIT: Duration = Duration::from_secs(2);

/// How long a purge Raft has not done yet holds this replica's retention
/// back; then it is forgotten (openraft may have dropped it: a leader that
/// deferred it for a lagging follower and lost leadership, a Raft instance
/// restarted after dormancy).
const ASKED_PURGE_MAX: Duration = Duration::from_secs(10);

/// Lets Raft purge the entries of segments retention retired, so they are
/// deleted; returns whether nothing is left to do (else the caller retries
/// after [`Retry::delay`]):
///
/// - Retired segments whose entries no snapshot covers yet, or a snapshot
///   older than the log start (it hard-links segments retired since, and
///   would keep their disk space after the purge): a new snapshot (it
///   leaves them out, and replaces the old one); with `wait`, waited for
///   (a snapshot newer than the one before, up to [`SNAPSHOT_WAIT`]).
/// - Retired segments whose entries the current snapshot covers and Raft
///   has applied: purge through them (never past applied entries: openraft
///   issue #2116's race needs a purge past what the core applied). A
///   leader purges only once every follower that answers has matched them:
///   openraft holds a purge back while it sends those entries.
/// - None left, but the current snapshot is older than the log start: a
///   snapshot, so retired files it hard-linked are let go.
///
/// So about one snapshot per segment event. Each hard-links the segments
/// (the active one with its length recorded) and fsyncs: the price of
/// keeping disk use near the limit while writing.
///
/// While a purge asked for earlier (`pending`) has not
/// happened, for up to [`ASKED_PURGE_MAX`], retention starts nothing here:
/// a snapshot's own purge would go below the pending one, which openraft's
/// debug assertions refuse. (Compaction's snapshots and openraft's own,
/// every `snapshot_after_entries`, do not look at it.)
async fn purge_retired(p: &Partition, pending: &mut Option<AskedPurge>, wait: bool) -> bool {
    if let Some(asked) = *pending {
        let purged = || p.raft.state(|s| s.purged().is_some_and(|l| l.index >= asked.index));
        // Raft runs a purge in turn with the log writes queued before it: at
        // high write rates the next segment event often comes first. Waiting
        // for it here (up to PURGE_WAIT) beats a retry a second later.
        let deadline = Instant::now() + PURGE_WAIT;
        while wait && !purged() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let done = purged();
        if !done && asked.at.elapsed() < ASKED_PURGE_MAX {
            return false;
        }
        if !done {
            tracing::debug!(topic = %p.topic, partition = p.partition, index = asked.index,
                "retention: a purge asked {:?} ago has not happened; going on", asked.at.elapsed());
        }
        *pending = None;
    }
    let replica = p.replica.clone();
    let Ok((retired, stale_snapshot)) =
        ferrolog_raft_store::runtime::blocking(&**p.replica.fs(), move || {
            let retired = replica.retired_through_index();
            let stale = replica.snapshot_behind_log_start();
            (retired, stale)
        })
        .await
    else {
        return false;
    };
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        tracing::debug!(topic = %p.topic, partition = p.partition, "retention {what}: {e}");
    };
    let snapshot_index = || p.raft.state(|s| s.snapshot().map(|l| l.index));
    let Some(upto) = retired else {
        if stale_snapshot && let Err(e) = p.raft.build_snapshot().await {
            fail("snapshot", &e);
            return false;
        }
        return true;
    };
    if p.raft.state(|s| s.purged().is_some_and(|l| l.index >= upto)) {
        return true; // purged already; the files go with the next deletion pass
    }
    let covered = || {
        p.raft.state(|s| {
            s.snapshot().is_some_and(|l| l.index >= upto) && s.last_applied().is_some_and(|l| l.index >= upto)
        })
    };
    if !covered() || stale_snapshot {
        let before = snapshot_index();
        if let Err(e) = p.raft.build_snapshot().await {
            fail("snapshot", &e);
            return false;
        }
        if !wait {
            return false;
        }
        let deadline = Instant::now() + SNAPSHOT_WAIT;
        while snapshot_index() <= before || !covered() {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let followers_ok = p.raft.state(|s| {
        let silent: std::collections::BTreeMap<_, _> =
            s.acknowledged_ago().map(|a| a.collect()).unwrap_or_default();
        s.matched().is_none_or(|mut m| {
            m.all(|(node, pos)| {
                pos.is_some_and(|l| l.index >= upto)
                    || silent.get(&node).is_none_or(|ago| ago.is_none_or(|d| d >= SILENT_FOLLOWER))
            })
        })
    });
    if !followers_ok {
        return false;
    }
    match p.raft.purge_log(upto).await {
        Ok(()) => {
            *pending = Some(AskedPurge { index: upto, at: Instant::now() });
            true
        }
        Err(e) => {
            fail("purge", &e);
            false
        }
    }
}

/// One partition's decision, proposed if it moves the log start; returns
/// false when it could not be made or written (the caller retries).
async fn decide(p: &Partition, image: &MetadataImage, defaults: &TopicDefaults) -> bool {
    let Some(limits) = image.topics.get(&p.topic).and_then(|t| Limits::of(defaults, &t.config)) else {
        return true;
    };
    if p.lost_quorum() {
        return false;
    }
    let replica = p.replica.clone();
    let summaries = match ferrolog_raft_store::runtime::blocking(&**p.replica.fs(), move || {
        replica.segment_summaries().map(|s| (s, replica.log_start_offset()))
    })
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::warn!(topic = %p.topic, partition = p.partition, "retention: cannot list segments: {e}");
            return false;
        }
        Err(_) => return false,
    };
    let (segments, current) = summaries;
    let Some(start) = new_log_start(&segments, crate::metadata::controller::now_ms(), limits, current) else {
        return true;
    };
    // Sealed segments may hold entries not committed yet: only committed
    // records are retired (a replica ignores a log start past what it applied).
    if start > p.replica.high_watermark() {
        return false;
    }
    let written = crate::control::propose_control(p, Control::LogStart(start), "retention").await;
    if written {
        tracing::info!(topic = %p.topic, partition = p.partition, from = current, to = start, "retention moved the log start offset");
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_000_000;

    /// Segments of `sizes` bytes, 10 offsets each, newest record at `stamps`.
    fn segs(sizes: &[u64], stamps: &[i64]) -> Vec<SegmentSummary> {
        sizes
            .iter()
            .zip(stamps)
            .enumerate()
            .map(|(i, (size, ts))| SegmentSummary {
                base_offset: i as u64 * 10,
                next_offset: i as u64 * 10 + 10,
                size_bytes: *size,
                max_timestamp_ms: *ts,
                modified_ms: NOW - 1,
            })
            .collect()
    }

    fn limits(retention_ms: i64, retention_bytes: i64) -> Limits {
        Limits { retention_ms, retention_bytes }
    }

    #[test]
    fn by_size_the_oldest_go_while_the_rest_stays_at_or_above_the_limit() {
        let s = segs(&[100, 100, 100, 100], &[NOW; 4]);
        assert_eq!(new_log_start(&s, NOW, limits(-1, 250), 0), Some(10), "400 - 100 ≥ 250, 300 - 100 < 250");
        assert_eq!(new_log_start(&s, NOW, limits(-1, 200), 0), Some(20));
        assert_eq!(new_log_start(&s, NOW, limits(-1, 0), 0), Some(30), "never the active segment");
        assert_eq!(new_log_start(&s, NOW, limits(-1, 400), 0), None);
        assert_eq!(new_log_start(&s, NOW, limits(-1, 200), 20), None, "already there");
    }

    #[test]
    fn by_time_the_oldest_go_while_their_newest_record_is_too_old() {
        let s = segs(&[1, 1, 1, 1], &[NOW - 500, NOW - 400, NOW - 50, NOW - 600]);
        assert_eq!(new_log_start(&s, NOW, limits(100, -1), 0), Some(20), "stops at the first young segment");
        assert_eq!(new_log_start(&s, NOW, limits(1000, -1), 0), None);
        // The active segment is old too, but stays.
        let all_old = segs(&[1, 1], &[NOW - 500, NOW - 500]);
        assert_eq!(new_log_start(&all_old, NOW, limits(100, -1), 0), Some(10));
    }

    #[test]
    fn a_future_timestamp_does_not_keep_a_segment_past_its_last_write() {
        let mut s = segs(&[1, 1, 1], &[i64::MAX, NOW - 500, NOW]);
        s[0].modified_ms = NOW - 500;
        assert_eq!(new_log_start(&s, NOW, limits(100, -1), 0), Some(20));
    }

    #[test]
    fn time_and_size_together_take_the_further() {
        let s = segs(&[100, 100, 100, 100], &[NOW - 500, NOW, NOW, NOW]);
        assert_eq!(new_log_start(&s, NOW, limits(100, 150), 0), Some(20));
        assert_eq!(new_log_start(&s, NOW, limits(100, -1), 0), Some(10));
        assert_eq!(new_log_start(&[], NOW, limits(0, 0), 0), None, "an empty list is no log");
    }

    #[test]
    fn a_step_that_keeps_failing_is_retried_less_often_up_to_a_bound() {
        assert_eq!(Retry::delay(0), RETRY);
        assert_eq!(Retry::delay(1), 2 * RETRY);
        assert_eq!(Retry::delay(3), 8 * RETRY);
        assert_eq!(Retry::delay(5), RETRY_MAX);
        assert_eq!(Retry::delay(u32::MAX), RETRY_MAX, "no overflow");
    }

    #[test]
    fn only_deleting_topics_with_a_limit_have_one() {
        let d = TopicDefaults::default();
        let m = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        assert_eq!(Limits::of(&d, &m(&[])), Some(limits(604_800_000, -1)), "Kafka's default: 7 days");
        assert_eq!(Limits::of(&d, &m(&[("retention.ms", "-1")])), None);
        assert_eq!(Limits::of(&d, &m(&[("cleanup.policy", "compact")])), None);
        assert_eq!(
            Limits::of(&d, &m(&[("cleanup.policy", "compact,delete"), ("retention.bytes", "5")])),
            Some(limits(604_800_000, 5))
        );
    }
}

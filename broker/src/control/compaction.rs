//! Log compaction (Kafka's `cleanup.policy=compact`): every
//! `compaction.check_interval_ms`, the leader of each partition whose topic
//! compacts decides a [`CompactionTarget`] from its own segments and
//! replicates it through the partition's Raft log as a control entry
//! ([`Control::Compact`]); then every replica, leader and followers alike,
//! compacts its own sealed segments to the target by one deterministic
//! rule (`ferrolog_raft_store::compaction`), one partition at a time on
//! the broker's cleaner thread (Kafka's one cleaner thread; at nice 19, see
//! [`crate::control::cleaner`]), throttled to
//! `compaction.io_max_bytes_per_second`.
//!
//! ```text
//!  leader, each check: segments ─decide─> target {through, tombstones_below} ─propose─> Raft commit
//!  every replica: apply control entry ─> target (persisted; the active segment rolls if below it)
//!  every replica, each check: target not reached? ─> key map ─> rewrite sealed segments ─> snapshot
//! ```
//!
//! The leader's decision, by Kafka's settings and their meaning:
//! - `through` is the end of the oldest sealed segments, all committed,
//!   whose last append is at least `min.compaction.lag.ms` old (append time,
//!   the segment file's last write: a record stays uncompacted at least that
//!   long after it was written, whatever timestamp its producer gave it);
//! - it moves when the bytes not compacted yet (from the last target's
//!   `through`) are at least `min.cleanable.dirty.ratio` of the compactable
//!   bytes, or when a segment not compacted yet holds a record older than
//!   `max.compaction.lag.ms`;
//! - `tombstones_below` is the largest earlier `through` that this broker's
//!   replica finished compacting to at least `delete.retention.ms` ago: a tombstone is removed
//!   only once it was in the compacted range that long, so a consumer that
//!   read the key's older value before compaction reached it has that long
//!   to read the deletion (KIP-534). Each broker notes when its replica
//!   finishes a pass, as leader or follower; a broker that restarted, or
//!   whose replica's segments were replaced (a snapshot installed) or cut,
//!   counts from then (later, never earlier).
//! - Every replica also caps the tombstones it removes at its own horizon
//!   (the same rule, from its own finished passes): a replica that lagged,
//!   or became leader after a restart, never removes a value and the
//!   tombstone that shadows it in one pass, which a reader that read the
//!   value before that pass would miss. Replicas may then differ in which
//!   tombstones they still hold, for about `delete.retention.ms` and a
//!   check or two after the target stops moving; once their horizons pass
//!   the target's they hold the same records. A topic no longer compacted
//!   is not compacted further (as Kafka's cleaner skips it).
//!
//! `max.compaction.lag.ms` is judged by a segment's newest record, and the
//! active segment is not rolled for it (Kafka rolls it): a record waits at
//! most until its segment rolls (`segment.ms`, `segment.bytes`) plus the lag.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use ferrolog_raft_store::{CompactionTarget, Control, SegmentSummary};
use tokio::sync::watch;

use crate::control::cleaner::Cleaner;
use crate::control::liveness::Liveness;
use crate::groups::GroupRegistry;
use crate::metadata::image::MetadataImage;
use crate::metadata::topic_config::TopicDefaults;
use crate::partition::Partition;
use crate::partition::records::Codec;

/// The minor peer protocol version every broker needs before a leader
/// writes compaction targets (a 1.9 follower does not decode them).
pub const COMPACTION_MINOR: u32 = 10;

/// A compacted topic's settings, from its effective configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    /// `min.compaction.lag.ms`.
    pub min_lag_ms: i64,
    /// `max.compaction.lag.ms`.
    pub max_lag_ms: i64,
    /// `delete.retention.ms`.
    pub delete_retention_ms: i64,
    /// `min.cleanable.dirty.ratio`, 0 to 1.
    pub min_dirty_ratio: f64,
}

impl Policy {
    /// The policy of a topic with `overrides` on a broker with `defaults`;
    /// `None` when its `cleanup.policy` does not compact.
    pub fn of(
        defaults: &TopicDefaults,
        overrides: &std::collections::BTreeMap<String, String>,
    ) -> Option<Self> {
        if !defaults.compacts(overrides) {
            return None;
        }
        let int = |k: &str, fallback: i64| defaults.value(overrides, k).parse::<i64>().unwrap_or(fallback);
        Some(Policy {
            min_lag_ms: int("min.compaction.lag.ms", 0),
            max_lag_ms: int("max.compaction.lag.ms", i64::MAX),
            delete_retention_ms: int("delete.retention.ms", 86_400_000),
            min_dirty_ratio: defaults.value(overrides, "min.cleanable.dirty.ratio").parse().unwrap_or(0.5),
        })
    }
}

/// The target a leader moves its partition to, if it moves (see the module
/// documentation): from its `segments` (oldest first, the last one active),
/// the time `now_ms`, its `high_watermark`, its `current` target and the
/// targets' `through` offsets it saw applied, with when (ms).
pub fn new_target(
    segments: &[SegmentSummary],
    now_ms: i64,
    policy: Policy,
    current: CompactionTarget,
    high_watermark: u64,
    reached: &Reached,
) -> Option<CompactionTarget> {
    let sealed = &segments[..segments.len().saturating_sub(1)];
    let age = |s: &SegmentSummary| now_ms.saturating_sub(s.modified_ms);
    let cleanable: Vec<&SegmentSummary> = sealed
        .iter()
        .take_while(|s| s.next_offset <= high_watermark && age(s) >= policy.min_lag_ms)
        .collect();
    let through = cleanable.last().map_or(0, |s| s.next_offset);
    let mut target = current;
    if through > current.through {
        let total: u64 = cleanable.iter().map(|s| s.size_bytes).sum();
        let dirty: Vec<&&SegmentSummary> =
            cleanable.iter().filter(|s| s.next_offset > current.through).collect();
        let dirty_bytes: u64 = dirty.iter().map(|s| s.size_bytes).sum();
        let ratio = if total == 0 { 0.0 } else { dirty_bytes as f64 / total as f64 };
        let overdue = dirty.iter().any(|s| {
            s.max_timestamp_ms != i64::MIN
                && now_ms.saturating_sub(s.max_timestamp_ms.min(s.modified_ms)) >= policy.max_lag_ms
        });
        if ratio >= policy.min_dirty_ratio || overdue {
            target.through = through;
        }
    }
    let tombstones_below = reached.horizon(now_ms, policy.delete_retention_ms).min(target.through);
    target.tombstones_below = target.tombstones_below.max(tombstones_below);
    (target != current).then_some(target)
}

/// One replica's [`Reached`] history, valid while its segments'
/// generation ([`ferrolog_raft_store::Replica::segments_generation`]) holds.
#[derive(Clone, Debug, Default)]
struct Horizon {
    generation: u64,
    reached: Reached,
}

/// When this broker saw each compaction target's `through` applied on one
/// replica: `(through, ms since the Unix epoch)`, oldest first. Kept short:
/// a new entry only once the last is `delete.retention.ms / 32` old (a
/// `through` noted later removes tombstones later, never earlier), and
/// entries older than the newest one past `delete.retention.ms` dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reached(Vec<(u64, i64)>);

impl Reached {
    /// Notes that `through` is applied at `now_ms`.
    pub fn note(&mut self, through: u64, now_ms: i64, delete_retention_ms: i64) {
        if self.0.last().is_some_and(|(t, _)| *t >= through) {
            return;
        }
        let spacing = delete_retention_ms / 32;
        if self.0.last().is_none_or(|(_, at)| now_ms.saturating_sub(*at) >= spacing) {
            self.0.push((through, now_ms));
        }
        let past = self.0.iter().rposition(|(_, at)| at.saturating_add(delete_retention_ms) <= now_ms);
        if let Some(i) = past {
            self.0.drain(..i);
        }
    }

    /// The largest `through` applied at least `delete_retention_ms` before
    /// `now_ms` (0 if none).
    pub fn horizon(&self, now_ms: i64, delete_retention_ms: i64) -> u64 {
        self.0
            .iter()
            .filter(|(_, at)| at.saturating_add(delete_retention_ms) <= now_ms)
            .map(|(t, _)| *t)
            .max()
            .unwrap_or(0)
    }
}

/// Runs compaction on this broker every `settings.check_interval_ms` until
/// the task is dropped: decides for the compacted partitions it leads
/// (while every live broker speaks [`COMPACTION_MINOR`] or later), then
/// compacts each hosted replica whose target it has not reached, on the log
/// cleaner ([`Cleaner::for_fs`] on `fs`, the data directory's file system).
pub async fn run(
    groups: GroupRegistry,
    image: watch::Receiver<Arc<MetadataImage>>,
    defaults: Arc<TopicDefaults>,
    liveness: Liveness,
    settings: crate::config::CompactionConfig,
    fs: ferrolog_raft_store::Fs,
) {
    let interval = Duration::from_millis(settings.check_interval_ms);
    let io_max_bytes_per_second = settings.io_max_bytes_per_second;
    let dedupe_buffer_bytes = usize::try_from(settings.dedupe_buffer_bytes).unwrap_or(usize::MAX);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reached: std::collections::HashMap<u64, Horizon> = std::collections::HashMap::new();
    let cleaner = Cleaner::for_fs(fs, "ferrolog-cleaner");
    loop {
        tick.tick().await;
        let img = image.borrow().clone();
        let old = liveness.older_than(COMPACTION_MINOR);
        let partitions = groups.partitions();
        let hosted: std::collections::HashSet<u64> = partitions.iter().map(|p| p.group).collect();
        reached.retain(|group, _| hosted.contains(group));
        for p in partitions {
            let Some(policy) = img.topics.get(&p.topic).and_then(|t| Policy::of(&defaults, &t.config)) else {
                continue; // not (or no longer) compacted
            };
            // What this replica's passes reached, and when: counted afresh
            // when its segments were replaced (a snapshot) or cut.
            let generation = p.replica.segments_generation();
            let seen = reached.entry(p.group).or_default();
            if seen.generation != generation {
                *seen = Horizon { generation, ..Horizon::default() };
            }
            let now = crate::metadata::controller::now_ms();
            if let Some(done) = p.replica.compacted_to() {
                seen.reached.note(done.through, now, policy.delete_retention_ms);
            }
            // Tombstones this replica may remove: below where its own passes
            // finished delete.retention.ms ago (KIP-534), whatever the
            // leader's target says.
            let tombstones_below_max = seen.reached.horizon(now, policy.delete_retention_ms);
            if old.is_empty() && p.raft.is_leader() {
                decide(&p, policy, &seen.reached, now).await;
            }
            compact(&p, io_max_bytes_per_second, dedupe_buffer_bytes, tombstones_below_max, &cleaner).await;
        }
    }
}

/// One partition's decision, proposed if it moves the target.
async fn decide(p: &Partition, policy: Policy, reached: &Reached, now: i64) {
    if p.lost_quorum() {
        return;
    }
    let replica = p.replica.clone();
    let listed = ferrolog_raft_store::runtime::blocking(&**p.replica.fs(), move || {
        replica.segment_summaries().map(|s| (s, replica.compaction_target(), replica.high_watermark()))
    })
    .await;
    let (segments, current, hw) = match listed {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::warn!(topic = %p.topic, partition = p.partition, "compaction: cannot list segments: {e}");
            return;
        }
        Err(_) => return,
    };
    let Some(target) = new_target(&segments, now, policy, current, hw, reached) else { return };
    if crate::control::propose_control(p, Control::Compact(target), "compaction").await {
        tracing::info!(topic = %p.topic, partition = p.partition, through = target.through,
            tombstones_below = target.tombstones_below, "compaction target moved");
    }
}

/// Compacts one replica to its target if it has not reached it, removing
/// tombstones only below `tombstones_below_max` as well (this replica's own
/// horizon, KIP-534), on the `cleaner` thread (else the blocking pool);
/// after a pass that rewrote segments, starts a snapshot so the files the
/// last one hard-linked (the uncompacted originals) are let go.
async fn compact(
    p: &Partition,
    rate: u64,
    map_bytes_max: usize,
    tombstones_below_max: u64,
    cleaner: &Cleaner,
) {
    if !p.replica.compaction_pending(tombstones_below_max) {
        return;
    }
    let replica = p.replica.clone();
    let started = Instant::now();
    let mut throttle = cleaner.throttle(rate);
    let pass = move || {
        replica.compact(&Codec, map_bytes_max, tombstones_below_max, &mut |bytes| throttle.read(bytes))
    };
    let result = cleaner.run(pass).await.ok_or("the pass panicked, or the log cleaner thread is gone");
    let elapsed_ms = started.elapsed().as_millis() as u64;
    match result {
        Ok(Ok(Some(s))) => {
            tracing::info!(topic = %p.topic, partition = p.partition, through = s.target.through,
                tombstones_below = s.target.tombstones_below, keys = s.keys, read_bytes = s.bytes_read,
                segments = s.segments_rewritten, bytes_before = s.bytes_before, bytes_after = s.bytes_after,
                records_removed = s.records_removed, chunks = s.chunks, complete = s.complete, elapsed_ms, "compacted");
            if s.segments_rewritten > 0
                && let Err(e) = p.raft.build_snapshot().await
            {
                tracing::debug!(topic = %p.topic, partition = p.partition, "compaction: snapshot: {e}");
            }
        }
        Ok(Ok(None)) => {}
        Ok(Err(e)) => {
            // Damage a pass read in the log's own segments is repaired as a
            // read's is; anything else (a full disk, a copy of its own that
            // does not verify) waits for the next check.
            let in_the_log = matches!(&e, ferrolog_raft_store::StoreError::Corruption { path, .. }
                if path.extension().is_some_and(|x| x == "seg"));
            if !(in_the_log && p.report_damage(&e, "compaction")) {
                tracing::warn!(topic = %p.topic, partition = p.partition, "compaction failed; retried at the next check: {e}")
            }
        }
        Err(e) => tracing::warn!(topic = %p.topic, partition = p.partition, "compaction task: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 10_000_000;

    /// Segments of 100 bytes, 10 offsets each, last written `ages` ms ago.
    fn segs(ages: &[i64]) -> Vec<SegmentSummary> {
        ages.iter()
            .enumerate()
            .map(|(i, age)| SegmentSummary {
                base_offset: i as u64 * 10,
                next_offset: i as u64 * 10 + 10,
                size_bytes: 100,
                max_timestamp_ms: NOW - age,
                modified_ms: NOW - age,
            })
            .collect()
    }

    fn policy(min_lag_ms: i64, delete_retention_ms: i64, ratio: f64) -> Policy {
        Policy { min_lag_ms, max_lag_ms: i64::MAX, delete_retention_ms, min_dirty_ratio: ratio }
    }

    fn none_reached() -> Reached {
        Reached::default()
    }

    fn t(through: u64, tombstones_below: u64) -> CompactionTarget {
        CompactionTarget { through, tombstones_below }
    }

    #[test]
    fn the_target_covers_sealed_committed_segments_past_the_lag() {
        let s = segs(&[500, 400, 300, 10]);
        let none = CompactionTarget::default();
        assert_eq!(
            new_target(&s, NOW, policy(0, i64::MAX, 0.5), none, 40, &none_reached()),
            Some(t(30, 0)),
            "never the active segment"
        );
        assert_eq!(
            new_target(&s, NOW, policy(350, i64::MAX, 0.5), none, 40, &none_reached()),
            Some(t(20, 0)),
            "the lag"
        );
        assert_eq!(
            new_target(&s, NOW, policy(0, i64::MAX, 0.5), none, 25, &none_reached()),
            Some(t(20, 0)),
            "committed only"
        );
        assert_eq!(new_target(&s, NOW, policy(1000, i64::MAX, 0.5), none, 40, &none_reached()), None);
    }

    #[test]
    fn the_dirty_ratio_or_the_max_lag_moves_it() {
        let s = segs(&[500, 400, 300, 200, 10]);
        // 30 of 40 compacted: 1 dirty segment of 4 is 0.25.
        assert_eq!(new_target(&s, NOW, policy(0, i64::MAX, 0.5), t(30, 0), 50, &none_reached()), None);
        assert_eq!(
            new_target(&s, NOW, policy(0, i64::MAX, 0.25), t(30, 0), 50, &none_reached()),
            Some(t(40, 0))
        );
        let overdue = Policy { max_lag_ms: 150, ..policy(0, i64::MAX, 0.9) };
        assert_eq!(new_target(&s, NOW, overdue, t(30, 0), 50, &none_reached()), Some(t(40, 0)));
    }

    #[test]
    fn tombstones_go_below_throughs_reached_delete_retention_ago() {
        let s = segs(&[500, 400, 300, 200, 10]);
        let mut r = Reached::default();
        r.note(20, NOW - 400, 350);
        r.note(40, NOW - 100, 350);
        // 20 was reached 400 ms ago (≥ 350): tombstones below it go; 40 only 100 ms ago.
        assert_eq!(new_target(&s, NOW, policy(0, 350, 0.5), t(40, 0), 50, &r), Some(t(40, 20)));
        assert_eq!(new_target(&s, NOW, policy(0, 350, 0.5), t(40, 20), 50, &r), None, "nothing new");
        assert_eq!(new_target(&s, NOW, policy(0, 50, 0.99), t(40, 20), 50, &r), Some(t(40, 40)));
        assert_eq!(
            new_target(&s, NOW, policy(0, 0, 0.5), t(0, 0), 50, &r),
            Some(t(40, 40)),
            "never past through"
        );
        assert_eq!(new_target(&[], NOW, policy(0, 0, 0.0), t(0, 0), 0, &r), None, "an empty list is no log");
    }

    #[test]
    fn reached_keeps_few_entries_and_never_dates_a_through_earlier() {
        let day = 86_400_000;
        let mut r = Reached::default();
        for i in 0..10_000 {
            r.note(i + 1, i as i64 * 15_000, day);
        }
        assert!(r.0.len() <= 40, "{} entries", r.0.len());
        let now = 10_000 * 15_000;
        let h = r.horizon(now, day);
        // Reached at i * 15 s: the through reached a day ago is (now - day) / 15 s + 1.
        let exact = ((now - day) / 15_000 + 1) as u64;
        assert!(h <= exact && h + (day / 32 / 15_000) as u64 + 1 >= exact, "horizon {h}, exact {exact}");
        assert_eq!(Reached::default().horizon(now, 0), 0);
    }

    #[test]
    fn an_empty_sealed_segment_is_never_overdue() {
        let mut s = segs(&[500, 400, 10]);
        s[1].max_timestamp_ms = i64::MIN;
        let overdue = Policy { max_lag_ms: 1, ..policy(0, i64::MAX, 0.99) };
        assert_eq!(new_target(&s, NOW, overdue, t(10, 0), 30, &none_reached()), None);
    }

    #[test]
    fn only_compacted_topics_have_a_policy() {
        let d = TopicDefaults::default();
        let m = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        assert_eq!(Policy::of(&d, &m(&[])), None);
        let p = Policy::of(&d, &m(&[("cleanup.policy", "compact,delete"), ("delete.retention.ms", "5")]));
        assert_eq!(p, Some(Policy { delete_retention_ms: 5, ..policy(0, 5, 0.5) }));
    }
}

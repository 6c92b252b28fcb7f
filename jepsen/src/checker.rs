//! The checker: finds anomalies in a recorded history (and in the copies of
//! each partition that every broker holds at the end), as Jepsen's queue
//! checker for Kafka does.
//!
//! Each key is a partition; its *version order* is the offsets at which any
//! value was acknowledged or read. The classes:
//!
//! | class | meaning |
//! |---|---|
//! | `lost-write` | acknowledged, never read, though a read reached a higher offset of its key |
//! | `unseen` | acknowledged, never read by the end (beyond every offset read) |
//! | `duplicate` | one value at two offsets |
//! | `inconsistent-offsets` | two values at one offset (across sends' acknowledgements and reads) |
//! | `nonmonotonic-send` | a process's later send to a key acknowledged at an offset not above its earlier one |
//! | `nonmonotonic-poll` | a consumer's later poll of a key returned an offset not above its earlier one |
//! | `poll-skip` | a consumer's consecutive polls of a key jumped over an offset known to hold a value |
//! | `*-within-op` | the same three inside one send or poll operation |
//! | `aborted-read` | a value whose send definitely failed was read |
//! | `unexpected-value` | a value read that no operation sent (or read under another key) |
//! | `replica-divergence` | a broker's committed copy disagrees with the history or another broker |
//! | `stale-final-value` | compacted topic: the final read's latest record of a key is a value older than the key's latest known record (acknowledged, read, or in a committed copy) |
//! | `lost-final-value` | compacted topic: the final read holds no record of a key at or after its latest known record, which was a value, and no unanswered tombstone can explain it |
//! | `group-undelivered` | consumer group: an acknowledged value no member of the group read |
//! | `group-commit-skip` | consumer group: an acknowledged commit of a position past an acknowledged record that no member had read when the commit was sent |
//!
//! **Compacted topics.** A history whose messages carry record keys is of
//! the `compact` workload; [`compacted`] holds the rules that differ there
//! (what compaction may remove, and the final state of every key).
//!
//! **Consumer groups.** Polls and commits of a group's members (`group`
//! workload) are checked by `group`: at least once, and no commit past
//! what was processed.
//!
//! **Vacuous runs.** [`check_run`] adds the rules of [`vacuity`] (and
//! `copies`): a run that acknowledged too little, whose final read did not
//! finish, or whose brokers' copies are missing, empty, behind or without
//! their committed marker is invalid even without an anomaly.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::{Value as Json, json};

use crate::history::{Key, Op, OpType, Outcome, Value};

mod compacted;
mod copies;
mod group;
pub mod vacuity;
use compacted::Compaction;
pub use copies::{CommittedMarker, committed_end};
use vacuity::{RunFacts, Violation};

/// Every anomaly class the checker reports, in report order.
pub const ANOMALIES: [&str; 17] = [
    LOST_WRITE,
    UNSEEN,
    DUPLICATE,
    INCONSISTENT_OFFSETS,
    NONMONOTONIC_SEND,
    NONMONOTONIC_SEND_WITHIN_OP,
    NONMONOTONIC_POLL,
    NONMONOTONIC_POLL_WITHIN_OP,
    POLL_SKIP,
    POLL_SKIP_WITHIN_OP,
    ABORTED_READ,
    UNEXPECTED_VALUE,
    REPLICA_DIVERGENCE,
    STALE_FINAL_VALUE,
    LOST_FINAL_VALUE,
    group::GROUP_UNDELIVERED,
    group::GROUP_COMMIT_SKIP,
];

/// Acknowledged, never read, below the highest offset read of its key.
pub const LOST_WRITE: &str = "lost-write";
/// Acknowledged and never read by the end.
pub const UNSEEN: &str = "unseen";
/// One value at two offsets.
pub const DUPLICATE: &str = "duplicate";
/// Two values at one offset.
pub const INCONSISTENT_OFFSETS: &str = "inconsistent-offsets";
/// A process's sends to a key acknowledged out of order across operations.
pub const NONMONOTONIC_SEND: &str = "nonmonotonic-send";
/// ... within one send operation.
pub const NONMONOTONIC_SEND_WITHIN_OP: &str = "nonmonotonic-send-within-op";
/// A consumer's polls of a key going backwards (or repeating) across operations.
pub const NONMONOTONIC_POLL: &str = "nonmonotonic-poll";
/// ... within one poll.
pub const NONMONOTONIC_POLL_WITHIN_OP: &str = "nonmonotonic-poll-within-op";
/// A consumer skipping a known offset between consecutive polls.
pub const POLL_SKIP: &str = "poll-skip";
/// ... within one poll.
pub const POLL_SKIP_WITHIN_OP: &str = "poll-skip-within-op";
/// A failed send's value was read.
pub const ABORTED_READ: &str = "aborted-read";
/// A read value no send produced.
pub const UNEXPECTED_VALUE: &str = "unexpected-value";
/// Brokers' copies disagree.
pub const REPLICA_DIVERGENCE: &str = "replica-divergence";
/// Compacted topic: the final state of a key is older than its last
/// acknowledged write.
pub const STALE_FINAL_VALUE: &str = "stale-final-value";
/// Compacted topic: a key's last acknowledged value is gone from the final
/// state, and no write can explain it.
pub const LOST_FINAL_VALUE: &str = "lost-final-value";

/// Most examples kept per class.
pub const EXAMPLES_MAX: usize = 10;

/// One record of a broker's local copy of a partition (from `dump-log`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    /// Its offset.
    pub offset: u64,
    /// Its value.
    pub value: Value,
    /// Below the broker's persisted commit point.
    pub committed: bool,
}

/// A broker's local copy of one partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaCopy {
    /// The broker.
    pub broker: u32,
    /// The partition.
    pub key: Key,
    /// Its records in offset order.
    pub records: Vec<ReplicaRecord>,
    /// The dump's committed marker for it; `None` when the dump printed
    /// none (see [`vacuity::NO_COMMITTED_MARKER`]).
    #[serde(default)]
    pub marker: Option<CommittedMarker>,
}

/// One anomaly class's findings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// How many instances.
    pub count: usize,
    /// Up to [`EXAMPLES_MAX`] of them.
    pub examples: Vec<Json>,
}

/// Counts describing the history.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Operations in the history.
    pub ops: usize,
    /// Send operations by outcome.
    pub sends_ok: usize,
    /// ...
    pub sends_fail: usize,
    /// ...
    pub sends_info: usize,
    /// Poll operations by outcome.
    pub polls_ok: usize,
    /// ...
    pub polls_not_ok: usize,
    /// Values sent.
    pub values_sent: usize,
    /// Values acknowledged with an offset.
    pub values_acknowledged: usize,
    /// Distinct values read.
    pub values_read: usize,
    /// Sent values never acknowledged but read (indeterminate sends that happened).
    pub values_unacknowledged_read: usize,
    /// Broker copies of partitions checked.
    pub replica_copies: usize,
    /// Broker copies whose committed records end before the highest offset
    /// known from the history (lagging, not an anomaly by itself).
    pub replica_copies_lagging: usize,
    /// Compacted topic: acknowledged values never read that compaction may
    /// have removed (tombstones, records shadowed by a later record of
    /// their key or by a tombstone sent without an answer).
    pub values_removable_unread: usize,
    /// Compacted topic: acknowledged offsets below the end of their
    /// partition's final read that it did not return: removed by
    /// compaction (a lost one is also reported as an anomaly). Zero means
    /// the compaction checks saw no work.
    pub final_offsets_compacted: usize,
    /// ... of which tombstones (removed after `delete.retention.ms`).
    pub final_tombstones_removed: usize,
    /// Compacted topic: (partition, record key) pairs with a known record
    /// (acknowledged, read or in a committed copy) whose final state was
    /// checked.
    pub final_keys_checked: usize,
    /// ... of which the final read holds a value.
    pub final_keys_live: usize,
    /// ... of which absent or deleted although the last acknowledged write
    /// was a value, explained by a tombstone sent without an answer.
    pub final_keys_deleted_by_unacknowledged_tombstone: usize,
    /// `group` workload: offset commits acknowledged, and not.
    pub group_commits_ok: usize,
    /// ...
    pub group_commits_not_ok: usize,
    /// `group` workload: distinct (partition, value) the group's members read.
    pub group_values_delivered: usize,
}

/// The checker's verdict.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// No anomaly of any class.
    pub valid: bool,
    /// Every class, found or not.
    pub anomalies: BTreeMap<String, Finding>,
    /// Counts describing the history.
    pub stats: Stats,
    /// Rules against vacuous runs that the run broke (only from
    /// [`check_run`]); any makes it invalid.
    #[serde(default)]
    pub violations: Vec<Violation>,
}

impl Report {
    /// Classes with at least one instance.
    pub fn found(&self) -> Vec<(&str, usize)> {
        self.anomalies.iter().filter(|(_, f)| f.count > 0).map(|(k, f)| (k.as_str(), f.count)).collect()
    }

    fn add(&mut self, class: &str, example: Json) {
        let f = self.anomalies.entry(class.to_owned()).or_default();
        f.count += 1;
        if f.examples.len() < EXAMPLES_MAX {
            f.examples.push(example);
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Sent {
    key: Key,
    op: u64,
    outcome: Outcome,
    offset: Option<u64>,
    record_key: Option<u32>,
    tombstone: bool,
    invoke_ns: u64,
}

/// Where a (key, offset, value) fact came from.
fn source(op: &Op) -> String {
    format!(
        "{} op {} (process {}, {:?})",
        match op.op_type {
            OpType::Send => "send",
            OpType::Poll => "poll",
            OpType::Commit => "commit",
        },
        op.index,
        op.process,
        op.outcome
    )
    .to_lowercase()
}

/// Checks a run: the anomalies of [`check`], with the final read's ends
/// from `facts`, then the rules against vacuous runs ([`vacuity::check`]);
/// any violation makes the report invalid.
pub fn check_run(history: &[Op], replicas: &[ReplicaCopy], facts: &RunFacts) -> Report {
    let mut report = check(history, replicas, &facts.final_read_ends);
    report.violations = vacuity::check(history, &report.stats, replicas, facts);
    report.valid = report.valid && report.violations.is_empty();
    report
}

/// Checks `history` and the brokers' final copies `replicas` (may be
/// empty), given where each partition's final read ended (`ends`: the high
/// watermark it read to, exclusive; may be empty). Anomalies only: see
/// [`check_run`] for the rules against vacuous runs.
pub fn check(history: &[Op], replicas: &[ReplicaCopy], ends: &BTreeMap<Key, u64>) -> Report {
    let mut report = Report::default();
    for class in ANOMALIES {
        report.anomalies.insert(class.to_owned(), Finding::default());
    }
    let mut ops: Vec<&Op> = history.iter().collect();
    ops.sort_by_key(|o| (o.invoke_ns, o.index));

    // What was sent, and the facts (key, offset) -> values, (key, value) -> offsets.
    let mut sent: HashMap<Value, Sent> = HashMap::new();
    let mut at_offset: BTreeMap<(Key, u64), BTreeMap<Value, String>> = BTreeMap::new();
    let mut offsets_of: BTreeMap<(Key, Value), BTreeMap<u64, String>> = BTreeMap::new();
    let mut read: HashSet<(Key, Value)> = HashSet::new();
    let mut max_read: HashMap<Key, u64> = HashMap::new();
    let s = &mut report.stats;
    s.ops = history.len();
    for op in &ops {
        match (op.op_type, op.outcome) {
            (OpType::Send, Outcome::Ok) => s.sends_ok += 1,
            (OpType::Send, Outcome::Fail) => s.sends_fail += 1,
            (OpType::Send, Outcome::Info) => s.sends_info += 1,
            (OpType::Poll, Outcome::Ok) => s.polls_ok += 1,
            (OpType::Poll, _) => s.polls_not_ok += 1,
            (OpType::Commit, Outcome::Ok) => s.group_commits_ok += 1,
            (OpType::Commit, _) => s.group_commits_not_ok += 1,
        }
        if op.op_type != OpType::Send {
            continue;
        }
        for m in &op.msgs {
            s.values_sent += 1;
            // A fail outcome means no value of the operation was stored,
            // whatever offsets a client claimed.
            let offset = if op.outcome == Outcome::Fail { None } else { m.offset };
            sent.insert(
                m.value,
                Sent {
                    key: m.key,
                    op: op.index,
                    outcome: op.outcome,
                    offset,
                    record_key: m.record_key,
                    tombstone: m.tombstone,
                    invoke_ns: op.invoke_ns,
                },
            );
            if let Some(o) = offset {
                s.values_acknowledged += 1;
                at_offset.entry((m.key, o)).or_default().entry(m.value).or_insert_with(|| source(op));
                offsets_of.entry((m.key, m.value)).or_default().entry(o).or_insert_with(|| source(op));
            }
        }
    }
    for op in ops.iter().filter(|o| o.op_type == OpType::Poll && o.outcome == Outcome::Ok) {
        for m in &op.msgs {
            let Some(o) = m.offset else { continue };
            match sent.get(&m.value) {
                Some(x) if x.key == m.key && x.record_key == m.record_key && x.tombstone == m.tombstone => {}
                other => report.add(
                    UNEXPECTED_VALUE,
                    json!({"key": m.key, "record_key": m.record_key, "tombstone": m.tombstone,
                           "value": m.value, "offset": o, "op": op.index,
                           "sent_to_key": other.map(|x| x.key), "sent_record_key": other.and_then(|x| x.record_key),
                           "sent_tombstone": other.map(|x| x.tombstone)}),
                ),
            }
            read.insert((m.key, m.value));
            let mx = max_read.entry(m.key).or_insert(o);
            *mx = (*mx).max(o);
            at_offset.entry((m.key, o)).or_default().entry(m.value).or_insert_with(|| source(op));
            offsets_of.entry((m.key, m.value)).or_default().entry(o).or_insert_with(|| source(op));
        }
    }
    report.stats.values_read = read.len();

    for ((key, offset), values) in &at_offset {
        if values.len() > 1 {
            report.add(
                INCONSISTENT_OFFSETS,
                json!({"key": key, "offset": offset,
                       "values": values.iter().map(|(v, src)| json!({"value": v, "from": src})).collect::<Vec<_>>()}),
            );
        }
    }
    for ((key, value), offsets) in &offsets_of {
        if offsets.len() > 1 {
            report.add(
                DUPLICATE,
                json!({"key": key, "value": value,
                       "offsets": offsets.iter().map(|(o, src)| json!({"offset": o, "from": src})).collect::<Vec<_>>()}),
            );
        }
    }

    let compacted = history.iter().any(|op| op.msgs.iter().any(|m| m.record_key.is_some()));
    let compaction = compacted.then(|| Compaction::new(&sent, &at_offset, replicas, ends));
    let removable = |key: Key, offset: u64, before_ns: Option<u64>| {
        compaction.as_ref().is_some_and(|c| c.removable(key, offset, before_ns))
    };

    // Acknowledged values never read; failed sends read.
    let mut by_value: Vec<(&Value, &Sent)> = sent.iter().collect();
    by_value.sort_by_key(|(v, _)| **v);
    for (value, x) in by_value {
        let was_read = read.contains(&(x.key, *value));
        if was_read && x.offset.is_none() {
            if x.outcome == Outcome::Fail {
                report.add(ABORTED_READ, json!({"key": x.key, "value": value, "send_op": x.op}));
            } else {
                report.stats.values_unacknowledged_read += 1;
            }
        }
        let Some(offset) = x.offset else { continue };
        if was_read {
            continue;
        }
        if removable(x.key, offset, None) {
            report.stats.values_removable_unread += 1;
            continue;
        }
        let example = json!({"key": x.key, "value": value, "offset": offset, "send_op": x.op,
                             "highest_offset_read": max_read.get(&x.key)});
        match max_read.get(&x.key) {
            Some(&mx) if offset < mx => report.add(LOST_WRITE, example),
            _ => report.add(UNSEEN, example),
        }
    }

    // The version order: every offset known to hold a value, per key.
    let mut known: HashMap<Key, BTreeSet<u64>> = HashMap::new();
    for (key, offset) in at_offset.keys() {
        known.entry(*key).or_default().insert(*offset);
    }
    // The first offset strictly between `after` and `before` known to hold
    // a record compaction may not have removed by `at_ns`: one a reader
    // cannot skip.
    let skipped = |key: Key, after: u64, before: u64, at_ns: u64| -> Option<u64> {
        if before <= after + 1 {
            return None;
        }
        known
            .get(&key)
            .and_then(|s| s.range(after + 1..before).copied().find(|o| !removable(key, *o, Some(at_ns))))
    };

    // Each process's sends, per key, in order.
    let mut last_sent: HashMap<(u32, Key), (u64, u64)> = HashMap::new();
    for op in ops.iter().filter(|o| o.op_type == OpType::Send && o.outcome != Outcome::Fail) {
        let mut in_op: HashMap<Key, u64> = HashMap::new();
        for m in &op.msgs {
            let Some(o) = m.offset else { continue };
            if let Some(&prev) = in_op.get(&m.key) {
                if o <= prev {
                    report.add(
                        NONMONOTONIC_SEND_WITHIN_OP,
                        json!({"op": op.index, "process": op.process, "key": m.key, "offsets": [prev, o]}),
                    );
                }
            } else if let Some(&(prev, prev_op)) = last_sent.get(&(op.process, m.key))
                && o <= prev
            {
                report.add(
                    NONMONOTONIC_SEND,
                    json!({"process": op.process, "key": m.key, "ops": [prev_op, op.index], "offsets": [prev, o]}),
                );
            }
            in_op.insert(m.key, in_op.get(&m.key).map_or(o, |p| (*p).max(o)));
        }
        for (key, o) in in_op {
            let e = last_sent.entry((op.process, key)).or_insert((o, op.index));
            if o >= e.0 {
                *e = (o, op.index);
            }
        }
    }

    // Each consumer's polls, per key, in order.
    let mut last_polled: HashMap<(u32, Key), (u64, u64)> = HashMap::new();
    for op in ops.iter().filter(|o| o.op_type == OpType::Poll && o.outcome == Outcome::Ok) {
        if op.reset {
            last_polled.retain(|(p, _), _| *p != op.process);
        }
        let mut in_op: HashMap<Key, u64> = HashMap::new();
        for m in &op.msgs {
            let Some(o) = m.offset else { continue };
            if let Some(&prev) = in_op.get(&m.key) {
                if o <= prev {
                    report.add(
                        NONMONOTONIC_POLL_WITHIN_OP,
                        json!({"op": op.index, "process": op.process, "key": m.key, "offsets": [prev, o]}),
                    );
                } else if let Some(n) = skipped(m.key, prev, o, op.complete_ns) {
                    report.add(
                        POLL_SKIP_WITHIN_OP,
                        json!({"op": op.index, "process": op.process, "key": m.key,
                               "offsets": [prev, o], "skipped": n}),
                    );
                }
            } else if let Some(&(prev, prev_op)) = last_polled.get(&(op.process, m.key)) {
                if o <= prev {
                    report.add(
                        NONMONOTONIC_POLL,
                        json!({"process": op.process, "key": m.key, "ops": [prev_op, op.index], "offsets": [prev, o]}),
                    );
                } else if let Some(n) = skipped(m.key, prev, o, op.complete_ns) {
                    report.add(
                        POLL_SKIP,
                        json!({"process": op.process, "key": m.key, "ops": [prev_op, op.index],
                               "offsets": [prev, o], "skipped": n}),
                    );
                }
            }
            in_op.insert(m.key, o);
        }
        for (key, o) in in_op {
            last_polled.insert((op.process, key), (o, op.index));
        }
    }

    check_replicas(&mut report, replicas, &at_offset, compacted, &|key, offset| removable(key, offset, None));
    if let Some(c) = &compaction {
        c.check_final_state(&mut report, &ops);
    }
    group::check(&ops, &mut report);
    report.valid = report.anomalies.values().all(|f| f.count == 0);
    report
}

/// Compares each broker's committed copy with the history and with the
/// other brokers' copies.
fn check_replicas(
    report: &mut Report,
    replicas: &[ReplicaCopy],
    at_offset: &BTreeMap<(Key, u64), BTreeMap<Value, String>>,
    compacted: bool,
    removable: &dyn Fn(Key, u64) -> bool,
) {
    report.stats.replica_copies = replicas.len();
    let mut highest_known: HashMap<Key, u64> = HashMap::new();
    for (key, offset) in at_offset.keys() {
        let h = highest_known.entry(*key).or_insert(*offset);
        *h = (*h).max(*offset);
    }
    // (key, offset) -> broker -> value, committed records only.
    let mut by_offset: BTreeMap<(Key, u64), BTreeMap<u32, Value>> = BTreeMap::new();
    for copy in replicas {
        let committed: Vec<&crate::checker::ReplicaRecord> =
            copy.records.iter().filter(|r| r.committed).collect();
        let end = committed.last().map(|r| r.offset);
        if highest_known.get(&copy.key).is_some_and(|h| end.is_none_or(|e| e < *h)) {
            report.stats.replica_copies_lagging += 1;
        }
        let mut offsets_of: HashMap<Value, u64> = HashMap::new();
        let mut have: HashSet<u64> = HashSet::new();
        for r in &committed {
            have.insert(r.offset);
            by_offset.entry((copy.key, r.offset)).or_default().insert(copy.broker, r.value);
            if let Some(first) = offsets_of.insert(r.value, r.offset)
                && first != r.offset
            {
                report.add(
                    REPLICA_DIVERGENCE,
                    json!({"broker": copy.broker, "key": copy.key, "value": r.value,
                           "problem": "one value at two offsets in this copy", "offsets": [first, r.offset]}),
                );
            }
            if let Some(values) = at_offset.get(&(copy.key, r.offset))
                && !values.contains_key(&r.value)
            {
                report.add(
                    REPLICA_DIVERGENCE,
                    json!({"broker": copy.broker, "key": copy.key, "offset": r.offset, "replica_value": r.value,
                           "problem": "differs from the history",
                           "history_values": values.keys().collect::<Vec<_>>()}),
                );
            }
        }
        // Offsets the history knows, below this copy's end, missing from it
        // (from offset 0 on a compacted topic: its records are thinned, its
        // log start stays).
        let first = if compacted { Some(0) } else { committed.first().map(|r| r.offset) };
        if let (Some(end), Some(first)) = (end, first) {
            for ((_, offset), values) in at_offset.range((copy.key, first)..=(copy.key, end)) {
                if !have.contains(offset) && !removable(copy.key, *offset) {
                    report.add(
                        REPLICA_DIVERGENCE,
                        json!({"broker": copy.broker, "key": copy.key, "offset": offset,
                               "problem": "missing from this copy",
                               "history_values": values.keys().collect::<Vec<_>>()}),
                    );
                }
            }
        }
    }
    for ((key, offset), brokers) in by_offset {
        let distinct: BTreeSet<Value> = brokers.values().copied().collect();
        if distinct.len() > 1 {
            report.add(
                REPLICA_DIVERGENCE,
                json!({"key": key, "offset": offset, "problem": "brokers disagree", "by_broker": brokers}),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Msg;

    /// Builds histories: each call appends one operation at the next time.
    #[derive(Default)]
    struct H {
        ops: Vec<Op>,
    }

    impl H {
        fn op(&mut self, process: u32, op_type: OpType, outcome: Outcome, msgs: Vec<Msg>) -> &mut Op {
            let i = self.ops.len() as u64;
            self.ops.push(Op {
                index: i,
                process,
                op_type,
                outcome,
                invoke_ns: i * 10,
                complete_ns: i * 10 + 5,
                msgs,
                reset: false,
                final_read: false,
                group: false,
                error: None,
            });
            self.ops.last_mut().expect("pushed")
        }
        fn send(&mut self, process: u32, msgs: Vec<Msg>) -> &mut Op {
            self.op(process, OpType::Send, Outcome::Ok, msgs)
        }
        fn poll(&mut self, process: u32, msgs: Vec<Msg>) -> &mut Op {
            self.op(process, OpType::Poll, Outcome::Ok, msgs)
        }
    }

    /// Producer 0 sends 1..=4 to key 0 at offsets 0..=3, and 10, 11 to key
    /// 1; consumer 1 reads key 0 in two polls; consumer 2 reads key 1.
    fn clean() -> H {
        let mut h = H::default();
        h.send(0, vec![Msg::at(0, 1, 0), Msg::at(0, 2, 1)]);
        h.send(0, vec![Msg::at(0, 3, 2), Msg::at(1, 10, 0)]);
        h.send(0, vec![Msg::at(0, 4, 3), Msg::at(1, 11, 1)]);
        h.poll(1, vec![Msg::at(0, 1, 0), Msg::at(0, 2, 1)]);
        h.poll(1, vec![Msg::at(0, 3, 2), Msg::at(0, 4, 3)]);
        h.poll(2, vec![Msg::at(1, 10, 0), Msg::at(1, 11, 1)]);
        h
    }

    fn replicas_of(h: &H, brokers: &[u32]) -> Vec<ReplicaCopy> {
        let mut by_key: BTreeMap<Key, BTreeMap<u64, Value>> = BTreeMap::new();
        for op in h.ops.iter().filter(|o| o.op_type == OpType::Send) {
            for m in &op.msgs {
                by_key.entry(m.key).or_default().insert(m.offset.expect("acked"), m.value);
            }
        }
        let mut out = Vec::new();
        for b in brokers {
            for (key, recs) in &by_key {
                out.push(ReplicaCopy {
                    broker: *b,
                    key: *key,
                    records: recs
                        .iter()
                        .map(|(o, v)| ReplicaRecord { offset: *o, value: *v, committed: true })
                        .collect(),
                    marker: Some(CommittedMarker {
                        log_start_offset: 0,
                        log_end_offset: recs.keys().last().map_or(0, |o| o + 1),
                        committed_end: recs.keys().last().map_or(0, |o| o + 1),
                    }),
                });
            }
        }
        out
    }

    /// The only classes found, with their counts.
    fn found(r: &Report) -> Vec<(&str, usize)> {
        r.found()
    }

    #[test]
    fn clean_history_passes() {
        let h = clean();
        let r = check(&h.ops, &replicas_of(&h, &[1, 2, 3]), &BTreeMap::new());
        assert!(r.valid, "{:#?}", r.found());
        assert_eq!(r.anomalies.len(), ANOMALIES.len());
        assert_eq!((r.stats.values_sent, r.stats.values_acknowledged, r.stats.values_read), (6, 6, 6));
        assert_eq!((r.stats.sends_ok, r.stats.polls_ok, r.stats.replica_copies), (3, 3, 6));
    }

    #[test]
    fn indeterminate_and_failed_sends_that_were_not_read_pass() {
        let mut h = clean();
        h.op(0, OpType::Send, Outcome::Info, vec![Msg::unacked(0, 5)]);
        h.op(3, OpType::Send, Outcome::Fail, vec![Msg::unacked(0, 6)]);
        h.op(1, OpType::Poll, Outcome::Info, vec![]).error = Some("timeout".into());
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert!(r.valid, "{:#?}", r.found());
        // An indeterminate send that did happen is fine too.
        h.poll(1, vec![Msg::at(0, 5, 4)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert!(r.valid, "{:#?}", r.found());
        assert_eq!(r.stats.values_unacknowledged_read, 1);
    }

    #[test]
    fn lost_write() {
        let mut h = clean();
        // Value 3 (offset 2) never read, though offset 3 was (by a
        // consumer that started there, so no consumer skipped it).
        h.ops[4].msgs = vec![];
        h.poll(7, vec![Msg::at(0, 4, 3)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(LOST_WRITE, 1)], "{r:#?}");
        assert_eq!(r.anomalies[LOST_WRITE].examples[0]["value"], 3);
    }

    #[test]
    fn unseen() {
        let mut h = clean();
        h.send(0, vec![Msg::at(0, 5, 4)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(UNSEEN, 1)], "{r:#?}");
    }

    #[test]
    fn duplicate() {
        let mut h = clean();
        // Value 4 appears again at offset 4 (e.g. a retry stored twice).
        h.poll(1, vec![Msg::at(0, 4, 4)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(DUPLICATE, 1)], "{r:#?}");
    }

    #[test]
    fn inconsistent_offsets_between_readers() {
        let mut h = clean();
        // Consumer 3 sees value 2 where everyone else saw value 1.
        h.poll(3, vec![Msg::at(0, 2, 0)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        let f = found(&r);
        assert!(f.contains(&(INCONSISTENT_OFFSETS, 1)), "{r:#?}");
        // The same value at two offsets is also a duplicate.
        assert!(f.contains(&(DUPLICATE, 1)), "{r:#?}");
    }

    #[test]
    fn inconsistent_offsets_between_send_and_read() {
        let mut h = clean();
        h.send(0, vec![Msg::at(0, 5, 4)]);
        h.poll(1, vec![Msg::at(0, 6, 4)]);
        h.send(4, vec![Msg::at(0, 6, 5)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        let f = found(&r);
        assert!(f.contains(&(INCONSISTENT_OFFSETS, 1)), "{r:#?}");
        assert!(f.contains(&(DUPLICATE, 1)), "{r:#?}");
        assert!(f.contains(&(UNSEEN, 1)), "{r:#?}"); // value 5
    }

    #[test]
    fn nonmonotonic_send_across_operations() {
        let mut h = clean();
        // Process 0's next send to key 1 is acknowledged below its last one.
        h.send(0, vec![Msg::at(1, 12, 1)]);
        h.poll(2, vec![Msg::at(1, 12, 1)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert!(found(&r).contains(&(NONMONOTONIC_SEND, 1)), "{r:#?}");
        assert!(r.anomalies[NONMONOTONIC_SEND_WITHIN_OP].count == 0);
    }

    #[test]
    fn nonmonotonic_send_within_operation() {
        let mut h = H::default();
        h.send(0, vec![Msg::at(0, 1, 1), Msg::at(0, 2, 0)]);
        h.poll(1, vec![Msg::at(0, 2, 0), Msg::at(0, 1, 1)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(NONMONOTONIC_SEND_WITHIN_OP, 1)], "{r:#?}");
    }

    #[test]
    fn nonmonotonic_poll_across_operations() {
        let mut h = clean();
        // Consumer 1 polls offset 1 again after reaching 3, without a seek.
        h.poll(1, vec![Msg::at(0, 2, 1)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(NONMONOTONIC_POLL, 1)], "{r:#?}");
        // After a seek it is fine.
        h.ops.last_mut().expect("op").reset = true;
        assert!(check(&h.ops, &[], &BTreeMap::new()).valid);
    }

    #[test]
    fn nonmonotonic_poll_within_operation() {
        let mut h = clean();
        h.poll(2, vec![Msg::at(0, 2, 1), Msg::at(0, 1, 0)]).reset = true;
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(NONMONOTONIC_POLL_WITHIN_OP, 1)], "{r:#?}");
    }

    #[test]
    fn poll_skip_across_operations() {
        let mut h = clean();
        // Consumer 1 reads offset 0, then jumps to 2, skipping offset 1.
        h.ops[3].msgs = vec![Msg::at(0, 1, 0)];
        h.ops[4].msgs = vec![Msg::at(0, 3, 2), Msg::at(0, 4, 3)];
        h.poll(5, vec![Msg::at(0, 2, 1)]); // someone else read offset 1
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(POLL_SKIP, 1)], "{r:#?}");
        assert_eq!(r.anomalies[POLL_SKIP].examples[0]["skipped"], 1);
    }

    #[test]
    fn poll_skip_within_operation() {
        let mut h = clean();
        h.poll(5, vec![Msg::at(0, 1, 0), Msg::at(0, 3, 2)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(POLL_SKIP_WITHIN_OP, 1)], "{r:#?}");
    }

    #[test]
    fn aborted_read() {
        let mut h = clean();
        h.op(0, OpType::Send, Outcome::Fail, vec![Msg::unacked(1, 12)]);
        h.poll(2, vec![Msg::at(1, 12, 2)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(ABORTED_READ, 1)], "{r:#?}");
    }

    #[test]
    fn unexpected_value() {
        let mut h = clean();
        h.poll(2, vec![Msg::at(1, 99, 2)]);
        let r = check(&h.ops, &[], &BTreeMap::new());
        assert_eq!(found(&r), vec![(UNEXPECTED_VALUE, 1)], "{r:#?}");
    }

    #[test]
    fn replica_that_differs_from_the_history_and_the_others() {
        let h = clean();
        let mut reps = replicas_of(&h, &[1, 2, 3]);
        // Broker 3's copy of key 0 has value 9 at offset 2.
        let c = reps.iter_mut().find(|c| c.broker == 3 && c.key == 0).expect("copy");
        c.records[2].value = 9;
        let r = check(&h.ops, &reps, &BTreeMap::new());
        assert_eq!(found(&r), vec![(REPLICA_DIVERGENCE, 2)], "{r:#?}");
        let problems: Vec<&str> =
            r.anomalies[REPLICA_DIVERGENCE].examples.iter().filter_map(|e| e["problem"].as_str()).collect();
        assert_eq!(problems, vec!["differs from the history", "brokers disagree"]);
    }

    #[test]
    fn replica_missing_a_record_or_holding_a_value_twice() {
        let h = clean();
        let mut reps = replicas_of(&h, &[1, 2, 3]);
        let c = reps.iter_mut().find(|c| c.broker == 2 && c.key == 0).expect("copy");
        c.records.remove(1);
        let r = check(&h.ops, &reps, &BTreeMap::new());
        assert_eq!(found(&r), vec![(REPLICA_DIVERGENCE, 1)], "{r:#?}");

        let mut reps = replicas_of(&h, &[1]);
        let c = reps.iter_mut().find(|c| c.key == 1).expect("copy");
        c.records.push(ReplicaRecord { offset: 2, value: 10, committed: true });
        let r = check(&h.ops, &reps, &BTreeMap::new());
        assert_eq!(found(&r), vec![(REPLICA_DIVERGENCE, 1)], "{r:#?}");
    }

    #[test]
    fn check_run_is_invalid_on_any_violation() {
        let h = clean();
        let reps = replicas_of(&h, &[1, 2, 3]);
        let facts = RunFacts {
            partitions: 2,
            final_read_ends: BTreeMap::from([(0, 4), (1, 2)]),
            min_values_acknowledged: 6,
            replica_sets: Some(BTreeMap::from([(0, vec![1, 2, 3]), (1, vec![1, 2, 3])])),
            slots: BTreeMap::from([(1, 1), (2, 2), (3, 3)]),
            followers_caught_up: true,
            ..RunFacts::default()
        };
        let r = check_run(&h.ops, &reps, &facts);
        assert!(r.valid && r.violations.is_empty(), "{:#?}", r.violations);
        let r = check_run(&h.ops, &reps, &RunFacts { min_values_acknowledged: 7, ..facts.clone() });
        assert!(!r.valid && r.found().is_empty(), "{r:#?}");
        let rules: Vec<&str> = r.violations.iter().map(|v| v.rule.as_str()).collect();
        assert_eq!(rules, vec![vacuity::TOO_FEW_ACKNOWLEDGED]);
        // Broker 3 stopped with partition 0 behind the final read.
        let mut reps = reps;
        let c = reps.iter_mut().find(|c| c.broker == 3 && c.key == 0).expect("copy");
        c.records.truncate(3);
        c.marker = Some(CommittedMarker { log_start_offset: 0, log_end_offset: 3, committed_end: 3 });
        let r = check_run(&h.ops, &reps, &facts);
        let rules: Vec<&str> = r.violations.iter().map(|v| v.rule.as_str()).collect();
        assert_eq!(rules, vec![vacuity::COPY_BEHIND_FINAL_READ], "{r:#?}");
        assert!(!r.valid);
    }

    #[test]
    fn lagging_or_uncommitted_replica_tails_are_not_divergence() {
        let h = clean();
        let mut reps = replicas_of(&h, &[1, 2]);
        let c = reps.iter_mut().find(|c| c.broker == 2 && c.key == 0).expect("copy");
        c.records.truncate(2);
        c.records.push(ReplicaRecord { offset: 2, value: 77, committed: false });
        let r = check(&h.ops, &reps, &BTreeMap::new());
        assert!(r.valid, "{:#?}", r.found());
        assert_eq!(r.stats.replica_copies_lagging, 1);
    }
}

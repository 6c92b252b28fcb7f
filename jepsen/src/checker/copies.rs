//! The rules against vacuous runs that concern the brokers' copies
//! (`dump-log` of each stopped broker; see `vacuity` for the list): every
//! broker of a partition's replica set dumped a copy of it, none is empty,
//! none lacks what another holds below both their committed ends, none
//! ends below the final read, and each carries its committed marker.
//!
//! A copy's *committed end* is its marker's `committed_end` (the offset
//! after the replica's persisted commit point), else the offset after its
//! last committed record. A copy of a broker outside its partition's final
//! replica set (a replica moved off, not yet deleted) may be empty or
//! behind; it must still agree with the others. On a compacted topic a
//! copy may lack a record
//! that compaction may remove (a tombstone, or a record a later record of
//! its key shadows in some copy); elsewhere copies must hold the same
//! offsets.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use super::ReplicaCopy;
use super::vacuity::{
    COPY_BEHIND_FINAL_READ, COPY_EMPTY, COPY_MISSING, COPY_PREFIX_MISSING, NO_COMMITTED_MARKER, RunFacts,
    Violation,
};
use crate::history::{Key, Op, OpType, Value};

/// Offsets named in a violation's detail, at most.
const OFFSETS_SHOWN: usize = 5;

/// The committed marker `dump-log` prints after each replica's records
/// (`{"replica": {…}}`): where the replica's log starts and ends, and its
/// committed end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommittedMarker {
    /// The replica's log start offset.
    pub log_start_offset: u64,
    /// Its log end offset (committed or not).
    pub log_end_offset: u64,
    /// The offset after its persisted commit point; records below it are
    /// committed.
    pub committed_end: u64,
}

/// A copy's committed end: its marker's, else the offset after its last
/// committed record (0 if none).
pub fn committed_end(copy: &ReplicaCopy) -> u64 {
    copy.marker.map_or_else(
        || copy.records.iter().filter(|r| r.committed).map(|r| r.offset + 1).max().unwrap_or(0),
        |m| m.committed_end,
    )
}

/// Each value's record key and whether it is a tombstone, from the
/// history's sends: empty unless the topic is compacted.
#[derive(Debug, Default)]
pub(super) struct RecordKeys(HashMap<Value, (u32, bool)>);

impl RecordKeys {
    /// Gathers them from `history`.
    pub(super) fn of(history: &[Op]) -> Self {
        RecordKeys(
            history
                .iter()
                .filter(|o| o.op_type == OpType::Send)
                .flat_map(|o| &o.msgs)
                .filter_map(|m| m.record_key.map(|rk| (m.value, (rk, m.tombstone))))
                .collect(),
        )
    }
}

fn copies_by_key(replicas: &[ReplicaCopy]) -> BTreeMap<Key, Vec<&ReplicaCopy>> {
    let mut by_key: BTreeMap<Key, Vec<&ReplicaCopy>> = BTreeMap::new();
    for c in replicas {
        by_key.entry(c.key).or_default().push(c);
    }
    by_key
}

/// Whether `copy`'s broker is in its partition's final replica set (or the
/// sets are unknown).
fn in_replica_set(copy: &ReplicaCopy, facts: &RunFacts) -> bool {
    facts.replica_sets.as_ref().is_none_or(|sets| {
        sets.get(&copy.key).is_some_and(|ids| ids.iter().any(|id| facts.slots.get(id) == Some(&copy.broker)))
    })
}

fn first_offsets(offsets: &BTreeSet<u64>) -> String {
    let shown: Vec<String> = offsets.iter().take(OFFSETS_SHOWN).map(u64::to_string).collect();
    let more = if offsets.len() > OFFSETS_SHOWN { ", …" } else { "" };
    format!("{}{more}", shown.join(", "))
}

/// `copy-missing`: a broker of a partition's replica set whose dump holds
/// no copy of it (a replica without records still has its marker).
pub(super) fn missing(replicas: &[ReplicaCopy], facts: &RunFacts, out: &mut Vec<Violation>) {
    let Some(sets) = &facts.replica_sets else {
        out.push(Violation::new(
            COPY_MISSING,
            "the final replica sets are unknown (the cluster did not answer before the brokers stopped): \
             a missing copy could not be told",
        ));
        return;
    };
    let held: BTreeSet<(u32, Key)> = replicas.iter().map(|c| (c.broker, c.key)).collect();
    for p in 0..facts.partitions {
        let Some(set) = sets.get(&p).filter(|s| !s.is_empty()) else {
            out.push(Violation::new(COPY_MISSING, format!("partition {p} has no known replica set")));
            continue;
        };
        for id in set {
            match facts.slots.get(id) {
                None => out.push(Violation::new(
                    COPY_MISSING,
                    format!("partition {p}'s replica on broker id {id}: no broker slot runs that id"),
                )),
                Some(slot) if !held.contains(&(*slot, p)) => out.push(Violation::new(
                    COPY_MISSING,
                    format!(
                        "broker {slot} (id {id}) holds a replica of partition {p}, but its dump has no copy of it"
                    ),
                )),
                Some(_) => {}
            }
        }
    }
}

/// `copy-empty`: a copy (of a broker in the replica set) with no committed
/// record while another copy of its partition has one, or the final read
/// returned a record of it.
pub(super) fn empty(
    replicas: &[ReplicaCopy],
    facts: &RunFacts,
    final_read_returned: &BTreeSet<Key>,
    out: &mut Vec<Violation>,
) {
    for (key, copies) in copies_by_key(replicas) {
        let holds = |c: &ReplicaCopy| c.records.iter().any(|r| r.committed);
        let others: Vec<u32> = copies.iter().filter(|c| holds(c)).map(|c| c.broker).collect();
        if others.is_empty() && !final_read_returned.contains(&key) {
            continue;
        }
        for c in copies.iter().filter(|c| !holds(c) && in_replica_set(c, facts)) {
            out.push(Violation::new(
                COPY_EMPTY,
                format!(
                    "broker {}'s copy of partition {key} holds no committed record, while {}",
                    c.broker,
                    if others.is_empty() {
                        "the final read returned records of it".to_owned()
                    } else {
                        format!("broker(s) {others:?} hold some")
                    }
                ),
            ));
        }
    }
}

/// `copy-prefix-missing`: a copy lacking a committed offset that another
/// copy holds below both copies' committed ends (what compaction may
/// remove aside, on a compacted topic).
pub(super) fn prefix_missing(replicas: &[ReplicaCopy], keys: &RecordKeys, out: &mut Vec<Violation>) {
    for (key, copies) in copies_by_key(replicas) {
        let held: Vec<(u64, BTreeMap<u64, Value>)> = copies
            .iter()
            .map(|c| {
                let end = committed_end(c);
                (
                    end,
                    c.records
                        .iter()
                        .filter(|r| r.committed && r.offset < end)
                        .map(|r| (r.offset, r.value))
                        .collect(),
                )
            })
            .collect();
        // Compacted topic: each record key's latest offset in any copy.
        let mut latest: HashMap<u32, u64> = HashMap::new();
        for (o, v) in held.iter().flat_map(|(_, recs)| recs) {
            if let Some((rk, _)) = keys.0.get(v) {
                let l = latest.entry(*rk).or_insert(*o);
                *l = (*l).max(*o);
            }
        }
        let removable = |o: u64, v: &Value| {
            keys.0.get(v).is_some_and(|(rk, tombstone)| *tombstone || latest.get(rk).is_some_and(|l| *l > o))
        };
        for (a, (end_a, recs_a)) in held.iter().enumerate() {
            let mut lacking: BTreeSet<u64> = BTreeSet::new();
            let mut from: BTreeSet<u32> = BTreeSet::new();
            for (b, (end_b, recs_b)) in held.iter().enumerate().filter(|(b, _)| *b != a) {
                for (o, v) in recs_b.range(..(*end_a).min(*end_b)) {
                    if !recs_a.contains_key(o) && !removable(*o, v) {
                        lacking.insert(*o);
                        from.insert(copies[b].broker);
                    }
                }
            }
            if !lacking.is_empty() {
                out.push(Violation::new(
                    COPY_PREFIX_MISSING,
                    format!(
                        "broker {}'s copy of partition {key} lacks {} offset(s) below its committed end {end_a} \
                         that broker(s) {from:?} hold: {}",
                        copies[a].broker,
                        lacking.len(),
                        first_offsets(&lacking)
                    ),
                ));
            }
        }
    }
}

/// `copy-behind-final-read`: a copy (of a broker in the replica set) whose
/// committed end is below where its partition's final read ended.
pub(super) fn behind_final_read(replicas: &[ReplicaCopy], facts: &RunFacts, out: &mut Vec<Violation>) {
    for c in replicas.iter().filter(|c| in_replica_set(c, facts)) {
        let end = committed_end(c);
        if let Some(&final_end) = facts.final_read_ends.get(&c.key)
            && end < final_end
        {
            out.push(Violation::new(
                COPY_BEHIND_FINAL_READ,
                format!(
                    "broker {}'s copy of partition {} ends at {end} (committed), below the final read's end \
                     {final_end} ({})",
                    c.broker,
                    c.key,
                    if facts.followers_caught_up {
                        "after every follower had reported lag 0"
                    } else {
                        "the followers had not all caught up within the harness's wait"
                    }
                ),
            ));
        }
    }
}

/// `no-committed-marker`: a copy without its marker, or whose records'
/// `committed` flags disagree with it.
pub(super) fn no_committed_marker(replicas: &[ReplicaCopy], out: &mut Vec<Violation>) {
    for c in replicas {
        let Some(m) = c.marker else {
            out.push(Violation::new(
                NO_COMMITTED_MARKER,
                format!(
                    "broker {}'s dump of partition {} has no committed marker (a dump-log that does not print \
                     it, or was cut short): which records are committed is unknown",
                    c.broker, c.key
                ),
            ));
            continue;
        };
        let wrong: BTreeSet<u64> = c
            .records
            .iter()
            .filter(|r| r.committed != (r.offset < m.committed_end))
            .map(|r| r.offset)
            .collect();
        if !wrong.is_empty() {
            out.push(Violation::new(
                NO_COMMITTED_MARKER,
                format!(
                    "broker {}'s dump of partition {}: {} record(s) flagged against its committed marker \
                     (committed_end {}): {}",
                    c.broker,
                    c.key,
                    wrong.len(),
                    m.committed_end,
                    first_offsets(&wrong)
                ),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::ReplicaRecord;
    use crate::history::{Msg, Outcome};

    /// Broker `broker`'s copy of partition 0: value 100 + o at each offset
    /// of `offsets`, committed below `committed_end`, with its marker.
    fn copy(broker: u32, offsets: &[u64], committed_end: u64) -> ReplicaCopy {
        ReplicaCopy {
            broker,
            key: 0,
            records: offsets
                .iter()
                .map(|o| ReplicaRecord { offset: *o, value: 100 + o, committed: *o < committed_end })
                .collect(),
            marker: Some(CommittedMarker {
                log_start_offset: 0,
                log_end_offset: offsets.last().map_or(0, |o| o + 1),
                committed_end,
            }),
        }
    }

    fn facts(ends: u64) -> RunFacts {
        RunFacts {
            partitions: 1,
            final_read_ends: BTreeMap::from([(0, ends)]),
            replica_sets: Some(BTreeMap::from([(0, vec![1, 2, 3])])),
            slots: BTreeMap::from([(1, 1), (2, 2), (3, 3)]),
            followers_caught_up: true,
            ..RunFacts::default()
        }
    }

    fn rules(v: &[Violation]) -> Vec<&str> {
        v.iter().map(|v| v.rule.as_str()).collect()
    }

    fn three() -> Vec<ReplicaCopy> {
        (1..=3).map(|b| copy(b, &[0, 1, 2, 3], 4)).collect()
    }

    #[test]
    fn a_missing_copy_fails_the_run() {
        let mut out = Vec::new();
        missing(&three(), &facts(4), &mut out);
        assert!(out.is_empty(), "{out:?}");
        // A re-added broker: slot 3 runs broker id 6.
        let f = RunFacts {
            replica_sets: Some(BTreeMap::from([(0, vec![1, 2, 6])])),
            slots: BTreeMap::from([(1, 1), (2, 2), (6, 3)]),
            ..facts(4)
        };
        missing(&three(), &f, &mut out);
        assert!(out.is_empty(), "{out:?}");

        let mut reps = three();
        reps.remove(1);
        missing(&reps, &facts(4), &mut out);
        assert_eq!(rules(&out), vec![COPY_MISSING]);
        assert!(out[0].detail.contains("broker 2 (id 2)"), "{}", out[0]);

        let mut out = Vec::new();
        missing(&three(), &RunFacts { replica_sets: None, ..facts(4) }, &mut out);
        assert_eq!(rules(&out), vec![COPY_MISSING]);
        let mut out = Vec::new();
        missing(&three(), &RunFacts { partitions: 2, ..facts(4) }, &mut out);
        assert_eq!(rules(&out), vec![COPY_MISSING]);
    }

    #[test]
    fn an_empty_copy_fails_the_run() {
        let f = facts(4);
        let mut out = Vec::new();
        empty(&three(), &f, &BTreeSet::new(), &mut out);
        // Nothing written to the partition: empty copies everywhere are fine.
        let none: Vec<ReplicaCopy> = (1..=3).map(|b| copy(b, &[], 0)).collect();
        empty(&none, &f, &BTreeSet::new(), &mut out);
        // A leftover copy of a broker moved off the partition may be empty.
        let mut reps = three();
        reps.push(copy(4, &[], 0));
        empty(&reps, &f, &BTreeSet::new(), &mut out);
        assert!(out.is_empty(), "{out:?}");

        let mut reps = three();
        reps[2] = copy(3, &[], 0);
        empty(&reps, &f, &BTreeSet::new(), &mut out);
        assert_eq!(rules(&out), vec![COPY_EMPTY]);
        assert!(out[0].detail.contains("broker 3"), "{}", out[0]);
        // Every copy empty while the final read returned records.
        let mut out = Vec::new();
        empty(&none, &f, &BTreeSet::from([0]), &mut out);
        assert_eq!(rules(&out), vec![COPY_EMPTY; 3]);
        // Records, none committed, count as empty.
        let mut out = Vec::new();
        let mut reps = three();
        reps[0] = copy(1, &[0, 1, 2, 3], 0);
        empty(&reps, &f, &BTreeSet::new(), &mut out);
        assert_eq!(rules(&out), vec![COPY_EMPTY]);
    }

    #[test]
    fn a_copy_lacking_a_prefix_another_holds_fails_the_run() {
        let none = RecordKeys::default();
        let mut out = Vec::new();
        prefix_missing(&three(), &none, &mut out);
        // A copy whose committed end is lower is a prefix of the others.
        prefix_missing(&[copy(1, &[0, 1, 2, 3], 4), copy(2, &[0, 1], 2)], &none, &mut out);
        assert!(out.is_empty(), "{out:?}");

        // Broker 2 lacks offsets 0 and 1 (its log starts late), broker 3 offset 2.
        let reps = [copy(1, &[0, 1, 2, 3], 4), copy(2, &[2, 3], 4), copy(3, &[0, 1, 3], 4)];
        prefix_missing(&reps, &none, &mut out);
        assert_eq!(rules(&out), vec![COPY_PREFIX_MISSING; 2]);
        assert!(out[0].detail.contains("broker 2's copy of partition 0 lacks 2 offset(s)"), "{}", out[0]);
        assert!(out[1].detail.contains("broker 3's copy") && out[1].detail.ends_with(": 2"), "{}", out[1]);
    }

    #[test]
    fn on_a_compacted_topic_a_copy_may_lack_only_what_compaction_may_remove() {
        // Values 100..=103 at offsets 0..=3: record keys 7, 7, 8 (a
        // tombstone), 7.
        let mut h = Vec::new();
        for (o, (rk, tombstone)) in [(7, false), (7, false), (8, true), (7, false)].into_iter().enumerate() {
            let o = o as u64;
            h.push(Op {
                index: o,
                process: 0,
                op_type: OpType::Send,
                outcome: Outcome::Ok,
                invoke_ns: o,
                complete_ns: o,
                msgs: vec![Msg::at(0, 100 + o, o).keyed(rk, tombstone)],
                reset: false,
                final_read: false,
                group: false,
                error: None,
            });
        }
        let keys = RecordKeys::of(&h);
        let mut out = Vec::new();
        // Broker 2 compacted offsets 0 and 1 (shadowed by 3) and 2 (a tombstone).
        prefix_missing(&[copy(1, &[0, 1, 2, 3], 4), copy(2, &[3], 4)], &keys, &mut out);
        assert!(out.is_empty(), "{out:?}");
        // Without offset 3, the latest record of key 7, it lacks what no compaction removes.
        prefix_missing(&[copy(1, &[0, 1, 2, 3], 4), copy(2, &[0, 1, 2], 4)], &keys, &mut out);
        assert_eq!(rules(&out), vec![COPY_PREFIX_MISSING]);
    }

    #[test]
    fn a_copy_behind_the_final_read_fails_the_run() {
        let mut out = Vec::new();
        behind_final_read(&three(), &facts(4), &mut out);
        // A leftover copy of a broker moved off the partition may be behind.
        behind_final_read(&[copy(4, &[0, 1], 2)], &facts(4), &mut out);
        assert!(out.is_empty(), "{out:?}");

        // Broker 2 has the records but its commit point is behind.
        let reps = [copy(1, &[0, 1, 2, 3], 4), copy(2, &[0, 1, 2, 3], 3)];
        behind_final_read(&reps, &facts(4), &mut out);
        assert_eq!(rules(&out), vec![COPY_BEHIND_FINAL_READ]);
        assert!(out[0].detail.contains("broker 2's copy of partition 0 ends at 3"), "{}", out[0]);
        // Without a marker, the last committed record says where it ends.
        let mut out = Vec::new();
        let mut short = copy(3, &[0, 1], 2);
        short.marker = None;
        behind_final_read(&[short], &RunFacts { replica_sets: None, ..facts(4) }, &mut out);
        assert_eq!(rules(&out), vec![COPY_BEHIND_FINAL_READ]);
    }

    #[test]
    fn a_copy_without_the_committed_marker_fails_the_run() {
        let mut out = Vec::new();
        no_committed_marker(&three(), &mut out);
        assert!(out.is_empty(), "{out:?}");

        let mut reps = three();
        reps[0].marker = None;
        // Records flagged committed beyond the marker's committed end.
        reps[1].marker = Some(CommittedMarker { committed_end: 2, ..reps[1].marker.expect("marker") });
        no_committed_marker(&reps, &mut out);
        assert_eq!(rules(&out), vec![NO_COMMITTED_MARKER; 2]);
        assert!(
            out[0].detail.contains("broker 1's dump of partition 0 has no committed marker"),
            "{}",
            out[0]
        );
        assert!(out[1].detail.contains("2 record(s)"), "{}", out[1]);
    }
}

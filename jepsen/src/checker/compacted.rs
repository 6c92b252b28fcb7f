//! The checker's rules for a compacted topic (the `compact` workload).
//!
//! Compaction may remove a record that a later record of its key shadows,
//! and tombstones. So where the queue rules expect every acknowledged
//! record to be read, here a record is *removable* when it is a tombstone,
//! when a later record of its key is known (acknowledged, read, or in a
//! broker's committed copy) and was sent before the reader looked, or when
//! a tombstone of its key was sent without an answer, seen nowhere, and
//! some offset after the record is known to no source (the place that
//! tombstone may hold, shadowing the record before being removed itself).
//!
//! The final read (every partition from its log start to its high
//! watermark) must show each key at its latest known record or later: that
//! value, or a later record; a key whose latest known record is a tombstone
//! shows no older value. This is Kafka's guarantee for a consumer that reads
//! from the start within `delete.retention.ms`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde_json::{Value as Json, json};

use super::{LOST_FINAL_VALUE, ReplicaCopy, Report, STALE_FINAL_VALUE, Sent};
use crate::history::{Key, Op, OpType, Outcome, Value};

/// A record known to be at an offset.
#[derive(Debug, Clone, Copy)]
struct Known {
    value: Value,
    tombstone: bool,
    /// When its send was invoked, ns: it was not written before.
    written_after_ns: u64,
}

impl Known {
    fn json(&self, offset: u64) -> Json {
        json!({"offset": offset, "value": self.value, "tombstone": self.tombstone})
    }
}

/// What compaction may have removed, from every source of facts.
pub(super) struct Compaction {
    /// (partition, record key) -> offset -> the record there.
    records: HashMap<(Key, u32), BTreeMap<u64, Known>>,
    /// (partition, offset) -> its record key and whether it is a tombstone.
    at: HashMap<(Key, u64), (u32, bool)>,
    /// Per partition: offsets below its end known to no source.
    unknown: HashMap<Key, BTreeSet<u64>>,
    /// Per partition: its end (the final read's, or one past the highest
    /// offset known).
    ends: HashMap<Key, u64>,
    /// (partition, record key) -> invoke times of tombstones sent without
    /// an answer and seen nowhere.
    unanswered_tombstones: HashMap<(Key, u32), Vec<u64>>,
    /// The same for values: one may have shadowed a record for a while and
    /// been removed in its turn (which excuses a reader's skip, not a final
    /// state: a value stays visible unless shadowed itself).
    unanswered_values: HashMap<(Key, u32), Vec<u64>>,
    /// Per partition: where the final read ended, when known (records
    /// committed after it are not its business).
    final_ends: HashMap<Key, u64>,
    /// Acknowledged (partition, offset, tombstone).
    acked: Vec<(Key, u64, bool)>,
}

impl Compaction {
    /// Gathers the facts: `sent` values, `at_offset` (acknowledgements and
    /// reads), the brokers' committed copies, and the final read's end
    /// offsets `ends` (exclusive; absent ones are taken from the facts).
    pub(super) fn new(
        sent: &HashMap<Value, Sent>,
        at_offset: &BTreeMap<(Key, u64), BTreeMap<Value, String>>,
        replicas: &[ReplicaCopy],
        ends: &BTreeMap<Key, u64>,
    ) -> Self {
        let mut c = Compaction {
            records: HashMap::new(),
            at: HashMap::new(),
            unknown: HashMap::new(),
            ends: HashMap::new(),
            unanswered_tombstones: HashMap::new(),
            unanswered_values: HashMap::new(),
            final_ends: ends.iter().map(|(k, e)| (*k, *e)).collect(),
            acked: Vec::new(),
        };
        let mut seen: HashSet<Value> = HashSet::new();
        let mut known_offsets: HashMap<Key, BTreeSet<u64>> = HashMap::new();
        let facts = at_offset
            .iter()
            .flat_map(|((key, offset), values)| values.keys().map(move |v| (*key, *offset, *v)));
        let copies = replicas
            .iter()
            .flat_map(|r| r.records.iter().filter(|x| x.committed).map(move |x| (r.key, x.offset, x.value)));
        for (key, offset, value) in facts.chain(copies) {
            known_offsets.entry(key).or_default().insert(offset);
            let Some(x) = sent.get(&value).filter(|x| x.key == key) else { continue };
            let Some(rk) = x.record_key else { continue };
            seen.insert(value);
            c.records
                .entry((key, rk))
                .or_default()
                .insert(offset, Known { value, tombstone: x.tombstone, written_after_ns: x.invoke_ns });
            c.at.insert((key, offset), (rk, x.tombstone));
        }
        for (value, x) in sent {
            if let Some(o) = x.offset {
                c.acked.push((x.key, o, x.tombstone));
            } else if x.outcome != Outcome::Fail
                && !seen.contains(value)
                && let Some(rk) = x.record_key
            {
                let unanswered =
                    if x.tombstone { &mut c.unanswered_tombstones } else { &mut c.unanswered_values };
                unanswered.entry((x.key, rk)).or_default().push(x.invoke_ns);
            }
        }
        for (key, offsets) in &known_offsets {
            let end = offsets.last().map_or(0, |o| o + 1).max(ends.get(key).copied().unwrap_or(0));
            c.ends.insert(*key, end);
            c.unknown.insert(*key, (0..end).filter(|o| !offsets.contains(o)).collect());
        }
        c
    }

    /// Whether a record of (`key`, `rk`) sent without an answer and seen
    /// nowhere, a tombstone (or, with `values`, any), invoked before
    /// `before_ns` if given, may sit at an unknown offset after `offset`.
    fn unanswered_after(&self, key: Key, rk: u32, offset: u64, before_ns: Option<u64>, values: bool) -> bool {
        let sent_before = |m: &HashMap<(Key, u32), Vec<u64>>| {
            m.get(&(key, rk)).is_some_and(|ts| ts.iter().any(|t| before_ns.is_none_or(|b| *t < b)))
        };
        (sent_before(&self.unanswered_tombstones) || (values && sent_before(&self.unanswered_values)))
            && self.unknown.get(&key).is_some_and(|u| u.range(offset + 1..).next().is_some())
    }

    /// Whether compaction may have removed the record at `offset` of
    /// partition `key` by `before_ns` (ns since the start; `None`: by the
    /// end): a tombstone, a record a later one of its key shadows (sent
    /// before `before_ns`), or one an unanswered record may shadow: by the
    /// end only a tombstone (an unanswered value that shadowed it is either
    /// still there, and known, or shadowed in its turn), at a time before
    /// the end a value too.
    pub(super) fn removable(&self, key: Key, offset: u64, before_ns: Option<u64>) -> bool {
        let Some(&(rk, tombstone)) = self.at.get(&(key, offset)) else { return false };
        tombstone
            || self.records.get(&(key, rk)).is_some_and(|r| {
                r.range(offset + 1..).any(|(_, k)| before_ns.is_none_or(|b| k.written_after_ns < b))
            })
            || self.unanswered_after(key, rk, offset, before_ns, before_ns.is_some())
    }

    /// Every key's final state (its latest record in the final read)
    /// against its latest known record; counts what the final read shows
    /// compaction removed.
    pub(super) fn check_final_state(&self, report: &mut Report, ops: &[&Op]) {
        let mut latest: HashMap<(Key, u32), (u64, Known)> = HashMap::new();
        let mut returned: HashMap<Key, HashSet<u64>> = HashMap::new();
        for op in ops.iter().filter(|o| o.final_read && o.op_type == OpType::Poll && o.outcome == Outcome::Ok)
        {
            for m in &op.msgs {
                let (Some(offset), Some(rk)) = (m.offset, m.record_key) else { continue };
                returned.entry(m.key).or_default().insert(offset);
                let k = Known { value: m.value, tombstone: m.tombstone, written_after_ns: 0 };
                let e = latest.entry((m.key, rk)).or_insert((offset, k));
                if offset > e.0 {
                    *e = (offset, k);
                }
            }
        }
        let s = &mut report.stats;
        for (key, offset, tombstone) in &self.acked {
            let (Some(seen), Some(end)) = (returned.get(key), self.ends.get(key)) else { continue };
            if offset < end && !seen.contains(offset) {
                s.final_offsets_compacted += 1;
                s.final_tombstones_removed += usize::from(*tombstone);
            }
        }
        let mut keys: Vec<&(Key, u32)> = self.records.keys().collect();
        keys.sort();
        for &(key, rk) in keys {
            // The latest record below where the final read ended.
            let end = self.final_ends.get(&key).copied().unwrap_or(u64::MAX);
            let Some((&last_offset, last)) = self.records[&(key, rk)].range(..end).next_back() else {
                continue;
            };
            report.stats.final_keys_checked += 1;
            let fin = latest.get(&(key, rk));
            let example = || {
                json!({"key": key, "record_key": rk, "latest_known": last.json(last_offset),
                       "final_read": fin.map(|(o, k)| k.json(*o))})
            };
            match fin {
                Some((o, k)) if *o >= last_offset => {
                    report.stats.final_keys_live += usize::from(!k.tombstone)
                }
                Some((_, k)) if !k.tombstone => report.add(STALE_FINAL_VALUE, example()),
                // Absent, or an older tombstone: deleted.
                _ if last.tombstone => {}
                _ if self.unanswered_after(key, rk, last_offset, None, false) => {
                    report.stats.final_keys_deleted_by_unacknowledged_tombstone += 1;
                }
                _ => report.add(LOST_FINAL_VALUE, example()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use crate::history::Msg;

    fn op(index: u64, process: u32, op_type: OpType, msgs: Vec<Msg>, final_read: bool) -> Op {
        Op {
            index,
            process,
            op_type,
            outcome: Outcome::Ok,
            invoke_ns: index * 10,
            complete_ns: index * 10 + 5,
            msgs,
            reset: final_read,
            final_read,
            group: false,
            error: None,
        }
    }

    /// Partition 0: record key 1 written twice (offsets 0, 1), key 2 written
    /// (2) then deleted (3), key 3 written (4).
    fn writes() -> Vec<Msg> {
        vec![
            Msg::at(0, 1, 0).keyed(1, false),
            Msg::at(0, 2, 1).keyed(1, false),
            Msg::at(0, 3, 2).keyed(2, false),
            Msg::at(0, 4, 3).keyed(2, true),
            Msg::at(0, 5, 4).keyed(3, false),
        ]
    }

    /// The writes, then a final read returning the records at `offsets`.
    fn history(offsets: &[u64]) -> Vec<Op> {
        let w = writes();
        let read = offsets.iter().map(|o| w[*o as usize]).collect();
        vec![op(0, 0, OpType::Send, w, false), op(1, 9, OpType::Poll, read, true)]
    }

    fn run(h: &[Op]) -> Report {
        check(h, &[], &BTreeMap::new())
    }

    #[test]
    fn a_compacted_final_read_passes_and_counts_what_compaction_removed() {
        // Offset 0 shadowed by 1, 2 by the tombstone at 3, the tombstone gone.
        let r = run(&history(&[1, 4]));
        assert!(r.valid, "{:#?}", r.found());
        let s = &r.stats;
        assert_eq!((s.final_offsets_compacted, s.final_tombstones_removed), (3, 1));
        assert_eq!((s.final_keys_checked, s.final_keys_live), (3, 2));
        assert_eq!(s.values_removable_unread, 3);
        // Nothing compacted yet is fine too.
        let r = run(&history(&[0, 1, 2, 3, 4]));
        assert!(r.valid, "{:#?}", r.found());
        assert_eq!(r.stats.final_offsets_compacted, 0);
    }

    #[test]
    fn an_older_value_in_the_final_state_is_stale() {
        // Key 1's last write (offset 1) gone, its older value (0) left; the
        // final read jumped over it.
        let r = run(&history(&[0, 4]));
        assert_eq!(
            r.found(),
            vec![(LOST_WRITE, 1), (POLL_SKIP_WITHIN_OP, 1), (STALE_FINAL_VALUE, 1)],
            "{r:#?}"
        );
    }

    #[test]
    fn a_deleted_key_that_comes_back_is_stale() {
        // Key 2's tombstone removed but its value before it still there.
        let r = run(&history(&[1, 2, 4]));
        assert_eq!(r.found(), vec![(STALE_FINAL_VALUE, 1)], "{r:#?}");
        assert_eq!(r.anomalies[STALE_FINAL_VALUE].examples[0]["record_key"], 2);
    }

    #[test]
    fn the_final_state_counts_what_readers_saw_not_only_acknowledgements() {
        // A consumer read a value of key 3 at offset 5 from a send without
        // an answer; the final read ends at key 3's acknowledged value (4).
        let mut h = history(&[1, 4]);
        let mut unanswered = op(2, 1, OpType::Send, vec![Msg::unacked(0, 6).keyed(3, false)], false);
        unanswered.outcome = Outcome::Info;
        h.push(unanswered);
        h.push(op(3, 5, OpType::Poll, vec![Msg::at(0, 6, 5).keyed(3, false)], false));
        let r = run(&h);
        assert_eq!(r.found(), vec![(STALE_FINAL_VALUE, 1)], "{r:#?}");
    }

    #[test]
    fn a_last_value_missing_is_lost_unless_an_unanswered_tombstone_can_explain_it() {
        let mut h = history(&[1]);
        let r = run(&h);
        assert_eq!(r.found(), vec![(LOST_FINAL_VALUE, 1), (UNSEEN, 1)], "{r:#?}");
        // A tombstone of key 3 sent without an answer may have been stored
        // after offset 4 and removed in its turn, if some offset after 4 is
        // known to no one: the final read ended at 6, offset 5 is unknown.
        let mut unanswered = op(2, 1, OpType::Send, vec![Msg::unacked(0, 6).keyed(3, true)], false);
        unanswered.outcome = Outcome::Info;
        h.push(unanswered);
        let ends = BTreeMap::from([(0, 6)]);
        let r = check(&h, &[], &ends);
        assert!(r.valid, "{:#?}", r.found());
        assert_eq!(r.stats.final_keys_deleted_by_unacknowledged_tombstone, 1);
        // With every offset up to the end known, it has no place to be.
        let r = check(&h, &[], &BTreeMap::from([(0, 5)]));
        assert_eq!(r.found(), vec![(LOST_FINAL_VALUE, 1), (UNSEEN, 1)], "{r:#?}");
        // One that definitely failed cannot explain anything.
        h[2].outcome = Outcome::Fail;
        let r = check(&h, &[], &ends);
        assert_eq!(r.found(), vec![(LOST_FINAL_VALUE, 1), (UNSEEN, 1)], "{r:#?}");
    }

    #[test]
    fn a_reader_may_skip_only_what_compaction_may_have_removed_by_then() {
        let mut h = history(&[1, 4]);
        // Skips 2 (shadowed) and 3 (a tombstone): fine.
        h.push(op(2, 5, OpType::Poll, vec![writes()[1]], false));
        h.push(op(3, 5, OpType::Poll, vec![writes()[4]], false));
        assert!(run(&h).valid);
        // Skips 1, key 1's latest: not fine.
        h.push(op(4, 6, OpType::Poll, vec![writes()[0]], false));
        h.push(op(5, 6, OpType::Poll, vec![writes()[2]], false));
        let r = run(&h);
        assert_eq!(r.found(), vec![(POLL_SKIP, 1)], "{r:#?}");
        assert_eq!(r.anomalies[POLL_SKIP].examples[0]["skipped"], 1);
        // A skip of key 1's value at 1 excused by a later write of key 1
        // only if that write was sent before the poll.
        let mut h = history(&[1, 4]);
        h.push(op(2, 6, OpType::Poll, vec![writes()[0]], false));
        h.push(op(3, 6, OpType::Poll, vec![writes()[2]], false));
        h.push(op(4, 0, OpType::Send, vec![Msg::at(0, 7, 5).keyed(1, false)], false));
        h.push(op(5, 9, OpType::Poll, vec![Msg::at(0, 7, 5).keyed(1, false)], true));
        let r = run(&h);
        assert_eq!(r.found(), vec![(POLL_SKIP, 1)], "{r:#?}");
    }

    #[test]
    fn a_skip_may_be_excused_by_an_unanswered_value_with_room_after() {
        // A value of key 1 sent without an answer before the poll may have
        // shadowed offset 1 for a while (and been shadowed and removed in
        // its turn), if some offset after 1 is known to no one.
        let w = writes();
        let mut unanswered = op(1, 1, OpType::Send, vec![Msg::unacked(0, 8).keyed(1, false)], false);
        unanswered.outcome = Outcome::Info;
        let h = vec![
            op(0, 0, OpType::Send, w.clone(), false),
            unanswered,
            op(2, 9, OpType::Poll, vec![w[1], w[4]], true),
            op(3, 6, OpType::Poll, vec![w[0]], false),
            op(4, 6, OpType::Poll, vec![w[2]], false),
        ];
        let r = check(&h, &[], &BTreeMap::from([(0, 7)]));
        assert!(r.valid, "{:#?}", r.found());
        let r = check(&h, &[], &BTreeMap::from([(0, 5)]));
        assert_eq!(r.found(), vec![(POLL_SKIP, 1)], "{r:#?}");
    }

    #[test]
    fn a_replica_may_lack_only_what_compaction_may_remove() {
        let h = history(&[1, 4]);
        let copy = |offsets: &[u64]| ReplicaCopy {
            broker: 1,
            key: 0,
            records: offsets
                .iter()
                .map(|o| ReplicaRecord { offset: *o, value: *o + 1, committed: true })
                .collect(),
            marker: None,
        };
        let ends = BTreeMap::new();
        // One replica compacted, another not yet: both fine.
        assert!(
            check(&h, &[copy(&[1, 4]), ReplicaCopy { broker: 2, ..copy(&[0, 1, 2, 3, 4]) }], &ends).valid
        );
        // Missing key 1's latest record.
        let r = check(&h, &[copy(&[0, 4])], &ends);
        assert_eq!(r.found(), vec![(REPLICA_DIVERGENCE, 1)], "{r:#?}");
        // Missing it below the copy's first record is missing too.
        let r = check(&h, &[copy(&[4])], &ends);
        assert_eq!(r.found(), vec![(REPLICA_DIVERGENCE, 1)], "{r:#?}");
    }

    #[test]
    fn a_record_read_under_another_record_key_or_as_a_tombstone_is_unexpected() {
        let mut h = history(&[1, 4]);
        h.push(op(2, 5, OpType::Poll, vec![Msg::at(0, 2, 1).keyed(2, false)], true));
        let r = run(&h);
        assert!(r.found().contains(&(UNEXPECTED_VALUE, 1)), "{r:#?}");
        let mut h = history(&[1, 4]);
        h.push(op(2, 5, OpType::Poll, vec![Msg::at(0, 2, 1).keyed(1, true)], false));
        let r = run(&h);
        assert_eq!(r.found(), vec![(UNEXPECTED_VALUE, 1)], "{r:#?}");
    }
}

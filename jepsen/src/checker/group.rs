//! The consumer-group checks (`group` workload): the group's members
//! commit the position after each poll they processed, so
//!
//! - every acknowledged value is read by some member at least once
//!   (`group-undelivered` otherwise), and
//! - an acknowledged commit of position `o` in a partition comes after
//!   every acknowledged record of that partition below `o` was read by some
//!   member (`group-commit-skip` otherwise: a member that took the
//!   partition over from that position would never read the record).
//!
//! Reads that are not the group's (the final read) do not count.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::json;

use super::Report;
use crate::history::{Key, Op, OpType, Outcome, Value};

/// An acknowledged value no member of the group read.
pub const GROUP_UNDELIVERED: &str = "group-undelivered";
/// A commit past an acknowledged record no member had read yet.
pub const GROUP_COMMIT_SKIP: &str = "group-commit-skip";

/// Adds the group anomalies of `ops` (sorted by invocation) to `report`;
/// nothing for a history without group operations.
pub fn check(ops: &[&Op], report: &mut Report) {
    if !ops.iter().any(|o| o.group) {
        return;
    }
    // When each (partition, offset) was first read by a member, and which
    // values they read.
    let mut first_read: HashMap<(Key, u64), u64> = HashMap::new();
    let mut read: HashSet<(Key, Value)> = HashSet::new();
    for op in ops.iter().filter(|o| o.group && o.op_type == OpType::Poll && o.outcome == Outcome::Ok) {
        for m in &op.msgs {
            read.insert((m.key, m.value));
            if let Some(offset) = m.offset {
                let t = first_read.entry((m.key, offset)).or_insert(op.complete_ns);
                *t = (*t).min(op.complete_ns);
            }
        }
    }
    report.stats.group_values_delivered = read.len();
    // Acknowledged records by partition and offset.
    let mut acked: BTreeMap<Key, BTreeMap<u64, Value>> = BTreeMap::new();
    for op in ops.iter().filter(|o| o.op_type == OpType::Send && o.outcome == Outcome::Ok) {
        for m in &op.msgs {
            if let Some(offset) = m.offset {
                acked.entry(m.key).or_default().insert(offset, m.value);
            }
        }
    }
    for (key, records) in &acked {
        for (offset, value) in records {
            if !read.contains(&(*key, *value)) {
                report.add(GROUP_UNDELIVERED, json!({"key": key, "offset": offset, "value": value}));
            }
        }
    }
    // Per partition, the acknowledged offsets in order and, for each, the
    // latest first-read time up to it (never read: u64::MAX).
    let prefix: BTreeMap<Key, (Vec<u64>, Vec<u64>)> = acked
        .iter()
        .map(|(key, records)| {
            let offsets: Vec<u64> = records.keys().copied().collect();
            let mut latest = 0u64;
            let times = offsets
                .iter()
                .map(|o| {
                    latest = latest.max(first_read.get(&(*key, *o)).copied().unwrap_or(u64::MAX));
                    latest
                })
                .collect();
            (*key, (offsets, times))
        })
        .collect();
    for op in ops.iter().filter(|o| o.group && o.op_type == OpType::Commit && o.outcome == Outcome::Ok) {
        for m in &op.msgs {
            let (Some(position), Some((offsets, times))) = (m.offset, prefix.get(&m.key)) else { continue };
            let below = offsets.partition_point(|o| *o < position);
            if below == 0 || times[below - 1] < op.invoke_ns {
                continue;
            }
            // The first acknowledged record below the position not read in time.
            let missed = offsets[..below]
                .iter()
                .find(|o| first_read.get(&(m.key, **o)).is_none_or(|t| *t >= op.invoke_ns))
                .copied();
            report.add(
                GROUP_COMMIT_SKIP,
                json!({
                    "key": m.key,
                    "committed": position,
                    "op": op.index,
                    "process": op.process,
                    "unread_offset": missed,
                    "unread_value": missed.and_then(|o| acked.get(&m.key).and_then(|r| r.get(&o))),
                }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Msg;

    fn op(index: u64, op_type: OpType, msgs: Vec<Msg>, group: bool) -> Op {
        Op {
            index,
            process: 1,
            op_type,
            outcome: Outcome::Ok,
            invoke_ns: index * 10,
            complete_ns: index * 10 + 5,
            msgs,
            reset: false,
            final_read: false,
            group,
            error: None,
        }
    }

    fn found(history: &[Op]) -> Vec<(String, usize)> {
        let ops: Vec<&Op> = history.iter().collect();
        let mut report = Report::default();
        check(&ops, &mut report);
        report.anomalies.into_iter().filter(|(_, f)| f.count > 0).map(|(k, f)| (k, f.count)).collect()
    }

    #[test]
    fn commits_after_reading_are_fine_and_commits_past_unread_records_are_not() {
        let sends = op(0, OpType::Send, vec![Msg::at(0, 10, 0), Msg::at(0, 11, 1), Msg::at(0, 12, 2)], false);
        let read_two = op(1, OpType::Poll, vec![Msg::at(0, 10, 0), Msg::at(0, 11, 1)], true);
        let commit_two = op(2, OpType::Commit, vec![Msg::at(0, 0, 2)], true);
        let read_last = op(3, OpType::Poll, vec![Msg::at(0, 12, 2)], true);
        assert!(found(&[sends.clone(), read_two.clone(), commit_two.clone(), read_last.clone()]).is_empty());
        // Committed 3 before offset 2 was read: a skip; nobody reads 12: undelivered too.
        let commit_three = op(2, OpType::Commit, vec![Msg::at(0, 0, 3)], true);
        assert_eq!(
            found(&[sends.clone(), read_two.clone(), commit_three.clone()]),
            [(GROUP_COMMIT_SKIP.to_owned(), 1), (GROUP_UNDELIVERED.to_owned(), 1)]
        );
        // Read only by a reader outside the group (the final read): undelivered.
        let outside = op(3, OpType::Poll, vec![Msg::at(0, 12, 2)], false);
        assert_eq!(found(&[sends, read_two, commit_two, outside]), [(GROUP_UNDELIVERED.to_owned(), 1)]);
    }

    #[test]
    fn a_history_without_a_group_is_not_checked() {
        let sends = op(0, OpType::Send, vec![Msg::at(0, 10, 0)], false);
        assert!(found(&[sends]).is_empty());
    }
}

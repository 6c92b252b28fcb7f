//! Rules against vacuous runs. The anomaly classes say what a run found
//! wrong; these rules say whether it looked at enough to find anything: a
//! run that acknowledged almost nothing, whose final read did not finish,
//! or whose brokers' copies are missing, empty, behind or unmarked passes
//! every anomaly check without having checked much. Each broken rule is a
//! [`Violation`] that makes the run invalid.
//!
//! | rule | the run fails when |
//! |---|---|
//! | `too-few-acknowledged` | it acknowledged fewer values than [`RunFacts::min_values_acknowledged`] |
//! | `final-read-incomplete` | a partition's final read (the drain of everything) failed, timed out, or never ran |
//! | `copy-missing` | a broker of a partition's final replica set dumped no copy of it (or the replica sets are unknown) |
//! | `copy-empty` | a copy of a broker in the replica set holds no committed record while another copy of its partition, or the final read, has one |
//! | `copy-prefix-missing` | a copy lacks a committed offset that another copy holds below both copies' committed ends |
//! | `copy-behind-final-read` | a copy of a broker in the replica set ends (committed) below where its partition's final read ended |
//! | `no-committed-marker` | a copy has no committed marker, or its records' `committed` flags disagree with it |
//!
//! The copy rules are in `copies`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::{ReplicaCopy, Stats, copies};
use crate::history::{Key, Op, OpType, Outcome};

/// Fewer values acknowledged than the run's minimum.
pub const TOO_FEW_ACKNOWLEDGED: &str = "too-few-acknowledged";
/// A partition's final read did not reach its end.
pub const FINAL_READ_INCOMPLETE: &str = "final-read-incomplete";
/// A broker that holds a replica dumped no copy of it.
pub const COPY_MISSING: &str = "copy-missing";
/// A copy without committed records where its partition has some.
pub const COPY_EMPTY: &str = "copy-empty";
/// A copy lacking offsets another copy holds below both copies' ends.
pub const COPY_PREFIX_MISSING: &str = "copy-prefix-missing";
/// A copy whose committed end is below the final read's end.
pub const COPY_BEHIND_FINAL_READ: &str = "copy-behind-final-read";
/// A copy without its dump's committed marker.
pub const NO_COMMITTED_MARKER: &str = "no-committed-marker";

/// Every rule, in report order.
pub const RULES: [&str; 7] = [
    TOO_FEW_ACKNOWLEDGED,
    FINAL_READ_INCOMPLETE,
    COPY_MISSING,
    COPY_EMPTY,
    COPY_PREFIX_MISSING,
    COPY_BEHIND_FINAL_READ,
    NO_COMMITTED_MARKER,
];

/// The default of `--min-acked-fraction`: the share of the offered load a
/// run must see acknowledged (see [`min_values_acknowledged`]).
pub const DEFAULT_MIN_ACKED_FRACTION: f64 = 0.25;

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// The rule, one of [`RULES`].
    pub rule: String,
    /// What broke it.
    pub detail: String,
}

impl Violation {
    /// A violation of `rule`.
    pub fn new(rule: &str, detail: impl Into<String>) -> Self {
        Violation { rule: rule.to_owned(), detail: detail.into() }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rule {}: {}", self.rule, self.detail)
    }
}

/// What the harness knows of a run besides its history and copies, for
/// the rules. Written to `results.json` (`run_facts`), so that `check`
/// applies the same rules to a run directory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunFacts {
    /// Partitions of the test topic (each is a key).
    pub partitions: u32,
    /// Where each partition's final read ended: the high watermark it read
    /// to, exclusive.
    pub final_read_ends: BTreeMap<Key, u64>,
    /// Partitions whose final read failed or timed out, with the error.
    pub final_read_failures: BTreeMap<Key, String>,
    /// The fewest values the run must acknowledge.
    pub min_values_acknowledged: usize,
    /// Each partition's replica set (broker ids) when the brokers were
    /// stopped; `None` when the cluster did not say.
    pub replica_sets: Option<BTreeMap<Key, Vec<u32>>>,
    /// Broker id → slot (the number a copy's `broker` names; they differ
    /// after a broker was re-added empty).
    pub slots: BTreeMap<u32, u32>,
    /// Whether every follower reported lag 0 before the brokers were
    /// stopped (within the harness's bounded wait).
    pub followers_caught_up: bool,
}

/// The minimum number of acknowledged values for a run offering `rate`
/// send operations per second for `time_limit_s` seconds, each of 1 to
/// `msgs_per_send_max` values (uniformly, so (1 + max) / 2 on average):
/// `fraction` of that offered load, rounded up.
pub fn min_values_acknowledged(rate: f64, time_limit_s: f64, msgs_per_send_max: u32, fraction: f64) -> usize {
    let offered = rate.max(0.0) * time_limit_s.max(0.0) * (1.0 + f64::from(msgs_per_send_max.max(1))) / 2.0;
    (offered * fraction.max(0.0)).ceil() as usize
}

/// Every broken rule of a run with history `history` (whose counts the
/// checker gathered in `stats`), brokers' copies `replicas` and `facts`.
pub fn check(history: &[Op], stats: &Stats, replicas: &[ReplicaCopy], facts: &RunFacts) -> Vec<Violation> {
    let mut out = Vec::new();
    too_few_acknowledged(stats, facts, &mut out);
    final_read_incomplete(facts, &mut out);
    let final_read_returned: BTreeSet<Key> = history
        .iter()
        .filter(|o| o.final_read && o.op_type == OpType::Poll && o.outcome == Outcome::Ok)
        .flat_map(|o| o.msgs.iter().map(|m| m.key))
        .collect();
    copies::missing(replicas, facts, &mut out);
    copies::empty(replicas, facts, &final_read_returned, &mut out);
    copies::prefix_missing(replicas, &copies::RecordKeys::of(history), &mut out);
    copies::behind_final_read(replicas, facts, &mut out);
    copies::no_committed_marker(replicas, &mut out);
    out
}

/// `too-few-acknowledged`.
fn too_few_acknowledged(stats: &Stats, facts: &RunFacts, out: &mut Vec<Violation>) {
    if stats.values_acknowledged < facts.min_values_acknowledged {
        out.push(Violation::new(
            TOO_FEW_ACKNOWLEDGED,
            format!(
                "{} values acknowledged, fewer than the run's minimum of {} (--min-acked-fraction of the \
                 offered load): the checks saw too little work",
                stats.values_acknowledged, facts.min_values_acknowledged
            ),
        ));
    }
}

/// `final-read-incomplete`.
fn final_read_incomplete(facts: &RunFacts, out: &mut Vec<Violation>) {
    for (p, e) in &facts.final_read_failures {
        out.push(Violation::new(
            FINAL_READ_INCOMPLETE,
            format!("the final read of partition {p} failed: {e}"),
        ));
    }
    for p in 0..facts.partitions {
        if !facts.final_read_ends.contains_key(&p) && !facts.final_read_failures.contains_key(&p) {
            out.push(Violation::new(FINAL_READ_INCOMPLETE, format!("partition {p} has no final read")));
        }
    }
    if facts.partitions == 0 && facts.final_read_ends.is_empty() {
        out.push(Violation::new(FINAL_READ_INCOMPLETE, "no partition was read at the end"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(partitions: u32) -> RunFacts {
        RunFacts {
            partitions,
            final_read_ends: (0..partitions).map(|p| (p, 10)).collect(),
            ..RunFacts::default()
        }
    }

    fn rules(v: &[Violation]) -> Vec<&str> {
        v.iter().map(|v| v.rule.as_str()).collect()
    }

    #[test]
    fn too_few_acknowledged_writes_fail_the_run() {
        let f = RunFacts { min_values_acknowledged: 100, ..facts(1) };
        let mut out = Vec::new();
        too_few_acknowledged(&Stats { values_acknowledged: 99, ..Stats::default() }, &f, &mut out);
        assert_eq!(rules(&out), vec![TOO_FEW_ACKNOWLEDGED]);
        assert!(out[0].detail.contains("99 values acknowledged"), "{}", out[0]);
        let mut out = Vec::new();
        too_few_acknowledged(&Stats { values_acknowledged: 100, ..Stats::default() }, &f, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn min_acknowledged_is_a_fraction_of_the_offered_load() {
        // The CI runs: 50 sends/s of 1..=4 values (2.5 on average).
        assert_eq!(min_values_acknowledged(50.0, 60.0, 4, DEFAULT_MIN_ACKED_FRACTION), 1875);
        assert_eq!(min_values_acknowledged(50.0, 30.0, 4, DEFAULT_MIN_ACKED_FRACTION), 938);
        assert_eq!(min_values_acknowledged(50.0, 60.0, 4, 0.0), 0);
    }

    #[test]
    fn a_final_read_that_failed_or_never_ran_fails_the_run() {
        let mut out = Vec::new();
        final_read_incomplete(&facts(2), &mut out);
        assert!(out.is_empty(), "{out:?}");

        let mut f = facts(2);
        f.final_read_ends.remove(&1);
        f.final_read_failures.insert(1, "partition 1: final read reached Some(4) of 10 within 60s".into());
        let mut out = Vec::new();
        final_read_incomplete(&f, &mut out);
        assert_eq!(rules(&out), vec![FINAL_READ_INCOMPLETE]);
        assert!(out[0].detail.contains("partition 1"), "{}", out[0]);

        let mut f = facts(3);
        f.final_read_ends.remove(&2);
        let mut out = Vec::new();
        final_read_incomplete(&f, &mut out);
        assert_eq!(rules(&out), vec![FINAL_READ_INCOMPLETE]);

        let mut out = Vec::new();
        final_read_incomplete(&RunFacts::default(), &mut out);
        assert_eq!(rules(&out), vec![FINAL_READ_INCOMPLETE]);
    }
}

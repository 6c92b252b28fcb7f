//! Rebalance planning: which partitions to reassign so that every broker
//! holds about as many replicas, and is the preferred leader (first
//! replica) of about as many partitions, as every other, or so that a
//! broker being decommissioned holds none. A pure function of the
//! placement; [`crate::Admin::alter_partition_reassignments`] carries the
//! plan out. Like Kafka's `kafka-reassign-partitions.sh --generate`, it
//! only proposes: moves are made with `--execute`.
//!
//! Greedy and move-minimising: each step moves one replica from the most
//! loaded broker (a drained one first) to the least loaded one that does
//! not hold the partition already, until replica counts are within one of
//! each other; then it reorders replica lists (no data moves) until
//! preferred-leader counts are within one too.

use std::collections::{BTreeMap, BTreeSet};

/// One partition's placement, as input and output of [`plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// Replica brokers, the preferred leader first.
    pub replicas: Vec<u32>,
}

/// Replica and preferred-leader counts per broker.
pub fn counts(placements: &[Placement], brokers: &BTreeSet<u32>) -> BTreeMap<u32, (usize, usize)> {
    let mut out: BTreeMap<u32, (usize, usize)> = brokers.iter().map(|b| (*b, (0, 0))).collect();
    for p in placements {
        for (i, b) in p.replicas.iter().enumerate() {
            let e = out.entry(*b).or_default();
            e.0 += 1;
            if i == 0 {
                e.1 += 1;
            }
        }
    }
    out
}

/// The placements that change (in input order) to balance `placements`
/// over `brokers`, none of them left on a broker in `drain`. Brokers in
/// neither set that hold replicas (unknown ones) are treated as drained.
///
/// # Errors
/// A partition cannot keep its replication factor: more replicas than
/// brokers to place them on.
pub fn plan(
    placements: &[Placement],
    brokers: &BTreeSet<u32>,
    drain: &BTreeSet<u32>,
) -> Result<Vec<Placement>, String> {
    let eligible: BTreeSet<u32> = brokers.difference(drain).copied().collect();
    if let Some(p) = placements.iter().find(|p| p.replicas.len() > eligible.len()) {
        return Err(format!(
            "{}-{} has {} replicas but only {} brokers can hold them",
            p.topic,
            p.partition,
            p.replicas.len(),
            eligible.len()
        ));
    }
    let mut out: Vec<Placement> = placements.to_vec();
    // Replica counts.
    loop {
        let c = counts(&out, &eligible);
        let drained = out.iter().flat_map(|p| p.replicas.iter()).find(|b| !eligible.contains(b)).copied();
        let (from, must) = match drained {
            Some(b) => (b, true),
            None => match c.iter().max_by_key(|(b, (n, _))| (*n, std::cmp::Reverse(**b))) {
                Some((b, _)) => (*b, false),
                None => break,
            },
        };
        let from_count = c.get(&from).map_or(usize::MAX, |e| e.0);
        // The least loaded broker that can take one of `from`'s partitions.
        let mut moved = false;
        let mut by_load: Vec<(usize, u32)> = c.iter().map(|(b, (n, _))| (*n, *b)).collect();
        by_load.sort_unstable();
        for (to_count, to) in by_load {
            if to == from || (!must && to_count + 1 >= from_count) {
                continue;
            }
            if let Some(p) = out.iter_mut().find(|p| p.replicas.contains(&from) && !p.replicas.contains(&to))
            {
                for r in p.replicas.iter_mut().filter(|r| **r == from) {
                    *r = to;
                }
                moved = true;
                break;
            }
        }
        if !moved {
            if must {
                return Err(format!("no broker can take broker {from}'s replicas"));
            }
            break;
        }
    }
    // Preferred-leader counts, by reordering.
    loop {
        let c = counts(&out, &eligible);
        let Some((&most, &(_, most_n))) = c.iter().max_by_key(|(b, (_, l))| (*l, std::cmp::Reverse(**b)))
        else {
            break;
        };
        let mut swapped = false;
        let mut by_leaders: Vec<(usize, u32)> = c.iter().map(|(b, (_, l))| (*l, *b)).collect();
        by_leaders.sort_unstable();
        for (n, to) in by_leaders {
            if to == most || n + 1 >= most_n {
                continue;
            }
            if let Some(p) =
                out.iter_mut().find(|p| p.replicas.first() == Some(&most) && p.replicas.contains(&to))
            {
                let at = p.replicas.iter().position(|r| *r == to).unwrap_or(0);
                p.replicas.swap(0, at);
                swapped = true;
                break;
            }
        }
        if !swapped {
            break;
        }
    }
    Ok(out.into_iter().zip(placements).filter(|(new, old)| new != *old).map(|(new, _)| new).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(partition: u32, replicas: &[u32]) -> Placement {
        Placement { topic: "t".into(), partition, replicas: replicas.to_vec() }
    }

    fn apply(placements: &[Placement], changes: &[Placement]) -> Vec<Placement> {
        placements
            .iter()
            .map(|x| {
                changes.iter().find(|c| c.partition == x.partition).cloned().unwrap_or_else(|| x.clone())
            })
            .collect()
    }

    fn spread(c: &BTreeMap<u32, (usize, usize)>) -> (usize, usize) {
        let r = c.values().map(|e| e.0);
        let l = c.values().map(|e| e.1);
        (
            r.clone().max().unwrap_or(0) - r.min().unwrap_or(0),
            l.clone().max().unwrap_or(0) - l.min().unwrap_or(0),
        )
    }

    #[test]
    fn a_new_broker_gets_its_share_of_replicas_and_leaders() {
        // 6 partitions of 3 replicas on brokers 1-3; broker 4 joins.
        let before: Vec<Placement> =
            (0..6).map(|i| p(i, &[1 + i % 3, 1 + (i + 1) % 3, 1 + (i + 2) % 3])).collect();
        let brokers: BTreeSet<u32> = [1, 2, 3, 4].into();
        let changes = plan(&before, &brokers, &BTreeSet::new()).unwrap();
        let after = apply(&before, &changes);
        let c = counts(&after, &brokers);
        assert!(spread(&c).0 <= 1 && spread(&c).1 <= 1, "{c:?}");
        assert!(c[&4].0 >= 4, "broker 4 holds {} of 18 replicas", c[&4].0);
        assert!(
            after.iter().all(|x| x.replicas.iter().collect::<BTreeSet<_>>().len() == 3),
            "a broker twice"
        );
        // Minimal: no more moves than the new broker's share.
        let moved: usize = changes
            .iter()
            .map(|c| {
                let old = &before[c.partition as usize];
                c.replicas.iter().filter(|b| !old.replicas.contains(b)).count()
            })
            .sum();
        assert!(moved <= 5, "{moved} replicas moved for a share of 4-5");
        // Balanced already: nothing to do.
        assert!(plan(&after, &brokers, &BTreeSet::new()).unwrap().is_empty());
    }

    #[test]
    fn a_drained_broker_ends_with_nothing() {
        let before: Vec<Placement> = (0..4).map(|i| p(i, &[1 + i % 4, 1 + (i + 1) % 4])).collect();
        let brokers: BTreeSet<u32> = [1, 2, 3, 4].into();
        let changes = plan(&before, &brokers, &[1].into()).unwrap();
        let after = apply(&before, &changes);
        assert!(after.iter().all(|x| !x.replicas.contains(&1)), "{after:?}");
        let c = counts(&after, &[2, 3, 4].into());
        assert!(spread(&c).0 <= 1, "{c:?}");
        // Three replicas on a cluster that would keep two brokers: refused.
        let wide = vec![p(0, &[1, 2, 3])];
        assert!(plan(&wide, &[1, 2, 3].into(), &[1].into()).is_err());
    }
}

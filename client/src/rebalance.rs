//! Rebalance planning: which partitions to reassign so that every broker
//! holds about as many replicas, and is the preferred leader (first
//! replica) of about as many partitions, as every other, or so that a
//! broker being decommissioned holds none. A pure function of the
//! placement; [`crate::Admin::alter_partition_reassignments`] carries the
//! plan out. Like Kafka's `kafka-reassign-partitions.sh --generate`, it
//! only proposes: moves are made with `--execute`.
//!
//! Greedy: each step moves one replica from the most loaded broker (a
//! drained one first) to the least loaded one that does not hold the
//! partition already, until replica counts are within one of each other or
//! no such move exists; then it reorders replica lists (no data moves)
//! while a broker has two or more preferred leaderships more than another
//! that holds a replica of one of them. Not an optimum: the counts printed
//! are what it reached.

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

/// Replica and preferred-leader counts of each broker in `brokers`
/// (others' replicas are not counted).
pub fn counts(placements: &[Placement], brokers: &BTreeSet<u32>) -> BTreeMap<u32, (usize, usize)> {
    let mut out: BTreeMap<u32, (usize, usize)> = brokers.iter().map(|b| (*b, (0, 0))).collect();
    for p in placements {
        for (i, b) in p.replicas.iter().enumerate() {
            if let Some(e) = out.get_mut(b) {
                e.0 += 1;
                if i == 0 {
                    e.1 += 1;
                }
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
    // Each step below lowers a sum of squares or a count of drained
    // replicas; the cap only guards against a bug turning that into a hang.
    let cap = 16 * (1 + placements.iter().map(|p| p.replicas.len()).sum::<usize>()).pow(2);
    let mut steps = 0usize;
    let mut step = || {
        steps += 1;
        if steps > cap { Err(format!("the plan did not settle within {cap} steps")) } else { Ok(()) }
    };
    // Replica counts.
    loop {
        step()?;
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
        // `c` counts eligible brokers only: a drained broker is never a target.
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
    // Preferred-leader counts, by reordering. A broker with two or more
    // preferred leaderships more than another gives one away along a chain:
    // it makes another replica of one of its partitions the first, that
    // broker does the same with one of its own, and so on until a broker
    // that had two fewer gains one (a breadth-first search over "first
    // replica of a partition that also holds"). Only the two ends' counts
    // change, and the sum of squares drops each time, so it ends.
    loop {
        step()?;
        let c = counts(&out, &eligible);
        let mut by_leaders: Vec<(usize, u32)> = c.iter().map(|(b, (_, l))| (*l, *b)).collect();
        by_leaders.sort_unstable();
        let chain = by_leaders.iter().rev().find_map(|&(most_n, most)| leader_chain(&out, &c, most, most_n));
        let Some(chain) = chain else { break };
        for (partition, to) in chain {
            let p = &mut out[partition];
            let at = p.replicas.iter().position(|r| *r == to).unwrap_or(0);
            p.replicas.swap(0, at);
        }
    }
    Ok(out.into_iter().zip(placements).filter(|(new, old)| new != *old).map(|(new, _)| new).collect())
}

/// The swaps (partition index, broker to make first) that move one
/// preferred leadership from `from` (which has `from_n`) to a broker with
/// at most `from_n - 2`, through brokers whose counts stay; `None` if no
/// chain exists.
fn leader_chain(
    out: &[Placement],
    c: &BTreeMap<u32, (usize, usize)>,
    from: u32,
    from_n: usize,
) -> Option<Vec<(usize, u32)>> {
    let mut prev: BTreeMap<u32, (u32, usize)> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([from]);
    while let Some(u) = queue.pop_front() {
        for (i, p) in out.iter().enumerate().filter(|(_, p)| p.replicas.first() == Some(&u)) {
            for &v in p.replicas.iter().skip(1) {
                if v == from || prev.contains_key(&v) || !c.contains_key(&v) {
                    continue;
                }
                prev.insert(v, (u, i));
                if c[&v].1 + 2 <= from_n {
                    let mut chain = Vec::new();
                    let mut at = v;
                    while at != from {
                        let (back, partition) = prev[&at];
                        chain.push((partition, at));
                        at = back;
                    }
                    return Some(chain);
                }
                queue.push_back(v);
            }
        }
    }
    None
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
    fn preferred_leaders_even_out_past_the_first_broker_and_drains_never_ping_pong() {
        // Leaders 2/1/1/0: broker 1 cannot give to 4, broker 2 can.
        let before = vec![p(0, &[1, 2]), p(1, &[1, 3]), p(2, &[2, 4]), p(3, &[3, 4])];
        let brokers: BTreeSet<u32> = [1, 2, 3, 4].into();
        let after = apply(&before, &plan(&before, &brokers, &BTreeSet::new()).unwrap());
        assert!(spread(&counts(&after, &brokers)).1 <= 1, "{after:?}");
        // Two drained brokers: their replicas go to the others, not to each other.
        let before =
            vec![p(0, &[1, 3]), p(1, &[1, 4]), p(2, &[2, 5]), p(3, &[3, 4]), p(4, &[4, 5]), p(5, &[5, 3])];
        let brokers: BTreeSet<u32> = [1, 2, 3, 4, 5].into();
        let after = apply(&before, &plan(&before, &brokers, &[1, 2].into()).unwrap());
        assert!(after.iter().all(|x| !x.replicas.contains(&1) && !x.replicas.contains(&2)), "{after:?}");
    }

    #[test]
    fn random_placements_end_valid_and_within_one() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..300 {
            let brokers_n = 2 + next(6) as u32;
            let rf = 1 + next(u64::from(brokers_n.min(3))) as usize;
            let all: Vec<u32> = (1..=brokers_n).collect();
            let before: Vec<Placement> = (0..1 + next(20) as u32)
                .map(|i| {
                    let mut r = all.clone();
                    for k in (1..r.len()).rev() {
                        r.swap(k, next(k as u64 + 1) as usize);
                    }
                    r.truncate(rf);
                    p(i, &r)
                })
                .collect();
            let brokers: BTreeSet<u32> = all.iter().copied().collect();
            let drain: BTreeSet<u32> = if next(3) == 0 { [1].into() } else { BTreeSet::new() };
            let Ok(changes) = plan(&before, &brokers, &drain) else {
                assert!(rf > (brokers_n as usize) - drain.len(), "refused although it fits");
                continue;
            };
            let after = apply(&before, &changes);
            for x in &after {
                assert_eq!(x.replicas.len(), rf);
                assert_eq!(x.replicas.iter().collect::<BTreeSet<_>>().len(), rf, "a broker twice: {x:?}");
                assert!(x.replicas.iter().all(|b| !drain.contains(b)), "left on a drained broker: {x:?}");
            }
            let eligible: BTreeSet<u32> = brokers.difference(&drain).copied().collect();
            assert!(spread(&counts(&after, &eligible)).0 <= 1, "{before:?} -> {after:?}");
        }
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

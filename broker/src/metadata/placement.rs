//! Replica placement for new topics: a pure function of the brokers' current
//! load, so it can be tested without a cluster.
//!
//! Each partition takes the `replication_factor` brokers with the fewest
//! replicas (ties by fewest preferred leaderships, then id), and its
//! preferred leader (first replica) is the one of those with the fewest
//! leaderships, so both replica and leader counts stay balanced.

use std::collections::BTreeMap;

use crate::config::BrokerId;

/// Places `partitions` partitions of `replication_factor` replicas on
/// `brokers`, given each broker's current replica and leader counts. Returns
/// per partition the broker ids, preferred leader first; `None` if there
/// are fewer brokers than `replication_factor`.
pub fn place(
    brokers: &[BrokerId],
    replica_counts: &BTreeMap<BrokerId, usize>,
    leader_counts: &BTreeMap<BrokerId, usize>,
    partitions: u32,
    replication_factor: u32,
) -> Option<Vec<Vec<BrokerId>>> {
    let rf = replication_factor as usize;
    if rf == 0 || brokers.len() < rf {
        return None;
    }
    let mut replicas: BTreeMap<BrokerId, usize> =
        brokers.iter().map(|b| (*b, replica_counts.get(b).copied().unwrap_or(0))).collect();
    let mut leaders: BTreeMap<BrokerId, usize> =
        brokers.iter().map(|b| (*b, leader_counts.get(b).copied().unwrap_or(0))).collect();
    let mut out = Vec::with_capacity(partitions as usize);
    for _ in 0..partitions {
        let mut order: Vec<BrokerId> = brokers.to_vec();
        order.sort_by_key(|b| (replicas[b], leaders[b], *b));
        let mut chosen: Vec<BrokerId> = order.into_iter().take(rf).collect();
        let lead = (0..chosen.len()).min_by_key(|i| (leaders[&chosen[*i]], *i)).unwrap_or(0);
        chosen.swap(0, lead);
        for b in &chosen {
            *replicas.entry(*b).or_default() += 1;
        }
        *leaders.entry(chosen[0]).or_default() += 1;
        out.push(chosen);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balances_replicas_and_leaders() {
        let none = BTreeMap::new();
        let p = place(&[1, 2, 3], &none, &none, 6, 3).expect("placed");
        let mut leaders = BTreeMap::<BrokerId, usize>::new();
        for r in &p {
            assert_eq!(r.len(), 3);
            let mut s = r.clone();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), 3, "distinct brokers");
            *leaders.entry(r[0]).or_default() += 1;
        }
        assert_eq!(leaders.values().copied().collect::<Vec<_>>(), vec![2, 2, 2]);

        let p = place(&[1, 2, 3, 4], &none, &none, 4, 1).expect("placed");
        let mut firsts: Vec<_> = p.iter().map(|r| r[0]).collect();
        firsts.sort_unstable();
        assert_eq!(firsts, vec![1, 2, 3, 4]);

        let loaded = BTreeMap::from([(1, 10), (2, 0), (3, 0)]);
        let p = place(&[1, 2, 3], &loaded, &none, 1, 2).expect("placed");
        assert!(!p[0].contains(&1), "the loaded broker is avoided");
        assert!(place(&[1, 2], &none, &none, 1, 3).is_none());
    }
}

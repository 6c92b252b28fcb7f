//! Partition assignors of a consumer group, run by the group's leader
//! member (as in Kafka: the coordinator only carries the result). Pure
//! functions of the members' subscriptions and the topics' partition counts.
//!
//! - [`Assignor::Range`]: per topic, consecutive ranges of partitions to the
//!   members subscribed to it, in member order, the first ones one more
//!   (Kafka's `RangeAssignor`).
//! - [`Assignor::RoundRobin`]: every subscribed partition, in (topic,
//!   partition) order, dealt to the members in turn, skipping members not
//!   subscribed to its topic (Kafka's `RoundRobinAssignor`).
//! - [`Assignor::CooperativeSticky`]: balanced (counts within one) while
//!   keeping each member's owned partitions where it can; a partition that
//!   must move is first only taken from its owner, and given to its new
//!   owner in the next rebalance, once revoked (KIP-429, Kafka's
//!   `CooperativeStickyAssignor`): no partition is ever owned by two
//!   members at once, and members keep consuming what does not move.

use std::collections::{BTreeMap, BTreeSet};

/// A topic partition: (topic, partition number).
pub type TopicPartition = (String, u32);

/// The assignors the client library has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Assignor {
    /// Kafka's `range`.
    Range,
    /// Kafka's `roundrobin`.
    RoundRobin,
    /// Kafka's `cooperative-sticky` (incremental rebalancing).
    CooperativeSticky,
}

impl Assignor {
    /// Its protocol name, as Kafka's clients name it.
    pub fn name(self) -> &'static str {
        match self {
            Assignor::Range => "range",
            Assignor::RoundRobin => "roundrobin",
            Assignor::CooperativeSticky => "cooperative-sticky",
        }
    }

    /// The assignor of a protocol name.
    pub fn from_name(name: &str) -> Option<Assignor> {
        [Assignor::Range, Assignor::RoundRobin, Assignor::CooperativeSticky]
            .into_iter()
            .find(|a| a.name() == name)
    }

    /// Whether members keep their partitions through a rebalance
    /// (revoking only those that move) rather than giving all up first.
    pub fn cooperative(self) -> bool {
        self == Assignor::CooperativeSticky
    }
}

/// One member's subscription, as the leader sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    /// Member id.
    pub member_id: String,
    /// Topics it subscribes to.
    pub topics: BTreeSet<String>,
    /// The partitions it owns now (cooperative rebalancing).
    pub owned: BTreeSet<TopicPartition>,
    /// The generation it owned them in (-1: none).
    pub generation: i32,
}

/// Assigns the partitions of `partitions` (topic → partition count) to
/// `members` with `assignor`; every member gets an entry (maybe empty).
/// Topics no member subscribes to, or that do not exist, are not assigned.
pub fn assign(
    assignor: Assignor,
    members: &[Subscription],
    partitions: &BTreeMap<String, u32>,
) -> BTreeMap<String, BTreeSet<TopicPartition>> {
    let mut out: BTreeMap<String, BTreeSet<TopicPartition>> =
        members.iter().map(|m| (m.member_id.clone(), BTreeSet::new())).collect();
    let mut sorted: Vec<&Subscription> = members.iter().collect();
    sorted.sort_by(|a, b| a.member_id.cmp(&b.member_id));
    match assignor {
        Assignor::Range => {
            for (topic, count) in partitions {
                let subscribed: Vec<&&Subscription> =
                    sorted.iter().filter(|m| m.topics.contains(topic)).collect();
                if subscribed.is_empty() {
                    continue;
                }
                let n = subscribed.len() as u32;
                let (each, extra) = (count / n, count % n);
                let mut next = 0;
                for (i, m) in subscribed.iter().enumerate() {
                    let take = each + u32::from((i as u32) < extra);
                    let set = out.get_mut(&m.member_id).expect("every member has an entry");
                    set.extend((next..next + take).map(|p| (topic.clone(), p)));
                    next += take;
                }
            }
        }
        Assignor::RoundRobin => {
            let mut turn = 0usize;
            for (topic, count) in partitions {
                for p in 0..*count {
                    let n = sorted.len();
                    if let Some(k) = (0..n).find(|k| sorted[(turn + k) % n].topics.contains(topic)) {
                        let m = sorted[(turn + k) % n];
                        out.get_mut(&m.member_id)
                            .expect("every member has an entry")
                            .insert((topic.clone(), p));
                        turn = (turn + k + 1) % n;
                    }
                }
            }
        }
        Assignor::CooperativeSticky => sticky(&sorted, partitions, &mut out),
    }
    out
}

/// The cooperative-sticky assignment (see the module docs).
fn sticky(
    members: &[&Subscription],
    partitions: &BTreeMap<String, u32>,
    out: &mut BTreeMap<String, BTreeSet<TopicPartition>>,
) {
    let exists = |tp: &TopicPartition| partitions.get(&tp.0).is_some_and(|c| tp.1 < *c);
    // Who owns what now: a claim by two members goes to the later generation.
    let mut owner: BTreeMap<TopicPartition, (i32, &str)> = BTreeMap::new();
    for m in members {
        for tp in m.owned.iter().filter(|tp| exists(tp) && m.topics.contains(&tp.0)) {
            let claim = (m.generation, m.member_id.as_str());
            owner.entry(tp.clone()).and_modify(|c| *c = (*c).max(claim)).or_insert(claim);
        }
    }
    let all: Vec<TopicPartition> = partitions
        .iter()
        .filter(|(t, _)| members.iter().any(|m| m.topics.contains(*t)))
        .flat_map(|(t, c)| (0..*c).map(move |p| (t.clone(), p)))
        .collect();
    // Start from what each member owns; then no member above the fair
    // share keeps more than it (ceil(partitions / members)).
    let mut target: BTreeMap<&str, BTreeSet<TopicPartition>> =
        members.iter().map(|m| (m.member_id.as_str(), BTreeSet::new())).collect();
    for (tp, (_, m)) in &owner {
        target.get_mut(m).expect("an owner is a member").insert(tp.clone());
    }
    let share = all.len().div_ceil(members.len().max(1));
    for set in target.values_mut() {
        while set.len() > share {
            let last = set.iter().next_back().cloned().expect("not empty");
            set.remove(&last);
        }
    }
    // Everything unassigned goes to the subscribed member with the fewest.
    let assigned: BTreeSet<TopicPartition> = target.values().flatten().cloned().collect();
    for tp in all.iter().filter(|tp| !assigned.contains(*tp)) {
        let fewest = members
            .iter()
            .filter(|m| m.topics.contains(&tp.0))
            .min_by_key(|m| (target[m.member_id.as_str()].len(), m.member_id.as_str()));
        if let Some(m) = fewest {
            target.get_mut(m.member_id.as_str()).expect("a member").insert(tp.clone());
        }
    }
    // Even out: move from the most to the fewest while they differ by two.
    loop {
        let mut best: Option<(&str, &str, TopicPartition)> = None;
        for (from, set) in &target {
            for to in members.iter().map(|m| m.member_id.as_str()) {
                if target[to].len() + 1 < set.len() {
                    let sub = members.iter().find(|m| m.member_id == to).expect("a member");
                    if let Some(tp) = set.iter().rev().find(|tp| sub.topics.contains(&tp.0)) {
                        best = Some((from, to, tp.clone()));
                        break;
                    }
                }
            }
            if best.is_some() {
                break;
            }
        }
        let Some((from, to, tp)) = best else { break };
        let (from, to) = (from.to_owned(), to.to_owned());
        target.get_mut(from.as_str()).expect("a member").remove(&tp);
        target.get_mut(to.as_str()).expect("a member").insert(tp);
    }
    // A partition moving from its owner is withheld this round: its owner
    // revokes it, rejoins, and the next rebalance gives it on (KIP-429).
    for (m, set) in target {
        let keep = set.into_iter().filter(|tp| owner.get(tp).is_none_or(|(_, o)| *o == m));
        out.get_mut(m).expect("every member has an entry").extend(keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(id: &str, topics: &[&str], owned: &[(&str, u32)], generation: i32) -> Subscription {
        Subscription {
            member_id: id.into(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            owned: owned.iter().map(|(t, p)| ((*t).to_owned(), *p)).collect(),
            generation,
        }
    }

    fn counts(a: &BTreeMap<String, BTreeSet<TopicPartition>>) -> Vec<usize> {
        a.values().map(BTreeSet::len).collect()
    }

    /// Every partition of `partitions` exactly once.
    fn covers(a: &BTreeMap<String, BTreeSet<TopicPartition>>, partitions: &BTreeMap<String, u32>) {
        let mut seen = BTreeSet::new();
        for set in a.values() {
            for tp in set {
                assert!(seen.insert(tp.clone()), "{tp:?} assigned twice: {a:?}");
            }
        }
        let total: u32 = partitions.values().sum();
        assert_eq!(seen.len(), total as usize, "{a:?}");
    }

    #[test]
    fn range_gives_consecutive_ranges_the_first_members_one_more() {
        let parts = BTreeMap::from([("t".to_owned(), 7)]);
        let members = [sub("b", &["t"], &[], -1), sub("a", &["t"], &[], -1), sub("c", &["t"], &[], -1)];
        let a = assign(Assignor::Range, &members, &parts);
        covers(&a, &parts);
        assert_eq!(a["a"], (0..3).map(|p| ("t".to_owned(), p)).collect());
        assert_eq!(a["b"], (3..5).map(|p| ("t".to_owned(), p)).collect());
        assert_eq!(a["c"], (5..7).map(|p| ("t".to_owned(), p)).collect());
    }

    #[test]
    fn round_robin_deals_in_turn_skipping_members_not_subscribed() {
        let parts = BTreeMap::from([("t".to_owned(), 4), ("u".to_owned(), 2)]);
        let members = [sub("a", &["t", "u"], &[], -1), sub("b", &["t"], &[], -1)];
        let a = assign(Assignor::RoundRobin, &members, &parts);
        covers(&a, &parts);
        assert_eq!(counts(&a), [4, 2]);
        assert!(a["b"].iter().all(|tp| tp.0 == "t"));
    }

    #[test]
    fn sticky_keeps_what_members_own_and_withholds_what_moves() {
        let parts = BTreeMap::from([("t".to_owned(), 6)]);
        // a owned everything; b joins: 3 move, but only after a revoked them.
        let owned: Vec<(&str, u32)> = (0..6).map(|p| ("t", p)).collect();
        let first = assign(
            Assignor::CooperativeSticky,
            &[sub("a", &["t"], &owned, 1), sub("b", &["t"], &[], -1)],
            &parts,
        );
        assert_eq!(counts(&first), [3, 0], "b gets nothing until a revoked: {first:?}");
        let kept: Vec<(&str, u32)> = first["a"].iter().map(|(t, p)| (t.as_str(), *p)).collect();
        let second = assign(
            Assignor::CooperativeSticky,
            &[sub("a", &["t"], &kept, 2), sub("b", &["t"], &[], -1)],
            &parts,
        );
        covers(&second, &parts);
        assert_eq!(second["a"], first["a"], "a keeps its partitions");
        assert_eq!(counts(&second), [3, 3]);
        // A member leaves: the other takes its partitions at once (nobody owns them).
        let b: Vec<(&str, u32)> = second["b"].iter().map(|(t, p)| (t.as_str(), *p)).collect();
        let third = assign(Assignor::CooperativeSticky, &[sub("b", &["t"], &b, 2)], &parts);
        covers(&third, &parts);
    }

    #[test]
    fn sticky_balances_many_members_and_resolves_double_claims_by_generation() {
        let parts = BTreeMap::from([("t".to_owned(), 10), ("u".to_owned(), 3)]);
        let members: Vec<Subscription> =
            (0..4).map(|i| sub(&format!("m{i}"), &["t", "u"], &[], -1)).collect();
        let a = assign(Assignor::CooperativeSticky, &members, &parts);
        covers(&a, &parts);
        let c = counts(&a);
        assert!(c.iter().max().unwrap() - c.iter().min().unwrap() <= 1, "{c:?}");
        // Two members claim t-0: the later generation keeps it; the other is not given it.
        let claims = [sub("x", &["t"], &[("t", 0)], 3), sub("y", &["t"], &[("t", 0)], 2)];
        let a = assign(Assignor::CooperativeSticky, &claims, &BTreeMap::from([("t".to_owned(), 2)]));
        assert!(a["x"].contains(&("t".to_owned(), 0)));
        assert!(!a["y"].contains(&("t".to_owned(), 0)));
    }

    #[test]
    fn names_round_trip() {
        for a in [Assignor::Range, Assignor::RoundRobin, Assignor::CooperativeSticky] {
            assert_eq!(Assignor::from_name(a.name()), Some(a));
        }
        assert_eq!(Assignor::from_name("sticky"), None);
    }
}

//! One coordinator partition's groups in memory: what its records say, and
//! the rules a commit must pass. Pure: [`super::Coordinator`] reads the
//! partition into it when it takes over, checks requests against it and
//! applies the records once they are committed.

use std::collections::BTreeMap;
use tokio::time::Instant;

use ferrolog_proto::TopicId;

use super::membership::{Membership, Phase};
use super::records::{Committed, Entry, GroupMeta};
use crate::error::ApiError;

/// One group: its membership record, its live membership and its
/// committed offsets.
#[derive(Debug, Default)]
pub struct Group {
    /// The last membership record, if any.
    pub meta: Option<GroupMeta>,
    /// The live membership: built from `meta` when the coordinator takes
    /// over ([`Groups::activate`]), or by the first join.
    pub live: Option<Membership>,
    /// Committed offsets by (topic, partition).
    pub offsets: BTreeMap<(String, u32), Committed>,
}

impl Group {
    /// Kafka's state.
    pub fn phase(&self) -> Phase {
        self.live.as_ref().map_or(Phase::Empty, Membership::phase)
    }

    /// How many members it has.
    pub fn members(&self) -> usize {
        self.live.as_ref().map_or(0, Membership::len)
    }

    /// The generation of its last rebalance (0 for a group that never had one).
    pub fn generation(&self) -> i32 {
        match &self.live {
            Some(l) => l.generation(),
            None => self.meta.as_ref().map_or(0, |m| m.generation),
        }
    }

    /// Whether nothing is left of it: no record, members or offsets.
    pub fn is_unused(&self) -> bool {
        self.meta.is_none() && self.offsets.is_empty() && self.live.as_ref().is_none_or(Membership::is_empty)
    }

    /// The live membership, made empty at the stored generation if none yet.
    pub fn live_mut(&mut self, now: Instant) -> &mut Membership {
        let generation = self.meta.as_ref().map_or(0, |m| m.generation);
        self.live.get_or_insert_with(|| Membership::empty(generation, now))
    }

    /// The committed offset of `topic`'s `partition` for the topic's
    /// incarnation `topic_id` (KIP-516): one committed for an earlier
    /// topic of the same name is none.
    pub fn committed(&self, topic: &str, partition: u32, topic_id: TopicId) -> Option<&Committed> {
        self.offsets.get(&(topic.to_owned(), partition)).filter(|c| c.topic_id == Some(topic_id))
    }
}

/// The groups of one coordinator partition.
#[derive(Debug, Default)]
pub struct Groups {
    groups: BTreeMap<String, Group>,
}

impl Groups {
    /// Applies one stored record, in log order.
    pub fn apply(&mut self, entry: Entry) {
        match entry {
            Entry::Offset { group, topic, partition, value: Some(c) } => {
                self.groups.entry(group).or_default().offsets.insert((topic, partition), c);
            }
            Entry::Offset { group, topic, partition, value: None } => {
                if let Some(g) = self.groups.get_mut(&group) {
                    g.offsets.remove(&(topic, partition));
                    self.forget_if_empty(&group);
                }
            }
            Entry::Group { group, value: Some(m) } => self.groups.entry(group).or_default().meta = Some(m),
            Entry::Group { group, value: None } => {
                if let Some(g) = self.groups.get_mut(&group) {
                    g.meta = None;
                    self.forget_if_empty(&group);
                }
            }
            Entry::Unknown => {}
        }
    }

    /// Forgets group `id` if nothing is left of it (no record, members or
    /// offsets), e.g. after a first join that was refused.
    pub fn forget_if_unused(&mut self, id: &str) {
        self.forget_if_empty(id);
    }

    fn forget_if_empty(&mut self, group: &str) {
        if self.groups.get(group).is_some_and(Group::is_unused) {
            self.groups.remove(group);
        }
    }

    /// Builds every group's live membership from its stored record, as a
    /// coordinator taking over at `now` (see [`Membership::from_meta`]).
    pub fn activate(&mut self, now: Instant) {
        for g in self.groups.values_mut() {
            g.live = g.meta.as_ref().map(|m| Membership::from_meta(m, now));
        }
    }

    /// The group `id`, if it has a membership record, members or an offset.
    pub fn get(&self, id: &str) -> Option<&Group> {
        self.groups.get(id)
    }

    /// The group `id`, made if it does not exist.
    pub fn entry(&mut self, id: &str) -> &mut Group {
        self.groups.entry(id.to_owned()).or_default()
    }

    /// The group `id`, if it exists.
    pub fn get_mut(&mut self, id: &str) -> Option<&mut Group> {
        self.groups.get_mut(id)
    }

    /// The ids of groups with members or a rebalance under way.
    pub fn active(&self) -> Vec<String> {
        self.groups
            .iter()
            .filter(|(_, g)| g.live.as_ref().is_some_and(|l| !l.is_empty() || l.phase() != Phase::Empty))
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Every group, by id.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Group)> {
        self.groups.iter()
    }

    /// What offset expiry removes at `now_ms` (ms since the Unix epoch),
    /// as (group, `None` for its membership record or `Some((topic,
    /// partition))` for an offset): Kafka's rules (KIP-211) with
    /// `retention_ms` (`offsets.retention.minutes`):
    /// - offsets of a topic deleted or re-created since (`current_id` has
    ///   no topic of that name with the offset's id) go at once, as Kafka
    ///   removes the offsets of deleted partitions;
    /// - a group without members that has a membership record loses all
    ///   its offsets, and the record, `retention_ms` after it became empty
    ///   (its record's state time) and after its last commit;
    /// - a group that never had members (commits from outside, e.g. offset
    ///   resets) loses each offset `retention_ms` after its commit.
    ///
    /// Groups with members keep everything else.
    pub fn expired(
        &self,
        now_ms: i64,
        retention_ms: i64,
        current_id: impl Fn(&str) -> Option<TopicId>,
    ) -> Vec<(String, Option<(String, u32)>)> {
        let old = |t: i64| t.saturating_add(retention_ms) <= now_ms;
        let mut out = Vec::new();
        for (id, g) in &self.groups {
            let mut gone: Vec<(String, u32)> = g
                .offsets
                .iter()
                .filter(|((t, _), c)| c.topic_id.is_none_or(|i| current_id(t) != Some(i)))
                .map(|(k, _)| k.clone())
                .collect();
            // Empty as stored, too: a group whose last member has just left
            // has its old record until its empty generation is stored.
            if g.members() == 0 && g.phase() == Phase::Empty {
                match &g.meta {
                    Some(m) if !m.members.is_empty() => {}
                    Some(m) => {
                        let newest = g.offsets.values().map(|c| c.commit_timestamp_ms).max().unwrap_or(0);
                        if old(m.state_timestamp_ms.max(newest)) {
                            gone = g.offsets.keys().cloned().collect();
                        }
                    }
                    None => gone.extend(
                        g.offsets.iter().filter(|(_, c)| old(c.commit_timestamp_ms)).map(|(k, _)| k.clone()),
                    ),
                }
            }
            gone.sort();
            gone.dedup();
            let all_offsets = gone.len() == g.offsets.len();
            out.extend(gone.into_iter().map(|k| (id.clone(), Some(k))));
            let stored_empty =
                g.meta.as_ref().is_some_and(|m| m.members.is_empty() && old(m.state_timestamp_ms));
            if g.members() == 0 && g.phase() == Phase::Empty && all_offsets && stored_empty {
                out.push((id.clone(), None));
            }
        }
        out
    }

    /// Checks that a commit from `member` of `generation` may be made for
    /// group `id` at `now` ([`Membership::check_commit`]: Kafka's rules).
    ///
    /// # Errors
    /// [`ApiError::UnknownMemberId`], [`ApiError::IllegalGeneration`],
    /// [`ApiError::FencedInstanceId`], [`ApiError::RebalanceInProgress`].
    pub fn check_member(
        &mut self,
        id: &str,
        generation: i32,
        member: &str,
        instance: Option<&str>,
        now: Instant,
    ) -> Result<(), ApiError> {
        match self.groups.get_mut(id) {
            Some(g) => g.live_mut(now).check_commit(generation, member, instance, now),
            // Kafka: a member commit to a group that does not exist is of
            // a generation that is not (any more).
            None if generation >= 0 || !member.is_empty() => Err(ApiError::IllegalGeneration(format!(
                "group {id:?} has no generation {generation} (it has no members)"
            ))),
            None => Ok(()),
        }
    }

    /// Checks one partition's commit of `offset` for group `id` against
    /// the offset committed for the same incarnation of the topic
    /// (`topic_id`): it must not go back unless `allow_backwards`.
    ///
    /// # Errors
    /// [`ApiError::OffsetCommitBackwards`], naming both offsets.
    pub fn check_forward(
        &self,
        id: &str,
        topic: &str,
        partition: u32,
        topic_id: TopicId,
        offset: u64,
        allow_backwards: bool,
    ) -> Result<(), ApiError> {
        let committed = self.groups.get(id).and_then(|g| g.committed(topic, partition, topic_id));
        match committed {
            Some(c) if offset < c.offset && !allow_backwards => {
                Err(ApiError::OffsetCommitBackwards(format!(
                    "group {id:?} has committed offset {} for {topic}-{partition}; {offset} is below it (an offset \
                 reset may move it back: `ferrolog group reset-offsets`)",
                    c.offset
                )))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(offset: u64, id: u128) -> Committed {
        Committed { offset, metadata: String::new(), commit_timestamp_ms: 1, topic_id: Some(TopicId(id)) }
    }

    fn offset(group: &str, partition: u32, value: Option<Committed>) -> Entry {
        Entry::Offset { group: group.into(), topic: "t".into(), partition, value }
    }

    #[test]
    fn records_replay_to_the_last_value_per_key_and_tombstones_forget() {
        let mut g = Groups::default();
        g.apply(offset("a", 0, Some(at(5, 1))));
        g.apply(offset("a", 0, Some(at(9, 1))));
        g.apply(offset("a", 1, Some(at(3, 1))));
        g.apply(offset("b", 0, Some(at(1, 1))));
        assert_eq!(g.get("a").unwrap().committed("t", 0, TopicId(1)).unwrap().offset, 9);
        g.apply(offset("b", 0, None));
        assert!(g.get("b").is_none(), "a group with nothing left is gone");
        g.apply(Entry::Group { group: "a".into(), value: Some(GroupMeta::default()) });
        g.apply(offset("a", 0, None));
        g.apply(offset("a", 1, None));
        assert!(g.get("a").is_some(), "its membership record keeps it");
        g.apply(Entry::Group { group: "a".into(), value: None });
        assert!(g.get("a").is_none());
        g.apply(Entry::Unknown);
        assert_eq!(g.iter().count(), 0);
    }

    #[test]
    fn an_offset_of_an_earlier_incarnation_is_none() {
        let mut g = Groups::default();
        g.apply(offset("a", 0, Some(at(5, 1))));
        assert!(g.get("a").unwrap().committed("t", 0, TopicId(2)).is_none());
        // Nor does it hold a commit of the new incarnation back.
        assert!(g.check_forward("a", "t", 0, TopicId(2), 0, false).is_ok());
    }

    #[test]
    fn commits_go_forward_unless_asked() {
        let mut g = Groups::default();
        g.apply(offset("a", 0, Some(at(5, 1))));
        for ok in [5, 6, 1_000] {
            assert!(g.check_forward("a", "t", 0, TopicId(1), ok, false).is_ok(), "{ok}");
        }
        let e = g.check_forward("a", "t", 0, TopicId(1), 4, false).unwrap_err();
        assert!(matches!(e, ApiError::OffsetCommitBackwards(_)), "{e}");
        assert!(g.check_forward("a", "t", 0, TopicId(1), 0, true).is_ok());
        assert!(g.check_forward("other", "t", 0, TopicId(1), 0, false).is_ok());
    }

    #[test]
    fn offsets_expire_by_kafkas_rules() {
        let day = 86_400_000i64;
        let committed = |at: i64| Committed {
            offset: 1,
            metadata: String::new(),
            commit_timestamp_ms: at,
            topic_id: Some(TopicId(1)),
        };
        let current = |t: &str| (t == "t").then_some(TopicId(1));
        let mut g = Groups::default();
        // Simple commits: each offset by its own age.
        g.apply(Entry::Offset {
            group: "simple".into(),
            topic: "t".into(),
            partition: 0,
            value: Some(committed(0)),
        });
        g.apply(Entry::Offset {
            group: "simple".into(),
            topic: "t".into(),
            partition: 1,
            value: Some(committed(6 * day)),
        });
        // An empty group with a record: everything once it was empty long enough.
        let empty_since = |at: i64| GroupMeta { state_timestamp_ms: at, ..GroupMeta::default() };
        g.apply(Entry::Group { group: "quiet".into(), value: Some(empty_since(day)) });
        g.apply(Entry::Offset {
            group: "quiet".into(),
            topic: "t".into(),
            partition: 0,
            value: Some(committed(day)),
        });
        // An offset of a deleted topic, in a group that is recent.
        g.apply(Entry::Offset {
            group: "fresh".into(),
            topic: "gone".into(),
            partition: 0,
            value: Some(committed(7 * day)),
        });
        g.apply(Entry::Offset {
            group: "fresh".into(),
            topic: "t".into(),
            partition: 0,
            value: Some(committed(7 * day)),
        });
        let mut found = g.expired(7 * day, 2 * day, current);
        found.sort();
        let key = |g: &str, t: &str, p: u32| (g.to_owned(), Some((t.to_owned(), p)));
        assert_eq!(
            found,
            [
                key("fresh", "gone", 0),
                ("quiet".to_owned(), None),
                key("quiet", "t", 0),
                key("simple", "t", 0)
            ]
        );
        // Nothing is old enough yet: only the deleted topic's offset goes.
        assert_eq!(g.expired(day, 2 * day, current), [key("fresh", "gone", 0)]);
        // A group with members keeps its offsets (only a deleted topic's go).
        let now = Instant::now();
        let live = g.entry("quiet").live_mut(now);
        let join = super::super::membership::JoinRequest {
            member_id: String::new(),
            instance_id: None,
            client_id: "c".into(),
            session_timeout_ms: 10_000,
            rebalance_timeout_ms: 10_000,
            protocol_type: "consumer".into(),
            protocols: vec![("range".into(), bytes::Bytes::new())],
        };
        let bounds = super::super::membership::Bounds {
            min_session: std::time::Duration::from_millis(1),
            max_session: std::time::Duration::from_secs(60),
            initial_delay: std::time::Duration::ZERO,
        };
        let _waiting = live.join(join, now, &bounds).unwrap();
        assert!(g.expired(7 * day, 2 * day, current).iter().all(|(id, _)| id != "quiet"));
    }

    #[test]
    fn a_group_whose_record_still_lists_members_does_not_expire() {
        let day = 86_400_000i64;
        let mut g = Groups::default();
        // Its last member left; the empty generation is not stored yet.
        let stable = GroupMeta {
            state_timestamp_ms: 0,
            members: vec![super::super::records::MemberMeta::default()],
            ..GroupMeta::default()
        };
        g.apply(Entry::Group { group: "left".into(), value: Some(stable) });
        let old = Committed {
            offset: 1,
            metadata: String::new(),
            commit_timestamp_ms: 0,
            topic_id: Some(TopicId(1)),
        };
        g.apply(Entry::Offset { group: "left".into(), topic: "t".into(), partition: 0, value: Some(old) });
        assert!(g.expired(30 * day, day, |_| Some(TopicId(1))).is_empty());
    }

    #[test]
    fn only_commits_from_outside_are_taken_while_a_group_has_no_members() {
        let mut g = Groups::default();
        let now = Instant::now();
        assert!(g.check_member("a", -1, "", None, now).is_ok());
        assert!(matches!(g.check_member("a", 1, "m-1", None, now), Err(ApiError::IllegalGeneration(_))));
        assert!(matches!(g.check_member("a", -1, "m-1", None, now), Err(ApiError::IllegalGeneration(_))));
        g.apply(Entry::Group { group: "a".into(), value: Some(GroupMeta::default()) });
        assert!(matches!(g.check_member("a", 1, "m-1", None, now), Err(ApiError::UnknownMemberId(_))));
    }
}

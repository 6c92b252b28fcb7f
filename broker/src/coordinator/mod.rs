//! Consumer group coordination (issue 13): committed offsets kept in the
//! cluster, in the internal topic [`OFFSETS_TOPIC`], as Kafka keeps them.
//!
//! ```text
//!  client ──FindCoordinator──> any broker: partition = hash(group id) mod N, its leader
//!  client ──OffsetCommit──> coordinator (leader of that partition) ──Session──> checks
//!         (member, generation, topic, metadata size, no going back) ──Partition::produce_in_term──>
//!         the partition's Raft log: committed by a majority like any record ──> applied to memory
//!  a new leader ──Session──> reads the partition from its log start to the high watermark
//!         (records::decode ──> state::Groups::apply) before it answers a group call
//! ```
//!
//! - [`records`]: the stored keys and values (`proto/ferrolog/groups/v1`).
//! - [`state`]: one partition's groups in memory and the rules of a commit.
//!
//! A group's coordinator is the leader of partition
//! [`partition_for`]`(group id)` of [`OFFSETS_TOPIC`]; the topic is created
//! on the first group call (Kafka's auto-creation, with Kafka's
//! `offsets.topic.num.partitions` and `offsets.topic.replication.factor`,
//! `[groups]` in the broker config) and is key-compacted. Its state in
//! memory is that of one Raft term: a leader reads the partition once per
//! term (after it applied an entry of its own term, so everything committed
//! before is in its log, Raft thesis §6.4), and from then on it is the only
//! writer, so its memory stays exact while the term lasts. Its writes are
//! proposed in that term only: a leadership lost and won again in between
//! fails the write rather than appending from a stale view. One group call
//! at a time per coordinator partition (a commit holds it until a majority
//! stored it): the order of commits is the log's.
//!
//! Membership (join, sync, heartbeat, generations, assignors) is the next
//! part of issue 13: until then every group is `Empty`, and only commits
//! from outside a membership (generation -1) are taken.

pub mod records;
pub mod state;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ferrolog_proto::TopicId;
use ferrolog_proto::client::Record;
use ferrolog_raft_store::NO_PRODUCER_ID;
use tokio::sync::{Mutex, OwnedMutexGuard};

use self::records::{Committed, Entry};
use self::state::Groups;
use crate::config::{BrokerId, GroupsConfig, Limits};
use crate::control::liveness::Liveness;
use crate::error::ApiError;
use crate::groups::GroupRegistry;
use crate::metadata::command::{ControllerRequest, PartitionAssignment};
use crate::metadata::controller::{Controller, now_ms};
use crate::metadata::image::{MetadataImage, TopicEntry};
use crate::partition::Partition;
use crate::partition::records::{self as batch, BatchError, ProducerFields};

/// The internal topic of committed offsets and group records (Kafka's name).
pub const OFFSETS_TOPIC: &str = "__consumer_offsets";

/// Longest group id, bytes (Kafka has no limit; the key must stay small).
pub const GROUP_ID_MAX_BYTES: usize = 255;

/// Bytes read per step when a coordinator reads its partition.
const LOAD_READ_BYTES: usize = 1 << 20;

/// The partition of [`OFFSETS_TOPIC`] (of `partitions`) that holds `group`:
/// Kafka's rule, `Utils.abs(groupId.hashCode()) % partitions`, with Java's
/// `String.hashCode` over UTF-16 code units, so a Kafka client's group
/// lands on the same partition number.
pub fn partition_for(group: &str, partitions: u32) -> u32 {
    let hash = group.encode_utf16().fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)));
    // Kafka's Utils.abs: the sign bit cleared (i32::MIN becomes 0).
    (hash & 0x7FFF_FFFF) as u32 % partitions.max(1)
}

/// Checks a group id.
///
/// # Errors
/// [`ApiError::InvalidGroupId`] for an empty id or one over
/// [`GROUP_ID_MAX_BYTES`].
pub fn validate_group_id(group: &str) -> Result<(), ApiError> {
    if group.is_empty() || group.len() > GROUP_ID_MAX_BYTES {
        return Err(ApiError::InvalidGroupId(format!(
            "a group id must be 1 to {GROUP_ID_MAX_BYTES} bytes, got {}",
            group.len()
        )));
    }
    Ok(())
}

/// One partition's commit in an OffsetCommit request.
#[derive(Clone, Debug)]
pub struct CommitRequest {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// The next offset the group will read.
    pub offset: u64,
    /// Free text stored with it.
    pub metadata: String,
}

/// A committed offset as answered: `None` when the group has none for
/// that partition (of the topic's current incarnation).
#[derive(Clone, Debug)]
pub struct CommittedOffset {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// The offset and what was stored with it.
    pub committed: Option<Committed>,
}

/// A group as listed or described.
#[derive(Clone, Debug)]
pub struct GroupDescription {
    /// Group id.
    pub group: String,
    /// Kafka's state name.
    pub state: &'static str,
    /// The generation of its last rebalance.
    pub generation: i32,
    /// The assignor in use.
    pub protocol: String,
    /// Member count.
    pub members: usize,
    /// Its committed offsets (current topic incarnations only).
    pub offsets: Vec<CommittedOffset>,
}

/// The state loaded for one coordinator partition, for one term.
#[derive(Debug)]
struct Loaded {
    term: u64,
    groups: Groups,
}

type Cell = Arc<Mutex<Option<Loaded>>>;

/// The group coordinator of one broker: serves the groups of the
/// [`OFFSETS_TOPIC`] partitions it leads. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Coordinator {
    me: BrokerId,
    groups: GroupRegistry,
    liveness: Liveness,
    controller: Controller,
    config: GroupsConfig,
    limits: Limits,
    /// Loaded state by the partition's Raft group id (a new incarnation of
    /// the topic has new group ids).
    loaded: Arc<std::sync::Mutex<HashMap<u64, Cell>>>,
}

/// A coordinator partition held for one group call: its state loaded for
/// the current term, and no other call on it until dropped.
struct Session {
    state: OwnedMutexGuard<Option<Loaded>>,
    partition: Arc<Partition>,
    term: u64,
    image: Arc<MetadataImage>,
}

impl Session {
    fn groups(&self) -> &Groups {
        // A session is only made with its state loaded (Coordinator::session).
        &self.state.as_ref().expect("a session holds loaded state").groups
    }

    /// Appends `rows` in this session's term and applies them once a
    /// majority stored them. On failure the state is dropped (read again
    /// on the next call): the write may still commit.
    async fn append(&mut self, rows: Vec<Record>, limits: &Limits) -> Result<(), ApiError> {
        let producer = ProducerFields { producer_id: NO_PRODUCER_ID, producer_epoch: 0, base_sequence: 0 };
        let built = batch::build_batch(
            rows.clone(),
            producer,
            now_ms(),
            limits.max_record_bytes,
            limits.max_batch_bytes,
        )
        .map_err(|e| match e {
            BatchError::TooLarge(m) => ApiError::RecordTooLarge(m),
            BatchError::Invalid(m) => ApiError::Invalid(m),
        })?;
        match self.partition.produce_in_term(built, self.term).await {
            Ok(_) => {
                let loaded = self.state.as_mut().expect("a session holds loaded state");
                for r in &rows {
                    // Encoded just now by records::*_record: they decode.
                    if let Ok(e) = records::decode(r) {
                        loaded.groups.apply(e);
                    }
                }
                Ok(())
            }
            Err(e) => {
                *self.state = None;
                Err(coordinator_error(e))
            }
        }
    }
}

/// A partition's error as a group call's: not the leader is not the
/// coordinator.
fn coordinator_error(e: ApiError) -> ApiError {
    match e {
        ApiError::NotLeader { leader } => ApiError::NotCoordinator { coordinator: leader },
        other => other,
    }
}

impl Coordinator {
    /// The coordinator of broker `me`.
    pub fn new(
        me: BrokerId,
        groups: GroupRegistry,
        liveness: Liveness,
        controller: Controller,
        config: GroupsConfig,
        limits: Limits,
    ) -> Self {
        Self { me, groups, liveness, controller, config, limits, loaded: Arc::default() }
    }

    /// The [`OFFSETS_TOPIC`] entry of a confirmed-current image; when it
    /// does not exist, asks the controller to create it.
    ///
    /// # Errors
    /// [`ApiError::CoordinatorNotAvailable`] while it is created or the
    /// controller cannot be reached.
    async fn offsets_topic(&self) -> Result<(TopicEntry, Arc<MetadataImage>), ApiError> {
        let image = self.controller.image();
        if let Some(t) = image.topics.get(OFFSETS_TOPIC) {
            return Ok((t.clone(), image));
        }
        let confirmed = self
            .controller
            .current_image()
            .await
            .map_err(|e| ApiError::CoordinatorNotAvailable(format!("the metadata may be behind: {e}")))?;
        if let Some(t) = confirmed.image.topics.get(OFFSETS_TOPIC) {
            return Ok((t.clone(), confirmed.image.clone()));
        }
        let brokers = confirmed.image.brokers.values().filter(|b| !b.decommissioned).count();
        let rf = self
            .config
            .offsets_topic_replication_factor
            .min(u32::try_from(brokers).unwrap_or(u32::MAX))
            .max(1);
        if rf < self.config.offsets_topic_replication_factor {
            tracing::warn!(
                "creating {OFFSETS_TOPIC} with replication factor {rf}: the cluster has {brokers} brokers, \
                 fewer than groups.offsets_topic_replication_factor ({})",
                self.config.offsets_topic_replication_factor
            );
        }
        let req = ControllerRequest::CreateTopic {
            name: OFFSETS_TOPIC.into(),
            partitions: self.config.offsets_topic_num_partitions,
            replication_factor: rf,
            config: BTreeMap::from([("cleanup.policy".into(), "compact".into())]),
        };
        match self.controller.handle(req).await {
            Ok(_) | Err(ApiError::TopicExists(_)) => {
                tracing::info!("created {OFFSETS_TOPIC} (or found it created)");
                Err(ApiError::CoordinatorNotAvailable(format!("{OFFSETS_TOPIC} is being created")))
            }
            Err(e) => Err(ApiError::CoordinatorNotAvailable(format!("cannot create {OFFSETS_TOPIC}: {e}"))),
        }
    }

    /// The [`OFFSETS_TOPIC`] partition of `group` and its leader's broker,
    /// if one is known (Kafka's FindCoordinator).
    ///
    /// # Errors
    /// [`ApiError::InvalidGroupId`]; [`ApiError::CoordinatorNotAvailable`]
    /// while the topic is created or the partition has no known leader.
    pub async fn find(&self, group: &str) -> Result<(u32, BrokerId), ApiError> {
        validate_group_id(group)?;
        let (topic, _) = self.offsets_topic().await?;
        let index = partition_for(group, topic.partitions.len() as u32);
        let a = &topic.partitions[index as usize];
        match self.groups.leader_of(&self.liveness, self.me, a) {
            0 => Err(ApiError::CoordinatorNotAvailable(format!("{OFFSETS_TOPIC}-{index} has no leader yet"))),
            b => Ok((index, b)),
        }
    }

    fn cell(&self, raft_group: u64) -> Cell {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        // Forget partitions no longer hosted here (deleted, moved away).
        if loaded.len() > 64 || !loaded.contains_key(&raft_group) {
            loaded.retain(|g, _| self.groups.contains(*g));
        }
        loaded.entry(raft_group).or_default().clone()
    }

    /// Holds `group`'s coordinator partition, its state loaded for the
    /// current term.
    async fn session(&self, group: &str) -> Result<Session, ApiError> {
        validate_group_id(group)?;
        let (topic, image) = self.offsets_topic().await?;
        let index = partition_for(group, topic.partitions.len() as u32);
        let a: &PartitionAssignment = &topic.partitions[index as usize];
        let not_here = || ApiError::NotCoordinator {
            coordinator: Some(self.groups.leader_of(&self.liveness, self.me, a))
                .filter(|b| *b != 0 && *b != self.me),
        };
        let partition = self.groups.partition_of(a.group).ok_or_else(not_here)?;
        let term = partition.ready_leader().await.map_err(coordinator_error)?;
        let mut state = self.cell(a.group).lock_owned().await;
        if state.as_ref().is_none_or(|l| l.term != term) {
            *state = None;
            let groups = load(&partition, index).await?;
            tracing::info!(
                partition = index,
                term,
                groups = groups.iter().count(),
                "{OFFSETS_TOPIC}-{index}: read the groups of this term"
            );
            *state = Some(Loaded { term, groups });
        }
        Ok(Session { state, partition, term, image })
    }

    /// Commits `offsets` for `group` (Kafka's OffsetCommit): checks the
    /// member and generation ([`Groups::check_member`]) for the whole
    /// request, then each partition (topic exists, metadata size, not
    /// backwards unless `allow_backwards`); the partitions that pass are
    /// written in one batch, acknowledged once a majority stored it.
    /// Returns each partition's outcome, `None` when committed.
    ///
    /// # Errors
    /// Group-level: see [`ApiError::NotCoordinator`],
    /// [`ApiError::UnknownMemberId`], [`ApiError::IllegalGeneration`],
    /// storage and availability errors (the commit may still have been
    /// stored: commit again).
    pub async fn commit(
        &self,
        group: &str,
        generation: i32,
        member: &str,
        offsets: Vec<CommitRequest>,
        allow_backwards: bool,
    ) -> Result<Vec<(CommitRequest, Option<ApiError>)>, ApiError> {
        let mut s = self.session(group).await?;
        s.groups().check_member(group, generation, member)?;
        let now = now_ms();
        let mut rows = Vec::new();
        let mut results = Vec::with_capacity(offsets.len());
        for c in offsets {
            let verdict = self.check_commit(&s, group, &c, allow_backwards);
            match verdict {
                Ok(topic_id) => {
                    let value = Committed {
                        offset: c.offset,
                        metadata: c.metadata.clone(),
                        commit_timestamp_ms: now,
                        topic_id: Some(topic_id),
                    };
                    rows.push(records::offset_record(group, &c.topic, c.partition, Some(&value), now));
                    results.push((c, None));
                }
                Err(e) => results.push((c, Some(e))),
            }
        }
        if !rows.is_empty() {
            s.append(rows, &self.limits).await?;
        }
        Ok(results)
    }

    /// One partition's commit checks; the topic's current id.
    fn check_commit(
        &self,
        s: &Session,
        group: &str,
        c: &CommitRequest,
        allow_backwards: bool,
    ) -> Result<TopicId, ApiError> {
        let t = s.image.topics.get(&c.topic).ok_or_else(|| ApiError::UnknownTopic(c.topic.clone()))?;
        if c.partition as usize >= t.partitions.len() {
            return Err(ApiError::UnknownTopic(format!("{} has no partition {}", c.topic, c.partition)));
        }
        if c.metadata.len() > self.config.offset_metadata_max_bytes {
            return Err(ApiError::OffsetMetadataTooLarge(format!(
                "{} bytes; the limit, groups.offset_metadata_max_bytes, is {}",
                c.metadata.len(),
                self.config.offset_metadata_max_bytes
            )));
        }
        s.groups().check_forward(group, &c.topic, c.partition, t.topic_id, c.offset, allow_backwards)?;
        Ok(t.topic_id)
    }

    /// `group`'s committed offsets (Kafka's OffsetFetch): for `partitions`,
    /// or every partition it has one for when empty. Offsets of a topic
    /// deleted or re-created since are not answered (KIP-516).
    ///
    /// # Errors
    /// As [`Coordinator::commit`]'s group-level errors.
    pub async fn fetch(
        &self,
        group: &str,
        partitions: Vec<(String, u32)>,
    ) -> Result<Vec<CommittedOffset>, ApiError> {
        let s = self.session(group).await?;
        let g = s.groups().get(group);
        if partitions.is_empty() {
            return Ok(g.map(|g| current_offsets(g, &s.image)).unwrap_or_default());
        }
        Ok(partitions
            .into_iter()
            .map(|(topic, partition)| {
                let committed = s
                    .image
                    .topics
                    .get(&topic)
                    .and_then(|t| g.and_then(|g| g.committed(&topic, partition, t.topic_id)).cloned());
                CommittedOffset { topic, partition, committed }
            })
            .collect())
    }

    /// `group`'s state, members and offsets (Kafka's DescribeGroups).
    ///
    /// # Errors
    /// [`ApiError::GroupIdNotFound`] for a group with neither members nor
    /// offsets; as [`Coordinator::commit`]'s group-level errors.
    pub async fn describe(&self, group: &str) -> Result<GroupDescription, ApiError> {
        let s = self.session(group).await?;
        let g = s.groups().get(group).ok_or_else(|| ApiError::GroupIdNotFound(group.to_owned()))?;
        Ok(describe(group, g, &s.image))
    }

    /// Deletes `group`: tombstones for its offsets and its membership
    /// record (Kafka's DeleteGroups).
    ///
    /// # Errors
    /// [`ApiError::NonEmptyGroup`] while it has members;
    /// [`ApiError::GroupIdNotFound`]; as [`Coordinator::commit`]'s
    /// group-level errors.
    pub async fn delete(&self, group: &str) -> Result<(), ApiError> {
        let mut s = self.session(group).await?;
        let g = s.groups().get(group).ok_or_else(|| ApiError::GroupIdNotFound(group.to_owned()))?;
        if g.members() > 0 {
            return Err(ApiError::NonEmptyGroup(group.to_owned()));
        }
        let now = now_ms();
        let mut rows: Vec<Record> =
            g.offsets.keys().map(|(t, p)| records::offset_record(group, t, *p, None, now)).collect();
        rows.push(records::group_record(group, None, now));
        // In batches the log takes: a group may have offsets for thousands
        // of partitions.
        let per_batch = 1_000;
        while !rows.is_empty() {
            let rest = rows.split_off(rows.len().min(per_batch));
            s.append(std::mem::replace(&mut rows, rest), &self.limits).await?;
        }
        Ok(())
    }

    /// The groups of every [`OFFSETS_TOPIC`] partition this broker leads
    /// (Kafka's ListGroups: a client asks every broker). A partition that
    /// cannot be read now is left out.
    pub async fn list(&self) -> Vec<GroupDescription> {
        let image = self.controller.image();
        let Some(topic) = image.topics.get(OFFSETS_TOPIC) else { return Vec::new() };
        let mut out = Vec::new();
        for a in &topic.partitions {
            if !self.groups.is_led(a.group) {
                continue;
            }
            let Some(partition) = self.groups.partition_of(a.group) else { continue };
            // Any group of the partition opens its session: find one by
            // holding the partition directly.
            let Ok(term) = partition.ready_leader().await else { continue };
            let mut state = self.cell(a.group).lock_owned().await;
            if state.as_ref().is_none_or(|l| l.term != term) {
                let index = topic.partitions.iter().position(|x| x.group == a.group).unwrap_or(0) as u32;
                match load(&partition, index).await {
                    Ok(groups) => *state = Some(Loaded { term, groups }),
                    Err(e) => {
                        tracing::warn!("{OFFSETS_TOPIC}: listing groups: {e}");
                        continue;
                    }
                }
            }
            if let Some(l) = state.as_ref() {
                out.extend(l.groups.iter().map(|(id, g)| describe(id, g, &image)));
            }
        }
        out
    }
}

/// `g`'s committed offsets of current topic incarnations.
fn current_offsets(g: &state::Group, image: &MetadataImage) -> Vec<CommittedOffset> {
    g.offsets
        .iter()
        .filter(|((t, _), c)| image.topics.get(t).is_some_and(|e| Some(e.topic_id) == c.topic_id))
        .map(|((t, p), c)| CommittedOffset { topic: t.clone(), partition: *p, committed: Some(c.clone()) })
        .collect()
}

fn describe(id: &str, g: &state::Group, image: &MetadataImage) -> GroupDescription {
    GroupDescription {
        group: id.to_owned(),
        state: g.state(),
        generation: g.generation(),
        protocol: g.meta.as_ref().map(|m| m.protocol.clone()).unwrap_or_default(),
        members: g.members(),
        offsets: current_offsets(g, image),
    }
}

/// Reads coordinator partition `index` from its log start to its high
/// watermark into [`Groups`].
///
/// # Errors
/// [`ApiError::CoordinatorLoadInProgress`] when the log moved under the
/// read; [`ApiError::Storage`] for a record that does not decode (named by
/// offset: the partition is written only by coordinators).
async fn load(partition: &Partition, index: u32) -> Result<Groups, ApiError> {
    let (mut pos, high_watermark) = partition.offsets().await.map_err(coordinator_error)?;
    let mut groups = Groups::default();
    let mut read = 0u64;
    while pos < high_watermark {
        let out = partition.read_committed(pos, LOAD_READ_BYTES).await.map_err(|e| match e {
            ApiError::OffsetOutOfRange { .. } => ApiError::CoordinatorLoadInProgress(format!(
                "{OFFSETS_TOPIC}-{index} changed while read: {e}"
            )),
            other => other,
        })?;
        if out.batches.is_empty() {
            return Err(ApiError::CoordinatorLoadInProgress(format!(
                "{OFFSETS_TOPIC}-{index}: nothing read at offset {pos} below the high watermark {high_watermark}"
            )));
        }
        for b in &out.batches {
            let rows = batch::decode(&b.records()).map_err(|e| {
                storage_error_at(index, b.header.base_offset, &format!("a batch that does not decode: {e}"))
            })?;
            let deltas = batch::offset_deltas(&rows);
            for (r, d) in rows.iter().zip(deltas) {
                let offset = b.header.base_offset + u64::from(d);
                if offset < pos {
                    continue;
                }
                let entry = records::decode(r).map_err(|e| storage_error_at(index, offset, &e))?;
                if entry == Entry::Unknown {
                    tracing::debug!(
                        "{OFFSETS_TOPIC}-{index} offset {offset}: a record kind this version does not know"
                    );
                }
                groups.apply(entry);
                read += 1;
            }
            pos = pos.max(b.header.next_offset());
        }
    }
    tracing::debug!("{OFFSETS_TOPIC}-{index}: {read} records read up to offset {high_watermark}");
    Ok(groups)
}

fn storage_error_at(index: u32, offset: u64, what: &str) -> ApiError {
    ApiError::Storage(format!("{OFFSETS_TOPIC}-{index} offset {offset}: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Java's `"...".hashCode()` values, and Kafka's partition for them
    /// with 50 partitions (`Utils.abs(hash) % 50`).
    #[test]
    fn partition_is_kafkas() {
        // Java: "a".hashCode() == 97, "group".hashCode() == 98629247,
        // "my-consumer-group".hashCode() == 1513705513.
        assert_eq!(partition_for("a", 50), 47);
        assert_eq!(partition_for("group", 50), 47);
        assert_eq!(partition_for("my-consumer-group", 50), 13);
        // "polygenelubricants".hashCode() is Integer.MIN_VALUE: Utils.abs gives 0.
        assert_eq!(partition_for("polygenelubricants", 50), 0);
        // A character outside the BMP counts as two UTF-16 units (1772899).
        assert_eq!(partition_for("😀", 50), 49);
        assert_eq!(partition_for("anything", 1), 0);
    }

    #[test]
    fn group_ids_are_checked() {
        assert!(validate_group_id("g").is_ok());
        assert!(matches!(validate_group_id(""), Err(ApiError::InvalidGroupId(_))));
        assert!(validate_group_id(&"x".repeat(GROUP_ID_MAX_BYTES)).is_ok());
        assert!(validate_group_id(&"x".repeat(GROUP_ID_MAX_BYTES + 1)).is_err());
    }
}

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
//! - [`membership`]: one group's members, generations and rebalances
//!   (Kafka's classic protocol), a state machine over explicit time.
//!
//! A group's coordinator is the leader of partition
//! [`partition_for`]`(group id)` of [`OFFSETS_TOPIC`]; the topic is created
//! on the first group call (Kafka's auto-creation, with Kafka's
//! `offsets.topic.num.partitions` and `offsets.topic.replication.factor`,
//! `[groups]` in the broker config) and is key-compacted. Its state in
//! memory is that of one Raft term: a leader reads the partition once per
//! term, after every entry of its log is applied (an entry of its own term
//! among them, so everything committed before is there, Raft thesis §6.4),
//! in a task of its own (`Coordinator::open`); from then on it is the
//! only writer, so its memory stays exact while the term lasts. Its writes
//! are proposed in that term only (a leadership lost and won again in
//! between fails the write rather than appending from a stale view), run in
//! a task that holds the partition until settled, and memory is put back
//! only after they commit (`Session::append`). One group call at a time
//! per coordinator partition (a commit holds it until a majority stored
//! it): the order of commits is the log's. Expired offsets and those of
//! deleted topics are removed with tombstones (`Coordinator::expire_offsets`).
//!
//! Membership calls (JoinGroup, SyncGroup, Heartbeat, LeaveGroup) change
//! the group's [`membership::Membership`] under the partition's lock and
//! never wait there; what must be stored before members learn of it (a new
//! generation, the leader's assignment) is written by [`Coordinator::run`],
//! one background task per broker that also ends sessions and rebalances
//! whose time is up, and then answered. The assignment itself is computed
//! by the leader member (the client library's assignors), as in Kafka.

pub mod membership;
pub mod records;
pub mod state;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrolog_proto::TopicId;
use ferrolog_proto::client::Record;
use ferrolog_raft_store::NO_PRODUCER_ID;
use prost::Message;
use tokio::sync::{Mutex, Notify, OwnedMutexGuard};

use self::membership::{Bounds, JoinRequest, JoinResult, Membership, SyncResult, Waiting};
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

/// How long a group call waits for its partition to be read back before
/// it answers `COORDINATOR_LOAD_IN_PROGRESS` (the read goes on).
const LOAD_WAIT: Duration = Duration::from_secs(5);

/// The partition of [`OFFSETS_TOPIC`] (of `partitions`) that holds `group`:
/// Kafka's rule, `Utils.abs(groupId.hashCode()) % partitions` (the
/// absolute value, 0 for `Integer.MIN_VALUE`), with Java's
/// `String.hashCode` over UTF-16 code units, so a Kafka client's group
/// lands on the same partition number.
pub fn partition_for(group: &str, partitions: u32) -> u32 {
    let hash = group.encode_utf16().fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)));
    // Kafka's Utils.abs: the absolute value, and 0 for i32::MIN.
    hash.checked_abs().map_or(0, i32::unsigned_abs) % partitions.max(1)
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
    /// The topic's id (KIP-516) the offset belongs to, if the caller said.
    pub topic_id: Option<TopicId>,
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
    /// Its members: (member id, client id, instance id, assigned
    /// partitions as far as the assignment decodes as a consumer's).
    pub members: Vec<MemberDescription>,
    /// Its committed offsets (current topic incarnations only).
    pub offsets: Vec<CommittedOffset>,
}

/// A member as described.
#[derive(Clone, Debug)]
pub struct MemberDescription {
    /// Member id.
    pub id: String,
    /// The client's self-given name.
    pub client_id: String,
    /// Static membership's instance id.
    pub instance_id: Option<String>,
    /// Its partitions, when the group's protocol type is "consumer".
    pub assignment: Vec<(String, u32)>,
}

/// A first join's member, removed from the group (LeaveGroup, in a task of
/// its own) when dropped still armed: its call ended without an answer, so
/// no client knows the member id, and it would otherwise hold partitions
/// nobody reads until its session ends (Kafka avoids this with KIP-394's
/// MEMBER_ID_REQUIRED, not built here).
struct UnansweredJoin {
    coordinator: Coordinator,
    group: String,
    /// The member to remove; `None` once answered.
    member: Option<String>,
}

impl Drop for UnansweredJoin {
    fn drop(&mut self) {
        if let Some(member) = self.member.take() {
            let (c, group) = (self.coordinator.clone(), std::mem::take(&mut self.group));
            tokio::spawn(async move {
                let _ = c.leave(&group, &member, None).await;
            });
        }
    }
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
    /// Wakes [`Coordinator::run`] when a membership call may let a group
    /// move on.
    kick: Arc<Notify>,
}

/// A coordinator partition held for one group call: its state loaded for
/// the current term, and no other call on it until dropped.
struct Session {
    /// Taken while a write is under way ([`Session::append`]).
    guard: Option<OwnedMutexGuard<Option<Loaded>>>,
    partition: Arc<Partition>,
    term: u64,
    image: Arc<MetadataImage>,
}

impl Session {
    fn groups(&self) -> &Groups {
        // A session is only made with its state loaded (Coordinator::open),
        // and not used after a failed write.
        &self.guard.as_ref().and_then(|g| g.as_ref()).expect("a session holds loaded state").groups
    }

    fn groups_mut(&mut self) -> &mut Groups {
        &mut self.guard.as_mut().and_then(|g| g.as_mut()).expect("a session holds loaded state").groups
    }

    /// Drops the partition's state (read back by the next call): memory
    /// holds what could not be stored (a new generation).
    fn forget(&mut self) {
        if let Some(g) = self.guard.as_mut() {
            **g = None;
        }
    }

    /// Appends `rows` in this session's term and applies them once a
    /// majority stored them. The write runs in a task of its own that holds
    /// the partition until it is settled, so a call dropped while it waits
    /// (its client went away) loses nothing; memory is put back only after
    /// the write committed. On any failure (the write may still commit) no
    /// state is left, and the next call reads the partition back, after
    /// every entry of this leader is applied.
    async fn append(&mut self, rows: Vec<Record>, limits: &Limits) -> Result<(), ApiError> {
        let producer = ProducerFields { producer_id: NO_PRODUCER_ID, producer_epoch: 0, base_sequence: 0 };
        // Built before the state is touched: a commit too large for one
        // batch is refused and every other group's state stays.
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
        let mut guard = self.guard.take().expect("a session holds loaded state");
        let (partition, term) = (self.partition.clone(), self.term);
        let task = tokio::spawn(async move {
            let loaded = guard.take();
            partition.produce_in_term(built, term).await.map_err(coordinator_error)?;
            let mut loaded =
                loaded.ok_or_else(|| ApiError::Unavailable("no state to apply a write to".into()))?;
            for r in &rows {
                // Encoded just now by records::*_record: they decode.
                if let Ok(e) = records::decode(r) {
                    loaded.groups.apply(e);
                }
            }
            *guard = Some(loaded);
            Ok(guard)
        });
        match task.await {
            Ok(Ok(guard)) => {
                self.guard = Some(guard);
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(e) => Err(ApiError::Unavailable(format!("the write's task failed: {e}"))),
        }
    }
}

/// `__consumer_offsets` without partitions: never made so (the controller
/// refuses a topic without partitions), answered rather than assumed.
fn no_partitions() -> ApiError {
    ApiError::CoordinatorNotAvailable(format!("{OFFSETS_TOPIC} has no partitions"))
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
        Self {
            me,
            groups,
            liveness,
            controller,
            config,
            limits,
            loaded: Arc::default(),
            kick: Arc::default(),
        }
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
        let rf = self.config.offsets_topic_replication_factor;
        if brokers < rf as usize {
            // As Kafka: not created with fewer replicas than configured (a
            // cluster still starting would keep them for good).
            return Err(ApiError::CoordinatorNotAvailable(format!(
                "{OFFSETS_TOPIC} needs groups.offsets_topic_replication_factor = {rf} brokers; {brokers} are registered"
            )));
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
        let a = topic.partitions.get(index as usize).ok_or_else(no_partitions)?;
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
        let a: &PartitionAssignment = topic.partitions.get(index as usize).ok_or_else(no_partitions)?;
        let not_here = || ApiError::NotCoordinator {
            coordinator: Some(self.groups.leader_of(&self.liveness, self.me, a))
                .filter(|b| *b != 0 && *b != self.me),
        };
        let partition = self.groups.partition_of(a.group).ok_or_else(not_here)?;
        self.open(partition, index, a.group, image).await
    }

    /// Holds coordinator partition `index` (Raft group `raft_group`), its
    /// state loaded for the current term. The partition is read back in a
    /// task of its own, so a call that stops waiting ([`LOAD_WAIT`]:
    /// `COORDINATOR_LOAD_IN_PROGRESS`, the client retries) does not stop
    /// the read.
    async fn open(
        &self,
        partition: Arc<Partition>,
        index: u32,
        raft_group: u64,
        image: Arc<MetadataImage>,
    ) -> Result<Session, ApiError> {
        let term = partition.ready_leader().await.map_err(|e| match e {
            ApiError::Unavailable(m) => ApiError::CoordinatorLoadInProgress(m),
            other => coordinator_error(other),
        })?;
        let loading =
            || ApiError::CoordinatorLoadInProgress(format!("{OFFSETS_TOPIC}-{index} is being read back"));
        let state = tokio::time::timeout(LOAD_WAIT, self.cell(raft_group).lock_owned())
            .await
            .map_err(|_| loading())?;
        let state = if state.as_ref().is_some_and(|l| l.term == term) {
            state
        } else {
            let task = tokio::spawn(read_back(state, partition.clone(), index, term));
            match tokio::time::timeout(LOAD_WAIT, task).await {
                Ok(Ok(r)) => r?,
                Ok(Err(e)) => {
                    return Err(ApiError::Unavailable(format!("reading {OFFSETS_TOPIC}-{index} back: {e}")));
                }
                Err(_) => return Err(loading()),
            }
        };
        // The leadership may have moved, or been lost, while this call waited.
        if partition.raft.leader_term() != Some(term)
            || partition.lost_quorum()
            || state.as_ref().map(|l| l.term) != Some(term)
        {
            return Err(ApiError::NotCoordinator { coordinator: None });
        }
        Ok(Session { guard: Some(state), partition, term, image })
    }

    fn bounds(&self) -> Bounds {
        Bounds {
            min_session: Duration::from_millis(self.config.min_session_timeout_ms),
            max_session: Duration::from_millis(self.config.max_session_timeout_ms),
            initial_delay: Duration::from_millis(self.config.initial_rebalance_delay_ms),
        }
    }

    /// Stores what `group`'s membership needs stored, answering its
    /// waiting members after each write ([`Membership::step`]).
    async fn advance(&self, s: &mut Session, group: &str) -> Result<(), ApiError> {
        loop {
            let now = Instant::now();
            let Some(g) = s.groups_mut().get_mut(group) else { return Ok(()) };
            let Some(p) = g.live.as_mut().and_then(|l| l.step(now, now_ms())) else { return Ok(()) };
            let row = records::group_record(group, Some(&p.meta), now_ms());
            if let Err(e) = s.append(vec![row], &self.limits).await {
                // The step changed memory already.
                s.forget();
                return Err(e);
            }
            if let Some(l) = s.groups_mut().get_mut(group).and_then(|g| g.live.as_mut()) {
                l.persisted(p.kind, Instant::now());
            }
            tracing::info!(
                group,
                generation = p.meta.generation,
                members = p.meta.members.len(),
                stored = ?p.kind,
                "group state stored"
            );
        }
    }

    /// Moves every group of the partitions led here on, every 100 ms and
    /// whenever a membership call asks: ends sessions and rebalances whose
    /// time is up, stores new generations and assignments and answers the
    /// members waiting for them; every `offsets_retention_check_interval_ms`
    /// starts [`Coordinator::expire_offsets`]. Runs until the process ends.
    pub async fn run(self) {
        let every = Duration::from_millis(self.config.offsets_retention_check_interval_ms);
        let mut next_expiry = Instant::now() + every;
        let mut expiry: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            let _ = tokio::time::timeout(Duration::from_millis(100), self.kick.notified()).await;
            // In a task of its own, one at a time: it waits for the
            // controller and for partitions, which members must not.
            if Instant::now() >= next_expiry && expiry.as_ref().is_none_or(|t| t.is_finished()) {
                next_expiry = Instant::now() + every;
                expiry = Some(tokio::spawn(self.clone().expire_offsets()));
            }
            let cells: Vec<(u64, Cell)> = {
                let loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
                loaded.iter().map(|(g, c)| (*g, c.clone())).collect()
            };
            let image = self.controller.image();
            let Some(topic) = image.topics.get(OFFSETS_TOPIC) else { continue };
            for (raft_group, cell) in cells {
                if !self.groups.is_led(raft_group) {
                    // Read back again when it leads again; its waiting
                    // members are answered NOT_COORDINATOR now.
                    if let Ok(mut state) = cell.try_lock() {
                        *state = None;
                    }
                    continue;
                }
                let Some(index) = topic.partitions.iter().position(|a| a.group == raft_group) else {
                    continue;
                };
                let Some(partition) = self.groups.partition_of(raft_group) else { continue };
                // Only a partition already read in this term: a group call loads it.
                let active = {
                    let Ok(state) = cell.try_lock() else { continue };
                    match state.as_ref() {
                        Some(l) if partition.raft.leader_term() == Some(l.term) => l.groups.active(),
                        _ => continue,
                    }
                };
                if active.is_empty() {
                    continue;
                }
                let Ok(mut s) = self.open(partition, index as u32, raft_group, image.clone()).await else {
                    continue;
                };
                for group in active {
                    if let Err(e) = self.advance(&mut s, &group).await {
                        tracing::warn!(group, "could not store the group's state: {e}");
                        break;
                    }
                }
            }
        }
    }

    /// Removes expired offsets ([`Groups::expired`]: empty groups past
    /// `offsets_retention_minutes`, offsets of deleted topics) from every
    /// coordinator partition led here, with tombstones. Each partition is
    /// judged on a metadata image confirmed current with the controller
    /// while the partition is held (a topic created since an earlier look
    /// is not taken for deleted); skipped when none can be had.
    async fn expire_offsets(self) {
        let image = self.controller.image();
        let Some(topic) = image.topics.get(OFFSETS_TOPIC) else { return };
        let retention_ms =
            i64::try_from(self.config.offsets_retention_minutes.saturating_mul(60_000)).unwrap_or(i64::MAX);
        for (index, a) in topic.partitions.iter().enumerate() {
            if !self.groups.is_led(a.group) {
                continue;
            }
            let Some(partition) = self.groups.partition_of(a.group) else { continue };
            let Ok(mut s) = self.open(partition, index as u32, a.group, image.clone()).await else {
                continue;
            };
            // Confirmed while the partition is held: every commit made so
            // far was made against metadata no newer than this.
            let Ok(confirmed) = self.controller.current_image().await else { continue };
            let image = confirmed.image;
            let now = now_ms();
            let gone = s.groups().expired(now, retention_ms, |t| image.topics.get(t).map(|e| e.topic_id));
            if gone.is_empty() {
                continue;
            }
            let mut rows: Vec<Record> = gone
                .iter()
                .map(|(g, what)| match what {
                    Some((t, p)) => records::offset_record(g, t, *p, None, now),
                    None => records::group_record(g, None, now),
                })
                .collect();
            let n = rows.len();
            let mut failed = None;
            while !rows.is_empty() && failed.is_none() {
                let rest = rows.split_off(rows.len().min(1_000));
                failed = s.append(std::mem::replace(&mut rows, rest), &self.limits).await.err();
            }
            match failed {
                None => {
                    tracing::info!("{OFFSETS_TOPIC}-{index}: removed {n} expired offsets and group records")
                }
                Some(e) => tracing::warn!("{OFFSETS_TOPIC}-{index}: removing expired offsets: {e}"),
            }
        }
    }

    /// Kafka's JoinGroup: waits until the rebalance it joins (or starts)
    /// has its new generation stored, then answers it. A first join that
    /// ends unanswered (its wait timed out, or its caller went away) is
    /// removed from the group again ([`UnansweredJoin`]).
    ///
    /// # Errors
    /// See [`Membership::join`]; [`ApiError::NotCoordinator`] when the
    /// coordinator's state was dropped meanwhile (leadership lost);
    /// [`ApiError::CoordinatorNotAvailable`] when no answer came by the
    /// group's rebalance deadline (and 5 s).
    pub async fn join(&self, group: &str, req: JoinRequest) -> Result<JoinResult, ApiError> {
        let own = Duration::from_millis(u64::try_from(req.rebalance_timeout_ms).unwrap_or(0));
        let first = req.member_id.is_empty();
        let (member, waiting, deadline) = {
            let mut s = self.session(group).await?;
            let bounds = self.bounds();
            let now = Instant::now();
            let live = s.groups_mut().entry(group).live_mut(now);
            match live.join_with_id(req, now, &bounds) {
                // Answered by the time the group's rebalance ends (or, for
                // a static member's return, once its id is stored).
                Ok((member, w)) => {
                    let deadline = live.join_deadline().unwrap_or(now + own).max(now + own);
                    (member, w, deadline)
                }
                Err(e) => {
                    // A refused first join leaves no group behind.
                    s.groups_mut().forget_if_unused(group);
                    return Err(e);
                }
            }
        };
        self.kick.notify_one();
        let mut unanswered = UnansweredJoin {
            coordinator: self.clone(),
            group: group.to_owned(),
            member: first.then_some(member),
        };
        let at_most = deadline.saturating_duration_since(Instant::now());
        let r = self.wait(waiting, at_most).await;
        if r.is_ok() {
            unanswered.member = None;
        }
        r
    }

    /// Kafka's SyncGroup: the leader's carries the assignment; every
    /// member's waits until it is stored, then gets its own.
    ///
    /// # Errors
    /// See [`Membership::sync`].
    pub async fn sync(
        &self,
        group: &str,
        generation: i32,
        member: &str,
        instance: Option<&str>,
        assignments: Vec<(String, Bytes)>,
    ) -> Result<SyncResult, ApiError> {
        let waiting = {
            let mut s = self.session(group).await?;
            let g = s
                .groups_mut()
                .get_mut(group)
                .ok_or_else(|| ApiError::UnknownMemberId(format!("{group:?} has no members")))?;
            g.live_mut(Instant::now()).sync(generation, member, instance, assignments, Instant::now())?
        };
        self.kick.notify_one();
        self.wait(waiting, Duration::from_millis(self.config.max_session_timeout_ms)).await
    }

    async fn wait<T>(&self, w: Waiting<T>, at_most: Duration) -> Result<T, ApiError> {
        match w {
            Waiting::Now(v) => Ok(v),
            Waiting::Later(rx) => match tokio::time::timeout(at_most + Duration::from_secs(5), rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(ApiError::NotCoordinator { coordinator: None }),
                Err(_) => {
                    Err(ApiError::CoordinatorNotAvailable("the rebalance did not complete in time".into()))
                }
            },
        }
    }

    /// Kafka's Heartbeat.
    ///
    /// # Errors
    /// See [`Membership::heartbeat`].
    pub async fn heartbeat(
        &self,
        group: &str,
        generation: i32,
        member: &str,
        instance: Option<&str>,
    ) -> Result<(), ApiError> {
        let mut s = self.session(group).await?;
        let g = s
            .groups_mut()
            .get_mut(group)
            .ok_or_else(|| ApiError::UnknownMemberId(format!("{group:?} has no members")))?;
        g.live_mut(Instant::now()).heartbeat(generation, member, instance, Instant::now())
    }

    /// Kafka's LeaveGroup: the group rebalances without the member.
    ///
    /// # Errors
    /// See [`Membership::leave`].
    pub async fn leave(&self, group: &str, member: &str, instance: Option<&str>) -> Result<(), ApiError> {
        {
            let mut s = self.session(group).await?;
            let g = s
                .groups_mut()
                .get_mut(group)
                .ok_or_else(|| ApiError::UnknownMemberId(format!("{group:?} has no members")))?;
            g.live_mut(Instant::now()).leave(member, instance, Instant::now())?;
        }
        self.kick.notify_one();
        Ok(())
    }

    /// Commits `offsets` for `group` (Kafka's OffsetCommit): checks the
    /// member (id, instance id) and generation ([`Groups::check_member`]) for the whole
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
        member: (&str, Option<&str>),
        offsets: Vec<CommitRequest>,
        allow_backwards: bool,
    ) -> Result<Vec<(CommitRequest, Option<ApiError>)>, ApiError> {
        let mut s = self.session(group).await?;
        s.groups_mut().check_member(group, generation, member.0, member.1, Instant::now())?;
        // A topic this broker's metadata does not know, or knows under
        // another id than the caller: the controller's current word decides.
        let unsure = offsets.iter().any(|c| match s.image.topics.get(&c.topic) {
            None => true,
            Some(t) => c.topic_id.is_some_and(|id| id != t.topic_id),
        });
        if unsure && let Ok(confirmed) = self.controller.current_image().await {
            s.image = confirmed.image;
        }
        let now = now_ms();
        let mut seen = std::collections::HashSet::new();
        let mut rows = Vec::new();
        let mut results = Vec::with_capacity(offsets.len());
        for c in offsets {
            let verdict = if seen.insert((c.topic.clone(), c.partition)) {
                self.check_commit(&s, group, &c, allow_backwards)
            } else {
                Err(ApiError::Invalid(format!("{}/{} is named twice in one commit", c.topic, c.partition)))
            };
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
        let t = s.image.topics.get(&c.topic);
        if let Some(id) = c.topic_id
            && t.is_none_or(|t| t.topic_id != id)
        {
            return Err(ApiError::UnknownTopicId {
                topic: c.topic.clone(),
                id: id.to_string(),
                current: t.map(|t| t.topic_id.to_string()),
            });
        }
        let t = t.ok_or_else(|| ApiError::UnknownTopic(c.topic.clone()))?;
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

    /// `group`'s committed offsets (Kafka's OffsetFetch): for `partitions`
    /// (topic, partition, the topic id the caller reads if it says), or
    /// every partition it has one for when empty. Offsets of another
    /// incarnation of the topic than the caller's (or, when it does not
    /// say, than the one this broker knows) are not answered (KIP-516).
    ///
    /// # Errors
    /// As [`Coordinator::commit`]'s group-level errors.
    pub async fn fetch(
        &self,
        group: &str,
        partitions: Vec<(String, u32, Option<TopicId>)>,
    ) -> Result<Vec<CommittedOffset>, ApiError> {
        let s = self.session(group).await?;
        let g = s.groups().get(group);
        if partitions.is_empty() {
            return Ok(g.map(|g| current_offsets(g, &s.image)).unwrap_or_default());
        }
        Ok(partitions
            .into_iter()
            .map(|(topic, partition, asked)| {
                // The incarnation the caller reads, else the one known here.
                let id = asked.or_else(|| s.image.topics.get(&topic).map(|t| t.topic_id));
                let committed = id.and_then(|id| g.and_then(|g| g.committed(&topic, partition, id)).cloned());
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
        let g = s
            .groups()
            .get(group)
            .filter(|g| !g.is_unused())
            .ok_or_else(|| ApiError::GroupIdNotFound(group.to_owned()))?;
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
    /// (Kafka's ListGroups: a client asks every broker), and an error
    /// naming the partitions led here that could not be read now (their
    /// groups are missing from the list: Kafka answers
    /// `COORDINATOR_LOAD_IN_PROGRESS` then).
    pub async fn list(&self) -> (Vec<GroupDescription>, Option<ApiError>) {
        let image = self.controller.image();
        let Some(topic) = image.topics.get(OFFSETS_TOPIC) else { return (Vec::new(), None) };
        let mut out = Vec::new();
        let mut unread = Vec::new();
        for (index, a) in topic.partitions.iter().enumerate() {
            if !self.groups.is_led(a.group) {
                continue;
            }
            let Some(partition) = self.groups.partition_of(a.group) else { continue };
            match self.open(partition, index as u32, a.group, image.clone()).await {
                Ok(s) => out.extend(
                    s.groups()
                        .iter()
                        .filter(|(_, g)| !g.is_unused())
                        .map(|(id, g)| describe(id, g, &s.image)),
                ),
                Err(e) => unread.push(format!("{OFFSETS_TOPIC}-{index}: {e}")),
            }
        }
        let error = (!unread.is_empty()).then(|| {
            ApiError::CoordinatorLoadInProgress(format!(
                "groups of these partitions are missing: {}",
                unread.join("; ")
            ))
        });
        (out, error)
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
    let live = g.live.as_ref();
    let consumer = live.is_some_and(|l| l.protocol_type() == "consumer");
    let members = live
        .map(Membership::describe)
        .unwrap_or_default()
        .into_iter()
        .map(|(id, client_id, instance_id, assignment)| MemberDescription {
            id,
            client_id,
            instance_id,
            assignment: if consumer { consumer_partitions(&assignment) } else { Vec::new() },
        })
        .collect();
    GroupDescription {
        group: id.to_owned(),
        state: g.phase().name(),
        generation: g.generation(),
        protocol: live.map(|l| l.protocol().to_owned()).unwrap_or_default(),
        members,
        offsets: current_offsets(g, image),
    }
}

/// The partitions of a "consumer" assignment (`ConsumerAssignment`);
/// none when it does not decode (another client's format).
fn consumer_partitions(assignment: &[u8]) -> Vec<(String, u32)> {
    ferrolog_proto::client::ConsumerAssignment::decode(assignment)
        .map(|a| a.partitions.into_iter().map(|p| (p.topic, p.partition)).collect())
        .unwrap_or_default()
}

/// Reads coordinator partition `index` back into `state` for `term` (see
/// [`Coordinator::open`]): first waits until every entry of the log is
/// applied (a write of this leader whose fate was unknown is then in the
/// high watermark or gone), then reads.
async fn read_back(
    mut state: OwnedMutexGuard<Option<Loaded>>,
    partition: Arc<Partition>,
    index: u32,
    term: u64,
) -> Result<OwnedMutexGuard<Option<Loaded>>, ApiError> {
    *state = None;
    partition.await_applied_all().await.map_err(|e| ApiError::CoordinatorLoadInProgress(e.to_string()))?;
    let mut groups = load(&partition, index).await?;
    groups.activate(Instant::now());
    tracing::info!(
        partition = index,
        term,
        groups = groups.iter().count(),
        "{OFFSETS_TOPIC}-{index}: read the groups of this term"
    );
    *state = Some(Loaded { term, groups });
    Ok(state)
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
        // Negative hashes: Kafka takes the absolute value ("my-group" is
        // -1906497762, "analytics" -1693017210), not the sign bit cleared.
        assert_eq!(partition_for("my-group", 50), 12);
        assert_eq!(partition_for("analytics", 50), 10);
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

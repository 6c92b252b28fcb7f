//! A consumer in a consumer group (Kafka's classic group protocol): the
//! group's members share the partitions of the topics they subscribe to,
//! each partition read by one member at a time; positions are committed to
//! the group's coordinator, so a member that takes a partition over starts
//! where its previous owner stopped.
//!
//! ```text
//!  poll ──> (rebalance needed?) ──> commit what was read ──> revoke ──JoinGroup──> leader:
//!           assignor(subscriptions) ──SyncGroup──> own assignment ──> committed offsets
//!           (or auto.offset.reset) ──> Consumer::seek ──> fetch
//!  heartbeat task, every heartbeat.interval.ms ──Heartbeat──> REBALANCE_IN_PROGRESS: rejoin at the
//!           next poll; UNKNOWN_MEMBER_ID / ILLEGAL_GENERATION / FENCED_INSTANCE_ID: partitions
//!           lost; no poll for max.poll.interval.ms: leave the group
//! ```
//!
//! Delivery is at least once: [`GroupConsumer::commit`] (or auto-commit,
//! at the start of each poll and before partitions are revoked) commits the
//! positions after the records returned so far, which the application has
//! processed by then. A member evicted meanwhile has its commit refused by
//! the coordinator (its generation is over), so it never moves the
//! positions of the partitions' new owners; the records it read past its
//! last accepted commit are read again by them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferrolog_proto::client as pb;
use prost::Message;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::assignor::{self, Assignor, Subscription, TopicPartition};
use crate::consumer::{Consumer, ConsumerConfig, Seek};
use crate::error::{Error, ErrorCode, Result};
use crate::group::{Groups, JoinParams, MemberRef, OffsetToCommit};
use crate::metadata::MetadataCache;
use crate::record::ConsumerRecord;

/// The protocol type of consumer groups.
pub const PROTOCOL_TYPE: &str = "consumer";

/// Where a partition without a committed offset starts (Kafka's
/// `auto.offset.reset`); also applied when the committed offset is no
/// longer in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoOffsetReset {
    /// The log start offset.
    Earliest,
    /// The high watermark: only new records.
    Latest,
    /// Fail the poll with [`Error::OffsetOutOfRange`] or a missing-offset error.
    None,
}

/// Group consumer settings (Kafka's names and defaults).
#[derive(Debug, Clone)]
pub struct GroupConsumerConfig {
    /// The group.
    pub group_id: String,
    /// Static membership (`group.instance.id`, KIP-345): a member that
    /// restarts with the same id within its session timeout gets its
    /// partitions back without a rebalance. Such a member does not leave
    /// the group when closed.
    pub group_instance_id: Option<String>,
    /// Shown by `group describe` (`client.id`).
    pub client_id: String,
    /// `session.timeout.ms` (45,000).
    pub session_timeout_ms: u32,
    /// `heartbeat.interval.ms` (3,000).
    pub heartbeat_interval_ms: u32,
    /// `max.poll.interval.ms` (300,000): a member that does not poll for
    /// this long leaves the group; also its rebalance timeout.
    pub max_poll_interval_ms: u32,
    /// `partition.assignment.strategy`, most preferred first ([range,
    /// cooperative-sticky]). Members rebalance cooperatively only when
    /// every assignor listed is cooperative.
    pub assignors: Vec<Assignor>,
    /// `enable.auto.commit` (true): commit positions at the start of each
    /// poll (at most every `auto_commit_interval_ms`) and before revoking.
    pub enable_auto_commit: bool,
    /// `auto.commit.interval.ms` (5,000).
    pub auto_commit_interval_ms: u64,
    /// `auto.offset.reset` (latest).
    pub auto_offset_reset: AutoOffsetReset,
    /// Fetching.
    pub consumer: ConsumerConfig,
}

impl GroupConsumerConfig {
    /// Kafka's defaults for group `group_id`.
    pub fn new(group_id: impl Into<String>) -> Self {
        GroupConsumerConfig {
            group_id: group_id.into(),
            group_instance_id: None,
            client_id: "ferrolog".into(),
            session_timeout_ms: 45_000,
            heartbeat_interval_ms: 3_000,
            max_poll_interval_ms: 300_000,
            assignors: vec![Assignor::Range, Assignor::CooperativeSticky],
            enable_auto_commit: true,
            auto_commit_interval_ms: 5_000,
            auto_offset_reset: AutoOffsetReset::Latest,
            consumer: ConsumerConfig::default(),
        }
    }
}

/// Most events [`GroupConsumer::take_events`] keeps between two calls
/// when no listener is set; beyond it the oldest are dropped (a warning
/// each time), so a member whose owner never asks does not grow without
/// bound.
pub const EVENTS_KEPT_MAX: usize = 1024;

/// What happened to this member's partitions, in order
/// ([`GroupConsumer::take_events`], or the listener when one is set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RebalanceEvent {
    /// Partitions given to this member in `generation`.
    Assigned {
        /// The member id they were given to.
        member_id: String,
        /// The generation.
        generation: i32,
        /// The partitions added.
        partitions: Vec<TopicPartition>,
    },
    /// Partitions given up in a rebalance (their positions were committed
    /// first when auto-commit is on).
    Revoked {
        /// The member id they were owned under (a member that lost its
        /// membership joins again under a new one).
        member_id: String,
        /// The generation they were owned in.
        generation: i32,
        /// The partitions.
        partitions: Vec<TopicPartition>,
    },
    /// Partitions lost without a rebalance: the member was evicted (its
    /// session ended, its generation is over) or replaced.
    Lost {
        /// The member id they were owned under.
        member_id: String,
        /// The generation they were owned in.
        generation: i32,
        /// The partitions.
        partitions: Vec<TopicPartition>,
        /// Why.
        reason: String,
    },
    /// A commit the coordinator refused: this member was no longer a
    /// member of its generation.
    CommitRefused {
        /// The member id the commit was made under.
        member_id: String,
        /// The generation it was made in.
        generation: i32,
        /// The coordinator's answer.
        reason: String,
    },
}

/// A rebalance listener ([`GroupConsumer::on_rebalance`]).
type Listener = Box<dyn FnMut(&RebalanceEvent) + Send>;

/// What the heartbeat task and the consumer share.
#[derive(Debug)]
struct Shared {
    /// The member it heartbeats for; `None` while not a member (joining).
    member: Option<MemberRef>,
    /// The coordinator asked for a rejoin.
    rejoin: bool,
    /// The membership was lost (evicted, fenced, or left for not polling).
    lost: Option<String>,
    last_poll: Instant,
}

/// A member of a consumer group. Not shared between tasks.
pub struct GroupConsumer {
    groups: Groups,
    meta: Arc<MetadataCache>,
    config: GroupConsumerConfig,
    topics: BTreeSet<String>,
    consumer: Consumer,
    member: MemberRef,
    owned: BTreeSet<TopicPartition>,
    /// The member id and generation `owned` was last confirmed in (the
    /// end of the last rebalance): what a revocation or a loss names, since
    /// a rebalance may have joined under a new id or generation by then.
    owned_in: (String, i32),
    joined: bool,
    shared: Arc<Mutex<Shared>>,
    heartbeat: Option<JoinHandle<()>>,
    last_commit: Instant,
    /// Events not yet taken, when no listener is set (at most [`EVENTS_KEPT_MAX`]).
    events: std::collections::VecDeque<RebalanceEvent>,
    /// In a mutex so the consumer stays `Sync` (its futures `Send`).
    listener: Mutex<Option<Listener>>,
}

impl std::fmt::Debug for GroupConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupConsumer")
            .field("group", &self.config.group_id)
            .field("member", &self.member)
            .field("owned", &self.owned)
            .finish_non_exhaustive()
    }
}

impl Drop for GroupConsumer {
    fn drop(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether a member call's error means this member's partitions are gone.
fn membership_lost(e: &Error) -> bool {
    matches!(
        e.code(),
        Some(ErrorCode::UnknownMemberId | ErrorCode::IllegalGeneration | ErrorCode::FencedInstanceId)
    )
}

/// Keeps `e` for [`GroupConsumer::take_events`], dropping the oldest
/// beyond [`EVENTS_KEPT_MAX`].
fn keep_event(events: &mut std::collections::VecDeque<RebalanceEvent>, e: RebalanceEvent, group: &str) {
    if events.len() >= EVENTS_KEPT_MAX {
        events.pop_front();
        tracing::warn!(group, kept = EVENTS_KEPT_MAX, "rebalance events not taken: dropped the oldest");
    }
    events.push_back(e);
}

impl GroupConsumer {
    /// A member of `config.group_id` for `topics`; it joins at the first
    /// [`GroupConsumer::poll`].
    ///
    /// # Panics
    /// Outside a tokio runtime (it starts its heartbeat task).
    ///
    /// # Errors
    /// A config without assignors, or with a heartbeat interval not below
    /// the session timeout.
    pub fn new(meta: Arc<MetadataCache>, config: GroupConsumerConfig, topics: &[&str]) -> Result<Self> {
        if config.assignors.is_empty() || config.heartbeat_interval_ms >= config.session_timeout_ms {
            return Err(Error::Config(
                "a group consumer needs an assignor, and heartbeat.interval.ms below session.timeout.ms"
                    .into(),
            ));
        }
        let shared = Arc::new(Mutex::new(Shared {
            member: None,
            rejoin: false,
            lost: None,
            last_poll: Instant::now(),
        }));
        let mut this = GroupConsumer {
            groups: Groups::new(meta.clone()),
            consumer: Consumer::new(meta.clone(), config.consumer.clone()),
            meta,
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            member: MemberRef {
                generation: -1,
                member_id: String::new(),
                instance_id: config.group_instance_id.clone(),
            },
            owned: BTreeSet::new(),
            owned_in: (String::new(), -1),
            joined: false,
            shared,
            heartbeat: None,
            last_commit: Instant::now(),
            events: std::collections::VecDeque::new(),
            listener: Mutex::new(None),
            config,
        };
        this.heartbeat = Some(this.spawn_heartbeat());
        Ok(this)
    }

    /// Calls `listener` with every [`RebalanceEvent`] as it happens
    /// (Kafka's `ConsumerRebalanceListener`), before poll returns. From
    /// then on events go to the listener only, and
    /// [`GroupConsumer::take_events`] returns those kept before it was set.
    pub fn on_rebalance(&mut self, listener: impl FnMut(&RebalanceEvent) + Send + 'static) {
        *self.listener.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(listener));
    }

    /// The events since the last call, oldest first, while no listener is
    /// set: at most the newest [`EVENTS_KEPT_MAX`].
    pub fn take_events(&mut self) -> Vec<RebalanceEvent> {
        std::mem::take(&mut self.events).into()
    }

    /// This member's id and generation (-1 before it joined).
    pub fn member(&self) -> &MemberRef {
        &self.member
    }

    /// The partitions this member owns.
    pub fn assignment(&self) -> Vec<TopicPartition> {
        self.owned.iter().cloned().collect()
    }

    fn event(&mut self, e: RebalanceEvent) {
        tracing::info!(group = %self.config.group_id, "{e:?}");
        if let Some(l) = self.listener.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            l(&e);
            return;
        }
        keep_event(&mut self.events, e, &self.config.group_id);
    }

    fn cooperative(&self) -> bool {
        self.config.assignors.iter().all(|a| a.cooperative())
    }

    fn spawn_heartbeat(&self) -> JoinHandle<()> {
        let (groups, shared, group) =
            (self.groups.clone(), self.shared.clone(), self.config.group_id.clone());
        let interval = Duration::from_millis(u64::from(self.config.heartbeat_interval_ms));
        let max_poll = Duration::from_millis(u64::from(self.config.max_poll_interval_ms));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let (member, idle) = {
                    let s = lock(&shared);
                    (s.member.clone(), s.last_poll.elapsed())
                };
                let Some(member) = member else { continue };
                if idle > max_poll {
                    // Kafka's consumer leaves the group when the application
                    // stops polling, so its partitions move on.
                    tracing::warn!(
                        group,
                        "no poll for {idle:?} (max.poll.interval.ms {max_poll:?}): leaving the group"
                    );
                    let _ = tokio::time::timeout(interval * 2, groups.leave(&group, &member)).await;
                    let mut s = lock(&shared);
                    if s.member.as_ref() == Some(&member) {
                        s.member = None;
                        s.lost = Some(format!(
                            "no poll within max.poll.interval.ms ({max_poll:?}): left the group"
                        ));
                    }
                    continue;
                }
                let r = tokio::time::timeout(interval * 2, groups.heartbeat(&group, &member)).await;
                let mut s = lock(&shared);
                if s.member.as_ref() != Some(&member) {
                    continue;
                }
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) if e.code() == Some(ErrorCode::RebalanceInProgress) => s.rejoin = true,
                    Ok(Err(e)) if membership_lost(&e) => {
                        s.member = None;
                        s.lost = Some(e.to_string());
                    }
                    Ok(Err(e)) => tracing::debug!(group, "heartbeat: {e}"),
                    Err(_) => tracing::debug!(group, "heartbeat: no answer within {:?}", interval * 2),
                }
            }
        })
    }

    /// Reads records of this member's partitions, joining the group or
    /// rebalancing first when needed; waits up to `timeout` for some.
    ///
    /// # Errors
    /// Join errors other than the retriable ones (an invalid session
    /// timeout, `INCONSISTENT_GROUP_PROTOCOL`, `FENCED_INSTANCE_ID`: a newer
    /// instance with this instance id runs); fetch errors as
    /// [`Consumer::poll`] (out-of-range positions are reset as
    /// `auto_offset_reset` says).
    pub async fn poll(&mut self, timeout: Duration) -> Result<Vec<ConsumerRecord>> {
        let deadline = Instant::now() + timeout;
        lock(&self.shared).last_poll = Instant::now();
        if self.config.enable_auto_commit
            && self.joined
            && self.last_commit.elapsed() >= Duration::from_millis(self.config.auto_commit_interval_ms)
        {
            self.commit_quietly(true).await;
        }
        loop {
            let (lost, rejoin) = {
                let mut s = lock(&self.shared);
                // Still polling, however long this call waits (Kafka's poll
                // timer restarts on every pass).
                s.last_poll = Instant::now();
                (s.lost.take(), std::mem::take(&mut s.rejoin))
            };
            if let Some(reason) = lost {
                self.lose(reason).await?;
            }
            if rejoin || !self.joined {
                self.rebalance().await?;
            }
            let slice = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(200));
            let records = match self.consumer.poll(slice).await {
                Ok(r) => r,
                Err(Error::OffsetOutOfRange {
                    topic, partition, log_start_offset, log_end_offset, ..
                }) if self.config.auto_offset_reset != AutoOffsetReset::None => {
                    let to = if self.config.auto_offset_reset == AutoOffsetReset::Earliest {
                        log_start_offset
                    } else {
                        log_end_offset
                    };
                    tracing::warn!(group = %self.config.group_id, "{topic}/{partition}: position out of range; reset to {to}");
                    self.consumer.seek(&topic, partition, Seek::Offset(to));
                    Vec::new()
                }
                Err(e) => return Err(e),
            };
            if !records.is_empty() || Instant::now() >= deadline {
                return Ok(records);
            }
        }
    }

    /// Each owned partition's position: the offset after the records
    /// returned so far, what [`GroupConsumer::commit`] commits.
    pub fn positions(&self) -> Vec<(TopicPartition, u64)> {
        self.to_commit(&self.owned).into_iter().map(|o| ((o.topic, o.partition), o.offset)).collect()
    }

    /// Moves an owned partition's position back (or on) to `offset`: the
    /// next poll reads from there, and a commit commits it (e.g. records
    /// returned but not processed). Partitions not owned are ignored.
    pub fn seek(&mut self, topic: &str, partition: u32, offset: u64) {
        if self.owned.contains(&(topic.to_owned(), partition)) {
            self.consumer.seek(topic, partition, Seek::Offset(offset));
        }
    }

    /// The positions of the owned partitions, to commit.
    fn to_commit(&self, of: &BTreeSet<TopicPartition>) -> Vec<OffsetToCommit> {
        of.iter()
            .filter_map(|(t, p)| {
                self.consumer.position(t, *p).map(|offset| OffsetToCommit {
                    topic: t.clone(),
                    partition: *p,
                    offset,
                    metadata: String::new(),
                    // The incarnation the position belongs to (KIP-516).
                    topic_id: self.consumer.topic_id(t, *p),
                })
            })
            .collect()
    }

    /// Commits the positions after the records returned so far, of every
    /// owned partition (Kafka's `commitSync`): acknowledged once stored by
    /// a majority of the coordinator partition's replicas.
    ///
    /// # Errors
    /// `ILLEGAL_GENERATION`, `UNKNOWN_MEMBER_ID`, `FENCED_INSTANCE_ID`,
    /// `REBALANCE_IN_PROGRESS` as [`Error::Broker`]: this member's
    /// generation is over and nothing was stored; its partitions are
    /// given up ([`RebalanceEvent::Lost`]) or rebalanced at the next poll.
    /// A partition's own error (e.g. `OFFSET_COMMIT_BACKWARDS` after a
    /// seek back) is returned too.
    pub async fn commit(&mut self) -> Result<()> {
        let owned = self.owned.clone();
        self.commit_partitions(&owned, true).await
    }

    /// Commits `of`'s positions. With `signal`, a refusal that ends the
    /// membership is passed to the next poll (which gives the partitions
    /// up, or rejoins); inside [`GroupConsumer::lose`] and
    /// [`GroupConsumer::rebalance`], which deal with it themselves, not.
    async fn commit_partitions(&mut self, of: &BTreeSet<TopicPartition>, signal: bool) -> Result<()> {
        let offsets = self.to_commit(of);
        if offsets.is_empty() || !self.joined {
            return Ok(());
        }
        self.last_commit = Instant::now();
        match self.groups.commit_as(&self.config.group_id, &self.member, &offsets, false).await {
            Ok(results) => {
                for (o, r) in results {
                    if let Err(e) = r {
                        return Err(Error::Broker {
                            operation: format!("commit offset {} of {}/{}", o.offset, o.topic, o.partition),
                            code: e.code().map_or(ErrorCode::InvalidRequest as i32, |c| c as i32),
                            message: e.to_string(),
                            leader: None,
                        });
                    }
                }
                Ok(())
            }
            Err(e) => {
                if membership_lost(&e) || e.code() == Some(ErrorCode::RebalanceInProgress) {
                    let generation = self.member.generation;
                    self.event(RebalanceEvent::CommitRefused {
                        member_id: self.member.member_id.clone(),
                        generation,
                        reason: e.to_string(),
                    });
                    let mut s = lock(&self.shared);
                    if signal && membership_lost(&e) {
                        s.member = None;
                        s.lost.get_or_insert_with(|| e.to_string());
                    } else if signal {
                        s.rejoin = true;
                    }
                }
                Err(e)
            }
        }
    }

    /// Auto-commit: errors are logged and reported as events, not
    /// returned; with `signal`, as [`GroupConsumer::commit_partitions`].
    async fn commit_quietly(&mut self, signal: bool) {
        let owned = self.owned.clone();
        if let Err(e) = self.commit_partitions(&owned, signal).await {
            tracing::warn!(group = %self.config.group_id, "auto-commit: {e}");
        }
    }

    /// Stops reading every owned partition and returns them: this member
    /// owns nothing afterwards.
    fn give_up_all(&mut self) -> Vec<TopicPartition> {
        let partitions: Vec<TopicPartition> = std::mem::take(&mut self.owned).into_iter().collect();
        for (t, p) in &partitions {
            self.consumer.unassign(t, *p);
        }
        partitions
    }

    /// Gives every partition up without a rebalance: the membership is
    /// gone. A commit is still tried first: the coordinator refuses it
    /// unless this member's generation is still current.
    async fn lose(&mut self, reason: String) -> Result<()> {
        if self.config.enable_auto_commit {
            self.commit_quietly(false).await;
        }
        let partitions = self.give_up_all();
        let (member_id, generation) = self.owned_in.clone();
        self.event(RebalanceEvent::Lost { member_id, generation, partitions, reason: reason.clone() });
        self.joined = false;
        if reason.contains("FENCED_INSTANCE_ID") {
            return Err(Error::Config(format!(
                "group {}: another instance with instance id {:?} replaced this one: {reason}",
                self.config.group_id, self.member.instance_id
            )));
        }
        if reason.contains("UNKNOWN_MEMBER_ID") || reason.contains("max.poll.interval.ms") {
            self.member.member_id.clear();
        }
        Ok(())
    }

    /// Joins (or rejoins) the group and takes this member's assignment. On
    /// failure this member owns nothing and is not joined: the next poll
    /// tries again (a member that keeps partitions without heartbeating
    /// would be evicted while it still reads them).
    async fn rebalance(&mut self) -> Result<()> {
        let r = self.rebalance_once().await;
        if r.is_err() {
            self.joined = false;
            // No heartbeats for a member that owns nothing here: the next
            // poll joins again (with the same member id).
            lock(&self.shared).member = None;
            if !self.owned.is_empty() {
                let partitions = self.give_up_all();
                let (member_id, generation) = self.owned_in.clone();
                let reason = format!(
                    "the rebalance failed: {}",
                    r.as_ref().err().map(ToString::to_string).unwrap_or_default()
                );
                self.event(RebalanceEvent::Lost { member_id, generation, partitions, reason });
            }
        }
        r
    }

    async fn rebalance_once(&mut self) -> Result<()> {
        let cooperative = self.cooperative();
        if self.joined && self.config.enable_auto_commit {
            self.commit_quietly(false).await;
        }
        if !cooperative && !self.owned.is_empty() {
            let partitions = self.give_up_all();
            let (member_id, generation) = self.owned_in.clone();
            self.event(RebalanceEvent::Revoked { member_id, generation, partitions });
        }
        lock(&self.shared).member = None;
        let assignment = loop {
            let joined = self.join_once().await;
            match joined {
                Ok(Some(a)) => break a,
                Ok(None) => continue,
                Err(e) if membership_lost(&e) => {
                    let reason = e.to_string();
                    if !self.owned.is_empty() {
                        self.lose(reason).await?;
                    } else if reason.contains("FENCED_INSTANCE_ID") {
                        return Err(e);
                    } else {
                        self.member.member_id.clear();
                    }
                }
                Err(e) => return Err(e),
            }
        };
        // A rejoin asked for by a heartbeat of a generation this join
        // replaced is done.
        lock(&self.shared).rejoin = false;
        let revoked: BTreeSet<TopicPartition> = self.owned.difference(&assignment).cloned().collect();
        let added: BTreeSet<TopicPartition> = assignment.difference(&self.owned).cloned().collect();
        if !revoked.is_empty() {
            if self.config.enable_auto_commit
                && let Err(e) = self.commit_partitions(&revoked, false).await
            {
                tracing::warn!(group = %self.config.group_id, "commit before revoking: {e}");
            }
            for (t, p) in &revoked {
                self.consumer.unassign(t, *p);
                self.owned.remove(&(t.clone(), *p));
            }
            let (member_id, generation) = self.owned_in.clone();
            self.event(RebalanceEvent::Revoked {
                member_id,
                generation,
                partitions: revoked.into_iter().collect(),
            });
            // The partitions move on in the next rebalance (KIP-429).
            lock(&self.shared).rejoin = true;
        }
        if !added.is_empty() {
            // Each partition is read in the topic incarnation the metadata
            // names now, and only an offset committed in that one is taken.
            let cluster = self.meta.snapshot();
            let id_of = |t: &str| cluster.topics.get(t).and_then(|m| m.topic_id);
            let asked: Vec<(String, u32, Option<ferrolog_proto::TopicId>)> =
                added.iter().map(|(t, p)| (t.clone(), *p, id_of(t))).collect();
            let committed = self.groups.committed_in(&self.config.group_id, &asked).await?;
            // Every added partition's start decided before any is taken: a
            // refusal takes none, so a loss that follows names only
            // partitions an `Assigned` event named before.
            let mut starts = Vec::with_capacity(added.len());
            for (t, p) in &added {
                let offset =
                    committed.iter().find(|c| c.topic == *t && c.partition == *p).and_then(|c| c.offset);
                starts.push(match (offset, self.config.auto_offset_reset) {
                    (Some(o), _) => Seek::Offset(o),
                    (None, AutoOffsetReset::Earliest) => Seek::Earliest,
                    (None, AutoOffsetReset::Latest) => Seek::Latest,
                    (None, AutoOffsetReset::None) => {
                        return Err(Error::Config(format!(
                            "group {}: {t}/{p} has no committed offset and auto.offset.reset is none",
                            self.config.group_id
                        )));
                    }
                });
            }
            for ((t, p), from) in added.iter().zip(starts) {
                self.consumer.seek(t, *p, from);
                if let (Seek::Offset(_), Some(id)) = (from, id_of(t)) {
                    self.consumer.bind_partition(t, *p, id);
                }
                self.owned.insert((t.clone(), *p));
            }
            let generation = self.member.generation;
            self.event(RebalanceEvent::Assigned {
                member_id: self.member.member_id.clone(),
                generation,
                partitions: added.into_iter().collect(),
            });
        }
        self.joined = true;
        self.owned_in = (self.member.member_id.clone(), self.member.generation);
        self.last_commit = Instant::now();
        let mut s = lock(&self.shared);
        s.member = Some(self.member.clone());
        s.last_poll = Instant::now();
        // What was lost is the membership this rebalance replaced.
        s.lost = None;
        Ok(())
    }

    /// One JoinGroup and SyncGroup; `None` when the group rebalanced again
    /// meanwhile (join again).
    async fn join_once(&mut self) -> Result<Option<BTreeSet<TopicPartition>>> {
        let subscription = pb::ConsumerSubscription {
            topics: self.topics.iter().cloned().collect(),
            owned_partitions: self
                .owned
                .iter()
                .map(|(t, p)| pb::TopicPartition {
                    topic: t.clone(),
                    partition: *p,
                    topic_id: Default::default(),
                })
                .collect(),
            generation_id: if self.owned.is_empty() { -1 } else { self.member.generation },
        };
        let metadata = Bytes::from(subscription.encode_to_vec());
        let params = JoinParams {
            member_id: self.member.member_id.clone(),
            instance_id: self.config.group_instance_id.clone(),
            client_id: self.config.client_id.clone(),
            session_timeout_ms: i32::try_from(self.config.session_timeout_ms).unwrap_or(i32::MAX),
            rebalance_timeout_ms: i32::try_from(self.config.max_poll_interval_ms).unwrap_or(i32::MAX),
            protocol_type: PROTOCOL_TYPE.into(),
            protocols: self
                .config
                .assignors
                .iter()
                .map(|a| (a.name().to_owned(), metadata.clone()))
                .collect(),
        };
        let joined = self.groups.join(&self.config.group_id, &params).await?;
        self.member.member_id.clone_from(&joined.member_id);
        self.member.generation = joined.generation;
        // Heartbeats from the join's answer on, as Kafka's client: the
        // session runs while the leader assigns.
        lock(&self.shared).member = Some(self.member.clone());
        let assignments = if joined.leader == joined.member_id && !joined.members.is_empty() {
            self.compute_assignment(&joined.protocol, &joined.members).await?
        } else {
            Vec::new()
        };
        let wait = u64::from(self.config.session_timeout_ms);
        match self.groups.sync(&self.config.group_id, &self.member, assignments, wait).await {
            Ok(bytes) => {
                let a = pb::ConsumerAssignment::decode(bytes.as_ref())
                    .map_err(|e| Error::Protocol(format!("an assignment that does not decode: {e}")))?;
                Ok(Some(a.partitions.into_iter().map(|tp| (tp.topic, tp.partition)).collect()))
            }
            Err(e) if e.code() == Some(ErrorCode::RebalanceInProgress) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The leader's work: every member's partitions, by the chosen assignor.
    async fn compute_assignment(
        &self,
        protocol: &str,
        members: &[(String, Bytes)],
    ) -> Result<Vec<(String, Bytes)>> {
        let assignor = Assignor::from_name(protocol).ok_or_else(|| {
            Error::Protocol(format!("the group chose assignor {protocol:?}, which this client lacks"))
        })?;
        let subs: Vec<Subscription> = members
            .iter()
            .map(|(id, metadata)| {
                let s = pb::ConsumerSubscription::decode(metadata.as_ref()).unwrap_or_default();
                Subscription {
                    member_id: id.clone(),
                    topics: s.topics.into_iter().collect(),
                    owned: s.owned_partitions.into_iter().map(|tp| (tp.topic, tp.partition)).collect(),
                    generation: s.generation_id,
                }
            })
            .collect();
        let cluster = self.meta.refresh().await?;
        let wanted: BTreeSet<&String> = subs.iter().flat_map(|s| s.topics.iter()).collect();
        let counts: BTreeMap<String, u32> = cluster
            .topics
            .iter()
            .filter(|(name, _)| wanted.contains(name))
            .map(|(name, t)| (name.clone(), t.partition_count()))
            .collect();
        let plan = assignor::assign(assignor, &subs, &counts);
        Ok(plan
            .into_iter()
            .map(|(member, set)| {
                let a = pb::ConsumerAssignment {
                    partitions: set
                        .into_iter()
                        .map(|(topic, partition)| pb::TopicPartition {
                            topic,
                            partition,
                            topic_id: Default::default(),
                        })
                        .collect(),
                };
                (member, Bytes::from(a.encode_to_vec()))
            })
            .collect())
    }

    /// Leaves the group: commits positions (with auto-commit), then a
    /// LeaveGroup so the partitions move on at once (a static member does
    /// not leave: it expects to come back within its session timeout).
    ///
    /// # Errors
    /// The commit's error, when auto-commit is on.
    pub async fn close(mut self) -> Result<()> {
        let committed =
            if self.config.enable_auto_commit && self.joined { self.commit().await } else { Ok(()) };
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        if !self.member.member_id.is_empty()
            && self.config.group_instance_id.is_none()
            && let Err(e) = self.groups.leave(&self.config.group_id, &self.member).await
        {
            tracing::debug!(group = %self.config.group_id, "leave: {e}");
        }
        committed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assigned(generation: i32) -> RebalanceEvent {
        RebalanceEvent::Assigned { member_id: "m".into(), generation, partitions: Vec::new() }
    }

    #[test]
    fn events_nobody_takes_stay_bounded_and_the_newest_are_kept() {
        let mut events = std::collections::VecDeque::new();
        let total = EVENTS_KEPT_MAX as i32 + 10;
        for g in 0..total {
            keep_event(&mut events, assigned(g), "g");
        }
        assert_eq!(events.len(), EVENTS_KEPT_MAX);
        assert_eq!(events.front(), Some(&assigned(10)), "the oldest ten were dropped");
        assert_eq!(events.back(), Some(&assigned(total - 1)));
    }

    #[tokio::test]
    async fn with_a_listener_events_go_to_it_and_are_not_kept() {
        let meta =
            MetadataCache::new(crate::ClientConfig::from_list("127.0.0.1:1")).expect("a metadata cache");
        let mut consumer =
            GroupConsumer::new(meta, GroupConsumerConfig::new("g"), &["t"]).expect("a group consumer");
        consumer.event(assigned(1));
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        consumer.on_rebalance(move |e| h.lock().expect("lock").push(e.clone()));
        for g in 2..5 {
            consumer.event(assigned(g));
        }
        assert_eq!(*heard.lock().expect("lock"), vec![assigned(2), assigned(3), assigned(4)]);
        assert_eq!(consumer.take_events(), vec![assigned(1)], "only the event from before the listener");
        assert!(consumer.take_events().is_empty());
    }
}

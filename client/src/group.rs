//! Consumer groups' committed offsets (issue 13), as an admin or a
//! consumer outside any group membership uses them: find a group's
//! coordinator, commit, read back, list, describe, delete.
//!
//! A group's coordinator is the leader of the partition of the internal
//! topic `__consumer_offsets` its id hashes to; any broker says which
//! (`FindCoordinator`). Calls go to the coordinator and follow
//! `NOT_COORDINATOR` (with its hint), `COORDINATOR_NOT_AVAILABLE` and
//! `COORDINATOR_LOAD_IN_PROGRESS` with backoff until the timeout, as Kafka
//! clients do. Commits here are made with generation -1 and no member id:
//! the coordinator takes them only while the group has no members.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrolog_proto::client as pb;

use crate::consumer::{ConsumerConfig, Seek, list_offset};
use crate::error::{Error, ErrorCode, Op, Result};
use crate::metadata::MetadataCache;

/// Extra time a JoinGroup call may take beyond its rebalance timeout, ms:
/// the broker's initial rebalance delay (3 s by default) and slack.
const JOIN_EXTRA_WAIT_MS: u64 = 10_000;

/// One partition's offset to commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffsetToCommit {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// The next offset the group will read (Kafka's rule: a position, not
    /// the last record processed).
    pub offset: u64,
    /// Free text stored with it.
    pub metadata: String,
    /// The topic's id (KIP-516) the offset belongs to: refused
    /// (`UNKNOWN_TOPIC_ID`) if the topic of that name is another
    /// incarnation now. `None`: the coordinator's current one.
    pub topic_id: Option<ferrolog_proto::TopicId>,
}

/// A committed offset as the coordinator answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedOffset {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// The offset, or `None`: the group has none for this partition (of the
    /// topic's current incarnation).
    pub offset: Option<u64>,
    /// What was stored with it.
    pub metadata: String,
    /// When it was committed, ms since the Unix epoch (0 when none).
    pub commit_timestamp_ms: i64,
}

/// A group as `ListGroups` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupListing {
    /// Group id.
    pub group: String,
    /// Kafka's state name (Empty, PreparingRebalance, CompletingRebalance, Stable, Dead).
    pub state: String,
    /// Member count.
    pub members: u32,
    /// The broker that coordinates it.
    pub coordinator: u32,
}

/// A group as `DescribeGroup` answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupDescription {
    /// Group id.
    pub group: String,
    /// Kafka's state name.
    pub state: String,
    /// The generation of its last rebalance.
    pub generation: i32,
    /// The assignor in use.
    pub protocol: String,
    /// Its members.
    pub members: Vec<GroupMemberDescription>,
    /// Committed offsets, by topic and partition.
    pub offsets: Vec<CommittedOffset>,
    /// The broker that answered (its coordinator).
    pub coordinator: u32,
}

/// A member as `DescribeGroup` answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupMemberDescription {
    /// Member id.
    pub member_id: String,
    /// The client's self-given name.
    pub client_id: String,
    /// Static membership's instance id.
    pub instance_id: Option<String>,
    /// Its partitions (for consumer groups).
    pub assignment: Vec<(String, u32)>,
}

/// A group's coordinator as `FindCoordinator` answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorInfo {
    /// Its broker id.
    pub broker: u32,
    /// Its client API address.
    pub address: String,
    /// The `__consumer_offsets` partition of the group.
    pub partition: u32,
}

/// Who makes a member call: a member of a generation, or (generation -1,
/// no member id) someone outside any membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberRef {
    /// The generation.
    pub generation: i32,
    /// Member id.
    pub member_id: String,
    /// Static membership's instance id (KIP-345).
    pub instance_id: Option<String>,
}

impl MemberRef {
    /// Outside any membership.
    pub fn outside() -> Self {
        MemberRef { generation: -1, member_id: String::new(), instance_id: None }
    }
}

/// A JoinGroup's parameters.
#[derive(Debug, Clone)]
pub struct JoinParams {
    /// Empty on the first join.
    pub member_id: String,
    /// Static membership's instance id.
    pub instance_id: Option<String>,
    /// The client's self-given name.
    pub client_id: String,
    /// ms.
    pub session_timeout_ms: i32,
    /// ms.
    pub rebalance_timeout_ms: i32,
    /// "consumer" for consumers.
    pub protocol_type: String,
    /// (assignor name, metadata), most preferred first.
    pub protocols: Vec<(String, bytes::Bytes)>,
}

/// What a JoinGroup answered.
#[derive(Debug, Clone)]
pub struct Joined {
    /// The new generation.
    pub generation: i32,
    /// The chosen assignor.
    pub protocol: String,
    /// The leader member's id.
    pub leader: String,
    /// This member's id.
    pub member_id: String,
    /// For the leader: (member id, metadata) of every member.
    pub members: Vec<(String, bytes::Bytes)>,
}

/// Group calls on a cluster. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Groups {
    meta: Arc<MetadataCache>,
    timeout: Duration,
    /// Coordinator address by group id, until a call fails.
    known: Arc<Mutex<HashMap<String, String>>>,
}

impl Groups {
    /// Group calls through `meta`, each retried for up to 30 s.
    pub fn new(meta: Arc<MetadataCache>) -> Self {
        Self { meta, timeout: Duration::from_secs(30), known: Arc::default() }
    }

    /// Sets how long each call retries transient errors.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The metadata cache calls go through.
    pub fn metadata(&self) -> &Arc<MetadataCache> {
        &self.meta
    }

    /// Asks any broker for `group`'s coordinator (creating
    /// `__consumer_offsets` on the first group call of a cluster).
    ///
    /// # Errors
    /// `INVALID_GROUP_ID` as [`Error::Broker`]; [`Error::Deadline`] while
    /// no coordinator is available.
    pub async fn find_coordinator(&self, group: &str) -> Result<CoordinatorInfo> {
        self.meta.retrying("find coordinator", self.timeout, || self.find_coordinator_once(group)).await
    }

    /// One FindCoordinator to any broker (the callers retry).
    async fn find_coordinator_once(&self, group: &str) -> Result<CoordinatorInfo> {
        let op = Op::new("find the coordinator of group", group);
        let address = self.meta.current().await?.answered_by.clone();
        let request = pb::FindCoordinatorRequest { group_id: group.to_owned() };
        let r = self
            .meta
            .call(&op, &address, 0, |mut c| async move { c.find_coordinator(request).await })
            .await?;
        Error::from_wire(&op, r.error)?;
        Ok(CoordinatorInfo { broker: r.broker_id, address: r.address, partition: r.partition })
    }

    /// Runs `call` against `group`'s coordinator, following
    /// `NOT_COORDINATOR` hints and retrying transient errors.
    async fn on_coordinator<T, F, Fut>(&self, operation: &'static str, group: &str, call: F) -> Result<T>
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.meta
            .retrying(operation, self.timeout, || {
                let known = self.known.lock().unwrap_or_else(|p| p.into_inner()).get(group).cloned();
                let call = &call;
                async move {
                    let address = match known {
                        Some(a) => a,
                        None => self.find_coordinator_once(group).await?.address,
                    };
                    let r = call(address.clone()).await;
                    let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
                    match &r {
                        Err(e) if e.is_retriable() => {
                            match e.leader_hint().filter(|_| e.code() == Some(ErrorCode::NotCoordinator)) {
                                Some(h) => known.insert(group.to_owned(), h.address.clone()),
                                None => known.remove(group),
                            };
                        }
                        _ => {
                            known.insert(group.to_owned(), address);
                        }
                    }
                    r
                }
            })
            .await
    }

    /// Commits `offsets` for `group` from outside any membership
    /// (generation -1): refused while the group has members. An offset
    /// below the committed one is refused (`OFFSET_COMMIT_BACKWARDS`)
    /// unless `allow_backwards` (offset resets). Returns each partition's
    /// outcome in order: `Ok` when committed (acknowledged once a majority
    /// of the coordinator partition's replicas stored it).
    ///
    /// # Errors
    /// Group-level: `UNKNOWN_MEMBER_ID` (the group has members), as
    /// [`Error::Broker`]; [`Error::Deadline`]. Per partition:
    /// `UNKNOWN_TOPIC`, `OFFSET_METADATA_TOO_LARGE`, `OFFSET_COMMIT_BACKWARDS`.
    pub async fn commit(
        &self,
        group: &str,
        offsets: &[OffsetToCommit],
        allow_backwards: bool,
    ) -> Result<Vec<(OffsetToCommit, Result<()>)>> {
        self.commit_as(group, &MemberRef::outside(), offsets, allow_backwards).await
    }

    /// As [`Groups::commit`], by `member` of its generation: refused
    /// whole (`ILLEGAL_GENERATION`, `UNKNOWN_MEMBER_ID`,
    /// `FENCED_INSTANCE_ID`, `REBALANCE_IN_PROGRESS`) unless it is a member
    /// of the group's current generation, so an evicted member cannot
    /// overwrite the positions of the partitions' new owners.
    ///
    /// # Errors
    /// As [`Groups::commit`].
    pub async fn commit_as(
        &self,
        group: &str,
        member: &MemberRef,
        offsets: &[OffsetToCommit],
        allow_backwards: bool,
    ) -> Result<Vec<(OffsetToCommit, Result<()>)>> {
        let op = Op::new("commit offsets of group", group);
        let r = self
            .on_coordinator("commit offsets", group, |address| {
                let request = pb::OffsetCommitRequest {
                    group_id: group.to_owned(),
                    generation_id: member.generation,
                    member_id: member.member_id.clone(),
                    group_instance_id: member.instance_id.clone(),
                    offsets: offsets
                        .iter()
                        .map(|o| pb::OffsetCommitPartition {
                            topic: o.topic.clone(),
                            partition: o.partition,
                            offset: o.offset,
                            metadata: o.metadata.clone(),
                            topic_id: o.topic_id.map(ferrolog_proto::TopicId::to_wire).unwrap_or_default(),
                        })
                        .collect(),
                    allow_backwards,
                };
                let op = &op;
                async move {
                    let r = self
                        .meta
                        .call(op, &address, 0, |mut c| async move { c.offset_commit(request).await })
                        .await?;
                    Error::from_wire(op, r.error)?;
                    Ok(r.results)
                }
            })
            .await?;
        // Answered in request order, one result per partition asked.
        if r.len() != offsets.len() {
            return Err(Error::Protocol(format!(
                "the coordinator answered {} results for {} partitions",
                r.len(),
                offsets.len()
            )));
        }
        Ok(offsets
            .iter()
            .zip(r)
            .map(|(o, x)| {
                let op = Op::partition("commit offset of", &o.topic, o.partition);
                (o.clone(), Error::from_wire(&op, x.error))
            })
            .collect())
    }

    /// `group`'s committed offsets for `partitions` (topic, partition), or
    /// for every partition it has one for when empty.
    ///
    /// # Errors
    /// [`Error::Deadline`] while no coordinator answers.
    pub async fn committed(&self, group: &str, partitions: &[(String, u32)]) -> Result<Vec<CommittedOffset>> {
        let asked: Vec<(String, u32, Option<ferrolog_proto::TopicId>)> =
            partitions.iter().map(|(t, p)| (t.clone(), *p, None)).collect();
        self.committed_in(group, &asked).await
    }

    /// As [`Groups::committed`], each partition of the topic incarnation
    /// (KIP-516 id) given: an offset committed for another incarnation is
    /// not answered.
    ///
    /// # Errors
    /// As [`Groups::committed`].
    pub async fn committed_in(
        &self,
        group: &str,
        partitions: &[(String, u32, Option<ferrolog_proto::TopicId>)],
    ) -> Result<Vec<CommittedOffset>> {
        let op = Op::new("fetch committed offsets of group", group);
        let r = self
            .on_coordinator("fetch committed offsets", group, |address| {
                let request = pb::OffsetFetchRequest {
                    group_id: group.to_owned(),
                    partitions: partitions
                        .iter()
                        .map(|(t, p, id)| pb::TopicPartition {
                            topic: t.clone(),
                            partition: *p,
                            topic_id: id.map(ferrolog_proto::TopicId::to_wire).unwrap_or_default(),
                        })
                        .collect(),
                };
                let op = &op;
                async move {
                    let r = self
                        .meta
                        .call(op, &address, 0, |mut c| async move { c.offset_fetch(request).await })
                        .await?;
                    Error::from_wire(op, r.error)?;
                    Ok(r.offsets)
                }
            })
            .await?;
        Ok(r.into_iter().map(committed).collect())
    }

    /// `group`'s state and committed offsets.
    ///
    /// # Errors
    /// `GROUP_ID_NOT_FOUND` as [`Error::Broker`]; [`Error::Deadline`].
    pub async fn describe(&self, group: &str) -> Result<GroupDescription> {
        let op = Op::new("describe group", group);
        let r = self
            .on_coordinator("describe group", group, |address| {
                let request = pb::DescribeGroupRequest { group_id: group.to_owned() };
                let op = &op;
                async move {
                    let r = self
                        .meta
                        .call(op, &address, 0, |mut c| async move { c.describe_group(request).await })
                        .await?;
                    Error::from_wire(op, r.error.clone())?;
                    Ok(r)
                }
            })
            .await?;
        Ok(GroupDescription {
            group: r.group_id,
            state: r.state,
            generation: r.generation_id,
            protocol: r.protocol,
            members: r
                .members
                .into_iter()
                .map(|m| GroupMemberDescription {
                    member_id: m.member_id,
                    client_id: m.client_id,
                    instance_id: Some(m.group_instance_id).filter(|i| !i.is_empty()),
                    assignment: m.assignment.into_iter().map(|tp| (tp.topic, tp.partition)).collect(),
                })
                .collect(),
            offsets: r.offsets.into_iter().map(committed).collect(),
            coordinator: r.coordinator,
        })
    }

    /// Deletes `group` and its committed offsets.
    ///
    /// # Errors
    /// `NON_EMPTY_GROUP`, `GROUP_ID_NOT_FOUND` as [`Error::Broker`];
    /// [`Error::Deadline`]. A retry after a lost answer may report
    /// `GROUP_ID_NOT_FOUND` for a group this call deleted.
    pub async fn delete(&self, group: &str) -> Result<()> {
        let op = Op::new("delete group", group);
        self.on_coordinator("delete group", group, |address| {
            let request = pb::DeleteGroupRequest { group_id: group.to_owned() };
            let op = &op;
            async move {
                let r = self
                    .meta
                    .call(op, &address, 0, |mut c| async move { c.delete_group(request).await })
                    .await?;
                Error::from_wire(op, r.error)
            }
        })
        .await
    }

    /// JoinGroup: waits until the rebalance has a new generation (up to the
    /// rebalance timeout and the broker's initial delay).
    ///
    /// # Errors
    /// `UNKNOWN_MEMBER_ID`, `FENCED_INSTANCE_ID`, `INVALID_SESSION_TIMEOUT`,
    /// `INCONSISTENT_GROUP_PROTOCOL`, `INVALID_REQUEST` as [`Error::Broker`].
    pub async fn join(&self, group: &str, p: &JoinParams) -> Result<Joined> {
        let op = Op::new("join group", group);
        let wait = u64::try_from(p.rebalance_timeout_ms).unwrap_or(0) + JOIN_EXTRA_WAIT_MS;
        let r = self
            .on_coordinator("join group", group, |address| {
                let request = pb::JoinGroupRequest {
                    group_id: group.to_owned(),
                    session_timeout_ms: p.session_timeout_ms,
                    rebalance_timeout_ms: p.rebalance_timeout_ms,
                    member_id: p.member_id.clone(),
                    group_instance_id: p.instance_id.clone(),
                    protocol_type: p.protocol_type.clone(),
                    protocols: p
                        .protocols
                        .iter()
                        .map(|(name, metadata)| pb::GroupProtocol {
                            name: name.clone(),
                            metadata: metadata.clone(),
                        })
                        .collect(),
                    client_id: p.client_id.clone(),
                };
                let op = &op;
                async move {
                    let r = self
                        .meta
                        .call(op, &address, wait, |mut c| async move { c.join_group(request).await })
                        .await?;
                    Error::from_wire(op, r.error.clone())?;
                    Ok(r)
                }
            })
            .await?;
        Ok(Joined {
            generation: r.generation_id,
            protocol: r.protocol_name,
            leader: r.leader,
            member_id: r.member_id,
            members: r.members.into_iter().map(|m| (m.member_id, m.metadata)).collect(),
        })
    }

    /// SyncGroup: the leader passes every member's assignment; each member
    /// gets its own once the coordinator stored them.
    ///
    /// # Errors
    /// `REBALANCE_IN_PROGRESS` (rejoin), `ILLEGAL_GENERATION`,
    /// `UNKNOWN_MEMBER_ID`, `FENCED_INSTANCE_ID` as [`Error::Broker`].
    pub async fn sync(
        &self,
        group: &str,
        member: &MemberRef,
        assignments: Vec<(String, bytes::Bytes)>,
        wait_ms: u64,
    ) -> Result<bytes::Bytes> {
        let op = Op::new("sync group", group);
        let r = self
            .on_coordinator("sync group", group, |address| {
                let request = pb::SyncGroupRequest {
                    group_id: group.to_owned(),
                    generation_id: member.generation,
                    member_id: member.member_id.clone(),
                    group_instance_id: member.instance_id.clone(),
                    assignments: assignments
                        .iter()
                        .map(|(m, a)| pb::SyncGroupAssignment { member_id: m.clone(), assignment: a.clone() })
                        .collect(),
                };
                let op = &op;
                async move {
                    let r = self
                        .meta
                        .call(op, &address, wait_ms, |mut c| async move { c.sync_group(request).await })
                        .await?;
                    Error::from_wire(op, r.error)?;
                    Ok(r.assignment)
                }
            })
            .await?;
        Ok(r)
    }

    /// Heartbeat: one attempt (and a coordinator lookup when the last one
    /// moved), for a heartbeat loop to call every interval.
    ///
    /// # Errors
    /// `REBALANCE_IN_PROGRESS`, `ILLEGAL_GENERATION`, `UNKNOWN_MEMBER_ID`,
    /// `FENCED_INSTANCE_ID` as [`Error::Broker`]; transport errors.
    pub async fn heartbeat(&self, group: &str, member: &MemberRef) -> Result<()> {
        let op = Op::new("heartbeat in group", group);
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner()).get(group).cloned();
        let address = match known {
            Some(a) => a,
            None => self.find_coordinator_once(group).await?.address,
        };
        let request = pb::HeartbeatRequest {
            group_id: group.to_owned(),
            generation_id: member.generation,
            member_id: member.member_id.clone(),
            group_instance_id: member.instance_id.clone(),
        };
        let r = self.meta.call(&op, &address, 0, |mut c| async move { c.heartbeat(request).await }).await;
        let r = r.and_then(|r| Error::from_wire(&op, r.error));
        if let Err(e) = &r
            && e.is_retriable()
        {
            let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
            match e.leader_hint().filter(|_| e.code() == Some(ErrorCode::NotCoordinator)) {
                Some(h) => known.insert(group.to_owned(), h.address.clone()),
                None => known.remove(group),
            };
        }
        r
    }

    /// LeaveGroup: the group rebalances without the member.
    ///
    /// # Errors
    /// `UNKNOWN_MEMBER_ID`, `FENCED_INSTANCE_ID` as [`Error::Broker`].
    pub async fn leave(&self, group: &str, member: &MemberRef) -> Result<()> {
        let op = Op::new("leave group", group);
        self.on_coordinator("leave group", group, |address| {
            let request = pb::LeaveGroupRequest {
                group_id: group.to_owned(),
                member_id: member.member_id.clone(),
                group_instance_id: member.instance_id.clone(),
            };
            let op = &op;
            async move {
                let r = self
                    .meta
                    .call(op, &address, 0, |mut c| async move { c.leave_group(request).await })
                    .await?;
                Error::from_wire(op, r.error)
            }
        })
        .await
    }

    /// Every group of the cluster (Kafka's ListGroups asks every broker for
    /// the groups it coordinates), and the brokers that could not be asked:
    /// their groups are missing from the list.
    ///
    /// # Errors
    /// Metadata errors only.
    pub async fn list(&self) -> Result<(Vec<GroupListing>, Vec<(u32, Error)>)> {
        let cluster = self.meta.refresh().await?;
        let mut groups = Vec::new();
        let mut missing = Vec::new();
        for (id, b) in &cluster.brokers {
            let op = Op::new("list groups on broker", "");
            let answer = self
                .meta
                .retrying("list groups", Duration::from_secs(5).min(self.timeout), || async {
                    let r = self
                        .meta
                        .call(&op, &b.address, 0, |mut c| async move {
                            c.list_groups(pb::ListGroupsRequest {}).await
                        })
                        .await?;
                    Error::from_wire(&op, r.error)?;
                    Ok(r.groups)
                })
                .await;
            match answer {
                Ok(listed) => groups.extend(listed.into_iter().map(|g| GroupListing {
                    group: g.group_id,
                    state: g.state,
                    members: g.members,
                    coordinator: *id,
                })),
                Err(e) => missing.push((*id, e)),
            }
        }
        groups.sort_by(|a, b| a.group.cmp(&b.group));
        // A partition's leadership may have moved between two brokers'
        // answers: one group listed twice.
        groups.dedup_by(|a, b| a.group == b.group);
        Ok((groups, missing))
    }

    /// The offset `seek` names in `topic`'s `partition` (ListOffsets), for
    /// offset resets.
    ///
    /// # Errors
    /// As the consumer's offset lookups.
    pub async fn resolve(&self, topic: &str, partition: u32, seek: Seek) -> Result<u64> {
        let config = ConsumerConfig::default();
        list_offset(&self.meta, &config, topic, partition, seek, None).await.map(|(o, ..)| o)
    }
}

fn committed(c: pb::CommittedOffset) -> CommittedOffset {
    CommittedOffset {
        topic: c.topic,
        partition: c.partition,
        offset: c.offset,
        metadata: c.metadata,
        commit_timestamp_ms: c.commit_timestamp_ms,
    }
}

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
    /// Member ids.
    pub members: Vec<String>,
    /// Committed offsets, by topic and partition.
    pub offsets: Vec<CommittedOffset>,
    /// The broker that answered (its coordinator).
    pub coordinator: u32,
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
        let op = Op::new("find the coordinator of group", group);
        self.meta
            .retrying("find coordinator", self.timeout, || async {
                let address = self.meta.current().await?.answered_by.clone();
                let request = pb::FindCoordinatorRequest { group_id: group.to_owned() };
                let r = self
                    .meta
                    .call(&op, &address, 0, |mut c| async move { c.find_coordinator(request).await })
                    .await?;
                Error::from_wire(&op, r.error)?;
                Ok(CoordinatorInfo { broker: r.broker_id, address: r.address, partition: r.partition })
            })
            .await
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
                        None => self.find_coordinator(group).await?.address,
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
        let op = Op::new("commit offsets of group", group);
        let r = self
            .on_coordinator("commit offsets", group, |address| {
                let request = pb::OffsetCommitRequest {
                    group_id: group.to_owned(),
                    generation_id: -1,
                    member_id: String::new(),
                    offsets: offsets
                        .iter()
                        .map(|o| pb::OffsetCommitPartition {
                            topic: o.topic.clone(),
                            partition: o.partition,
                            offset: o.offset,
                            metadata: o.metadata.clone(),
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
        let mut by_partition: HashMap<(String, u32), Option<pb::Error>> =
            r.into_iter().map(|x| ((x.topic, x.partition), x.error)).collect();
        Ok(offsets
            .iter()
            .map(|o| {
                let op = Op::partition("commit offset of", &o.topic, o.partition);
                let outcome = match by_partition.remove(&(o.topic.clone(), o.partition)) {
                    Some(e) => Error::from_wire(&op, e),
                    None => Err(Error::Broker {
                        operation: op.describe(),
                        code: ErrorCode::InvalidRequest as i32,
                        message: "the coordinator's answer does not mention this partition".into(),
                        leader: None,
                    }),
                };
                (o.clone(), outcome)
            })
            .collect())
    }

    /// `group`'s committed offsets for `partitions` (topic, partition), or
    /// for every partition it has one for when empty.
    ///
    /// # Errors
    /// [`Error::Deadline`] while no coordinator answers.
    pub async fn committed(&self, group: &str, partitions: &[(String, u32)]) -> Result<Vec<CommittedOffset>> {
        let op = Op::new("fetch committed offsets of group", group);
        let r = self
            .on_coordinator("fetch committed offsets", group, |address| {
                let request = pb::OffsetFetchRequest {
                    group_id: group.to_owned(),
                    partitions: partitions
                        .iter()
                        .map(|(t, p)| pb::TopicPartition { topic: t.clone(), partition: *p })
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
            members: r.members.into_iter().map(|m| m.member_id).collect(),
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

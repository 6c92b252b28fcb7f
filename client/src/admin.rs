//! Administration: create, delete, list and describe topics; cluster status.
//!
//! Topic calls go to any broker (the broker forwards them to the
//! controller) and are retried on transient errors for `admin_timeout`.
//! Cluster status asks `Metadata` of one broker, then `PartitionStatus` of
//! each partition's leader, concurrently.

use std::sync::Arc;
use std::time::Duration;

use ferrolog_proto::client as pb;

use crate::error::{Error, ErrorCode, Op, Result};
use crate::metadata::{BrokerMeta, ClusterMeta, MetadataCache, TopicMeta};

/// Raft state of one partition as its leader reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionStatus {
    /// Leader broker id.
    pub leader: u32,
    /// Current Raft term.
    pub term: u64,
    /// Raft commit index.
    pub commit_index: u64,
    /// Index of the leader's last log entry.
    pub last_log_index: u64,
    /// Offset after the last committed record.
    pub high_watermark: u64,
    /// First retained offset.
    pub log_start_offset: u64,
    /// Each follower's replication progress.
    pub followers: Vec<FollowerStatus>,
}

/// A follower's replication progress: the leader's view, and the
/// follower's own broker's word on its replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowerStatus {
    /// The follower's broker id.
    pub broker_id: u32,
    /// Raft index the leader last knew replicated to it, if known.
    pub matched_index: Option<u64>,
    /// Entries its log is behind the leader's last log index, as its own
    /// broker reports its log; `None` when its replica is not running or
    /// its broker does not answer (never 0 for a replica that is down).
    pub lag: Option<u64>,
    /// Its replica's state, as its broker reports it.
    pub state: ReplicaHealth,
}

/// The state of one replica, as its broker reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaHealth {
    /// Its Raft group runs.
    Running,
    /// Its Raft group runs, but its log was found damaged: it neither votes
    /// nor leads until a leader has brought it back. Says what was damaged.
    Recovering(String),
    /// Its Raft group is not running (failed to start, or stopped on an
    /// error and waits to be restarted). The error.
    Failed(String),
    /// Its broker did not answer. The error.
    Unreachable(String),
}

impl std::fmt::Display for ReplicaHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplicaHealth::Running => f.write_str("running"),
            ReplicaHealth::Recovering(why) => write!(f, "recovering: {why}"),
            ReplicaHealth::Failed(why) => write!(f, "failed: {why}"),
            ReplicaHealth::Unreachable(why) => write!(f, "unreachable: {why}"),
        }
    }
}

/// One partition in a [`ClusterStatus`].
#[derive(Debug, Clone)]
pub struct PartitionReport {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// Replica broker ids.
    pub replicas: Vec<u32>,
    /// Leader per the metadata, 0 when unknown.
    pub leader: u32,
    /// The leader's answer, or why there is none.
    pub status: Result<PartitionStatus>,
}

/// Brokers, controller and every partition's Raft state.
#[derive(Debug, Clone)]
pub struct ClusterStatus {
    /// Brokers by id, as the answering broker sees them.
    pub brokers: Vec<BrokerMeta>,
    /// Controller broker id, 0 when unknown.
    pub controller: u32,
    /// The broker that answered `Metadata`.
    pub answered_by: String,
    /// Every partition of every topic, by topic then partition.
    pub partitions: Vec<PartitionReport>,
}

/// Creates, deletes and describes topics; reports cluster status.
#[derive(Debug, Clone)]
pub struct Admin {
    meta: Arc<MetadataCache>,
    timeout: Duration,
}

impl Admin {
    /// An admin client using `meta`; calls are retried for 30 s.
    pub fn new(meta: Arc<MetadataCache>) -> Self {
        Admin { meta, timeout: Duration::from_secs(30) }
    }

    /// Sets how long calls are retried on transient errors.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The metadata cache in use.
    pub fn metadata(&self) -> &Arc<MetadataCache> {
        &self.meta
    }

    /// Any broker's address: the last one that answered metadata, else the
    /// first bootstrap broker. Rotates through the others on failure
    /// because failures refresh metadata, which rotates.
    async fn any_broker(&self) -> Result<String> {
        let cluster = self.meta.current().await?;
        Ok(cluster.answered_by.clone())
    }

    /// Creates a topic with `partitions` partitions of `replication_factor`
    /// replicas each.
    ///
    /// # Errors
    /// `TOPIC_ALREADY_EXISTS`, `INVALID_REPLICATION_FACTOR`,
    /// `INVALID_REQUEST` as [`Error::Broker`]; transport errors after
    /// retrying. A retry after a lost answer may report
    /// `TOPIC_ALREADY_EXISTS` for a topic this call created.
    pub async fn create_topic(&self, name: &str, partitions: u32, replication_factor: u32) -> Result<()> {
        let op = Op::new("create topic", name);
        self.meta
            .retrying("create topic", self.timeout, || async {
                let address = self.any_broker().await?;
                let request =
                    pb::CreateTopicRequest { name: name.to_owned(), partitions, replication_factor };
                let r = self
                    .meta
                    .call(&op, &address, 0, |mut c| async move { c.create_topic(request).await })
                    .await?;
                Error::from_wire(&op, r.error)
            })
            .await
    }

    /// Waits until `name` exists and every partition has a leader, for at
    /// most `wait`. Use after [`Admin::create_topic`] before producing.
    ///
    /// # Errors
    /// [`Error::Deadline`] when it does not happen in time.
    pub async fn wait_for_leaders(&self, name: &str, wait: Duration) -> Result<TopicMeta> {
        let op = "wait for topic leaders";
        self.meta
            .retrying(op, wait, || async {
                let cluster = self.meta.refresh().await?;
                match cluster.topics.get(name) {
                    Some(t) if !t.partitions.is_empty() && t.partitions.iter().all(|p| p.leader != 0) => {
                        Ok(t.clone())
                    }
                    Some(_) => Err(unavailable(op, name, "not every partition has a leader yet")),
                    None => Err(unavailable(op, name, "the topic is not in the metadata yet")),
                }
            })
            .await
    }

    /// Deletes a topic and its data.
    ///
    /// # Errors
    /// `UNKNOWN_TOPIC` as [`Error::Broker`] when it does not exist;
    /// transport errors after retrying.
    pub async fn delete_topic(&self, name: &str) -> Result<()> {
        let op = Op::new("delete topic", name);
        let mut attempts = 0u32;
        self.meta
            .retrying("delete topic", self.timeout, || {
                attempts += 1;
                let first = attempts == 1;
                let op = &op;
                async move {
                    let address = self.any_broker().await?;
                    let request = pb::DeleteTopicRequest { name: name.to_owned() };
                    let r = self
                        .meta
                        .call(op, &address, 0, |mut c| async move { c.delete_topic(request).await })
                        .await?;
                    match Error::from_wire(op, r.error) {
                        // A retry after a lost answer finds the topic gone: that is success.
                        Err(e) if !first && e.code() == Some(ErrorCode::UnknownTopic) => Ok(()),
                        // UNKNOWN_TOPIC is retriable for data calls, not here.
                        Err(e) if e.code() == Some(ErrorCode::UnknownTopic) => {
                            Err(Error::UnknownTopic { topic: name.to_owned() })
                        }
                        other => other,
                    }
                }
            })
            .await
    }

    /// Every topic, by name, from fresh metadata.
    ///
    /// # Errors
    /// As [`MetadataCache::refresh`].
    pub async fn list_topics(&self) -> Result<Vec<TopicMeta>> {
        let cluster = self.fresh_metadata().await?;
        Ok(cluster.topics.values().cloned().collect())
    }

    /// One topic's partitions, leaders and replicas, from fresh metadata.
    ///
    /// # Errors
    /// [`Error::UnknownTopic`] when it does not exist.
    pub async fn describe_topic(&self, name: &str) -> Result<(TopicMeta, Arc<ClusterMeta>)> {
        let cluster = self.fresh_metadata().await?;
        match cluster.topics.get(name) {
            Some(t) => Ok((t.clone(), cluster.clone())),
            None => Err(Error::UnknownTopic { topic: name.to_owned() }),
        }
    }

    /// Fresh metadata, retried on transient errors.
    ///
    /// # Errors
    /// [`Error::Deadline`] when no broker answers in time.
    pub async fn fresh_metadata(&self) -> Result<Arc<ClusterMeta>> {
        self.meta.retrying("metadata", self.timeout, || self.meta.refresh()).await
    }

    /// Brokers, controller, and each partition's Raft state from its leader.
    /// A partition whose leader does not answer carries the error instead.
    ///
    /// # Errors
    /// Only when no broker answers `Metadata`.
    pub async fn cluster_status(&self) -> Result<ClusterStatus> {
        let cluster = self.fresh_metadata().await?;
        let mut tasks = tokio::task::JoinSet::new();
        for t in cluster.topics.values() {
            for p in &t.partitions {
                let meta = self.meta.clone();
                let (topic, partition, leader) = (t.name.clone(), p.partition, p.leader);
                let address = cluster.brokers.get(&leader).map(|b| b.address.clone());
                let replicas = p.replicas.clone();
                let follower_addresses: Vec<(u32, Option<String>)> = replicas
                    .iter()
                    .filter(|b| **b != leader)
                    .map(|b| (*b, cluster.brokers.get(b).map(|m| m.address.clone())))
                    .collect();
                tasks.spawn(async move {
                    let status = match address {
                        Some(a) => partition_status(&meta, &topic, partition, &a).await,
                        None => Err(unavailable("partition status of", &topic, "no leader known")),
                    };
                    let status = match status {
                        Ok(s) => {
                            Ok(with_follower_reports(&meta, &topic, partition, s, follower_addresses).await)
                        }
                        Err(e) => Err(e),
                    };
                    PartitionReport { topic, partition, replicas, leader, status }
                });
            }
        }
        let mut partitions = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(report) => partitions.push(report),
                Err(e) => return Err(Error::Protocol(format!("partition status task failed: {e}"))),
            }
        }
        partitions.sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
        Ok(ClusterStatus {
            brokers: cluster.brokers.values().cloned().collect(),
            controller: cluster.controller,
            answered_by: cluster.answered_by.clone(),
            partitions,
        })
    }
}

fn unavailable(operation: &str, topic: &str, message: &str) -> Error {
    Error::Broker {
        operation: format!("{operation} {topic}"),
        code: ErrorCode::Unavailable as i32,
        message: message.to_owned(),
        leader: None,
    }
}

/// Asks each follower's broker for its own replica (one after another:
/// partitions are asked concurrently) and
/// completes the leader's follower list with their states and lags.
async fn with_follower_reports(
    meta: &MetadataCache,
    topic: &str,
    partition: u32,
    mut status: PartitionStatus,
    followers: Vec<(u32, Option<String>)>,
) -> PartitionStatus {
    for (broker, address) in followers {
        let (state, last_log_index) = match address {
            Some(a) => own_replica(meta, topic, partition, &a).await,
            None => (ReplicaHealth::Unreachable("not a known broker".into()), None),
        };
        let lag = last_log_index.map(|l| status.last_log_index.saturating_sub(l));
        match status.followers.iter_mut().find(|f| f.broker_id == broker) {
            Some(f) => {
                f.state = state;
                f.lag = lag;
            }
            None => {
                status.followers.push(FollowerStatus { broker_id: broker, matched_index: None, lag, state })
            }
        }
    }
    status.followers.sort_by_key(|f| f.broker_id);
    status
}

/// The state of the replica hosted by the broker at `address`, and its last
/// log index when it runs.
async fn own_replica(
    meta: &MetadataCache,
    topic: &str,
    partition: u32,
    address: &str,
) -> (ReplicaHealth, Option<u64>) {
    let op = Op::partition("replica status of", topic, partition);
    let request = pb::PartitionStatusRequest { topic: topic.to_owned(), partition };
    let r = match meta.call(&op, address, 0, |mut c| async move { c.partition_status(request).await }).await {
        Ok(r) => r,
        Err(e) => return (ReplicaHealth::Unreachable(e.to_string()), None),
    };
    if let Err(e) = Error::from_wire(&op, r.error.clone()) {
        return (ReplicaHealth::Failed(e.to_string()), None);
    }
    match pb::ReplicaState::try_from(r.replica_state) {
        Ok(pb::ReplicaState::Running) => (ReplicaHealth::Running, Some(r.last_log_index)),
        Ok(pb::ReplicaState::Recovering) => {
            (ReplicaHealth::Recovering(r.replica_detail), Some(r.last_log_index))
        }
        Ok(pb::ReplicaState::Failed) => (ReplicaHealth::Failed(r.replica_detail), None),
        // A broker of an earlier version does not say: trust its log.
        _ => (ReplicaHealth::Running, Some(r.last_log_index)),
    }
}

async fn partition_status(
    meta: &MetadataCache,
    topic: &str,
    partition: u32,
    address: &str,
) -> Result<PartitionStatus> {
    let op = Op::partition("partition status of", topic, partition);
    let request = pb::PartitionStatusRequest { topic: topic.to_owned(), partition };
    let r = meta.call(&op, address, 0, |mut c| async move { c.partition_status(request).await }).await?;
    Error::from_wire(&op, r.error)?;
    if r.replica_state == pb::ReplicaState::Failed as i32 {
        return Err(unavailable(
            "partition status of",
            topic,
            &format!("the leader's replica failed: {}", r.replica_detail),
        ));
    }
    Ok(PartitionStatus {
        leader: r.leader,
        term: r.term,
        commit_index: r.commit_index,
        last_log_index: r.last_log_index,
        high_watermark: r.high_watermark,
        log_start_offset: r.log_start_offset,
        followers: r
            .followers
            .into_iter()
            .map(|f| FollowerStatus {
                broker_id: f.broker_id,
                matched_index: f.matched_index,
                // Filled in from the follower's own broker.
                lag: None,
                state: ReplicaHealth::Unreachable("not asked".into()),
            })
            .collect(),
    })
}

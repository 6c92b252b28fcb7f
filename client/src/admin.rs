//! Administration: create, delete, list and describe topics; cluster status.
//!
//! Topic calls go to any broker (the broker forwards them to the
//! controller) and are retried on transient errors for `admin_timeout`.
//! Cluster status asks `Metadata` of one broker, then `PartitionStatus` of
//! each partition's leader, concurrently.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ferrolog_proto::client as pb;
/// A topic configuration entry and its source, as `Admin::describe_topic_config` returns them.
pub use ferrolog_proto::client::{ConfigEntry, ConfigSource};

use crate::error::{Error, ErrorCode, Op, Result, Retry};
use crate::metadata::{BrokerMeta, ClusterMeta, MetadataCache, PartitionMeta, TopicMeta};

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
    /// Whether it is a Raft learner (a replica a reassignment adds, still
    /// catching up; it does not vote yet).
    pub learner: bool,
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

/// Whether `cluster` shows `c`'s partition moving to exactly `c`'s target.
fn moving_to(cluster: &ClusterMeta, c: &ReassignmentRequest) -> bool {
    let Some(p) =
        cluster.topics.get(&c.topic).and_then(|t| t.partitions.iter().find(|p| p.partition == c.partition))
    else {
        return false;
    };
    let target: Vec<u32> = p.replicas.iter().copied().filter(|b| !p.removing.contains(b)).collect();
    p.is_reassigning() && !p.reassignment_cancelled && c.replicas.as_ref() == Some(&target)
}

/// One partition's change in [`Admin::alter_partition_reassignments`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReassignmentRequest {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// The target brokers in order (the first is the preferred leader), or
    /// `None` to cancel the partition's reassignment.
    pub replicas: Option<Vec<u32>>,
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
    /// A reassignment under way: the brokers it adds and removes (both
    /// empty when none runs).
    pub adding: Vec<u32>,
    /// See `adding`.
    pub removing: Vec<u32>,
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
    /// Ids of the brokers the cluster consists of (the controller group's
    /// members, founded from `initial_cluster`, and every registered
    /// broker), sorted; empty when the answering broker does not know.
    pub cluster_brokers: Vec<u32>,
    /// Controller broker id, 0 when unknown.
    pub controller: u32,
    /// The broker that answered `Metadata`.
    pub answered_by: String,
    /// Every partition of every topic, by topic then partition.
    pub partitions: Vec<PartitionReport>,
    /// Per broker that answered: files it has open and its open-file limit
    /// (brokers that did not answer, or do not report it, are missing).
    pub open_files: BTreeMap<u32, (u64, u64)>,
    /// Per broker that answered: the partition replicas it hosts and how
    /// many of them are dormant (idle followers whose Raft node is stopped
    /// until their group's next message).
    pub replicas: BTreeMap<u32, (u64, u64)>,
    /// Per broker that answered and whose replica of the metadata group is
    /// not running: the error it stopped on and what its restart waits for
    /// (the broker restarts it by itself; meanwhile it misses metadata
    /// changes, such as topics created).
    pub metadata_failures: BTreeMap<u32, String>,
}

/// Whether the cluster can take topics of any replication factor up to its
/// size, as the broker that answered `Metadata` sees it: a controller is
/// known, and every broker of the cluster has registered with it and
/// answers pings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    /// A controller (metadata group leader) is known.
    pub controller_known: bool,
    /// Ids of the brokers the cluster consists of; empty when unknown.
    pub expected: Vec<u32>,
    /// Of those, the ones that have registered.
    pub registered: Vec<u32>,
    /// Of those, the ones that have not registered yet.
    pub unregistered: Vec<u32>,
    /// Registered brokers that do not answer the answering broker's pings.
    pub not_alive: Vec<u32>,
}

impl Readiness {
    /// Every broker registered and alive, and a controller known.
    pub fn is_ready(&self) -> bool {
        self.controller_known
            && !self.expected.is_empty()
            && self.unregistered.is_empty()
            && self.not_alive.is_empty()
    }

    /// One line for people: `yes (3 of 3 brokers registered and alive)` or
    /// what is missing.
    pub fn describe(&self) -> String {
        let ids = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
        let counts = format!("{} of {} brokers registered", self.registered.len(), self.expected.len());
        if self.is_ready() {
            return format!("yes ({counts} and alive)");
        }
        let mut why = Vec::new();
        if !self.controller_known {
            why.push("no controller known".to_owned());
        }
        if self.expected.is_empty() {
            why.push("the cluster's brokers are not known yet".to_owned());
        } else {
            why.push(counts);
        }
        if !self.unregistered.is_empty() {
            why.push(format!("not registered yet: {}", ids(&self.unregistered)));
        }
        if !self.not_alive.is_empty() {
            why.push(format!("not answering: {}", ids(&self.not_alive)));
        }
        format!("NO: {}", why.join("; "))
    }
}

impl ClusterStatus {
    /// Whether every broker of the cluster has registered and answers, and
    /// a controller is known (see [`Readiness`]).
    pub fn readiness(&self) -> Readiness {
        let registered_ids: Vec<u32> = self.brokers.iter().map(|b| b.id).collect();
        let (registered, unregistered) =
            self.cluster_brokers.iter().partition(|id| registered_ids.contains(id));
        Readiness {
            controller_known: self.controller != 0,
            expected: self.cluster_brokers.clone(),
            registered,
            unregistered,
            not_alive: self.brokers.iter().filter(|b| !b.alive).map(|b| b.id).collect(),
        }
    }
}

/// A partition move to wait for: topic, partition, and the replicas it
/// moves to (`None` for a cancellation, which goes back to where it began).
pub type AwaitedMove = (String, u32, Option<Vec<u32>>);

/// Whether `m` is done as `cluster` shows it: no reassignment of the
/// partition under way and, for a move with a target, the replicas are the
/// target. The second half matters because brokers apply the controller's
/// records each at its own pace: a broker that has not applied the start
/// yet shows the partition as if it had never moved. A partition the
/// metadata does not show is not done (the answering broker may not know
/// its topic yet).
pub fn move_done(cluster: &ClusterMeta, m: &AwaitedMove) -> bool {
    let (topic, partition, target) = m;
    let Some(p) =
        cluster.topics.get(topic).and_then(|t| t.partitions.iter().find(|x| x.partition == *partition))
    else {
        return false;
    };
    !p.is_reassigning() && target.as_ref().is_none_or(|t| p.replicas == *t)
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
    /// replicas each. Transient refusals are retried for the admin timeout
    /// ([`Admin::with_timeout`]): no controller yet, and too few brokers
    /// registered or answering while the cluster has enough (a cluster that
    /// has just started, a broker that is down).
    ///
    /// # Errors
    /// `TOPIC_ALREADY_EXISTS`, `INVALID_REPLICATION_FACTOR` (the cluster has
    /// fewer brokers than that), `INVALID_REQUEST` as [`Error::Broker`];
    /// [`Error::Deadline`] with the last refusal once the timeout has
    /// passed. A retry after a lost answer may report
    /// `TOPIC_ALREADY_EXISTS` for a topic this call created.
    pub async fn create_topic(&self, name: &str, partitions: u32, replication_factor: u32) -> Result<()> {
        self.create_topic_reporting(name, partitions, replication_factor, |_| {}).await
    }

    /// As [`Admin::create_topic`], calling `on_retry` with each transient
    /// refusal before it is retried (to tell a user what is awaited).
    ///
    /// # Errors
    /// As [`Admin::create_topic`].
    pub async fn create_topic_reporting(
        &self,
        name: &str,
        partitions: u32,
        replication_factor: u32,
        on_retry: impl FnMut(&Error) + Send,
    ) -> Result<()> {
        self.create_topic_with_config(name, partitions, replication_factor, &BTreeMap::new(), on_retry).await
    }

    /// As [`Admin::create_topic_reporting`], with configuration overrides
    /// (Kafka's topic-level keys: `retention.ms`, `cleanup.policy`, ...).
    ///
    /// # Errors
    /// As [`Admin::create_topic`]; `INVALID_CONFIG` (the message names the
    /// key) as [`Error::Broker`].
    pub async fn create_topic_with_config(
        &self,
        name: &str,
        partitions: u32,
        replication_factor: u32,
        config: &BTreeMap<String, String>,
        on_retry: impl FnMut(&Error) + Send,
    ) -> Result<()> {
        let op = Op::new("create topic", name);
        let on_retry = std::sync::Mutex::new(on_retry);
        self.meta
            .retrying("create topic", self.timeout, || async {
                let address = self.any_broker().await?;
                let request = pb::CreateTopicRequest {
                    name: name.to_owned(),
                    partitions,
                    replication_factor,
                    configs: config.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                };
                let r = self
                    .meta
                    .call(&op, &address, 0, |mut c| async move { c.create_topic(request).await })
                    .await
                    .and_then(|r| Error::from_wire(&op, r.error));
                if let Err(e) = &r
                    && e.retry() == Retry::Yes
                {
                    (on_retry.lock().unwrap_or_else(std::sync::PoisonError::into_inner))(e);
                }
                r
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

    /// Hands the leadership of `topic`/`partition` to broker `to`'s replica
    /// (`None`: the preferred replica, the first assigned; Kafka's preferred
    /// leader election), following the leader through `NOT_LEADER` for the
    /// admin timeout. Returns the new leader's broker id and Raft term.
    ///
    /// # Errors
    /// `ELECTION_NOT_NEEDED` (that replica leads already),
    /// `PREFERRED_LEADER_NOT_AVAILABLE` (its broker is down or shutting
    /// down, or its log stayed behind; the leadership did not move, or moved
    /// to another replica as the message says), `INVALID_REQUEST` (no
    /// voting replica on that broker), `UNKNOWN_TOPIC`, as [`Error::Broker`].
    pub async fn transfer_leader(&self, topic: &str, partition: u32, to: Option<u32>) -> Result<(u32, u64)> {
        let op = Op::partition("transfer leadership of", topic, partition);
        let meta = &self.meta;
        meta.retrying("transfer leadership", self.timeout, || async {
            let address = meta.leader_address(topic, partition).await?;
            let request =
                pb::TransferLeaderRequest { topic: topic.to_owned(), partition, to_broker: to.unwrap_or(0) };
            // The leader answers once the leadership has moved (up to 10 s).
            let r = meta
                .call(&op, &address, 10_000, |mut c| async move { c.transfer_leader(request).await })
                .await;
            let r = r.and_then(|r| Error::from_wire(&op, r.error).map(|()| (r.leader, r.term)));
            if let Err(e) = &r {
                meta.note_failure(topic, partition, e);
            }
            r
        })
        .await
    }

    /// Starts or cancels partition reassignments (KIP-455): each entry
    /// moves a partition to `replicas` (in order, the first becoming its
    /// preferred leader), or with `replicas: None` cancels its
    /// reassignment. Returns once the controller has committed each
    /// change, with each partition's own result in request order; the moves
    /// themselves continue in the cluster (see [`PartitionMeta::adding`]
    /// and [`Admin::wait_for_reassignments`]).
    ///
    /// Partitions answered `UNAVAILABLE` (no controller yet, a controller
    /// that failed over) and a call that fails in transport are retried
    /// until the admin timeout. A retried change that finds its own earlier
    /// attempt committed (`REASSIGNMENT_IN_PROGRESS` with the same target,
    /// or `NO_REASSIGNMENT_IN_PROGRESS` for a cancel) counts as done.
    ///
    /// # Errors
    /// The whole call: no broker answered within the timeout, or the
    /// broker refused the request (`INVALID_REQUEST`). Per partition:
    /// `REASSIGNMENT_IN_PROGRESS`, `NO_REASSIGNMENT_IN_PROGRESS`,
    /// `INVALID_REPLICA_ASSIGNMENT`, `UNKNOWN_TOPIC`, and `UNAVAILABLE`
    /// once the timeout has passed, as [`Error::Broker`].
    ///
    /// [`PartitionMeta::adding`]: crate::metadata::PartitionMeta::adding
    pub async fn alter_partition_reassignments(
        &self,
        changes: &[ReassignmentRequest],
    ) -> Result<Vec<Result<()>>> {
        let what = format!("{} partitions", changes.len());
        let op = Op::new("alter partition reassignments", &what);
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut results: Vec<Option<Result<()>>> = vec![None; changes.len()];
        let mut sent = vec![false; changes.len()];
        loop {
            let pending: Vec<usize> = (0..changes.len()).filter(|i| results[*i].is_none()).collect();
            let request = pb::AlterPartitionReassignmentsRequest {
                partitions: pending
                    .iter()
                    .map(|i| {
                        let c = &changes[*i];
                        pb::ReassignablePartition {
                            topic: c.topic.clone(),
                            partition: c.partition,
                            replicas: c.replicas.clone().unwrap_or_default(),
                            cancel: c.replicas.is_none(),
                        }
                    })
                    .collect(),
            };
            // The controller commits up to 1,000 moves per metadata entry,
            // but a controller older than peer protocol 1.6 commits one per
            // partition (20–40 ms each here): a big request is given the
            // time that needs, not the default.
            let extra_ms = 100 * request.partitions.len() as u64;
            let answered = match self.any_broker().await {
                Ok(address) => {
                    self.meta
                        .call(&op, &address, extra_ms, |mut c| async move {
                            c.alter_partition_reassignments(request).await
                        })
                        .await
                }
                Err(e) => Err(e),
            };
            let late = tokio::time::Instant::now() >= deadline;
            let r = match answered {
                Ok(r) => r,
                Err(e) if late || e.retry() != Retry::Yes => return Err(e),
                Err(_) => {
                    let _ = self.meta.refresh().await;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            Error::from_wire(&op, r.error)?;
            let mut cluster: Option<Arc<ClusterMeta>> = None;
            for i in pending {
                let c = &changes[i];
                let answer = r.results.iter().find(|x| x.topic == c.topic && x.partition == c.partition);
                let pop = Op::partition("reassign", &c.topic, c.partition);
                let outcome = match answer {
                    Some(a) => Error::from_wire(&pop, a.error.clone()),
                    None => Err(unavailable("reassign", &c.topic, "the broker did not answer for it")),
                };
                let retried = sent[i];
                sent[i] = true;
                let code = outcome.as_ref().err().and_then(Error::code);
                let done = match code {
                    None => Some(Ok(())),
                    Some(ErrorCode::Unavailable) if !late => None,
                    Some(ErrorCode::ReassignmentInProgress) if retried => {
                        // The controller has a move of it: ours if its
                        // target is ours. The broker answering metadata
                        // may not show it yet (each applies the
                        // controller's records at its own pace): ask again
                        // for up to 5 s while it shows none.
                        let shows_move = |m: &ClusterMeta| {
                            m.topics
                                .get(&c.topic)
                                .and_then(|t| t.partitions.iter().find(|p| p.partition == c.partition))
                                .is_some_and(PartitionMeta::is_reassigning)
                        };
                        let until = tokio::time::Instant::now() + Duration::from_secs(5);
                        while cluster.as_ref().is_none_or(|m| !shows_move(m))
                            && tokio::time::Instant::now() < until
                        {
                            if cluster.is_some() {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                            cluster = self.fresh_metadata().await.ok();
                        }
                        let ours = cluster.as_ref().is_some_and(|m| moving_to(m, c));
                        Some(if ours { Ok(()) } else { outcome })
                    }
                    Some(ErrorCode::NoReassignmentInProgress) if retried && c.replicas.is_none() => {
                        Some(Ok(()))
                    }
                    Some(_) => Some(outcome),
                };
                results[i] = done;
            }
            if results.iter().all(Option::is_some) {
                return Ok(results.into_iter().map(|r| r.unwrap_or(Ok(()))).collect());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until every one of `moves` is done ([`move_done`]), reading
    /// fresh metadata every 200 ms and calling `progress` with the metadata
    /// each time.
    ///
    /// # Errors
    /// [`Error::Deadline`] after `wait`; metadata errors.
    pub async fn wait_for_reassignments(
        &self,
        moves: &[AwaitedMove],
        wait: Duration,
        mut progress: impl FnMut(&ClusterMeta),
    ) -> Result<()> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let cluster = self.fresh_metadata().await?;
            progress(&cluster);
            let running = moves.iter().any(|m| !move_done(&cluster, m));
            if !running {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Deadline {
                    operation: format!("waiting for the reassignment of {} partitions", moves.len()),
                    timeout_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                    last: None,
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Retires broker `id`, which must hold no replica any more: it is never
    /// placed on again and leaves the controller quorum.
    ///
    /// # Errors
    /// `INVALID_REQUEST` (it still holds replicas, is unknown, or is the
    /// last broker), as [`Error::Broker`]; [`Error::Deadline`].
    pub async fn decommission_broker(&self, id: u32) -> Result<()> {
        let what = id.to_string();
        let op = Op::new("decommission broker", &what);
        self.meta
            .retrying("decommission broker", self.timeout, || {
                let op = &op;
                async move {
                    let address = self.any_broker().await?;
                    let request = pb::DecommissionBrokerRequest { broker_id: id };
                    let r = self
                        .meta
                        .call(op, &address, 0, |mut c| async move { c.decommission_broker(request).await })
                        .await?;
                    Error::from_wire(op, r.error)
                }
            })
            .await
    }

    /// Makes broker `id` a controller voter (Kafka's AddRaftVoter,
    /// KIP-853). Returns once the controller committed the new quorum; the
    /// voters change after the broker's metadata replica caught up (see
    /// [`ClusterMeta::controller_voters`](crate::metadata::ClusterMeta)).
    ///
    /// # Errors
    /// `INVALID_REQUEST` (unknown or decommissioned broker),
    /// `UNAVAILABLE` (it does not answer, or too few voters do), as
    /// [`Error::Broker`]; [`Error::Deadline`].
    pub async fn add_raft_voter(&self, id: u32) -> Result<()> {
        self.change_raft_voter(id, true).await
    }

    /// Takes broker `id` out of the controller voters (Kafka's
    /// RemoveRaftVoter, KIP-853); it stays a broker.
    ///
    /// # Errors
    /// As [`Admin::add_raft_voter`]; also `INVALID_REQUEST` when it is the
    /// only voter.
    pub async fn remove_raft_voter(&self, id: u32) -> Result<()> {
        self.change_raft_voter(id, false).await
    }

    async fn change_raft_voter(&self, id: u32, add: bool) -> Result<()> {
        let what = id.to_string();
        let name = if add { "add controller voter" } else { "remove controller voter" };
        let op = Op::new(name, &what);
        self.meta
            .retrying(name, self.timeout, || {
                let op = &op;
                async move {
                    let address = self.any_broker().await?;
                    let error = if add {
                        let request = pb::AddRaftVoterRequest { broker_id: id };
                        self.meta
                            .call(op, &address, 0, |mut c| async move { c.add_raft_voter(request).await })
                            .await?
                            .error
                    } else {
                        let request = pb::RemoveRaftVoterRequest { broker_id: id };
                        self.meta
                            .call(op, &address, 0, |mut c| async move { c.remove_raft_voter(request).await })
                            .await?
                            .error
                    };
                    Error::from_wire(op, error)
                }
            })
            .await
    }

    /// Grows topic `name` to `count` partitions (Kafka's CreatePartitions,
    /// KIP-195). Records with a key may map to another partition from then
    /// on. Retried like [`Admin::create_topic`]; a retry that finds its own
    /// earlier attempt done (`INVALID_PARTITIONS` with the topic at `count`)
    /// succeeds.
    ///
    /// # Errors
    /// `INVALID_PARTITIONS` (not more than it has, or over the limit),
    /// `UNKNOWN_TOPIC`, as [`Error::Broker`]; [`Error::Deadline`].
    pub async fn create_partitions(&self, name: &str, count: u32) -> Result<()> {
        let op = Op::new("add partitions to", name);
        let mut attempts = 0u32;
        self.meta
            .retrying("add partitions", self.timeout, || {
                attempts += 1;
                let first = attempts == 1;
                let op = &op;
                async move {
                    let address = self.any_broker().await?;
                    let request = pb::CreatePartitionsRequest { topic: name.to_owned(), count };
                    let r = self
                        .meta
                        .call(op, &address, 0, |mut c| async move { c.create_partitions(request).await })
                        .await?;
                    match Error::from_wire(op, r.error) {
                        Err(e) if !first && e.code() == Some(ErrorCode::InvalidPartitions) => {
                            let cluster = self.fresh_metadata().await?;
                            let now = cluster.topics.get(name).map_or(0, |t| t.partitions.len() as u32);
                            if now == count { Ok(()) } else { Err(e) }
                        }
                        Err(e) if e.code() == Some(ErrorCode::UnknownTopic) => {
                            Err(Error::UnknownTopic { topic: name.to_owned() })
                        }
                        other => other,
                    }
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

    /// Sets and deletes configuration overrides of topic `name` (Kafka's
    /// IncrementalAlterConfigs, KIP-339); answered once the controller has
    /// committed the change. Setting a value a topic has already is a no-op.
    ///
    /// # Errors
    /// `INVALID_CONFIG` (names the key), as [`Error::Broker`];
    /// [`Error::UnknownTopic`]; [`Error::Deadline`].
    pub async fn alter_topic_config(
        &self,
        name: &str,
        set: &BTreeMap<String, String>,
        delete: &[String],
    ) -> Result<()> {
        let op = Op::new("alter config of", name);
        self.meta
            .retrying("alter topic config", self.timeout, || {
                let op = &op;
                async move {
                    let address = self.any_broker().await?;
                    let request = pb::AlterTopicConfigRequest {
                        topic: name.to_owned(),
                        set: set.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                        delete: delete.to_vec(),
                    };
                    let r = self
                        .meta
                        .call(op, &address, 0, |mut c| async move { c.alter_topic_config(request).await })
                        .await?;
                    match Error::from_wire(op, r.error) {
                        Err(e) if e.code() == Some(ErrorCode::UnknownTopic) => {
                            Err(Error::UnknownTopic { topic: name.to_owned() })
                        }
                        other => other,
                    }
                }
            })
            .await
    }

    /// The effective configuration of topic `name` as the answering broker
    /// has it: every key, its value and its source.
    ///
    /// # Errors
    /// [`Error::UnknownTopic`]; [`Error::Deadline`].
    pub async fn describe_topic_config(&self, name: &str) -> Result<Vec<ConfigEntry>> {
        let op = Op::new("describe config of", name);
        self.meta
            .retrying("describe topic config", self.timeout, || {
                let op = &op;
                async move {
                    let address = self.any_broker().await?;
                    let request = pb::DescribeTopicConfigRequest { topic: name.to_owned() };
                    let r = self
                        .meta
                        .call(op, &address, 0, |mut c| async move { c.describe_topic_config(request).await })
                        .await?;
                    match Error::from_wire(op, r.error) {
                        Ok(()) => Ok(r.entries),
                        Err(e) if e.code() == Some(ErrorCode::UnknownTopic) => {
                            Err(Error::UnknownTopic { topic: name.to_owned() })
                        }
                        Err(e) => Err(e),
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

    /// One partition's Raft state from its leader, with each other
    /// replica's state from its own broker, and its reassignment if any.
    ///
    /// # Errors
    /// `UNKNOWN_TOPIC` when the metadata has no such partition; metadata
    /// errors. The leader's own failure is in the report's `status`.
    pub async fn describe_partition(&self, topic: &str, partition: u32) -> Result<PartitionReport> {
        let cluster = self.fresh_metadata().await?;
        let p = cluster
            .topics
            .get(topic)
            .and_then(|t| t.partitions.iter().find(|p| p.partition == partition))
            .cloned()
            .ok_or_else(|| Error::UnknownTopic { topic: format!("{topic}-{partition}") })?;
        Ok(partition_report(self.meta.clone(), cluster, topic.to_owned(), p).await)
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
                tasks.spawn(partition_report(self.meta.clone(), cluster.clone(), t.name.clone(), p.clone()));
            }
        }
        let mut files = tokio::task::JoinSet::new();
        for b in cluster.brokers.values().filter(|b| b.alive) {
            let (meta, id, address) = (self.meta.clone(), b.id, b.address.clone());
            files.spawn(async move { (id, own_entry(&meta, id, &address).await) });
        }
        let mut partitions = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(report) => partitions.push(report),
                Err(e) => return Err(Error::Protocol(format!("partition status task failed: {e}"))),
            }
        }
        partitions.sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
        let (mut open_files, mut replicas, mut metadata_failures) =
            (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        while let Some(joined) = files.join_next().await {
            if let Ok((id, Some(b))) = joined {
                open_files.insert(id, (b.open_files, b.open_files_limit));
                replicas.insert(id, (b.replicas, b.dormant_replicas));
                if !b.metadata_replica_failure.is_empty() {
                    metadata_failures.insert(id, b.metadata_replica_failure);
                }
            }
        }
        Ok(ClusterStatus {
            brokers: cluster.brokers.values().cloned().collect(),
            cluster_brokers: cluster.cluster_brokers.clone(),
            controller: cluster.controller,
            answered_by: cluster.answered_by.clone(),
            partitions,
            open_files,
            replicas,
            metadata_failures,
        })
    }
}

/// What broker `id` at `address` reports of itself in its `Metadata`
/// answer (open files and their limit, replicas hosted and dormant); `None`
/// if it does not answer or report.
async fn own_entry(meta: &MetadataCache, id: u32, address: &str) -> Option<pb::BrokerInfo> {
    let op = Op::new("metadata", "");
    let r =
        meta.call(&op, address, 0, |mut c| async move {
            c.metadata(pb::MetadataRequest { topics: vec![] }).await
        })
        .await
        .ok()?;
    r.brokers.iter().find(|b| b.id == id && b.open_files_limit > 0).cloned()
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
            None => status.followers.push(FollowerStatus {
                broker_id: broker,
                matched_index: None,
                lag,
                state,
                learner: false,
            }),
        }
    }
    status.followers.sort_by_key(|f| f.broker_id);
    status
}

/// One partition's report: its leader's Raft state, and each other
/// replica's own broker's word on it.
async fn partition_report(
    meta: Arc<MetadataCache>,
    cluster: Arc<ClusterMeta>,
    topic: String,
    p: PartitionMeta,
) -> PartitionReport {
    let (partition, leader) = (p.partition, p.leader);
    let address = cluster.brokers.get(&leader).map(|b| b.address.clone());
    let follower_addresses: Vec<(u32, Option<String>)> = p
        .replicas
        .iter()
        .filter(|b| **b != leader)
        .map(|b| (*b, cluster.brokers.get(b).map(|m| m.address.clone())))
        .collect();
    let status = match address {
        Some(a) => partition_status(&meta, &topic, partition, &a).await,
        None => Err(unavailable("partition status of", &topic, "no leader known")),
    };
    let status = match status {
        Ok(s) => Ok(with_follower_reports(&meta, &topic, partition, s, follower_addresses).await),
        Err(e) => Err(e),
    };
    PartitionReport {
        topic,
        partition,
        replicas: p.replicas,
        adding: p.adding,
        removing: p.removing,
        leader,
        status,
    }
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
                learner: f.learner,
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(cluster: &[u32], brokers: &[(u32, bool)], controller: u32) -> ClusterStatus {
        ClusterStatus {
            brokers: brokers
                .iter()
                .map(|(id, alive)| BrokerMeta {
                    id: *id,
                    address: format!("a{id}"),
                    peer_address: format!("p{id}"),
                    alive: *alive,
                    decommissioned: false,
                })
                .collect(),
            cluster_brokers: cluster.to_vec(),
            open_files: BTreeMap::new(),
            replicas: BTreeMap::new(),
            metadata_failures: BTreeMap::new(),
            controller,
            answered_by: "a1".into(),
            partitions: vec![],
        }
    }

    #[test]
    fn readiness_needs_every_broker_registered_and_alive() {
        let r = status(&[1, 2, 3], &[(1, true), (2, true), (3, true)], 1).readiness();
        assert!(r.is_ready());
        assert_eq!(r.describe(), "yes (3 of 3 brokers registered and alive)");

        let r = status(&[1, 2, 3], &[(1, true), (2, true)], 1).readiness();
        assert!(!r.is_ready());
        assert_eq!(r.unregistered, vec![3]);
        assert_eq!(r.describe(), "NO: 2 of 3 brokers registered; not registered yet: 3");

        let r = status(&[1, 2, 3], &[(1, true), (2, false), (3, true)], 0).readiness();
        assert_eq!(r.describe(), "NO: no controller known; 3 of 3 brokers registered; not answering: 2");

        // A broker that does not report the cluster's brokers: unknown, not ready.
        let r = status(&[], &[(1, true)], 1).readiness();
        assert!(!r.is_ready());
        assert!(r.describe().contains("not known"), "{}", r.describe());
    }
}

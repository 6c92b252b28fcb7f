//! The metadata cache: brokers, topics and partition leaders, refreshed from
//! any broker with the `Metadata` RPC, and one gRPC channel per broker
//! address.
//!
//! The cache is an immutable [`ClusterMeta`] snapshot behind a lock, replaced
//! whole on refresh (copy-on-write for `NOT_LEADER` hints), so readers never
//! hold the lock across an await. Channels are created lazily
//! ([`tonic::transport::Endpoint::connect_lazy`]): nothing connects until a
//! call is made, and a channel reconnects by itself after its broker
//! restarts.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrolog_proto::TopicId;
use ferrolog_proto::client as pb;
use ferrolog_proto::client::ferrolog_client::FerrologClient;
use tonic::transport::{Channel, Endpoint};

use crate::error::{Error, ErrorCode, LeaderHint, Op, Result, Retry};
use crate::retry::Backoff;

/// Settings shared by every client built on one [`MetadataCache`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Brokers to ask for metadata first, `host:port` (any broker will do;
    /// the rest of the cluster is learned from its answer).
    pub bootstrap: Vec<String>,
    /// Longest wait to open a TCP connection, ms.
    pub connect_timeout_ms: u64,
    /// Longest wait for an answer to one request, ms (Kafka's
    /// `request.timeout.ms`, 30 s). Fetches wait their long-poll time on top.
    pub request_timeout_ms: u64,
    /// Refresh metadata at least this often even without errors, ms
    /// (Kafka's `metadata.max.age.ms`, 5 min).
    pub metadata_max_age_ms: u64,
    /// Backoff between retries.
    pub backoff: Backoff,
    /// Largest gRPC message sent or received, bytes. Must exceed the
    /// broker's `limits.max_fetch_bytes` (16 MiB by default).
    pub max_message_bytes: usize,
}

impl ClientConfig {
    /// Defaults with these bootstrap brokers.
    pub fn new<S: Into<String>>(bootstrap: impl IntoIterator<Item = S>) -> Self {
        ClientConfig {
            bootstrap: bootstrap.into_iter().map(Into::into).collect(),
            connect_timeout_ms: 5_000,
            request_timeout_ms: 30_000,
            metadata_max_age_ms: 300_000,
            backoff: Backoff::default(),
            max_message_bytes: 64 << 20,
        }
    }

    /// Defaults with a comma-separated bootstrap list, `host:port,host:port`.
    pub fn from_list(list: &str) -> Self {
        Self::new(list.split(',').map(str::trim).filter(|s| !s.is_empty()))
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad setting.
    pub fn validate(&self) -> Result<()> {
        if self.bootstrap.is_empty() {
            return Err(Error::Config("no bootstrap broker given".into()));
        }
        if self.request_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return Err(Error::Config("request_timeout_ms and connect_timeout_ms must be > 0".into()));
        }
        if self.max_message_bytes < 1 << 20 {
            return Err(Error::Config("max_message_bytes must be at least 1 MiB".into()));
        }
        Ok(())
    }
}

/// A broker as the metadata describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerMeta {
    /// Broker id (≥ 1).
    pub id: u32,
    /// Client API address, `host:port`.
    pub address: String,
    /// Broker-to-broker address, `host:port`.
    pub peer_address: String,
    /// Alive as seen by the broker that answered.
    pub alive: bool,
    /// Decommissioned: holds nothing and is never placed on again.
    pub decommissioned: bool,
}

/// A partition as the metadata describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionMeta {
    /// Partition number.
    pub partition: u32,
    /// The partition's Raft group id.
    pub group_id: u64,
    /// Leader's broker id, 0 when no leader is known.
    pub leader: u32,
    /// Broker ids of the replicas, the preferred leader first. During a
    /// reassignment: the target's, then those being removed.
    pub replicas: Vec<u32>,
    /// Brokers whose replicas a reassignment under way adds (KIP-455).
    pub adding: Vec<u32>,
    /// Brokers whose replicas a reassignment under way removes.
    pub removing: Vec<u32>,
    /// Whether the reassignment under way was cancelled (it goes back to
    /// the replicas it started from).
    pub reassignment_cancelled: bool,
    /// Whether a reassignment of this partition is under way (one that only
    /// reorders the replicas adds and removes none).
    pub reassigning: bool,
}

impl PartitionMeta {
    /// Whether a reassignment of this partition is under way.
    pub fn is_reassigning(&self) -> bool {
        self.reassigning || !self.adding.is_empty() || !self.removing.is_empty()
    }
}

/// A topic as the metadata describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicMeta {
    /// Topic name.
    pub name: String,
    /// The topic's id (KIP-516): differs between a topic and one deleted
    /// and re-created under its name. `None` from a broker without topic
    /// ids (or one that sent a malformed id).
    pub topic_id: Option<TopicId>,
    /// Partitions, sorted by number.
    pub partitions: Vec<PartitionMeta>,
    /// Replicas per partition.
    pub replication_factor: u32,
}

impl TopicMeta {
    /// Number of partitions.
    pub fn partition_count(&self) -> u32 {
        self.partitions.len() as u32
    }
}

/// One answer to `Metadata`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterMeta {
    /// Brokers by id.
    pub brokers: BTreeMap<u32, BrokerMeta>,
    /// Topics by name.
    pub topics: BTreeMap<String, TopicMeta>,
    /// Controller (metadata group leader) broker id, 0 when unknown.
    pub controller: u32,
    /// Address of the broker that answered.
    pub answered_by: String,
    /// Ids of the brokers the cluster consists of (the controller group's
    /// members and every registered broker), sorted; one missing from
    /// `brokers` has not registered yet. Empty when the answering broker
    /// does not know.
    pub cluster_brokers: Vec<u32>,
    /// The brokers in the controller quorum (the metadata group's voters),
    /// sorted; empty from a broker that does not say.
    pub controller_voters: Vec<u32>,
    /// The size limits of the broker that answered.
    pub limits: BrokerLimits,
}

/// A broker's size limits, as its `Metadata` answer states them (the
/// producer refuses a record over them before sending it, with the
/// broker's own wording).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BrokerLimits {
    /// `limits.max_record_bytes`: largest key + value + headers of one
    /// record, bytes; `None` when the broker does not say.
    pub max_record_bytes: Option<usize>,
    /// `limits.max_batch_bytes`: largest sum of key + value + headers of one
    /// produce request's records, bytes; `None` when the broker does not say.
    pub max_batch_bytes: Option<usize>,
}

impl ClusterMeta {
    fn from_wire(answered_by: &str, r: pb::MetadataResponse) -> Self {
        let brokers = r
            .brokers
            .into_iter()
            .map(|b| {
                (
                    b.id,
                    BrokerMeta {
                        id: b.id,
                        address: b.address,
                        peer_address: b.peer_address,
                        alive: b.alive,
                        decommissioned: b.decommissioned,
                    },
                )
            })
            .collect();
        let topics = r
            .topics
            .into_iter()
            .map(|t| {
                let mut partitions: Vec<PartitionMeta> = t
                    .partitions
                    .into_iter()
                    .map(|p| PartitionMeta {
                        partition: p.partition,
                        group_id: p.group_id,
                        leader: p.leader,
                        replicas: p.replicas,
                        adding: p.adding_replicas,
                        removing: p.removing_replicas,
                        reassignment_cancelled: p.reassignment_cancelled,
                        reassigning: p.reassigning,
                    })
                    .collect();
                partitions.sort_by_key(|p| p.partition);
                let topic_id = TopicId::from_wire(&t.topic_id).ok().flatten();
                (
                    t.name.clone(),
                    TopicMeta {
                        name: t.name,
                        topic_id,
                        partitions,
                        replication_factor: t.replication_factor,
                    },
                )
            })
            .collect();
        let limit = |n: u64| usize::try_from(n).ok().filter(|n| *n > 0);
        let limits = BrokerLimits {
            max_record_bytes: limit(r.max_record_bytes),
            max_batch_bytes: limit(r.max_batch_bytes),
        };
        let mut controller_voters = r.controller_voters;
        controller_voters.sort_unstable();
        let mut cluster_brokers = r.cluster_brokers;
        cluster_brokers.sort_unstable();
        cluster_brokers.dedup();
        ClusterMeta {
            brokers,
            topics,
            controller: r.controller,
            answered_by: answered_by.to_owned(),
            limits,
            cluster_brokers,
            controller_voters,
        }
    }

    /// The leader of a partition: broker id and client address, when known.
    pub fn leader(&self, topic: &str, partition: u32) -> Option<(u32, String)> {
        let t = self.topics.get(topic)?;
        let p = t.partitions.iter().find(|p| p.partition == partition)?;
        let b = self.brokers.get(&p.leader)?;
        Some((b.id, b.address.clone()))
    }
}

struct State {
    cluster: Arc<ClusterMeta>,
    /// Incremented by every refresh and hint, so waiting refreshers can see
    /// that someone else already refreshed.
    generation: u64,
    refreshed_at: Option<Instant>,
    channels: HashMap<String, Channel>,
    /// Where the next refresh starts in its list of candidates: the broker
    /// after the one that answered last, so one with a stale view (a leader
    /// cut off from its followers) is not the only one asked.
    rotation: usize,
    /// Addresses whose metadata request failed, and when: tried last for
    /// [`FAILED_BROKER_LAST_MS`], so a dead or hung broker does not cost
    /// every refresh a timeout.
    failed: HashMap<String, Instant>,
}

/// Longest wait for one broker's Metadata answer, ms (at most the request
/// timeout). A broker answers it from memory; one that does not within this
/// is stopped or overloaded (a paused process still accepts connections),
/// and the next broker is asked.
pub const METADATA_TIMEOUT_MS: u64 = 2_000;

/// How long a broker whose metadata request failed is asked last, ms.
pub const FAILED_BROKER_LAST_MS: u64 = 10_000;

/// Cached cluster metadata and gRPC channels, shared by every client of one
/// application (wrap it in an [`Arc`]).
pub struct MetadataCache {
    config: ClientConfig,
    state: Mutex<State>,
    refresh_lock: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for MetadataCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataCache").field("bootstrap", &self.config.bootstrap).finish_non_exhaustive()
    }
}

/// Strips an `http://` scheme, so both spellings name one channel.
fn normalize(address: &str) -> &str {
    address.strip_prefix("http://").unwrap_or(address)
}

impl MetadataCache {
    /// A cache that has not asked anyone yet.
    ///
    /// # Errors
    /// [`Error::Config`] for bad settings.
    pub fn new(config: ClientConfig) -> Result<Arc<Self>> {
        config.validate()?;
        Ok(Arc::new(MetadataCache {
            config,
            state: Mutex::new(State {
                cluster: Arc::new(ClusterMeta::default()),
                generation: 0,
                refreshed_at: None,
                channels: HashMap::new(),
                rotation: 0,
                failed: HashMap::new(),
            }),
            refresh_lock: tokio::sync::Mutex::new(()),
        }))
    }

    /// The settings.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock leaves consistent data behind
        // (every update is a single assignment), so poisoning is ignored.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The current snapshot (possibly empty, possibly stale).
    pub fn snapshot(&self) -> Arc<ClusterMeta> {
        self.lock().cluster.clone()
    }

    /// A client for the broker at `address` (`host:port`), on a channel
    /// shared with every other caller and connected on first use.
    ///
    /// # Errors
    /// [`Error::InvalidAddress`] when `address` is not a valid URI authority.
    pub fn client(&self, address: &str) -> Result<FerrologClient<Channel>> {
        let address = normalize(address);
        let mut state = self.lock();
        let channel = match state.channels.get(address) {
            Some(c) => c.clone(),
            None => {
                let endpoint = Endpoint::from_shared(format!("http://{address}"))
                    .map_err(|e| Error::InvalidAddress {
                        address: address.to_owned(),
                        message: e.to_string(),
                    })?
                    .connect_timeout(Duration::from_millis(self.config.connect_timeout_ms))
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(30))
                    .keep_alive_timeout(Duration::from_secs(20));
                let channel = endpoint.connect_lazy();
                state.channels.insert(address.to_owned(), channel.clone());
                channel
            }
        };
        Ok(FerrologClient::new(channel)
            .max_decoding_message_size(self.config.max_message_bytes)
            .max_encoding_message_size(self.config.max_message_bytes))
    }

    /// Runs one RPC against `address` with the request timeout plus
    /// `extra_wait_ms` (a long poll's wait), mapping transport failures.
    pub(crate) async fn call<T, F, Fut>(
        &self,
        op: &Op<'_>,
        address: &str,
        extra_wait_ms: u64,
        f: F,
    ) -> Result<T>
    where
        F: FnOnce(FerrologClient<Channel>) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        self.call_within(op, address, self.config.request_timeout_ms + extra_wait_ms, f).await
    }

    /// As [`MetadataCache::call`], with a timeout of `timeout_ms`.
    pub(crate) async fn call_within<T, F, Fut>(
        &self,
        op: &Op<'_>,
        address: &str,
        timeout_ms: u64,
        f: F,
    ) -> Result<T>
    where
        F: FnOnce(FerrologClient<Channel>) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let client = self.client(address)?;
        match tokio::time::timeout(Duration::from_millis(timeout_ms), f(client)).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(Error::transport(op, address, status)),
            Err(_) => {
                Err(Error::Timeout { operation: op.describe(), address: address.to_owned(), timeout_ms })
            }
        }
    }

    /// Asks brokers for metadata (every topic) until one answers: the
    /// brokers already known first, then the bootstrap list, starting at a
    /// rotating position, brokers that failed lately last. Concurrent
    /// callers share one refresh.
    ///
    /// # Errors
    /// [`Error::NoBrokerReachable`] with the last failure when no broker
    /// answered without error.
    pub async fn refresh(&self) -> Result<Arc<ClusterMeta>> {
        let seen = self.lock().generation;
        let _one_at_a_time = self.refresh_lock.lock().await;
        let (candidates, start) = {
            let state = self.lock();
            if state.generation != seen && state.refreshed_at.is_some() {
                return Ok(state.cluster.clone());
            }
            let mut candidates: Vec<String> = Vec::new();
            let known = state.cluster.brokers.values().filter(|b| b.alive).map(|b| b.address.clone());
            for a in known.chain(self.config.bootstrap.iter().map(|a| normalize(a).to_owned())) {
                if !candidates.contains(&a) {
                    candidates.push(a);
                }
            }
            let n = candidates.len().max(1);
            candidates.rotate_left(state.rotation % n);
            let failed_lately = |a: &String| {
                state
                    .failed
                    .get(a)
                    .is_some_and(|t| t.elapsed() < Duration::from_millis(FAILED_BROKER_LAST_MS))
            };
            // Stable: the rotation order within each group is kept.
            candidates.sort_by_key(failed_lately);
            (candidates, state.rotation)
        };
        let op = Op::new("metadata", "");
        let mut last = None;
        for address in &candidates {
            let within = METADATA_TIMEOUT_MS.min(self.config.request_timeout_ms);
            let answer = self
                .call_within(&op, address, within, |mut c| async move {
                    c.metadata(pb::MetadataRequest { topics: vec![] }).await
                })
                .await
                .and_then(|r| Error::from_wire(&op, r.error.clone()).map(|()| r));
            match answer {
                Ok(r) => {
                    let cluster = Arc::new(ClusterMeta::from_wire(address, r));
                    let mut state = self.lock();
                    state.cluster = cluster.clone();
                    state.generation += 1;
                    state.refreshed_at = Some(Instant::now());
                    state.rotation = start.wrapping_add(1);
                    state.failed.remove(address);
                    return Ok(cluster);
                }
                Err(e) => {
                    tracing::debug!(broker = %address, error = %e, "metadata request failed");
                    self.lock().failed.insert(address.clone(), Instant::now());
                    last = Some(e);
                }
            }
        }
        self.lock().rotation = start.wrapping_add(1);
        Err(Error::NoBrokerReachable {
            tried: candidates.join(","),
            last: Box::new(last.unwrap_or_else(|| Error::Config("no broker address known".into()))),
        })
    }

    /// The snapshot, refreshed first if it was never fetched or is older
    /// than `metadata_max_age_ms`.
    ///
    /// # Errors
    /// As [`MetadataCache::refresh`].
    pub async fn current(&self) -> Result<Arc<ClusterMeta>> {
        let stale = {
            let state = self.lock();
            state
                .refreshed_at
                .is_none_or(|t| t.elapsed() > Duration::from_millis(self.config.metadata_max_age_ms))
        };
        if stale { self.refresh().await } else { Ok(self.snapshot()) }
    }

    /// Records a `NOT_LEADER` answer's hint: `hint` now leads `topic/partition`.
    pub fn apply_leader_hint(&self, topic: &str, partition: u32, hint: &LeaderHint) {
        let mut state = self.lock();
        let cluster = Arc::make_mut(&mut state.cluster);
        cluster.brokers.entry(hint.broker_id).or_insert_with(|| BrokerMeta {
            id: hint.broker_id,
            address: hint.address.clone(),
            peer_address: String::new(),
            alive: true,
            decommissioned: false,
        });
        if let Some(t) = cluster.topics.get_mut(topic)
            && let Some(p) = t.partitions.iter_mut().find(|p| p.partition == partition)
        {
            p.leader = hint.broker_id;
        }
        state.generation += 1;
    }

    /// Forgets the leader of `topic/partition` (after it failed to answer as
    /// leader), so the next lookup refreshes.
    pub fn forget_leader(&self, topic: &str, partition: u32) {
        let mut state = self.lock();
        let cluster = Arc::make_mut(&mut state.cluster);
        if let Some(p) = cluster
            .topics
            .get_mut(topic)
            .and_then(|t| t.partitions.iter_mut().find(|p| p.partition == partition))
        {
            p.leader = 0;
        }
    }

    /// The partition's leader address, refreshing metadata once if it is
    /// not known.
    ///
    /// # Errors
    /// `UNKNOWN_TOPIC` / `UNAVAILABLE` (both retriable) when the topic or
    /// its leader is not (yet) known, or a failed refresh.
    pub async fn leader_address(&self, topic: &str, partition: u32) -> Result<String> {
        if let Some((_, address)) = self.snapshot().leader(topic, partition) {
            return Ok(address);
        }
        let cluster = self.refresh().await?;
        if let Some((_, address)) = cluster.leader(topic, partition) {
            return Ok(address);
        }
        let (code, message) = if cluster.topics.contains_key(topic) {
            (ErrorCode::Unavailable, "no leader known for the partition")
        } else {
            (ErrorCode::UnknownTopic, "the topic is not in the cluster metadata")
        };
        Err(Error::Broker {
            operation: Op::partition("find leader of", topic, partition).describe(),
            code: code as i32,
            message: message.into(),
            leader: None,
        })
    }

    /// Reacts to a failed partition request: applies a leader hint, or
    /// forgets the leader when the error suggests the metadata is stale.
    pub(crate) fn note_failure(&self, topic: &str, partition: u32, error: &Error) {
        if let Some(hint) = error.leader_hint() {
            self.apply_leader_hint(topic, partition, hint);
        } else if error.needs_metadata_refresh() {
            self.forget_leader(topic, partition);
        }
    }

    /// Waits until `topic` appears in the metadata, refreshing with backoff,
    /// for at most `wait`.
    ///
    /// # Errors
    /// [`Error::UnknownTopic`] when it does not appear in time; the refresh
    /// error when no broker answered at all.
    pub async fn topic(&self, topic: &str, wait: Duration) -> Result<TopicMeta> {
        if let Some(t) = self.snapshot().topics.get(topic) {
            return Ok(t.clone());
        }
        let deadline = Instant::now() + wait;
        let mut attempt = 0;
        loop {
            let refreshed = self.refresh().await;
            match &refreshed {
                Ok(c) => {
                    if let Some(t) = c.topics.get(topic) {
                        return Ok(t.clone());
                    }
                }
                Err(e) => tracing::debug!(error = %e, "metadata refresh failed"),
            }
            let delay = self.config.backoff.delay(attempt).max(Duration::from_millis(100));
            if Instant::now() + delay > deadline {
                return match refreshed {
                    Ok(_) => Err(Error::UnknownTopic { topic: topic.to_owned() }),
                    Err(e) => Err(e),
                };
            }
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// Runs `f` until it succeeds, fails permanently, or `timeout` passes,
    /// refreshing metadata and backing off between attempts.
    ///
    /// # Errors
    /// The permanent error, or [`Error::Deadline`] with the last retriable one.
    pub(crate) async fn retrying<T, F, Fut>(&self, operation: &str, timeout: Duration, mut f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let deadline = Instant::now() + timeout;
        let mut attempt = 0;
        loop {
            let e = match f().await {
                Ok(v) => return Ok(v),
                Err(e) if e.retry() != Retry::Yes => return Err(e),
                Err(e) => e,
            };
            let delay = self.config.backoff.delay(attempt);
            if Instant::now() + delay >= deadline {
                return Err(Error::Deadline {
                    operation: operation.to_owned(),
                    timeout_ms: timeout.as_millis() as u64,
                    last: Some(Box::new(e)),
                });
            }
            tracing::debug!(operation, error = %e, attempt, "retrying");
            tokio::time::sleep(delay).await;
            if e.needs_metadata_refresh()
                && e.leader_hint().is_none()
                && let Err(e) = self.refresh().await
            {
                tracing::debug!(error = %e, "metadata refresh failed");
            }
            attempt += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> pb::MetadataResponse {
        pb::MetadataResponse {
            error: None,
            brokers: vec![
                pb::BrokerInfo {
                    id: 1,
                    address: "127.0.0.1:9401".into(),
                    peer_address: "p1".into(),
                    alive: true,
                    ..Default::default()
                },
                pb::BrokerInfo {
                    id: 2,
                    address: "127.0.0.1:9402".into(),
                    peer_address: "p2".into(),
                    alive: true,
                    ..Default::default()
                },
            ],
            topics: vec![pb::TopicInfo {
                name: "t".into(),
                partitions: vec![
                    pb::PartitionInfo {
                        partition: 1,
                        group_id: 11,
                        leader: 0,
                        replicas: vec![1, 2],
                        ..pb::PartitionInfo::default()
                    },
                    pb::PartitionInfo {
                        partition: 0,
                        group_id: 10,
                        leader: 2,
                        replicas: vec![1, 2],
                        ..pb::PartitionInfo::default()
                    },
                ],
                replication_factor: 2,
                topic_id: TopicId(77).to_wire(),
            }],
            controller: 1,
            max_record_bytes: 1000,
            max_batch_bytes: 0,
            cluster_brokers: vec![2, 1],
            controller_voters: vec![],
        }
    }

    #[test]
    fn decodes_and_finds_leaders() {
        let c = ClusterMeta::from_wire("127.0.0.1:9401", sample());
        assert_eq!(c.topics["t"].partitions[0].partition, 0, "sorted by partition");
        assert_eq!(c.topics["t"].topic_id, Some(TopicId(77)));
        assert_eq!(c.leader("t", 0), Some((2, "127.0.0.1:9402".into())));
        assert_eq!(c.leader("t", 1), None, "leader 0 is none");
        assert_eq!(c.leader("t", 9), None);
        assert_eq!(c.leader("u", 0), None);
        assert_eq!(c.limits, BrokerLimits { max_record_bytes: Some(1000), max_batch_bytes: None });
        assert_eq!(c.cluster_brokers, vec![1, 2], "sorted");
    }

    #[test]
    fn hints_update_the_snapshot() {
        let cache = MetadataCache::new(ClientConfig::from_list("127.0.0.1:9401")).expect("cache");
        cache.lock().cluster = Arc::new(ClusterMeta::from_wire("x", sample()));
        cache.apply_leader_hint("t", 1, &LeaderHint { broker_id: 3, address: "127.0.0.1:9403".into() });
        assert_eq!(cache.snapshot().leader("t", 1), Some((3, "127.0.0.1:9403".into())));
        cache.forget_leader("t", 0);
        assert_eq!(cache.snapshot().leader("t", 0), None);
    }

    #[test]
    fn bootstrap_list_parsing_and_validation() {
        let c = ClientConfig::from_list(" a:1, ,b:2,");
        assert_eq!(c.bootstrap, vec!["a:1", "b:2"]);
        assert!(ClientConfig::from_list("").validate().is_err());
    }

    #[tokio::test]
    async fn channels_are_lazy_and_shared() {
        let cache = MetadataCache::new(ClientConfig::from_list("127.0.0.1:1")).expect("cache");
        cache.client("127.0.0.1:1").expect("lazy channel");
        cache.client("http://127.0.0.1:1").expect("same channel");
        assert_eq!(cache.lock().channels.len(), 1);
        assert!(matches!(cache.client("bad address with spaces"), Err(Error::InvalidAddress { .. })));
    }
}

//! Broker configuration: one TOML file, overridden by environment variables
//! (`FERROLOG_*`) and command-line flags, checked by [`BrokerConfig::validate`].
//!
//! The commented template is `deploy/broker.toml`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use ferrolog_raft_store::StoreConfig;
use serde::{Deserialize, Serialize};

/// A broker's id, unique in the cluster; also its Raft node id in the
/// metadata (controller) group. 1-based; 0 means "none" on the wire.
pub type BrokerId = u32;

/// Everything a broker needs to start. Units are in the field names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BrokerConfig {
    /// This broker's id (≥ 1). 0 (the default) only with [`BrokerConfig::join`]:
    /// the cluster assigns the next free id when the broker first joins,
    /// and the data directory keeps it (`crate::identity`).
    pub node_id: BrokerId,
    /// Address the client API listens on, `host:port`.
    pub client_addr: SocketAddr,
    /// Address the Kafka listener listens on, `host:port` (Kafka's
    /// `listeners`; clients are told it as given, so a wildcard address
    /// will not do). Only with `kafka.enabled`.
    pub kafka_addr: SocketAddr,
    /// The Kafka listener (`crate::kafka`).
    pub kafka: KafkaConfig,
    /// Address the broker-to-broker Raft transport listens on, `host:port`.
    /// Stored in Raft memberships: keep it stable across restarts.
    pub peer_addr: SocketAddr,
    /// Where partitions and the metadata log live.
    pub data_dir: PathBuf,
    /// The controller's founding voters, broker id → peer address; used
    /// only when the data directory is new (like etcd's `initial-cluster`).
    pub initial_cluster: BTreeMap<BrokerId, SocketAddr>,
    /// Peer addresses of brokers of a running cluster, for a broker that is
    /// not one of its founders: a new data directory registers through any
    /// of them (getting a broker id if `node_id` is 0) and follows the
    /// metadata as a learner of the controller's group; `ferrolog
    /// controller add` can make it a voter. Excludes `initial_cluster`.
    pub join: Vec<SocketAddr>,
    /// Peer address → address to dial instead, for peers reached through a
    /// proxy or NAT (the fault-injecting proxy of `ferrolog-jepsen`, for
    /// one). A peer not listed is dialled at its own address. Memberships
    /// keep the peer's own address; only this broker's connections change.
    pub peer_routes: BTreeMap<SocketAddr, SocketAddr>,
    /// Raft timings shared by every group on this broker.
    pub raft: RaftTimings,
    /// Storage of every partition replica on this broker.
    pub storage: StoreConfig,
    /// Size and connection limits.
    pub limits: Limits,
    /// What a broker does when asked to stop.
    pub shutdown: ShutdownConfig,
    /// Moving leaderships back to preferred replicas.
    pub balance: BalanceConfig,
    /// Partition reassignment.
    pub reassignment: ReassignmentConfig,
    /// Retention checks.
    pub retention: RetentionConfig,
    /// Log compaction.
    pub compaction: CompactionConfig,
    /// The background scrub of sealed segments.
    pub scrub: ScrubConfig,
    /// Idempotent producer state.
    pub producers: ProducersConfig,
    /// Consumer groups (`crate::coordinator`).
    pub groups: GroupsConfig,
    /// Defaults for topic configuration keys, by Kafka's topic-level names
    /// (`"retention.ms" = "604800000"`; the broker-level `log.*` settings of
    /// Kafka): what a topic without its own override gets on this broker.
    /// `segment.bytes`, `segment.ms` and `max.message.bytes` come from
    /// `storage` and `limits` instead. Keep them the same on every broker.
    /// Checked like a topic's overrides (`crate::metadata::topic_config`).
    pub topic_defaults: BTreeMap<String, String>,
}

/// Retention (`crate::control::retention`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// How often partition leaders check their topics' `retention.ms` and
    /// `retention.bytes`, ms (Kafka's `log.retention.check.interval.ms`,
    /// 300,000).
    pub check_interval_ms: u64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self { check_interval_ms: 300_000 }
    }
}

/// Log compaction (`crate::control::compaction`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompactionConfig {
    /// How often partition leaders check their compacted topics and every
    /// replica compacts to its target, ms (Kafka's `log.cleaner.backoff.ms`,
    /// 15,000).
    pub check_interval_ms: u64,
    /// Bytes per second one compaction pass reads at most; 0: no limit
    /// (Kafka's `log.cleaner.io.max.bytes.per.second`, unlimited by default).
    pub io_max_bytes_per_second: u64,
    /// Bytes the key map of one compaction pass holds at most (each key's
    /// bytes plus 64); more distinct keys are compacted in chunks (Kafka's
    /// `log.cleaner.dedupe.buffer.size`, 128 MiB).
    pub dedupe_buffer_bytes: u64,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        Self { check_interval_ms: 15_000, io_max_bytes_per_second: 0, dedupe_buffer_bytes: 128 << 20 }
    }
}

/// The background scrub (`crate::control::scrub`): every replica's
/// committed entries read back and their checksums verified now and then, so
/// bit rot in data nobody reads is found, and repaired from a healthy
/// replica, while the other replicas still hold good copies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScrubConfig {
    /// ms from the end of one pass over every hosted replica to the start
    /// of the next (the first starts this long after the broker starts, at
    /// most 5 minutes); 0 turns the scrub off. Default 1 day (86,400,000),
    /// as storage systems scrub daily to weekly (Ceph's
    /// `osd_scrub_max_interval` is 7 days).
    pub interval_ms: u64,
    /// Bytes per second a pass reads at most (0: no limit). Default 8 MiB/s:
    /// 1 TB takes about 36 hours, and the disk is left to producers and
    /// consumers.
    pub io_max_bytes_per_second: u64,
}

impl Default for ScrubConfig {
    fn default() -> Self {
        Self { interval_ms: 86_400_000, io_max_bytes_per_second: 8 << 20 }
    }
}

/// Idempotent producer state (`crate::control::producer_expiry`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProducersConfig {
    /// ms without a write after which a producer id's state is dropped from
    /// every replica (Kafka's `producer.id.expiration.ms`, 86,400,000: 1 day).
    pub id_expiration_ms: u64,
    /// How often partition leaders look for idle producer ids, ms (Kafka's
    /// `producer.id.expiration.check.interval.ms`, 600,000).
    pub id_expiration_check_interval_ms: u64,
}

impl Default for ProducersConfig {
    fn default() -> Self {
        Self { id_expiration_ms: 86_400_000, id_expiration_check_interval_ms: 600_000 }
    }
}

/// Consumer groups and their committed offsets (`crate::coordinator`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GroupsConfig {
    /// Partitions of `__consumer_offsets` when it is created (Kafka's
    /// `offsets.topic.num.partitions`, 50). Read once: a group's partition
    /// is its id's hash modulo the topic's count, which never changes.
    pub offsets_topic_num_partitions: u32,
    /// Its replication factor (Kafka's `offsets.topic.replication.factor`,
    /// 3): group calls answer `COORDINATOR_NOT_AVAILABLE` until that many
    /// brokers have registered (a smaller cluster sets it lower).
    pub offsets_topic_replication_factor: u32,
    /// Longest metadata string of a commit, bytes (Kafka's
    /// `offset.metadata.max.bytes`, 4,096).
    pub offset_metadata_max_bytes: usize,
    /// Shortest session timeout a member may ask for, ms (Kafka's
    /// `group.min.session.timeout.ms`, 6,000).
    pub min_session_timeout_ms: u64,
    /// Longest, ms (Kafka's `group.max.session.timeout.ms`, 1,800,000).
    pub max_session_timeout_ms: u64,
    /// How long the first rebalance of an empty group waits for more
    /// members, ms (Kafka's `group.initial.rebalance.delay.ms`, 3,000).
    pub initial_rebalance_delay_ms: u64,
    /// How long an empty group keeps its committed offsets, minutes
    /// (Kafka's `offsets.retention.minutes`, 10,080: 7 days; KIP-211).
    pub offsets_retention_minutes: u64,
    /// How often coordinators look for expired offsets, and for offsets of
    /// deleted topics, ms (Kafka's `offsets.retention.check.interval.ms`,
    /// 600,000).
    pub offsets_retention_check_interval_ms: u64,
}

impl Default for GroupsConfig {
    fn default() -> Self {
        Self {
            offsets_topic_num_partitions: 50,
            offsets_topic_replication_factor: 3,
            offset_metadata_max_bytes: 4096,
            min_session_timeout_ms: 6_000,
            max_session_timeout_ms: 1_800_000,
            initial_rebalance_delay_ms: 3_000,
            offsets_retention_minutes: 10_080,
            offsets_retention_check_interval_ms: 600_000,
        }
    }
}

/// Partition reassignment (`crate::control::membership`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReassignmentConfig {
    /// Bytes per second this broker sends in all to replicas that
    /// reassignments are adding (log entries and snapshot chunks while they
    /// catch up; Kafka's `leader.replication.throttled.rate`, KIP-73); 0:
    /// no limit. Traffic to other replicas is never held back. The default,
    /// 32 MiB/s, is about a third of what one broker of this design
    /// replicates at 1 KiB records on a small machine, leaving the rest to
    /// producers.
    pub replication_throttled_rate: u64,
}

impl Default for ReassignmentConfig {
    fn default() -> Self {
        Self { replication_throttled_rate: 32 << 20 }
    }
}

/// Preferred-leader balancing (`crate::control::balance`), with Kafka's
/// settings and defaults.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BalanceConfig {
    /// Move leaderships back to preferred replicas when a broker's share
    /// of them falls too low (Kafka's `auto.leader.rebalance.enable`).
    pub auto_leader_rebalance_enable: bool,
    /// A broker is out of balance when more than this percentage of the
    /// partitions whose preferred replica it holds are led elsewhere
    /// (Kafka's `leader.imbalance.per.broker.percentage`), 0–100.
    pub leader_imbalance_per_broker_percentage: u32,
    /// How often the balance is checked, ms (Kafka's
    /// `leader.imbalance.check.interval.seconds`, 300 s).
    pub leader_imbalance_check_interval_ms: u64,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        Self {
            auto_leader_rebalance_enable: true,
            leader_imbalance_per_broker_percentage: 10,
            leader_imbalance_check_interval_ms: 300_000,
        }
    }
}

/// What a broker does when asked to stop (SIGTERM or SIGINT).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    /// Hand every leadership over to a caught-up follower before stopping
    /// (Kafka's `controlled.shutdown.enable`), so a rolling restart costs
    /// no election timeouts; see `crate::control::handover`.
    pub controlled_shutdown_enable: bool,
    /// Longest the hand-overs may take, ms; what is not handed over by then
    /// elects a new leader after a timeout once the broker is gone, as
    /// after a crash. A second signal cuts it short.
    pub controlled_shutdown_timeout_ms: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self { controlled_shutdown_enable: true, controlled_shutdown_timeout_ms: 30_000 }
    }
}

/// Raft timing settings (Raft paper §5.2, §9.3), milliseconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RaftTimings {
    /// A leader's heartbeat period, ms.
    pub heartbeat_interval_ms: u64,
    /// Lower bound of the randomized election timeout, ms.
    pub election_timeout_min_ms: u64,
    /// Upper bound of the randomized election timeout, ms.
    pub election_timeout_max_ms: u64,
    /// Build a partition snapshot after this many applied entries.
    pub snapshot_after_entries: u64,
    /// A partition's follower replica that has been idle this long, ms,
    /// while its leader's broker says it leads, stops its Raft node's tasks
    /// (it goes dormant) until the group's next message
    /// (`crate::control::dormant`); 0: never.
    pub dormant_after_ms: u64,
}

impl Default for RaftTimings {
    fn default() -> Self {
        Self {
            heartbeat_interval_ms: 100,
            election_timeout_min_ms: 500,
            election_timeout_max_ms: 1000,
            snapshot_after_entries: 100_000,
            dormant_after_ms: 10_000,
        }
    }
}

/// The Kafka listener (`crate::kafka`): framing and connection limits,
/// by Kafka's names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaConfig {
    /// Whether the broker listens for Kafka clients on `kafka_addr`.
    pub enabled: bool,
    /// Largest request frame, bytes (Kafka's `socket.request.max.bytes`,
    /// 100 MiB): a larger size prefix closes the connection, with a log
    /// line, before any of it is read.
    pub socket_request_max_bytes: usize,
    /// A connection with no request for this long is closed, ms (Kafka's
    /// `connections.max.idle.ms`, 10 minutes).
    pub connections_max_idle_ms: u64,
    /// Most Kafka connections open at once; past that a new connection is
    /// closed at once (Kafka's `max.connections`).
    pub max_connections: usize,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            socket_request_max_bytes: 100 << 20,
            connections_max_idle_ms: 600_000,
            max_connections: 1024,
        }
    }
}

/// Limits on what clients may send and receive.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest record: key + value + each header's key and value, bytes
    /// (Kafka's `message.max.bytes`). At most `max_batch_bytes`.
    pub max_record_bytes: usize,
    /// Largest produce batch: the sum of its records' key + value + headers
    /// (the quantity `max_record_bytes` counts), bytes. Its encoding may
    /// take up to 2 × this + 64 KiB.
    pub max_batch_bytes: usize,
    /// Largest fetch response, bytes; a request asking for more gets this.
    pub max_fetch_bytes: usize,
    /// Longest a fetch may wait for new records, ms.
    pub max_fetch_wait_ms: u64,
    /// Most concurrent client connections.
    pub max_connections: usize,
    /// Most partitions of one topic.
    pub max_partitions_per_topic: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_record_bytes: 1 << 20,
            max_batch_bytes: 1 << 20,
            max_fetch_bytes: 16 << 20,
            max_fetch_wait_ms: 30_000,
            max_connections: 1024,
            max_partitions_per_topic: 10_000,
        }
    }
}

impl Default for BrokerConfig {
    fn default() -> Self {
        Self {
            node_id: 0,
            client_addr: SocketAddr::from(([127, 0, 0, 1], 9401)),
            kafka_addr: SocketAddr::from(([127, 0, 0, 1], 9092)),
            kafka: KafkaConfig::default(),
            peer_addr: SocketAddr::from(([127, 0, 0, 1], 9501)),
            data_dir: PathBuf::from("./ferrolog-data/broker-1"),
            initial_cluster: BTreeMap::new(),
            join: Vec::new(),
            peer_routes: BTreeMap::new(),
            raft: RaftTimings::default(),
            storage: StoreConfig::default(),
            limits: Limits::default(),
            shutdown: ShutdownConfig::default(),
            balance: BalanceConfig::default(),
            reassignment: ReassignmentConfig::default(),
            retention: RetentionConfig::default(),
            compaction: CompactionConfig::default(),
            scrub: ScrubConfig::default(),
            producers: ProducersConfig::default(),
            groups: GroupsConfig::default(),
            topic_defaults: BTreeMap::new(),
        }
    }
}

/// A configuration that cannot work, naming the field and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid broker config: {0}")]
pub struct ConfigError(pub String);

impl BrokerConfig {
    /// Parses a TOML document.
    ///
    /// # Errors
    /// [`ConfigError`] with the parser's message (line and column).
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError(e.to_string()))
    }

    /// Renders the configuration as TOML.
    ///
    /// # Errors
    /// [`ConfigError`] if a value cannot be represented.
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        toml::to_string(self).map_err(|e| ConfigError(e.to_string()))
    }

    /// This broker's defaults for topic configuration keys.
    ///
    /// # Errors
    /// [`ConfigError`] naming a bad key or value of `topic_defaults`.
    pub fn topic_defaults(&self) -> Result<crate::metadata::topic_config::TopicDefaults, ConfigError> {
        crate::metadata::topic_config::TopicDefaults::from_broker(
            &self.topic_defaults,
            self.storage.segment_bytes,
            self.storage.segment_ms,
            self.limits.max_batch_bytes,
        )
        .map_err(ConfigError)
    }

    /// Checks that the configuration can work.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError(m));
        self.topic_defaults()?;
        if self.retention.check_interval_ms == 0 {
            return bad("retention.check_interval_ms must be ≥ 1".into());
        }
        if self.compaction.check_interval_ms == 0 {
            return bad("compaction.check_interval_ms must be ≥ 1".into());
        }
        if self.compaction.dedupe_buffer_bytes < 1 << 20 {
            return bad("compaction.dedupe_buffer_bytes must be ≥ 1 MiB".into());
        }
        if self.groups.offsets_topic_num_partitions == 0 || self.groups.offsets_topic_replication_factor == 0
        {
            return bad(
                "groups.offsets_topic_num_partitions and groups.offsets_topic_replication_factor must be ≥ 1"
                    .into(),
            );
        }
        let g = &self.groups;
        if g.offsets_retention_check_interval_ms == 0 || g.offsets_retention_minutes == 0 {
            return bad(
                "groups.offsets_retention_minutes and groups.offsets_retention_check_interval_ms must be ≥ 1"
                    .into(),
            );
        }
        if g.initial_rebalance_delay_ms > 86_400_000 {
            return bad(format!(
                "groups.initial_rebalance_delay_ms ({}) must be at most a day (86400000)",
                g.initial_rebalance_delay_ms
            ));
        }
        if g.min_session_timeout_ms == 0
            || g.min_session_timeout_ms > g.max_session_timeout_ms
            || g.max_session_timeout_ms > i32::MAX as u64
        {
            return bad(format!(
                "groups.min_session_timeout_ms ({}) must be ≥ 1 and ≤ groups.max_session_timeout_ms ({}), \
                 itself below 2^31",
                g.min_session_timeout_ms, g.max_session_timeout_ms
            ));
        }
        if self.producers.id_expiration_check_interval_ms == 0 {
            return bad("producers.id_expiration_check_interval_ms must be ≥ 1".into());
        }
        if self.producers.id_expiration_ms <= self.producers.id_expiration_check_interval_ms
            || i64::try_from(self.producers.id_expiration_ms).is_err()
        {
            return bad(
                "producers.id_expiration_ms must be above producers.id_expiration_check_interval_ms and below 2^63"
                    .into(),
            );
        }
        if u64::from(self.node_id) >= crate::metadata::image::FIRST_NODE_ID {
            return bad(format!(
                "node_id is {}: broker ids are below {} (the Raft node ids above are handed out by the controller)",
                self.node_id,
                crate::metadata::image::FIRST_NODE_ID
            ));
        }
        if self.node_id == 0 && self.join.is_empty() {
            return bad("node_id must be ≥ 1 (0 only with join: the cluster then assigns one)".into());
        }
        if !self.join.is_empty() && !self.initial_cluster.is_empty() {
            return bad(
                "join and initial_cluster are both set: a founding broker gives initial_cluster, one that \
                 joins a running cluster gives join"
                    .into(),
            );
        }
        if self.join.contains(&self.peer_addr) {
            return bad(format!("join lists this broker's own peer_addr {}", self.peer_addr));
        }
        if self.balance.leader_imbalance_per_broker_percentage > 100 {
            return bad(format!(
                "balance.leader_imbalance_per_broker_percentage is {}: at most 100",
                self.balance.leader_imbalance_per_broker_percentage
            ));
        }
        if self.balance.leader_imbalance_check_interval_ms == 0 {
            return bad("balance.leader_imbalance_check_interval_ms must be ≥ 1".into());
        }
        if self.client_addr == self.peer_addr {
            return bad(format!("client_addr and peer_addr are both {}", self.client_addr));
        }
        if self.kafka.enabled && (self.kafka_addr == self.client_addr || self.kafka_addr == self.peer_addr) {
            return bad(format!("kafka_addr {} is also the client or peer address", self.kafka_addr));
        }
        if self.kafka.enabled && self.kafka_addr.ip().is_unspecified() {
            return bad(format!(
                "kafka_addr {} is a wildcard address: Kafka clients are told this address to connect to",
                self.kafka_addr
            ));
        }
        if self.kafka.socket_request_max_bytes < 1024 || self.kafka.max_connections == 0 {
            return bad("kafka.socket_request_max_bytes must be ≥ 1024 and kafka.max_connections ≥ 1".into());
        }
        if self.data_dir.as_os_str().is_empty() {
            return bad("data_dir is empty".into());
        }
        if self.initial_cluster.contains_key(&0) {
            return bad("initial_cluster: broker id 0 is reserved".into());
        }
        if !self.initial_cluster.is_empty() {
            match self.initial_cluster.get(&self.node_id) {
                None => {
                    return bad(format!(
                        "initial_cluster does not list this broker (node_id {})",
                        self.node_id
                    ));
                }
                Some(a) if *a != self.peer_addr => {
                    return bad(format!(
                        "initial_cluster gives broker {} the peer address {a}, but peer_addr is {}",
                        self.node_id, self.peer_addr
                    ));
                }
                Some(_) => {}
            }
        }
        if let Some((from, _)) = self.peer_routes.iter().find(|(from, _)| **from == self.peer_addr) {
            return bad(format!("peer_routes: {from} is this broker's own peer_addr"));
        }
        let r = &self.raft;
        if r.heartbeat_interval_ms == 0 {
            return bad("raft.heartbeat_interval_ms must be > 0".into());
        }
        if r.election_timeout_min_ms <= r.heartbeat_interval_ms {
            return bad(format!(
                "raft.election_timeout_min_ms ({}) must exceed raft.heartbeat_interval_ms ({})",
                r.election_timeout_min_ms, r.heartbeat_interval_ms
            ));
        }
        if r.election_timeout_max_ms <= r.election_timeout_min_ms {
            return bad("raft.election_timeout_max_ms must exceed raft.election_timeout_min_ms".into());
        }
        if r.snapshot_after_entries == 0 {
            return bad("raft.snapshot_after_entries must be > 0".into());
        }
        self.storage.validate().map_err(|e| ConfigError(e.to_string()))?;
        let l = &self.limits;
        if l.max_record_bytes == 0 || l.max_batch_bytes < l.max_record_bytes {
            return bad("limits: need 0 < max_record_bytes ≤ max_batch_bytes".into());
        }
        if l.max_batch_bytes > 64 << 20 {
            return bad("limits.max_batch_bytes is above 64 MiB".into());
        }
        if l.max_fetch_bytes == 0 || l.max_connections == 0 || l.max_partitions_per_topic == 0 {
            return bad(
                "limits: max_fetch_bytes, max_connections and max_partitions_per_topic must be > 0".into()
            );
        }
        Ok(())
    }
}

/// Parses `1=host:port,2=host:port` (the `--initial-cluster` flag).
///
/// # Errors
/// [`ConfigError`] for a malformed item, a bad id or address, or a repeated id.
pub fn parse_initial_cluster(text: &str) -> Result<BTreeMap<BrokerId, SocketAddr>, ConfigError> {
    let mut out = BTreeMap::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (id, addr) = item
            .split_once('=')
            .ok_or_else(|| ConfigError(format!("initial cluster item {item:?} is not id=host:port")))?;
        let id: BrokerId =
            id.trim().parse().map_err(|_| ConfigError(format!("initial cluster: bad broker id {id:?}")))?;
        let addr: SocketAddr = addr
            .trim()
            .parse()
            .map_err(|e| ConfigError(format!("initial cluster: bad address {addr:?}: {e}")))?;
        if out.insert(id, addr).is_some() {
            return Err(ConfigError(format!("initial cluster: broker {id} listed twice")));
        }
    }
    Ok(out)
}

/// Parses `host:port,host:port` (the `--join` flag): peer addresses of
/// running brokers.
///
/// # Errors
/// [`ConfigError`] for a malformed address or an empty list.
pub fn parse_join(text: &str) -> Result<Vec<SocketAddr>, ConfigError> {
    let out: Vec<SocketAddr> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|a| a.parse().map_err(|e| ConfigError(format!("join: bad peer address {a:?}: {e}"))))
        .collect::<Result<_, _>>()?;
    if out.is_empty() {
        return Err(ConfigError("join: no peer address given".into()));
    }
    Ok(out)
}

/// Parses `host:port=host:port,...` (the `--peer-routes` flag): each peer
/// address and the address to dial instead.
///
/// # Errors
/// [`ConfigError`] for a malformed item or address, or a peer listed twice.
pub fn parse_peer_routes(text: &str) -> Result<BTreeMap<SocketAddr, SocketAddr>, ConfigError> {
    let mut out = BTreeMap::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let parse = |a: &str| {
            a.trim()
                .parse::<SocketAddr>()
                .map_err(|e| ConfigError(format!("peer routes: bad address {a:?}: {e}")))
        };
        let (peer, via) = item
            .split_once('=')
            .ok_or_else(|| ConfigError(format!("peer route {item:?} is not host:port=host:port")))?;
        let peer = parse(peer)?;
        if out.insert(peer, parse(via)?).is_some() {
            return Err(ConfigError(format!("peer routes: {peer} listed twice")));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_parses_and_validates() {
        let text = include_str!("../../deploy/broker.toml");
        let c = BrokerConfig::from_toml(text).expect("template parses");
        c.validate().expect("template is valid");
    }

    #[test]
    fn topic_defaults_are_checked_with_the_key_named() {
        let text = include_str!("../../deploy/broker.toml").replace(
            "\"retention.bytes\" = \"-1\"",
            "\"retention.bytes\" = \"-1\"\n\"retention.hours\" = \"5\"",
        );
        let c = BrokerConfig::from_toml(&text).expect("parses");
        let e = c.validate().unwrap_err();
        assert!(e.0.contains("retention.hours"), "{e}");
    }

    #[test]
    fn round_trips_through_toml() {
        let c = BrokerConfig {
            initial_cluster: parse_initial_cluster("1=127.0.0.1:9501, 2=127.0.0.1:9502").expect("parse"),
            peer_routes: parse_peer_routes("127.0.0.1:9502=127.0.0.1:19502").expect("parse"),
            topic_defaults: BTreeMap::from([("retention.ms".into(), "3600000".into())]),
            ..BrokerConfig::default()
        };
        let back = BrokerConfig::from_toml(&c.to_toml().expect("render")).expect("parse");
        assert_eq!(back, c);
    }

    #[test]
    fn rejects_bad_values() {
        let ok = BrokerConfig { node_id: 1, ..BrokerConfig::default() };
        let joining = BrokerConfig { join: parse_join("127.0.0.1:7").expect("p"), ..BrokerConfig::default() };
        joining.validate().expect("a joining broker may leave its id to the cluster");
        let cases: Vec<(&str, BrokerConfig)> = vec![
            ("node_id", BrokerConfig { node_id: 0, ..ok.clone() }),
            (
                "both set",
                BrokerConfig {
                    initial_cluster: parse_initial_cluster("1=127.0.0.1:9501").expect("p"),
                    ..joining.clone()
                },
            ),
            ("own peer_addr", BrokerConfig { join: vec![ok.peer_addr], ..joining.clone() }),
            ("both", BrokerConfig { peer_addr: ok.client_addr, ..ok.clone() }),
            (
                "own peer_addr",
                BrokerConfig {
                    peer_routes: [(ok.peer_addr, ok.client_addr)].into_iter().collect(),
                    ..ok.clone()
                },
            ),
            (
                "does not list",
                BrokerConfig {
                    initial_cluster: parse_initial_cluster("2=127.0.0.1:1").expect("p"),
                    ..ok.clone()
                },
            ),
            (
                "election_timeout_min_ms",
                BrokerConfig {
                    raft: RaftTimings { election_timeout_min_ms: 10, ..RaftTimings::default() },
                    ..ok.clone()
                },
            ),
        ];
        for (needle, c) in cases {
            let e = c.validate().expect_err(needle);
            assert!(e.to_string().contains(needle), "{e} should mention {needle}");
        }
        assert!(parse_initial_cluster("1=127.0.0.1:1,1=127.0.0.1:2").is_err());
        assert!(parse_initial_cluster("x=127.0.0.1:1").is_err());
        assert!(parse_initial_cluster("1=nowhere").is_err());
        assert!(BrokerConfig::from_toml("node_id = 1\nbogus = 3\n").is_err());
        assert!(parse_join(" , ").is_err());
        assert!(parse_join("nowhere").is_err());
    }
}

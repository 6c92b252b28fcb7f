//! The partitions this broker hosts, and the reconciler that starts and
//! stops them as the metadata image changes.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use ferrolog_raft_store::types::{Node, NodeId};
use ferrolog_raft_store::{Flusher, Replica, StoreConfig};
use openraft::Raft;
use tokio::sync::watch;
use tracing::Instrument;

use crate::config::BrokerId;
use crate::groups::{GroupRegistry, HostedGroup};
use crate::metadata::command::PartitionAssignment;
use crate::metadata::image::MetadataImage;
use crate::network::{PeerAddresses, PeerNetworkFactory};
use crate::partition::Partition;

/// (topic, partition).
type PartitionKey = (String, u32);

/// Hosted partitions by (topic, partition). Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct PartitionTable {
    by_name: Arc<RwLock<HashMap<PartitionKey, Arc<Partition>>>>,
}

impl PartitionTable {
    /// The hosted replica of `topic`/`partition`.
    pub fn get(&self, topic: &str, partition: u32) -> Option<Arc<Partition>> {
        self.by_name.read().unwrap_or_else(|p| p.into_inner()).get(&(topic.to_owned(), partition)).cloned()
    }

    /// Every hosted replica.
    pub fn all(&self) -> Vec<Arc<Partition>> {
        self.by_name.read().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    fn insert(&self, p: Arc<Partition>) {
        self.by_name.write().unwrap_or_else(|e| e.into_inner()).insert((p.topic.clone(), p.partition), p);
    }

    fn remove(&self, topic: &str, partition: u32) -> Option<Arc<Partition>> {
        self.by_name.write().unwrap_or_else(|e| e.into_inner()).remove(&(topic.to_owned(), partition))
    }
}

/// What the reconciler needs to start replicas.
#[derive(Clone, Debug)]
pub struct Reconciler {
    /// This broker.
    pub broker: BrokerId,
    /// `<data_dir>/partitions`.
    pub root: PathBuf,
    /// Storage settings for every replica.
    pub storage: StoreConfig,
    /// The data directory's flusher.
    pub flusher: Flusher,
    /// Raft settings of every group.
    pub raft_config: Arc<openraft::Config>,
    /// Shared peer connections.
    pub peers: PeerAddresses,
    /// Groups reachable by the peer service.
    pub groups: GroupRegistry,
    /// Groups reachable by the client service.
    pub table: PartitionTable,
}

/// Directory of a partition replica: `<root>/<topic>-<partition>.g<group>`.
pub fn partition_dir(root: &Path, topic: &str, partition: u32, group: u64) -> PathBuf {
    root.join(format!("{topic}-{partition}.g{group}"))
}

impl Reconciler {
    /// Starts and stops replicas to match each new image, until the image's
    /// sender is dropped.
    pub async fn run(self, mut image: watch::Receiver<Arc<MetadataImage>>) {
        loop {
            let current = image.borrow_and_update().clone();
            self.reconcile(&current).await;
            if image.changed().await.is_err() {
                return;
            }
        }
    }

    async fn reconcile(&self, image: &MetadataImage) {
        let wanted: BTreeMap<u64, (String, u32, PartitionAssignment)> =
            image.replicas_on(self.broker).into_iter().map(|(t, p, a)| (a.group, (t, p, a))).collect();
        for (group, (topic, partition, assignment)) in &wanted {
            if let Some(p) = self.table.get(topic, *partition)
                && p.group == *group
            {
                p.set_replicas(assignment.replicas.clone());
                continue;
            }
            let span = tracing::info_span!("partition", node = self.broker, partition = %format!("{topic}-{partition}"));
            if let Err(e) = self.start(image, topic, *partition, assignment).instrument(span).await {
                tracing::error!(%topic, partition, group, "cannot start replica: {e:#}");
            }
        }
        for p in self.table.all() {
            if !wanted.contains_key(&p.group) {
                tracing::info!(topic = %p.topic, partition = p.partition, group = p.group, "topic deleted: removing replica");
                self.stop(&p.topic, p.partition).await;
                let _ = std::fs::remove_dir_all(partition_dir(&self.root, &p.topic, p.partition, p.group));
            }
        }
    }

    async fn start(
        &self,
        image: &MetadataImage,
        topic: &str,
        partition: u32,
        a: &PartitionAssignment,
    ) -> anyhow::Result<()> {
        let me = a
            .replicas
            .iter()
            .find(|r| r.broker == self.broker)
            .ok_or_else(|| anyhow::anyhow!("not a replica"))?;
        let dir = partition_dir(&self.root, topic, partition, a.group);
        let staging_dir = dir.join("staging");
        std::fs::create_dir_all(&staging_dir)?;
        let replica = Replica::open(&dir.join("replica"), self.storage.clone(), self.flusher.clone())?;
        let network = PeerNetworkFactory::new(a.group, self.peers.clone());
        let raft = Raft::new(
            me.node,
            self.raft_config.clone(),
            network,
            replica.log_store(),
            replica.state_machine(),
        )
        .await?;
        self.groups.insert(
            a.group,
            HostedGroup { node_id: me.node, raft: raft.clone(), replica: replica.clone(), staging_dir },
        );
        if a.initial.contains(&me.node) && !raft.is_initialized().await? {
            let mut members: BTreeMap<NodeId, Node> = BTreeMap::new();
            for r in a.replicas.iter().filter(|r| a.initial.contains(&r.node)) {
                let addr = image
                    .brokers
                    .get(&r.broker)
                    .map(|b| b.peer_addr.clone())
                    .ok_or_else(|| anyhow::anyhow!("broker {} is not registered", r.broker))?;
                members.insert(r.node, Node { addr });
            }
            if let Err(e) = raft.initialize(members).await {
                tracing::debug!("initialize: {e}");
            }
        }
        tracing::info!(group = a.group, node = me.node, "replica started");
        self.table.insert(Arc::new(Partition::new(
            topic.to_owned(),
            partition,
            a.group,
            me.node,
            raft,
            replica,
            a.replicas.clone(),
        )));
        Ok(())
    }

    async fn stop(&self, topic: &str, partition: u32) {
        if let Some(p) = self.table.remove(topic, partition) {
            self.groups.remove(p.group);
            if let Err(e) = p.raft.shutdown().await {
                tracing::warn!(%topic, partition, "raft shutdown: {e}");
            }
        }
    }

    /// Stops every hosted replica.
    pub async fn stop_all(&self) {
        for p in self.table.all() {
            self.stop(&p.topic, p.partition).await;
        }
    }
}

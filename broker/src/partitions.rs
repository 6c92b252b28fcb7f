//! The reconciler that starts and stops this broker's partition replicas as
//! the metadata image changes (they are hosted in [`GroupRegistry`]), and
//! the record of replicas that failed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use ferrolog_raft_store::meta_db::MetaDb;
use ferrolog_raft_store::vfs::Vfs;
use ferrolog_raft_store::{Flusher, Founding, Replica, StoreConfig};
use ferrolog_replica::{NodeId, RaftNode, ValidSettings};
use tokio::sync::watch;
use tracing::Instrument;

use crate::config::BrokerId;
use crate::groups::{GroupRegistry, HostedGroup};
use crate::metadata::command::PartitionAssignment;
use crate::metadata::controller::Controller;
use crate::metadata::image::MetadataImage;
use crate::metadata::topic_config;
use crate::network::PeerAddresses;
use crate::partition::Partition;

/// Replicas that failed to start or stopped on an error, by group id: the
/// reconciler's record of what to restart when, which `cluster status`
/// also shows. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Failures {
    failed: Arc<Mutex<HashMap<u64, FailedReplica>>>,
}

/// A replica that could not be started, or whose Raft group stopped on an
/// error (storage, or a fatal error inside Raft): the reconciler starts
/// it again after [`restart_backoff`], reopening its log with every segment
/// verified so damage is found and repaired. Kept until it has run for
/// [`HEALTHY_AFTER`] without failing again.
#[derive(Clone, Debug)]
pub struct FailedReplica {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// The last error.
    pub error: String,
    /// Consecutive failures.
    pub attempts: u32,
    /// When the reconciler starts it again.
    pub retry_at: Instant,
    /// Since when it runs again, if it does.
    pub running_since: Option<Instant>,
    /// Why its restart waits for the data directory (`crate::control::writable`), if it does.
    pub waiting_for_disk: Option<String>,
}

impl std::fmt::Display for FailedReplica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (failure {})", self.error, self.attempts)?;
        match &self.waiting_for_disk {
            Some(why) => write!(f, "; restart waits for the disk: {why}"),
            None => {
                let ms = self.retry_at.saturating_duration_since(Instant::now()).as_millis();
                write!(f, "; next start in {ms} ms")
            }
        }
    }
}

/// How long after the last replica was stopped the reconciler gives freed
/// memory back to the operating system even if some stopped replica is
/// still held (see [`Reconciler::run`]).
pub const RELEASE_MEMORY_AFTER: Duration = Duration::from_secs(30);

/// How long a restarted replica must run before its failures are forgotten.
pub const HEALTHY_AFTER: Duration = Duration::from_secs(60);

/// Replicas [`Reconciler::stop_all`] stops concurrently.
pub const STOPS_AT_ONCE: usize = 256;

/// Replicas a reconciler pass starts concurrently.
pub const STARTS_AT_ONCE: usize = 32;

/// Wait before the `attempts`-th restart of a failed replica: 1 s, doubling,
/// at most 60 s.
pub fn restart_backoff(attempts: u32) -> Duration {
    Duration::from_secs(1u64 << attempts.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

impl Failures {
    /// Whether some failed replica is not running again yet (its restart
    /// is due, or waits for the disk).
    fn pending(&self) -> bool {
        self.failures().values().any(|f| f.running_since.is_none())
    }

    fn failures(&self) -> std::sync::MutexGuard<'_, HashMap<u64, FailedReplica>> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The failure of the replica of `topic`/`partition` if it is not
    /// running now (failed to start, or stopped and waiting to restart).
    pub fn failure(&self, topic: &str, partition: u32) -> Option<FailedReplica> {
        self.failures()
            .values()
            .find(|f| f.topic == topic && f.partition == partition && f.running_since.is_none())
            .cloned()
    }

    /// Records that the replica of `group` failed with `error`, scheduling
    /// its restart after [`restart_backoff`]. Returns the record.
    fn record_failure(&self, group: u64, topic: &str, partition: u32, error: String) -> FailedReplica {
        let mut failed = self.failures();
        let attempts = failed.get(&group).map_or(0, |f| f.attempts) + 1;
        let f = FailedReplica {
            topic: topic.to_owned(),
            partition,
            error,
            attempts,
            retry_at: Instant::now() + restart_backoff(attempts),
            running_since: None,
            waiting_for_disk: None,
        };
        failed.insert(group, f.clone());
        f
    }
}

/// What the reconciler needs to start replicas.
#[derive(Clone, Debug)]
pub struct Reconciler {
    /// This broker.
    pub broker: BrokerId,
    /// `<data_dir>/partitions`.
    pub root: PathBuf,
    /// The replicas' shared metadata database in `root`.
    pub meta_db: Arc<MetaDb>,
    /// Storage settings for every replica.
    pub storage: StoreConfig,
    /// The data directory's flusher.
    pub flusher: Flusher,
    /// Raft settings of every group.
    pub raft_settings: ValidSettings,
    /// Shared peer connections.
    pub peers: PeerAddresses,
    /// The hosted groups (the peer and client services find them there).
    pub groups: GroupRegistry,
    /// Replicas that failed, and when they restart.
    pub failures: Failures,
    /// This data directory's incarnation (`crate::identity`).
    pub incarnation: u64,
    /// Tells whether the metadata image has caught up.
    pub controller: Controller,
    /// The segment roll limits (bytes, ms) last set on each hosted group,
    /// so that a pass touches a replica only when its topic's
    /// `segment.bytes` / `segment.ms` changed.
    pub roll_limits: Arc<Mutex<HashMap<u64, (u64, u64)>>>,
}

/// The replica's storage inside its partition directory (beside `staging`).
pub const REPLICA_DIR: &str = "replica";

/// Removes a partition directory: the replica's storage and its keys in the
/// shared metadata database first (see [`Replica::remove`]), then the rest.
/// Blocking; failures are logged (the directory sweep tries again).
fn remove_partition_dir(fs: &dyn Vfs, meta_db: &Arc<MetaDb>, dir: &Path) {
    let result = Replica::remove(meta_db, &dir.join(REPLICA_DIR))
        .and_then(|()| ferrolog_raft_store::remove_dir_if_exists(fs, dir));
    if let Err(e) = result {
        tracing::warn!(dir = %dir.display(), "cannot remove a replica: {e:#}");
    }
}

/// Directory of a partition replica: `<root>/<topic>-<partition>.g<group>`,
/// the topic cut to its first 200 bytes so the name fits the usual 255-byte
/// file name limit (the group id keeps it unique; topic names are ASCII).
pub fn partition_dir(root: &Path, topic: &str, partition: u32, group: u64) -> PathBuf {
    let short = topic.get(..200).unwrap_or(topic);
    root.join(format!("{short}-{partition}.g{group}"))
}

impl Reconciler {
    /// Starts and stops replicas to match the image, on every change and
    /// every second, until the image's sender is dropped. A pass compares
    /// the hosted replicas with the image (and sweeps the data directory)
    /// only when the image changed since the last complete comparison or a
    /// failed replica waits for its restart: an idle broker's pass reads no
    /// more than each group's running state.
    ///
    /// Once replicas were stopped, the first pass that finds every stopped
    /// replica dropped (by its Raft node's remaining tasks and by requests and
    /// rounds of `crate::control::quiesce` and `crate::control::checkquorum` that still held
    /// one), or [`RELEASE_MEMORY_AFTER`] after the last stop otherwise,
    /// gives the freed memory back to the operating system
    /// ([`crate::control::memory::release_freed`]).
    pub async fn run(self, mut image: watch::Receiver<Arc<MetadataImage>>) {
        let mut addressed: Option<Arc<MetadataImage>> = None;
        let mut placed: Option<Arc<MetadataImage>> = None;
        let mut stopped_at: Option<Instant> = None;
        loop {
            let current = image.borrow_and_update().clone();
            if addressed.as_ref().is_none_or(|a| !Arc::ptr_eq(a, &current)) {
                // Every group dials each node's broker where it now is.
                self.peers.set_node_addresses(current.node_addresses());
                addressed = Some(current.clone());
            }
            let compare =
                placed.as_ref().is_none_or(|p| !Arc::ptr_eq(p, &current)) || self.failures.pending();
            let (stopped, compared) = self.reconcile(&current, compare).await;
            // A pass that did not compare leaves what was placed as it was:
            // resetting it there made every other pass a full comparison
            // (and a listing of the data directory), each second, idle.
            if compared {
                placed = (stopped == 0).then(|| current.clone());
            } else if stopped > 0 {
                placed = None;
            }
            if stopped > 0 {
                stopped_at = Some(Instant::now());
            } else if let Some(t) = stopped_at
                && (self.stopped_replicas_dropped() || t.elapsed() >= RELEASE_MEMORY_AFTER)
            {
                stopped_at = None;
                crate::control::memory::release_freed(&**self.flusher.fs()).await;
            }
            tokio::select! {
                changed = image.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            }
        }
    }

    /// Whether no stopped replica is alive any more: no more partitions and
    /// open replicas in this process than hosted (the registry also holds
    /// the metadata group's replica). The counts are the process's: with
    /// several brokers in one process this is never true, and
    /// `RELEASE_MEMORY_AFTER` alone decides.
    fn stopped_replicas_dropped(&self) -> bool {
        Partition::live_count() as usize <= self.groups.partitions().len()
            && Replica::open_count() <= self.groups.all().len()
    }

    /// Whether the image may be acted on: it has caught up with the
    /// controller's commits, and it records this data directory's
    /// incarnation, so every node id in it for this broker was given to
    /// this directory (a wiped broker's old node ids are never started).
    fn image_usable(&self, image: &MetadataImage) -> bool {
        self.controller.image_caught_up()
            && image.brokers.get(&self.broker).is_some_and(|b| b.incarnation == self.incarnation)
    }

    /// One pass; returns how many replicas it stopped, and whether it
    /// compared the hosted replicas with the image (asked by `compare`, the
    /// image was usable, and no deletion waits for a confirmed image).
    async fn reconcile(&self, image: &MetadataImage, compare: bool) -> (usize, bool) {
        let failed = self.stop_failed_groups().await;
        self.release_recovered();
        for (_, h) in self.groups.recovering() {
            crate::control::recovery::seek_vote_floor(&h).await;
        }
        self.failures.failures().retain(|_, f| f.running_since.is_none_or(|t| t.elapsed() < HEALTHY_AFTER));
        if !compare || !self.image_usable(image) {
            return (failed, false);
        }
        let wanted: BTreeMap<u64, (String, u32, PartitionAssignment)> =
            image.replicas_on(self.broker).into_iter().map(|(t, p, a)| (a.group, (t, p, a))).collect();
        let (mut removed, mut reassigned) = (0usize, 0usize);
        let placed_here = |p: &Partition| {
            wanted
                .get(&p.group)
                .and_then(|(_, _, a)| a.replicas.iter().find(|r| r.broker == self.broker))
                .map(|r| r.node)
        };
        // Deleting a replica needs an image known to hold every metadata
        // change committed so far: after a restart the image may stop at a
        // lazily saved commit index, before a reassignment that placed a
        // replica here (which would then be deleted as not placed: a voter
        // forgetting its log). Confirmed with the controller (ReadIndex)
        // only when something would be deleted.
        let hosted = self.groups.partitions();
        let orphans = self.orphan_dirs(image, &wanted);
        let doomed = hosted.iter().any(|p| placed_here(p) != Some(p.node_id));
        let deleting = doomed || !orphans.is_empty();
        let fresh = deleting && self.confirmed_current(image).await;
        for p in hosted {
            match placed_here(&p) {
                Some(node) if node == p.node_id => {}
                _ if !fresh => {}
                Some(_) => {
                    // Re-assigned under a new node id: what it holds belongs to the old one.
                    tracing::warn!(topic = %p.topic, partition = p.partition, group = p.group, "node id changed: restarting the replica empty");
                    self.stop(p.group).await;
                    self.remove(&partition_dir(&self.root, &p.topic, p.partition, p.group)).await;
                    reassigned += 1;
                }
                None => {
                    if image.partition_by_group(p.group).is_some() {
                        // A reassignment completed without this broker: the
                        // group's voters no longer include this replica.
                        tracing::info!(topic = %p.topic, partition = p.partition, group = p.group, "replica moved off this broker: removing it");
                    } else {
                        tracing::info!(topic = %p.topic, partition = p.partition, group = p.group, "topic deleted: removing replica");
                    }
                    self.stop(p.group).await;
                    self.remove(&partition_dir(&self.root, &p.topic, p.partition, p.group)).await;
                    removed += 1;
                }
            }
        }
        if removed > 0 {
            tracing::info!(
                removed,
                hosted = self.groups.partitions().len(),
                live_partitions = Partition::live_count(),
                open_replicas = Replica::open_count(),
                tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks(),
                "replicas no longer placed here removed"
            );
        }
        let mut disk: Option<Result<(), String>> = None;
        let mut to_start = Vec::new();
        for (group, (topic, partition, assignment)) in &wanted {
            if self.groups.contains(*group) {
                if let Some(p) = self.groups.partition(topic, *partition) {
                    if p.set_replicas(assignment.replicas.clone()) {
                        // Who leads and who can follow is judged by the replica list.
                        self.groups.stir([p.group]);
                    }
                    self.apply_roll_limits(image, &p);
                }
                continue;
            }
            let previous = self.failures.failures().get(group).cloned();
            if previous.as_ref().is_some_and(|f| f.running_since.is_none() && Instant::now() < f.retry_at) {
                continue;
            }
            // A replica that failed is started again only on a disk that
            // takes writes (crate::control::writable); checked once per pass.
            if previous.as_ref().is_some_and(|f| f.running_since.is_none()) {
                if disk.is_none() {
                    let (fs, root) = (self.flusher.fs().clone(), self.root.clone());
                    let on = fs.clone();
                    let probed = ferrolog_raft_store::runtime::blocking(&*on, move || {
                        crate::control::writable::probe(&*fs, &root)
                    })
                    .await;
                    disk = Some(probed.unwrap_or_else(|e| Err(e.to_string())));
                }
                if let Some(Err(why)) = &disk {
                    if let Some(f) = self.failures.failures().get_mut(group) {
                        if f.waiting_for_disk.is_none() {
                            tracing::warn!(%topic, partition, group, "not restarting the replica yet: {why}");
                        }
                        f.waiting_for_disk = Some(why.clone());
                    }
                    continue;
                }
            }
            // After a failure every segment is verified, not only the tail.
            to_start.push((*group, topic, *partition, assignment, previous.is_some()));
        }
        // Many at once: each start waits for a few fsyncs (a new replica's
        // files and metadata, its founding entry), which the disk serves
        // side by side; one at a time, 10,000 new partitions took minutes.
        // In group order (`wanted` is sorted), with the lowest group still
        // being opened reported in pings (GroupRegistry::opening_floor):
        // replicas elsewhere campaign for a group once a majority has it open.
        // Restarts of failed replicas (which may verify every segment, for
        // minutes) are left out: they are not new groups.
        let opening =
            std::sync::Mutex::new(to_start.iter().filter(|s| !s.4).map(|s| s.0).collect::<BTreeSet<u64>>());
        let opened = |group: u64| {
            let mut pending = opening.lock().unwrap_or_else(|p| p.into_inner());
            pending.remove(&group);
            self.groups.set_opening_floor(pending.first().copied().unwrap_or(0));
        };
        let opened = &opened;
        self.groups.set_opening_floor(
            opening.lock().unwrap_or_else(|p| p.into_inner()).first().copied().unwrap_or(0),
        );
        use futures::StreamExt;
        futures::stream::iter(to_start)
            .for_each_concurrent(STARTS_AT_ONCE, |(group, topic, partition, assignment, rescan)| async move {
                let span = tracing::info_span!("partition", node = self.broker, partition = %format!("{topic}-{partition}"), group);
                let started = self.start(image, topic, partition, assignment, rescan).instrument(span).await;
                opened(group);
                match started {
                    Ok(()) => {
                        if let Some(f) = self.failures.failures().get_mut(&group) {
                            f.running_since = Some(Instant::now());
                        }
                    }
                    Err(e) => {
                        let f = self.failures.record_failure(group, topic, partition, format!("{e:#}"));
                        tracing::error!(%topic, partition, group, attempts = f.attempts,
                            retry_in_ms = restart_backoff(f.attempts).as_millis() as u64, "cannot start replica: {e:#}");
                    }
                }
            })
            .await;
        self.failures.failures().retain(|g, f| {
            wanted.contains_key(g) && f.running_since.is_none_or(|t| t.elapsed() < HEALTHY_AFTER)
        });
        if fresh {
            for dir in orphans {
                tracing::info!(dir = %dir.display(), "removing a replica no longer placed here (topic deleted or replica moved)");
                self.remove(&dir).await;
            }
        }
        self.groups.set_replicas_open();
        // A deletion left for want of a confirmed image is tried again on
        // the next pass, image change or not: not compared.
        let settled = fresh || !deleting;
        (failed + removed + reassigned, settled)
    }

    /// The segment roll limits of `topic`'s replicas on this broker (bytes, ms).
    fn roll_limits_of(&self, image: &MetadataImage, topic: &str) -> (u64, u64) {
        let (bytes, ms) = (self.storage.segment_bytes, self.storage.segment_ms);
        image.topics.get(topic).map_or((bytes, ms), |t| topic_config::roll_limits(&t.config, bytes, ms))
    }

    /// Sets `p`'s segment roll limits when its topic's differ from those
    /// last set (a `topic alter` of `segment.bytes` or `segment.ms`).
    fn apply_roll_limits(&self, image: &MetadataImage, p: &Partition) {
        let want = self.roll_limits_of(image, &p.topic);
        let mut set = self.roll_limits.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if set.get(&p.group) == Some(&want) {
            return;
        }
        match p.replica.set_roll_limits(want.0, want.1) {
            Ok(()) => {
                tracing::info!(topic = %p.topic, partition = p.partition, segment_bytes = want.0, segment_ms = want.1, "segment roll limits set");
                set.insert(p.group, want);
            }
            Err(e) => {
                tracing::warn!(topic = %p.topic, partition = p.partition, "cannot set segment roll limits: {e}")
            }
        }
    }

    /// Stops every hosted partition whose Raft group has stopped on an
    /// error, recording the failure so that it is started again (repaired)
    /// after a back-off: a group is never silently dead while its broker runs.
    /// Returns how many it stopped.
    async fn stop_failed_groups(&self) -> usize {
        let mut stopped = 0;
        for (p, fatal) in self.groups.stopped_on_error() {
            let f = self.failures.record_failure(
                p.group,
                &p.topic,
                p.partition,
                format!("raft stopped: {fatal}"),
            );
            tracing::error!(topic = %p.topic, partition = p.partition, group = p.group, attempts = f.attempts,
                retry_in_ms = restart_backoff(f.attempts).as_millis() as u64,
                "replica stopped on an error; restarting it after repair: {fatal}");
            self.stop(p.group).await;
            stopped += 1;
        }
        stopped
    }

    /// Ends the recovery of hosted replicas (every group, the metadata
    /// group included) that a leader has brought back (`crate::control::recovery`).
    fn release_recovered(&self) {
        for (_, h) in self.groups.recovering() {
            // Partition groups' elections are scheduled by crate::control::quiesce;
            // the metadata group's by its Raft node's own timer.
            let partition = h.partition.clone();
            if h.raft.release_if_caught_up(partition.is_none())
                && let Some(p) = partition
            {
                p.campaign.set_allowed(true);
            }
        }
    }

    /// Replica directories of groups this broker neither hosts nor is
    /// placed in by `image` (a topic deleted, or a replica moved off, while
    /// the broker was down): removed by `reconcile` only on an image
    /// confirmed current.
    fn orphan_dirs(
        &self,
        image: &MetadataImage,
        wanted: &BTreeMap<u64, (String, u32, PartitionAssignment)>,
    ) -> Vec<PathBuf> {
        let fs = self.flusher.fs();
        let Ok(names) = fs.list(&self.root) else { return Vec::new() };
        names
            .into_iter()
            .filter(|name| fs.metadata(&self.root.join(name)).is_ok_and(|m| m.is_dir))
            .filter(|name| {
                name.rsplit_once(".g").and_then(|(_, g)| g.parse::<u64>().ok()).is_some_and(|group| {
                    group < image.next_group_id
                        && !wanted.contains_key(&group)
                        && !self.groups.contains(group)
                })
            })
            .map(|name| self.root.join(name))
            .collect()
    }

    /// Whether `image` holds every metadata change the controller had
    /// committed when asked now ([`Controller::current_image`], ReadIndex):
    /// what it does not place here is really gone. Also when `image` shows
    /// this broker decommissioned: it is never placed on again, so nothing
    /// it holds is wanted (and once out of the metadata group its image
    /// may never reach the controller's offset).
    async fn confirmed_current(&self, image: &MetadataImage) -> bool {
        if image.brokers.get(&self.broker).is_some_and(|b| b.decommissioned) {
            return true;
        }
        match self.controller.current_image().await {
            Ok(confirmed) => confirmed.covers(image),
            Err(e) => {
                crate::logging::every(
                    "reconcile.confirm",
                    Duration::from_secs(30),
                    format_args!("not removing replicas yet: {e}"),
                );
                false
            }
        }
    }

    /// Removes a stopped replica's partition directory, off the async threads.
    async fn remove(&self, dir: &Path) {
        let (fs, db, dir) = (self.flusher.fs().clone(), self.meta_db.clone(), dir.to_owned());
        let on = fs.clone();
        let _ =
            ferrolog_raft_store::runtime::blocking(&*on, move || remove_partition_dir(&*fs, &db, &dir)).await;
    }

    async fn start(
        &self,
        image: &MetadataImage,
        topic: &str,
        partition: u32,
        a: &PartitionAssignment,
        rescan: bool,
    ) -> anyhow::Result<()> {
        let me = a
            .replicas
            .iter()
            .find(|r| r.broker == self.broker)
            .ok_or_else(|| anyhow::anyhow!("not a replica"))?;
        let founders = Self::founders(image, a, me.node)?;
        let dir = partition_dir(&self.root, topic, partition, a.group);
        let staging_dir = dir.join("staging");
        // Opening reads, verifies and creates files: off the async threads.
        // If this start is dropped meanwhile (the broker stops), the opened
        // replica is closed cleanly there, not left marked as after a crash.
        let mut storage = self.storage.clone();
        let roll = self.roll_limits_of(image, topic);
        (storage.segment_bytes, storage.segment_ms) = roll;
        self.roll_limits.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(a.group, roll);
        let (flusher, staging) = (self.flusher.clone(), staging_dir.clone());
        let meta_db = self.meta_db.clone();
        let (opened_tx, opened) = tokio::sync::oneshot::channel::<anyhow::Result<Replica>>();
        let span = tracing::Span::current();
        let fs = self.flusher.fs().clone();
        // Awaited, and if this start is dropped meanwhile the open still
        // finishes (a blocking task is not cancelled) and closes it.
        let _ = ferrolog_raft_store::runtime::blocking(&*fs, move || {
            let _span = span.enter();
            let result = (|| -> anyhow::Result<Replica> {
                let fs = flusher.fs().clone();
                ferrolog_raft_store::create_dir_durable(&*fs, &staging)?;
                ferrolog_replica::snapshot::clear_staging(&*fs, &staging)?;
                Ok(Replica::open_in(&meta_db, &dir.join(REPLICA_DIR), storage, flusher, rescan)?)
            })();
            if let Err(Ok(unwanted)) = opened_tx.send(result)
                && let Err(e) = unwanted.close_cleanly()
            {
                tracing::warn!("cannot record a clean stop of a replica opened during shutdown: {e}");
            }
        })
        .await;
        let replica = opened.await.map_err(|_| anyhow::anyhow!("the replica's open was cut off"))??;
        // A new group's founding members each write the same first
        // configuration, and their vote for the founding leader (the
        // preferred leader), before their node starts (Replica::found):
        // that leader leads from its first start, without an election.
        let founding = match founders {
            Some(voters) => replica.found(voters, Self::founding_leader(a)).await?,
            None => Founding::Existing,
        };
        let raft = if founding == (Founding::Founded { leader: Some(me.node) }) {
            RaftNode::start_founding_leader(
                a.group,
                me.node,
                &self.raft_settings,
                &replica,
                self.peers.clone(),
            )
            .await?
        } else {
            RaftNode::start(a.group, me.node, &self.raft_settings, &replica, self.peers.clone()).await?
        };
        // Elections of partition groups are started by crate::control::quiesce
        // (spread out, with back-off), never by the node's own per-group timer.
        raft.set_elections(false);
        if crate::inject::active(crate::inject::Bug::AckBeforeCommit) {
            raft.inject(ferrolog_replica::InjectedBug::AckBeforeCommit);
        }
        let p = Arc::new(Partition::new(
            topic.to_owned(),
            partition,
            a.group,
            me.node,
            raft.clone(),
            replica.clone(),
            a.replicas.clone(),
        ));
        // No campaign before the recovery check below.
        p.campaign.set_allowed(false);
        let hosted = HostedGroup {
            node_id: me.node,
            raft: raft.clone(),
            replica: replica.clone(),
            staging_dir,
            partition: Some(p.clone()),
        };
        self.groups.insert(a.group, hosted);
        let held = raft.hold_if_recovering(me.node);
        tracing::info!(group = a.group, node = me.node, "replica started");
        p.campaign.set_allowed(!held);
        Ok(())
    }

    /// The group's initial voters (node id → peer address) if `me` is one
    /// of them, to found the group with if its log is empty
    /// ([`Replica::found`]); `None` for a replica that joins later. The
    /// placement's preferred leader (first replica) campaigns first
    /// (crate::control::quiesce), so new partitions start balanced.
    ///
    /// # Errors
    /// A voter's broker is not registered.
    fn founders(
        image: &MetadataImage,
        a: &PartitionAssignment,
        me: NodeId,
    ) -> anyhow::Result<Option<BTreeMap<NodeId, String>>> {
        if !a.initial.contains(&me) {
            return Ok(None);
        }
        let mut members: BTreeMap<NodeId, String> = BTreeMap::new();
        for r in a.replicas.iter().filter(|r| a.initial.contains(&r.node)) {
            let addr = image
                .brokers
                .get(&r.broker)
                .map(|b| b.peer_addr.clone())
                .ok_or_else(|| anyhow::anyhow!("broker {} is not registered", r.broker))?;
            members.insert(r.node, addr);
        }
        Ok(Some(members))
    }

    /// The leader a new group is founded with (see [`Replica::found`]): the
    /// first initial voter, which is the preferred leader (`initial` is
    /// written in assignment order at creation and never rewritten), as
    /// long as every initial voter is still a replica. Once a founding
    /// replica's broker has been replaced (`BrokerReplaced` gives it a new
    /// node id) a late founder's view of the voters differs from the
    /// others', and a leader it restored without an election would skip
    /// Raft's up-to-date check (§5.4.1): such a group elects as usual.
    pub(crate) fn founding_leader(a: &PartitionAssignment) -> Option<NodeId> {
        let intact = a.initial.iter().all(|n| a.replicas.iter().any(|r| r.node == *n));
        a.initial.first().copied().filter(|_| intact)
    }

    async fn stop(&self, group: u64) {
        self.roll_limits.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&group);
        if let Some(p) = self.groups.remove(group).and_then(|h| h.partition) {
            match p.raft.shutdown().await {
                // Nothing writes the log any more: record that it stopped
                // cleanly (under flush = interval an unclean stop makes the
                // replica recovering when it opens again). The record is
                // fsynced: off the runtime's threads.
                Ok(()) => {
                    let replica = p.replica.clone();
                    let fs = replica.fs().clone();
                    let marked =
                        ferrolog_raft_store::runtime::blocking(&*fs, move || replica.close_cleanly()).await;
                    if let Ok(Err(e)) = marked {
                        tracing::warn!(topic = %p.topic, partition = p.partition, "cannot record a clean stop: {e}");
                    }
                }
                Err(e) => tracing::warn!(topic = %p.topic, partition = p.partition, "raft shutdown: {e}"),
            }
        }
    }

    /// Stops every hosted replica, [`STOPS_AT_ONCE`] at a time (each stop
    /// waits for its group's tasks and one fsync, so one at a time took
    /// seconds per thousand replicas).
    pub async fn stop_all(&self) {
        use futures::StreamExt;
        futures::stream::iter(self.groups.partitions())
            .for_each_concurrent(STOPS_AT_ONCE, |p| async move { self.stop(p.group).await })
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::command::ReplicaAssignment;

    #[test]
    fn a_failed_replica_restarts_after_1_s_doubling_to_60_s() {
        let waits: Vec<u64> = (1..=9).map(|a| restart_backoff(a).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(restart_backoff(u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn each_consecutive_failure_of_a_replica_waits_longer_and_says_so() {
        let failures = Failures::default();
        let mut last_wait = Duration::ZERO;
        for attempt in 1..=7u32 {
            let before = Instant::now();
            let f = failures.record_failure(7, "t", 0, format!("error {attempt}"));
            assert_eq!(f.attempts, attempt);
            let wait = f.retry_at.saturating_duration_since(before);
            assert!(wait >= restart_backoff(attempt) && wait > last_wait, "attempt {attempt}: {wait:?}");
            last_wait = wait;
            let shown = failures.failure("t", 0).expect("a failed replica is reported").to_string();
            assert!(
                shown.starts_with(&format!("error {attempt} (failure {attempt}); next start in ")),
                "{shown}"
            );
        }
        // Another replica's failures are its own.
        assert_eq!(failures.record_failure(8, "t", 1, "other".into()).attempts, 1);
    }

    fn assignment(replicas: &[(BrokerId, NodeId)], initial: &[NodeId]) -> PartitionAssignment {
        PartitionAssignment {
            group: 7,
            replicas: replicas.iter().map(|&(broker, node)| ReplicaAssignment { broker, node }).collect(),
            initial: initial.to_vec(),
            reassignment: None,
        }
    }

    #[test]
    fn a_group_is_founded_with_its_preferred_leader_only_while_its_founders_are_intact() {
        let created = assignment(&[(2, 11), (3, 12), (1, 13)], &[11, 12, 13]);
        assert_eq!(Reconciler::founding_leader(&created), Some(11), "the first initial voter");
        // Broker 3 replaced: its replica has a new node id. A founder that
        // opens only now sees other voters than the first founders did.
        let replaced = assignment(&[(2, 11), (3, 20), (1, 13)], &[11, 12, 13]);
        assert_eq!(Reconciler::founding_leader(&replaced), None);
        let leader_replaced = assignment(&[(2, 21), (3, 12), (1, 13)], &[11, 12, 13]);
        assert_eq!(Reconciler::founding_leader(&leader_replaced), None);
        let joined = assignment(&[(2, 11), (3, 12)], &[]);
        assert_eq!(Reconciler::founding_leader(&joined), None, "no founders: nothing to found");
    }
}

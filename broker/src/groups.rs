//! The Raft groups a broker hosts, in one registry: one entry per partition
//! replica (and the metadata group), keyed by group id (every incoming Raft
//! RPC names one), with an index by topic and partition (every client
//! request names one).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use ferrolog_raft_store::Replica;
use ferrolog_replica::{NodeId, RaftNode};

use crate::partition::Partition;

/// Identifies a Raft group across the cluster (a partition, or the metadata group).
pub type GroupId = u64;

/// One replica hosted here.
#[derive(Clone, Debug)]
pub struct HostedGroup {
    /// This replica's Raft node id within its group.
    pub node_id: NodeId,
    /// The running Raft node.
    pub raft: RaftNode,
    /// The replica's storage.
    pub replica: Replica,
    /// Where incoming snapshots are staged before install (same file system
    /// as the replica, so installing links instead of copying).
    pub staging_dir: PathBuf,
    /// The partition this group is (`None`: the metadata group), with the
    /// same node and storage.
    pub partition: Option<Arc<Partition>>,
}

/// Hosted groups by id, and the current group of each (topic, partition).
/// A deleted and re-created topic has new group ids, so its old replicas
/// stay listed (and get stopped) until removed by group.
#[derive(Debug, Default)]
struct Groups {
    by_id: BTreeMap<GroupId, HostedGroup>,
    by_name: BTreeMap<(String, u32), GroupId>,
}

/// The groups this broker hosts. Cheap to clone; clones share the map.
#[derive(Clone, Debug, Default)]
pub struct GroupRegistry {
    groups: Arc<RwLock<Groups>>,
    /// Groups whose leader here is handing over, with the term handed over
    /// (set by `crate::control::checkquorum`).
    handing_over: Arc<RwLock<BTreeMap<GroupId, u64>>>,
    /// The reconciler has opened every replica the metadata assigns this
    /// broker at least once since it started (reported in pings).
    replicas_open: Arc<std::sync::atomic::AtomicBool>,
    /// The lowest group id the reconciler is still opening (0: none); see
    /// [`GroupRegistry::opening_floor`].
    opening_floor: Arc<std::sync::atomic::AtomicU64>,
    /// The broker is in a controlled shutdown (see [`GroupRegistry::set_draining`]).
    draining: Arc<std::sync::atomic::AtomicBool>,
    /// The groups whose replica here leads and runs, with the term, kept
    /// current by [`GroupRegistry::watch_leadership`] from the nodes' own
    /// change notifications (see [`GroupRegistry::leading`]).
    led: Arc<RwLock<BTreeMap<GroupId, u64>>>,
    /// The groups whose Raft node stopped on an error, with the error, kept
    /// current by the same watcher (see [`GroupRegistry::stopped_on_error`]).
    fatal: Arc<RwLock<BTreeMap<GroupId, String>>>,
    /// Hands newly registered groups to the leadership watcher, once it runs.
    watcher: Arc<std::sync::Mutex<Option<NewGroups>>>,
    /// [`GroupRegistry::leading`]'s answer until `led` or a hand-over changes.
    leading_cache: Arc<std::sync::Mutex<Option<Arc<Vec<GroupId>>>>>,
    /// Groups registered, whose node's state changed (as the leadership
    /// watcher saw), whose parked leader a write woke, or named by
    /// [`GroupRegistry::stir`], since [`GroupRegistry::take_stirred`] last
    /// took them.
    stirred: Stirred,
    /// Groups whose replica here found its log damaged while serving a
    /// read (see [`Damaged`]).
    damaged: Damaged,
}

/// Groups whose hosted replica found its log damaged while serving a read
/// (a frame of a sealed segment failing its CRC: bit rot that opening the
/// log did not look for, since only a log that stopped uncleanly or failed
/// is verified in full). Shared by the registry and each hosted
/// [`Partition`], which records the damage itself ([`Partition::damage`]);
/// [`GroupRegistry::stopped_on_error`] reports those groups, so the
/// reconciler stops them and starts them again with every segment verified:
/// the replica keeps its valid prefix and fetches the rest from a healthy
/// replica (`crate::control::recovery`) instead of refusing the same read
/// forever.
#[derive(Clone, Debug, Default)]
pub struct Damaged(Arc<std::sync::Mutex<BTreeSet<GroupId>>>);

impl Damaged {
    /// Records that the replica of `group` found damage.
    pub fn report(&self, group: GroupId) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(group);
    }

    fn groups(&self) -> Vec<GroupId> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect()
    }

    fn forget(&self, group: GroupId) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&group);
    }
}

/// A set of groups something happened to, shared by the registry, its
/// leadership watcher and each hosted [`Partition`] (a write that wakes a
/// parked leader), or kept by `crate::control::liveness` (groups whose
/// leader changed in the pings), and drained by `crate::control::quiesce`.
#[derive(Clone, Debug, Default)]
pub struct Stirred(Arc<std::sync::Mutex<BTreeSet<GroupId>>>);

impl Stirred {
    /// Adds `groups` to the set.
    pub fn stir(&self, groups: impl IntoIterator<Item = GroupId>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend(groups);
    }

    /// Empties the set, returning what it held.
    pub fn take(&self) -> BTreeSet<GroupId> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Where the leadership watcher learns of newly registered groups.
type NewGroups = tokio::sync::mpsc::UnboundedSender<(GroupId, RaftNode)>;

/// How long the leadership watcher gathers change notifications before it
/// looks at the groups that changed: under load a leader's state changes
/// with every write, and pings (every heartbeat interval, 100 ms by
/// default) need the answer no fresher than this.
pub const LEADERSHIP_COALESCE: std::time::Duration = std::time::Duration::from_millis(100);

impl GroupRegistry {
    /// Adds (or replaces) the replica of `group`; a partition's also
    /// becomes the one its topic and partition name.
    pub fn insert(&self, group: GroupId, hosted: HostedGroup) {
        let mut g = self.groups.write().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = &hosted.partition {
            debug_assert_eq!(p.group, group, "a partition registered under another group id");
            p.report_to(self.stirred.clone(), self.damaged.clone());
            g.by_name.insert((p.topic.clone(), p.partition), group);
        }
        let raft = hosted.raft.clone();
        g.by_id.insert(group, hosted);
        drop(g);
        self.update_leadership(group);
        self.stir([group]);
        if let Some(w) = self.watcher.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = w.send((group, raft));
        }
    }

    /// Marks `groups` as stirred ([`GroupRegistry::take_stirred`]): for a
    /// change the nodes do not report (a partition's replica list).
    pub fn stir(&self, groups: impl IntoIterator<Item = GroupId>) {
        self.stirred.stir(groups);
    }

    /// The groups registered, whose Raft node's state changed (a write,
    /// a follower's progress, a new role or leader: whatever the node
    /// reports, coalesced by [`GroupRegistry::watch_leadership`]), whose
    /// parked leader a write woke, or that [`GroupRegistry::stir`] named,
    /// since the last call. One consumer (`crate::control::quiesce`), which
    /// looks again only at what changed instead of at every group each round.
    pub fn take_stirred(&self) -> BTreeSet<GroupId> {
        self.stirred.take()
    }

    fn forget_leading(&self) {
        *self.leading_cache.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Removes the replica of `group`, returning it, and forgets its
    /// hand-over (a stopped group's entry would otherwise stay forever:
    /// `crate::control::checkquorum` only updates the groups it still examines).
    pub fn remove(&self, group: GroupId) -> Option<HostedGroup> {
        self.handing_over.write().unwrap_or_else(|p| p.into_inner()).remove(&group);
        let mut g = self.groups.write().unwrap_or_else(|p| p.into_inner());
        let removed = g.by_id.remove(&group);
        if let Some(p) = removed.as_ref().and_then(|h| h.partition.as_ref()) {
            let key = (p.topic.clone(), p.partition);
            if g.by_name.get(&key) == Some(&group) {
                g.by_name.remove(&key);
            }
        }
        drop(g);
        self.led.write().unwrap_or_else(|p| p.into_inner()).remove(&group);
        self.fatal.write().unwrap_or_else(|p| p.into_inner()).remove(&group);
        self.damaged.forget(group);
        self.forget_leading();
        removed
    }

    /// The term `group`'s replica here leads, if it leads and runs.
    fn leads(&self, group: GroupId) -> Option<u64> {
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        g.by_id.get(&group)?.raft.state(|s| (s.is_leader() && s.is_running()).then(|| s.term()))
    }

    /// Looks at whether the replica of `group` leads (and runs) now, and
    /// records it for [`GroupRegistry::leading`]. Cheap when nothing
    /// changed (the common case: a busy group's state changes with every
    /// write); a change is written after reading the state again under the
    /// lock, so of concurrent callers the last reading wins.
    fn update_leadership(&self, group: GroupId) {
        self.update_fatal(group);
        let recorded = self.led.read().unwrap_or_else(|p| p.into_inner()).get(&group).copied();
        if recorded == self.leads(group) {
            return;
        }
        let mut led = self.led.write().unwrap_or_else(|p| p.into_inner());
        let changed = match self.leads(group) {
            Some(term) => led.insert(group, term) != Some(term),
            None => led.remove(&group).is_some(),
        };
        drop(led);
        if changed {
            self.forget_leading();
        }
    }

    /// Records whether the replica of `group` has stopped on an error.
    fn update_fatal(&self, group: GroupId) {
        let fatal = {
            let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
            let Some(h) = g.by_id.get(&group) else { return };
            h.raft.state(|s| s.fatal())
        };
        let mut map = self.fatal.write().unwrap_or_else(|p| p.into_inner());
        match fatal {
            Some(e) => map.insert(group, e),
            None => map.remove(&group),
        };
    }

    /// Keeps [`GroupRegistry::leading`] current, forever: one task listens
    /// to every hosted node's change notifications (a quiet group costs
    /// nothing) and, every [`LEADERSHIP_COALESCE`] at most, looks again at
    /// the groups that changed. Run it once per broker.
    pub async fn watch_leadership(self) {
        use futures::{FutureExt, StreamExt};
        /// Hands [`GroupRegistry::leading`] back to computing on every call
        /// once the watcher ends (the broker stops).
        struct Unwatch(GroupRegistry);
        impl Drop for Unwatch {
            fn drop(&mut self) {
                *self.0.watcher.lock().unwrap_or_else(|p| p.into_inner()) = None;
            }
        }
        fn tagged(
            g: GroupId,
            raft: &RaftNode,
        ) -> impl futures::Stream<Item = GroupId> + Send + Unpin + use<> {
            // Once more when the node stops (its stream ends), so a fatal
            // error it stopped on is seen even if no change came with it.
            raft.changes().map(move |()| g).chain(futures::stream::iter([g]))
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        *self.watcher.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx.clone());
        let _unwatch = Unwatch(self.clone());
        for (g, h) in self.all() {
            let _ = tx.send((g, h.raft));
        }
        drop(tx);
        let mut changes = futures::stream::SelectAll::new();
        let mut changed: BTreeSet<GroupId> = BTreeSet::new();
        loop {
            tokio::select! {
                new = rx.recv() => match new {
                    Some((g, raft)) => {
                        changes.push(tagged(g, &raft));
                        changed.insert(g);
                    }
                    None => return,
                },
                Some(g) = changes.next(), if !changes.is_empty() => {
                    changed.insert(g);
                }
            }
            // Gather what else changed meanwhile, then look once per group.
            tokio::time::sleep(LEADERSHIP_COALESCE).await;
            // The changes that are ready, outside tokio's cooperative budget
            // (128 ready operations per poll of a task, after which the
            // notifications read as not ready): while 10,000 new groups
            // elected, their changes came faster than 128 per round, and
            // leaders went unannounced for a minute while their followers
            // took them for dead and campaigned. At most one per watched
            // group: a group is looked at once however often it changed,
            // and later changes are seen next round.
            for _ in 0..changes.len() {
                match tokio::task::coop::unconstrained(changes.next()).now_or_never() {
                    Some(Some(g)) => {
                        changed.insert(g);
                    }
                    _ => break,
                }
            }
            while let Ok((g, raft)) = rx.try_recv() {
                changes.push(tagged(g, &raft));
                changed.insert(g);
            }
            for g in &changed {
                self.update_leadership(*g);
            }
            self.stir(std::mem::take(&mut changed));
        }
    }

    /// Records that every replica the metadata assigns this broker has been
    /// opened once since the broker started (see [`GroupRegistry::replicas_open`]).
    pub fn set_replicas_open(&self) {
        self.replicas_open.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether every replica the metadata assigns this broker has been
    /// opened once since it started: until then a leader's heartbeat to a
    /// group not yet open here fails, so leaders elsewhere wait for this
    /// (reported in pings, `crate::control::liveness`) before waking to catch up
    /// their followers here.
    pub fn replicas_open(&self) -> bool {
        self.replicas_open.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records that the broker has begun a controlled shutdown
    /// (`crate::control::handover`): from now on it campaigns for no group,
    /// refuses leaderships handed to it, and says so in its pings, so that
    /// no peer picks it as a hand-over target. There is no way back: the
    /// process exits at the end of the shutdown.
    pub fn set_draining(&self) {
        self.draining.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether the broker is in a controlled shutdown ([`GroupRegistry::set_draining`]).
    pub fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records the lowest group id the reconciler is still opening in its
    /// current pass, 0 when it opens none (see [`GroupRegistry::opening_floor`]).
    pub fn set_opening_floor(&self, floor: u64) {
        self.opening_floor.store(floor, std::sync::atomic::Ordering::Relaxed);
    }

    /// The lowest group id whose replica here the reconciler is still
    /// opening, 0 when it opens none: every group below it that the
    /// metadata assigns this broker is open (or failed to open). Reported in
    /// pings, so a replica elsewhere campaigns for a new group only once a
    /// majority of its replicas can vote (`crate::control::quiesce`): group
    /// ids grow with creation and every broker opens in group order, so
    /// when thousands of partitions are created, a campaign sent before the
    /// voters had opened the group would fail and back off, and hold the
    /// campaigner's budget meanwhile.
    pub fn opening_floor(&self) -> u64 {
        self.opening_floor.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the replica of `group` here leads and runs, as the
    /// leadership watcher last saw it (see [`GroupRegistry::leading`]).
    pub fn is_led(&self, group: GroupId) -> bool {
        self.led.read().unwrap_or_else(|p| p.into_inner()).contains_key(&group)
    }

    /// Ids of the hosted groups whose replica here is the Raft leader, is
    /// running (a group stopped on an error, e.g. a full disk, keeps
    /// reporting the leader state it stopped in, so it is left out: its
    /// followers must not stay parked trusting it) and is not handing over
    /// (see [`GroupRegistry::set_handing_over`]).
    ///
    /// Every broker's pings ask for it (each broker pings every other once
    /// per heartbeat interval), so it is not computed by reading every
    /// hosted group's state (at 3,000 groups that was most of an idle
    /// broker's CPU): [`GroupRegistry::watch_leadership`] keeps it current,
    /// a leadership won or lost here showing up to [`LEADERSHIP_COALESCE`]
    /// later (a hand-over at once). Without the watcher running (tests that
    /// host groups without a broker) it is computed on every call.
    pub fn leading(&self) -> Arc<Vec<GroupId>> {
        let watched = self.watcher.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        if !watched {
            for g in self.all().into_iter().map(|(g, _)| g) {
                self.update_leadership(g);
            }
        }
        let mut cache = self.leading_cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(list) = cache.as_ref() {
            return list.clone();
        }
        let led = self.led.read().unwrap_or_else(|p| p.into_inner());
        let handing_over = self.handing_over.read().unwrap_or_else(|p| p.into_inner());
        let mut list: Vec<GroupId> =
            led.iter().filter(|(g, term)| handing_over.get(g) != Some(term)).map(|(g, _)| *g).collect();
        list.sort_unstable();
        let list = Arc::new(list);
        *cache = Some(list.clone());
        list
    }

    /// Records that this broker's leader of `group` hands over `term`
    /// (`None`: it does not): for that term the group is left out of
    /// [`GroupRegistry::leading`], which pings report, so followers that
    /// parked their tickers trusting this leader start them again.
    pub fn set_handing_over(&self, group: GroupId, term: Option<u64>) {
        let mut map = self.handing_over.write().unwrap_or_else(|p| p.into_inner());
        match term {
            Some(t) => map.insert(group, t),
            None => map.remove(&group),
        };
        drop(map);
        self.forget_leading();
    }

    /// Whether this broker's leader of `group` hands over `term` (see
    /// [`GroupRegistry::set_handing_over`]).
    pub fn hands_over(&self, group: GroupId, term: u64) -> bool {
        self.handing_over.read().unwrap_or_else(|p| p.into_inner()).get(&group) == Some(&term)
    }

    /// Every hosted group.
    pub fn all(&self) -> Vec<(GroupId, HostedGroup)> {
        let groups = self.groups.read().unwrap_or_else(|p| p.into_inner());
        groups.by_id.iter().map(|(g, h)| (*g, h.clone())).collect()
    }

    /// The replica of `group`, if hosted here.
    pub fn get(&self, group: GroupId) -> Option<HostedGroup> {
        self.groups.read().unwrap_or_else(|p| p.into_inner()).by_id.get(&group).cloned()
    }

    /// Whether a replica of `group` is hosted here.
    pub fn contains(&self, group: GroupId) -> bool {
        self.groups.read().unwrap_or_else(|p| p.into_inner()).by_id.contains_key(&group)
    }

    /// The hosted replica of `topic`/`partition` (its newest group).
    pub fn partition(&self, topic: &str, partition: u32) -> Option<Arc<Partition>> {
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        let group = g.by_name.get(&(topic.to_owned(), partition))?;
        g.by_id.get(group).and_then(|h| h.partition.clone())
    }

    /// The leader of partition `a`: as the local replica knows it, or, for
    /// a partition not hosted here (or whose replica knows none: just
    /// restarted, its idle leader has not sent a heartbeat yet), the
    /// replica's broker whose last ping to `me` listed the group among
    /// those it leads (`liveness`). 0 when unknown. Looked up by group id
    /// (this incarnation's replica, no key to build: a Metadata answer
    /// does this for every partition).
    pub fn leader_of(
        &self,
        liveness: &crate::control::liveness::Liveness,
        me: crate::config::BrokerId,
        a: &crate::metadata::command::PartitionAssignment,
    ) -> crate::config::BrokerId {
        if let Some(b) = self.partition_of(a.group).and_then(|p| p.leader_broker()) {
            return b;
        }
        a.replicas.iter().map(|r| r.broker).find(|b| *b != me && liveness.leads(*b, a.group)).unwrap_or(0)
    }

    /// The hosted partition of `group`, if it is one.
    pub fn partition_of(&self, group: GroupId) -> Option<Arc<Partition>> {
        self.groups
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_id
            .get(&group)
            .and_then(|h| h.partition.clone())
    }

    /// The hosted groups whose replica is recovering (`crate::control::recovery`).
    pub fn recovering(&self) -> Vec<(GroupId, HostedGroup)> {
        if Replica::recovering_count() == 0 {
            // None in the process: no look at every group (asked every second).
            return Vec::new();
        }
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        g.by_id.iter().filter(|(_, h)| h.replica.is_recovering()).map(|(id, h)| (*id, h.clone())).collect()
    }

    /// The hosted partitions whose Raft node stopped on an error, or whose
    /// replica found its log damaged while serving a read ([`Damaged`]),
    /// with the error. Reads each group's state in place (no copy of the
    /// registry): the reconciler asks every second.
    pub fn stopped_on_error(&self) -> Vec<(Arc<Partition>, String)> {
        let watched = self.watcher.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(Arc<Partition>, String)> = if watched {
            // Kept by the watcher: no look at every group each time.
            let fatal = self.fatal.read().unwrap_or_else(|p| p.into_inner());
            fatal
                .iter()
                .filter_map(|(id, e)| Some((g.by_id.get(id)?.partition.clone()?, e.clone())))
                .collect()
        } else {
            g.by_id
                .values()
                .filter_map(|h| {
                    let p = h.partition.as_ref()?;
                    h.raft.state(|s| s.fatal()).map(|fatal| (p.clone(), fatal))
                })
                .collect()
        };
        for id in self.damaged.groups() {
            // A report from a replica since stopped (a read that was still
            // running) names damage the hosted one has not found.
            let hosted = g.by_id.get(&id).and_then(|h| h.partition.clone());
            match hosted.as_ref().and_then(|p| p.damage().map(|why| (p.clone(), why))) {
                Some((p, why)) if !out.iter().any(|(q, _)| q.group == id) => {
                    out.push((p, format!("damage was found in its log: {why}")));
                }
                Some(_) => {}
                None => self.damaged.forget(id),
            }
        }
        out
    }

    /// Every hosted partition replica (the metadata group left out).
    pub fn partitions(&self) -> Vec<Arc<Partition>> {
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        g.by_id.values().filter_map(|h| h.partition.clone()).collect()
    }

    /// How many partition replicas are hosted here (the metadata group left out).
    pub fn partition_count(&self) -> usize {
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        g.by_id.values().filter(|h| h.partition.is_some()).count()
    }

    /// Every hosted partition replica whose group id `keep` accepts. Looks
    /// only at group ids for the others (does not touch their replicas).
    /// `keep` runs under this registry's lock and must not call into it
    /// (the leadership watcher holds `led` while it takes this lock, so an
    /// [`GroupRegistry::is_led`] inside `keep` could deadlock).
    pub fn partitions_where(&self, keep: impl Fn(GroupId) -> bool) -> Vec<Arc<Partition>> {
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        g.by_id.iter().filter(|(id, _)| keep(**id)).filter_map(|(_, h)| h.partition.clone()).collect()
    }

    /// The hosted partitions among `groups` (ids not hosted, or of the
    /// metadata group, are skipped), in one look at the registry (under
    /// its read lock, as [`GroupRegistry::partitions_where`]).
    pub fn partitions_among(&self, groups: impl IntoIterator<Item = GroupId>) -> Vec<Arc<Partition>> {
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        groups.into_iter().filter_map(|id| g.by_id.get(&id)?.partition.clone()).collect()
    }

    /// The hosted partitions `keep` selects, in one look at the registry
    /// (for loops that need only a few of thousands: only those are cloned).
    /// `keep` runs under the registry's read lock: it must not call into
    /// the registry (a writer queued meanwhile would deadlock it) and
    /// should be cheap (atomics, local maps).
    pub fn partitions_matching(&self, keep: impl Fn(&Partition) -> bool) -> Vec<Arc<Partition>> {
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        g.by_id.values().filter_map(|h| h.partition.as_ref().filter(|p| keep(p)).cloned()).collect()
    }
}

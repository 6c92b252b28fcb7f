//! A node's Raft library instance, kept running only while it is needed.
//!
//! Each running instance of the Raft library costs a replica about 65 KB
//! of fixed state (its statistics histograms and the first blocks of its
//! channels) and a few tasks, whatever the group does: most of an idle
//! replica's memory (measured with heaptrack at 1,000 partitions). A
//! follower of a quiet group has nothing to do until its leader writes or
//! someone campaigns, so the broker may make it **dormant**
//! ([`crate::RaftNode::make_dormant`]): the instance stops and only its
//! last published state is kept, read as before through
//! [`crate::RaftNode::state`]. The next call that needs the library (a
//! peer's message, a campaign, a proposal) starts a new instance over the
//! same storage first, as a restart would: Raft's safety rests only on what
//! the storage keeps (the vote, the log; Raft paper §5), which stays open
//! and untouched meanwhile.
//!
//! A node is made dormant only when nothing is using it (no call in
//! progress), it has been unused for the asked idle time, it follows a
//! known leader, and everything in its log is committed and applied. A new
//! instance takes the whole stored log as flushed (openraft counts only
//! the vote as flushed at start, and the next heartbeat that matches a
//! stored entry marks the log flushed up to it without any IO), so the log
//! is fsynced after the old instance stopped and before any new instance
//! may start; if that fsync fails, the node stops for good with the error
//! in its state, as a running node stops on a failed flush. Starting and
//! stopping instances run in their own tasks, holding the node's
//! transition lock to the end: a caller that gives up midway (a dropped
//! request, a broker stopping) cannot leave two instances over one log, or
//! one started before the fsync.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use ferrolog_raft_store::Replica;
use ferrolog_raft_store::state_machine::PartitionRaft;
use ferrolog_raft_store::types::TypeConfig;
use futures::future::BoxFuture;
use openraft::async_runtime::watch::WatchReceiver;

use crate::node::NodeError;

/// Starts a new instance of the Raft library for the node, its ticker and
/// election timer switched as given (`tick`, `elect`).
pub(crate) type Starter =
    Box<dyn Fn(bool, bool) -> BoxFuture<'static, Result<PartitionRaft, NodeError>> + Send + Sync>;

/// How long a new instance may take to publish the state it read from the
/// storage; the node runs on without waiting longer (with a warning).
const STARTUP_WAIT: Duration = Duration::from_secs(5);

/// How many nodes of this process are dormant now.
static DORMANT: AtomicUsize = AtomicUsize::new(0);

/// How many times a dormant node of this process was started again, by
/// the call that needed it.
static WOKEN: LazyLock<std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>> =
    LazyLock::new(Default::default);

/// Now, for timestamps in atomics: ms on
/// [`ferrolog_raft_store::runtime::monotonic_ms`]'s clock.
fn now_ms() -> u64 {
    ferrolog_raft_store::runtime::monotonic_ms()
}

/// How many nodes of this process are dormant now (see the module's
/// documentation).
pub fn dormant_count() -> usize {
    DORMANT.load(Ordering::Relaxed)
}

/// How many times a dormant node of this process has been started again
/// since the process started.
pub fn woken_count() -> u64 {
    WOKEN.lock().unwrap_or_else(|p| p.into_inner()).values().sum()
}

/// How many times dormant nodes of this process have been started again
/// since the process started, by the name of the call that needed them
/// (`handle_append`, `vote`, `campaign`, ...).
pub fn woken_by() -> Vec<(&'static str, u64)> {
    WOKEN.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (*k, *v)).collect()
}

/// Counts one dormant node while it lives.
struct Counted;

impl Counted {
    fn new() -> Self {
        DORMANT.fetch_add(1, Ordering::Relaxed);
        Self
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        DORMANT.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The node's instance, or the state it last published: counted as
/// dormant until it stops for good.
enum Slot {
    Running(PartitionRaft),
    Dormant(Box<openraft::RaftMetrics<TypeConfig>>, Option<Counted>),
}

/// What every clone of one [`crate::RaftNode`] shares.
pub(crate) struct Lifecycle {
    slot: RwLock<Slot>,
    /// Calls in progress that hold the running instance ([`InUse`]).
    in_use: AtomicUsize,
    /// When the last call that used the instance ended, ms on [`now_ms`]'s clock.
    last_used_ms: AtomicU64,
    /// Serialises starting and stopping instances; held by the task that
    /// does either, to its end.
    transition: Arc<tokio::sync::Mutex<()>>,
    start: Starter,
    replica: Replica,
    /// The ticker and election-timer switches, applied to each new instance.
    ticking: AtomicBool,
    elections: AtomicBool,
    /// Bumped whenever the node goes dormant or wakes, for [`Lifecycle::changes`].
    incarnation: tokio::sync::watch::Sender<u64>,
    /// Shut down for good (or could not start again).
    stopped: AtomicBool,
    /// [`crate::InjectedBug::AckBeforeCommit`] is on (debug builds only).
    pub(crate) ack_before_commit: AtomicBool,
    /// [`crate::InjectedBug::VoteWhileRecovering`] is on.
    pub(crate) vote_while_recovering: AtomicBool,
    /// Until when (ms on [`now_ms`]'s clock) the dormant node keeps the lease of
    /// the leader whose heartbeat it acknowledged from its kept state: as a
    /// running follower does (Raft thesis §4.2.3, §6.4), it refuses other
    /// candidates' votes meanwhile.
    lease_until_ms: AtomicU64,
}

/// The running instance, held by a call in progress: the node does not go
/// dormant meanwhile.
pub(crate) struct InUse<'a> {
    raft: PartitionRaft,
    of: &'a Lifecycle,
}

impl std::ops::Deref for InUse<'_> {
    type Target = PartitionRaft;
    fn deref(&self) -> &PartitionRaft {
        &self.raft
    }
}

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        self.of.last_used_ms.store(now_ms(), Ordering::Relaxed);
        self.of.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Lifecycle {
    /// A running node: `raft`, started by `start` (which starts it again
    /// after it was dormant) over `replica`.
    pub(crate) fn new(
        raft: PartitionRaft,
        start: Starter,
        replica: Replica,
        config: &openraft::Config,
    ) -> Self {
        Self {
            slot: RwLock::new(Slot::Running(raft)),
            in_use: AtomicUsize::new(0),
            last_used_ms: AtomicU64::new(now_ms()),
            transition: Arc::new(tokio::sync::Mutex::new(())),
            start,
            replica,
            ticking: AtomicBool::new(config.enable_tick),
            elections: AtomicBool::new(config.enable_elect),
            incarnation: tokio::sync::watch::Sender::new(0),
            stopped: AtomicBool::new(false),
            ack_before_commit: AtomicBool::new(false),
            vote_while_recovering: AtomicBool::new(false),
            lease_until_ms: AtomicU64::new(0),
        }
    }

    /// The replica the node runs over.
    pub(crate) fn replica(&self) -> &Replica {
        &self.replica
    }

    fn slot(&self) -> std::sync::RwLockReadGuard<'_, Slot> {
        // A panic while the slot was written left it whole (one assignment).
        self.slot.read().unwrap_or_else(|p| p.into_inner())
    }

    fn slot_mut(&self) -> std::sync::RwLockWriteGuard<'_, Slot> {
        self.slot.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Calls `f` with the running instance (`Some`) or the dormant node's
    /// last published state (`None` and the state).
    pub(crate) fn with<R>(
        &self,
        f: impl FnOnce(Result<&PartitionRaft, &openraft::RaftMetrics<TypeConfig>>) -> R,
    ) -> R {
        match &*self.slot() {
            Slot::Running(raft) => f(Ok(raft)),
            Slot::Dormant(m, _) => f(Err(m)),
        }
    }

    /// Calls `f` with a dormant node's kept state while nothing starts or
    /// stops it (its transition lock held); `None` if it runs, is starting
    /// or stopping, or has stopped for good (or on an error).
    pub(crate) fn with_dormant<R>(
        &self,
        f: impl FnOnce(&openraft::RaftMetrics<TypeConfig>) -> R,
    ) -> Option<R> {
        let _serial = self.transition.try_lock().ok()?;
        if self.stopped.load(Ordering::Acquire) {
            return None;
        }
        match &*self.slot() {
            Slot::Dormant(m, _) if m.running_state.is_ok() && m.state == openraft::ServerState::Follower => {
                Some(f(m))
            }
            _ => None,
        }
    }

    /// Records that the dormant node acknowledged its leader's heartbeat:
    /// it keeps that leader's lease for `lease` from now.
    pub(crate) fn lease_for(&self, lease: Duration) {
        self.lease_until_ms.store(now_ms() + lease.as_millis() as u64, Ordering::Relaxed);
    }

    /// Whether a lease recorded by [`Lifecycle::lease_for`] still runs.
    pub(crate) fn leased(&self) -> bool {
        self.lease_until_ms.load(Ordering::Relaxed) > now_ms()
    }

    /// The last log id in the node's storage.
    pub(crate) fn last_log_id(&self) -> Option<ferrolog_raft_store::types::LogId> {
        self.replica.last_log_id()
    }

    /// Whether the node is dormant now.
    pub(crate) fn is_dormant(&self) -> bool {
        matches!(&*self.slot(), Slot::Dormant(..))
    }

    /// The running instance, started again first if the node is dormant;
    /// `why` names the call, for [`woken_by`].
    ///
    /// # Errors
    /// The node was shut down, or a new instance could not start.
    pub(crate) async fn running(self: &Arc<Self>, why: &'static str) -> Result<InUse<'_>, String> {
        loop {
            {
                let slot = self.slot();
                if let Slot::Running(raft) = &*slot {
                    // Counted under the slot's lock: `make_dormant` checks the
                    // count under the same lock, so it never stops an
                    // instance a call has just taken.
                    self.in_use.fetch_add(1, Ordering::AcqRel);
                    return Ok(InUse { raft: raft.clone(), of: self });
                }
            }
            if self.stopped.load(Ordering::Acquire) {
                return Err("raft stopped: the node was shut down".into());
            }
            let this = self.clone();
            tokio::spawn(async move { this.wake(why).await })
                .await
                .map_err(|e| format!("starting a dormant node: {e}"))??;
        }
    }

    /// Starts a new instance if the node is dormant; run in its own task
    /// (see the module's documentation).
    async fn wake(self: Arc<Self>, why: &'static str) -> Result<(), String> {
        let _serial = self.transition.clone().lock_owned().await;
        if self.stopped.load(Ordering::Acquire) {
            return Err("raft stopped: the node was shut down".into());
        }
        let Some((term, applied)) =
            self.with(|node| node.err().map(|m| (m.current_term, m.last_applied.as_ref().map(|l| l.index))))
        else {
            return Ok(());
        };
        let began = Instant::now();
        let (tick, elect) = (self.ticking.load(Ordering::Acquire), self.elections.load(Ordering::Acquire));
        let raft = match (self.start)(tick, elect).await {
            Ok(raft) => raft,
            Err(e) => {
                let e = format!("a dormant node cannot start again: {e}");
                self.fail(&e);
                return Err(e);
            }
        };
        // `Raft::new` returns before the instance has published what it
        // read from the storage: its state is blank (no term, leader or
        // membership) until then, and the broker's loops would act on it.
        let loaded = raft
            .wait(Some(STARTUP_WAIT))
            .metrics(
                move |m| m.current_term >= term && m.last_applied.as_ref().map(|l| l.index) >= applied,
                "started",
            )
            .await;
        if let Err(e) = loaded {
            tracing::warn!("a woken node has not published its stored state within {STARTUP_WAIT:?}: {e}");
        }
        let mut slot = self.slot_mut();
        // The switches as last set, under the slot's lock, as
        // `set_ticking` and `set_elections` read the slot.
        raft.runtime_config().tick(self.ticking.load(Ordering::Acquire));
        raft.runtime_config().elect(self.elections.load(Ordering::Acquire));
        *slot = Slot::Running(raft);
        drop(slot);
        self.last_used_ms.store(now_ms(), Ordering::Relaxed);
        self.incarnation.send_modify(|n| *n += 1);
        *WOKEN.lock().unwrap_or_else(|p| p.into_inner()).entry(why).or_default() += 1;
        tracing::trace!(took_us = began.elapsed().as_micros() as u64, "dormant node woke");
        Ok(())
    }

    /// Stops a dormant node for good on `error`, kept in its state (as
    /// [`crate::State::fatal`]) for the broker's failure handling.
    fn fail(&self, error: &str) {
        self.stopped.store(true, Ordering::Release);
        if let Slot::Dormant(m, counted) = &mut *self.slot_mut() {
            use openraft::error::ErrorSource;
            let source = openraft::impls::BoxedErrorSource::from_string(error);
            m.running_state = Err(openraft::error::Fatal::StorageError(openraft::StorageError::read(source)));
            m.state = openraft::ServerState::Shutdown;
            counted.take();
        }
        self.incarnation.send_modify(|n| *n += 1);
        tracing::error!("{error}");
    }

    /// Switches the ticker of this and every later instance.
    pub(crate) fn set_ticking(&self, on: bool) {
        let slot = self.slot();
        self.ticking.store(on, Ordering::Release);
        if let Slot::Running(raft) = &*slot {
            raft.runtime_config().tick(on);
        }
    }

    /// Switches the election timer of this and every later instance.
    pub(crate) fn set_elections(&self, on: bool) {
        let slot = self.slot();
        self.elections.store(on, Ordering::Release);
        if let Slot::Running(raft) = &*slot {
            raft.runtime_config().elect(on);
        }
    }

    /// Stops the running instance if the node may go dormant (see the
    /// module's documentation) and has been unused for `idle`. Returns
    /// whether it went dormant.
    ///
    /// # Errors
    /// [`NodeError::Stopped`]: the log could not be fsynced; the node has
    /// stopped for good, with the error in its state.
    pub(crate) async fn make_dormant(self: &Arc<Self>, idle: Duration) -> Result<bool, NodeError> {
        let Ok(serial) = self.transition.clone().try_lock_owned() else { return Ok(false) };
        if self.stopped.load(Ordering::Acquire) {
            return Ok(false);
        }
        let raft = {
            let mut slot = self.slot_mut();
            let Slot::Running(raft) = &*slot else { return Ok(false) };
            let unused_for = now_ms().saturating_sub(self.last_used_ms.load(Ordering::Relaxed));
            if self.in_use.load(Ordering::Acquire) > 0 || unused_for < idle.as_millis() as u64 {
                return Ok(false);
            }
            let metrics = raft.metrics();
            let m = metrics.borrow_watched().clone();
            if !may_sleep(&m) {
                return Ok(false);
            }
            let raft = raft.clone();
            *slot = Slot::Dormant(Box::new(m), Some(Counted::new()));
            raft
        };
        self.incarnation.send_modify(|n| *n += 1);
        let this = self.clone();
        let stop = tokio::spawn(async move {
            let _serial = serial;
            if let Err(e) = raft.shutdown().await {
                tracing::warn!("stopping a node that went dormant: {e}");
            }
            drop(raft);
            let replica = this.replica.clone();
            let fs = replica.fs().clone();
            let synced = match ferrolog_raft_store::runtime::blocking(&*fs, move || replica.sync()).await {
                Ok(Ok(())) => return Ok(true),
                Ok(Err(e)) => e.to_string(),
                Err(e) => e.to_string(),
            };
            let e = format!("fsync of a dormant node's log: {synced}");
            this.fail(&e);
            Err(NodeError::Stopped(e))
        });
        stop.await.map_err(|e| NodeError::Stopped(format!("making a node dormant: {e}")))?
    }

    /// Stops the node for good and waits for its instance's tasks.
    ///
    /// # Errors
    /// A task that panicked or could not be joined.
    pub(crate) async fn shutdown(&self) -> Result<(), NodeError> {
        let _serial = self.transition.lock().await;
        self.stopped.store(true, Ordering::Release);
        let raft = match &mut *self.slot_mut() {
            Slot::Running(raft) => Some(raft.clone()),
            Slot::Dormant(m, counted) => {
                m.state = openraft::ServerState::Shutdown;
                counted.take();
                None
            }
        };
        self.incarnation.send_modify(|n| *n += 1);
        match raft {
            Some(raft) => raft.shutdown().await.map_err(|e| NodeError::Stopped(e.to_string())),
            None => Ok(()),
        }
    }

    /// A stream that yields whenever the node's state may have changed
    /// since it was made (including going dormant and waking), and ends
    /// when the node stops for good.
    pub(crate) fn changes(
        self: &Arc<Self>,
    ) -> impl futures::Stream<Item = ()> + Send + Unpin + 'static + use<> {
        type Metrics = openraft::alias::WatchReceiverOf<TypeConfig, openraft::RaftMetrics<TypeConfig>>;
        struct Watch {
            of: Arc<Lifecycle>,
            incarnations: tokio::sync::watch::Receiver<u64>,
            /// The running instance's state and its incarnation; `None`
            /// while dormant.
            current: Option<(u64, Metrics)>,
        }
        impl Watch {
            /// Looks at the node's present incarnation.
            fn refresh(&mut self) {
                let seen = *self.incarnations.borrow_and_update();
                self.current = self.of.with(|r| r.ok().map(|raft| (seen, raft.metrics())));
            }
        }
        // Taken now, not at the first poll: a change between the two is seen.
        let incarnations = self.incarnation.subscribe();
        let seen = *incarnations.borrow();
        let current = self.with(|r| r.ok().map(|raft| (seen, raft.metrics())));
        let watch = Watch { of: self.clone(), incarnations, current };
        Box::pin(futures::stream::unfold(watch, |mut w| async move {
            match w.current.as_mut() {
                Some((seen, rx)) => {
                    if rx.changed().await.is_ok() {
                        return Some(((), w));
                    }
                    // That instance stopped: it went dormant (a newer
                    // incarnation), or stopped for good (on an error, or
                    // shut down).
                    let seen = *seen;
                    if *w.incarnations.borrow() == seen || w.of.stopped.load(Ordering::Acquire) {
                        return None;
                    }
                    w.refresh();
                    Some(((), w))
                }
                None => {
                    if w.of.stopped.load(Ordering::Acquire) {
                        return None;
                    }
                    // Dormant: nothing changes until it wakes or stops.
                    w.incarnations.changed().await.ok()?;
                    w.refresh();
                    Some(((), w))
                }
            }
        }))
    }
}

/// Whether a node in state `m` may go dormant: a follower of a known
/// leader, running, with every entry of its log committed and applied.
fn may_sleep(m: &openraft::RaftMetrics<TypeConfig>) -> bool {
    let applied = m.last_applied.as_ref().map(|l| l.index);
    m.state == openraft::ServerState::Follower
        && m.running_state.is_ok()
        && m.current_leader.is_some()
        && m.current_leader != Some(m.id)
        && m.local_committed.as_ref().map(|l| l.index) == applied
        && m.last_log_index == applied
}

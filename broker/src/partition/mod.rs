//! One partition replica hosted on this broker: its Raft node and storage,
//! and the leader-side handling of produce, fetch and offset requests.
//!
//! - [`records`]: request records ⇄ stored batch, size limits.
//! - [`sequencer`]: idempotent producer checks before proposing (KIP-98).
//! - [`kafka_batch`]: Kafka's record batch as stored and served (issue 14).
//! - [`kafka_codec`]: Kafka's compression codecs, bounded decompression.
//!
//! A request for a partition is served only by its leader, and only once the
//! leader has applied an entry of its own term: then everything committed
//! by earlier leaders is applied, so its high watermark and producer state
//! are complete (Raft paper §5.4.2, §8).

pub mod kafka_batch;
pub mod kafka_codec;
pub mod records;
pub mod sequencer;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use ferrolog_raft_store::{Leadership, SequenceCheck};
use ferrolog_raft_store::{RecordBatch, Replica, StoreError, StoredBatch};
use ferrolog_replica::{NodeId, ProposeError, RaftNode, State};
use tokio::sync::{Mutex, Notify};
use tracing::Instrument;

use crate::config::BrokerId;
use crate::error::ApiError;
use crate::metadata::command::ReplicaAssignment;
use sequencer::{Sequencer, Verdict};

/// How long a produce waits for a new leader to apply its first entry, or
/// for an earlier batch of the same producer to arrive, before answering a
/// retriable error.
pub const LEADER_READY_WAIT: Duration = Duration::from_secs(3);
const SEQUENCE_GAP_WAIT: Duration = Duration::from_millis(500);

/// Most consumer reads a broker runs at once (each on the blocking pool,
/// up to `limits.max_fetch_bytes` of buffers each); more wait their turn.
pub const READS_IN_FLIGHT: usize = 8;

/// The permits of [`READS_IN_FLIGHT`]: process-wide, so brokers sharing a
/// process (a simulation, an embedding) share them.
static READS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(READS_IN_FLIGHT);

/// One hosted partition replica.
#[derive(Debug)]
pub struct Partition {
    /// Topic name.
    pub topic: String,
    /// Partition number within the topic.
    pub partition: u32,
    /// The partition's Raft group id.
    pub group: u64,
    /// This replica's Raft node id.
    pub node_id: NodeId,
    /// The Raft node.
    pub raft: RaftNode,
    /// The storage.
    pub replica: Replica,
    replicas: RwLock<Vec<ReplicaAssignment>>,
    sequencer: Mutex<Sequencer>,
    sequence_advanced: Notify,
    /// When the last produce was proposed, ms since `created`.
    last_write_ms: AtomicU64,
    /// When this replica last answered a leader's AppendEntries (a
    /// heartbeat included), ms since `created`; 0: never.
    leader_contact_ms: AtomicU64,
    /// When this replica last refused a vote to a candidate whose log is
    /// behind its own, ms since `created`; 0: never.
    outran_candidate_ms: AtomicU64,
    /// That candidate's node id.
    outran_candidate: AtomicU64,
    created: Instant,
    ticking: AtomicBool,
    /// Held while `ticking` changes and the Raft node is told, so the last
    /// change to reach the node is the one `ticking` shows.
    ticking_change: std::sync::Mutex<()>,
    /// When the ticker last started, ms since `created`.
    ticking_since_ms: AtomicU64,
    /// Where a write that wakes the parked ticker says so
    /// (`crate::control::quiesce` then looks at the group again); set when
    /// the partition is registered.
    stirred: std::sync::OnceLock<crate::groups::Stirred>,
    /// Where a read that finds the log damaged reports it (the registry's;
    /// see [`crate::groups::Damaged`]); set when the partition is registered.
    damaged: std::sync::OnceLock<crate::groups::Damaged>,
    /// The first damage a read found in this replica's log.
    damage: std::sync::OnceLock<String>,
    /// Set by [`crate::control::checkquorum`]: this replica leads without a
    /// quorum. A channel, so produces waiting on a commit learn of it at
    /// once without polling.
    quorum_lost: tokio::sync::watch::Sender<bool>,
    /// When this replica may campaign ([`crate::control::quiesce`]).
    pub campaign: crate::control::quiesce::Campaign,
}

/// [`Partition`]s alive in this process.
static LIVE_PARTITIONS: AtomicU64 = AtomicU64::new(0);

impl Drop for Partition {
    fn drop(&mut self) {
        LIVE_PARTITIONS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A proposed batch ([`Partition::produce_begin`]): [`Produced::wait`]
/// gives its base offset once committed.
#[derive(Debug)]
pub struct Produced {
    state: ProducedState,
}

#[derive(Debug)]
enum ProducedState {
    /// A duplicate of an applied batch (KIP-98): its base offset.
    Duplicate(u64),
    /// Proposed; its settling task, and CheckQuorum's verdict.
    Settling {
        settled: tokio::task::JoinHandle<Result<(u64, bool), ApiError>>,
        lost: tokio::sync::watch::Receiver<bool>,
    },
}

impl Produced {
    /// The batch's base offset once a majority has committed it, and
    /// whether it was a duplicate of an applied batch. Waiting on a leader
    /// that has lost its quorum would last until the partition heals; this
    /// answers once that is known (the batch may still commit: an
    /// idempotent retry then gets its offset). Told by CheckQuorum's
    /// verdict, without a timer per request.
    ///
    /// # Errors
    /// Not leader, unavailable, storage errors.
    pub async fn wait(self) -> Result<(u64, bool), ApiError> {
        match self.state {
            ProducedState::Duplicate(offset) => Ok((offset, true)),
            ProducedState::Settling { settled, mut lost } => tokio::select! {
                biased;
                r = settled => {
                    r.unwrap_or_else(|e| Err(ApiError::Unavailable(format!("produce task failed: {e}"))))
                }
                _ = lost.wait_for(|l| *l) => Err(ApiError::Unavailable(
                    "this leader lost its quorum and is handing over; the batch may still commit".into(),
                )),
            },
        }
    }
}

/// Committed records read by a fetch.
#[derive(Debug)]
pub struct FetchOutcome {
    /// Whole batches in offset order (the first may start before the
    /// requested offset).
    pub batches: Vec<StoredBatch>,
    /// The high watermark when read.
    pub high_watermark: u64,
    /// The log start offset.
    pub log_start_offset: u64,
}

/// Raft state of the partition, for `cluster status`.
#[derive(Debug, Clone)]
pub struct PartitionStatus {
    /// Leader broker, if known.
    pub leader: Option<BrokerId>,
    /// Current term.
    pub term: u64,
    /// Commit index.
    pub commit_index: u64,
    /// Last log index.
    pub last_log_index: u64,
    /// High watermark (offsets).
    pub high_watermark: u64,
    /// Log start offset.
    pub log_start_offset: u64,
    /// Each other member of the group; leader only.
    pub followers: Vec<FollowerState>,
}

/// One follower or learner as the leader sees it.
#[derive(Debug, Clone, Copy)]
pub struct FollowerState {
    /// Its broker (0 if the metadata does not place the node).
    pub broker: BrokerId,
    /// Its Raft node id.
    pub node: NodeId,
    /// Raft index of the last entry known replicated to it.
    pub matched: Option<u64>,
    /// Whether it is a learner (catching up, not voting).
    pub learner: bool,
}

/// Maps a storage error to the wire.
pub fn storage_error(e: StoreError) -> ApiError {
    match e {
        StoreError::OffsetOutOfRange { offset, log_start_offset, log_end_offset } => {
            ApiError::OffsetOutOfRange { offset, log_start_offset, log_end_offset }
        }
        other => ApiError::Storage(other.to_string()),
    }
}

impl Partition {
    /// Wraps a started Raft node and its storage.
    pub fn new(
        topic: String,
        partition: u32,
        group: u64,
        node_id: NodeId,
        raft: RaftNode,
        replica: Replica,
        replicas: Vec<ReplicaAssignment>,
    ) -> Self {
        LIVE_PARTITIONS.fetch_add(1, Ordering::Relaxed);
        Self {
            topic,
            partition,
            group,
            node_id,
            raft,
            replica,
            replicas: RwLock::new(replicas),
            sequencer: Mutex::new(Sequencer::default()),
            sequence_advanced: Notify::new(),
            last_write_ms: AtomicU64::new(0),
            leader_contact_ms: AtomicU64::new(0),
            outran_candidate_ms: AtomicU64::new(0),
            outran_candidate: AtomicU64::new(0),
            created: Instant::now(),
            ticking: AtomicBool::new(true),
            ticking_change: std::sync::Mutex::new(()),
            ticking_since_ms: AtomicU64::new(0),
            stirred: std::sync::OnceLock::new(),
            damaged: std::sync::OnceLock::new(),
            damage: std::sync::OnceLock::new(),
            quorum_lost: tokio::sync::watch::Sender::new(false),
            campaign: crate::control::quiesce::Campaign::default(),
        }
    }

    /// How many [`Partition`]s are alive in this process: created and not
    /// yet dropped by every holder (the partition table, requests, produce
    /// tasks). After replicas are stopped it falls back unless something
    /// still holds one.
    pub fn live_count() -> u64 {
        LIVE_PARTITIONS.load(Ordering::Relaxed)
    }

    /// The current replica list.
    pub fn replicas(&self) -> Vec<ReplicaAssignment> {
        self.replicas.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Records that this replica answered a leader's AppendEntries now:
    /// its leader lease, and every other voter's, runs for one maximum
    /// election timeout from about now (`crate::control::quiesce` waits
    /// that out before campaigning).
    pub fn note_leader_contact(&self) {
        self.leader_contact_ms.store((self.created.elapsed().as_millis() as u64).max(1), Ordering::Relaxed);
    }

    /// How long ago this replica last answered a leader's AppendEntries,
    /// if it ever did.
    pub fn since_leader_contact(&self) -> Option<Duration> {
        let at = self.leader_contact_ms.load(Ordering::Relaxed);
        (at != 0)
            .then(|| Duration::from_millis((self.created.elapsed().as_millis() as u64).saturating_sub(at)))
    }

    /// Records that this replica refused a vote (or pre-vote) to a
    /// candidate whose log is behind its own: that candidate cannot win
    /// with this replica's vote, so this one should not wait for it
    /// (`crate::control::quiesce`).
    pub fn note_outran_candidate(&self, candidate: NodeId) {
        self.outran_candidate.store(candidate, Ordering::Relaxed);
        self.outran_candidate_ms.store((self.created.elapsed().as_millis() as u64).max(1), Ordering::Relaxed);
    }

    /// The candidate of [`Partition::note_outran_candidate`], if that was
    /// within `d`.
    pub fn outran_candidate_within(&self, d: Duration) -> Option<NodeId> {
        let at = self.outran_candidate_ms.load(Ordering::Relaxed);
        let recent =
            at != 0 && (self.created.elapsed().as_millis() as u64).saturating_sub(at) < d.as_millis() as u64;
        recent.then(|| self.outran_candidate.load(Ordering::Relaxed))
    }

    /// Whether a produce was proposed within `d`.
    pub fn written_within(&self, d: Duration) -> bool {
        let last = self.last_write_ms.load(Ordering::Relaxed);
        last != 0 && (self.created.elapsed().as_millis() as u64).saturating_sub(last) < d.as_millis() as u64
    }

    /// Whether the group's Raft ticker runs (see `crate::control::quiesce`).
    pub fn is_ticking(&self) -> bool {
        self.ticking.load(Ordering::Relaxed)
    }

    /// Runs or parks the group's Raft ticker (heartbeats, election timeout).
    ///
    /// The produce path and the scheduling round (`crate::control::quiesce`) both
    /// call this; the flag and the node's ticker change together under a
    /// lock, or a write's `true` and the round's `false` could cross and
    /// leave the flag saying parked while the node ticks (or the reverse).
    pub fn set_ticking(&self, on: bool) {
        let _serial = self.ticking_change.lock().unwrap_or_else(|p| p.into_inner());
        if self.ticking.swap(on, Ordering::AcqRel) != on {
            if on {
                self.ticking_since_ms.store(self.created.elapsed().as_millis() as u64, Ordering::Relaxed);
                if let Some(s) = self.stirred.get() {
                    s.stir([self.group]);
                }
            }
            self.raft.set_ticking(on);
        }
    }

    /// Has [`Partition::set_ticking`] report each start of the ticker to
    /// `stirred`, and a read that finds the log damaged report it to
    /// `damaged` (the registry's); the first call wins.
    pub fn report_to(&self, stirred: crate::groups::Stirred, damaged: crate::groups::Damaged) {
        let _ = self.stirred.set(stirred);
        let _ = self.damaged.set(damaged);
    }

    /// The damage a read found in this replica's log ([`StoreError::Corruption`]:
    /// a frame that fails its CRC or does not parse where no torn write can
    /// be), if one did. The replica is then stopped and started again with
    /// every segment verified ([`crate::groups::Damaged`]).
    pub fn damage(&self) -> Option<String> {
        self.damage.get().cloned()
    }

    /// Maps a storage error of a read to the wire, first recording damage
    /// ([`Partition::damage`]) if the error is one ([`StoreError::is_damage`]:
    /// records that do not decode inside a frame that verified are not, or
    /// the replica would be restarted for nothing, again at every such read).
    fn read_error(&self, e: StoreError) -> ApiError {
        self.report_damage(&e, "a read");
        storage_error(e)
    }

    /// Records `e` as damage this replica's log holds ([`Partition::damage`])
    /// if it is damage ([`StoreError::is_damage`]) and none was recorded
    /// yet, and reports the group (the registry's [`crate::groups::Damaged`]),
    /// whose replica is then restarted with every segment verified and
    /// fetches the damaged range from a healthy replica. `found_by` names
    /// who found it in the log line ("a read", "the scrub", "compaction").
    /// Returns whether this call recorded it.
    pub fn report_damage(&self, e: &StoreError, found_by: &str) -> bool {
        if !e.is_damage() || self.damage.set(e.to_string()).is_err() {
            return false;
        }
        tracing::error!(topic = %self.topic, partition = self.partition, group = self.group,
            "{found_by} found the log damaged; no damaged record is served, and the replica is restarted \
             to verify every segment and fetch the damaged range from a healthy replica: {e}");
        if let Some(d) = self.damaged.get() {
            d.report(self.group);
        }
        true
    }

    /// The broker hosting Raft node `node` of this group.
    pub fn broker_of(&self, node: NodeId) -> Option<BrokerId> {
        self.replicas
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|r| r.node == node)
            .map(|r| r.broker)
    }

    /// The replicas that may campaign and whose votes count: the assigned
    /// replicas that are voters of the group as this replica's membership
    /// has it. During a reassignment the assignment also lists learners
    /// (replicas being added, which cannot be elected) and, after the
    /// voters changed, replicas on their way out. A replica that knows no
    /// membership yet (a new one) gets every assigned replica.
    pub fn electable_replicas(&self) -> Vec<ReplicaAssignment> {
        let mut replicas = self.replicas();
        let voters: Vec<NodeId> = self.raft.state(|s| s.voters().collect());
        if !voters.is_empty() {
            replicas.retain(|r| voters.contains(&r.node));
        }
        replicas
    }

    /// Replaces the replica list (after a reassignment); returns whether
    /// it changed.
    pub fn set_replicas(&self, replicas: Vec<ReplicaAssignment>) -> bool {
        let mut current = self.replicas.write().unwrap_or_else(|p| p.into_inner());
        if *current == replicas {
            return false;
        }
        *current = replicas;
        true
    }

    /// The leader's broker id as this replica knows it; `None` also when
    /// this replica leads but has [lost its quorum](Self::lost_quorum), so
    /// that clients ask other brokers (which learn of the next leader
    /// first), and when its Raft group has stopped on an error.
    pub fn leader_broker(&self) -> Option<BrokerId> {
        if self.lost_quorum() {
            return None;
        }
        let (leader, running) = self.raft.state(|s| (s.leader(), s.is_running()));
        // A group stopped on an error knows no leader any more.
        leader.filter(|_| running).and_then(|n| self.broker_of(n))
    }

    /// Whether this replica leads but has lost its quorum, as
    /// [`crate::control::checkquorum`] last judged (every heartbeat interval). It is
    /// still the leader for Raft.
    pub fn lost_quorum(&self) -> bool {
        *self.quorum_lost.borrow()
    }

    /// Records [`crate::control::checkquorum`]'s verdict.
    pub fn set_lost_quorum(&self, lost: bool) {
        self.quorum_lost.send_if_modified(|l| std::mem::replace(l, lost) != lost);
    }

    /// How long the group's ticker has run (`None`: parked, so this replica
    /// sends no heartbeats).
    pub fn heartbeating_for(&self) -> Option<Duration> {
        let now_ms = self.created.elapsed().as_millis() as u64;
        self.is_ticking().then(|| {
            Duration::from_millis(now_ms.saturating_sub(self.ticking_since_ms.load(Ordering::Relaxed)))
        })
    }

    fn not_leader(&self) -> ApiError {
        ApiError::NotLeader { leader: self.leader_broker().filter(|_| !self.raft.is_leader()) }
    }

    /// Checks this replica leads and has applied an entry of its own
    /// leadership (its term and its node id: another node may have led an
    /// earlier part of the same term), waiting up to [`LEADER_READY_WAIT`]
    /// for the latter: until then its commit index may be behind what an
    /// earlier leader committed (Raft thesis §6.4). Returns the term.
    ///
    /// # Errors
    /// [`ApiError::NotLeader`], or [`ApiError::Unavailable`] while the new
    /// leader catches up.
    pub async fn ready_leader(&self) -> Result<u64, ApiError> {
        let term = self.raft.leader_term().ok_or_else(|| self.not_leader())?;
        let me = self.node_id;
        let ready = move |s: State<'_>| s.term() != term || s.last_applied_leadership() == Some((term, me));
        if !self.raft.state(ready)
            && !self
                .raft
                .wait_for(LEADER_READY_WAIT, "leader applied an entry of its leadership", ready)
                .await
        {
            return Err(ApiError::Unavailable("the new leader is still applying earlier entries".into()));
        }
        if self.raft.state(|s| s.term() != term || !s.is_leader()) {
            return Err(self.not_leader());
        }
        Ok(term)
    }

    /// Appends `batch` and waits until a majority has committed it. For an
    /// idempotent batch already appended, answers its original offset with
    /// `true` (a duplicate) instead of appending again.
    ///
    /// # Errors
    /// Not leader, unavailable, sequence errors (KIP-98), storage errors.
    pub async fn produce(self: &Arc<Self>, batch: RecordBatch) -> Result<(u64, bool), ApiError> {
        self.produce_checked(batch, None).await
    }

    /// [`Partition::produce`] as the leader of `term` only: a replica that
    /// leads in another term (it lost the leadership and won it again)
    /// answers [`ApiError::NotLeader`] without writing. For a writer whose
    /// decision rests on what it read in `term` (the group coordinator).
    ///
    /// # Errors
    /// As [`Partition::produce`].
    pub async fn produce_in_term(
        self: &Arc<Self>,
        batch: RecordBatch,
        term: u64,
    ) -> Result<(u64, bool), ApiError> {
        self.produce_checked(batch, Some(term)).await
    }

    async fn produce_checked(
        self: &Arc<Self>,
        batch: RecordBatch,
        in_term: Option<u64>,
    ) -> Result<(u64, bool), ApiError> {
        self.begin_checked(batch, in_term).await?.wait().await
    }

    /// [`Partition::produce`] in two steps: this one returns once the batch
    /// is proposed (or known a duplicate), in the order of the calls; the
    /// returned [`Produced`] then waits for the commit. A connection that
    /// pipelines requests (the Kafka listener) proposes them in the order
    /// they arrived and awaits their commits together.
    ///
    /// # Errors
    /// As [`Partition::produce`], for what is known before the proposal.
    pub async fn produce_begin(self: &Arc<Self>, batch: RecordBatch) -> Result<Produced, ApiError> {
        self.begin_checked(batch, None).await
    }

    async fn begin_checked(
        self: &Arc<Self>,
        batch: RecordBatch,
        in_term: Option<u64>,
    ) -> Result<Produced, ApiError> {
        let term = self.ready_leader().await?;
        if in_term.is_some_and(|t| t != term) {
            return Err(self.not_leader());
        }
        if self.lost_quorum() {
            // Handing over (see crate::control::checkquorum): the client should find the next leader.
            return Err(ApiError::NotLeader { leader: None });
        }
        self.last_write_ms.store((self.created.elapsed().as_millis() as u64).max(1), Ordering::Relaxed);
        self.set_ticking(true);
        if !self.raft.renew_lease(LEADER_READY_WAIT).await {
            return Err(ApiError::Unavailable("the leader cannot reach a quorum".into()));
        }
        let (pid, epoch, first, count) =
            (batch.producer_id, batch.producer_epoch, batch.base_sequence, batch.record_count);
        let gap_deadline = tokio::time::Instant::now() + SEQUENCE_GAP_WAIT;
        let watch = self.replica.append_watch();
        let pending = loop {
            let mut seq = self.sequencer.lock().await;
            if !seq.is_valid_for(term) {
                self.await_proposals_settled().await?;
                seq.reset(term);
            }
            match seq.check(&self.replica, pid, epoch, first, count) {
                Verdict::Append => {}
                Verdict::InFlight => return Err(ApiError::DuplicateInFlight),
                Verdict::Applied(SequenceCheck::Duplicate(r)) => {
                    return Ok(Produced { state: ProducedState::Duplicate(r.base_offset) });
                }
                Verdict::Applied(SequenceCheck::Fenced { current }) => {
                    return Err(ApiError::ProducerFenced { current, got: epoch });
                }
                Verdict::Applied(SequenceCheck::OutOfOrder { expected }) => {
                    // A batch sent after one that has not arrived yet (many in
                    // flight per partition): wait a little for the gap to fill.
                    let notified = self.sequence_advanced.notified();
                    drop(seq);
                    if first > expected && tokio::time::Instant::now() < gap_deadline {
                        let _ = tokio::time::timeout_at(gap_deadline, notified).await;
                        continue;
                    }
                    return Err(ApiError::OutOfOrderSequence { expected, got: first });
                }
                Verdict::Applied(SequenceCheck::Append) => {}
            }
            let leadership = Leadership { term, node: self.node_id };
            let reservation = seq.reserve(watch, leadership, pid, epoch, first, count);
            // Proposed as the leader of `term` only: the sequence checks
            // above were made against that term's applied state. A failure,
            // or this request's cancellation while the proposal waits for
            // room, drops the reservation, which gives the place back.
            let pending = self.raft.propose(batch.clone(), term).await.map_err(|e| self.propose_error(e))?;
            reservation.proposed();
            self.sequence_advanced.notify_waiters();
            break pending;
        };
        // The proposal is settled in its own task, so the sequencer learns
        // its outcome even if this request is cancelled (a client timeout
        // drops this future): a reservation must never outlive its write.
        let this = self.clone();
        let settled = tokio::spawn(
            async move {
                let result = pending.committed().await;
                let mut seq = this.sequencer.lock().await;
                seq.complete(pid, first);
                this.sequence_advanced.notify_waiters();
                match result {
                    Ok(r) if r.record_count == 0 && count > 0 => {
                        // Stored blank: Raft refused an earlier batch of
                        // this producer and accepted this one
                        // (ferrolog_raft_store::appends). Nothing of it is
                        // in the log; it comes again after the earlier one.
                        seq.invalidate();
                        let expected = match this.replica.check_sequence(pid, epoch, first, count) {
                            SequenceCheck::OutOfOrder { expected } => expected,
                            _ => first,
                        };
                        Err(ApiError::OutOfOrderSequence { expected, got: first })
                    }
                    Ok(r) => Ok((r.base_offset, false)),
                    Err(e) => {
                        // The Raft node has marked it failed in the watch.
                        seq.invalidate();
                        Err(this.propose_error(e))
                    }
                }
            }
            .instrument(tracing::debug_span!("settle", group = self.group)),
        );
        // Waiting on a leader that has lost its quorum would last until the
        // partition heals; answer once it is known lost (the batch may still
        // commit: an idempotent retry then gets its offset). Told by
        // CheckQuorum's verdict, without a timer per request.
        Ok(Produced { state: ProducedState::Settling { settled, lost: self.quorum_lost.subscribe() } })
    }

    /// Waits (up to [`LEADER_READY_WAIT`]) until every entry in the local
    /// log is applied: a reader of the applied records then sees every
    /// proposal of this leader that may still commit (the group
    /// coordinator, reading its partition back within a term).
    ///
    /// # Errors
    /// [`ApiError::Unavailable`] when they are not applied in time.
    pub async fn await_applied_all(&self) -> Result<(), ApiError> {
        self.await_apply_caught_up().await
    }

    /// Waits until every idempotent proposal of this leader has reached the
    /// log or failed, then clears the watch, then waits until every entry in
    /// the log is applied: the applied producer state then covers every
    /// proposal that may still commit, and a sequencer reset forgets
    /// nothing still on its way. Called with the sequencer locked, so no
    /// proposal starts meanwhile; the Raft node marks failures without
    /// that lock.
    async fn await_proposals_settled(&self) -> Result<(), ApiError> {
        let watch = self.replica.append_watch();
        let deadline = tokio::time::Instant::now() + LEADER_READY_WAIT;
        loop {
            let changed = watch.changed();
            if watch.is_settled() {
                watch.clear();
                break;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(ApiError::Unavailable("waiting for earlier proposals to reach the log".into()));
            }
        }
        self.await_apply_caught_up().await
    }

    /// Waits until every entry in the local log is applied, so the applied
    /// producer state covers every proposal that may still commit.
    async fn await_apply_caught_up(&self) -> Result<(), ApiError> {
        // The log as stored: the Raft library may publish its last index
        // after an append that a caller has just seen.
        let last = self.raft.state(|s| s.last_log_index()).max(self.replica.last_log_index());
        if let Some(last) = last
            && !self.raft.wait_applied(last, LEADER_READY_WAIT).await
        {
            return Err(ApiError::Unavailable("waiting for earlier entries to apply".into()));
        }
        Ok(())
    }

    /// A proposal's failure on the wire.
    fn propose_error(&self, e: ProposeError) -> ApiError {
        match e {
            ProposeError::NotLeader { .. } => self.not_leader(),
            ProposeError::Unavailable(m) => ApiError::Unavailable(m),
        }
    }

    /// Reads committed records from `offset`, waiting up to `max_wait` when
    /// `offset` is the high watermark.
    ///
    /// # Errors
    /// Not leader / unavailable; [`ApiError::OffsetOutOfRange`] outside
    /// [log start, high watermark]; storage errors.
    pub async fn fetch(
        &self,
        offset: u64,
        max_bytes: usize,
        max_wait: Duration,
    ) -> Result<FetchOutcome, ApiError> {
        self.ready_leader().await?;
        let mut hw_rx = self.replica.watch_high_watermark();
        if offset == *hw_rx.borrow() && !max_wait.is_zero() {
            let _ = tokio::time::timeout(max_wait, hw_rx.wait_for(|hw| *hw > offset)).await;
        }
        self.read_committed(offset, max_bytes).await
    }

    /// Waits up to `max_wait` until the high watermark passes `offset` (a
    /// long-polling fetch of several partitions waits on all of them).
    pub async fn wait_past(&self, offset: u64, max_wait: Duration) {
        let mut hw_rx = self.replica.watch_high_watermark();
        let _ = tokio::time::timeout(max_wait, hw_rx.wait_for(|hw| *hw > offset)).await;
    }

    /// Reads committed records without waiting, on the blocking pool (file
    /// IO stays off the async worker threads, and the log's lock, which
    /// appends need, is held only to plan the read: see
    /// [`ferrolog_raft_store::Replica::read`]).
    ///
    /// # Errors
    /// As [`Partition::fetch`], without the leader check.
    pub async fn read_committed(&self, offset: u64, max_bytes: usize) -> Result<FetchOutcome, ApiError> {
        // Waited for here, not on the blocking pool: a fetch whose client
        // went away while it waited never starts its read.
        let _permit =
            READS.acquire().await.map_err(|e| ApiError::Unavailable(format!("reads are shut: {e}")))?;
        let replica = self.replica.clone();
        let (batches, high_watermark) =
            ferrolog_raft_store::runtime::blocking(&**self.replica.fs(), move || {
                replica.read_with_high_watermark(offset, max_bytes)
            })
            .await
            .map_err(|e| ApiError::Unavailable(format!("read task failed: {e}")))?
            .map_err(|e| self.read_error(e))?;
        Ok(FetchOutcome { batches, high_watermark, log_start_offset: self.replica.log_start_offset() })
    }

    /// Log start offset and high watermark, as the leader sees them.
    ///
    /// # Errors
    /// Not leader / unavailable.
    pub async fn offsets(&self) -> Result<(u64, u64), ApiError> {
        self.ready_leader().await?;
        Ok((self.replica.log_start_offset(), self.replica.high_watermark()))
    }

    /// Kafka's ListOffsets by timestamp (KIP-79): the first committed
    /// record, in offset order, whose timestamp is ≥ `timestamp_ms` (ms
    /// since the Unix epoch), as `(offset, its timestamp in ms)`; `None`
    /// when no committed record is that late. Timestamps may go backwards
    /// within and across batches; the answer is still the first such
    /// record, not the start of its batch.
    ///
    /// # Errors
    /// Not leader / unavailable; storage errors, including a stored batch
    /// whose records do not decode or contradict its header.
    pub async fn offset_for_timestamp(&self, timestamp_ms: i64) -> Result<Option<(u64, i64)>, ApiError> {
        self.ready_leader().await?;
        self.replica.offset_for_timestamp(timestamp_ms, records::timestamps).map_err(|e| self.read_error(e))
    }

    /// The Raft state of this replica.
    pub fn status(&self) -> PartitionStatus {
        let (leader, term, commit_index, last_log_index, matched, learners) = self.raft.state(|s| {
            let matched: Vec<(NodeId, Option<u64>)> =
                s.matched().map(|r| r.map(|(n, m)| (n, m.map(|l| l.index))).collect()).unwrap_or_default();
            (
                s.leader(),
                s.term(),
                s.committed().map_or(0, |l| l.index),
                s.last_log_index().unwrap_or(0),
                matched,
                s.learners().collect::<Vec<NodeId>>(),
            )
        });
        let followers = matched
            .into_iter()
            .filter(|(n, _)| *n != self.node_id)
            .map(|(n, matched)| FollowerState {
                broker: self.broker_of(n).unwrap_or(0),
                node: n,
                matched,
                learner: learners.contains(&n),
            })
            .collect();
        PartitionStatus {
            leader: leader.and_then(|n| self.broker_of(n)),
            term,
            commit_index,
            last_log_index,
            high_watermark: self.replica.high_watermark(),
            log_start_offset: self.replica.log_start_offset(),
            followers,
        }
    }
}

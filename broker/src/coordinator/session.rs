//! A coordinator partition held for one group call: its groups read back
//! from the partition's log for the current Raft term, and its writes.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use ferrolog_proto::client::Record;
use ferrolog_raft_store::NO_PRODUCER_ID;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::records::{self, Entry};
use super::state::Groups;
use super::{Coordinator, OFFSETS_TOPIC, partition_for, validate_group_id};
use crate::config::Limits;
use crate::error::ApiError;
use crate::metadata::command::PartitionAssignment;
use crate::metadata::controller::now_ms;
use crate::metadata::image::MetadataImage;
use crate::partition::Partition;
use crate::partition::records::{self as batch, BatchError, ProducerFields};

/// Most records of `__consumer_offsets` written in one batch by
/// [`Session::append_all`].
pub(super) const ROWS_PER_APPEND: usize = 1_000;

/// Bytes read per step when a coordinator reads its partition.
const LOAD_READ_BYTES: usize = 1 << 20;

/// How long a group call waits for its partition to be read back before
/// it answers `COORDINATOR_LOAD_IN_PROGRESS` (the read goes on).
const LOAD_WAIT: Duration = Duration::from_secs(5);

/// The state loaded for one coordinator partition, for one term.
#[derive(Debug)]
pub(super) struct Loaded {
    pub(super) term: u64,
    pub(super) groups: Groups,
}

pub(super) type Cell = Arc<Mutex<Option<Loaded>>>;

/// A coordinator partition held for one group call: its state loaded for
/// the current term, and no other call on it until dropped.
pub(super) struct Session {
    /// Taken while a write is under way ([`Session::append`]).
    guard: Option<OwnedMutexGuard<Option<Loaded>>>,
    partition: Arc<Partition>,
    term: u64,
    pub(super) image: Arc<MetadataImage>,
}

impl Session {
    pub(super) fn groups(&self) -> &Groups {
        // A session is only made with its state loaded (Coordinator::open),
        // and not used after a failed write.
        &self.guard.as_ref().and_then(|g| g.as_ref()).expect("a session holds loaded state").groups
    }

    pub(super) fn groups_mut(&mut self) -> &mut Groups {
        &mut self.guard.as_mut().and_then(|g| g.as_mut()).expect("a session holds loaded state").groups
    }

    /// Drops the partition's state (read back by the next call): memory
    /// holds what could not be stored (a new generation).
    pub(super) fn forget(&mut self) {
        if let Some(g) = self.guard.as_mut() {
            **g = None;
        }
    }

    /// [`Session::append`] of `rows` in batches of at most
    /// [`ROWS_PER_APPEND`] (a group may have offsets for thousands of
    /// partitions), in order; stops at the first that fails.
    ///
    /// # Errors
    /// As [`Session::append`]; the batches before the failing one are stored.
    pub(super) async fn append_all(
        &mut self,
        mut rows: Vec<Record>,
        limits: &Limits,
    ) -> Result<(), ApiError> {
        while !rows.is_empty() {
            let rest = rows.split_off(rows.len().min(ROWS_PER_APPEND));
            self.append(std::mem::replace(&mut rows, rest), limits).await?;
        }
        Ok(())
    }

    /// Appends `rows` in this session's term and applies them once a
    /// majority stored them. The write runs in a task of its own that holds
    /// the partition until it is settled, so a call dropped while it waits
    /// (its client went away) loses nothing; memory is put back only after
    /// the write committed. On any failure (the write may still commit) no
    /// state is left, and the next call reads the partition back, after
    /// every entry of this leader is applied.
    pub(super) async fn append(&mut self, rows: Vec<Record>, limits: &Limits) -> Result<(), ApiError> {
        let producer = ProducerFields { producer_id: NO_PRODUCER_ID, producer_epoch: 0, base_sequence: 0 };
        // Built before the state is touched: a commit too large for one
        // batch is refused and every other group's state stays.
        let built = batch::build_batch(
            rows.clone(),
            producer,
            now_ms(),
            limits.max_record_bytes,
            limits.max_batch_bytes,
        )
        .map_err(|e| match e {
            BatchError::TooLarge(m) => ApiError::RecordTooLarge(m),
            BatchError::Invalid(m) => ApiError::Invalid(m),
        })?;
        let mut guard = self.guard.take().expect("a session holds loaded state");
        let (partition, term) = (self.partition.clone(), self.term);
        let task = tokio::spawn(async move {
            let loaded = guard.take();
            partition.produce_in_term(built, term).await.map_err(coordinator_error)?;
            let mut loaded =
                loaded.ok_or_else(|| ApiError::Unavailable("no state to apply a write to".into()))?;
            for r in &rows {
                // Encoded just now by records::*_record: they decode.
                if let Ok(e) = records::decode(r) {
                    loaded.groups.apply(e);
                }
            }
            *guard = Some(loaded);
            Ok(guard)
        });
        match task.await {
            Ok(Ok(guard)) => {
                self.guard = Some(guard);
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(e) => Err(ApiError::Unavailable(format!("the write's task failed: {e}"))),
        }
    }
}

/// `__consumer_offsets` without partitions: never made so (the controller
/// refuses a topic without partitions), answered rather than assumed.
pub(super) fn no_partitions() -> ApiError {
    ApiError::CoordinatorNotAvailable(format!("{OFFSETS_TOPIC} has no partitions"))
}

/// A partition's error as a group call's: not the leader is not the
/// coordinator.
pub(super) fn coordinator_error(e: ApiError) -> ApiError {
    match e {
        ApiError::NotLeader { leader } => ApiError::NotCoordinator { coordinator: leader },
        other => other,
    }
}

impl Coordinator {
    pub(super) fn cell(&self, raft_group: u64) -> Cell {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        // Forget partitions no longer hosted here (deleted, moved away).
        if loaded.len() > 64 || !loaded.contains_key(&raft_group) {
            loaded.retain(|g, _| self.groups.contains(*g));
        }
        loaded.entry(raft_group).or_default().clone()
    }

    /// Holds `group`'s coordinator partition, its state loaded for the
    /// current term.
    pub(super) async fn session(&self, group: &str) -> Result<Session, ApiError> {
        validate_group_id(group)?;
        let (topic, image) = self.offsets_topic().await?;
        let index = partition_for(group, topic.partitions.len() as u32);
        let a: &PartitionAssignment = topic.partitions.get(index as usize).ok_or_else(no_partitions)?;
        let not_here = || ApiError::NotCoordinator {
            coordinator: Some(self.groups.leader_of(&self.liveness, self.me, a))
                .filter(|b| *b != 0 && *b != self.me),
        };
        let partition = self.groups.partition_of(a.group).ok_or_else(not_here)?;
        self.open(partition, index, a.group, image).await.map_err(|e| match e {
            // The replica here knows no leader yet (it has not heard from
            // one since it opened): the hint comes from the brokers' pings,
            // as for a partition not hosted here.
            ApiError::NotCoordinator { coordinator: None } => not_here(),
            other => other,
        })
    }

    /// Holds coordinator partition `index` (Raft group `raft_group`), its
    /// state loaded for the current term. The partition is read back in a
    /// task of its own, so a call that stops waiting ([`LOAD_WAIT`]:
    /// `COORDINATOR_LOAD_IN_PROGRESS`, the client retries) does not stop
    /// the read.
    pub(super) async fn open(
        &self,
        partition: Arc<Partition>,
        index: u32,
        raft_group: u64,
        image: Arc<MetadataImage>,
    ) -> Result<Session, ApiError> {
        let term = partition.ready_leader().await.map_err(|e| match e {
            ApiError::Unavailable(m) => ApiError::CoordinatorLoadInProgress(m),
            other => coordinator_error(other),
        })?;
        let loading =
            || ApiError::CoordinatorLoadInProgress(format!("{OFFSETS_TOPIC}-{index} is being read back"));
        let state = tokio::time::timeout(LOAD_WAIT, self.cell(raft_group).lock_owned())
            .await
            .map_err(|_| loading())?;
        let state = if state.as_ref().is_some_and(|l| l.term == term) {
            state
        } else {
            let task = tokio::spawn(read_back(state, partition.clone(), index, term));
            match tokio::time::timeout(LOAD_WAIT, task).await {
                Ok(Ok(r)) => r?,
                Ok(Err(e)) => {
                    return Err(ApiError::Unavailable(format!("reading {OFFSETS_TOPIC}-{index} back: {e}")));
                }
                Err(_) => return Err(loading()),
            }
        };
        // The leadership may have moved, or been lost, while this call waited.
        if partition.raft.leader_term() != Some(term)
            || partition.lost_quorum()
            || state.as_ref().map(|l| l.term) != Some(term)
        {
            return Err(ApiError::NotCoordinator { coordinator: None });
        }
        Ok(Session { guard: Some(state), partition, term, image })
    }
}

/// Reads coordinator partition `index` back into `state` for `term` (see
/// [`Coordinator::open`]): first waits until every entry of the log is
/// applied (a write of this leader whose fate was unknown is then in the
/// high watermark or gone), then reads.
async fn read_back(
    mut state: OwnedMutexGuard<Option<Loaded>>,
    partition: Arc<Partition>,
    index: u32,
    term: u64,
) -> Result<OwnedMutexGuard<Option<Loaded>>, ApiError> {
    *state = None;
    partition.await_applied_all().await.map_err(|e| ApiError::CoordinatorLoadInProgress(e.to_string()))?;
    let mut groups = load(&partition, index).await?;
    groups.activate(Instant::now());
    tracing::info!(
        partition = index,
        term,
        groups = groups.iter().count(),
        "{OFFSETS_TOPIC}-{index}: read the groups of this term"
    );
    *state = Some(Loaded { term, groups });
    Ok(state)
}

/// Reads coordinator partition `index` from its log start to its high
/// watermark into [`Groups`].
///
/// # Errors
/// [`ApiError::CoordinatorLoadInProgress`] when the log moved under the
/// read; [`ApiError::Storage`] for a record that does not decode (named by
/// offset: the partition is written only by coordinators).
async fn load(partition: &Partition, index: u32) -> Result<Groups, ApiError> {
    let (mut pos, high_watermark) = partition.offsets().await.map_err(coordinator_error)?;
    let mut groups = Groups::default();
    let mut read = 0u64;
    while pos < high_watermark {
        let out = partition.read_committed(pos, LOAD_READ_BYTES).await.map_err(|e| match e {
            ApiError::OffsetOutOfRange { .. } => ApiError::CoordinatorLoadInProgress(format!(
                "{OFFSETS_TOPIC}-{index} changed while read: {e}"
            )),
            other => other,
        })?;
        if out.batches.is_empty() {
            return Err(ApiError::CoordinatorLoadInProgress(format!(
                "{OFFSETS_TOPIC}-{index}: nothing read at offset {pos} below the high watermark {high_watermark}"
            )));
        }
        for b in &out.batches {
            let rows = batch::decode(&b.records()).map_err(|e| {
                storage_error_at(index, b.header.base_offset, &format!("a batch that does not decode: {e}"))
            })?;
            let deltas = batch::offset_deltas(&rows);
            for (r, d) in rows.iter().zip(deltas) {
                let offset = b.header.base_offset + u64::from(d);
                if offset < pos {
                    continue;
                }
                let entry = records::decode(r).map_err(|e| storage_error_at(index, offset, &e))?;
                if entry == Entry::Unknown {
                    tracing::debug!(
                        "{OFFSETS_TOPIC}-{index} offset {offset}: a record kind this version does not know"
                    );
                }
                groups.apply(entry);
                read += 1;
            }
            pos = pos.max(b.header.next_offset());
        }
    }
    tracing::debug!("{OFFSETS_TOPIC}-{index}: {read} records read up to offset {high_watermark}");
    Ok(groups)
}

fn storage_error_at(index: u32, offset: u64, what: &str) -> ApiError {
    ApiError::Storage(format!("{OFFSETS_TOPIC}-{index} offset {offset}: {what}"))
}

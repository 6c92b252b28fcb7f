//! One partition's send queue: the open batch, the closed batches not yet
//! acknowledged, and idempotence bookkeeping (KIP-98). Pure: no IO, no
//! clock of its own; the worker calls it with `now` and performs the sends.
//!
//! Rules:
//! - Batches are closed and sent in order; a batch gets its `base_sequence`
//!   when first sent, continuing the partition's sequence by record count,
//!   and keeps it on every resend, so the broker can drop duplicates.
//! - At most `max_in_flight` requests per partition; a batch is sent only
//!   when every batch before it is in flight or acknowledged, so requests
//!   leave in sequence order (a resend included). One exception: the
//!   oldest unacknowledged batch may be resent as one request over the
//!   limit, since the broker holds every later one until it arrives.
//! - A retriable failure puts the batch back, unsent, and blocks the
//!   partition for a backoff; after it, every unacknowledged batch is sent
//!   again in order with its original sequence.
//! - A permanent failure or an expired batch leaves a gap in the sequence
//!   that the broker would never fill. Batches that may be stored (before
//!   a refused batch; after an expired one, those whose answer was lost or
//!   is pending) keep their identity and sequence until acknowledged or
//!   refused as out of order: only a resend with the same sequence can find
//!   out without storing them twice. The others wait; once nothing is left
//!   to resolve and nothing is in flight, the partition takes a new
//!   producer id and renumbers them from 0
//!   ([`PartitionQueue::reset_if_drained`]).

use ferrolog_proto::TopicId;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ferrolog_proto::client as pb;
use tokio::sync::oneshot;

use crate::error::{Error, Result, Retry};
use crate::record::RecordMetadata;
use crate::retry::Backoff;

/// Where a record's delivery result goes.
pub(crate) type Waiter = oneshot::Sender<Result<RecordMetadata>>;

/// An idempotent producer identity (KIP-98).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProducerId {
    /// Id from `InitProducerId`, or -1 without idempotence.
    pub id: i64,
    /// Its epoch.
    pub epoch: i32,
}

impl ProducerId {
    /// The identity of a producer without idempotence.
    pub(crate) const NONE: ProducerId = ProducerId { id: -1, epoch: -1 };
}

/// Records that travel together in one `Produce` request.
#[derive(Debug)]
pub(crate) struct Batch {
    /// Unique within the producer.
    pub id: u64,
    /// The records, in send order.
    pub records: Vec<pb::Record>,
    /// One per record, same order.
    pub waiters: Vec<Waiter>,
    /// Producer-wide record ids (for `flush`), same order.
    pub record_ids: Vec<u64>,
    /// Encoded size of the records, bytes.
    pub bytes: usize,
    /// When its first record was handed to `send`: the delivery timeout
    /// counts from here.
    pub created: Instant,
    /// Identity and first sequence number, fixed at the first send.
    pub sequence: Option<(ProducerId, i32)>,
    /// A request for it is outstanding.
    pub in_flight: bool,
    /// Whether, when last sent, an earlier batch of the partition was
    /// unacknowledged: then `OUT_OF_ORDER_SEQUENCE` means "wait for it".
    pub sent_behind: bool,
    /// Behind a sequence gap: to be renumbered under a new producer id.
    pub after_gap: bool,
    /// A request for it failed without an answer from the broker (transport
    /// error, timeout): it may be stored. Only a resend with the same
    /// sequence can tell without storing it twice.
    pub maybe_stored: bool,
    /// Requests made so far.
    pub attempts: u32,
    /// The last failure, reported if the batch times out.
    pub last_error: Option<Error>,
    /// The id of the topic incarnation its records were sent to (KIP-516),
    /// fixed when the batch is created and sent with every attempt: a
    /// batch is never delivered to another incarnation of its topic.
    pub topic_id: Option<TopicId>,
}

impl Batch {
    pub(crate) fn new(id: u64, created: Instant) -> Self {
        Batch {
            id,
            records: Vec::new(),
            waiters: Vec::new(),
            record_ids: Vec::new(),
            bytes: 0,
            created,
            sequence: None,
            in_flight: false,
            sent_behind: false,
            after_gap: false,
            maybe_stored: false,
            attempts: 0,
            last_error: None,
            topic_id: None,
        }
    }

    pub(crate) fn record_count(&self) -> u32 {
        self.records.len() as u32
    }

    /// Resolves every record's delivery: offsets `base_offset..` on success.
    pub(crate) fn complete(self, partition: u32, result: Result<u64>) {
        for (i, waiter) in self.waiters.into_iter().enumerate() {
            let r = match &result {
                // Saturating: a broker's nonsense offset must not panic us.
                Ok(base) => Ok(RecordMetadata { partition, offset: base.saturating_add(i as u64) }),
                Err(e) => Err(e.clone()),
            };
            // The caller may have dropped its delivery future: not an error.
            let _ = waiter.send(r);
        }
    }
}

/// Advances a sequence number by `count` records, wrapping from `i32::MAX`
/// to 0 as Kafka's `DefaultRecordBatch.incrementSequence` does.
pub(crate) fn increment_sequence(sequence: i32, count: u32) -> i32 {
    let count = count as i64;
    let next = sequence as i64 + count;
    if next > i32::MAX as i64 { (next - i32::MAX as i64 - 1) as i32 } else { next as i32 }
}

/// What the worker must do with a batch whose request failed.
// Returned once per failed response and matched at once: boxing would only
// add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Failure {
    /// Put back; the partition retries after its backoff.
    Retrying,
    /// Permanent: deliver the error to the batch's records.
    Failed(Batch, Error),
    /// No such batch (already completed or expired).
    Unknown,
}

/// A request the worker should send now.
#[derive(Debug, Clone)]
pub(crate) struct SendSpec {
    pub batch_id: u64,
    pub records: Vec<pb::Record>,
    pub bytes: usize,
    pub producer: ProducerId,
    pub base_sequence: i32,
    pub topic_id: Option<TopicId>,
    /// When the batch was made: its delivery timeout counts from here, and
    /// bounds how long the request may wait for an answer.
    pub created: Instant,
}

/// One partition's queue. See the module documentation for the rules.
#[derive(Debug)]
pub(crate) struct PartitionQueue {
    /// Batch still accepting records.
    pub open: Option<Batch>,
    /// Closed, unacknowledged batches in sequence order.
    pub batches: VecDeque<Batch>,
    /// Identity used for batches that get their sequence next; `None`
    /// while waiting for `InitProducerId`.
    pub producer: Option<ProducerId>,
    /// Whether this partition waits for an id of its own (after a reset)
    /// rather than the producer-wide one.
    pub wants_own_producer_id: bool,
    /// Next sequence number to hand out.
    pub next_sequence: i32,
    /// Requests outstanding.
    pub in_flight: usize,
    /// No sends before this instant (backoff after a failure).
    pub retry_at: Option<Instant>,
    /// Consecutive failed requests, the backoff exponent.
    pub failures: u32,
    /// The leader address whose failure (gone, or not the leader any more)
    /// set the backoff; cleared once another leader is known or a send
    /// succeeds.
    pub failed_leader: Option<String>,
    /// A sequence gap exists: batches after it (and batches without a
    /// sequence yet) wait to be renumbered under a new id.
    pub gap: bool,
    idempotent: bool,
}

impl PartitionQueue {
    pub(crate) fn new(producer: Option<ProducerId>, idempotent: bool) -> Self {
        PartitionQueue {
            open: None,
            batches: VecDeque::new(),
            producer: if idempotent { producer } else { Some(ProducerId::NONE) },
            wants_own_producer_id: false,
            next_sequence: 0,
            in_flight: 0,
            retry_at: None,
            failures: 0,
            failed_leader: None,
            gap: false,
            idempotent,
        }
    }

    /// Whether nothing is queued or in flight.
    #[cfg(test)]
    pub(crate) fn is_idle(&self) -> bool {
        self.open.is_none() && self.batches.is_empty()
    }

    /// Adds a record to the open batch, first closing it if the record
    /// would take it past `batch_bytes_max` (a record larger than that
    /// travels alone). Returns whether a batch was closed.
    pub(crate) fn add(
        &mut self,
        record: pb::Record,
        bytes: usize,
        record_id: u64,
        waiter: Waiter,
        new_batch: impl FnOnce() -> Batch,
        batch_bytes_max: usize,
    ) -> bool {
        let mut closed = false;
        if let Some(open) = &self.open
            && !open.records.is_empty()
            && open.bytes + bytes > batch_bytes_max
        {
            self.close_open();
            closed = true;
        }
        let open = self.open.get_or_insert_with(new_batch);
        open.records.push(record);
        open.waiters.push(waiter);
        open.record_ids.push(record_id);
        open.bytes += bytes;
        if open.bytes >= batch_bytes_max {
            self.close_open();
            closed = true;
        }
        closed
    }

    /// Closes the open batch, if any; returns whether there was one.
    pub(crate) fn close_open(&mut self) -> bool {
        match self.open.take() {
            Some(b) => {
                // Creation order, which `expire` relies on.
                debug_assert!(self.batches.back().is_none_or(|last| last.created <= b.created));
                self.batches.push_back(b);
                true
            }
            None => false,
        }
    }

    /// Whether the open batch has lingered long enough to close.
    pub(crate) fn linger_expired(&self, now: Instant, linger: Duration) -> bool {
        self.open.as_ref().is_some_and(|b| now >= b.created + linger)
    }

    /// The next request to send, if the rules allow one now. Marks the
    /// batch in flight and fixes its sequence on its first send.
    pub(crate) fn next_send(&mut self, now: Instant, max_in_flight: usize) -> Option<SendSpec> {
        if self.retry_at.is_some_and(|t| now < t) {
            return None;
        }
        let producer = self.producer?;
        let index = if self.gap {
            // Only batches still to be resolved under their own sequence go
            // out; the ones behind the gap, and new ones, wait for the reset.
            self.batches.iter().position(|b| !b.in_flight && !b.after_gap && b.sequence.is_some())?
        } else {
            self.batches.iter().position(|b| !b.in_flight)?
        };
        // At the limit, one more request is allowed for the oldest batch:
        // every batch in flight is after it, and the broker holds them until
        // this one fills their sequence gap, so waiting for a free slot
        // would stall the partition for the broker's whole gap wait.
        let fills_gap = index == 0 && self.in_flight > 0;
        if self.in_flight >= max_in_flight && !(fills_gap && self.in_flight < max_in_flight + 1) {
            return None;
        }
        let next_sequence = self.next_sequence;
        let batch = &mut self.batches[index];
        let (producer, base_sequence) = match batch.sequence {
            Some(s) => s,
            None => {
                let s = if self.idempotent { (producer, next_sequence) } else { (ProducerId::NONE, 0) };
                batch.sequence = Some(s);
                self.next_sequence = increment_sequence(next_sequence, batch.record_count());
                s
            }
        };
        batch.in_flight = true;
        batch.sent_behind = index > 0;
        batch.attempts += 1;
        self.in_flight += 1;
        Some(SendSpec {
            batch_id: batch.id,
            records: batch.records.clone(),
            bytes: batch.bytes,
            producer,
            base_sequence,
            topic_id: batch.topic_id,
            created: batch.created,
        })
    }

    fn take_in_flight(&mut self, batch_id: u64) -> Option<usize> {
        let index = self.batches.iter().position(|b| b.id == batch_id && b.in_flight)?;
        self.batches[index].in_flight = false;
        self.in_flight -= 1;
        Some(index)
    }

    /// The broker acknowledged a batch: it is removed and returned for
    /// completion.
    pub(crate) fn on_success(&mut self, batch_id: u64) -> Option<Batch> {
        let index = self.take_in_flight(batch_id)?;
        self.failures = 0;
        self.failed_leader = None;
        self.batches.remove(index)
    }

    /// A request failed with `error`. Retriable errors put the batch back
    /// and set the partition's backoff; others remove it, and (with
    /// idempotence) mark the sequence gap for a reset.
    pub(crate) fn on_error(
        &mut self,
        batch_id: u64,
        error: Error,
        now: Instant,
        backoff: &Backoff,
    ) -> Failure {
        let Some(index) = self.take_in_flight(batch_id) else { return Failure::Unknown };
        let batch = &self.batches[index];
        let retriable = match error.retry() {
            Retry::Yes => true,
            // With a gap, out of order is expected: it is renumbered later.
            Retry::AfterEarlierFailure => batch.sent_behind || self.gap,
            Retry::No => false,
        };
        if retriable {
            let batch = &mut self.batches[index];
            if matches!(error, Error::Transport { .. } | Error::Timeout { .. }) {
                batch.maybe_stored = true;
            }
            if self.gap && error.retry() == Retry::AfterEarlierFailure {
                // The broker expects another sequence: this one is not
                // stored, so it can be renumbered.
                batch.after_gap = true;
                batch.maybe_stored = false;
            }
            batch.last_error = Some(error);
            self.retry_at = Some(now + backoff.delay(self.failures));
            self.failures = self.failures.saturating_add(1);
            return Failure::Retrying;
        }
        let Some(batch) = self.batches.remove(index) else { return Failure::Unknown };
        if self.idempotent && batch.sequence.is_some() {
            self.open_gap(index);
        }
        Failure::Failed(batch, error)
    }

    /// A request of batch `batch_id` was still unanswered at the batch's
    /// delivery deadline (`error` says so): it is no longer in flight and
    /// may have been stored; [`PartitionQueue::expire`] fails it next. The
    /// partition's back-off and failure count are left alone: the broker
    /// did not fail, the batch ran out of time.
    pub(crate) fn on_deadline(&mut self, batch_id: u64, error: Error) {
        let Some(index) = self.take_in_flight(batch_id) else { return };
        let batch = &mut self.batches[index];
        batch.maybe_stored = true;
        batch.last_error = Some(error);
    }

    /// The sequence breaks before the batch now at `index`: it and every
    /// later batch are to be renumbered.
    fn open_gap(&mut self, index: usize) {
        self.gap = true;
        for b in self.batches.iter_mut().skip(index) {
            b.after_gap = true;
        }
    }

    /// Removes the batches that are not in flight and older than
    /// `timeout`, the open one included; they are to fail with a delivery
    /// timeout. Expiring a batch
    /// that has a sequence opens a gap after it: whether it was stored is
    /// unknown, so later batches that may be stored, or are in flight, stay
    /// to be resolved under their own sequence (acknowledged, or refused as
    /// out of order and then renumbered); the others are renumbered.
    pub(crate) fn expire(&mut self, now: Instant, timeout: Duration) -> Vec<Batch> {
        if self.open.as_ref().is_some_and(|b| now >= b.created + timeout) {
            self.close_open();
        }
        // The common case, checked without walking the queue (the worker
        // asks every partition's queue at every drive): batches are queued
        // in the order they were created ([`PartitionQueue::close_open`]),
        // so none can expire before the first.
        if self.batches.front().is_none_or(|b| now < b.created + timeout) {
            return Vec::new();
        }
        let mut expired = Vec::new();
        let mut kept = VecDeque::with_capacity(self.batches.len());
        let mut gap = false;
        for mut b in self.batches.drain(..) {
            if !b.in_flight && now >= b.created + timeout {
                gap |= b.sequence.is_some() && self.idempotent;
                expired.push(b);
            } else {
                b.after_gap |= gap && !b.maybe_stored && !b.in_flight;
                kept.push_back(b);
            }
        }
        self.batches = kept;
        self.gap |= gap;
        expired
    }

    /// The earliest instant at which [`PartitionQueue::expire`] can remove
    /// something.
    pub(crate) fn next_expiry(&self, timeout: Duration) -> Option<Instant> {
        let closed = self.batches.iter().filter(|b| !b.in_flight);
        closed.chain(self.open.as_ref()).map(|b| b.created + timeout).min()
    }

    /// Whether a closed batch is waiting to be sent (or sent again).
    pub(crate) fn has_unsent(&self) -> bool {
        self.batches.iter().any(|b| !b.in_flight)
    }

    /// Once there is a gap, nothing is in flight and every batch before the
    /// gap is acknowledged (or failed): forgets the identity and the
    /// sequences of the batches left, so they are renumbered from 0 under a
    /// new producer id. Returns whether it reset (the worker then asks for
    /// the new id).
    pub(crate) fn reset_if_drained(&mut self) -> bool {
        // Cheap checks first: the worker asks every queue at every drive.
        if !self.gap || self.in_flight > 0 {
            return false;
        }
        if self.batches.iter().any(|b| !b.after_gap && b.sequence.is_some()) {
            return false;
        }
        for b in &mut self.batches {
            b.sequence = None;
            b.after_gap = false;
            b.maybe_stored = false;
        }
        self.gap = false;
        self.next_sequence = 0;
        self.producer = None;
        self.wants_own_producer_id = true;
        self.failures = 0;
        self.retry_at = None;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    const PID: ProducerId = ProducerId { id: 7, epoch: 0 };
    const NO_BACKOFF: Backoff = Backoff { initial_ms: 0, max_ms: 0 };

    fn record(n: usize) -> pb::Record {
        pb::Record { value: vec![0; n].into(), ..Default::default() }
    }

    /// A queue holding closed batches of the given record counts; returns
    /// the receivers of every record's result.
    fn queue_with(counts: &[usize]) -> (PartitionQueue, Vec<oneshot::Receiver<Result<RecordMetadata>>>) {
        let mut q = PartitionQueue::new(Some(PID), true);
        let mut receivers = Vec::new();
        let now = Instant::now();
        let mut id = 0;
        for (b, &n) in counts.iter().enumerate() {
            for _ in 0..n {
                let (tx, rx) = oneshot::channel();
                receivers.push(rx);
                q.add(record(10), 10, id, tx, || Batch::new(b as u64, now), usize::MAX);
                id += 1;
            }
            q.close_open();
        }
        (q, receivers)
    }

    fn broker_error(code: ErrorCode) -> Error {
        Error::Broker { operation: "produce".into(), code: code as i32, message: String::new(), leader: None }
    }

    #[test]
    fn sequences_follow_record_counts_and_in_flight_is_bounded() {
        let (mut q, _rx) = queue_with(&[3, 2, 4, 1, 1, 1]);
        let now = Instant::now();
        let sent: Vec<_> = std::iter::from_fn(|| q.next_send(now, 5)).collect();
        assert_eq!(sent.iter().map(|s| s.base_sequence).collect::<Vec<_>>(), vec![0, 3, 5, 9, 10]);
        assert!(sent.iter().all(|s| s.producer == PID));
        assert_eq!(q.in_flight, 5);
        assert!(q.next_send(now, 5).is_none(), "at most 5 in flight");
        // The oldest batch fails; the four after it wait at the broker for
        // it: its resend may go beyond the limit, by one.
        q.on_error(0, broker_error(ErrorCode::Unavailable), now, &NO_BACKOFF);
        assert_eq!(q.next_send(now, 4).map(|s| s.batch_id), Some(0), "fills the gap");
        assert_eq!(q.in_flight, 5);
        assert!(q.on_success(0).is_some());
        assert_eq!(q.next_send(now, 5).map(|s| s.base_sequence), Some(11));
        assert_eq!(q.next_sequence, 12);
    }

    #[test]
    fn retriable_failure_resends_in_order_with_original_sequences() {
        let (mut q, _rx) = queue_with(&[2, 2, 2]);
        let now = Instant::now();
        let first: Vec<_> = std::iter::from_fn(|| q.next_send(now, 5)).collect();
        assert_eq!(first.len(), 3);
        // Batch 0 hits a leader change; 1 and 2 then see a gap.
        assert!(matches!(
            q.on_error(0, broker_error(ErrorCode::NotLeader), now, &NO_BACKOFF),
            Failure::Retrying
        ));
        assert!(matches!(
            q.on_error(1, broker_error(ErrorCode::OutOfOrderSequence), now, &NO_BACKOFF),
            Failure::Retrying
        ));
        // Only batch 2 is still in flight; the resend starts at batch 0.
        let again: Vec<_> = std::iter::from_fn(|| q.next_send(now, 5)).collect();
        assert_eq!(
            again.iter().map(|s| (s.batch_id, s.base_sequence)).collect::<Vec<_>>(),
            vec![(0, 0), (1, 2)]
        );
        assert!(matches!(
            q.on_error(2, broker_error(ErrorCode::OutOfOrderSequence), now, &NO_BACKOFF),
            Failure::Retrying
        ));
        assert_eq!(q.next_send(now, 5).map(|s| (s.batch_id, s.base_sequence)), Some((2, 4)));
        assert!(q.on_success(0).is_some() && q.on_success(1).is_some() && q.on_success(2).is_some());
        assert!(q.is_idle());
        assert_eq!(q.next_sequence, 6);
    }

    /// A request cut at its batch's delivery deadline blames no broker: the
    /// partition neither backs off nor counts a failure, and the batch
    /// expires as maybe stored, opening a sequence gap.
    #[test]
    fn a_request_cut_at_its_deadline_expires_its_batch_without_backing_off() {
        let (mut q, _rx) = queue_with(&[1, 1]);
        let now = Instant::now();
        assert_eq!(q.next_send(now, 1).map(|s| s.batch_id), Some(0));
        let cut = Error::Timeout { operation: "produce".into(), address: "b".into(), timeout_ms: 3 };
        q.on_deadline(0, cut);
        assert_eq!((q.in_flight, q.failures, q.retry_at), (0, 0, None));
        let expired = q.expire(now + Duration::from_secs(1), Duration::from_millis(500));
        assert_eq!(
            expired.iter().map(|b| (b.id, b.maybe_stored)).collect::<Vec<_>>(),
            [(0, true), (1, false)]
        );
        assert!(q.gap, "whether batch 0 was stored is unknown: its sequence is a gap");
    }

    #[test]
    fn backoff_blocks_the_partition() {
        let (mut q, _rx) = queue_with(&[1]);
        let now = Instant::now();
        q.next_send(now, 5).expect("send");
        let backoff = Backoff { initial_ms: 100, max_ms: 100 };
        q.on_error(0, broker_error(ErrorCode::Unavailable), now, &backoff);
        assert!(q.next_send(now, 5).is_none());
        assert!(q.next_send(now + Duration::from_millis(130), 5).is_some());
    }

    #[test]
    fn out_of_order_at_the_head_is_fatal_and_forces_a_reset() {
        let (mut q, mut rx) = queue_with(&[2, 3]);
        let now = Instant::now();
        q.next_send(now, 5).expect("send 0");
        q.next_send(now, 5).expect("send 1");
        match q.on_error(0, broker_error(ErrorCode::OutOfOrderSequence), now, &NO_BACKOFF) {
            Failure::Failed(b, e) => {
                assert_eq!(b.id, 0);
                b.complete(0, Err(e));
            }
            other => panic!("expected a failure, got {other:?}"),
        }
        assert!(rx[0].try_recv().expect("resolved").is_err());
        assert!(q.gap);
        assert!(q.next_send(now, 5).is_none(), "nothing after the gap is sent before the reset");
        assert!(!q.reset_if_drained(), "batch 1 is still in flight");
        assert!(matches!(
            q.on_error(1, broker_error(ErrorCode::OutOfOrderSequence), now, &NO_BACKOFF),
            Failure::Retrying
        ));
        assert!(q.reset_if_drained());
        assert!(q.next_send(now, 5).is_none(), "waits for a new producer id");
        let new_pid = ProducerId { id: 8, epoch: 0 };
        q.producer = Some(new_pid);
        let s = q.next_send(now, 5).expect("renumbered");
        assert_eq!((s.batch_id, s.producer, s.base_sequence), (1, new_pid, 0));
    }

    #[test]
    fn batches_before_a_gap_keep_their_sequence_until_acknowledged() {
        let (mut q, _rx) = queue_with(&[2, 2, 2, 2]);
        let now = Instant::now();
        let sent: Vec<_> = std::iter::from_fn(|| q.next_send(now, 5)).collect();
        assert_eq!(sent.len(), 4);
        // Batch 0 was stored but its answer was lost; batch 1 is refused
        // for good; batches 2 and 3 then see the gap.
        let lost = Error::Transport {
            operation: "produce".into(),
            address: "a:1".into(),
            code: tonic::Code::Unavailable,
            message: "reset".into(),
        };
        assert!(matches!(q.on_error(0, lost, now, &NO_BACKOFF), Failure::Retrying));
        let too_large =
            Error::RecordTooLarge { topic: "t".into(), partition: 0, bytes: 1, message: "m".into() };
        assert!(matches!(q.on_error(1, too_large, now, &NO_BACKOFF), Failure::Failed(..)));
        assert!(q.gap);
        for id in [2, 3] {
            let e = broker_error(ErrorCode::OutOfOrderSequence);
            assert!(matches!(q.on_error(id, e, now, &NO_BACKOFF), Failure::Retrying), "batch {id} waits");
        }
        assert!(!q.reset_if_drained(), "batch 0 may be stored: resolve it first");
        let again = q.next_send(now, 5).expect("batch 0 again");
        assert_eq!((again.batch_id, again.producer, again.base_sequence), (0, PID, 0), "same identity");
        assert!(q.next_send(now, 5).is_none(), "batches after the gap wait");
        assert!(q.on_success(0).is_some(), "answered as a duplicate: acknowledged");
        assert!(q.reset_if_drained());
        q.producer = Some(ProducerId { id: 8, epoch: 0 });
        let renumbered: Vec<_> =
            std::iter::from_fn(|| q.next_send(now, 5)).map(|s| (s.batch_id, s.base_sequence)).collect();
        assert_eq!(renumbered, vec![(2, 0), (3, 2)]);
    }

    #[test]
    fn after_an_expiry_batches_that_may_be_stored_are_resolved_before_renumbering() {
        let (mut q, _rx) = queue_with(&[1, 1, 1, 1]);
        let now = q.batches[0].created;
        for b in q.batches.iter_mut().skip(1) {
            b.created = now + Duration::from_secs(100);
        }
        let sent: Vec<_> = std::iter::from_fn(|| q.next_send(now, 5)).collect();
        assert_eq!(sent.len(), 4);
        let lost = || Error::Timeout { operation: "produce".into(), address: "a:1".into(), timeout_ms: 1 };
        q.on_error(0, lost(), now, &NO_BACKOFF);
        q.on_error(1, lost(), now, &NO_BACKOFF);
        q.on_error(2, broker_error(ErrorCode::NotLeader), now, &NO_BACKOFF);
        // Batch 3 is still in flight when batch 0 expires.
        let expired = q.expire(now + Duration::from_secs(10), Duration::from_secs(5));
        assert_eq!(expired.iter().map(|b| b.id).collect::<Vec<_>>(), vec![0]);
        assert!(q.gap);
        assert_eq!(
            q.batches.iter().map(|b| (b.id, b.after_gap)).collect::<Vec<_>>(),
            vec![(1, false), (2, true), (3, false)],
            "1 may be stored and 3 is in flight: both keep their sequence for now"
        );
        let again = q.next_send(now, 5).expect("batch 1 again");
        assert_eq!((again.batch_id, again.base_sequence), (1, 1), "its own sequence");
        assert!(q.next_send(now, 5).is_none(), "batch 2 waits for the reset");
        // The broker never stored batch 0: 1 and 3 are out of order, not stored.
        q.on_error(1, broker_error(ErrorCode::OutOfOrderSequence), now, &NO_BACKOFF);
        assert!(!q.reset_if_drained(), "batch 3 is in flight");
        q.on_error(3, broker_error(ErrorCode::OutOfOrderSequence), now, &NO_BACKOFF);
        assert!(q.reset_if_drained());
        q.producer = Some(ProducerId { id: 9, epoch: 0 });
        let renumbered: Vec<_> =
            std::iter::from_fn(|| q.next_send(now, 5)).map(|s| (s.batch_id, s.base_sequence)).collect();
        assert_eq!(renumbered, vec![(1, 0), (2, 1), (3, 2)], "in order, from 0");
    }

    #[test]
    fn a_gap_with_nothing_behind_it_still_resets_for_later_batches() {
        let (mut q, _rx) = queue_with(&[1]);
        let now = Instant::now();
        q.next_send(now, 5).expect("send");
        q.on_error(0, broker_error(ErrorCode::InvalidRequest), now, &NO_BACKOFF);
        assert!(q.reset_if_drained(), "the next batch must not continue after the gap");
        assert_eq!((q.producer, q.next_sequence), (None, 0));
    }

    #[test]
    fn record_too_large_fails_only_its_batch() {
        let (mut q, _rx) = queue_with(&[1]);
        let now = Instant::now();
        q.next_send(now, 5).expect("send");
        let e = Error::RecordTooLarge { topic: "t".into(), partition: 0, bytes: 10, message: "limit".into() };
        assert!(matches!(q.on_error(0, e, now, &NO_BACKOFF), Failure::Failed(..)));
        assert!(q.is_idle());
    }

    #[test]
    fn expiry_skips_in_flight_batches() {
        let (mut q, _rx) = queue_with(&[1, 1]);
        let now = q.batches[1].created;
        q.next_send(now, 1).expect("send 0");
        let later = now + Duration::from_secs(10);
        assert_eq!(q.next_expiry(Duration::from_secs(5)), Some(now + Duration::from_secs(5)));
        let expired = q.expire(later, Duration::from_secs(5));
        assert_eq!(expired.iter().map(|b| b.id).collect::<Vec<_>>(), vec![1]);
        assert!(!q.gap, "batch 1 never got a sequence");
        assert_eq!(q.batches.len(), 1);
    }

    #[test]
    fn batches_close_at_the_size_limit_and_big_records_travel_alone() {
        let mut q = PartitionQueue::new(Some(PID), true);
        let now = Instant::now();
        let mut ids = 0..;
        let mut add = |q: &mut PartitionQueue, n: usize| {
            let (tx, _rx) = oneshot::channel();
            let id = ids.next().expect("id");
            q.add(record(n), n, id, tx, || Batch::new(id, now), 100)
        };
        assert!(!add(&mut q, 40));
        assert!(!add(&mut q, 40));
        assert!(add(&mut q, 40), "the third would exceed 100 bytes: the first two are closed");
        assert!(add(&mut q, 500), "an oversized record closes the open batch and its own");
        assert_eq!(q.batches.iter().map(|b| b.record_count()).collect::<Vec<_>>(), vec![2, 1, 1]);
        assert!(q.open.is_none());
    }

    #[test]
    fn sequence_wraps_like_kafka() {
        assert_eq!(increment_sequence(0, 5), 5);
        assert_eq!(increment_sequence(i32::MAX - 1, 1), i32::MAX);
        assert_eq!(increment_sequence(i32::MAX, 1), 0);
        assert_eq!(increment_sequence(i32::MAX - 2, 5), 2);
    }

    #[test]
    fn without_idempotence_no_ids_and_no_resets() {
        let mut q = PartitionQueue::new(None, false);
        let now = Instant::now();
        let (tx, _rx) = oneshot::channel();
        q.add(record(1), 1, 0, tx, || Batch::new(0, now), 100);
        q.close_open();
        let s = q.next_send(now, 5).expect("send");
        assert_eq!((s.producer, s.base_sequence), (ProducerId::NONE, 0));
        q.on_error(0, broker_error(ErrorCode::InvalidRequest), now, &NO_BACKOFF);
        assert!(!q.gap);
    }
}

//! The leader's gate for idempotent producers (KIP-98): decides, before a
//! batch is proposed to Raft, whether it is the next in its producer's
//! sequence, a duplicate of an applied batch, or a retry of one still in
//! flight.
//!
//! The applied state lives in the replica (derived by apply, carried in
//! snapshots); this adds the leader's own proposals that are not applied
//! yet. It is valid only while nothing unknown sits between the two: after
//! becoming leader, or after a proposal failed (it may still commit), the
//! caller waits until every proposal has reached the log or failed and
//! apply has reached the log's end, and calls [`Sequencer::reset`].
//!
//! Raft may refuse a proposal and accept a later one: each idempotent
//! proposal is registered with the replica's [`AppendWatch`], whose log
//! store stores blank a batch that would overtake a refused one (see
//! [`ferrolog_raft_store::appends`]).

use std::collections::{BTreeSet, HashMap};

use ferrolog_raft_store::{
    AppendWatch, Leadership, NO_PRODUCER_ID, ProposalKey, Replica, SequenceCheck, producer,
};

/// Verdict on a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Propose it.
    Append,
    /// As the replica's check: duplicate of an applied batch, out of order, fenced.
    Applied(SequenceCheck),
    /// The same batch was proposed and is not applied yet.
    InFlight,
}

#[derive(Debug, Default)]
struct Pending {
    epoch: i16,
    next_sequence: i32,
    in_flight: BTreeSet<i32>,
}

/// Proposals in flight per producer id, valid for one leader term.
#[derive(Debug, Default)]
pub struct Sequencer {
    term: Option<u64>,
    pending: HashMap<i64, Pending>,
}

impl Sequencer {
    /// Whether the state is valid for `term` (else wait for apply to reach
    /// the log end, then [`Sequencer::reset`]).
    pub fn is_valid_for(&self, term: u64) -> bool {
        self.term == Some(term)
    }

    /// Forgets everything in flight and starts over for `term`; the caller
    /// has seen apply reach the end of the log.
    pub fn reset(&mut self, term: u64) {
        self.term = Some(term);
        self.pending.clear();
    }

    /// Marks the state invalid: a proposal failed and may or may not commit.
    pub fn invalidate(&mut self) {
        self.term = None;
    }

    /// Judges a batch of `record_count` records.
    pub fn check(
        &self,
        replica: &Replica,
        producer_id: i64,
        epoch: i16,
        first: i32,
        record_count: u32,
    ) -> Verdict {
        if producer_id == NO_PRODUCER_ID {
            return Verdict::Append;
        }
        let applied = replica.check_sequence(producer_id, epoch, first, record_count);
        let Some(p) = self.pending.get(&producer_id) else {
            return match applied {
                SequenceCheck::Append => Verdict::Append,
                other => Verdict::Applied(other),
            };
        };
        if epoch < p.epoch {
            return Verdict::Applied(SequenceCheck::Fenced { current: p.epoch });
        }
        if epoch == p.epoch {
            if p.in_flight.contains(&first) {
                // Applied already (its settling has not run yet): answer it.
                if let d @ SequenceCheck::Duplicate(_) = applied {
                    return Verdict::Applied(d);
                }
                return Verdict::InFlight;
            }
            if first == p.next_sequence {
                return Verdict::Append;
            }
            return match applied {
                d @ SequenceCheck::Duplicate(_) => Verdict::Applied(d),
                _ => Verdict::Applied(SequenceCheck::OutOfOrder { expected: p.next_sequence }),
            };
        }
        // A newer epoch while the old one has batches in flight: let those
        // settle first.
        Verdict::InFlight
    }

    /// Reserves the batch's place in its producer's sequence and registers
    /// it with `watch`, before it is proposed. The returned guard gives
    /// the place back unless told the proposal was handed to Raft.
    pub fn reserve<'a>(
        &'a mut self,
        watch: &'a AppendWatch,
        leadership: Leadership,
        producer_id: i64,
        epoch: i16,
        first: i32,
        record_count: u32,
    ) -> Reservation<'a> {
        let key = (producer_id != NO_PRODUCER_ID).then_some(ProposalKey {
            producer_id,
            epoch,
            base_sequence: first,
        });
        if key.is_some() {
            let p = self.pending.entry(producer_id).or_default();
            p.epoch = epoch;
            let last = producer::last_sequence(first, record_count);
            p.next_sequence = producer::next_sequence(last);
            p.in_flight.insert(first);
        }
        if let Some(key) = key {
            watch.expect(key, leadership);
        }
        Reservation { seq: self, watch, producer_id, first, key, armed: true }
    }

    /// Notes that the proposal of the batch finished (applied or failed).
    pub fn complete(&mut self, producer_id: i64, first: i32) {
        if let Some(p) = self.pending.get_mut(&producer_id) {
            p.in_flight.remove(&first);
            if p.in_flight.is_empty() {
                self.pending.remove(&producer_id);
            }
        }
    }
}

/// A batch's place in its producer's sequence, reserved before its
/// proposal ([`Sequencer::reserve`]). Dropped before
/// [`Reservation::proposed`] (the proposal failed, or the request was
/// cancelled while the proposal waited for room in Raft's queue) it gives
/// the place back: the batch is no longer in flight, the watch forgets it,
/// and the state is marked invalid, since what else was reserved behind
/// it is unknown. A reservation must never outlive its proposal.
#[must_use = "dropping a reservation gives its place back"]
pub struct Reservation<'a> {
    seq: &'a mut Sequencer,
    watch: &'a AppendWatch,
    producer_id: i64,
    first: i32,
    key: Option<ProposalKey>,
    armed: bool,
}

impl Reservation<'_> {
    /// The proposal was handed to Raft: its outcome is now the settling's
    /// to report ([`Sequencer::complete`]; a refusal is marked in the watch
    /// by the Raft node, [`ferrolog_replica::Pending::committed`]).
    pub fn proposed(mut self) {
        self.armed = false;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.seq.complete(self.producer_id, self.first);
        self.seq.invalidate();
        if let Some(key) = self.key {
            self.watch.forget(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolog_raft_store::{Flusher, StoreConfig};

    const PID: i64 = 7;
    const LEADER: Leadership = Leadership { term: 1, node: 1 };

    fn replica(dir: &std::path::Path) -> Replica {
        let flusher = Flusher::spawn("sequencer-test").expect("flusher");
        Replica::open(dir, StoreConfig::default(), flusher).expect("replica")
    }

    /// A reservation dropped before its proposal was handed over (the
    /// proposal failed, or the request was cancelled) leaves nothing
    /// behind that a later batch could be judged against.
    #[test]
    fn a_dropped_reservation_gives_its_place_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let replica = replica(dir.path());
        let watch = replica.append_watch();
        let mut seq = Sequencer::default();
        seq.reset(1);
        seq.reserve(watch, LEADER, PID, 0, 0, 2).proposed();
        assert!(!watch.is_idle(), "registered before it is handed to Raft");
        drop(seq.reserve(watch, LEADER, PID, 0, 2, 1));
        assert!(!seq.is_valid_for(1), "what was reserved behind it is unknown");
        assert!(watch.admit(ProposalKey { producer_id: PID, epoch: 0, base_sequence: 0 }, LEADER));
        assert!(watch.is_idle(), "the watch forgot the dropped one");
        seq.reset(1);
        assert_eq!(
            seq.check(&replica, PID, 0, 3, 1),
            Verdict::Applied(SequenceCheck::OutOfOrder { expected: 0 }),
            "judged by the applied state alone (nothing applied here)"
        );
        assert_eq!(seq.check(&replica, PID, 0, 0, 2), Verdict::Append);
    }
}

//! The leader's gate for idempotent producers (KIP-98): decides, before a
//! batch is proposed to Raft, whether it is the next in its producer's
//! sequence, a duplicate of an applied batch, or a retry of one still in
//! flight.
//!
//! The applied state lives in the replica (derived by apply, carried in
//! snapshots); this adds the leader's own proposals that are not applied
//! yet. It is valid only while nothing unknown sits between the two: after
//! becoming leader, or after a proposal failed (it may still commit), the
//! caller waits until apply has reached the log's end and calls
//! [`Sequencer::reset`].

use std::collections::{BTreeSet, HashMap};

use ferrolog_raft_store::{NO_PRODUCER_ID, Replica, SequenceCheck, producer};

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

    /// Notes that the batch was proposed.
    pub fn reserve(&mut self, producer_id: i64, epoch: i16, first: i32, record_count: u32) {
        if producer_id == NO_PRODUCER_ID {
            return;
        }
        let p = self.pending.entry(producer_id).or_default();
        p.epoch = epoch;
        let last = producer::last_sequence(first, record_count);
        p.next_sequence = producer::next_sequence(last);
        p.in_flight.insert(first);
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

//! Idempotent producer state of a partition (Kafka KIP-98): for each
//! producer id, its epoch and its last few batches' sequence numbers and
//! offsets, so a retried batch is recognised and answered with the offsets
//! it already has instead of being appended twice.
//!
//! The state is a pure function of the committed log: every replica derives
//! the same one by applying entries, and snapshots carry it so it survives
//! failover, restarts and log purges. The leader consults it before it
//! proposes a batch (see the broker's sequencer); apply only records.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::batch::{AppendResult, NO_PRODUCER_ID, RecordBatch};

/// How many recent batches per producer are remembered for duplicate
/// detection; Kafka's broker keeps 5, matching its default of 5 in-flight
/// requests per connection.
pub const BATCHES_RETAINED: usize = 5;

/// One remembered batch of a producer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchSequence {
    /// Sequence number of the batch's first record.
    pub first_sequence: i32,
    /// Sequence number of the batch's last record.
    pub last_sequence: i32,
    /// Offset the batch's first record received.
    pub base_offset: u64,
    /// Records in the batch.
    pub record_count: u32,
}

/// What is known of one producer id.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerEntry {
    /// Latest epoch seen; older epochs are fenced.
    pub epoch: i16,
    /// The most recent batches, oldest first, at most [`BATCHES_RETAINED`].
    pub batches: VecDeque<BatchSequence>,
    /// When the producer last wrote, ms since the Unix epoch: its last
    /// batch's largest timestamp, never earlier than the time of the last
    /// expiry decision applied before it (so a producer's slow clock cannot
    /// age it). 0 in state written before expiry existed: unknown, and
    /// counted from the next expiry decision.
    #[serde(default)]
    pub last_timestamp_ms: i64,
}

/// The verdict on a batch about to be appended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SequenceCheck {
    /// The next batch in sequence (or not idempotent): append it.
    Append,
    /// Already appended: these are its offsets.
    Duplicate(AppendResult),
    /// Not the next sequence number; `expected` is.
    OutOfOrder {
        /// The sequence number the next batch must start with.
        expected: i32,
    },
    /// The producer's epoch is older than `current`.
    Fenced {
        /// The epoch in force.
        current: i16,
    },
}

/// Idempotent producer state of a partition, by producer id.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerStates {
    producers: BTreeMap<i64, ProducerEntry>,
    /// The time of the last expiry decision applied, ms since the Unix
    /// epoch (the leader's clock when it decided; 0: none yet).
    #[serde(default)]
    clock_ms: i64,
}

/// The sequence number after `last` (sequence numbers wrap to 0 after
/// `i32::MAX`, as in Kafka).
pub fn next_sequence(last: i32) -> i32 {
    if last == i32::MAX { 0 } else { last + 1 }
}

/// Sequence number of the last record of a batch of `record_count` records
/// starting at `first` (wrapping after `i32::MAX`).
pub fn last_sequence(first: i32, record_count: u32) -> i32 {
    let n = i64::from(record_count.max(1)) - 1;
    ((i64::from(first) + n) % (i64::from(i32::MAX) + 1)) as i32
}

impl ProducerStates {
    /// Judges a batch `(producer_id, epoch, first_sequence)` of
    /// `record_count` records against the state. A batch without producer
    /// id is always [`SequenceCheck::Append`].
    pub fn check(
        &self,
        producer_id: i64,
        epoch: i16,
        first_sequence: i32,
        record_count: u32,
    ) -> SequenceCheck {
        if producer_id == NO_PRODUCER_ID {
            return SequenceCheck::Append;
        }
        let Some(entry) = self.producers.get(&producer_id) else {
            return if first_sequence == 0 {
                SequenceCheck::Append
            } else {
                SequenceCheck::OutOfOrder { expected: 0 }
            };
        };
        if epoch < entry.epoch {
            return SequenceCheck::Fenced { current: entry.epoch };
        }
        if epoch > entry.epoch {
            return if first_sequence == 0 {
                SequenceCheck::Append
            } else {
                SequenceCheck::OutOfOrder { expected: 0 }
            };
        }
        if let Some(b) = entry
            .batches
            .iter()
            .find(|b| b.first_sequence == first_sequence && b.record_count == record_count)
        {
            return SequenceCheck::Duplicate(AppendResult {
                base_offset: b.base_offset,
                record_count: b.record_count,
            });
        }
        let expected = entry.batches.back().map_or(0, |b| next_sequence(b.last_sequence));
        if first_sequence == expected {
            SequenceCheck::Append
        } else {
            SequenceCheck::OutOfOrder { expected }
        }
    }

    /// The sequence number the producer's next batch must start with, if the
    /// producer is known at `epoch`.
    pub fn expected_sequence(&self, producer_id: i64, epoch: i16) -> Option<i32> {
        let e = self.producers.get(&producer_id).filter(|e| e.epoch == epoch)?;
        Some(e.batches.back().map_or(0, |b| next_sequence(b.last_sequence)))
    }

    /// Records an applied batch. Batches of unknown producers (whatever
    /// their sequence: a producer whose id expired while its batch was in
    /// flight is known again from it, as Kafka's replicas do), newer epochs
    /// and next sequences are recorded; anything else (which the leader's
    /// check should have refused) is ignored and reported as `false`.
    pub fn record(&mut self, batch: &RecordBatch, result: AppendResult) -> bool {
        let verdict =
            self.check(batch.producer_id, batch.producer_epoch, batch.base_sequence, batch.record_count);
        let unknown = !self.producers.contains_key(&batch.producer_id);
        if batch.producer_id == NO_PRODUCER_ID || (verdict != SequenceCheck::Append && !unknown) {
            return batch.producer_id == NO_PRODUCER_ID;
        }
        let clock_ms = self.clock_ms;
        let entry = self.producers.entry(batch.producer_id).or_default();
        if batch.producer_epoch != entry.epoch {
            entry.epoch = batch.producer_epoch;
            entry.batches.clear();
        }
        entry.last_timestamp_ms = entry.last_timestamp_ms.max(batch.max_timestamp_ms).max(clock_ms);
        entry.batches.push_back(BatchSequence {
            first_sequence: batch.base_sequence,
            last_sequence: last_sequence(batch.base_sequence, batch.record_count),
            base_offset: result.base_offset,
            record_count: result.record_count,
        });
        while entry.batches.len() > BATCHES_RETAINED {
            entry.batches.pop_front();
        }
        true
    }

    /// Producer ids that would expire at `now_ms` after `expiration_ms`
    /// without writes (Kafka's `producer.id.expiration.ms`).
    pub fn idle(&self, now_ms: i64, expiration_ms: i64) -> usize {
        self.producers
            .values()
            .filter(|e| {
                e.last_timestamp_ms != 0 && e.last_timestamp_ms.saturating_add(expiration_ms) <= now_ms
            })
            .count()
    }

    /// Applies an expiry decision ([`crate::Control::ExpireProducers`]):
    /// drops every producer id whose last write is `expiration_ms` or more
    /// before `now_ms`; one of unknown age (state from before expiry
    /// existed) starts its count at `now_ms`. Returns how many went. A pure
    /// function of the state and the decision, so every replica drops the
    /// same ones.
    pub fn expire(&mut self, now_ms: i64, expiration_ms: i64) -> usize {
        self.clock_ms = self.clock_ms.max(now_ms);
        let before = self.producers.len();
        self.producers.retain(|_, e| {
            if e.last_timestamp_ms == 0 {
                e.last_timestamp_ms = now_ms;
            }
            e.last_timestamp_ms.saturating_add(expiration_ms) > now_ms
        });
        before - self.producers.len()
    }

    /// Whether `producer_id` is tracked.
    pub fn contains(&self, producer_id: i64) -> bool {
        self.producers.contains_key(&producer_id)
    }

    /// Number of producer ids tracked.
    pub fn len(&self) -> usize {
        self.producers.len()
    }

    /// Whether no producer id is tracked.
    pub fn is_empty(&self) -> bool {
        self.producers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(pid: i64, epoch: i16, seq: i32, n: u32) -> RecordBatch {
        RecordBatch {
            record_count: n,
            producer_id: pid,
            producer_epoch: epoch,
            base_sequence: seq,
            ..RecordBatch::default()
        }
    }

    fn res(base_offset: u64, record_count: u32) -> AppendResult {
        AppendResult { base_offset, record_count }
    }

    #[test]
    fn sequences_duplicates_gaps_and_fencing() {
        let mut s = ProducerStates::default();
        assert_eq!(s.check(7, 0, 3, 1), SequenceCheck::OutOfOrder { expected: 0 });
        assert_eq!(s.check(7, 0, 0, 2), SequenceCheck::Append);
        assert!(s.record(&batch(7, 0, 0, 2), res(10, 2)));
        assert_eq!(s.check(7, 0, 0, 2), SequenceCheck::Duplicate(res(10, 2)));
        assert_eq!(s.check(7, 0, 2, 1), SequenceCheck::Append);
        assert_eq!(s.check(7, 0, 3, 1), SequenceCheck::OutOfOrder { expected: 2 });
        assert!(!s.record(&batch(7, 0, 5, 1), res(12, 1)), "a gap is not recorded");
        assert!(s.record(&batch(9, 0, 5, 1), res(12, 1)), "an unknown producer is known from any batch");
        assert_eq!(s.check(9, 0, 6, 1), SequenceCheck::Append);
        assert!(s.record(&batch(7, 1, 0, 1), res(12, 1)), "a new epoch restarts at 0");
        assert_eq!(s.check(7, 0, 2, 1), SequenceCheck::Fenced { current: 1 });
        assert_eq!(s.expected_sequence(7, 1), Some(1));
        assert_eq!(s.check(NO_PRODUCER_ID, 0, 99, 1), SequenceCheck::Append);
    }

    #[test]
    fn idle_producers_expire_and_active_ones_stay() {
        let mut s = ProducerStates::default();
        let at = |pid: i64, seq: i32, ts: i64| RecordBatch { max_timestamp_ms: ts, ..batch(pid, 0, seq, 1) };
        assert!(s.record(&at(1, 0, 1_000), res(0, 1)));
        assert!(s.record(&at(2, 0, 1_000), res(1, 1)));
        assert!(s.record(&at(2, 1, 5_000), res(2, 1)));
        assert_eq!(s.idle(5_999, 5_000), 0);
        assert_eq!(s.idle(6_000, 5_000), 1);
        assert_eq!(s.expire(6_000, 5_000), 1);
        assert!(!s.contains(1) && s.contains(2));
        assert_eq!(
            s.check(2, 0, 1, 1),
            SequenceCheck::Duplicate(res(2, 1)),
            "the active one still deduplicates"
        );
        assert_eq!(
            s.check(1, 0, 1, 1),
            SequenceCheck::OutOfOrder { expected: 0 },
            "the idle one is forgotten"
        );
        // A producer whose clock is slow is aged from the last decision, not its timestamps.
        assert!(s.record(&at(3, 0, 10), res(3, 1)));
        assert_eq!(s.expire(6_001, 5_000), 0, "3 counts from 6,000");
        // State from before expiry: counted from the first decision.
        let mut old = s.clone();
        old.producers.values_mut().for_each(|e| e.last_timestamp_ms = 0);
        assert_eq!(old.expire(100_000, 5_000), 0);
        assert_eq!(old.expire(105_000, 5_000), 2);
    }

    #[test]
    fn remembers_the_last_five_batches_and_wraps() {
        let mut s = ProducerStates::default();
        for i in 0..8u32 {
            assert!(s.record(&batch(1, 0, i as i32, 1), res(u64::from(i), 1)));
        }
        assert_eq!(s.check(1, 0, 7, 1), SequenceCheck::Duplicate(res(7, 1)));
        assert_eq!(s.check(1, 0, 3, 1), SequenceCheck::Duplicate(res(3, 1)));
        assert_eq!(s.check(1, 0, 2, 1), SequenceCheck::OutOfOrder { expected: 8 });
        assert_eq!(last_sequence(i32::MAX - 1, 3), 0);
        assert_eq!(next_sequence(i32::MAX), 0);
    }
}

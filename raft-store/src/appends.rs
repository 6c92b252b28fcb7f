//! The leader's last gate for idempotent batches: a producer's batch that
//! would reach the log ahead of an earlier batch of the same producer is
//! stored as a blank entry instead.
//!
//! A leader checks a batch's producer sequence (KIP-98) before proposing
//! it, and pipelines: batch `n + 1` of a producer is checked against the
//! reservation of batch `n`, not against the log. That is sound only if
//! the Raft library accepts proposals in the order they were made, or
//! refuses every one after a refused one. It does not: a leader whose lease
//! (a quorum's acknowledgement within the maximum election timeout) has
//! lapsed refuses a proposal, and accepts the next one once an
//! acknowledgement arrives, in the same term. Batch `n + 1` would then
//! land in the log without batch `n`, and the producer's records would be
//! stored out of order (seen at 10,000 partitions, where leases lapse
//! under load).
//!
//! The Raft library hands proposals to the log store in the order they
//! were made, less the refused ones. So the leader registers each
//! idempotent proposal here before handing it over
//! ([`AppendWatch::expect`]), and the log store admits each entry it
//! appends ([`AppendWatch::admit`]): an entry with an earlier proposal of
//! its producer still registered before it, which can only have been
//! refused, is stored blank (no records; every replica applies it as
//! nothing), and the leader answers its producer out of order. Waiting for
//! each batch to reach the log before proposing the next would do too, at
//! a cost: 13–15% of one producer's records/s at 100 B, measured. The
//! leader crosses off a proposal that failed ([`AppendWatch::forget`]).
//! A proposal is known by its producer id, epoch and first sequence: the
//! leader never has two proposals of the same batch in flight.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

use crate::batch::{NO_PRODUCER_ID, RecordBatch};

/// One idempotent batch: producer id, epoch, first sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProposalKey {
    /// Producer id (KIP-98).
    pub producer_id: i64,
    /// Producer epoch.
    pub epoch: i16,
    /// Sequence number of the batch's first record.
    pub base_sequence: i32,
}

impl ProposalKey {
    /// The key of `batch`, or `None` for a batch without a producer id.
    pub fn of(batch: &RecordBatch) -> Option<Self> {
        (batch.producer_id != NO_PRODUCER_ID).then_some(ProposalKey {
            producer_id: batch.producer_id,
            epoch: batch.producer_epoch,
            base_sequence: batch.base_sequence,
        })
    }
}

/// A registered proposal: its key, and whether it failed.
#[derive(Debug)]
struct Sent {
    key: ProposalKey,
    failed: bool,
}

/// The leader's idempotent proposals not in its log yet, per producer id in
/// the order they were proposed (see the module's documentation). Empty
/// on followers.
#[derive(Debug, Default)]
pub struct AppendWatch {
    sent: Mutex<HashMap<i64, VecDeque<Sent>>>,
    /// Registered proposals, read without the lock on every append.
    count: AtomicUsize,
    /// Woken whenever a proposal is crossed off.
    changed: Notify,
}

impl AppendWatch {
    fn sent(&self) -> std::sync::MutexGuard<'_, HashMap<i64, VecDeque<Sent>>> {
        // The map stays consistent whatever panicked while holding it.
        self.sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers a proposal about to be handed to Raft. Proposals must be
    /// registered in the order they are handed over.
    pub fn expect(&self, key: ProposalKey) {
        self.sent().entry(key.producer_id).or_default().push_back(Sent { key, failed: false });
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether no registered proposal is waiting to be appended.
    pub fn is_idle(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// Marks a proposal that failed (or whose caller gave up before handing
    /// it over): it will never be appended. It stays registered while a
    /// later proposal of its producer is, so that one is stored blank if it
    /// reaches the log. A no-op if it is not registered.
    pub fn forget(&self, key: ProposalKey) {
        self.update(key, |queue, position| {
            queue[position].failed = true;
        });
    }

    /// Called by the log store for each idempotent entry it is about to
    /// append, in log order: crosses the entry's proposal off and returns
    /// whether the entry may be stored as it is. `false`: an earlier
    /// proposal of the same producer is still registered, so it never
    /// reached the log (it was refused; its failure may not be known yet),
    /// and this one must be stored blank, as must every later one while
    /// the earlier stays registered. An entry that was not registered here
    /// (a follower's, an earlier leader's) is admitted.
    pub fn admit(&self, key: ProposalKey) -> bool {
        if self.is_idle() {
            return true;
        }
        let mut admitted = true;
        self.update(key, |queue, position| {
            queue.remove(position);
            admitted = position == 0;
        });
        admitted
    }

    /// Applies `change` to the registered proposal `key` (its producer's
    /// queue, its position there), then drops the failed proposals left
    /// with nothing after them: they hold nothing back.
    fn update(&self, key: ProposalKey, change: impl FnOnce(&mut VecDeque<Sent>, usize)) {
        let mut sent = self.sent();
        let Some(queue) = sent.get_mut(&key.producer_id) else { return };
        let Some(position) = queue.iter().position(|s| s.key == key) else { return };
        let before = queue.len();
        change(queue, position);
        while queue.back().is_some_and(|s| s.failed) {
            queue.pop_back();
        }
        let gone = before - queue.len();
        if queue.is_empty() {
            sent.remove(&key.producer_id);
        }
        drop(sent);
        if gone > 0 {
            self.count.fetch_sub(gone, Ordering::AcqRel);
            self.changed.notify_waiters();
        }
    }

    /// A future that completes at the next crossing off. Create it before
    /// checking the state it waits on, so a change in between is not
    /// missed (`tokio::sync::Notify::notified`).
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(producer_id: i64, base_sequence: i32) -> ProposalKey {
        ProposalKey { producer_id, epoch: 0, base_sequence }
    }

    #[test]
    fn entries_reaching_the_log_in_order_are_admitted() {
        let w = AppendWatch::default();
        assert!(w.is_idle());
        w.expect(key(7, 0));
        w.expect(key(7, 2));
        w.expect(key(8, 0));
        assert!(w.admit(key(8, 0)), "another producer's batches do not hold it back");
        assert!(w.admit(key(7, 0)));
        assert!(w.admit(key(9, 5)), "not registered: a follower's or an earlier leader's entry");
        assert!(w.admit(key(7, 2)));
        assert!(w.is_idle());
    }

    /// The lease case: batch 0 refused, batch 2 (proposed behind it)
    /// accepted; and whether or not the leader has heard of the refusal
    /// yet when batch 2 reaches the log.
    #[test]
    fn a_batch_that_would_overtake_a_refused_one_is_not_admitted() {
        for refusal_known in [false, true] {
            let w = AppendWatch::default();
            w.expect(key(7, 0));
            w.expect(key(7, 2));
            w.expect(key(7, 3));
            if refusal_known {
                w.forget(key(7, 0));
                assert!(!w.is_idle(), "batch 0 still holds back the ones after it");
            }
            assert!(!w.admit(key(7, 2)), "batch 0 never reached the log");
            assert!(!w.admit(key(7, 3)), "nor does it later: 3 would overtake it too");
            w.forget(key(7, 0));
            assert!(w.is_idle(), "refusal known: {refusal_known}");
            assert!(w.admit(key(7, 3)), "nothing registered: the sequencer has started over");
        }
    }

    #[test]
    fn failed_proposals_with_nothing_after_them_are_dropped() {
        let w = AppendWatch::default();
        w.expect(key(7, 0));
        w.expect(key(7, 1));
        w.forget(key(7, 1));
        assert!(!w.is_idle(), "batch 0 is still on its way");
        w.forget(key(7, 0));
        assert!(w.is_idle());
        w.forget(key(7, 0));
        assert!(w.is_idle(), "forgetting twice is harmless");
        assert!(w.admit(key(7, 0)));
        assert_eq!(ProposalKey::of(&RecordBatch { producer_id: NO_PRODUCER_ID, ..Default::default() }), None);
    }

    #[tokio::test]
    async fn crossing_off_wakes_a_waiter_created_before() {
        let w = AppendWatch::default();
        w.expect(key(7, 0));
        let changed = w.changed();
        assert!(w.admit(key(7, 0)));
        tokio::time::timeout(std::time::Duration::from_secs(5), changed).await.expect("woken");
    }
}

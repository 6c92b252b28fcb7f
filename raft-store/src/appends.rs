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
//! a cost: 13–15% of one producer's records/s at 100 B, measured.
//!
//! The Raft node marks a refused proposal as soon as it hears of it
//! ([`AppendWatch::fail`]); it stays registered, holding its producer's
//! later batches back, until the leader starts over: once every
//! registered proposal has reached the log or failed, it clears the watch
//! ([`AppendWatch::clear`]) and judges sequences by the applied state
//! again. A proposal never handed over is forgotten
//! ([`AppendWatch::forget`]). A proposal is known by its producer id,
//! epoch and first sequence, and the leadership (term and leader node)
//! that proposed it: the leader never has two proposals of the same batch
//! in flight, and a deposed leader's registrations leave every other
//! leadership's entries alone.

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

/// A leadership: its term and its leader's node id. One term can see two
/// leaders (openraft orders leader ids by term, then node id, and a voter
/// whose leader's lease lapsed may grant a higher id of the same term), so
/// a leader's own entries are known by both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Leadership {
    /// The Raft term.
    pub term: u64,
    /// The leader's Raft node id.
    pub node: u64,
}

/// A registered proposal: its key, the leadership that proposed it, and
/// whether it is known to have failed.
#[derive(Debug)]
struct Sent {
    key: ProposalKey,
    leadership: Leadership,
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

    /// Registers a proposal about to be handed to Raft by `leadership`.
    /// Proposals must be registered in the order they are handed over.
    pub fn expect(&self, key: ProposalKey, leadership: Leadership) {
        let mut sent = self.sent();
        sent.entry(key.producer_id).or_default().push_back(Sent { key, leadership, failed: false });
        // Under the lock, as every change of the count: it must never
        // disagree with the map once the lock is free.
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    /// Marks a proposal that Raft refused or dropped: it will never be
    /// appended. It stays registered, holding back every later proposal of
    /// its producer (those are stored blank), until [`AppendWatch::clear`].
    /// A no-op if it is not registered.
    pub fn fail(&self, key: ProposalKey) {
        let mut sent = self.sent();
        let found = sent.get_mut(&key.producer_id).and_then(|q| q.iter_mut().find(|s| s.key == key));
        if let Some(s) = found {
            s.failed = true;
            drop(sent);
            self.changed.notify_waiters();
        }
    }

    /// Whether every registered proposal has reached the log or failed:
    /// none is still on its way.
    pub fn is_settled(&self) -> bool {
        self.is_idle() || self.sent().values().flatten().all(|s| s.failed)
    }

    /// Forgets every registered proposal. For the leader when it starts
    /// over ([`AppendWatch::is_settled`] first: what is left failed, and
    /// holds nothing back any more).
    pub fn clear(&self) {
        let mut sent = self.sent();
        debug_assert!(sent.values().flatten().all(|s| s.failed), "cleared while proposals were on their way");
        sent.clear();
        self.count.store(0, Ordering::Release);
    }

    /// Whether no registered proposal is waiting to be appended.
    pub fn is_idle(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// Forgets a proposal that was never handed to Raft (its hand-over
    /// failed, or its caller gave up first): the leader calls it under the
    /// same lock as it registered the proposal, and marks its own state
    /// invalid with it, so nothing was registered behind it meanwhile. A
    /// no-op if it is not registered.
    pub fn forget(&self, key: ProposalKey) {
        self.remove(key, None);
    }

    /// Called by the log store for each idempotent entry it is about to
    /// append, in log order, with the leadership of the entry's log id:
    /// crosses the entry's proposal off and returns whether the entry may
    /// be stored as it is. `false`: an earlier proposal of the same
    /// producer by that leadership is still registered, so it never
    /// reached the log (it was refused; its failure may not be known yet),
    /// and this one must be stored blank, as must every later one until
    /// the leader starts over ([`AppendWatch::clear`]). An entry that was
    /// not registered here by its leadership (a follower's, another
    /// leader's) is admitted.
    pub fn admit(&self, key: ProposalKey, leadership: Leadership) -> bool {
        if self.is_idle() {
            return true;
        }
        self.remove(key, Some(leadership)).is_none_or(|held_back| !held_back)
    }

    /// Removes the registration of `key` (by `leadership`, if given; else
    /// the last one). Returns whether a registration of the same
    /// leadership was before it, or `None` if there was none to remove.
    fn remove(&self, key: ProposalKey, leadership: Option<Leadership>) -> Option<bool> {
        let mut sent = self.sent();
        let queue = sent.get_mut(&key.producer_id)?;
        let position =
            queue.iter().rposition(|s| s.key == key && leadership.is_none_or(|l| s.leadership == l))?;
        let leadership = queue[position].leadership;
        let held_back = queue.iter().take(position).any(|s| s.leadership == leadership);
        queue.remove(position);
        if queue.is_empty() {
            sent.remove(&key.producer_id);
        }
        self.count.fetch_sub(1, Ordering::AcqRel);
        drop(sent);
        self.changed.notify_waiters();
        Some(held_back)
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

    const TERM: Leadership = Leadership { term: 3, node: 1 };

    fn key(producer_id: i64, base_sequence: i32) -> ProposalKey {
        ProposalKey { producer_id, epoch: 0, base_sequence }
    }

    #[test]
    fn entries_reaching_the_log_in_order_are_admitted() {
        let w = AppendWatch::default();
        assert!(w.is_idle());
        w.expect(key(7, 0), TERM);
        w.expect(key(7, 2), TERM);
        w.expect(key(8, 0), TERM);
        assert!(w.admit(key(8, 0), TERM), "another producer's batches do not hold it back");
        assert!(w.admit(key(7, 0), TERM));
        assert!(w.admit(key(9, 5), TERM), "not registered: a follower's or an earlier leader's entry");
        assert!(w.admit(key(7, 2), TERM));
        assert!(w.is_idle());
    }

    /// The lease case: batch 0 refused, batches 2 and 3 (proposed behind
    /// it) accepted; whether or not the leader has heard of the refusal
    /// when they reach the log.
    #[test]
    fn a_batch_that_would_overtake_a_refused_one_is_not_admitted() {
        for refusal_known in [false, true] {
            let w = AppendWatch::default();
            w.expect(key(7, 0), TERM);
            w.expect(key(7, 2), TERM);
            w.expect(key(7, 3), TERM);
            if refusal_known {
                w.fail(key(7, 0));
            }
            assert!(!w.is_settled(), "batches 2 and 3 are on their way");
            assert!(!w.admit(key(7, 2), TERM), "batch 0 never reached the log");
            assert!(!w.admit(key(7, 3), TERM), "nor does it later: 3 would overtake it too");
            w.fail(key(7, 0));
            assert!(w.is_settled(), "refusal known: {refusal_known}");
            assert!(!w.is_idle(), "batch 0 holds the producer back until the leader starts over");
            w.clear();
            assert!(w.is_idle());
            w.expect(key(7, 0), TERM);
            assert!(w.admit(key(7, 0), TERM), "started over");
        }
    }

    /// A deposed leader's registrations do not touch what a later leader
    /// sends it: only entries of the leadership that proposed them match,
    /// whether the later leader leads a later term or, after it, the same
    /// term (a higher node id).
    #[test]
    fn only_entries_of_the_registering_leadership_are_judged() {
        let w = AppendWatch::default();
        w.expect(key(7, 0), TERM);
        w.expect(key(7, 1), TERM);
        let later_term = Leadership { term: TERM.term + 1, ..TERM };
        let same_term = Leadership { node: TERM.node + 1, ..TERM };
        assert!(w.admit(key(7, 1), later_term), "another leader's entry, stored as sent");
        assert!(w.admit(key(7, 1), same_term), "another leader's entry, stored as sent");
        assert!(!w.is_settled(), "the registrations of TERM are still there");
    }

    #[test]
    fn a_proposal_never_handed_over_is_forgotten() {
        let w = AppendWatch::default();
        w.expect(key(7, 0), TERM);
        w.expect(key(7, 1), TERM);
        w.forget(key(7, 1));
        assert!(!w.is_idle(), "batch 0 is still on its way");
        assert!(w.admit(key(7, 0), TERM));
        assert!(w.is_idle());
        w.expect(key(7, 0), TERM);
        w.fail(key(7, 0));
        w.expect(key(7, 1), TERM);
        w.forget(key(7, 1));
        assert!(!w.is_idle(), "a failure is kept until the leader starts over");
        w.forget(key(7, 0));
        assert!(w.is_idle(), "forgetting what is not registered is harmless");
        assert_eq!(ProposalKey::of(&RecordBatch { producer_id: NO_PRODUCER_ID, ..Default::default() }), None);
    }

    #[tokio::test]
    async fn crossing_off_wakes_a_waiter_created_before() {
        let w = AppendWatch::default();
        w.expect(key(7, 0), TERM);
        let changed = w.changed();
        assert!(w.admit(key(7, 0), TERM));
        tokio::time::timeout(std::time::Duration::from_secs(5), changed).await.expect("woken");
        w.expect(key(7, 1), TERM);
        let changed = w.changed();
        w.fail(key(7, 1));
        tokio::time::timeout(std::time::Duration::from_secs(5), changed).await.expect("woken by a failure");
    }
}

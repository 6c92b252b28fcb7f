//! The log store as the leader's last gate for idempotent batches
//! (`ferrolog_raft_store::appends`): Raft may refuse a proposal (an expired
//! leader lease) and accept the next one of the same producer in the same
//! term. That one reaches the log store ahead of the refused batch, and is
//! stored blank, on every replica alike: no record of it is stored, the
//! producer's applied sequence does not move, and nothing of the producer
//! is ever stored out of order.

mod common;

use ferrolog_raft_store::types::{Entry, EntryPayload, TypeConfig, log_id};
use ferrolog_raft_store::{
    Flusher, Leadership, ProposalKey, RecordBatch, Replica, SequenceCheck, StoreConfig,
};
use openraft::storage::RaftLogReader;
use openraft::type_config::TypeConfigExt;

const PID: i64 = 7;
/// The leadership of every entry here: `log_id(1, 1, _)`.
const LEADER: Leadership = Leadership { term: 1, node: 1 };

fn open(dir: &std::path::Path) -> Replica {
    Replica::open(dir, StoreConfig::default(), Flusher::spawn("overtaking").expect("flusher")).expect("open")
}

fn key(base_sequence: i32) -> ProposalKey {
    ProposalKey { producer_id: PID, epoch: 0, base_sequence }
}

/// Batch `base_sequence` of producer `PID`, one record, at `index`.
fn entry(index: u64, base_sequence: i32) -> Entry {
    Entry {
        log_id: log_id(1, 1, index),
        payload: EntryPayload::Normal(RecordBatch {
            record_count: 1,
            producer_id: PID,
            base_sequence,
            records: common::payload(index, 16),
            ..Default::default()
        }),
    }
}

async fn stored(replica: &Replica, from: u64, to: u64) -> Vec<Entry> {
    replica.log_store().try_get_log_entries(from..to).await.expect("entries")
}

fn is_blank(e: &Entry) -> bool {
    matches!(e.payload, EntryPayload::Blank)
}

#[test]
fn a_batch_that_overtakes_a_refused_one_is_stored_blank() {
    let dir = tempfile::tempdir().expect("tempdir");
    TypeConfig::run(async {
        let replica = open(dir.path());
        let watch = replica.append_watch();
        // The leader proposed batches 0, 1 and 2; Raft refused 0 and
        // accepted 1 and 2, which reach the log store first.
        for s in 0..3 {
            watch.expect(key(s), LEADER);
        }
        common::append_durable(&mut replica.log_store(), vec![entry(0, 1), entry(1, 2)])
            .await
            .expect("append");
        let entries = stored(&replica, 0, 2).await;
        assert!(entries.iter().all(is_blank), "stored as they came: {entries:?}");
        common::apply_all(&mut replica.state_machine(), entries).await;
        assert_eq!(replica.log_end_offset(), 0, "no record stored");
        assert_eq!(
            replica.check_sequence(PID, 0, 0, 1),
            SequenceCheck::Append,
            "the producer still expects 0"
        );
        // The leader learns of the refusal, and starts over.
        watch.fail(key(0));
        assert!(watch.is_settled());
        watch.clear();

        // In order: batch 0 then 1, stored as they are.
        watch.expect(key(0), LEADER);
        watch.expect(key(1), LEADER);
        common::append_durable(&mut replica.log_store(), vec![entry(2, 0)]).await.expect("append");
        common::append_durable(&mut replica.log_store(), vec![entry(3, 1)]).await.expect("append");
        let entries = stored(&replica, 2, 4).await;
        assert!(!entries.iter().any(is_blank), "in order: {entries:?}");
        common::apply_all(&mut replica.state_machine(), entries).await;
        assert_eq!(replica.log_end_offset(), 2);
        assert_eq!(replica.check_sequence(PID, 0, 2, 1), SequenceCheck::Append);
        assert!(watch.is_idle());
    });
}

/// A follower registers nothing: what its leader sends is stored as sent.
#[test]
fn a_follower_stores_every_entry_as_sent() {
    let dir = tempfile::tempdir().expect("tempdir");
    TypeConfig::run(async {
        let replica = open(dir.path());
        common::append_durable(&mut replica.log_store(), vec![entry(0, 1), entry(1, 0)])
            .await
            .expect("append");
        assert!(!stored(&replica, 0, 2).await.iter().any(is_blank));
    });
}

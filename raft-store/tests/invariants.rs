//! Invariants the store relies on are checked where they are assumed
//! (issue 10): an append must continue the log's indexes, and apply must
//! move forward, or offsets (the prefix sum of record counts) would be
//! wrong. Either stops with an error and changes nothing.

mod common;

use ferrolog_raft_store::types::TypeConfig;
use ferrolog_raft_store::{Flusher, Replica, StoreConfig};
use openraft::storage::RaftStateMachine;
use openraft::type_config::TypeConfigExt;

fn open(dir: &std::path::Path) -> Replica {
    Replica::open(dir, StoreConfig::default(), Flusher::spawn("invariants").expect("flusher")).expect("open")
}

#[test]
fn an_append_that_skips_an_index_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    TypeConfig::run(async {
        let replica = open(dir.path());
        common::append_durable(
            &mut replica.log_store(),
            vec![common::entry(1, 0, 100), common::entry(1, 1, 100)],
        )
        .await
        .expect("append");
        let gap = common::append_durable(&mut replica.log_store(), vec![common::entry(1, 3, 100)]).await;
        let e = gap.expect_err("index 3 after 1");
        assert!(e.to_string().contains("index 3 where 2 is next"), "{e}");
        assert_eq!(replica.log_end_offset(), common::base_offset(2), "nothing written");
    });
}

#[test]
fn applying_an_entry_again_stops_with_an_error_and_numbers_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    TypeConfig::run(async {
        let replica = open(dir.path());
        let mut sm = replica.state_machine();
        common::apply_all(&mut sm, (0..3).map(|i| common::entry(1, i, 100)).collect()).await;
        let hw = replica.high_watermark();
        assert_eq!(hw, common::base_offset(3));
        let again = futures::stream::iter([Ok((common::entry(1, 2, 100), None))]);
        let e = sm.apply(again).await.expect_err("entry 2 applied twice");
        assert!(e.to_string().contains("apply out of order"), "{e}");
        assert_eq!(replica.high_watermark(), hw, "the high watermark did not move");
        let (last, _) = sm.applied_state().await.expect("applied state");
        assert_eq!(last.map(|l| l.index), Some(2));
    });
}

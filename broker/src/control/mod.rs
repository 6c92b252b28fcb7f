//! The broker's background control loops, each its own task started by
//! [`crate::server`]; none is on the data path, and safety does not depend
//! on any of them (votes and commits stay Raft's):
//!
//! - [`liveness`]: one ping per broker pair per heartbeat interval says which
//!   brokers answer, which groups each leads, and when one came back.
//! - [`quiesce`]: idle groups park their tickers; elections are started here,
//!   spread out with back-off, instead of by per-group timers.
//! - [`dormant`]: an idle follower stops its Raft node's tasks until its
//!   group's next message.
//! - [`checkquorum`]: a leader that lost its quorum hands over (Raft thesis §6.2).
//! - [`balance`]: leaderships go back to preferred replicas when a broker's
//!   share of them falls too low (Kafka's `auto.leader.rebalance.enable`).
//! - [`handover`]: hands leaderships to caught-up followers; on SIGTERM, every
//!   one this broker holds before it stops (controlled shutdown). Not a loop:
//!   run once by [`crate::server::Broker::serve`].
//! - [`membership`]: each led group's voters follow the metadata (learner, then
//!   joint consensus).
//! - [`recovery`]: drives the recovery of replicas whose log was found
//!   damaged (vote floors, release once a leader brought them back); the
//!   rules, and the refusal of votes, are `ferrolog_replica::recovery`'s.
//! - [`metadata_restart`]: this broker's metadata replica, stopped on an
//!   error (a full or read-only disk), is opened again and restarted.
//! - [`writable`]: whether a data directory takes writes again before a failed
//!   replica on it is restarted.
//! - [`memory`]: memory of stopped replicas is given back to the system.
//! - [`files`]: the open-file limit, raised at start and watched.
//! - [`retention`]: partition leaders move the log start offset by
//!   `retention.ms` / `retention.bytes` through Raft; old segments go.
//! - [`compaction`]: partition leaders decide a compaction target through
//!   Raft; every replica compacts its sealed segments to it, on the
//!   [`cleaner`] thread (lowest CPU priority).
//! - [`producer_expiry`]: partition leaders expire idle producer ids through
//!   Raft (`producer.id.expiration.ms`).
//! - [`scrub`]: every replica's committed entries are read back and verified
//!   now and then; damage found is repaired as a read's is.

pub mod balance;
pub mod checkquorum;
pub mod cleaner;
pub mod compaction;
pub mod dormant;
pub mod files;
pub mod handover;
pub mod liveness;
pub mod membership;
pub mod memory;
pub mod metadata_restart;
pub mod producer_expiry;
pub mod quiesce;
pub mod recovery;
pub mod retention;
pub mod scrub;
pub mod writable;

/// How long a leader's control decision may wait to commit, so that a
/// leader cut off from its followers does not hold up its other partitions.
const CONTROL_WRITE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Proposes `control` as a control entry of `p`'s Raft log (retention,
/// compaction, producer expiry: a leader's decision every replica carries
/// out at the same log position) and waits up to 5 s for it to commit.
/// Returns whether it committed; a failure is logged at debug under
/// `what`, and the caller's next check decides again.
pub(crate) async fn propose_control(
    p: &crate::partition::Partition,
    control: ferrolog_raft_store::Control,
    what: &str,
) -> bool {
    // A quiet group's followers learn the commit from the ticking leader.
    p.set_ticking(true);
    let write = p.raft.write(ferrolog_raft_store::RecordBatch::control_batch(control));
    match tokio::time::timeout(CONTROL_WRITE_WAIT, write).await {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => {
            tracing::debug!(topic = %p.topic, partition = p.partition, "{what}: not proposed: {e}");
            false
        }
        Err(_) => {
            tracing::debug!(topic = %p.topic, partition = p.partition,
                "{what}: not committed within {CONTROL_WRITE_WAIT:?}; the next check decides again");
            false
        }
    }
}

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
//! - [`recovery`]: a replica whose log was found damaged neither votes nor
//!   campaigns until a leader has brought it back.
//! - [`writable`]: whether a data directory takes writes again before a failed
//!   replica on it is restarted.
//! - [`memory`]: memory of stopped replicas is given back to the system.
//! - [`files`]: the open-file limit, raised at start and watched.
//! - [`retention`]: partition leaders move the log start offset by
//!   `retention.ms` / `retention.bytes` through Raft; old segments go.
//! - [`compaction`]: partition leaders decide a compaction target through
//!   Raft; every replica compacts its sealed segments to it.
//! - [`producer_expiry`]: partition leaders expire idle producer ids through
//!   Raft (`producer.id.expiration.ms`).

pub mod balance;
pub mod checkquorum;
pub mod compaction;
pub mod dormant;
pub mod files;
pub mod handover;
pub mod liveness;
pub mod membership;
pub mod memory;
pub mod producer_expiry;
pub mod quiesce;
pub mod recovery;
pub mod retention;
pub mod writable;

//! The Ferrolog broker.
//!
//! A broker hosts replicas of many partitions; each partition replica is a
//! member of that partition's Raft group, stored by `ferrolog-raft-store`.
//!
//! ```text
//!  peer broker ──gRPC Peer──> network::server ──> groups::GroupRegistry ──> openraft node
//!  openraft node ──RaftNetworkV2──> network::client ──gRPC (one channel per peer)──> peer broker
//! ```
//!
//! Modules:
//! - [`config`], [`cli`]: configuration (TOML, environment, flags) and the command line.
//! - [`server`]: wiring of one broker process.
//! - [`groups`]: the Raft groups this broker hosts, by group id.
//! - [`network`]: the broker-to-broker Raft transport (client, server, the
//!   peer protocol's version check, snapshot streaming), many groups
//!   multiplexed on one connection per peer; the messages themselves are
//!   converted in `ferrolog_raft_store::wire`.
//! - [`partitions`]: hosted replicas and the reconciler, which also restarts a
//!   group that stopped on an error; [`recovery`]: a replica whose log was found
//!   damaged does not vote until a leader has brought it back; [`memory`]:
//!   the memory of stopped replicas is given back to the operating system.
//! - [`liveness`], [`quiesce`]: one ping per broker pair detects failures;
//!   idle groups park their tickers, and elections are scheduled here (spread
//!   out, with back-off) instead of by per-group timers.
//! - [`logging`]: log output, with repeated warnings rate-limited and summarised;
//!   [`files`]: the open-file limit, raised at start and watched.

pub mod checkquorum;
pub mod cli;
pub mod config;
pub mod dump;
pub mod error;
pub mod files;
pub mod groups;
pub mod grpc;
pub mod identity;
pub mod listener;
pub mod liveness;
pub mod logging;
pub mod membership;
pub mod memory;
pub mod metadata;
pub mod network;
pub mod partition;
pub mod partitions;
pub mod quiesce;
pub mod recovery;
pub mod server;
pub mod writable;

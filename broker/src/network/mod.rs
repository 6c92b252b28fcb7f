//! Broker-to-broker Raft transport over gRPC (`ferrolog.raft.v1.Peer`).
//!
//! Every group hosted on a pair of brokers shares one HTTP/2 connection;
//! each request names its group, and HTTP/2 streams keep a slow group's
//! RPC from blocking another's. Heartbeats and commit notices of many
//! groups travel together in `Batch` RPCs ([`batch`]). Entries travel as
//! CRC32C-checked segment frames, every other field is a protobuf message
//! of Ferrolog's own (`ferrolog_raft_store::wire`); snapshots stream their
//! files in chunks (`ferrolog_replica::snapshot`). Both sides check each
//! other's [`protocol`] version. The groups' Raft nodes send through
//! [`PeerAddresses`] (the `ferrolog_replica::PeerTransport` of this
//! broker) and receive through [`RaftPeerServer`]. Connections go over TCP,
//! or over an in-memory network ([`memory`]) when the broker's listeners are
//! on one.

pub mod batch;
pub mod client;
pub mod memory;
pub mod protocol;
pub mod server;
pub mod throttle;

pub use client::PeerAddresses;
pub use protocol::peer_client;

/// Reset streams after which h2 closes a broker-pair connection, on either
/// side (h2's guards against reset floods, CVE-2023-44487, default to 20
/// streams reset before the server accepted them and 1,024 local error
/// resets). Every group's RPCs share that connection and each timed-out RPC
/// resets its stream, so under load the defaults closed it and failed every
/// group's RPCs at once. Peers are the cluster's brokers.
pub const PEER_RESETS_MAX: usize = 100_000;
pub use server::RaftPeerServer;

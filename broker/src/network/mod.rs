//! Broker-to-broker Raft transport over gRPC (`ferrolog.raft.v1.RaftPeer`).
//!
//! Every group hosted on a pair of brokers shares one HTTP/2 connection;
//! each request names its group, and HTTP/2 streams keep a slow group's
//! RPC from blocking another's. Entries travel as CRC32C-checked segment
//! frames ([`codec`]); snapshots stream their files in chunks ([`snapshot`]).

pub mod client;
pub mod codec;
pub mod server;
pub mod snapshot;

pub use client::{PeerAddresses, PeerNetworkFactory};
pub use server::RaftPeerServer;

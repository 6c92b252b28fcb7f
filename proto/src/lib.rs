//! Ferrolog's protobuf schema and the gRPC code generated from it.
//!
//! - [`raft`]: the broker-to-broker Raft transport (`ferrolog/raft/v1/raft.proto`).
//! - [`client`]: the client API: produce, fetch, offsets, metadata, topics
//!   (`ferrolog/client/v1/client.proto`).

/// Broker-to-broker Raft transport, package `ferrolog.raft.v1`.
#[allow(missing_docs, clippy::all, rust_2018_idioms)]
pub mod raft {
    tonic::include_proto!("ferrolog.raft.v1");
}

/// The client API, package `ferrolog.client.v1`.
#[allow(missing_docs, clippy::all, rust_2018_idioms)]
pub mod client {
    tonic::include_proto!("ferrolog.client.v1");
}

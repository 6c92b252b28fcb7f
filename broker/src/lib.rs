//! The Ferrolog broker.
//!
//! A broker hosts replicas of many partitions; each partition replica is a
//! member of that partition's Raft group: a `ferrolog_replica::RaftNode`
//! (the only interface to Raft the broker uses; it never names the Raft
//! library) over storage from `ferrolog-raft-store`.
//!
//! The data path (produce, then fetch):
//!
//! ```text
//!  client ──gRPC Produce──> grpc::service ──> partition::Partition (leader check, sequencer:
//!        idempotence, KIP-98) ──RaftNode::propose──> Raft leader ──append──> raft-store log
//!        ──pwrite──> segment file ──flusher: fdatasync──> local ack
//!     └─ network::client (PeerTransport) ──gRPC Peer AppendEntries──> follower broker
//!        ──> network::server ──> groups::GroupRegistry ──> RaftNode::handle_append ──> its log,
//!        its fsync ──> ack
//!  majority acked ──> commit ──> apply (raft-store state machine: offsets, high watermark)
//!        ──> Produce answered with the batch's base offset
//!  client ──gRPC Fetch──> grpc::fetch_wire (own route) ──> grpc::service ──>
//!        partition::Partition::fetch (waits on the high watermark) ──> blocking pool:
//!        Replica::read (planned under the log lock, files read without it, yielding the CPU
//!        between chunks) ──> whole CRC-checked frames, none past the high watermark ──>
//!        answered as chunks, the records not copied
//! ```
//!
//! Modules:
//! - [`config`], [`cli`]: configuration (TOML, environment, flags) and the command line.
//! - [`server`]: wiring of one broker process: `Broker::start` on bound
//!   listeners with a shutdown signal, `Broker::serve` until it fires.
//! - [`grpc`]: the client API (thin handlers; errors to wire codes in one place).
//! - [`kafka`]: the Kafka listener: Kafka's wire protocol on its own port, on
//!   the same partitions, controller and coordinator as the gRPC API; Kafka
//!   batches stored as they came (`partition::kafka_batch`).
//! - [`partition`]: one hosted replica = one Raft group: produce, fetch, offsets.
//! - [`partitions`]: the reconciler (starts and stops replicas to match the
//!   metadata image, and restarts a group that stopped on an error).
//! - [`groups`]: the one registry of the Raft groups this broker hosts, by
//!   group id with a topic/partition index, and which of them it leads.
//! - [`metadata`]: the controller (metadata Raft group): its commands, the
//!   image, the pure decision of each request (`metadata::decide`), proposing.
//! - [`network`]: the broker-to-broker Raft transport (client, server, the
//!   peer protocol's version check), many groups multiplexed on one
//!   connection per peer; the messages themselves are converted in
//!   `ferrolog_raft_store::wire`, snapshots chunked in `ferrolog_replica::snapshot`;
//!   `network::memory` is an in-memory network brokers of one process can
//!   listen and dial on instead of TCP (a simulation's, with `cut`/`heal`).
//! - [`control`]: the background control loops: liveness (one ping per
//!   broker pair), quiesce (idle groups park; elections scheduled here),
//!   CheckQuorum, membership, recovery of damaged replicas, the disk-writable
//!   probe, memory give-back and the open-file watch; and handover
//!   (leadership transfer on request, and the controlled shutdown that
//!   hands every leadership over before the broker stops).
//! - [`coordinator`]: consumer groups: their coordinator (the leader of the
//!   group's partition of `__consumer_offsets`) and committed offsets.
//! - [`identity`]: a data directory's broker id and incarnation.
//! - [`logging`]: log output, with repeated warnings rate-limited and summarised.
//!
//! Clocks, randomness and order, kept under a simulation's control (the
//! groundwork for a deterministic simulation of whole brokers, issue 15;
//! the crate's `clippy.toml` rejects the alternatives): deadlines,
//! timeouts and silences are measured on tokio's clock
//! (`tokio::time::Instant`), which a simulation pauses and advances;
//! wall-clock time and random numbers (topic ids, member ids, boot ids,
//! back-off jitter) come from `ferrolog_raft_store::runtime`, which a
//! simulation sets and seeds; and the registries whose iteration decides
//! what is sent first (the hosted groups, the quiesce scheduler, liveness,
//! retention) are ordered maps, not hash maps with a per-process seed.

pub mod cli;
pub mod config;
pub mod control;
pub mod coordinator;
pub mod dump;
pub mod error;
pub mod groups;
pub mod grpc;
pub mod identity;
pub mod inject;
pub mod kafka;
pub mod listener;
pub mod logging;
pub mod metadata;
pub mod network;
pub mod partition;
pub mod partitions;
pub mod server;

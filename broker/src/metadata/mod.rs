//! The cluster metadata kept by the controller (the metadata Raft group,
//! group id [`METADATA_GROUP`]), like Kafka's KRaft `__cluster_metadata`.
//!
//! The metadata group is an ordinary Ferrolog log: each record's value is one
//! JSON-encoded [`command::MetadataCommand`]. Every broker hosts a replica
//! and folds the committed records, in offset order, into the same
//! [`image::MetadataImage`]; the leader of the group is the controller,
//! which decides what a request commits ([`decide`], a pure function of the
//! image) and proposes it ([`controller`]).
//!
//! ```text
//!  admin request ─> any broker ─(peer RPC)─> controller: validate, place ─> Raft ─> commit
//!  every broker: metadata replica ─(records ≤ high watermark)─> image ─> reconciler starts/stops partitions
//! ```

pub mod command;
pub mod controller;
pub mod decide;
pub mod hosted;
pub mod image;
pub mod placement;
pub mod topic_config;

/// Group id of the metadata (controller) Raft group. Partition groups get
/// ids from 1 up, never reused.
pub const METADATA_GROUP: u64 = 0;

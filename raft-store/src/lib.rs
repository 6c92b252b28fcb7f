//! Durable storage of one Ferrolog partition replica for openraft.
//!
//! A partition is a Raft group whose log entries *are* its record batches,
//! so the Raft log storage is the data store. Data path:
//!
//! ```text
//!  openraft ──append──> log_store ──> log::PartitionLog ──pwrite──> segment files (*.seg)
//!                                          │                           │  sealed: *.idx
//!                                          │ tail_cache                 │
//!                                          └─ file ──> flusher (one per data dir):
//!                                                      fdatasync / syncfs, then IOFlushed
//!  openraft ──apply──> state_machine ──> offsets, high watermark
//!  consumers ──read(offset)──> plan_read (under the log lock) ──> ReadPlan::run (without it,
//!                               on a blocking thread) ──> whole CRC-checked frames
//!  vote, committed, purge pointer, snapshot meta ──> meta ──> meta_db: one redb per
//!                                          directory of replicas, many replicas per commit
//! ```
//!
//! Modules, one responsibility each:
//! - [`format`](mod@format): the on-disk byte format (pure functions).
//! - [`segment`]: one segment file and its sparse offset/time index.
//! - [`log`]: the list of segments, offsets, truncate/purge, reads.
//! - [`flusher`]: group commit across partitions of a data directory.
//! - [`meta`]: a replica's crash-safe small metadata (vote, commit index, ...).
//! - [`meta_db`]: one redb database per directory of replicas, group-committed.
//! - [`tail_cache`]: bounded cache of the newest entries.
//! - [`producer`]: idempotent producer state (KIP-98), derived by apply.
//! - [`snapshot`]: snapshots that carry the retained segment files.
//! - [`compaction`]: deterministic key-based compaction of sealed segments.
//! - [`log_store`], [`state_machine`]: the openraft trait implementations.
//! - [`replica`]: opens a replica and hands out both halves.
//! - [`wire`]: the peer protocol's messages to and from the Raft library's types.
//! - [`unsynced`]: after a failed fsync, what the log must not trust.
//! - [`vfs`]: the file-system seam (real, and fault-injecting for tests);
//!   every file operation of the store goes through it.
//! - [`runtime`]: the async runtime the Raft library runs on (tokio, with
//!   random numbers a deterministic simulation can seed).
//! - [`types`], [`batch`], [`config`], [`error`]: shared vocabulary.

pub mod appends;
pub mod batch;
pub mod compaction;
pub mod config;
pub mod error;
pub mod flusher;
pub mod format;
mod fsutil;
pub mod log;
pub mod log_store;
pub mod meta;
pub mod meta_db;
pub mod producer;
pub mod replica;
pub mod runtime;
pub mod segment;
pub mod snapshot;
pub mod state_machine;
pub mod tail_cache;
pub mod types;
pub mod unsynced;
pub mod vfs;
pub mod wire;

pub use appends::{AppendWatch, Leadership, ProposalKey};
pub use batch::{AppendResult, CONTROL_PRODUCER_ID, Control, NO_PRODUCER_ID, RecordBatch};
pub use compaction::{CompactionStats, CompactionTarget, KeyedRecord, RecordCodec};
pub use config::{FlushPolicy, StoreConfig};
pub use error::StoreError;
pub use flusher::Flusher;
pub use fsutil::{create_dir_durable, read_if_exists, remove_dir_if_exists, write_durable};
pub use log::{Damage, PartitionLog, ReadPlan, SegmentSummary, StoredBatch};
pub use log_store::LogStore;
pub use producer::{ProducerStates, SequenceCheck};
pub use replica::{FOUNDING_TERM, Founding, Replica};
pub use state_machine::PartitionStateMachine;
pub use vfs::{FaultyFs, Fs, RealFs};

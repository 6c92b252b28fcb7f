//! This broker's replica of the metadata group, behind one handle that a
//! restart can swap (issue 9, item 2).
//!
//! The controller ([`super::controller`]), the image's follower
//! ([`super::controller::follow`]), CheckQuorum and the broker's shutdown
//! reach the metadata group's Raft node and storage through a
//! [`HostedMetadata`], asking it each time. When the replica stops on an
//! error (a full or read-only disk: the metadata log is fsynced on every
//! write), `crate::control::metadata_restart` opens its log again in place,
//! verified, starts a new Raft node over it and swaps both in here, with no
//! broker restart; whoever asks afterwards gets the new ones, and
//! [`HostedMetadata::changes`] tells those that keep a handle.

use std::sync::{Arc, RwLock};
use tokio::time::Instant;

use ferrolog_raft_store::Replica;
use ferrolog_replica::{NodeId, RaftNode};
use tokio::sync::watch;

/// The metadata group's replica on this broker: its Raft node and storage
/// as they are now. Cheap to clone; clones share the slot.
#[derive(Clone)]
pub struct HostedMetadata {
    node: NodeId,
    current: Arc<RwLock<Current>>,
    /// How many times the replica was replaced (0: the one the broker
    /// started with).
    generation: Arc<watch::Sender<u64>>,
}

/// What the slot holds.
#[derive(Clone)]
struct Current {
    raft: RaftNode,
    replica: Replica,
    started: Instant,
}

impl std::fmt::Debug for HostedMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostedMetadata")
            .field("node", &self.node)
            .field("generation", &*self.generation.borrow())
            .finish_non_exhaustive()
    }
}

impl HostedMetadata {
    /// The replica the broker started: node `node`'s `raft` over `replica`.
    pub fn new(node: NodeId, raft: RaftNode, replica: Replica) -> Self {
        let current = Current { raft, replica, started: Instant::now() };
        Self { node, current: Arc::new(RwLock::new(current)), generation: Arc::new(watch::channel(0).0) }
    }

    fn current(&self) -> Current {
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// This broker's node id in the metadata group.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The Raft node now.
    pub fn raft(&self) -> RaftNode {
        self.current().raft
    }

    /// The storage now.
    pub fn replica(&self) -> Replica {
        self.current().replica
    }

    /// When the Raft node now in place started.
    pub fn started(&self) -> Instant {
        self.current().started
    }

    /// Changes each time the replica is replaced ([`HostedMetadata::replace`]):
    /// for holders of the storage's watches to take them again.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Puts a new Raft node, over `replica` opened again, in place of the
    /// one that stopped. The caller must have shut the old node down first
    /// (`crate::control::metadata_restart` does, or does not replace it).
    pub fn replace(&self, raft: RaftNode, replica: Replica) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) =
            Current { raft, replica, started: Instant::now() };
        self.generation.send_modify(|g| *g += 1);
    }
}

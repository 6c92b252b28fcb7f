//! One Ferrolog replica as a member of its Raft group: the interface the
//! broker drives, and the only crate that runs the Raft library (openraft,
//! pinned at an alpha). The broker never names the library's types, so an
//! upgrade touches this crate and `raft-store` (which implements the
//! library's storage traits), and the peer protocol stays Ferrolog's own
//! protobuf messages whatever the library's types become.
//!
//! ```text
//!  broker ──propose(batch, term)──> RaftNode ──> openraft ──append──> raft-store (segments, fsync)
//!         <──Pending::committed── offsets once a majority stored it and it applied here
//!  broker ──state(|s| ..)──> State: role, term, leader, log positions, membership, lease
//!  broker ──campaign / set_ticking / transfer_leader / add_learner / change_voters──> RaftNode
//!  peer gRPC ──handle_vote / handle_append / handle_transfer / install_snapshot / log_state──> RaftNode
//!  broker ──hold_if_recovering / seek_vote_floor / release_if_caught_up──> RaftNode (recovery)
//!  RaftNode ──PeerTransport (the broker's gRPC channels), pb messages only──> peers
//! ```
//!
//! Modules, one responsibility each:
//! - [`node`]: [`RaftNode`], one group's node: propose, read its state,
//!   elections and tickers, leadership hand-over, membership, peer messages.
//! - [`lifecycle`]: keeps a node's Raft library instance running only
//!   while it is needed; an idle follower's node goes dormant and starts
//!   again on its next use.
//! - [`state`]: [`State`], a borrowed view of the node's state in
//!   Ferrolog's types ([`LogPosition`], [`Role`]).
//! - [`transport`]: [`PeerTransport`], what the broker provides to reach
//!   peers, adapted to the library's network traits.
//! - `commit_notice`: an AppendEntries that only carries a new commit index
//!   rides along with the next request of its replication stream.
//! - [`recovery`]: a replica that may have lost entries it acknowledged
//!   neither votes nor campaigns until a leader has brought it back.
//! - [`snapshot`]: a snapshot's files streamed in chunks and staged.
//! - [`settings`]: Raft timings and the behaviour every group relies on.
//! - [`inject`]: bugs a test turns on to show its checker catches them.

mod commit_notice;
pub mod inject;
pub mod lifecycle;
pub mod node;
pub mod recovery;
pub mod settings;
pub mod snapshot;
pub mod state;
pub mod transport;

pub use inject::InjectedBug;
pub use lifecycle::{dormant_count, woken_by, woken_count};
pub use node::{Appended, HandleError, NodeError, Pending, ProposeError, RaftNode, candidate_last_log};
pub use settings::{Settings, SettingsError, Timings, ValidSettings};
pub use state::{LogPosition, Role, State};
pub use transport::{PeerTransport, PeerUnreachable};

/// A replica's Raft node id: unique within its group, never reused.
pub type NodeId = u64;

/// Log filter directives that quiet the Raft library's own chatter (its
/// info lines are per-entry and per-heartbeat), for the default log filter.
pub const QUIET_RAFT_LOGS: &str = "openraft=warn";

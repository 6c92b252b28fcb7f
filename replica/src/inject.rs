//! Bugs injected on purpose, so that the checkers can show they catch them
//! (issue 15: "a deliberately injected bug is caught by both the simulation
//! and the jepsen checker"). The deterministic simulation
//! (`tests/simulation.rs`) turns one on per node; the broker turns it on
//! for every partition replica when its environment asks (debug builds
//! only, `FERROLOG_INJECT_BUG`), for jepsen's negative control.
//!
//! Only debug builds honour [`crate::RaftNode::inject`]: a release build
//! cannot be made to break its guarantees, whatever calls it.

/// A bug that can be injected into a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InjectedBug {
    /// A leader answers a proposal whose commit takes longer than
    /// [`ACK_EARLY_MS`] as if it had committed, at the offset its log
    /// ended at when it was proposed. A leader that crashes or is cut off
    /// before replicating then loses acknowledged records, and a guessed
    /// offset may hold another record.
    AckBeforeCommit,
    /// A replica that may have lost entries it acknowledged votes as if it
    /// had not ([`crate::recovery`]'s refusal skipped): with its damaged
    /// log it can help elect a leader that lacks committed entries.
    VoteWhileRecovering,
}

/// How long the [`InjectedBug::AckBeforeCommit`] bug waits for a real
/// commit, ms.
pub const ACK_EARLY_MS: u64 = 2;

//! Bugs injected on purpose, so that the fault-injection checkers can show
//! they catch them (issue 15: "a deliberately injected bug is caught").
//!
//! Only debug builds read the switch, the environment variable
//! [`ENV`]; a release build has no way to turn a bug on, whatever its
//! environment. A broker with a bug on says so at start, at error level.

use std::sync::LazyLock;

/// The environment variable naming the bug to inject (debug builds only).
pub const ENV: &str = "FERROLOG_INJECT_BUG";

/// A bug that can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// `ack-before-commit`: every partition replica's node gets
    /// [`ferrolog_replica::InjectedBug::AckBeforeCommit`] (a leader answers
    /// a produce whose commit takes longer than 2 ms as if it had
    /// committed, at a guessed offset), the same switch the deterministic
    /// simulation turns on.
    AckBeforeCommit,
}

static ACTIVE: LazyLock<Option<Bug>> = LazyLock::new(|| {
    if !cfg!(debug_assertions) {
        return None;
    }
    match std::env::var(ENV).ok()?.as_str() {
        "ack-before-commit" => Some(Bug::AckBeforeCommit),
        other => {
            tracing::error!(env = ENV, value = other, "unknown injected bug; none is active");
            None
        }
    }
});

/// Whether `bug` is injected in this process.
pub fn active(bug: Bug) -> bool {
    *ACTIVE == Some(bug)
}

/// Logs, at error level, the injected bug if one is active (at start).
pub fn announce() {
    if let Some(bug) = *ACTIVE {
        tracing::error!(
            ?bug,
            env = ENV,
            "AN INJECTED BUG IS ACTIVE: this broker breaks its guarantees on purpose"
        );
    }
}

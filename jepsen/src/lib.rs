//! Ferrolog's Jepsen-style harness: real broker processes, faults, a
//! recorded history, and a checker.
pub mod checker;
pub mod history;

//! The `matrix` command's verdict over its runs: a matrix passes only when
//! it ran something and every run ran to the end and was valid.

use std::fmt;

/// How the runs of a matrix ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Runs that ended valid.
    pub valid: usize,
    /// Runs that ended invalid (an anomaly, a problem or a broken rule).
    pub invalid: usize,
    /// Runs that did not end: the harness failed (setup, brokers that did
    /// not start, ...), so they checked nothing.
    pub errored: usize,
}

impl Tally {
    /// The process exit code: 1 if any run was invalid, else 2 if any run
    /// errored or none ran (a matrix that checked nothing), else 0.
    pub fn exit_code(&self) -> u8 {
        if self.invalid > 0 {
            1
        } else if self.errored > 0 || self.valid == 0 {
            2
        } else {
            0
        }
    }
}

impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} runs valid, {} invalid, {} errored", self.valid, self.invalid, self.errored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_matrix_with_an_errored_run_exits_non_zero() {
        assert_eq!(Tally { valid: 3, invalid: 0, errored: 0 }.exit_code(), 0);
        assert_eq!(Tally { valid: 3, invalid: 0, errored: 1 }.exit_code(), 2);
        assert_eq!(Tally { valid: 0, invalid: 0, errored: 2 }.exit_code(), 2);
        assert_eq!(Tally { valid: 2, invalid: 1, errored: 1 }.exit_code(), 1);
        // Nothing ran: nothing was checked.
        assert_eq!(Tally::default().exit_code(), 2);
    }
}

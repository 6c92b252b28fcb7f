//! The broker's open files against its limit. Each replica keeps its
//! active segment open (1 file per replica, more while segments roll or
//! snapshots are sent; the replicas share one metadata database), so thousands of
//! partitions need far more than the common soft limit of 1,024: at start
//! the soft `RLIMIT_NOFILE` is raised to the hard limit (what an
//! unprivileged process may do, POSIX `setrlimit`), the result is logged,
//! a warning is logged while more than [`WARN_AT_PERCENT`] of it is used,
//! and `Metadata` reports both numbers (`ferrolog cluster status`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Share of the open-file limit above which a warning is logged, %.
pub const WARN_AT_PERCENT: u64 = 80;

/// How often usage is checked.
pub const CHECK_EVERY: Duration = Duration::from_secs(10);

/// Raises the soft open-file limit to the hard limit and logs the outcome.
/// Returns the soft limit now in force (`None`: unlimited or unknown).
pub fn raise_limit() -> Option<u64> {
    let before = getrlimit(Resource::Nofile);
    let raised = Rlimit { current: before.maximum, maximum: before.maximum };
    let now = match (before.current, before.maximum) {
        (Some(soft), Some(hard)) if soft < hard => match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::info!(from = soft, to = hard, "raised the open-file limit to the hard limit");
                Some(hard)
            }
            Err(e) => {
                tracing::warn!(soft, hard, "cannot raise the open-file limit: {e}");
                Some(soft)
            }
        },
        (soft, _) => soft,
    };
    if let Some((open, limit)) = usage() {
        record((open, limit));
        tracing::info!(open, limit, "open files at start");
    }
    now
}

/// The last [`usage`] seen by [`raise_limit`] or [`watch`] (0: unknown).
static OPEN: AtomicU64 = AtomicU64::new(0);
static LIMIT: AtomicU64 = AtomicU64::new(0);

/// Open files and the open-file limit as last checked (at most
/// [`CHECK_EVERY`] old; `None` before the first check): what `Metadata`
/// reports, without listing `/proc/self/fd` on every call.
pub fn last_usage() -> Option<(u64, u64)> {
    let limit = LIMIT.load(Ordering::Relaxed);
    (limit > 0).then(|| (OPEN.load(Ordering::Relaxed), limit))
}

fn record(usage: (u64, u64)) {
    OPEN.store(usage.0, Ordering::Relaxed);
    LIMIT.store(usage.1, Ordering::Relaxed);
}

/// Files open now and the soft open-file limit (`None` where `/proc` or the
/// limit is not available, or the limit is infinite). Lists
/// `/proc/self/fd`: blocking, and as long as the broker's open files.
pub fn usage() -> Option<(u64, u64)> {
    let limit = getrlimit(Resource::Nofile).current?;
    let open = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    Some((open, limit))
}

/// Whether `open` of `limit` is close enough to warn.
pub fn near_limit(open: u64, limit: u64) -> bool {
    limit > 0 && open.saturating_mul(100) > limit.saturating_mul(WARN_AT_PERCENT)
}

/// Checks usage every [`CHECK_EVERY`] (through
/// [`ferrolog_raft_store::runtime::blocking`] on `fs`, the data directory's
/// file system), forever,
/// records it for [`last_usage`], and warns (at most once a minute) while
/// it is above [`WARN_AT_PERCENT`] of the limit.
pub async fn watch(fs: ferrolog_raft_store::Fs) {
    let mut tick = tokio::time::interval(CHECK_EVERY);
    loop {
        tick.tick().await;
        let Ok(Some((open, limit))) = ferrolog_raft_store::runtime::blocking(&*fs, usage).await else {
            continue;
        };
        record((open, limit));
        if near_limit(open, limit) {
            crate::logging::every(
                "files.near_limit",
                Duration::from_secs(60),
                format_args!(
                    "{open} files open of a limit of {limit} (over {WARN_AT_PERCENT}%): \
                     raise the hard limit (ulimit -Hn, LimitNOFILE=) or host fewer replicas"
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_only_above_the_threshold() {
        assert!(!near_limit(800, 1000));
        assert!(near_limit(801, 1000));
        assert!(!near_limit(5, 0), "an unknown limit never warns");
    }

    #[test]
    fn usage_counts_this_process_files() {
        let (open, limit) = usage().expect("/proc and a finite limit on this machine");
        // At least stdin, stdout, stderr and the directory being listed.
        assert!(open >= 3 && limit >= open, "{open} of {limit}");
    }
}

//! The broker's log output, and rate limits on it.
//!
//! Under load one fault can repeat the same warning thousands of times a
//! second (one per Raft group and retry: a peer's timeouts during a restart
//! among 2,000 partitions wrote 1.7 GB of logs in 4 minutes). Each call site
//! of a warning or an error may log [`BURST`] events per [`WINDOW`]; further
//! ones are counted, and once per window a summary names the call site, how
//! many were suppressed, and the first suppressed message. Information and
//! debug events are not limited (they are off by default where they repeat).
//!
//! The limits measure real time (`std::time::Instant`, which the crate's
//! clippy.toml otherwise forbids): they change what is logged, never what
//! the broker does.
#![allow(clippy::disallowed_methods, reason = "log rate limits measure real time; see the module comment")]

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use tracing::callsite::Identifier;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata};
use tracing_subscriber::layer::{Context, Filter, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Warnings and errors one call site may log per [`WINDOW`].
pub const BURST: u32 = 20;

/// The rate-limit window.
pub const WINDOW: Duration = Duration::from_secs(10);

/// Counts of one call site in the current window.
#[derive(Debug)]
struct Site {
    window_start: Instant,
    logged: u32,
    suppressed: u64,
    /// Where the call site is, for the summary.
    location: String,
    /// The first suppressed message of the window.
    example: Option<String>,
}

/// The per-call-site state, shared by the filter and the summary thread.
static SITES: LazyLock<Mutex<HashMap<Identifier, Site>>> = LazyLock::new(Mutex::default);

/// A per-layer filter passing at most [`BURST`] warnings and errors per call
/// site per [`WINDOW`].
#[derive(Clone, Copy, Debug, Default)]
pub struct RateLimit;

struct Message(Option<String>);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

impl<S> Filter<S> for RateLimit {
    fn enabled(&self, _meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        true
    }

    fn event_enabled(&self, event: &Event<'_>, _cx: &Context<'_, S>) -> bool {
        let meta = event.metadata();
        if *meta.level() > Level::WARN {
            return true;
        }
        let mut sites = SITES.lock().unwrap_or_else(|p| p.into_inner());
        let site = sites.entry(meta.callsite()).or_insert_with(|| Site {
            window_start: Instant::now(),
            logged: 0,
            suppressed: 0,
            location: format!("{}:{}", meta.module_path().unwrap_or(meta.target()), meta.line().unwrap_or(0)),
            example: None,
        });
        if site.window_start.elapsed() >= WINDOW && site.suppressed == 0 {
            site.window_start = Instant::now();
            site.logged = 0;
        }
        if site.logged < BURST {
            site.logged += 1;
            return true;
        }
        if site.example.is_none() {
            let mut m = Message(None);
            event.record(&mut m);
            site.example = m.0;
        }
        site.suppressed += 1;
        false
    }
}

/// Logs, once per [`WINDOW`], how many warnings and errors each call site
/// had suppressed, and starts that site's next window.
fn summarise() {
    let due: Vec<(String, u64, Option<String>)> = {
        let mut sites = SITES.lock().unwrap_or_else(|p| p.into_inner());
        sites
            .values_mut()
            .filter(|s| s.suppressed > 0 && s.window_start.elapsed() >= WINDOW)
            .map(|s| {
                let out = (s.location.clone(), s.suppressed, s.example.take());
                s.suppressed = 0;
                s.logged = 0;
                s.window_start = Instant::now();
                out
            })
            .collect()
    };
    for (site, suppressed, example) in due {
        tracing::warn!(
            site,
            suppressed,
            "{suppressed} more like this suppressed in {} s: {}",
            WINDOW.as_secs(),
            example.unwrap_or_default()
        );
    }
}

/// Installs the broker's log output: `RUST_LOG` (default `info`, the Raft
/// library at `warn`: [`ferrolog_replica::QUIET_RAFT_LOGS`]) to standard error, with [`RateLimit`], and a thread
/// that logs the suppressed counts. Does nothing if a subscriber is already
/// installed.
#[allow(
    clippy::disallowed_methods,
    reason = "the broker binary's logging: a summary of suppressed lines, nothing a broker acts on"
)]
pub fn init() {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("info,{}", ferrolog_replica::QUIET_RAFT_LOGS)));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let output = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(ansi)
        .with_filter(tracing_subscriber::filter::FilterExt::and(filter, RateLimit));
    if tracing_subscriber::registry().with(output).try_init().is_ok() {
        let _ = std::thread::Builder::new().name("log-summary".into()).spawn(|| {
            loop {
                std::thread::sleep(WINDOW / 2);
                summarise();
            }
        });
    }
}

/// Logs `message` at information level at most once per `period` for
/// `key` (a summary that would otherwise repeat every round of a loop).
pub fn every(key: &'static str, period: Duration, message: std::fmt::Arguments<'_>) {
    static LAST: LazyLock<Mutex<HashMap<&'static str, Instant>>> = LazyLock::new(Mutex::default);
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if last.get(key).is_some_and(|t| t.elapsed() < period) {
        return;
    }
    last.insert(key, Instant::now());
    drop(last);
    tracing::info!("{message}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Counts the events that reach it.
    struct Count(Arc<AtomicU32>);

    impl<S: tracing::Subscriber> Layer<S> for Count {
        fn on_event(&self, _event: &Event<'_>, _cx: Context<'_, S>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_repeated_warning_passes_a_burst_and_is_counted_after() {
        let seen = Arc::new(AtomicU32::new(0));
        let subscriber = tracing_subscriber::registry().with(Count(seen.clone()).with_filter(RateLimit));
        tracing::subscriber::with_default(subscriber, || {
            for i in 0..100 {
                tracing::warn!(i, "the same warning");
            }
            for _ in 0..100 {
                tracing::info!("information is not limited");
            }
        });
        assert_eq!(seen.load(Ordering::Relaxed), BURST + 100);
        let sites = SITES.lock().unwrap();
        let suppressed: u64 = sites.values().map(|s| s.suppressed).sum();
        assert_eq!(suppressed, u64::from(100 - BURST));
        assert!(sites.values().any(|s| s.example.as_deref() == Some("the same warning")));
    }
}

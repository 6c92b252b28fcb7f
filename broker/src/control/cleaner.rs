//! The log cleaner thread: compaction passes run on one thread of their
//! own (Kafka's `log.cleaner.threads`, default 1; the scrub starts one of
//! its own, `crate::control::scrub`), at the lowest CPU
//! priority the system gives an unprivileged thread (nice 19), so a pass
//! that reads and rewrites hundreds of MB a second yields the cores to
//! produce, fetch and Raft whenever they want them. The pool that
//! `tokio::task::spawn_blocking` uses is not lowered: its threads serve
//! other blocking work too, and an unprivileged thread cannot raise its
//! priority back.
//!
//! On a file system whose background work runs on the runtime (an
//! in-memory disk in a deterministic simulation,
//! `ferrolog_raft_store::vfs::Vfs::background_on_runtime`) there is no
//! thread: passes run on the calling task, unthrottled (a throttle sleeps
//! its thread in real time, which a simulation does not have).

use std::sync::mpsc;

use ferrolog_raft_store::Fs;

/// A job for the cleaner thread.
type Job = Box<dyn FnOnce() + Send>;

/// The nice value of the cleaner thread (the lowest priority on Linux).
pub const CLEANER_NICE: i32 = 19;

/// Where background passes run: the cleaner thread (which ends when this
/// is dropped, after the job it runs), or, without one, through
/// [`ferrolog_raft_store::runtime::blocking`] on the data directory's file
/// system.
#[derive(Debug)]
pub struct Cleaner {
    /// The thread's queue; `None`: no thread.
    jobs: Option<mpsc::Sender<Job>>,
    fs: Fs,
}

impl Cleaner {
    /// The cleaner for a data directory on `fs`: a thread of its own,
    /// named `name`, lowered to [`CLEANER_NICE`] (a refusal is logged;
    /// passes then run at normal priority), unless `fs` runs background
    /// work on the runtime. A thread that cannot be created is logged, and
    /// passes go to the blocking pool.
    pub fn for_fs(fs: Fs, name: &str) -> Self {
        if fs.background_on_runtime() {
            return Cleaner { jobs: None, fs };
        }
        match Self::spawn_thread(name) {
            Ok(jobs) => Cleaner { jobs: Some(jobs), fs },
            Err(e) => {
                tracing::warn!("no {name} thread ({e}): its passes run on the blocking pool");
                Cleaner { jobs: None, fs }
            }
        }
    }

    #[allow(clippy::disallowed_methods, reason = "called only where the file system is not a simulation's")]
    fn spawn_thread(name: &str) -> std::io::Result<mpsc::Sender<Job>> {
        let (jobs, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new().name(name.into()).spawn(move || {
            lower_priority();
            while let Ok(job) = rx.recv() {
                // A job that panics loses its answer (its caller sees
                // `None`), not the thread.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                    tracing::error!("log cleaner thread: a job (a compaction or scrub pass) panicked");
                }
            }
        })?;
        Ok(jobs)
    }

    /// Runs `f` on the cleaner thread, after any job before it (or where
    /// [`Cleaner::for_fs`] said), and returns its result; `None` if `f`
    /// panicked or the thread is gone.
    pub async fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let Some(jobs) = &self.jobs else {
            return ferrolog_raft_store::runtime::blocking(&*self.fs, f).await.ok();
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        jobs.send(Box::new(move || {
            let _ = tx.send(f());
        }))
        .ok()?;
        rx.await.ok()
    }

    /// A throttle of `rate` bytes per second for one pass run by
    /// [`Cleaner::run`]; without a limit where passes run on the runtime.
    pub fn throttle(&self, rate: u64) -> IoThrottle {
        IoThrottle::new(if self.fs.background_on_runtime() { 0 } else { rate })
    }
}

/// A byte-rate limit for one pass of background reads on a blocking
/// thread (a compaction pass: Kafka's
/// `log.cleaner.io.max.bytes.per.second`; a scrub pass).
#[derive(Debug)]
pub struct IoThrottle {
    /// Bytes per second; 0: no limit.
    rate: u64,
    started: std::time::Instant,
    bytes: u64,
}

impl IoThrottle {
    /// A throttle of `rate` bytes per second (0: no limit), its pass
    /// starting now.
    #[allow(clippy::disallowed_methods, reason = "paced by thread::sleep on a blocking thread: real time")]
    pub fn new(rate: u64) -> Self {
        IoThrottle { rate, started: std::time::Instant::now(), bytes: 0 }
    }

    /// Counts `bytes` read and sleeps (the caller is a blocking thread)
    /// until the pass is back within its rate.
    pub fn read(&mut self, bytes: u64) {
        if self.rate == 0 {
            return;
        }
        self.bytes += bytes;
        let due = std::time::Duration::from_secs_f64(self.bytes as f64 / self.rate as f64);
        if let Some(wait) = due.checked_sub(self.started.elapsed()) {
            std::thread::sleep(wait);
        }
    }
}

/// Lowers the calling thread to [`CLEANER_NICE`]: on Linux a nice value is
/// per thread (`setpriority(PRIO_PROCESS, tid)`); elsewhere it would be the
/// whole process's, so nothing is done.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), CLEANER_NICE) {
        tracing::warn!("log cleaner thread: cannot lower its priority to nice {CLEANER_NICE}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn jobs_run_in_order_on_one_low_priority_thread() {
        let cleaner = Cleaner::for_fs(ferrolog_raft_store::vfs::real(), "test-cleaner");
        let thread = cleaner.run(|| std::thread::current().id()).await.expect("ran");
        let again = cleaner.run(|| std::thread::current().id()).await;
        assert_eq!(Some(thread), again, "one thread");
        assert_eq!(
            cleaner.run(|| std::thread::current().name().map(str::to_owned)).await.flatten().as_deref(),
            Some("test-cleaner")
        );
        assert_ne!(thread, std::thread::current().id());
        // The thread's own nice value, read on it.
        let nice = cleaner
            .run(|| rustix::process::getpriority_process(Some(rustix::thread::gettid())))
            .await
            .expect("ran")
            .expect("getpriority");
        assert_eq!(nice, CLEANER_NICE);
    }
}

//! The async runtime every Raft group runs on: tokio, as openraft's own
//! tokio runtime provides it, with one difference. The random numbers the
//! Raft library draws (randomized election timeouts, Raft paper §5.2, and
//! its ticker's first wait) come from a generator that a deterministic
//! simulation can seed for its thread ([`seed_thread_rng`]), so one seed
//! replays the same elections. Unseeded, each draw comes from rand's
//! thread-local generator, as with openraft's runtime.
//!
//! The same module is where the brokers above it get their other
//! nondeterministic inputs, so that a simulation controls them in one place:
//! [`random_u64`] and [`random_u128`] (ids, back-off jitter) draw from that
//! generator, and [`wall_clock`] (record timestamps, retention by time,
//! producer id expiry) reads the system clock, or a simulation's wall clock
//! that moves with tokio's paused clock ([`simulate_clocks`]), which also
//! sets the origin of [`monotonic_ms`].
//! Blocking file-system work goes through [`blocking`]: to tokio's blocking
//! pool, or, on a simulation's in-memory disk, run right on the task.

use std::cell::Cell;
use std::convert::Infallible;
use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use openraft::{AsyncRuntime, OptionalSend};
use openraft_rt_tokio::TokioRuntime;
use rand::TryRng;

use crate::vfs::Vfs;

thread_local! {
    /// The state of this thread's seeded generator, if a simulation set one.
    static SEEDED: Cell<Option<u64>> = const { Cell::new(None) };
    /// This thread's simulated wall clock, if a simulation set one: the
    /// time since the Unix epoch at an instant of tokio's clock.
    static SIMULATED_WALL: Cell<Option<(Duration, tokio::time::Instant)>> = const { Cell::new(None) };
    /// This thread's origin of [`monotonic_ms`], if a simulation set one.
    static SIMULATED_ORIGIN: Cell<Option<tokio::time::Instant>> = const { Cell::new(None) };
}

/// Makes [`wall_clock`] on this thread read `since_epoch` now and advance
/// with tokio's clock from here on, and [`monotonic_ms`] count from now
/// (`None`: the system clock and the process's origin again). For
/// deterministic simulations, whose runtime's clock is paused; call it
/// inside that runtime, at its start. Nothing else should call it.
pub fn simulate_clocks(since_epoch: Option<Duration>) {
    let now = tokio::time::Instant::now();
    SIMULATED_WALL.with(|w| w.set(since_epoch.map(|d| (d, now))));
    SIMULATED_ORIGIN.with(|o| o.set(since_epoch.map(|_| now)));
}

/// The process's origin of [`monotonic_ms`]: its first reading.
static PROCESS_ORIGIN: std::sync::LazyLock<tokio::time::Instant> =
    std::sync::LazyLock::new(tokio::time::Instant::now);

/// Milliseconds on tokio's clock since an origin: the process's first
/// reading, or in a simulation the start set by [`simulate_clocks`] (a
/// process-wide origin would carry a sub-millisecond phase from whatever
/// ran before, and round a replayed seed's times otherwise). For instants
/// kept in atomics as numbers; compare only readings of one process, and in
/// a simulation of its one thread (a simulation runs on a current-thread
/// runtime: the origin it sets is that thread's).
pub fn monotonic_ms() -> u64 {
    let origin = SIMULATED_ORIGIN.with(Cell::get).unwrap_or_else(|| *PROCESS_ORIGIN);
    u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// The wall-clock time: the system's (`SystemTime::now`), or this thread's
/// simulated one ([`simulate_clocks`]). Use it, not the system clock,
/// for every wall-clock reading a broker acts on.
#[allow(clippy::disallowed_methods, reason = "the one place the system's wall clock is read")]
pub fn wall_clock() -> SystemTime {
    match SIMULATED_WALL.with(Cell::get) {
        Some((since_epoch, at)) => UNIX_EPOCH + since_epoch + at.elapsed(),
        None => SystemTime::now(),
    }
}

/// [`wall_clock`] in milliseconds since the Unix epoch (0 for a clock set
/// before 1970).
pub fn wall_clock_ms() -> i64 {
    wall_clock().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A random number from this thread's generator ([`RaftRng`]: seeded in a
/// simulation, else rand's thread-local generator, seeded by the OS).
pub fn random_u64() -> u64 {
    let Ok(v) = RaftRng.try_next_u64();
    v
}

/// As [`random_u64`], 128 bits (random ids: topic ids, member ids).
pub fn random_u128() -> u128 {
    (u128::from(random_u64()) << 64) | u128::from(random_u64())
}

/// Seeds the generator the Raft library draws from on this thread (`None`:
/// back to the OS-seeded thread-local generator). For deterministic
/// simulations, which run a whole group on one thread; nothing else should
/// call it.
pub fn seed_thread_rng(seed: Option<u64>) {
    SEEDED.with(|s| s.set(seed));
}

/// The Raft library's random numbers: from this thread's seeded sequence
/// (splitmix64) when [`seed_thread_rng`] set one, else from rand's
/// thread-local generator.
#[derive(Debug, Default)]
pub struct RaftRng;

impl TryRng for RaftRng {
    type Error = Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Infallible> {
        self.try_next_u64().map(|v| (v >> 32) as u32)
    }

    fn try_next_u64(&mut self) -> Result<u64, Infallible> {
        let seeded = SEEDED.with(|s| {
            let state = s.get()?.wrapping_add(0x9E37_79B9_7F4A_7C15);
            s.set(Some(state));
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            Some(z ^ (z >> 31))
        });
        Ok(seeded.unwrap_or_else(|| rand::Rng::next_u64(&mut rand::rng())))
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Infallible> {
        for chunk in dst.chunks_mut(8) {
            let bytes = self.try_next_u64()?.to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
        Ok(())
    }
}

/// Blocking work ([`blocking`]) that panicked (the panic's message) or
/// was cancelled (the runtime shut down before it ran).
#[derive(Debug, thiserror::Error)]
#[error("blocking work failed: {0}")]
pub struct BlockingFailed(pub String);

/// Runs `work`, which blocks on file-system calls, without stalling the
/// runtime's other tasks: on tokio's blocking pool, or here on the calling
/// task when `fs` runs its background work on the runtime
/// ([`Vfs::background_on_runtime`]: an in-memory disk in a deterministic
/// simulation, whose calls never block, and where another thread would
/// make the order of events depend on the operating system's scheduler).
///
/// # Errors
/// [`BlockingFailed`] when `work` panicked (on the calling task too: the
/// panic is caught, as the blocking pool would) or the runtime shut down
/// before it ran.
#[allow(clippy::disallowed_methods, reason = "the one place blocking work is sent to tokio's pool")]
pub async fn blocking<T, F>(fs: &dyn Vfs, work: F) -> Result<T, BlockingFailed>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    if fs.background_on_runtime() {
        return std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
            .map_err(|p| BlockingFailed(panic_message(&*p)));
    }
    tokio::task::spawn_blocking(work).await.map_err(|e| match e.try_into_panic() {
        Ok(p) => BlockingFailed(panic_message(&*p)),
        Err(e) => BlockingFailed(e.to_string()),
    })
}

/// A panic payload's message, when it is a string.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// openraft's tokio runtime with [`RaftRng`] as its random numbers.
#[derive(Debug)]
pub struct RaftRuntime(TokioRuntime);

type Tokio = TokioRuntime;

impl AsyncRuntime for RaftRuntime {
    type JoinError = <Tokio as AsyncRuntime>::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = <Tokio as AsyncRuntime>::JoinHandle<T>;
    type Sleep = <Tokio as AsyncRuntime>::Sleep;
    type Instant = <Tokio as AsyncRuntime>::Instant;
    type TimeoutError = <Tokio as AsyncRuntime>::TimeoutError;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = <Tokio as AsyncRuntime>::Timeout<R, T>;
    type ThreadLocalRng = RaftRng;
    type Mpsc = <Tokio as AsyncRuntime>::Mpsc;
    type Watch = <Tokio as AsyncRuntime>::Watch;
    type Oneshot = <Tokio as AsyncRuntime>::Oneshot;
    type Mutex<T: OptionalSend + 'static> = <Tokio as AsyncRuntime>::Mutex<T>;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        Tokio::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        Tokio::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        Tokio::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        Tokio::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        Tokio::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        Tokio::is_panic(join_error)
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        RaftRng
    }

    fn new(threads: usize) -> Self {
        Self(Tokio::new(threads))
    }

    fn block_on<F, T>(&mut self, future: F) -> T
    where
        F: Future<Output = T>,
    {
        self.0.block_on(future)
    }
}

#[cfg(test)]
mod tests {
    use rand::RngExt;

    use super::*;

    #[test]
    fn a_seeded_thread_draws_the_same_sequence_again() {
        let draw = || (0..8).map(|_| RaftRuntime::thread_rng().random_range(150..300u64)).collect::<Vec<_>>();
        seed_thread_rng(Some(42));
        let first = draw();
        seed_thread_rng(Some(42));
        assert_eq!(draw(), first);
        seed_thread_rng(Some(43));
        assert_ne!(draw(), first, "another seed, another sequence");
        seed_thread_rng(None);
        assert!(first.iter().all(|t| (150..300).contains(t)));
    }

    #[test]
    fn ids_drawn_on_a_seeded_thread_repeat_with_the_seed() {
        let draw = || (random_u64(), random_u128());
        seed_thread_rng(Some(7));
        let first = draw();
        seed_thread_rng(Some(7));
        assert_eq!(draw(), first);
        seed_thread_rng(None);
        assert_ne!(draw(), first, "unseeded: from the OS-seeded generator");
    }

    /// A simulation's wall clock and monotonic milliseconds move with
    /// tokio's paused clock, and only with it.
    #[tokio::test(start_paused = true)]
    async fn a_simulated_wall_clock_moves_with_the_paused_clock() {
        // The process's origin, read before: the simulation's is its own.
        let _ = monotonic_ms();
        tokio::time::advance(Duration::from_micros(700)).await;
        simulate_clocks(Some(Duration::from_millis(1_700_000_000_000)));
        assert_eq!(wall_clock_ms(), 1_700_000_000_000);
        assert_eq!(monotonic_ms(), 0);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(wall_clock_ms(), 1_700_000_000_000, "real time passing moves nothing");
        assert_eq!(monotonic_ms(), 0, "real time passing moves nothing");
        tokio::time::advance(Duration::from_millis(1_234)).await;
        assert_eq!(wall_clock_ms(), 1_700_000_001_234);
        assert_eq!(monotonic_ms(), 1_234, "counted from the simulation's start, not the process's");
        simulate_clocks(None);
        assert!(wall_clock_ms() > 1_700_000_001_234, "the system clock again (this is after 2023)");
    }
}

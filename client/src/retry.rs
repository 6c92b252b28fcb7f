//! Exponential backoff with jitter, as Kafka clients do it
//! (`retry.backoff.ms` doubling up to `retry.backoff.max.ms`, KIP-580, ±20 %).

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// Backoff between retries: `initial_ms · 2^attempt`, capped at `max_ms`,
/// each delay scaled by a random factor in [0.8, 1.2] so that clients that
/// failed together do not retry together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay before the first retry, ms.
    pub initial_ms: u64,
    /// Largest delay, ms.
    pub max_ms: u64,
}

impl Default for Backoff {
    /// 20 ms doubling up to 1 s.
    fn default() -> Self {
        Backoff { initial_ms: 20, max_ms: 1000 }
    }
}

impl Backoff {
    /// The delay before retry number `attempt` (0 for the first retry).
    pub fn delay(&self, attempt: u32) -> Duration {
        let base = self.initial_ms.saturating_mul(1u64 << attempt.min(20)).min(self.max_ms);
        let jitter_permille = 800 + random_u64() % 401;
        Duration::from_millis(base * jitter_permille / 1000)
    }
}

/// A random number from the standard library's per-process random hasher
/// keys: enough for jitter, no dependency.
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_with_bounded_jitter() {
        let b = Backoff { initial_ms: 20, max_ms: 1000 };
        for (attempt, base) in [(0, 20), (1, 40), (2, 80), (5, 640), (6, 1000), (40, 1000)] {
            for _ in 0..50 {
                let d = b.delay(attempt).as_millis() as u64;
                assert!(d >= base * 8 / 10 && d <= base * 12 / 10, "attempt {attempt}: {d} ms vs {base}");
            }
        }
    }
}

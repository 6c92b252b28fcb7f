//! The reassignment throttle: entries and snapshot chunks this broker
//! sends to learners of the groups it leads (replicas a reassignment is
//! adding, catching up; `crate::control::membership` keeps the set) share
//! one budget of bytes per second, so copying a partition to a
//! new broker leaves the disks and the network room for producers (Kafka's
//! `leader.replication.throttled.rate` applied to the moving replicas,
//! KIP-73). Traffic to every other replica is never held back.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use ferrolog_replica::NodeId;
use tokio::time::Instant;

/// A shared byte-rate limit for traffic to a set of Raft nodes.
#[derive(Clone, Debug)]
pub struct Throttle {
    /// Bytes per second; 0: no limit.
    rate: u64,
    /// The nodes it applies to (learners of groups led here).
    nodes: Arc<RwLock<Arc<HashSet<NodeId>>>>,
    /// When the budget is next free: each send of `n` bytes starts no
    /// earlier than this and moves it `n / rate` seconds on (a virtual
    /// clock, as in a generic cell rate algorithm).
    free_at: Arc<Mutex<Option<Instant>>>,
}

/// Longest one send waits for the budget before it goes anyway: beyond
/// that the Raft node's own request timeout would fire first, and it would
/// only send the same bytes again.
pub const MAX_WAIT: Duration = Duration::from_millis(400);

impl Throttle {
    /// A throttle of `rate` bytes per second (0: unlimited), applying to no
    /// node until [`Throttle::set_nodes`].
    pub fn new(rate: u64) -> Self {
        Self { rate, nodes: Arc::default(), free_at: Arc::default() }
    }

    /// Throttles traffic to `node` (a learner of a group led here), or
    /// stops throttling it (it became a voter, or was removed).
    pub fn set_node(&self, node: NodeId, throttled: bool) {
        let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        if nodes.contains(&node) != throttled {
            let mut next = HashSet::clone(&nodes);
            if throttled {
                next.insert(node);
            } else {
                next.remove(&node);
            }
            *nodes = Arc::new(next);
        }
    }

    /// Whether traffic to `node` is throttled.
    pub fn applies(&self, node: NodeId) -> bool {
        self.rate > 0 && self.nodes.read().unwrap_or_else(|p| p.into_inner()).contains(&node)
    }

    /// Charges `bytes` to the budget and waits until they may be sent (at
    /// most [`MAX_WAIT`]). Returns how long it waited.
    pub async fn charge(&self, bytes: u64) -> Duration {
        let start = self.reserve(bytes, Instant::now());
        let now = Instant::now();
        let wait = start.saturating_duration_since(now).min(MAX_WAIT);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        wait
    }

    /// Reserves `bytes` at time `now`: returns when the send may start.
    fn reserve(&self, bytes: u64, now: Instant) -> Instant {
        if self.rate == 0 {
            return now;
        }
        let mut free_at = self.free_at.lock().unwrap_or_else(|p| p.into_inner());
        // Sends that waited only MAX_WAIT went early; the clock is not let
        // run further ahead than that, or it would hold back the next move.
        let start = free_at.map_or(now, |f| f.max(now)).min(now + MAX_WAIT);
        let takes = Duration::from_secs_f64(bytes as f64 / self.rate as f64);
        *free_at = Some(start + takes);
        start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_are_spaced_by_their_size_over_the_rate() {
        let t = Throttle::new(10_000_000);
        let now = Instant::now();
        assert_eq!(t.reserve(1_000_000, now), now, "the first goes at once");
        assert_eq!(t.reserve(1_000_000, now), now + Duration::from_millis(100));
        assert_eq!(t.reserve(0, now), now + Duration::from_millis(200));
        // Never further ahead than MAX_WAIT.
        assert_eq!(t.reserve(10_000_000, now), now + Duration::from_millis(200));
        assert_eq!(t.reserve(1, now), now + MAX_WAIT, "not 1.2 s on");
        assert_eq!(t.reserve(1, now), now + MAX_WAIT);
        // Idle time is not saved up: after a pause the next goes at once.
        let later = now + Duration::from_secs(20);
        assert_eq!(t.reserve(10, later), later);
    }

    #[test]
    fn only_the_nodes_set_are_throttled_and_zero_is_unlimited() {
        let t = Throttle::new(10);
        assert!(!t.applies(7));
        t.set_node(7, true);
        assert!(t.applies(7) && !t.applies(8));
        t.set_node(7, false);
        assert!(!t.applies(7));
        let unlimited = Throttle::new(0);
        unlimited.set_node(7, true);
        assert!(!unlimited.applies(7));
        let now = Instant::now();
        assert_eq!(unlimited.reserve(u64::MAX, now), now);
    }
}

//! Which brokers answer: each broker pings every registered peer once per
//! Raft heartbeat interval; a broker is alive while its last answer is more
//! recent than the minimum election timeout. One ping per broker pair
//! replaces per-group heartbeats for failure detection (`crate::quiesce`).
//!
//! Pings also say which groups the answering broker leads, and when it came
//! back: a broker that restarted (a new boot id) or answers again after
//! being silent is *returned* once it reports its replicas open, and
//! leaders elsewhere wake their groups until each follower there has
//! acknowledged a heartbeat since (`crate::quiesce`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrolog_proto::raft::PingRequest;
use ferrolog_proto::raft::raft_peer_client::RaftPeerClient;
use tokio::sync::watch;

use crate::config::BrokerId;
use crate::metadata::image::MetadataImage;
use crate::network::PeerAddresses;

/// What the last answer of one broker said.
#[derive(Debug)]
struct Heard {
    /// When it answered.
    at: Instant,
    /// The groups it leads.
    leading: HashSet<u64>,
    /// Its boot id (`PingResponse.boot_id`).
    boot_id: u64,
    /// Since when it has answered without a gap, on this boot, with its
    /// replicas open (`None`: not open yet).
    returned_at: Option<Instant>,
}

/// Last successful ping per broker. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Liveness {
    seen: Arc<Mutex<HashMap<BrokerId, Heard>>>,
    dead_after: Arc<Mutex<Duration>>,
    /// When [`Liveness::run`] started pinging.
    started: Arc<Mutex<Option<Instant>>>,
}

impl Default for Liveness {
    fn default() -> Self {
        Self {
            seen: Arc::default(),
            dead_after: Arc::new(Mutex::new(Duration::from_secs(1))),
            started: Arc::default(),
        }
    }
}

impl Liveness {
    fn dead_after(&self) -> Duration {
        *self.dead_after.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `broker` answered recently enough.
    pub fn is_alive(&self, broker: BrokerId) -> bool {
        let dead_after = self.dead_after();
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&broker).is_some_and(|h| h.at.elapsed() < dead_after)
    }

    /// Whether `broker` answered recently and said it leads `group`.
    pub fn leads(&self, broker: BrokerId, group: u64) -> bool {
        let dead_after = self.dead_after();
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&broker).is_some_and(|h| h.at.elapsed() < dead_after && h.leading.contains(&group))
    }

    /// Whether every broker has had time to answer since pinging started
    /// (one `dead_after` window): before that, a broker not heard from yet
    /// may be alive, so nothing should be concluded from its silence.
    pub fn settled(&self) -> bool {
        let dead_after = self.dead_after();
        self.started.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|t| t.elapsed() >= dead_after)
    }

    /// When `broker` came back (see the module comment), if it is alive.
    pub fn returned_at(&self, broker: BrokerId) -> Option<Instant> {
        let dead_after = self.dead_after();
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&broker).filter(|h| h.at.elapsed() < dead_after).and_then(|h| h.returned_at)
    }

    fn mark(&self, broker: BrokerId, leading: Vec<u64>, boot_id: u64, replicas_open: bool) {
        let dead_after = self.dead_after();
        let now = Instant::now();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let previous = seen.get(&broker);
        let continuous = previous.is_some_and(|h| h.boot_id == boot_id && h.at.elapsed() < dead_after);
        let returned_at = match previous {
            _ if !replicas_open => None,
            Some(h) if continuous => h.returned_at.or(Some(now)),
            _ => Some(now),
        };
        seen.insert(broker, Heard { at: now, leading: leading.into_iter().collect(), boot_id, returned_at });
    }

    /// Pings every registered broker (itself included, through its own
    /// listener) every `every`, reporting one silent for `dead_after` as
    /// dead, until the image's sender is dropped.
    pub async fn run(
        self,
        me: BrokerId,
        image: watch::Receiver<Arc<MetadataImage>>,
        peers: PeerAddresses,
        every: Duration,
        dead_after: Duration,
    ) {
        *self.dead_after.lock().unwrap_or_else(|p| p.into_inner()) = dead_after;
        *self.started.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if image.has_changed().is_err() {
                return;
            }
            let brokers: Vec<(BrokerId, String)> =
                image.borrow().brokers.iter().map(|(id, b)| (*id, b.peer_addr.clone())).collect();
            for (id, addr) in brokers {
                let Ok(channel) = peers.channel(&addr) else { continue };
                let this = self.clone();
                tokio::spawn(async move {
                    let mut req = tonic::Request::new(PingRequest { from_broker: me });
                    req.set_timeout(dead_after);
                    if let Ok(r) = RaftPeerClient::new(channel).ping(req).await {
                        let r = r.into_inner();
                        if r.broker_id == id {
                            this.mark(id, r.leading_groups, r.boot_id, r.replicas_open);
                        }
                    }
                });
            }
        }
    }
}

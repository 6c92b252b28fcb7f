//! Which brokers answer: each broker pings every registered peer once per
//! Raft heartbeat interval; a broker is alive while its last answer is more
//! recent than the minimum election timeout. One ping per broker pair
//! replaces per-group heartbeats for failure detection (`crate::quiesce`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrolog_proto::raft::PingRequest;
use ferrolog_proto::raft::raft_peer_client::RaftPeerClient;
use tokio::sync::watch;

use crate::config::BrokerId;
use crate::metadata::image::MetadataImage;
use crate::network::PeerAddresses;

/// When a broker last answered, and the groups it said it leads.
type Heard = (Instant, HashSet<u64>);

/// Last successful ping per broker. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Liveness {
    seen: Arc<Mutex<HashMap<BrokerId, Heard>>>,
    dead_after: Arc<Mutex<Duration>>,
}

impl Default for Liveness {
    fn default() -> Self {
        Self { seen: Arc::default(), dead_after: Arc::new(Mutex::new(Duration::from_secs(1))) }
    }
}

impl Liveness {
    /// Whether `broker` answered recently enough.
    pub fn is_alive(&self, broker: BrokerId) -> bool {
        let dead_after = *self.dead_after.lock().unwrap_or_else(|p| p.into_inner());
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&broker).is_some_and(|(t, _)| t.elapsed() < dead_after)
    }

    /// Whether `broker` answered recently and said it leads `group`.
    pub fn leads(&self, broker: BrokerId, group: u64) -> bool {
        let dead_after = *self.dead_after.lock().unwrap_or_else(|p| p.into_inner());
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&broker).is_some_and(|(t, led)| t.elapsed() < dead_after && led.contains(&group))
    }

    fn mark(&self, broker: BrokerId, leading: Vec<u64>) {
        let led = leading.into_iter().collect();
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).insert(broker, (Instant::now(), led));
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
                            this.mark(id, r.leading_groups);
                        }
                    }
                });
            }
        }
    }
}

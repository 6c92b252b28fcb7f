//! Which brokers answer: every second each broker pings every registered
//! peer; a broker is alive while its last answer is recent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrolog_proto::raft::PingRequest;
use ferrolog_proto::raft::raft_peer_client::RaftPeerClient;
use tokio::sync::watch;

use crate::config::BrokerId;
use crate::metadata::image::MetadataImage;
use crate::network::PeerAddresses;

/// Period of the pings.
pub const PING_INTERVAL: Duration = Duration::from_secs(1);
/// A broker not heard from for this long is reported dead.
pub const DEAD_AFTER: Duration = Duration::from_secs(3);

/// Last successful ping per broker. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Liveness {
    seen: Arc<Mutex<HashMap<BrokerId, Instant>>>,
}

impl Liveness {
    /// Whether `broker` answered within [`DEAD_AFTER`].
    pub fn is_alive(&self, broker: BrokerId) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&broker).is_some_and(|t| t.elapsed() < DEAD_AFTER)
    }

    fn mark(&self, broker: BrokerId) {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).insert(broker, Instant::now());
    }

    /// Pings every registered broker (itself included, through its own
    /// listener) until the image's sender is dropped.
    pub async fn run(self, me: BrokerId, image: watch::Receiver<Arc<MetadataImage>>, peers: PeerAddresses) {
        let mut tick = tokio::time::interval(PING_INTERVAL);
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
                    req.set_timeout(PING_INTERVAL);
                    if let Ok(r) = RaftPeerClient::new(channel).ping(req).await
                        && r.into_inner().broker_id == id
                    {
                        this.mark(id);
                    }
                });
            }
        }
    }
}

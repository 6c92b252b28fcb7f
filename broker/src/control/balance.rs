//! Preferred-leader balancing (Kafka's `auto.leader.rebalance.enable`).
//!
//! Each partition's first replica is its preferred leader; placement
//! spreads first replicas evenly, so leaderships are spread evenly while
//! preferred replicas lead. Failures and restarts move leaderships away
//! (a broker back from a restart, or from a controlled shutdown, leads
//! nothing). Every [`BalanceConfig::leader_imbalance_check_interval_ms`]
//! each broker counts, for every broker B, the partitions whose preferred
//! replica is on B and how many of them another broker leads, from the
//! leaderships the pings announce ([`imbalance`]). Where that share is over
//! [`BalanceConfig::leader_imbalance_per_broker_percentage`] and B is alive
//! and not draining, this broker hands the leaderships it holds of B's
//! preferred partitions to B ([`HandOver::transfer_to`]), when B's replica
//! looks caught up ([`handover::candidates`]) and has stored the blank
//! entry the hand-over appends first: never to a replica that is behind. Kafka's controller makes the same decision for the cluster;
//! here each leader acts on its own groups, so no message is needed beyond
//! the pings, and two brokers never move the same group.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;

use crate::config::{BalanceConfig, BrokerId};
use crate::control::handover::{self, HandOver};
use crate::metadata::image::MetadataImage;

/// How long one hand-over to a preferred replica may take.
pub const TRANSFER_WAIT: Duration = Duration::from_secs(5);

/// Per broker: partitions whose preferred replica it holds, and how many
/// of those it does not lead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Share {
    /// Partitions whose first replica is on the broker.
    pub preferred: usize,
    /// Of those, the ones it does not lead.
    pub led_elsewhere: usize,
}

impl Share {
    /// Whether more than `percentage` % of the broker's preferred
    /// partitions are led elsewhere (Kafka's imbalance ratio check).
    pub fn out_of_balance(&self, percentage: u32) -> bool {
        self.led_elsewhere * 100 > self.preferred * percentage as usize
    }
}

/// Every broker's [`Share`] in `image`; `leads(broker, group)` tells
/// whether a broker leads a group.
pub fn imbalance(image: &MetadataImage, leads: impl Fn(BrokerId, u64) -> bool) -> BTreeMap<BrokerId, Share> {
    let mut out: BTreeMap<BrokerId, Share> = BTreeMap::new();
    for p in image.topics.values().flat_map(|t| t.partitions.iter()) {
        let Some(first) = p.replicas.first() else { continue };
        let share = out.entry(first.broker).or_default();
        share.preferred += 1;
        if !leads(first.broker, p.group) {
            share.led_elsewhere += 1;
        }
    }
    out
}

/// Checks the balance every interval and hands leaderships held here back
/// to preferred replicas on brokers out of balance, forever (off when
/// `auto_leader_rebalance_enable` is false).
pub async fn run(
    me: BrokerId,
    hand_over: HandOver,
    image: watch::Receiver<Arc<MetadataImage>>,
    config: BalanceConfig,
) {
    let (groups, liveness) = (hand_over.groups.clone(), hand_over.liveness.clone());
    if !config.auto_leader_rebalance_enable {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(config.leader_imbalance_check_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: the brokers have not said what they lead yet.
    tick.tick().await;
    loop {
        tick.tick().await;
        if groups.draining() {
            continue;
        }
        let img = image.borrow().clone();
        let shares = imbalance(&img, |b, g| if b == me { groups.is_led(g) } else { liveness.leads(b, g) });
        let wanted: Vec<BrokerId> = shares
            .iter()
            .filter(|(b, s)| {
                **b != me
                    && s.out_of_balance(config.leader_imbalance_per_broker_percentage)
                    && liveness.takes_leadership(**b)
            })
            .map(|(b, _)| *b)
            .collect();
        if wanted.is_empty() {
            continue;
        }
        let moves: Vec<_> = groups
            .leading()
            .iter()
            .filter_map(|g| groups.get(*g).map(|h| (*g, h)))
            .filter_map(|(g, h)| {
                let preferred = h.partition.as_ref()?.replicas().first()?.broker;
                wanted.contains(&preferred).then_some((g, h, preferred))
            })
            .collect();
        let outcomes: Vec<_> = futures::stream::iter(moves)
            .map(|(g, h, to)| {
                let (img, hand_over) = (img.clone(), &hand_over);
                async move {
                    let replicas = handover::voters_in_order(&h, g, &img);
                    // Only to a caught-up replica: a behind one is left for the next check.
                    let (last, matched) = h.raft.state(|s| {
                        let m: Vec<_> = s
                            .matched()
                            .map(|r| r.map(|(n, m)| (n, m.map(|l| l.index))).collect())
                            .unwrap_or_default();
                        (s.last_log_index().unwrap_or(0), m)
                    });
                    let matched_of = |n| matched.iter().find(|(m, _)| *m == n).and_then(|(_, i)| *i);
                    let ready =
                        !handover::candidates(&replicas, h.node_id, matched_of, last, |b| b == to).is_empty();
                    if !ready {
                        return (g, to, None);
                    }
                    (g, to, Some(hand_over.transfer_to(g, replicas, to, TRANSFER_WAIT).await))
                }
            })
            .buffer_unordered(handover::IN_FLIGHT)
            .collect()
            .await;
        let moved = outcomes.iter().filter(|(_, _, o)| *o == Some(handover::Transfer::Moved)).count();
        for (group, to, o) in &outcomes {
            match o {
                Some(handover::Transfer::Moved) | None => {}
                Some(other) => {
                    tracing::warn!(group, to, ?other, "preferred leader election did not move the leadership")
                }
            }
        }
        tracing::info!(
            out_of_balance = ?wanted,
            moved,
            tried = outcomes.iter().filter(|(_, _, o)| o.is_some()).count(),
            behind = outcomes.iter().filter(|(_, _, o)| o.is_none()).count(),
            "preferred leader election: leaderships handed back to preferred replicas"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_is_out_of_balance_past_the_percentage() {
        let s = Share { preferred: 10, led_elsewhere: 1 };
        assert!(!s.out_of_balance(10), "exactly 10% is within");
        assert!(Share { preferred: 10, led_elsewhere: 2 }.out_of_balance(10));
        assert!(!Share { preferred: 0, led_elsewhere: 0 }.out_of_balance(0));
        assert!(Share { preferred: 2, led_elsewhere: 1 }.out_of_balance(0));
        assert!(!Share { preferred: 2, led_elsewhere: 2 }.out_of_balance(100));
    }
}

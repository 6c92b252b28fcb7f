//! Idempotent producer state expiry (Kafka's `producer.id.expiration.ms`,
//! KIP-98; 1 day by default): every
//! `producers.id_expiration_check_interval_ms`, the leader of each partition
//! whose applied state holds a producer id replicates its clock and the
//! expiration through the partition's Raft log ([`Control::ExpireProducers`]),
//! so every replica drops the same idle ids at the same log position and
//! snapshots stop carrying them. The decision is written even when no id is
//! idle: it is the clock a producer's last write is never dated before, so
//! a producer whose timestamps are old (a backfill) is not taken for idle
//! while it writes. A producer that sends again after its id
//! expired is answered `OUT_OF_ORDER_SEQUENCE` (expected 0) unless its batch
//! starts a sequence: Kafka's `UNKNOWN_PRODUCER_ID` case.

use std::time::Duration;

use ferrolog_raft_store::Control;

use crate::control::compaction::COMPACTION_MINOR;
use crate::control::liveness::Liveness;
use crate::groups::GroupRegistry;
use crate::partition::Partition;

/// Runs expiry on this broker every `interval` until the task is dropped,
/// for the partitions it leads, while every live broker decodes the
/// decision (peer protocol 1.10, as compaction's).
pub async fn run(groups: GroupRegistry, liveness: Liveness, interval: Duration, expiration_ms: i64) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !liveness.older_than(COMPACTION_MINOR).is_empty() {
            continue;
        }
        for p in groups.partitions() {
            if p.raft.is_leader() {
                decide(&p, expiration_ms).await;
            }
        }
    }
}

/// Proposes an expiry for one partition if its applied state holds an idle id.
async fn decide(p: &Partition, expiration_ms: i64) {
    let now_ms = crate::metadata::controller::now_ms();
    if p.replica.producer_count() == 0 || p.lost_quorum() {
        return;
    }
    let idle = p.replica.idle_producers(now_ms, expiration_ms);
    let control = Control::ExpireProducers { now_ms, expiration_ms };
    if crate::control::propose_control(p, control, "producer expiry").await && idle > 0 {
        tracing::info!(topic = %p.topic, partition = p.partition, idle, expiration_ms, "expired idle producer ids");
    }
}

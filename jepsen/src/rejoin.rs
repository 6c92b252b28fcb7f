//! The `membership` fault's slowest operation (issue 11): decommission a
//! broker and add its machine back as a new, empty broker, while the other
//! faults go on.
//!
//! 1. drain: every partition the broker holds is reassigned to the other
//!    live brokers (keeping the replicas that stay), again and again until
//!    it holds none (a move may be refused, cancelled by another membership
//!    operation, or slowed by a kill or a cut);
//! 2. `DecommissionBroker`, retried until accepted, then wait until the
//!    broker is out of the controller quorum;
//! 3. its process is SIGKILLed, its data directory deleted, and it starts
//!    again with `--join`: the controller gives it a new broker id, which
//!    later membership operations place replicas on and make a voter.
//!
//! It runs in the background across later fault periods, at most one at a
//! time. Before the broker is decommissioned it gives up a step after
//! [`STEP_WAIT`] or when the run stops (the slot then serves as before);
//! once it is, it goes on to the re-add whatever the run does, so that the
//! run's final phase never meets a decommissioned broker.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrolog_client::admin::ReassignmentRequest;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use tokio::sync::watch;

use crate::cluster::Cluster;
use crate::nemesis::Ops;

/// Longest each step (drain, decommission, leaving the quorum, joining
/// again) may take before the operation gives up.
pub const STEP_WAIT: Duration = Duration::from_secs(180);
/// Pause between two looks at the metadata.
const POLL: Duration = Duration::from_secs(2);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why the operation stopped before the end.
enum Stop {
    /// The run is over (before the broker was decommissioned).
    RunOver,
    /// A step did not finish in time, or failed; `decommissioned`: after
    /// the broker was (its slot then stays out of membership operations).
    GaveUp { why: String, decommissioned: bool },
}

/// Decommissions the broker slot `slot` runs (`old`), then re-adds the
/// slot empty; returns what happened, for the run's fault log.
pub async fn decommission_and_rejoin(
    cluster: Arc<Mutex<Cluster>>,
    ops: Ops,
    slot: u32,
    old: u32,
    mut rng: StdRng,
    mut stop: watch::Receiver<bool>,
) -> String {
    lock(&cluster).set_retiring(slot, true);
    let began = Instant::now();
    let outcome = steps(&cluster, &ops, slot, old, &mut rng, &mut stop).await;
    let took = began.elapsed().as_secs_f64();
    let keep_out = matches!(outcome, Err(Stop::GaveUp { decommissioned: true, .. }));
    lock(&cluster).set_retiring(slot, keep_out);
    match outcome {
        Ok((moved, new)) => format!(
            "decommissioned broker {old} (slot {slot}, {moved} replicas moved off) and re-added the slot empty as \
             broker {new}, in {took:.1} s"
        ),
        Err(Stop::RunOver) => format!(
            "decommission and re-add of broker {old} (slot {slot}) cut short by the end of the run after {took:.1} s"
        ),
        Err(Stop::GaveUp { why, .. }) => {
            format!("decommission and re-add of broker {old} (slot {slot}) gave up after {took:.1} s: {why}")
        }
    }
}

fn gave_up(why: String, decommissioned: bool) -> Stop {
    Stop::GaveUp { why, decommissioned }
}

async fn steps(
    cluster: &Mutex<Cluster>,
    ops: &Ops,
    slot: u32,
    old: u32,
    rng: &mut StdRng,
    stop: &mut watch::Receiver<bool>,
) -> Result<(usize, u32), Stop> {
    let moved = drain(ops, old, rng, stop).await?;
    let deadline = Instant::now() + STEP_WAIT;
    loop {
        match ops.admin.decommission_broker(old).await {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => tracing::info!("decommission {old}: {e}"),
            Err(e) => return Err(gave_up(format!("decommission refused: {e}"), false)),
        }
        pause(stop).await?;
    }
    // Decommissioned: from here the operation finishes whatever the run
    // does, so that the final phase never meets a decommissioned broker
    // whose image has stopped. Its vote may still be needed to take it out
    // of the controller quorum: only then is it killed.
    let deadline = Instant::now() + STEP_WAIT;
    loop {
        match ops.admin.fresh_metadata().await {
            Ok(m) if !m.controller_voters.is_empty() && !m.controller_voters.contains(&old) => break,
            _ if Instant::now() > deadline => {
                tracing::warn!(
                    "broker {old} still in the controller quorum after {STEP_WAIT:?}: re-adding it anyway"
                );
                break;
            }
            _ => tokio::time::sleep(POLL).await,
        }
    }
    let addr = {
        let mut c = lock(cluster);
        c.rejoin_empty(slot).map_err(|e| gave_up(format!("restarting slot {slot} empty: {e:#}"), true))?;
        c.brokers[(slot - 1) as usize].client_addr().to_string()
    };
    tracing::info!("nemesis: slot {slot} (broker {old}, decommissioned) joins again empty");
    let deadline = Instant::now() + STEP_WAIT;
    loop {
        if let Ok(m) = ops.admin.fresh_metadata().await
            && let Some(b) =
                m.brokers.values().find(|b| b.address == addr && b.id != old && !b.decommissioned)
        {
            lock(cluster).set_broker_id(slot, b.id);
            return Ok((moved, b.id));
        }
        if Instant::now() > deadline {
            return Err(gave_up(format!("slot {slot} did not join again"), true));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Reassigns every partition that has a replica on `old` (the workload's
/// topic and any other) until none has; returns how many partitions it
/// asked to move.
async fn drain(
    ops: &Ops,
    old: u32,
    rng: &mut StdRng,
    stop: &mut watch::Receiver<bool>,
) -> Result<usize, Stop> {
    let deadline = Instant::now() + STEP_WAIT;
    let mut asked = std::collections::BTreeSet::new();
    loop {
        let m = match ops.admin.fresh_metadata().await {
            Ok(m) => m,
            Err(_) => {
                pause(stop).await?;
                continue;
            }
        };
        let others: Vec<u32> = m
            .brokers
            .values()
            .filter(|b| b.id != old && b.alive && !b.decommissioned)
            .map(|b| b.id)
            .collect();
        let mut held = 0;
        let mut moves = Vec::new();
        for t in m.topics.values() {
            for p in t.partitions.iter().filter(|p| p.replicas.contains(&old)) {
                held += 1;
                if p.reassigning {
                    // Finishing or being cancelled: looked at again next time.
                    continue;
                }
                let mut target: Vec<u32> = p.replicas.iter().copied().filter(|b| *b != old).collect();
                let mut spare: Vec<u32> = others.iter().copied().filter(|b| !target.contains(b)).collect();
                spare.shuffle(rng);
                let rf = t.replication_factor as usize;
                target.extend(spare.into_iter().take(rf.saturating_sub(target.len())));
                if target.len() < rf {
                    // Too few live brokers now (a kill): next time.
                    continue;
                }
                target.shuffle(rng);
                moves.push(ReassignmentRequest {
                    topic: t.name.clone(),
                    partition: p.partition,
                    replicas: Some(target),
                });
            }
        }
        if held == 0 {
            return Ok(asked.len());
        }
        if Instant::now() > deadline {
            return Err(gave_up(format!("broker {old} still holds {held} replicas"), false));
        }
        if !moves.is_empty() {
            asked.extend(moves.iter().map(|m| (m.topic.clone(), m.partition)));
            if let Err(e) = ops.admin.alter_partition_reassignments(&moves).await {
                tracing::info!("draining broker {old}: {e}");
            }
        }
        pause(stop).await?;
    }
}

/// Waits [`POLL`], or less if the run ends ([`Stop::RunOver`]).
async fn pause(stop: &mut watch::Receiver<bool>) -> Result<(), Stop> {
    tokio::select! {
        () = tokio::time::sleep(POLL) => Ok(()),
        _ = stop.wait_for(|s| *s) => Err(Stop::RunOver),
    }
}

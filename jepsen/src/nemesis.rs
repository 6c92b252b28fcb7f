//! The nemesis: faults on a seeded random schedule. It alternates a quiet
//! period and a fault period, each `interval` × U(0.5, 1.5); every fault is
//! healed at the end of its period and when the run stops.
//!
//! - `kill`: SIGKILL one broker (a quarter of the time a majority), restart it.
//! - `pause`: SIGSTOP one broker (or a majority), SIGCONT it.
//! - `partition`: cut broker-to-broker links: isolate one node, split into a
//!   majority and a minority, a bridge (two sides that share one node), a
//!   ring (each node sees only its neighbours; 4 nodes or more), or one way
//!   (one node's packets to the others are dropped while it still hears
//!   them, or the reverse).
//! - `netem`: delay and loss on every broker link (`tc netem` in
//!   namespaces, the proxy's [`crate::proxy::Slow`] otherwise).
//! - `membership`: operations that change who holds and leads a partition
//!   (issue 11): reassign a random partition of the workload's topic to a
//!   random set of brokers (in random order, so its preferred leader moves
//!   too), cancel a partition's move, hand a partition's leadership to a
//!   random replica, or change the controller quorum (remove a random
//!   voter while more than 3 vote, else add a broker that does not vote;
//!   KIP-853); or, when the cluster has a broker to spare, decommission a
//!   random broker and add its machine back empty under a new id
//!   ([`crate::rejoin`], one at a time, in the background). Nothing is
//!   undone at the end of the period: moves and quorum changes run on
//!   through later faults (a refused request, e.g. a partition already
//!   moving or a quorum change without a live majority, is recorded in the
//!   fault's detail).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::bail;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::cluster::Cluster;
use crate::history::Recorder;
use crate::network::Network;

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fault {
    /// SIGKILL and restart.
    Kill,
    /// SIGSTOP and SIGCONT.
    Pause,
    /// Network partitions between brokers.
    Partition,
    /// Packet delay and loss.
    Netem,
    /// Reassignments, cancels and leadership transfers.
    Membership,
    /// Power loss: SIGKILL, then the broker's in-memory disk loses what
    /// no fsync covered (the run mounts those disks, see
    /// [`crate::cluster::Cluster::use_memory_disks`]); one broker, a
    /// majority or all of them; restart at the end.
    Power,
}

impl Fault {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Pause => "pause",
            Fault::Partition => "partition",
            Fault::Netem => "netem",
            Fault::Membership => "membership",
            Fault::Power => "power",
        }
    }
}

/// Parses `kill,partition`, `mixed` (kill, pause, partition, netem) or `none`.
///
/// # Errors
/// An unknown name.
pub fn parse_faults(s: &str) -> anyhow::Result<Vec<Fault>> {
    let mut out = BTreeSet::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part {
            "kill" => out.insert(Fault::Kill),
            "pause" => out.insert(Fault::Pause),
            "partition" => out.insert(Fault::Partition),
            "netem" => out.insert(Fault::Netem),
            "membership" => out.insert(Fault::Membership),
            "power" => out.insert(Fault::Power),
            "mixed" | "all" => {
                out.extend([Fault::Kill, Fault::Pause, Fault::Partition, Fault::Netem]);
                true
            }
            "none" => true,
            other => {
                bail!(
                    "unknown fault {other:?} (kill, power, pause, partition, netem, membership, mixed, none)"
                )
            }
        };
    }
    Ok(out.into_iter().collect())
}

/// One fault as it happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultEvent {
    /// Its kind.
    pub fault: Fault,
    /// What exactly, e.g. `kill [2]` or `partition majority/minority [[1, 3], [2]]`.
    pub detail: String,
    /// Start, s since the start of the run.
    pub start_s: f64,
    /// End (healed), s since the start of the run.
    pub end_s: f64,
}

/// A partition: `(name, components, cuts)`, where a cut `(a, b)` drops
/// what broker `a` sends to broker `b`.
pub fn grudge(ids: &[u32], rng: &mut StdRng) -> (String, Vec<Vec<u32>>, Vec<(u32, u32)>) {
    let mut nodes = ids.to_vec();
    nodes.shuffle(rng);
    let n = nodes.len();
    let mut kinds = vec!["isolate", "majority-minority", "bridge", "one-way-out", "one-way-in"];
    if n >= 4 {
        kinds.push("ring");
    }
    let kind = kinds[rng.gen_range(0..kinds.len())];
    let one_way = |from: &[u32], to: &[u32]| -> Vec<(u32, u32)> {
        from.iter().flat_map(|x| to.iter().map(move |y| (*x, *y))).collect()
    };
    let both_ways = |a: &[u32], b: &[u32]| -> Vec<(u32, u32)> {
        let mut cuts = one_way(a, b);
        cuts.extend(one_way(b, a));
        cuts
    };
    let (one, rest) = nodes.split_at(1);
    match kind {
        "isolate" => ("isolate".into(), vec![one.to_vec(), rest.to_vec()], both_ways(one, rest)),
        "one-way-out" => ("one-way-out".into(), vec![one.to_vec(), rest.to_vec()], one_way(one, rest)),
        "one-way-in" => ("one-way-in".into(), vec![one.to_vec(), rest.to_vec()], one_way(rest, one)),
        "majority-minority" => {
            let (minority, majority) = nodes.split_at(n / 2);
            (
                "majority-minority".into(),
                vec![majority.to_vec(), minority.to_vec()],
                both_ways(minority, majority),
            )
        }
        "bridge" => {
            // nodes[0] sees both sides; the sides do not see each other.
            let (a, b) = rest.split_at(rest.len() / 2);
            let mut left = vec![nodes[0]];
            left.extend_from_slice(a);
            let mut right = vec![nodes[0]];
            right.extend_from_slice(b);
            ("bridge".into(), vec![left, right], both_ways(a, b))
        }
        _ => {
            let mut cuts = Vec::new();
            for i in 0..n {
                for j in i + 1..n {
                    let adjacent = j == i + 1 || (i == 0 && j == n - 1);
                    if !adjacent {
                        cuts.extend([(nodes[i], nodes[j]), (nodes[j], nodes[i])]);
                    }
                }
            }
            ("ring".into(), vec![nodes.clone()], cuts)
        }
    }
}

/// A fault in force.
enum Active {
    Killed(Vec<u32>),
    Paused(Vec<u32>),
    Cut,
    Netem,
    Nothing,
}

/// Picks 1 broker, or a majority a quarter of the time.
fn targets(ids: &[u32], rng: &mut StdRng) -> Vec<u32> {
    let mut nodes = ids.to_vec();
    nodes.shuffle(rng);
    let k = if rng.gen_bool(0.25) { ids.len() / 2 + 1 } else { 1 };
    let mut t = nodes[..k].to_vec();
    t.sort_unstable();
    t
}

/// The shared handles the nemesis works on.
#[derive(Clone)]
pub struct Targets {
    /// The brokers.
    pub cluster: Arc<Mutex<Cluster>>,
    /// Their network.
    pub net: Arc<Mutex<Network>>,
    /// For the `membership` fault: the workload's topic and an admin client.
    pub ops: Option<Ops>,
    /// The decommission and re-add under way, if any: when it began (s
    /// into the run) and its task, which returns what happened.
    pub rejoin: Arc<Mutex<Option<Rejoining>>>,
}

/// A decommission and re-add under way: when it began (s into the run)
/// and its task, which returns what happened.
pub type Rejoining = (f64, tokio::task::JoinHandle<String>);

/// Chance that a `membership` fault decommissions and re-adds a broker,
/// when none is under way and a broker can be spared.
const REJOIN_CHANCE: f64 = 0.35;

/// What the `membership` fault works on.
#[derive(Clone)]
pub struct Ops {
    /// An admin client of the cluster.
    pub admin: ferrolog_client::Admin,
    /// The workload's topic.
    pub topic: String,
    /// Its partition count.
    pub partitions: u32,
    /// Its replication factor.
    pub replication_factor: u32,
}

impl Ops {
    /// One random operation; returns what it did (or what refused it).
    async fn act(&self, ids: &[u32], rng: &mut StdRng) -> String {
        use ferrolog_client::admin::ReassignmentRequest;
        let partition = rng.gen_range(0..self.partitions.max(1));
        let name = format!("{}-{partition}", self.topic);
        let roll: f64 = rng.r#gen();
        if roll < 0.5 {
            let mut to = ids.to_vec();
            to.shuffle(rng);
            to.truncate(self.replication_factor as usize);
            let change =
                ReassignmentRequest { topic: self.topic.clone(), partition, replicas: Some(to.clone()) };
            match self.admin.alter_partition_reassignments(&[change]).await {
                Ok(r) => match r.into_iter().next() {
                    Some(Ok(())) => format!("reassign {name} to {to:?}"),
                    Some(Err(e)) => format!("reassign {name} to {to:?} refused: {e}"),
                    None => format!("reassign {name}: no answer"),
                },
                Err(e) => format!("reassign {name} failed: {e}"),
            }
        } else if roll < 0.85 {
            self.change_quorum(ids, rng).await
        } else if roll < 0.92 {
            let change = ReassignmentRequest { topic: self.topic.clone(), partition, replicas: None };
            match self.admin.alter_partition_reassignments(&[change]).await {
                Ok(r) => match r.into_iter().next() {
                    Some(Ok(())) => format!("cancel the move of {name}"),
                    Some(Err(e)) => format!("cancel {name} refused: {e}"),
                    None => format!("cancel {name}: no answer"),
                },
                Err(e) => format!("cancel {name} failed: {e}"),
            }
        } else {
            let to = ids[rng.gen_range(0..ids.len())];
            match self.admin.transfer_leader(&self.topic, partition, Some(to)).await {
                Ok((leader, term)) => {
                    format!("transfer-leader {name} to {to}: broker {leader} leads, term {term}")
                }
                Err(e) => format!("transfer-leader {name} to {to} refused: {e}"),
            }
        }
    }
}

impl Ops {
    /// Removes a random controller voter while more than 3 vote, else adds
    /// a random broker that does not vote.
    async fn change_quorum(&self, ids: &[u32], rng: &mut StdRng) -> String {
        let voters = match self.admin.fresh_metadata().await {
            Ok(m) => m.controller_voters.clone(),
            Err(e) => return format!("controller quorum change: no metadata: {e}"),
        };
        let others: Vec<u32> = ids.iter().copied().filter(|b| !voters.contains(b)).collect();
        if others.is_empty() && voters.len() <= 3 {
            return format!("controller quorum change: none to make (voters {voters:?})");
        }
        if voters.len() > 3 && (others.is_empty() || rng.gen_bool(0.5)) {
            let v: Vec<u32> = voters.to_vec();
            let Some(id) = v.choose(rng).copied() else {
                return "controller quorum change: no voters known".into();
            };
            match self.admin.remove_raft_voter(id).await {
                Ok(()) => format!("controller remove {id} (voters were {v:?})"),
                Err(e) => format!("controller remove {id} refused: {e}"),
            }
        } else {
            let id = others[rng.gen_range(0..others.len())];
            match self.admin.add_raft_voter(id).await {
                Ok(()) => format!("controller add {id} (voters were {voters:?})"),
                Err(e) => format!("controller add {id} refused: {e}"),
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Targets {
    async fn start(
        &self,
        fault: Fault,
        rng: &mut StdRng,
        now_s: f64,
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<(String, Active)> {
        let ids = lock(&self.cluster).ids();
        match fault {
            Fault::Membership => {
                let Some(ops) = &self.ops else { bail!("the membership fault needs the workload's topic") };
                if let Some(started) = self.start_rejoin(ops, rng, now_s, stop) {
                    return Ok((started, Active::Nothing));
                }
                let brokers = lock(&self.cluster).broker_ids();
                Ok((ops.act(&brokers, rng).await, Active::Nothing))
            }
            Fault::Kill => {
                let t = targets(&ids, rng);
                let mut c = lock(&self.cluster);
                for id in &t {
                    c.kill(*id);
                }
                Ok((format!("kill {t:?}"), Active::Killed(t)))
            }
            Fault::Power => {
                // One broker, a majority, or the whole cluster at once.
                let mut t = ids.clone();
                t.shuffle(rng);
                let k = match rng.gen_range(0..3) {
                    0 => 1,
                    1 => ids.len() / 2 + 1,
                    _ => ids.len(),
                };
                t.truncate(k);
                t.sort_unstable();
                lock(&self.cluster).power_cut(&t)?;
                Ok((format!("power {t:?}"), Active::Killed(t)))
            }
            Fault::Pause => {
                let t = targets(&ids, rng);
                let mut c = lock(&self.cluster);
                for id in &t {
                    c.pause(*id);
                }
                Ok((format!("pause {t:?}"), Active::Paused(t)))
            }
            Fault::Partition => {
                let (name, components, cuts) = grudge(&ids, rng);
                let mut net = lock(&self.net);
                for (from, to) in &cuts {
                    net.cut(*from, *to)?;
                }
                Ok((format!("partition {name} {components:?}"), Active::Cut))
            }
            Fault::Netem => {
                let done = lock(&self.net).slow()?;
                Ok((format!("netem {done}"), Active::Netem))
            }
        }
    }

    /// Starts a decommission and re-add ([`crate::rejoin`]) by chance,
    /// if none is under way and the others can hold every replica; returns
    /// the fault's detail then.
    fn start_rejoin(
        &self,
        ops: &Ops,
        rng: &mut StdRng,
        now_s: f64,
        stop: &watch::Receiver<bool>,
    ) -> Option<String> {
        let mut rejoin = lock(&self.rejoin);
        if rejoin.is_some() || !rng.gen_bool(REJOIN_CHANCE) {
            return None;
        }
        let slots = lock(&self.cluster).ids();
        if slots.len() <= ops.replication_factor as usize {
            return None;
        }
        let slot = slots[rng.gen_range(0..slots.len())];
        let old = lock(&self.cluster).brokers[(slot - 1) as usize].broker_id;
        let task = tokio::spawn(crate::rejoin::decommission_and_rejoin(
            self.cluster.clone(),
            ops.clone(),
            slot,
            old,
            StdRng::seed_from_u64(rng.r#gen()),
            stop.clone(),
        ));
        *rejoin = Some((now_s, task));
        Some(format!("decommission broker {old} (slot {slot}) and re-add the slot empty: started"))
    }

    /// The decommission and re-add's outcome as a fault event, once it
    /// has finished (or, with `wait`, once it finishes: it stops soon
    /// after the run does).
    async fn rejoin_done(&self, wait: bool, now_s: impl Fn() -> f64) -> Option<FaultEvent> {
        let (start_s, task) = {
            let mut rejoin = lock(&self.rejoin);
            if !wait && !rejoin.as_ref().is_some_and(|(_, task)| task.is_finished()) {
                return None;
            }
            rejoin.take()?
        };
        let detail = task.await.unwrap_or_else(|e| format!("decommission and re-add task failed: {e}"));
        tracing::info!("nemesis: {detail}");
        Some(FaultEvent { fault: Fault::Membership, detail, start_s, end_s: now_s() })
    }

    fn end(&self, active: Active) -> anyhow::Result<()> {
        match active {
            Active::Killed(ids) => {
                let mut c = lock(&self.cluster);
                for id in ids {
                    c.spawn(id)?;
                }
            }
            Active::Paused(ids) => {
                let mut c = lock(&self.cluster);
                for id in ids {
                    c.resume(id);
                }
            }
            Active::Cut => lock(&self.net).heal()?,
            Active::Netem => lock(&self.net).clear_slow(),
            Active::Nothing => {}
        }
        Ok(())
    }

    /// Heals everything: links, netem, paused and dead brokers.
    ///
    /// # Errors
    /// A broker that cannot be restarted, or a route that cannot be removed.
    pub fn heal_all(&self) -> anyhow::Result<()> {
        {
            let mut net = lock(&self.net);
            net.heal()?;
            net.clear_slow();
        }
        let mut c = lock(&self.cluster);
        for id in c.ids() {
            c.resume(id);
            if !c.is_running(id) {
                c.spawn(id)?;
            }
        }
        Ok(())
    }
}

/// Runs faults from `faults` until `stop` turns true; returns what happened.
pub async fn run(
    faults: Vec<Fault>,
    interval: Duration,
    seed: u64,
    targets: Targets,
    rec: Recorder,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<Vec<FaultEvent>> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6e656d);
    let mut events = Vec::new();
    if faults.is_empty() {
        let _ = stop.wait_for(|s| *s).await;
        return Ok(events);
    }
    let now_s = |rec: &Recorder| rec.now_ns() as f64 / 1e9;
    loop {
        let quiet = interval.mul_f64(rng.gen_range(0.5..1.5));
        tokio::select! {
            _ = tokio::time::sleep(quiet) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let fault = faults[rng.gen_range(0..faults.len())];
        let start_s = now_s(&rec);
        let (detail, active) = targets.start(fault, &mut rng, start_s, &stop).await?;
        tracing::info!("nemesis: {detail}");
        let hold = interval.mul_f64(rng.gen_range(0.5..1.5));
        let stopped = tokio::select! {
            _ = tokio::time::sleep(hold) => false,
            _ = stop.wait_for(|s| *s) => true,
        };
        targets.end(active)?;
        events.push(FaultEvent { fault, detail, start_s, end_s: now_s(&rec) });
        events.extend(targets.rejoin_done(false, || now_s(&rec)).await);
        if stopped {
            break;
        }
    }
    events.extend(targets.rejoin_done(true, || now_s(&rec)).await);
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grudges_cut_only_across_components() {
        let mut rng = StdRng::seed_from_u64(1);
        for n in [3u32, 5] {
            let ids: Vec<u32> = (1..=n).collect();
            let mut kinds = BTreeSet::new();
            for _ in 0..300 {
                let (kind, components, cuts) = grudge(&ids, &mut rng);
                assert!(!cuts.is_empty(), "{kind} {components:?}");
                let directed: BTreeSet<_> = cuts.iter().copied().collect();
                for (a, b) in &cuts {
                    assert_ne!(a, b);
                    // Never a cut inside one component (the ring is one component of neighbours).
                    if kind != "ring" {
                        assert!(
                            !components.iter().any(|c| c.contains(a) && c.contains(b)),
                            "{kind} {components:?} {cuts:?}"
                        );
                    }
                    // Symmetric kinds cut both directions; one-way kinds exactly one.
                    assert_eq!(directed.contains(&(*b, *a)), !kind.starts_with("one-way"), "{kind} {cuts:?}");
                }
                kinds.insert(kind);
            }
            assert_eq!(kinds.len(), if n >= 4 { 6 } else { 5 }, "{kinds:?}");
        }
    }

    #[test]
    fn fault_lists() -> anyhow::Result<()> {
        assert_eq!(parse_faults("kill,partition")?, vec![Fault::Kill, Fault::Partition]);
        assert_eq!(parse_faults("power,partition")?, vec![Fault::Partition, Fault::Power]);
        assert!(!parse_faults("mixed")?.contains(&Fault::Power), "mixed runs on real disks");
        assert_eq!(
            parse_faults("membership,kill,partition")?,
            vec![Fault::Kill, Fault::Partition, Fault::Membership]
        );
        assert_eq!(parse_faults("mixed")?.len(), 4);
        assert!(parse_faults("none")?.is_empty());
        assert!(parse_faults("flood").is_err());
        Ok(())
    }
}

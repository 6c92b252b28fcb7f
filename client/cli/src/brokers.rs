//! `ferrolog broker list|decommission` and `ferrolog cluster rebalance`:
//! spreading replicas and preferred leaders evenly over the brokers, and
//! draining a broker before retiring it, as reassignments
//! (`ferrolog_client::rebalance` plans them).

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use ferrolog_client::Admin;
use ferrolog_client::admin::{AwaitedMove, ReassignmentRequest, move_done};
use ferrolog_client::metadata::ClusterMeta;
use ferrolog_client::rebalance::{self, Placement};

use crate::table;

/// Broker commands.
#[derive(Subcommand, Debug)]
pub enum BrokerCommand {
    /// Every broker with its state (alive, down, decommissioned), whether it
    /// is in the controller quorum, and its replica and preferred-leader
    /// counts.
    List,
    /// Move every replica off a broker (reassignments, as `cluster
    /// rebalance` plans them with this broker drained), wait for the moves,
    /// then retire it: it is never placed on again and leaves the
    /// controller quorum (a joint-consensus change of the metadata group).
    /// Stop its process afterwards.
    Decommission {
        /// The broker to retire.
        id: u32,
        /// Longest wait for the moves, seconds.
        #[arg(long, default_value_t = 3600, value_name = "SECONDS")]
        wait: u64,
    },
}

/// Arguments of `ferrolog cluster rebalance`.
#[derive(clap::Args, Debug)]
pub struct RebalanceArgs {
    /// Carry the plan out (reassign the partitions); without it, only print
    /// the plan (as a `partition reassign --plan` file on stdout).
    #[arg(long)]
    execute: bool,
    /// With --execute: wait until every move completed, at most this many
    /// seconds.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "3600")]
    wait: Option<u64>,
}

/// Fresh metadata with no reassignment under way, waiting up to 10 s for
/// moves to finish (or for the answering broker to learn that they did:
/// brokers apply the controller's records each at its own pace).
async fn settled_metadata(admin: &Admin) -> anyhow::Result<std::sync::Arc<ClusterMeta>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let cluster = admin.fresh_metadata().await.context("reading metadata")?;
        let moving = cluster.topics.values().any(|t| t.partitions.iter().any(|p| p.is_reassigning()));
        if !moving || tokio::time::Instant::now() >= deadline {
            return Ok(cluster);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every partition's placement, and the brokers that may take replicas
/// (registered, alive, not decommissioned: a move to a broker that is down
/// would wait for it).
fn placements(cluster: &ClusterMeta) -> anyhow::Result<(Vec<Placement>, BTreeSet<u32>)> {
    let mut out = Vec::new();
    for t in cluster.topics.values() {
        for p in &t.partitions {
            anyhow::ensure!(
                !p.is_reassigning(),
                "{}-{} is being reassigned: wait for it (or cancel it) first",
                t.name,
                p.partition
            );
            out.push(Placement {
                topic: t.name.clone(),
                partition: p.partition,
                replicas: p.replicas.clone(),
            });
        }
    }
    let brokers = cluster.brokers.values().filter(|b| !b.decommissioned && b.alive).map(|b| b.id).collect();
    Ok((out, brokers))
}

/// Starts the reassignments of `changes`; fails if any is refused.
async fn execute(admin: &Admin, changes: &[Placement]) -> anyhow::Result<Vec<AwaitedMove>> {
    let requests: Vec<ReassignmentRequest> = changes
        .iter()
        .map(|c| ReassignmentRequest {
            topic: c.topic.clone(),
            partition: c.partition,
            replicas: Some(c.replicas.clone()),
        })
        .collect();
    let results = admin.alter_partition_reassignments(&requests).await.context("reassigning")?;
    let mut refused = 0;
    for (c, r) in changes.iter().zip(results) {
        if let Err(e) = r {
            eprintln!("{}-{}: refused: {e}", c.topic, c.partition);
            refused += 1;
        }
    }
    anyhow::ensure!(refused == 0, "{refused} of {} reassignments refused", changes.len());
    Ok(changes.iter().map(|c| (c.topic.clone(), c.partition, Some(c.replicas.clone()))).collect())
}

/// Waits for `moving` to complete, printing how many still move.
async fn wait(admin: &Admin, moving: &[AwaitedMove], secs: u64) -> anyhow::Result<()> {
    let mut last = usize::MAX;
    admin
        .wait_for_reassignments(moving, Duration::from_secs(secs), |cluster| {
            let left = moving.iter().filter(|m| !move_done(cluster, m)).count();
            if left != last {
                eprintln!("moving: {left} of {} partitions", moving.len());
                last = left;
            }
        })
        .await
        .context("waiting for the moves")
}

/// The plan as Kafka's reassignment JSON.
fn plan_json(changes: &[Placement]) -> String {
    let partitions: Vec<serde_json::Value> = changes
        .iter()
        .map(|c| serde_json::json!({"topic": c.topic, "partition": c.partition, "replicas": c.replicas}))
        .collect();
    serde_json::json!({"version": 1, "partitions": partitions}).to_string()
}

/// Runs `ferrolog cluster rebalance`.
pub async fn rebalance(admin: &Admin, args: RebalanceArgs) -> anyhow::Result<()> {
    let cluster = settled_metadata(admin).await?;
    let (current, brokers) = placements(&cluster)?;
    let changes = rebalance::plan(&current, &brokers, &BTreeSet::new()).map_err(anyhow::Error::msg)?;
    let before = rebalance::counts(&current, &brokers);
    let mut after_placements = current.clone();
    for c in &changes {
        if let Some(p) =
            after_placements.iter_mut().find(|p| p.topic == c.topic && p.partition == c.partition)
        {
            p.replicas = c.replicas.clone();
        }
    }
    let after = rebalance::counts(&after_placements, &brokers);
    let rows: Vec<Vec<String>> = brokers
        .iter()
        .map(|b| {
            let (r0, l0) = before.get(b).copied().unwrap_or_default();
            let (r1, l1) = after.get(b).copied().unwrap_or_default();
            vec![b.to_string(), format!("{r0} -> {r1}"), format!("{l0} -> {l1}")]
        })
        .collect();
    eprint!("{}", table::render(&["BROKER", "REPLICAS", "PREFERRED LEADERS"], &rows));
    if changes.is_empty() {
        eprintln!("balanced already: nothing to move");
        return Ok(());
    }
    if !args.execute {
        eprintln!(
            "{} partitions would change (dry run; --execute to apply, or pass this plan to `partition reassign --plan`):",
            changes.len()
        );
        println!("{}", plan_json(&changes));
        return Ok(());
    }
    let moving = execute(admin, &changes).await?;
    println!("reassigning {} partitions", moving.len());
    if let Some(secs) = args.wait {
        wait(admin, &moving, secs).await?;
        let moved = elect_preferred_leaders(admin).await?;
        println!(
            "done: replicas and preferred leaders are spread evenly; {moved} leaderships moved to preferred replicas"
        );
    }
    Ok(())
}

/// Hands every partition's leadership to its preferred replica where
/// another leads (Kafka's preferred leader election, KIP-460), as the
/// brokers' own balancing would at its next check; returns how many moved.
/// A preferred replica that cannot lead now (behind, or down) is reported
/// and skipped.
async fn elect_preferred_leaders(admin: &Admin) -> anyhow::Result<usize> {
    let cluster = admin.fresh_metadata().await.context("reading metadata")?;
    let mut moved = 0;
    for t in cluster.topics.values() {
        for p in &t.partitions {
            let Some(preferred) = p.replicas.first().copied() else { continue };
            if p.leader == preferred || p.is_reassigning() {
                continue;
            }
            match admin.transfer_leader(&t.name, p.partition, None).await {
                Ok(_) => moved += 1,
                Err(e) if e.code() == Some(ferrolog_client::error::ErrorCode::ElectionNotNeeded) => {}
                Err(e) => {
                    eprintln!("{}-{}: preferred leader {preferred} not elected: {e}", t.name, p.partition)
                }
            }
        }
    }
    Ok(moved)
}

/// Runs a broker command.
pub async fn broker(admin: &Admin, command: BrokerCommand) -> anyhow::Result<()> {
    match command {
        BrokerCommand::List => {
            let cluster = admin.fresh_metadata().await.context("reading metadata")?;
            let all: BTreeSet<u32> = cluster.brokers.keys().copied().collect();
            let current = placements_any(&cluster);
            let counts = rebalance::counts(&current, &all);
            let rows: Vec<Vec<String>> = cluster
                .brokers
                .values()
                .map(|b| {
                    let state = match (b.decommissioned, b.alive) {
                        (true, _) => "decommissioned",
                        (false, true) => "alive",
                        (false, false) => "DOWN",
                    };
                    let (replicas, leaders) = counts.get(&b.id).copied().unwrap_or_default();
                    vec![
                        b.id.to_string(),
                        b.address.clone(),
                        state.to_owned(),
                        if cluster.controller_voters.contains(&b.id) { "voter" } else { "-" }.to_owned(),
                        replicas.to_string(),
                        leaders.to_string(),
                    ]
                })
                .collect();
            print!(
                "{}",
                table::render(
                    &["BROKER", "ADDRESS", "STATE", "CONTROLLER QUORUM", "REPLICAS", "PREFERRED LEADERS"],
                    &rows
                )
            );
            Ok(())
        }
        BrokerCommand::Decommission { id, wait: secs } => {
            let cluster = settled_metadata(admin).await?;
            anyhow::ensure!(cluster.brokers.contains_key(&id), "broker {id} is not registered");
            let (current, brokers) = placements(&cluster)?;
            let changes = rebalance::plan(&current, &brokers, &[id].into()).map_err(anyhow::Error::msg)?;
            if !changes.is_empty() {
                let moving = execute(admin, &changes).await?;
                println!("moving {} partitions off broker {id}", moving.len());
                wait(admin, &moving, secs).await?;
            }
            admin.decommission_broker(id).await.with_context(|| format!("decommissioning broker {id}"))?;
            // The joint-consensus change that takes it out of the controller
            // quorum may still need its vote: not "stop it" before that.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            loop {
                let cluster = admin.fresh_metadata().await.context("reading metadata")?;
                let voters = &cluster.controller_voters;
                if !voters.is_empty() && !voters.contains(&id) {
                    if voters.len() < 3 {
                        eprintln!(
                            "warning: the controller quorum is brokers {voters:?}: it survives no broker's failure"
                        );
                    }
                    break;
                }
                anyhow::ensure!(
                    tokio::time::Instant::now() < deadline,
                    "broker {id} is decommissioned but still in the controller quorum {voters:?} after 60 s; keep it \
                     running and check `ferrolog cluster status`"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            println!(
                "broker {id} holds no replica, is decommissioned and out of the controller quorum: stop its process"
            );
            Ok(())
        }
    }
}

/// Every partition's placement, reassigning or not (for counting).
fn placements_any(cluster: &ClusterMeta) -> Vec<Placement> {
    cluster
        .topics
        .values()
        .flat_map(|t| {
            t.partitions.iter().map(|p| Placement {
                topic: t.name.clone(),
                partition: p.partition,
                replicas: p.replicas.clone(),
            })
        })
        .collect()
}

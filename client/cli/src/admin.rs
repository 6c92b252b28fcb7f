//! `ferrolog topic ...`, `ferrolog partition ...` and `ferrolog cluster status`.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use ferrolog_client::Admin;
use ferrolog_client::admin::{ClusterStatus, ReplicaHealth};
use ferrolog_client::error::ErrorCode;

use crate::table;

/// Topic commands.
#[derive(Subcommand, Debug)]
pub enum TopicCommand {
    /// Create a topic and wait until every partition has a leader.
    ///
    /// While the cluster has enough brokers but too few have registered (it
    /// has just started) or answer, waits for them, saying so on stderr,
    /// for up to --timeout; then fails with the controller's last reason.
    Create {
        /// Topic name.
        name: String,
        /// Number of partitions.
        #[arg(long, default_value_t = 3)]
        partitions: u32,
        /// Replicas per partition.
        #[arg(long, default_value_t = 3)]
        replication_factor: u32,
        /// Seconds to wait for a controller and for enough brokers to
        /// register and answer; then as long again, at most, for every
        /// partition to have a leader.
        #[arg(long, default_value_t = 30, value_name = "SECONDS")]
        timeout: u64,
        /// A configuration override, Kafka's topic-level key and value
        /// (`--config retention.ms=3600000`); repeat for more. Every other
        /// key takes the broker default (`ferrolog topic describe` lists them).
        #[arg(long = "config", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        config: Vec<(String, String)>,
    },
    /// List topics.
    List,
    /// Show a topic's partitions with their leader and replicas, and its
    /// configuration: every key's value and where it comes from (topic,
    /// broker config, built-in default).
    Describe {
        /// Topic name.
        name: String,
    },
    /// Change a topic: its configuration overrides (Kafka's
    /// IncrementalAlterConfigs), and/or its partition count (Kafka's
    /// CreatePartitions). A record's key picks its partition by hash modulo
    /// the partition count, so records with a key may go to another
    /// partition after more are added: per-key order holds only from the
    /// change on.
    #[command(arg_required_else_help = true)]
    Alter {
        /// Topic name.
        name: String,
        /// The new partition count (more than the topic has).
        #[arg(long)]
        partitions: Option<u32>,
        /// Set a configuration key (`--config retention.ms=3600000`); repeat for more.
        #[arg(long = "config", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        /// Drop a configuration override: the key takes the broker default again.
        #[arg(long = "delete-config", value_name = "KEY")]
        delete_config: Vec<String>,
    },
    /// Delete a topic and its data.
    Delete {
        /// Topic name.
        name: String,
    },
}

/// Cluster commands.
#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Plan reassignments that spread replicas and preferred leaders
    /// evenly over the brokers (each within one of the others), moving as
    /// few replicas as it can; with --execute, carry them out. For a broker
    /// just added, or after brokers were down when topics were created.
    Rebalance(crate::brokers::RebalanceArgs),
    /// Brokers, controller, readiness (every broker of the cluster
    /// registered and alive), and each partition's leader, term, replicas,
    /// commit index, high watermark and follower lag.
    Status,
}

/// Partition commands.
#[derive(Subcommand, Debug)]
pub enum PartitionCommand {
    /// Hand a partition's leadership to another of its replicas (the
    /// preferred one, its first replica, unless --to says otherwise), as a
    /// Raft leadership transfer: the leader stops taking writes, the chosen
    /// replica catches up and is elected at once, with no election timeout.
    /// Refused if that replica's broker is down or shutting down, or its
    /// log stays behind.
    TransferLeader {
        /// Topic name.
        topic: String,
        /// Partition number.
        partition: u32,
        /// The broker whose replica is to lead (default: the preferred replica's).
        #[arg(long, value_name = "BROKER")]
        to: Option<u32>,
    },
    /// Move a partition's replicas to other brokers, or cancel such a move
    /// (Kafka's partition reassignment, KIP-455).
    ///
    /// The new replicas join as Raft learners and copy the log while the
    /// partition keeps taking writes; once they have caught up, one
    /// joint-consensus change makes the target replicas the voters (a
    /// leader that is being removed first hands its leadership to a replica
    /// that stays); then the replicas left out delete their data. The
    /// controller records every step, so a move survives any broker's
    /// restart and a change of controller. --cancel goes back to the
    /// replicas the move started from, losing nothing.
    ///
    /// With --plan, many partitions at once from a JSON file in Kafka's
    /// reassignment format: {"version":1,"partitions":[{"topic":"t",
    /// "partition":0,"replicas":[2,3,4]}]} (with --cancel, the replicas are
    /// ignored). Prints each partition's result; exits non-zero if any was
    /// refused. With --wait, then waits until every move has completed,
    /// printing progress.
    Reassign(crate::reassign::ReassignArgs),
    /// Show one partition: leader, term, replicas, each replica's lag, and
    /// any reassignment under way with its phase.
    Describe {
        /// Topic name.
        topic: String,
        /// Partition number.
        partition: u32,
    },
}

/// Runs a partition command.
pub async fn partition(bootstrap: &str, command: PartitionCommand) -> anyhow::Result<()> {
    let admin = Admin::new(crate::connect(bootstrap)?).with_timeout(ADMIN_TIMEOUT);
    match command {
        PartitionCommand::TransferLeader { topic, partition, to } => {
            match admin.transfer_leader(&topic, partition, to).await {
                Ok((leader, term)) => {
                    println!("{topic}-{partition}: broker {leader} leads now (term {term})");
                    Ok(())
                }
                Err(e) if e.code() == Some(ErrorCode::ElectionNotNeeded) => {
                    println!("{topic}-{partition}: nothing to do: {e}");
                    Ok(())
                }
                Err(e) => Err(e).context(format!("transferring the leadership of {topic}-{partition}")),
            }
        }
        PartitionCommand::Reassign(args) => crate::reassign::reassign(&admin, args).await,
        PartitionCommand::Describe { topic, partition } => {
            crate::reassign::describe(&admin, &topic, partition).await
        }
    }
}

/// How long admin calls retry transient errors (a leader election takes
/// about a second; an unreachable cluster should not keep the user waiting).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs a topic command.
pub async fn topic(bootstrap: &str, command: TopicCommand) -> anyhow::Result<()> {
    let admin = Admin::new(crate::connect(bootstrap)?).with_timeout(ADMIN_TIMEOUT);
    match command {
        TopicCommand::Create { name, partitions, replication_factor, timeout, config } => {
            let config: BTreeMap<String, String> = config.into_iter().collect();
            let timeout = Duration::from_secs(timeout);
            let mut last_reason = String::new();
            let report = |e: &ferrolog_client::Error| {
                // Say what is awaited, once per distinct reason.
                let reason = e.to_string();
                if reason != last_reason {
                    eprintln!("waiting: {reason}");
                    last_reason = reason;
                }
            };
            let created = admin
                .clone()
                .with_timeout(timeout)
                .create_topic_with_config(&name, partitions, replication_factor, &config, report)
                .await;
            match created {
                Err(e) if e.code() == Some(ErrorCode::TopicAlreadyExists) => {
                    anyhow::bail!("topic {name:?} already exists")
                }
                Err(e @ ferrolog_client::Error::Deadline { .. }) => {
                    return Err(anyhow::Error::new(e)).with_context(|| {
                        format!(
                            "creating topic {name:?}: the cluster could not place it within --timeout {} s",
                            timeout.as_secs()
                        )
                    });
                }
                other => other.with_context(|| format!("creating topic {name:?}"))?,
            }
            admin.wait_for_leaders(&name, timeout).await.with_context(|| {
                format!("topic {name:?} was created, but not every partition has a leader yet")
            })?;
            println!(
                "created topic {name}: {partitions} partitions, replication factor {replication_factor}"
            );
        }
        TopicCommand::List => {
            let topics = admin.list_topics().await.context("listing topics")?;
            let rows: Vec<Vec<String>> = topics
                .iter()
                .map(|t| {
                    vec![
                        t.name.clone(),
                        topic_id_text(t.topic_id),
                        t.partition_count().to_string(),
                        t.replication_factor.to_string(),
                    ]
                })
                .collect();
            print!("{}", table::render(&["TOPIC", "TOPIC ID", "PARTITIONS", "REPLICATION"], &rows));
        }
        TopicCommand::Describe { name } => {
            let (t, cluster) =
                admin.describe_topic(&name).await.with_context(|| format!("describing {name:?}"))?;
            println!(
                "topic {}: {} partitions, replication factor {}, id {}",
                t.name,
                t.partition_count(),
                t.replication_factor,
                topic_id_text(t.topic_id)
            );
            let rows: Vec<Vec<String>> = t
                .partitions
                .iter()
                .map(|p| {
                    let leader = match (p.leader, cluster.brokers.get(&p.leader)) {
                        (0, _) => "none".to_owned(),
                        (id, Some(b)) => format!("{id} ({})", b.address),
                        (id, None) => id.to_string(),
                    };
                    vec![p.partition.to_string(), leader, join(&p.replicas), p.group_id.to_string()]
                })
                .collect();
            print!("{}", table::render(&["PARTITION", "LEADER", "REPLICAS", "RAFT GROUP"], &rows));
            let entries = admin
                .describe_topic_config(&name)
                .await
                .with_context(|| format!("describing the configuration of {name:?}"))?;
            let rows: Vec<Vec<String>> = entries
                .iter()
                .map(|e| vec![e.name.clone(), e.value.clone(), source_name(e.source).to_owned()])
                .collect();
            println!();
            print!("{}", table::render(&["CONFIG", "VALUE", "SOURCE"], &rows));
        }
        TopicCommand::Alter { name, partitions, config, delete_config } => {
            if !config.is_empty() || !delete_config.is_empty() {
                let set: BTreeMap<String, String> = config.into_iter().collect();
                admin
                    .alter_topic_config(&name, &set, &delete_config)
                    .await
                    .with_context(|| format!("altering the configuration of {name:?}"))?;
                for (k, v) in &set {
                    println!("topic {name}: {k}={v}");
                }
                for k in &delete_config {
                    println!("topic {name}: {k} back to the broker default");
                }
            }
            if let Some(partitions) = partitions {
                admin
                    .create_partitions(&name, partitions)
                    .await
                    .with_context(|| format!("adding partitions to {name:?}"))?;
                admin.wait_for_leaders(&name, Duration::from_secs(30)).await.with_context(|| {
                    format!(
                        "topic {name:?} now has {partitions} partitions, but not every one has a leader yet"
                    )
                })?;
                println!("topic {name} now has {partitions} partitions");
                println!(
                    "note: records with a key may map to another partition from now on (key hash modulo {partitions})"
                );
            }
        }
        TopicCommand::Delete { name } => {
            admin.delete_topic(&name).await.with_context(|| format!("deleting topic {name:?}"))?;
            println!("deleted topic {name}");
        }
    }
    Ok(())
}

/// `KEY=VALUE` of `--config`.
fn parse_key_value(arg: &str) -> Result<(String, String), String> {
    match arg.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("{arg:?} is not KEY=VALUE")),
    }
}

/// How `topic describe` names a config source (Kafka's names).
fn source_name(source: i32) -> &'static str {
    use ferrolog_client::admin::ConfigSource;
    match ConfigSource::try_from(source) {
        Ok(ConfigSource::Topic) => "topic",
        Ok(ConfigSource::Broker) => "broker config",
        Ok(ConfigSource::Default) => "default",
        _ => "unknown",
    }
}

/// Runs a broker command.
pub async fn broker(bootstrap: &str, command: crate::brokers::BrokerCommand) -> anyhow::Result<()> {
    let admin = Admin::new(crate::connect(bootstrap)?).with_timeout(ADMIN_TIMEOUT);
    crate::brokers::broker(&admin, command).await
}

/// Runs a controller quorum command.
pub async fn controller(
    bootstrap: &str,
    command: crate::controller::ControllerCommand,
) -> anyhow::Result<()> {
    let admin = Admin::new(crate::connect(bootstrap)?).with_timeout(ADMIN_TIMEOUT);
    crate::controller::run(&admin, command).await
}

/// Runs a cluster command.
pub async fn cluster(bootstrap: &str, command: ClusterCommand) -> anyhow::Result<()> {
    let admin = Admin::new(crate::connect(bootstrap)?).with_timeout(ADMIN_TIMEOUT);
    match command {
        ClusterCommand::Rebalance(args) => crate::brokers::rebalance(&admin, args).await,
        ClusterCommand::Status => {
            let status = admin.cluster_status().await.context("asking the cluster for its status")?;
            print!("{}", render_status(&status));
            Ok(())
        }
    }
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// A partition's replicas as printed, with a reassignment under way:
/// `2,3,4,1 (moving: +4 -1)`.
fn replicas_text(p: &ferrolog_client::admin::PartitionReport) -> String {
    if p.adding.is_empty() && p.removing.is_empty() {
        return join(&p.replicas);
    }
    let adding: Vec<String> = p.adding.iter().map(|b| format!("+{b}")).collect();
    let removing: Vec<String> = p.removing.iter().map(|b| format!("-{b}")).collect();
    format!(
        "{} (moving: {})",
        join(&p.replicas),
        adding.into_iter().chain(removing).collect::<Vec<_>>().join(" ")
    )
}

/// The status report, as printed.
fn render_status(s: &ClusterStatus) -> String {
    let mut out = String::new();
    let controller =
        if s.controller == 0 { "unknown".to_owned() } else { format!("broker {}", s.controller) };
    out.push_str(&format!("controller: {controller} (metadata from {})\n", s.answered_by));
    out.push_str(&format!("ready: {}\n\n", s.readiness().describe()));
    let mut brokers: Vec<Vec<String>> = s
        .brokers
        .iter()
        .map(|b| {
            let id = if b.id == s.controller { format!("{} *", b.id) } else { b.id.to_string() };
            let files = s.open_files.get(&b.id).map_or_else(
                || "-".to_owned(),
                |(open, limit)| format!("{open} / {limit} ({}%)", open.saturating_mul(100) / (*limit).max(1)),
            );
            let replicas = s
                .replicas
                .get(&b.id)
                .map_or_else(|| "-".to_owned(), |(hosted, dormant)| format!("{hosted} ({dormant} dormant)"));
            vec![
                id,
                b.address.clone(),
                b.peer_address.clone(),
                if b.alive { "yes" } else { "NO" }.to_owned(),
                files,
                replicas,
            ]
        })
        .collect();
    for id in s.readiness().unregistered {
        brokers.push(vec![
            id.to_string(),
            "-".into(),
            "-".into(),
            "not registered".into(),
            "-".into(),
            "-".into(),
        ]);
    }
    brokers.sort_by_key(|row| row[0].split(' ').next().and_then(|id| id.parse::<u32>().ok()));
    out.push_str(&table::render(
        &["BROKER", "ADDRESS", "PEER ADDRESS", "ALIVE", "OPEN FILES / LIMIT", "REPLICAS"],
        &brokers,
    ));
    out.push_str("(* = controller)\n");
    for (id, why) in &s.metadata_failures {
        out.push_str(&format!("broker {id}: metadata replica FAILED: {why}\n"));
    }
    out.push('\n');
    if s.partitions.is_empty() {
        out.push_str("no topics\n");
        return out;
    }
    let mut problems = Vec::new();
    let rows: Vec<Vec<String>> = s
        .partitions
        .iter()
        .map(|p| {
            let mut row = vec![p.topic.clone(), p.partition.to_string()];
            match &p.status {
                Ok(st) => {
                    let lag = st
                        .followers
                        .iter()
                        .map(|f| match (&f.state, f.lag) {
                            (ReplicaHealth::Running, Some(lag)) if f.learner => {
                                format!("{}:{lag} learner", f.broker_id)
                            }
                            (ReplicaHealth::Running, Some(lag)) => format!("{}:{lag}", f.broker_id),
                            (ReplicaHealth::Recovering(_), Some(lag)) => {
                                format!("{}:{lag} RECOVERING", f.broker_id)
                            }
                            (ReplicaHealth::Failed(_), _) => format!("{}:FAILED", f.broker_id),
                            (ReplicaHealth::Unreachable(_), _) => format!("{}:UNREACHABLE", f.broker_id),
                            (_, None) => format!("{}:?", f.broker_id),
                        })
                        .collect::<Vec<_>>()
                        .join(" ");
                    for f in st.followers.iter().filter(|f| f.state != ReplicaHealth::Running) {
                        problems.push(format!(
                            "{}-{} on broker {}: {}",
                            p.topic, p.partition, f.broker_id, f.state
                        ));
                    }
                    row.extend([
                        st.leader.to_string(),
                        st.term.to_string(),
                        replicas_text(p),
                        st.commit_index.to_string(),
                        st.high_watermark.to_string(),
                        lag,
                    ]);
                }
                Err(e) => {
                    let leader = if p.leader == 0 { "none".to_owned() } else { p.leader.to_string() };
                    row.extend([
                        leader,
                        "-".into(),
                        replicas_text(p),
                        "-".into(),
                        "-".into(),
                        format!("error: {e}"),
                    ]);
                }
            }
            row
        })
        .collect();
    out.push_str(&table::render(
        &[
            "TOPIC",
            "PARTITION",
            "LEADER",
            "TERM",
            "REPLICAS",
            "COMMIT",
            "HIGH WATERMARK",
            "FOLLOWER LAG (broker:entries)",
        ],
        &rows,
    ));
    if !problems.is_empty() {
        out.push_str("\nreplicas not in service:\n");
        for p in problems {
            out.push_str(&format!("  {p}\n"));
        }
    }
    out
}

/// A topic id as printed (KIP-516): its UUID form, or `-` from a broker
/// that sends none.
fn topic_id_text(id: Option<ferrolog_client::TopicId>) -> String {
    id.map_or_else(|| "-".to_owned(), |id| id.to_string())
}

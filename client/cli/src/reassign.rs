//! `ferrolog partition reassign` and `ferrolog partition describe`: moving
//! a partition's replicas (KIP-455) and watching it happen.

use std::time::Duration;

use anyhow::Context;
use ferrolog_client::Admin;
use ferrolog_client::admin::{AwaitedMove, PartitionReport, ReassignmentRequest, ReplicaHealth, move_done};
use ferrolog_client::metadata::ClusterMeta;
use serde::Deserialize;

use crate::table;

/// Arguments of `ferrolog partition reassign`.
#[derive(clap::Args, Debug)]
pub struct ReassignArgs {
    /// Topic name (not with --plan).
    #[arg(required_unless_present = "plan", conflicts_with = "plan")]
    topic: Option<String>,
    /// Partition number (not with --plan).
    #[arg(required_unless_present = "plan", conflicts_with = "plan")]
    partition: Option<u32>,
    /// The target brokers in order, comma-separated; the first becomes the
    /// preferred leader.
    #[arg(long, value_delimiter = ',', value_name = "BROKERS", required_unless_present_any = ["cancel", "plan"], conflicts_with = "cancel")]
    replicas: Vec<u32>,
    /// Cancel the partition's reassignment: back to the replicas it started from.
    #[arg(long)]
    cancel: bool,
    /// A JSON reassignment plan (Kafka's format) for many partitions.
    #[arg(long, value_name = "FILE")]
    plan: Option<std::path::PathBuf>,
    /// Wait until every move has completed, printing progress; at most this
    /// many seconds (default when given without a value: 3600).
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "3600")]
    wait: Option<u64>,
}

/// Kafka's reassignment JSON (`kafka-reassign-partitions.sh`).
#[derive(Deserialize, Debug)]
struct Plan {
    version: u32,
    partitions: Vec<PlanEntry>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct PlanEntry {
    topic: String,
    partition: u32,
    #[serde(default)]
    replicas: Vec<u32>,
    /// Kafka's plans may carry log directories; only "any" is meaningful here.
    #[serde(default)]
    log_dirs: Option<Vec<String>>,
}

/// The changes `args` ask for.
fn changes(args: &ReassignArgs) -> anyhow::Result<Vec<ReassignmentRequest>> {
    let target = |replicas: Vec<u32>| if args.cancel { None } else { Some(replicas) };
    let Some(path) = &args.plan else {
        let (Some(topic), Some(partition)) = (args.topic.clone(), args.partition) else {
            anyhow::bail!("give TOPIC and PARTITION, or --plan FILE");
        };
        return Ok(vec![ReassignmentRequest { topic, partition, replicas: target(args.replicas.clone()) }]);
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let plan: Plan = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a reassignment plan", path.display()))?;
    anyhow::ensure!(plan.version == 1, "{}: plan version {} (only 1 is known)", path.display(), plan.version);
    anyhow::ensure!(!plan.partitions.is_empty(), "{}: the plan lists no partitions", path.display());
    let mut out = Vec::with_capacity(plan.partitions.len());
    for e in plan.partitions {
        if let Some(dirs) = &e.log_dirs {
            anyhow::ensure!(
                dirs.iter().all(|d| d == "any"),
                "{}-{}: log_dirs other than \"any\" are not supported (a broker has one data directory)",
                e.topic,
                e.partition
            );
        }
        anyhow::ensure!(
            args.cancel || !e.replicas.is_empty(),
            "{}-{}: no replicas given",
            e.topic,
            e.partition
        );
        out.push(ReassignmentRequest {
            topic: e.topic,
            partition: e.partition,
            replicas: target(e.replicas),
        });
    }
    Ok(out)
}

/// Runs `ferrolog partition reassign`.
pub async fn reassign(admin: &Admin, args: ReassignArgs) -> anyhow::Result<()> {
    let changes = changes(&args)?;
    let results =
        admin.alter_partition_reassignments(&changes).await.context("asking for the reassignment")?;
    let mut refused = 0usize;
    let mut started = Vec::new();
    for (c, r) in changes.iter().zip(results) {
        let name = format!("{}-{}", c.topic, c.partition);
        match (r, &c.replicas) {
            (Ok(()), Some(to)) => {
                println!("{name}: moving to brokers {}", join(to));
                started.push((c.topic.clone(), c.partition, Some(to.clone())));
            }
            (Ok(()), None) => {
                println!("{name}: cancelled; going back to its original replicas");
                started.push((c.topic.clone(), c.partition, None));
            }
            (Err(e), _) => {
                eprintln!("{name}: refused: {e}");
                refused += 1;
            }
        }
    }
    if let Some(secs) = args.wait
        && !started.is_empty()
    {
        let mut last = String::new();
        admin
            .wait_for_reassignments(&started, Duration::from_secs(secs), |cluster| {
                let line = progress_line(cluster, &started);
                if line != last {
                    eprintln!("{line}");
                    last = line;
                }
            })
            .await
            .context("waiting for the moves to complete")?;
        let n = started.len();
        println!("done: {n} partition{} moved", if n == 1 { "" } else { "s" });
    }
    anyhow::ensure!(refused == 0, "{refused} of {} reassignments refused", changes.len());
    Ok(())
}

/// One progress line: how many of `watched` still move, with the first few.
fn progress_line(cluster: &ClusterMeta, watched: &[AwaitedMove]) -> String {
    let moving: Vec<String> = watched
        .iter()
        .filter(|w| !move_done(cluster, w))
        .filter_map(|(t, p, _)| {
            let m = cluster.topics.get(t)?.partitions.iter().find(|x| x.partition == *p)?;
            Some({
                format!(
                    "{t}-{p} (replicas {}, adding {}, removing {})",
                    join(&m.replicas),
                    join(&m.adding),
                    join(&m.removing)
                )
            })
        })
        .collect();
    if moving.is_empty() {
        return format!("moving: none of {} left", watched.len());
    }
    let shown: Vec<&str> = moving.iter().take(3).map(String::as_str).collect();
    let more = if moving.len() > 3 { format!(" and {} more", moving.len() - 3) } else { String::new() };
    format!("moving: {} of {}: {}{more}", moving.len(), watched.len(), shown.join("; "))
}

/// The phase of a reassignment as seen from its leader's report: new
/// replicas still learning the log, or the voters being switched (and the
/// completion recorded).
pub fn phase(r: &PartitionReport, cancelled: bool) -> String {
    if r.adding.is_empty() && r.removing.is_empty() && !cancelled {
        return "none".into();
    }
    let what = if cancelled { "cancelled, going back" } else { "moving" };
    let Ok(status) = &r.status else { return format!("{what}: leader unknown") };
    let learning: Vec<String> = r
        .adding
        .iter()
        .filter_map(|b| match status.followers.iter().find(|f| f.broker_id == *b) {
            Some(f) if !f.learner => None,
            Some(f) => Some(format!("{b} ({} entries behind)", f.lag.map_or("?".into(), |l| l.to_string()))),
            None if *b == status.leader => None,
            None => Some(format!("{b} (not a member yet)")),
        })
        .collect();
    if learning.is_empty() {
        format!("{what}: changing voters to the target, then removing {}", join(&r.removing))
    } else {
        format!("{what}: learners catching up: {}", learning.join(", "))
    }
}

/// Runs `ferrolog partition describe`.
pub async fn describe(admin: &Admin, topic: &str, partition: u32) -> anyhow::Result<()> {
    let report = admin
        .describe_partition(topic, partition)
        .await
        .with_context(|| format!("describing {topic}-{partition}"))?;
    let cluster = admin.metadata().current().await.context("reading metadata")?;
    let cancelled = cluster
        .topics
        .get(topic)
        .and_then(|t| t.partitions.iter().find(|p| p.partition == partition))
        .is_some_and(|p| p.reassignment_cancelled);
    println!("{topic}-{partition}");
    println!("  replicas: {}", join(&report.replicas));
    println!("  reassignment: {}", phase(&report, cancelled));
    match &report.status {
        Err(e) => println!("  leader: {} ({e})", report.leader),
        Ok(s) => {
            println!("  leader: broker {} (term {})", s.leader, s.term);
            println!(
                "  commit index: {}, high watermark: {}, log start offset: {}",
                s.commit_index, s.high_watermark, s.log_start_offset
            );
            let mut rows = vec![vec![s.leader.to_string(), "leader".into(), "0".into(), "running".into()]];
            for f in &s.followers {
                rows.push(vec![
                    f.broker_id.to_string(),
                    if f.learner { "learner" } else { "voter" }.into(),
                    f.lag.map_or_else(|| "?".into(), |l| l.to_string()),
                    match &f.state {
                        ReplicaHealth::Running => "running".into(),
                        other => other.to_string(),
                    },
                ]);
            }
            print!("{}", table::render(&["BROKER", "ROLE", "LAG (entries)", "STATE"], &rows));
        }
    }
    Ok(())
}

fn join(ids: &[u32]) -> String {
    if ids.is_empty() {
        return "-".into();
    }
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

//! `ferrolog group ...`: consumer groups' committed offsets (list,
//! describe with lag, reset, delete), over [`ferrolog_client::Groups`].

use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use ferrolog_client::group::OffsetToCommit;
use ferrolog_client::{Groups, Seek};

use crate::table::render;

/// How long a group command retries while no coordinator answers.
const GROUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Consumer group commands.
#[derive(Subcommand, Debug)]
pub enum GroupCommand {
    /// Every group of the cluster, with its state and member count (each
    /// broker lists the groups it coordinates).
    List,
    /// A group's state, generation, members, and per partition its
    /// committed offset, the log end offset (high watermark) and the lag
    /// between them.
    Describe {
        /// Group id.
        group: String,
    },
    /// Move a group's committed offsets for a topic's partitions to the
    /// earliest or latest offset, an offset, or the first record at or
    /// after a time. A dry run unless --execute; refused while the group
    /// has members.
    ResetOffsets(ResetArgs),
    /// Delete a group without members and its committed offsets.
    Delete {
        /// Group id.
        group: String,
    },
}

/// `group reset-offsets` arguments.
#[derive(Args, Debug)]
pub struct ResetArgs {
    /// Group id.
    group: String,
    /// The topic whose partitions' offsets to move.
    #[arg(long)]
    topic: String,
    /// Only these partitions (comma-separated); all of the topic's by default.
    #[arg(long, value_delimiter = ',')]
    partitions: Vec<u32>,
    /// `earliest` (the log start offset), `latest` (the high watermark), an
    /// offset (an integer), or a time: RFC 3339 (`2013-01-01T10:00:00Z`) or
    /// `YYYY-MM-DD[ HH:MM[:SS]]` in UTC: the first record at or after it
    /// (the high watermark when none is).
    #[arg(long)]
    to: String,
    /// Commit the new offsets (without it, only print them).
    #[arg(long)]
    execute: bool,
}

/// Parses `--to`.
fn parse_to(text: &str) -> anyhow::Result<Seek> {
    match text {
        "earliest" => Ok(Seek::Earliest),
        "latest" => Ok(Seek::Latest),
        t if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) => {
            Ok(Seek::Offset(t.parse().with_context(|| format!("offset {t:?}"))?))
        }
        t => crate::timefmt::parse_timestamp_ms(t)
            .map(Seek::Timestamp)
            .map_err(|e| anyhow::anyhow!("--to {t:?} is not earliest, latest, an offset or a time: {e}")),
    }
}

/// Runs a group command.
pub async fn run(bootstrap: &str, command: GroupCommand) -> anyhow::Result<()> {
    let groups = Groups::new(crate::connect(bootstrap)?).with_timeout(GROUP_TIMEOUT);
    match command {
        GroupCommand::List => list(&groups).await,
        GroupCommand::Describe { group } => describe(&groups, &group).await,
        GroupCommand::ResetOffsets(args) => reset(&groups, args).await,
        GroupCommand::Delete { group } => {
            groups.delete(&group).await.with_context(|| format!("deleting group {group:?}"))?;
            println!("deleted group {group:?} and its committed offsets");
            Ok(())
        }
    }
}

async fn list(groups: &Groups) -> anyhow::Result<()> {
    let (listed, missing) = groups.list().await.context("listing groups")?;
    let rows: Vec<Vec<String>> = listed
        .iter()
        .map(|g| vec![g.group.clone(), g.state.clone(), g.members.to_string(), g.coordinator.to_string()])
        .collect();
    print!("{}", render(&["GROUP", "STATE", "MEMBERS", "COORDINATOR"], &rows));
    for (broker, e) in &missing {
        eprintln!("warning: broker {broker} did not answer; the groups it coordinates are missing: {e}");
    }
    Ok(())
}

async fn describe(groups: &Groups, group: &str) -> anyhow::Result<()> {
    let d = groups.describe(group).await.with_context(|| format!("describing group {group:?}"))?;
    println!(
        "group {}: {}, generation {}, {} members, coordinator broker {}{}",
        d.group,
        d.state,
        d.generation,
        d.members.len(),
        d.coordinator,
        if d.protocol.is_empty() { String::new() } else { format!(", assignor {}", d.protocol) }
    );
    if !d.members.is_empty() {
        let members: Vec<Vec<String>> = d
            .members
            .iter()
            .map(|m| {
                let parts: Vec<String> = m.assignment.iter().map(|(t, p)| format!("{t}/{p}")).collect();
                vec![
                    m.member_id.clone(),
                    m.client_id.clone(),
                    m.instance_id.clone().unwrap_or_else(|| "-".into()),
                    if parts.is_empty() { "-".into() } else { parts.join(",") },
                ]
            })
            .collect();
        print!("{}", render(&["MEMBER", "CLIENT", "INSTANCE", "PARTITIONS"], &members));
    }
    let mut rows = Vec::new();
    for c in &d.offsets {
        let end = groups.resolve(&c.topic, c.partition, Seek::Latest).await;
        let (end, lag) = match (&end, c.offset) {
            (Ok(end), Some(o)) => (end.to_string(), end.saturating_sub(o).to_string()),
            (Ok(end), None) => (end.to_string(), "-".into()),
            (Err(e), _) => (format!("? ({e})"), "?".into()),
        };
        rows.push(vec![
            c.topic.clone(),
            c.partition.to_string(),
            c.offset.map_or("-".into(), |o| o.to_string()),
            end,
            lag,
            c.metadata.clone(),
        ]);
    }
    print!("{}", render(&["TOPIC", "PARTITION", "COMMITTED", "LOG-END", "LAG", "METADATA"], &rows));
    Ok(())
}

async fn reset(groups: &Groups, args: ResetArgs) -> anyhow::Result<()> {
    let seek = parse_to(&args.to)?;
    let meta = groups.metadata().clone();
    let topic = meta
        .topic(&args.topic, crate::TOPIC_WAIT)
        .await
        .with_context(|| format!("topic {:?}", args.topic))?;
    let count = topic.partition_count();
    let partitions: Vec<u32> =
        if args.partitions.is_empty() { (0..count).collect() } else { args.partitions.clone() };
    if let Some(p) = partitions.iter().find(|p| **p >= count) {
        bail!("topic {:?} has {count} partitions; there is no partition {p}", args.topic);
    }
    match groups.describe(&args.group).await {
        Ok(d) if !d.members.is_empty() => bail!(
            "group {:?} has {} members: stop them before resetting its offsets (NON_EMPTY_GROUP)",
            args.group,
            d.members.len()
        ),
        _ => {}
    }
    let asked: Vec<(String, u32)> = partitions.iter().map(|p| (args.topic.clone(), *p)).collect();
    let current = groups.committed(&args.group, &asked).await.context("reading the committed offsets")?;
    let mut offsets = Vec::new();
    let mut rows = Vec::new();
    for p in &partitions {
        let mut new = groups
            .resolve(&args.topic, *p, seek)
            .await
            .with_context(|| format!("finding the offset of {}/{p}", args.topic))?;
        if let Seek::Offset(asked) = seek {
            // As Kafka's tool: an offset outside the partition's records is
            // moved to its nearest end (a position past the end would make
            // the group's next fetch OFFSET_OUT_OF_RANGE).
            let start = groups.resolve(&args.topic, *p, Seek::Earliest).await?;
            let end = groups.resolve(&args.topic, *p, Seek::Latest).await?;
            new = asked.clamp(start, end.max(start));
            if new != asked {
                eprintln!(
                    "warning: {}/{p} holds offsets {start} up to {end}: {asked} becomes {new}",
                    args.topic
                );
            }
        }
        let was = current.iter().find(|c| c.partition == *p).and_then(|c| c.offset);
        rows.push(vec![
            args.group.clone(),
            args.topic.clone(),
            p.to_string(),
            was.map_or("-".into(), |o| o.to_string()),
            new.to_string(),
        ]);
        offsets.push(OffsetToCommit {
            topic: args.topic.clone(),
            partition: *p,
            offset: new,
            metadata: String::new(),
            topic_id: topic.topic_id,
        });
    }
    print!("{}", render(&["GROUP", "TOPIC", "PARTITION", "CURRENT", "NEW"], &rows));
    if !args.execute {
        println!("dry run: nothing committed (add --execute to commit these offsets)");
        return Ok(());
    }
    let results = groups.commit(&args.group, &offsets, true).await.context("committing the new offsets")?;
    let failed: Vec<String> = results
        .iter()
        .filter_map(|(o, r)| r.as_ref().err().map(|e| format!("{}/{}: {e}", o.topic, o.partition)))
        .collect();
    if !failed.is_empty() {
        bail!("{} of {} partitions were not reset:\n  {}", failed.len(), results.len(), failed.join("\n  "));
    }
    println!("committed {} offsets", results.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn to_takes_names_offsets_and_times() {
        assert_eq!(parse_to("earliest").unwrap(), Seek::Earliest);
        assert_eq!(parse_to("latest").unwrap(), Seek::Latest);
        assert_eq!(parse_to("42").unwrap(), Seek::Offset(42));
        assert_eq!(parse_to("1970-01-01T00:00:01Z").unwrap(), Seek::Timestamp(1000));
        assert!(parse_to("soon").is_err());
        assert!(parse_to("").is_err());
    }
}

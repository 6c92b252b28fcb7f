//! `ferrolog consume`: prints records of a topic's partitions, from a
//! position, until each partition reaches the end it had at start (or, with
//! `--follow`, until Ctrl-C).

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use ferrolog_client::{Consumer, ConsumerConfig, OnTopicRecreated, Seek};
use indicatif::{ProgressBar, ProgressStyle};

use crate::output::record_json;
use crate::timefmt::parse_timestamp_ms;

/// How records are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// The value's bytes, then a newline.
    Value,
    /// A JSON object per line: partition, offset, key, value, timestamp, headers.
    Json,
}

/// `ferrolog consume` flags.
#[derive(Args, Debug)]
pub struct ConsumeArgs {
    /// Topic to read.
    pub topic: String,
    /// Partition to read (repeatable); default: every partition.
    #[arg(long = "partition", short = 'p')]
    pub partitions: Vec<u32>,
    /// Where to start: earliest, latest, an offset (integer), or a time
    /// (RFC 3339 or "YYYY-MM-DD HH:MM:SS" UTC) to start at the first record
    /// at or after it.
    #[arg(long, default_value = "earliest", value_parser = parse_from)]
    pub from: Seek,
    /// Keep waiting for new records (until Ctrl-C) instead of stopping at
    /// the end each partition had at start.
    #[arg(long)]
    follow: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Value)]
    pub output: OutputFormat,
    /// Stop after this many records.
    #[arg(long)]
    pub max_records: Option<u64>,
    /// When the topic is deleted or re-created while reading (KIP-516
    /// topic ids): `fail` stops with an error (exit status 1); `restart`
    /// warns on stderr and reads the new topic from its beginning. An
    /// offset is never carried into the new topic.
    #[arg(long, value_enum, default_value_t = OnRecreated::Fail, conflicts_with = "group")]
    on_topic_recreated: OnRecreated,
    /// When the position is outside the partition's records, as after
    /// retention deleted the records before it (Kafka's
    /// `auto.offset.reset`): `none` stops with an error naming the log start
    /// and end (exit status 1); `earliest` warns on stderr and reads on
    /// from the log start; `latest` warns and reads on from the end.
    #[arg(long, value_enum, default_value_t = OffsetReset::None, conflicts_with = "group")]
    pub offset_reset: OffsetReset,
    /// Read as a member of this consumer group: the group's members share
    /// the topic's partitions, and the position after each batch printed
    /// is committed to the group (at least once: a batch printed and not
    /// committed when a member stops is printed again by the next owner).
    /// Follows until Ctrl-C or --max-records (--follow is implied); --from
    /// (earliest or latest) applies to partitions without a committed
    /// offset and to a committed offset outside the partition's records.
    #[arg(long, conflicts_with = "partitions")]
    pub group: Option<String>,
    /// Static membership (Kafka's group.instance.id, KIP-345): a member
    /// restarted with the same id within its session timeout gets its
    /// partitions back without a rebalance.
    #[arg(long, requires = "group")]
    pub group_instance_id: Option<String>,
    /// Partition assignor(s) offered, most preferred first: range,
    /// roundrobin, cooperative-sticky (Kafka's partition.assignment.strategy).
    #[arg(long, value_delimiter = ',', default_value = "range,cooperative-sticky", requires = "group")]
    pub assignor: Vec<String>,
    /// The member's session timeout, ms (Kafka's session.timeout.ms).
    #[arg(long, default_value_t = 45_000, requires = "group")]
    pub session_timeout_ms: u32,
    /// Heartbeat interval, ms (Kafka's heartbeat.interval.ms).
    #[arg(long, default_value_t = 3_000, requires = "group")]
    pub heartbeat_interval_ms: u32,
}

/// `--offset-reset` (Kafka's `auto.offset.reset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OffsetReset {
    /// Stop with an error.
    None,
    /// Read on from the log start offset.
    Earliest,
    /// Read on from the log end offset.
    Latest,
}

/// `--on-topic-recreated`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnRecreated {
    /// Stop with an error naming the topic.
    Fail,
    /// Warn and read the new topic from its beginning.
    Restart,
}

/// Parses `--from`: `earliest`, `latest`, an offset, or a time.
fn parse_from(text: &str) -> Result<Seek, String> {
    let t = text.trim();
    match t.to_ascii_lowercase().as_str() {
        "earliest" | "beginning" => return Ok(Seek::Earliest),
        "latest" | "end" => return Ok(Seek::Latest),
        _ => {}
    }
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse().map(Seek::Offset).map_err(|e| format!("offset {t:?}: {e}"));
    }
    if t.contains('-') {
        return parse_timestamp_ms(t).map(Seek::Timestamp);
    }
    Err(format!("{t:?} is not earliest, latest, an offset or a time"))
}

/// Runs `ferrolog consume`.
pub async fn run(bootstrap: &str, args: ConsumeArgs) -> anyhow::Result<()> {
    if args.group.is_some() {
        return crate::consume_group::run(bootstrap, args).await;
    }
    let meta = crate::connect(bootstrap)?;
    let topic = meta.topic(&args.topic, crate::TOPIC_WAIT).await.map_err(|e| match e {
        ferrolog_client::Error::UnknownTopic { .. } => {
            anyhow::anyhow!("topic {:?} does not exist", args.topic)
        }
        other => anyhow::Error::new(other).context("asking the cluster for metadata"),
    })?;
    let partitions: Vec<u32> = if args.partitions.is_empty() {
        topic.partitions.iter().map(|p| p.partition).collect()
    } else {
        for p in &args.partitions {
            if *p >= topic.partition_count() {
                bail!(
                    "topic {:?} has {} partitions (0..{}); there is no partition {p}",
                    args.topic,
                    topic.partition_count(),
                    topic.partition_count()
                );
            }
        }
        args.partitions.clone()
    };
    let on_topic_recreated = match args.on_topic_recreated {
        OnRecreated::Fail => OnTopicRecreated::Fail,
        OnRecreated::Restart => OnTopicRecreated::Restart,
    };
    let mut consumer =
        Consumer::new(meta, ConsumerConfig { on_topic_recreated, ..ConsumerConfig::default() });
    // Every request carries the id of the topic found above: its offsets
    // are never applied to a topic re-created under the name.
    consumer.assign(&args.topic, partitions.iter().copied(), args.from);
    if let Some(id) = topic.topic_id {
        consumer.bind_topic_id(&args.topic, id);
    }

    // Without --follow: the end of each partition now is where reading stops.
    let mut ends: BTreeMap<u32, u64> = BTreeMap::new();
    let mut starts: BTreeMap<u32, u64> = BTreeMap::new();
    if !args.follow {
        for &p in &partitions {
            let end = consumer
                .list_offset(&args.topic, p, Seek::Latest)
                .await
                .with_context(|| format!("finding the end of partition {p}"))?;
            // Where reading starts, for the progress bar only: the consumer
            // resolves the seek itself (a time seek also skips within a batch).
            let start = consumer
                .list_offset(&args.topic, p, args.from)
                .await
                .with_context(|| format!("finding where to start in partition {p}"))?;
            ends.insert(p, end);
            starts.insert(p, start.min(end));
        }
    }

    let stdout = std::io::stdout();
    let bar = progress_bar(&args, &starts, &ends, stdout.is_terminal());
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut printed = 0u64;
    let max = args.max_records.unwrap_or(u64::MAX);
    let done = |c: &Consumer, ends: &BTreeMap<u32, u64>| {
        !args.follow
            && ends
                .iter()
                .all(|(&p, &end)| end == 0 || c.position(&args.topic, p).is_some_and(|pos| pos >= end))
    };
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    while printed < max && !done(&consumer, &ends) {
        let polled = tokio::select! {
            r = consumer.poll(Duration::from_millis(500)) => r,
            _ = &mut ctrl_c => break,
        };
        let records = match polled {
            Err(ferrolog_client::Error::OffsetOutOfRange {
                topic,
                partition,
                offset,
                log_start_offset,
                log_end_offset,
            }) if args.offset_reset != OffsetReset::None => {
                let to = if args.offset_reset == OffsetReset::Earliest {
                    log_start_offset
                } else {
                    log_end_offset
                };
                eprintln!(
                    "warning: {topic}/{partition}: offset {offset} is outside the records held \
                     ({log_start_offset} up to {log_end_offset}; retention deletes the oldest); \
                     reading on from {to} (--offset-reset {})",
                    if args.offset_reset == OffsetReset::Earliest { "earliest" } else { "latest" }
                );
                consumer.seek(&topic, partition, Seek::Offset(to));
                continue;
            }
            Err(e @ ferrolog_client::Error::OffsetOutOfRange { .. }) => {
                return Err(anyhow::Error::new(e)).with_context(|| {
                    format!(
                        "reading {} (retention may have deleted the records there: --from earliest, or \
                         --offset-reset earliest to read on from the log start)",
                        args.topic
                    )
                });
            }
            r => r.with_context(|| format!("reading {}", args.topic))?,
        };
        for restart in consumer.take_restarts() {
            eprintln!(
                "warning: topic {} was deleted or re-created; partition {} was at offset {} of the old \
                 topic and now reads the new one from its beginning ({})",
                restart.topic, restart.partition, restart.old_position, restart.reason
            );
            if !args.follow {
                // Stop at the new topic's end as it is now.
                let end = consumer
                    .list_offset(&args.topic, restart.partition, Seek::Latest)
                    .await
                    .with_context(|| format!("finding the end of partition {}", restart.partition))?;
                ends.insert(restart.partition, end);
            }
        }
        let mut newly = 0;
        for r in records {
            if !args.follow && ends.get(&r.partition).is_none_or(|end| r.offset >= *end) {
                continue;
            }
            let written = match args.output {
                OutputFormat::Value => out.write_all(&r.value).and_then(|()| out.write_all(b"\n")),
                OutputFormat::Json => writeln!(out, "{}", record_json(&r)),
            };
            if let Err(e) = written {
                if e.kind() == std::io::ErrorKind::BrokenPipe {
                    return Ok(());
                }
                return Err(e).context("writing to stdout");
            }
            printed += 1;
            newly += 1;
            if printed >= max {
                break;
            }
        }
        if let Err(e) = out.flush() {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return Ok(());
            }
            return Err(e).context("writing to stdout");
        }
        if let Some(bar) = &bar {
            bar.inc(newly);
        }
    }
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    Ok(())
}

/// A progress bar on stderr when stderr is a terminal and the records go
/// elsewhere (printing them to the terminal is progress enough): records
/// read of those between the start positions and the ends.
fn progress_bar(
    args: &ConsumeArgs,
    starts: &BTreeMap<u32, u64>,
    ends: &BTreeMap<u32, u64>,
    stdout_is_terminal: bool,
) -> Option<ProgressBar> {
    if stdout_is_terminal || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = if args.follow {
        let bar = ProgressBar::new_spinner();
        if let Ok(style) =
            ProgressStyle::with_template("{spinner} {elapsed_precise} {pos} records ({per_sec})")
        {
            bar.set_style(style);
        }
        bar
    } else {
        let total: u64 =
            ends.iter().map(|(p, end)| end - starts.get(p).copied().unwrap_or(0).min(*end)).sum();
        let total = args.max_records.map_or(total, |m| m.min(total));
        let bar = ProgressBar::new(total);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} {elapsed_precise} [{bar:30}] {pos}/{len} records ({per_sec}, {eta} left)",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    };
    bar.enable_steady_tick(Duration::from_millis(200));
    Some(bar)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_accepts_positions_offsets_and_times() {
        assert_eq!(parse_from("earliest"), Ok(Seek::Earliest));
        assert_eq!(parse_from("LATEST"), Ok(Seek::Latest));
        assert_eq!(parse_from("42"), Ok(Seek::Offset(42)));
        assert_eq!(parse_from("2013-01-01T10:00:00Z"), Ok(Seek::Timestamp(1_357_034_400_000)));
        assert_eq!(parse_from("2013-01-01 10:00:00"), Ok(Seek::Timestamp(1_357_034_400_000)));
        assert!(parse_from("soon").is_err());
        assert!(parse_from("").is_err());
        assert!(parse_from("2013-13-01").is_err());
    }
}

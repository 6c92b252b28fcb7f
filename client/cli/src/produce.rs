//! `ferrolog produce`: sends one record per input line or CSV row, then
//! reports how many records were read, stored, refused by the cluster, or
//! left with an unknown outcome, and how fast; it fails if any was not
//! stored or if the input could not be parsed.
//!
//! Input that cannot be parsed (see [`crate::input`]) stops the command at
//! that line (records before it are sent and awaited, nothing after it is
//! read), unless `--skip-bad-input` is given: then each bad row is warned
//! about with its line number, counted and skipped.
//!
//! ```text
//!  input thread ──Item (bounded)──> send loop ──Producer::send──> Delivery ──(bounded)──> collector
//!                                      └ Producer::ready(): waits while 32 MiB are unacknowledged
//! ```

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Args;
use ferrolog_client::{Delivery, Producer, ProducerConfig, Record};
use indicatif::{ProgressBar, ProgressStyle};

use crate::input::{self, Item, Options, Progress, Source};

/// Errors printed in full before the rest are only counted.
const ERRORS_SHOWN_MAX: u64 = 10;
/// Deliveries waited on by the collector at most at once.
const DELIVERIES_QUEUED_MAX: usize = 65_536;

/// `ferrolog produce` flags.
#[derive(Args, Debug)]
pub struct ProduceArgs {
    /// Topic to send to.
    topic: String,
    /// Read this file instead of stdin: text (a record per line), `.csv`, or
    /// a `.zip` holding one CSV.
    #[arg(long, short)]
    file: Option<PathBuf>,
    /// Read CSV: the first line is a header, each row a record (its raw text).
    /// Implied by a `.csv` file and by --key-field / --timestamp-field.
    #[arg(long)]
    csv: bool,
    /// CSV field to use as the record key (records with equal keys go to the
    /// same partition, as in Kafka).
    #[arg(long)]
    key_field: Option<String>,
    /// CSV field to use as the record timestamp: RFC 3339,
    /// "YYYY-MM-DD HH:MM:SS" (UTC) or integer ms.
    #[arg(long)]
    timestamp_field: Option<String>,
    /// Skip input rows that cannot be parsed (a CSV row whose field count
    /// differs from the header's, a quote never closed, a missing or bad
    /// timestamp), each with a warning naming its line, instead of
    /// stopping at the first. Skipped rows are counted in the summary and
    /// do not make the command fail.
    #[arg(long)]
    skip_bad_input: bool,
    /// Line mode: each line is `KEY<SEPARATOR>VALUE`, cut at the first
    /// separator (Kafka's console producer `parse.key=true` with
    /// `key.separator`); a line without it is bad input. Reads a `.csv` file
    /// as lines too.
    #[arg(long, value_name = "SEPARATOR", conflicts_with_all = ["csv", "key_field", "timestamp_field"],
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    key_separator: Option<String>,
    /// A value equal to this text is sent as a null value: a tombstone,
    /// which deletes its key from a compacted topic (Kafka's console
    /// producer `null.marker`). An empty value is never null.
    #[arg(long, value_name = "TEXT")]
    null_marker: Option<String>,
    /// How long a record may wait for its acknowledgement, retries
    /// included, ms (Kafka's `delivery.timeout.ms`, KIP-91). A record not
    /// acknowledged by then is counted "unknown": it may or may not be
    /// stored (its request may have reached a broker that had not answered
    /// yet), so resending it may store it twice.
    #[arg(long, value_name = "MS", default_value_t = ProducerConfig::default().delivery_timeout_ms)]
    delivery_timeout_ms: u64,
}

/// Counts shared by the send loop, the collector and the progress bar.
#[derive(Default)]
struct Counts {
    /// Records read from the input and sent.
    sent: AtomicU64,
    stored: AtomicU64,
    /// Refused by the cluster or the client: certainly not stored.
    refused: AtomicU64,
    /// Failed in a way that leaves open whether they were stored (a
    /// delivery timeout, a lost connection).
    unknown: AtomicU64,
    bad_rows: AtomicU64,
    stored_bytes: AtomicU64,
}

/// Whether a record that failed with `e` may still have been stored: the
/// request may have reached the leader and committed while its answer was
/// lost.
fn outcome_unknown(e: &ferrolog_client::Error) -> bool {
    use ferrolog_client::Error;
    use ferrolog_client::error::ErrorCode;
    match e {
        Error::DeliveryTimeout { .. }
        | Error::Timeout { .. }
        | Error::Transport { .. }
        | Error::NoBrokerReachable { .. }
        | Error::Deadline { .. }
        | Error::Protocol(_)
        | Error::Closed => true,
        Error::Broker { .. } => {
            matches!(e.code(), Some(ErrorCode::Unavailable | ErrorCode::StorageError) | None)
        }
        _ => false,
    }
}

impl Counts {
    fn report_error(&self, message: &str) {
        let n = self.refused.load(Ordering::Relaxed)
            + self.unknown.load(Ordering::Relaxed)
            + self.bad_rows.load(Ordering::Relaxed);
        if n <= ERRORS_SHOWN_MAX {
            eprintln!("{message}");
        }
        if n == ERRORS_SHOWN_MAX {
            eprintln!("(further errors are only counted)");
        }
    }
}

/// Runs `ferrolog produce`.
pub async fn run(bootstrap: &str, args: ProduceArgs) -> anyhow::Result<()> {
    let meta = crate::connect(bootstrap)?;
    let topic = meta.topic(&args.topic, crate::TOPIC_WAIT).await.map_err(|e| match e {
        ferrolog_client::Error::UnknownTopic { .. } => {
            anyhow::anyhow!(
                "topic {:?} does not exist; create it with `ferrolog topic create {}`",
                args.topic,
                args.topic
            )
        }
        other => anyhow::Error::new(other).context("asking the cluster for metadata"),
    })?;
    let config =
        ProducerConfig { delivery_timeout_ms: args.delivery_timeout_ms, ..ProducerConfig::default() };
    let producer = Producer::new(meta, config)?;

    let source = args.file.clone().map_or(Source::Stdin, Source::File);
    let options = Options {
        csv: args.csv,
        key_field: args.key_field.clone(),
        timestamp_field: args.timestamp_field.clone(),
        key_separator: args.key_separator.clone(),
    };
    let null_marker = args.null_marker.clone().map(Bytes::from);
    let progress = Arc::new(Progress::default());
    let (items_tx, mut items) = tokio::sync::mpsc::channel(4096);
    let reader = input::spawn_reader(source, options, items_tx, progress.clone())
        .context("starting the input thread")?;

    let counts = Arc::new(Counts::default());
    let (deliveries_tx, deliveries) = tokio::sync::mpsc::channel(DELIVERIES_QUEUED_MAX);
    let collector = tokio::spawn(collect(deliveries, counts.clone()));
    let started = Instant::now();
    let bar = progress_bar(&progress, &counts, started);

    let mut stopped_at = None;
    while let Some(item) = items.recv().await {
        match item {
            Item::Record { line, key, value, timestamp_ms } => {
                let size = (value.len() + key.as_ref().map_or(0, |k| k.len())) as u64;
                producer.ready().await;
                let null_value = null_marker.as_ref().is_some_and(|m| *m == value);
                let value = if null_value { Bytes::new() } else { value };
                let record = Record { key, value, null_value, timestamp_ms, ..Record::default() };
                let delivery = producer.send(&args.topic, record);
                counts.sent.fetch_add(1, Ordering::Relaxed);
                if deliveries_tx.send((line, size, delivery)).await.is_err() {
                    break;
                }
            }
            Item::Bad { line, message } if args.skip_bad_input => {
                counts.bad_rows.fetch_add(1, Ordering::Relaxed);
                let n = counts.bad_rows.load(Ordering::Relaxed);
                counts.report_error(&format!("warning: line {line}: skipped bad input row {n}: {message}"));
            }
            Item::Bad { line, message } => {
                stopped_at = Some(format!("line {line}: {message}"));
                break;
            }
        }
    }
    // After a bad row the reader is left behind (it may be waiting on a
    // terminal); it stops at its next item, or with the process.
    drop(items);
    let read_result = if stopped_at.is_none() {
        reader.join().map_err(|_| anyhow::anyhow!("the input thread panicked"))?
    } else {
        Ok(())
    };
    producer.close().await;
    drop(deliveries_tx);
    collector.await.context("the delivery collector failed")?;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }

    let elapsed = started.elapsed().as_secs_f64().max(1e-6);
    let sent = counts.sent.load(Ordering::Relaxed);
    let stored = counts.stored.load(Ordering::Relaxed);
    let refused = counts.refused.load(Ordering::Relaxed);
    let unknown = counts.unknown.load(Ordering::Relaxed);
    let bad_rows = counts.bad_rows.load(Ordering::Relaxed);
    let bytes = counts.stored_bytes.load(Ordering::Relaxed);
    let skipped =
        if args.skip_bad_input { format!(", {bad_rows} bad input rows skipped") } else { String::new() };
    println!(
        "{sent} records read: {stored} stored, {refused} refused, {unknown} unknown (may or may not be stored){skipped}"
    );
    println!(
        "{stored} records sent to {} ({} partitions) in {elapsed:.2} s: {:.0} records/s, {:.2} MB/s",
        args.topic,
        topic.partition_count(),
        stored as f64 / elapsed,
        bytes as f64 / elapsed / 1e6
    );
    if let Some(bad) = stopped_at {
        bail!(
            "{bad}\nstopped there: the {sent} records before it were sent, nothing after it was read \
             (--skip-bad-input skips such rows)"
        );
    }
    read_result?;
    if refused > 0 || unknown > 0 {
        bail!("{refused} records were refused and {unknown} have an unknown outcome");
    }
    Ok(())
}

/// Awaits deliveries in send order and counts the outcomes.
async fn collect(mut deliveries: tokio::sync::mpsc::Receiver<(u64, u64, Delivery)>, counts: Arc<Counts>) {
    while let Some((line, size, delivery)) = deliveries.recv().await {
        match delivery.await {
            Ok(_) => {
                counts.stored.fetch_add(1, Ordering::Relaxed);
                counts.stored_bytes.fetch_add(size, Ordering::Relaxed);
            }
            Err(e) if outcome_unknown(&e) => {
                counts.unknown.fetch_add(1, Ordering::Relaxed);
                counts.report_error(&format!("line {line}: maybe not stored: {e}"));
            }
            Err(e) => {
                counts.refused.fetch_add(1, Ordering::Relaxed);
                counts.report_error(&format!("line {line}: not stored: {e}"));
            }
        }
    }
}

/// A progress bar on stderr, when stderr is a terminal: input bytes read
/// (when the size is known) and records stored per second.
fn progress_bar(progress: &Arc<Progress>, counts: &Arc<Counts>, started: Instant) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(0);
    let known = ProgressStyle::with_template(
        "{spinner} {elapsed_precise} [{bar:30}] {binary_bytes}/{binary_total_bytes} {msg}",
    )
    .map(|s| s.progress_chars("=> "))
    .ok();
    let unknown = ProgressStyle::with_template("{spinner} {elapsed_precise} {binary_bytes} read {msg}").ok();
    let (bar2, progress, counts) = (bar.clone(), progress.clone(), counts.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let mut styled = None;
        while !bar2.is_finished() {
            tick.tick().await;
            let total = progress.total_bytes.load(Ordering::Relaxed);
            let want = total > 0;
            if styled != Some(want) {
                if let Some(style) = if want { known.clone() } else { unknown.clone() } {
                    bar2.set_style(style);
                }
                styled = Some(want);
            }
            bar2.set_length(total);
            bar2.set_position(progress.read_bytes.load(Ordering::Relaxed));
            let stored = counts.stored.load(Ordering::Relaxed);
            let rate = stored as f64 / started.elapsed().as_secs_f64().max(1e-3);
            let failed = counts.refused.load(Ordering::Relaxed) + counts.unknown.load(Ordering::Relaxed);
            let failed = if failed > 0 { format!(", {failed} failed") } else { String::new() };
            bar2.set_message(format!("{stored} records stored ({rate:.0}/s){failed}"));
        }
    });
    Some(bar)
}

#[cfg(test)]
mod tests {
    use ferrolog_client::Error;

    use super::outcome_unknown;

    #[test]
    fn refusals_are_told_apart_from_unknown_outcomes() {
        let too_large =
            Error::RecordTooLarge { topic: "t".into(), partition: 0, bytes: 9, message: "limit".into() };
        let invalid = Error::Broker {
            operation: "produce to t/0".into(),
            code: 5,
            message: "bad".into(),
            leader: None,
        };
        let storage = Error::Broker {
            operation: "produce to t/0".into(),
            code: 10,
            message: "disk".into(),
            leader: None,
        };
        let timeout = Error::DeliveryTimeout { topic: "t".into(), partition: 0, timeout_ms: 1, last: None };
        assert!(!outcome_unknown(&too_large));
        assert!(!outcome_unknown(&invalid));
        assert!(outcome_unknown(&storage), "the write may have reached other replicas");
        assert!(outcome_unknown(&timeout));
        assert!(outcome_unknown(&Error::Closed));
    }
}

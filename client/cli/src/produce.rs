//! `ferrolog produce`: sends one record per input line or CSV row, then
//! reports how many were stored, how fast, and fails if any was not.
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
}

/// Counts shared by the send loop, the collector and the progress bar.
#[derive(Default)]
struct Counts {
    sent: AtomicU64,
    stored: AtomicU64,
    failed: AtomicU64,
    bad_rows: AtomicU64,
    stored_bytes: AtomicU64,
}

impl Counts {
    fn report_error(&self, message: &str) {
        let n = self.failed.load(Ordering::Relaxed) + self.bad_rows.load(Ordering::Relaxed);
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
    let producer = Producer::new(meta, ProducerConfig::default())?;

    let source = args.file.clone().map_or(Source::Stdin, Source::File);
    let options = Options {
        csv: args.csv,
        key_field: args.key_field.clone(),
        timestamp_field: args.timestamp_field.clone(),
    };
    let progress = Arc::new(Progress::default());
    let (items_tx, mut items) = tokio::sync::mpsc::channel(4096);
    let reader = input::spawn_reader(source, options, items_tx, progress.clone())
        .context("starting the input thread")?;

    let counts = Arc::new(Counts::default());
    let (deliveries_tx, deliveries) = tokio::sync::mpsc::channel(DELIVERIES_QUEUED_MAX);
    let collector = tokio::spawn(collect(deliveries, counts.clone()));
    let started = Instant::now();
    let bar = progress_bar(&progress, &counts, started);

    while let Some(item) = items.recv().await {
        match item {
            Item::Record { line, key, value, timestamp_ms } => {
                let size = (value.len() + key.as_ref().map_or(0, |k| k.len())) as u64;
                producer.ready().await;
                let delivery =
                    producer.send(&args.topic, Record { key, value, timestamp_ms, ..Record::default() });
                counts.sent.fetch_add(1, Ordering::Relaxed);
                if deliveries_tx.send((line, size, delivery)).await.is_err() {
                    break;
                }
            }
            Item::Bad { line, message } => {
                counts.bad_rows.fetch_add(1, Ordering::Relaxed);
                counts.report_error(&format!("line {line}: skipped: {message}"));
            }
        }
    }
    let read_result = reader.join().map_err(|_| anyhow::anyhow!("the input thread panicked"))?;
    producer.close().await;
    drop(deliveries_tx);
    collector.await.context("the delivery collector failed")?;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    read_result?;

    let elapsed = started.elapsed().as_secs_f64().max(1e-6);
    let stored = counts.stored.load(Ordering::Relaxed);
    let failed = counts.failed.load(Ordering::Relaxed);
    let bad_rows = counts.bad_rows.load(Ordering::Relaxed);
    let bytes = counts.stored_bytes.load(Ordering::Relaxed);
    println!(
        "{stored} records sent to {} ({} partitions) in {elapsed:.2} s: {:.0} records/s, {:.2} MB/s",
        args.topic,
        topic.partition_count(),
        stored as f64 / elapsed,
        bytes as f64 / elapsed / 1e6
    );
    if failed > 0 || bad_rows > 0 {
        bail!("{failed} records failed and {bad_rows} input rows were skipped");
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
            Err(e) => {
                counts.failed.fetch_add(1, Ordering::Relaxed);
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
            let failed = counts.failed.load(Ordering::Relaxed);
            let failed = if failed > 0 { format!(", {failed} failed") } else { String::new() };
            bar2.set_message(format!("{stored} records stored ({rate:.0}/s){failed}"));
        }
    });
    Some(bar)
}

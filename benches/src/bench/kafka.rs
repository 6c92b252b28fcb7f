//! `ferrolog-bench kafka`: the same produce and consume workloads through
//! the Kafka listener, driven by kcat (librdkafka, a real Kafka client),
//! and through the native gRPC client library, on one cluster in one run.
//!
//! Per record size (100 B, 1 KiB), `--runs` rounds; each round writes
//! fresh topics (deleted after it, so every round starts on the same
//! disk) and alternates which path goes first, so neither always meets a
//! cold or a fuller cluster. Native: the client library pipelined for
//! `--seconds` (as `e2e` does: 20,000 records in flight, 2 ms linger, 256
//! KiB batches). Kafka: kcat produces as many records as the first native
//! run did, from a file (acks=all, 2 ms linger, 256 KiB batches, no
//! idempotence, no compression). Each topic is then read back from the
//! start by the same kind of client (8 MiB per partition fetch both).
//! kcat's times include its start-up and metadata fetch (tens of ms beside
//! runs of seconds). kcat's input file is written and synced before the
//! first round, and every produce and consume starts after a `sync(2)`,
//! so no phase pays for the writeback of another's dirty pages. Printed:
//! every round, with the CPU each phase cost the brokers (all three) and
//! the client per record; then min / median / max per path and the ratio
//! of the medians. The brokers run with `flush = always`, as for every
//! benchmark here.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use ferrolog_client::{Admin, ClientConfig, MetadataCache};
use ferrolog_tests::kafka_tools::kcat;

use crate::cluster;
use crate::load::{self, ProduceArgs};

/// Flags of `kafka`.
#[derive(Args, Debug, Clone)]
pub struct KafkaArgs {
    /// Seconds of the native producer's run per record size; kcat then
    /// produces as many records.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Partitions of each topic (replication factor 3).
    #[arg(long, default_value_t = 6)]
    partitions: u32,
    /// Rounds per record size (each path once per round, order alternating).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The Kafka client: kcat, or librdkafka in this process (`rdkafka`,
    /// needs the bench built with `--features rdkafka`).
    #[arg(long, value_enum, default_value_t = KafkaClient::Kcat)]
    client: KafkaClient,
}

/// The Kafka client a round uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KafkaClient {
    /// kcat, a process of its own reading a file (librdkafka inside).
    Kcat,
    /// librdkafka in this process (the `rdkafka` crate).
    Rdkafka,
}

/// kcat's path, looked up (installed if missing) on the first call only:
/// the look-up runs `kcat -V`, which must not count in a measured phase.
fn kcat_path() -> anyhow::Result<std::path::PathBuf> {
    static PATH: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    if let Some(p) = PATH.get() {
        return Ok(p.clone());
    }
    let p = kcat()?;
    Ok(PATH.get_or_init(|| p).clone())
}

/// Runs kcat with `args`, `input` on its stdin (a file); returns its wall
/// time, seconds, and the bytes it wrote to stdout.
fn timed_kcat(args: &[String], input: Option<&std::path::Path>) -> anyhow::Result<(f64, usize)> {
    let mut cmd = Command::new(kcat_path()?);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    match input {
        Some(path) => cmd.stdin(std::fs::File::open(path)?),
        None => cmd.stdin(Stdio::null()),
    };
    let start = Instant::now();
    let out = cmd.output().context("running kcat")?;
    let seconds = start.elapsed().as_secs_f64();
    anyhow::ensure!(out.status.success(), "kcat {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok((seconds, out.stdout.len()))
}

/// One path's figures in one round, for its produce and its consume.
#[derive(Clone, Copy, Debug, Default)]
struct Rates {
    produce: Phase,
    consume: Phase,
}

/// One phase: records/s, and the CPU it cost the brokers (all three) and
/// the client per record, seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Phase {
    rate: f64,
    broker_cpu: f64,
    client_cpu: f64,
}

/// CPU meters read before a phase: the brokers' and the client's (this
/// process, `libc::RUSAGE_SELF`, or its waited-for children,
/// `libc::RUSAGE_CHILDREN`). Flushes dirty pages first (`sync(2)`).
struct Meter<'a> {
    cluster: &'a ferrolog_tests::Cluster,
    who: libc::c_int,
    broker: f64,
    client: f64,
}

impl<'a> Meter<'a> {
    fn start(cluster: &'a ferrolog_tests::Cluster, who: libc::c_int) -> Self {
        // SAFETY: sync has no preconditions.
        unsafe { libc::sync() };
        Meter { cluster, who, broker: brokers_cpu(cluster), client: rusage_seconds(who) }
    }

    /// The phase that moved `records` in `seconds`.
    fn stop(self, records: u64, seconds: f64) -> Phase {
        let n = records.max(1) as f64;
        Phase {
            rate: n / seconds,
            broker_cpu: (brokers_cpu(self.cluster) - self.broker) / n,
            client_cpu: (rusage_seconds(self.who) - self.client) / n,
        }
    }
}

/// (min, median, max) of `v` (not empty).
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

/// CPU time (user + system) of this process (`libc::RUSAGE_SELF`) or of
/// its waited-for children (`libc::RUSAGE_CHILDREN`), seconds.
fn rusage_seconds(who: libc::c_int) -> f64 {
    // SAFETY: an all-zero rusage is a valid value of the plain C struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes only the struct it is given.
    if unsafe { libc::getrusage(who, &mut u) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// CPU time the cluster's brokers have used so far, seconds.
fn brokers_cpu(c: &ferrolog_tests::Cluster) -> f64 {
    c.brokers.iter().filter_map(|b| c.pid(b.id)).filter_map(cluster::cpu_seconds).sum()
}

/// Kafka against native: prints a table.
///
/// # Errors
/// Cluster, client or kcat failures.
pub async fn kafka(a: KafkaArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.runs >= 1, "--runs must be at least 1");
    if a.client == KafkaClient::Kcat {
        // Found (or installed) now, not inside a measured phase.
        tokio::task::spawn_blocking(kcat_path).await??;
    }
    let c = cluster::start("bench-kafka").await?;
    let meta: Arc<MetadataCache> = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(60));
    let bootstrap = c.kafka_bootstrap();
    let dir = tempfile::tempdir()?;
    let mut summary = Vec::new();
    let kafka_label = match a.client {
        KafkaClient::Kcat => "Kafka (kcat)",
        KafkaClient::Rdkafka => "Kafka (rdkafka)",
    };
    println!(
        "| record | round | path | produce records/s | produce MB/s | produce CPU µs/record, brokers + \
         client | consume records/s | consume MB/s | consume CPU µs/record, brokers + client |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for bytes in [100usize, 1024] {
        let mut records = None;
        let (mut native, mut kafka) = (Vec::new(), Vec::new());
        for round in 0..a.runs {
            // Round 0 runs native first (it sets the record count kcat sends).
            for kafka_path in if round % 2 == 0 { [false, true] } else { [true, false] } {
                let topic = format!("{}-{bytes}-{round}", if kafka_path { "kafka" } else { "native" });
                load::topic(&meta, &topic, a.partitions).await?;
                let r = if kafka_path {
                    let n = records.context("the record count comes from the first native run")?;
                    match a.client {
                        KafkaClient::Kcat => {
                            let input = input_file(dir.path(), n, bytes)?;
                            kcat_round(&c, &bootstrap, &topic, n, &input).await?
                        }
                        KafkaClient::Rdkafka => {
                            rdkafka_round(&c, &bootstrap, &topic, n, bytes, a.partitions).await?
                        }
                    }
                } else {
                    let m = Meter::start(&c, libc::RUSAGE_SELF);
                    let args = ProduceArgs::pipelined(bytes, a.seconds, a.partitions);
                    let p = load::produce(&meta, &topic, &args).await?;
                    let produce = m.stop(p.records, p.seconds);
                    if records.is_none() {
                        records = Some(p.records);
                        if a.client == KafkaClient::Kcat {
                            // kcat's input, before any kcat run, synced.
                            input_file(dir.path(), p.records, bytes)?;
                        }
                    }
                    let m = Meter::start(&c, libc::RUSAGE_SELF);
                    let start = Instant::now();
                    load::consume(&meta, &topic, p.records, bytes).await?;
                    Rates { produce, consume: m.stop(p.records, start.elapsed().as_secs_f64()) }
                };
                let mb = |rate: f64| rate * bytes as f64 / 1e6;
                let us = |x: f64| x * 1e6;
                println!(
                    "| {bytes} B | {round} | {} | {:.0} | {:.1} | {:.2} + {:.2} | {:.0} | {:.1} | {:.2} + {:.2} |",
                    if kafka_path { kafka_label } else { "native gRPC" },
                    r.produce.rate,
                    mb(r.produce.rate),
                    us(r.produce.broker_cpu),
                    us(r.produce.client_cpu),
                    r.consume.rate,
                    mb(r.consume.rate),
                    us(r.consume.broker_cpu),
                    us(r.consume.client_cpu),
                );
                if kafka_path {
                    kafka.push(r)
                } else {
                    native.push(r)
                }
                admin.delete_topic(&topic).await.context("deleting the round's topic")?;
            }
        }
        summary.push((bytes, native, kafka));
    }
    println!();
    println!(
        "| record | path | produce records/s min / median / max | produce CPU µs/record, brokers + client \
         (medians) | consume records/s min / median / max | consume CPU µs/record, brokers + client (medians) |"
    );
    println!("|---|---|---|---|---|---|");
    for (bytes, native, kafka) in summary {
        let mut medians = Vec::new();
        for (label, rates) in [("native gRPC", &native), (kafka_label, &kafka)] {
            let phase = |of: fn(&Rates) -> Phase| {
                let rate = spread(rates.iter().map(|r| of(r).rate).collect());
                let broker = spread(rates.iter().map(|r| of(r).broker_cpu * 1e6).collect()).1;
                let client = spread(rates.iter().map(|r| of(r).client_cpu * 1e6).collect()).1;
                (rate, format!("{:.0} / {:.0} / {:.0} | {broker:.2} + {client:.2}", rate.0, rate.1, rate.2))
            };
            let (p, pt) = phase(|r| r.produce);
            let (c, ct) = phase(|r| r.consume);
            println!("| {bytes} B | {label} | {pt} | {ct} |");
            medians.push((p.1, c.1));
        }
        println!(
            "| {bytes} B | Kafka / native (medians) | {:.0}% | | {:.0}% | |",
            100.0 * medians[1].0 / medians[0].0,
            100.0 * medians[1].1 / medians[0].1
        );
    }
    Ok(())
}

/// The file of `n` lines of `bytes` bytes kcat produces from, in `dir`:
/// written (and synced) once, then reused.
///
/// # Errors
/// File errors.
fn input_file(dir: &std::path::Path, n: u64, bytes: usize) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join(format!("records-{bytes}-{n}.txt"));
    if !path.exists() {
        let file = std::fs::File::create(&path)?;
        let mut f = std::io::BufWriter::new(&file);
        let line = vec![b'x'; bytes];
        for _ in 0..n {
            f.write_all(&line)?;
            f.write_all(b"\n")?;
        }
        f.flush()?;
        drop(f);
        file.sync_all()?;
    }
    Ok(path)
}

/// librdkafka in this process produces `n` records of `bytes` to `topic`,
/// then reads them back ([`super::kafka_rdkafka`]).
#[cfg(feature = "rdkafka")]
async fn rdkafka_round(
    c: &ferrolog_tests::Cluster,
    bootstrap: &str,
    topic: &str,
    n: u64,
    bytes: usize,
    partitions: u32,
) -> anyhow::Result<Rates> {
    let (b, t) = (bootstrap.to_owned(), topic.to_owned());
    let m = Meter::start(c, libc::RUSAGE_SELF);
    let ps = tokio::task::spawn_blocking(move || super::kafka_rdkafka::produce(&b, &t, n, bytes)).await??;
    let produce = m.stop(n, ps);
    let (b, t) = (bootstrap.to_owned(), topic.to_owned());
    let m = Meter::start(c, libc::RUSAGE_SELF);
    let cs =
        tokio::task::spawn_blocking(move || super::kafka_rdkafka::consume(&b, &t, partitions, n)).await??;
    Ok(Rates { produce, consume: m.stop(n, cs) })
}

/// Without the `rdkafka` feature: says how to build it.
#[cfg(not(feature = "rdkafka"))]
async fn rdkafka_round(
    _: &ferrolog_tests::Cluster,
    _: &str,
    _: &str,
    _: u64,
    _: usize,
    _: u32,
) -> anyhow::Result<Rates> {
    anyhow::bail!(
        "--client rdkafka needs the bench built with it: cargo build --release -p ferrolog-benches --features rdkafka"
    )
}

/// kcat produces the `n` lines of `input` to `topic`, then reads them back.
async fn kcat_round(
    c: &ferrolog_tests::Cluster,
    bootstrap: &str,
    topic: &str,
    n: u64,
    input: &std::path::Path,
) -> anyhow::Result<Rates> {
    let input = input.to_owned();
    let common = |more: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = vec!["-b".into(), bootstrap.to_owned(), "-t".into(), topic.to_owned()];
        v.extend(more.iter().map(|s| (*s).to_owned()));
        v
    };
    let produce = common(&[
        "-P",
        "-X",
        "acks=all",
        "-X",
        "linger.ms=2",
        "-X",
        "batch.size=262144",
        "-X",
        "queue.buffering.max.messages=1000000",
        "-X",
        "enable.idempotence=false",
        "-X",
        "compression.codec=none",
    ]);
    let m = Meter::start(c, libc::RUSAGE_CHILDREN);
    let (ps, _) = tokio::task::spawn_blocking(move || timed_kcat(&produce, Some(&input))).await??;
    let produce = m.stop(n, ps);
    let count = n.to_string();
    // 8 MiB per partition fetch, as the native consumer asks (librdkafka's
    // default is 1 MiB), within the broker's 16 MiB per response;
    // queued.min.messages raised from librdkafka's 100,000 so that 100 B
    // records are prefetched as deep as 1 KiB ones (with the defaults kcat
    // read 100 B records at 0.38–0.48 M/s here). It prints one byte per
    // record, so the count read is checked.
    let consume = common(&[
        "-C",
        "-o",
        "beginning",
        "-e",
        "-q",
        "-f",
        ".",
        "-c",
        &count,
        "-X",
        "fetch.max.bytes=16777216",
        "-X",
        "max.partition.fetch.bytes=8388608",
        "-X",
        "queued.min.messages=1000000",
    ]);
    let m = Meter::start(c, libc::RUSAGE_CHILDREN);
    let (cs, read) = tokio::task::spawn_blocking(move || timed_kcat(&consume, None)).await??;
    let consume = m.stop(n, cs);
    anyhow::ensure!(read as u64 == n, "kcat read {read} of the {n} records it produced");
    Ok(Rates { produce, consume })
}

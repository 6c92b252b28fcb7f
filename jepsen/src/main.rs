//! `ferrolog-jepsen`: runs fault-injection tests against real brokers and
//! checks their histories. See jepsen/README.md.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use ferrolog_client::assignor::Assignor;
use ferrolog_jepsen::checker::vacuity::{self, RunFacts};
use ferrolog_jepsen::matrix::Tally;
use ferrolog_jepsen::network::NetworkChoice;
use ferrolog_jepsen::run::{self, Summary, TestOptions};
use ferrolog_jepsen::workload::WorkloadConfig;
use ferrolog_jepsen::{checker, history, net};

#[derive(Parser, Debug)]
#[command(name = "ferrolog-jepsen", about = "Fault injection and consistency checking for Ferrolog")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// One run: brokers, faults, final read, check. Exits 1 on any anomaly.
    Test {
        #[command(flatten)]
        test: TestArgs,
        /// The run directory (default: <out>/<time>-<faults>-s<seed>).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Runs every fault set of --fault-sets, --repeats times each, and writes
    /// a table (matrix.md). Exits 1 if any run was invalid, else 2 if any
    /// run errored (or none ran), else 0.
    Matrix {
        #[command(flatten)]
        test: TestArgs,
        /// Fault sets, separated by spaces or semicolons; each as --faults.
        #[arg(long, default_value = "partition;kill;pause;netem;mixed")]
        fault_sets: String,
        /// Runs per fault set.
        #[arg(long, default_value_t = 1)]
        repeats: u32,
    },
    /// Re-checks a run directory's history.jsonl and replicas.json, with the
    /// rules against vacuous runs (facts from its results.json).
    Check {
        /// The run directory.
        dir: PathBuf,
    },
    /// Removes namespaces and interfaces left by killed runs.
    Cleanup,
}

fn parse_assignor(name: &str) -> Result<Assignor, String> {
    Assignor::from_name(name)
        .ok_or_else(|| format!("unknown assignor {name:?} (range, roundrobin, cooperative-sticky)"))
}

/// What the clients do.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    /// Jepsen's Kafka queue: unique values appended per partition, every one
    /// read back.
    Queue,
    /// A compacted topic (`cleanup.policy=compact`): values and tombstones
    /// over a few record keys per partition; the final read must hold every
    /// key's last acknowledged write or a later one.
    Compact,
    /// The queue, read by the members of one consumer group that commit
    /// after each poll and leave and rejoin now and then: every
    /// acknowledged value must reach the group, and no commit may pass a
    /// record no member had read.
    Group,
}

#[derive(Args, Debug, Clone)]
struct TestArgs {
    /// The workload.
    #[arg(long, value_enum, default_value = "queue")]
    workload: Workload,
    /// Record keys per partition (`compact` workload).
    #[arg(long, default_value_t = 5)]
    record_keys: u32,
    /// Fraction of records that are tombstones (`compact` workload).
    #[arg(long, default_value_t = 0.15)]
    tombstone_ratio: f64,
    /// The group members' assignors, most preferred first (`group`
    /// workload): range, roundrobin, cooperative-sticky.
    #[arg(long, value_delimiter = ',', default_value = "cooperative-sticky", value_parser = parse_assignor)]
    assignors: Vec<Assignor>,
    /// Brokers.
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// Seconds of the fault phase.
    #[arg(long, default_value_t = 60)]
    time_limit: u64,
    /// Faults: kill, power, pause, partition, netem, membership, mixed, none (comma-separated).
    /// `power` runs every broker on an in-memory disk over FUSE that keeps only what fsync
    /// covered (needs root and /dev/fuse) and cuts the power of one, a majority or all.
    #[arg(long, default_value = "kill,partition")]
    faults: String,
    /// Mean seconds of each quiet and each fault period.
    #[arg(long, default_value_t = 5.0)]
    interval: f64,
    /// Seconds to wait after healing, before the final read.
    #[arg(long, default_value_t = 5)]
    recovery: u64,
    /// Send operations per second, over all producers.
    #[arg(long, default_value_t = 50.0)]
    rate: f64,
    /// Producer processes.
    #[arg(long, default_value_t = 4)]
    producers: u32,
    /// Consumer processes.
    #[arg(long, default_value_t = 3)]
    consumers: u32,
    /// Partitions of the test topic (all keys).
    #[arg(long, default_value_t = 4)]
    partitions: u32,
    /// Keys written at any one time.
    #[arg(long, default_value_t = 2)]
    keys_active: u32,
    /// Milliseconds between moves of the active key window.
    #[arg(long, default_value_t = 10_000)]
    key_rotate_ms: u64,
    /// Most values per send operation.
    #[arg(long, default_value_t = 4)]
    msgs_per_send: u32,
    /// Milliseconds after which a send is given up (outcome info).
    #[arg(long, default_value_t = 10_000)]
    send_timeout_ms: u64,
    /// Seed of the schedule and the workload (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// The ferrolog-broker executable (default: beside this one).
    #[arg(long)]
    broker_bin: Option<PathBuf>,
    /// Where run directories go.
    #[arg(long, default_value = "target/jepsen")]
    out: PathBuf,
    /// Keep brokers' data directories of passing runs.
    #[arg(long)]
    keep_data: bool,
    /// The brokers' `raft.dormant_after_ms`: shorter than their default
    /// (10 s), so that the followers of partitions the workload leaves idle
    /// go dormant and wake again while the faults run.
    #[arg(long, default_value_t = 2000)]
    dormant_after_ms: u64,
    /// A negative control for the `power` fault: the memory disks answer
    /// fsync of files with this extension (`seg`: the partitions' segment
    /// files) without making anything durable, as if the brokers skipped
    /// those syncs; power cuts must then lose acknowledged records and the
    /// run must be INVALID.
    #[arg(long, value_name = "EXTENSION")]
    disk_lies_about: Option<String>,
    /// The network between brokers: namespaces, the TCP proxy, or auto
    /// (namespaces where they, and tc netem if netem is asked for, work).
    #[arg(long, value_enum, default_value = "auto")]
    network: NetworkChoice,
    /// The run fails (rule too-few-acknowledged) when fewer values are
    /// acknowledged than this share of the offered load: --rate ×
    /// --time-limit × (1 + --msgs-per-send) / 2 values.
    #[arg(long, default_value_t = vacuity::DEFAULT_MIN_ACKED_FRACTION)]
    min_acked_fraction: f64,
}

impl TestArgs {
    fn options(&self, faults: &str, seed: u64) -> anyhow::Result<TestOptions> {
        let broker_bin = match &self.broker_bin {
            Some(p) => p.clone(),
            None => std::env::current_exe()?.with_file_name("ferrolog-broker"),
        };
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.min_acked_fraction),
            "--min-acked-fraction must be between 0 and 1, not {}",
            self.min_acked_fraction
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.tombstone_ratio),
            "--tombstone-ratio must be between 0 and 1, not {}",
            self.tombstone_ratio
        );
        anyhow::ensure!(
            broker_bin.exists(),
            "{} not found: build it (cargo build -p ferrolog-broker) or pass --broker-bin",
            broker_bin.display()
        );
        Ok(TestOptions {
            nodes: self.nodes,
            time_limit: Duration::from_secs(self.time_limit),
            faults: faults.to_owned(),
            interval: Duration::from_secs_f64(self.interval),
            recovery: Duration::from_secs(self.recovery),
            workload: WorkloadConfig {
                topic: "jepsen".into(),
                partitions: self.partitions,
                keys_active: self.keys_active,
                key_rotate_ms: self.key_rotate_ms,
                producers: self.producers,
                consumers: self.consumers,
                rate: self.rate,
                msgs_per_send_max: self.msgs_per_send,
                send_timeout_ms: self.send_timeout_ms,
                seed,
                record_keys: if self.workload == Workload::Compact { self.record_keys.max(1) } else { 0 },
                tombstone_ratio: self.tombstone_ratio,
                group: (self.workload == Workload::Group)
                    .then(|| ("jepsen".to_owned(), self.assignors.clone())),
            },
            broker_bin,
            keep_data: self.keep_data,
            dormant_after_ms: self.dormant_after_ms,
            disk_lies_about: self.disk_lies_about.clone(),
            network: self.network,
            min_acked_fraction: self.min_acked_fraction,
        })
    }

    fn seed(&self) -> u64 {
        self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
        })
    }
}

fn run_name(faults: &str, seed: u64) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format!("{secs}-{}-s{seed}", faults.replace(',', "+"))
}

/// Runs one test, stopping (and cleaning up) on SIGINT or SIGTERM.
async fn one(opts: &TestOptions, dir: &Path) -> anyhow::Result<Summary> {
    run::fresh_dir(dir)?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = run::run_test(opts, dir) => r,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted (SIGINT); brokers and namespaces removed"),
        _ = term.recv() => anyhow::bail!("interrupted (SIGTERM); brokers and namespaces removed"),
    }
}

async fn main_inner(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Cmd::Test { test, dir } => {
            let seed = test.seed();
            let opts = test.options(&test.faults, seed)?;
            let dir = dir.unwrap_or_else(|| test.out.join(run_name(&test.faults, seed)));
            let s = one(&opts, &dir).await?;
            run::print_summary(&s);
            Ok(if s.valid { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Cmd::Matrix { test, fault_sets, repeats } => {
            let root = test.out.join(run_name("matrix", test.seed()));
            std::fs::create_dir_all(&root)?;
            let mut rows: Vec<Summary> = Vec::new();
            let mut tally = Tally::default();
            let mut table = String::from(
                "| workload | faults | network | seed | s | faults injected | ops | sends ok/info/fail | values acknowledged | values read | anomalies | run dir |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            );
            let base = test.seed();
            let mut i = 0u64;
            for faults in fault_sets.split([';', ' ']).filter(|s| !s.is_empty()) {
                for _ in 0..repeats {
                    let seed = base.wrapping_add(i);
                    i += 1;
                    let opts = test.options(faults, seed)?;
                    let dir = root.join(run_name(faults, seed));
                    let s = match one(&opts, &dir).await {
                        Ok(s) => s,
                        Err(e) if e.to_string().starts_with("interrupted") => return Err(e),
                        Err(e) => {
                            tally.errored += 1;
                            eprintln!("ferrolog-jepsen: run {faults} (seed {seed}) errored: {e:#}");
                            table.push_str(&format!(
                                "| {} | {faults} | | {seed} | run failed: {e:#} |\n",
                                match test.workload {
                                    Workload::Compact => "compact",
                                    Workload::Group => "group",
                                    Workload::Queue => "queue",
                                }
                            ));
                            continue;
                        }
                    };
                    run::print_summary(&s);
                    if s.valid {
                        tally.valid += 1;
                    } else {
                        tally.invalid += 1;
                    }
                    let anomalies = if s.anomalies.is_empty() && s.problems.is_empty() {
                        "none".to_owned()
                    } else {
                        let mut v: Vec<String> =
                            s.anomalies.iter().map(|(k, n)| format!("{k}: {n}")).collect();
                        v.extend(s.problems.iter().cloned());
                        v.join("; ")
                    };
                    table.push_str(&format!(
                        "| {} | {faults} | {} | {seed} | {} | {} | {} | {}/{}/{} | {} | {} | {anomalies} | {} |\n",
                        s.workload,
                        s.network,
                        test.time_limit,
                        s.fault_events,
                        s.ops,
                        s.sends_ok,
                        s.sends_info,
                        s.sends_fail,
                        s.values_acknowledged,
                        s.values_read,
                        s.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
                    ));
                    std::fs::write(root.join("matrix.md"), &table)?;
                    rows.push(s);
                }
            }
            std::fs::write(root.join("matrix.md"), &table)?;
            std::fs::write(root.join("matrix.json"), serde_json::to_vec_pretty(&rows)?)?;
            println!("{table}");
            eprintln!("ferrolog-jepsen: matrix in {}: {tally}", root.display());
            Ok(ExitCode::from(tally.exit_code()))
        }
        Cmd::Check { dir } => {
            let ops = history::read_jsonl(&dir.join("history.jsonl"))?;
            let replicas: Vec<checker::ReplicaCopy> = match std::fs::read(dir.join("replicas.json")) {
                Ok(b) => serde_json::from_slice(&b).context("replicas.json")?,
                Err(_) => Vec::new(),
            };
            // What the run knew (the final read's ends, replica sets, the
            // minimum acknowledged); from a run before the rules against
            // vacuous runs, only the final read's ends, so they fail.
            let results = std::fs::read(dir.join("results.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .unwrap_or_default();
            let facts: RunFacts = serde_json::from_value(results["run_facts"].clone()).unwrap_or_else(|_| {
                let ends: Vec<(u32, u64)> =
                    serde_json::from_value(results["final_read_end_offsets"].clone()).unwrap_or_default();
                RunFacts { final_read_ends: ends.into_iter().collect(), ..RunFacts::default() }
            });
            let report = checker::check_run(&ops, &replicas, &facts);
            for v in &report.violations {
                eprintln!("ferrolog-jepsen: {v}");
            }
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(if report.valid { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Cmd::Cleanup => {
            for r in net::cleanup_all() {
                eprintln!("removed {r}");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,ferrolog_client=error"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ferrolog-jepsen: {e}");
            return ExitCode::from(2);
        }
    };
    let result = rt.block_on(main_inner(cli));
    // Dropping the runtime drops every task, and with them the brokers and namespaces.
    drop(rt);
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ferrolog-jepsen: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

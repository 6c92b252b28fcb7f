//! One test run, in phases:
//!
//! ```text
//!  setup    network (namespaces + bridge, or proxies), N brokers, topic (partitions = keys, RF 3)
//!  faults   producers + consumers record the history; the nemesis runs its schedule
//!  heal     stop clients, heal links, resume and restart brokers
//!  wait     `recovery` seconds, then the cluster must answer with a controller
//!  final    read every partition from offset 0 up to its high watermark
//!  copies   wait (at most 30 s) for followers to catch up, note the replica
//!           sets, stop each broker, `dump-log` its data
//!  check    checker over history + copies, and the rules against vacuous
//!           runs -> results.json, plot.svg
//! ```
//!
//! The run directory holds `history.jsonl`, `faults.jsonl`, `replicas.json`,
//! `dump-broker-N.jsonl`, `broker-N.log`, `results.json` and `plot.svg`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferrolog_client::{Admin, ClientConfig, MetadataCache};
use serde::Serialize;
use tokio::sync::watch;

use crate::checker::vacuity::{self, RunFacts};
use crate::checker::{self, ReplicaCopy, Report};
use crate::cluster::{self, Cluster, Site};
use crate::history::{self, Recorder};
use crate::nemesis::{self, Fault, FaultEvent, Targets};
use crate::network::{Network, NetworkChoice};
use crate::workload::{self, Ids, WorkloadConfig};

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct TestOptions {
    /// Brokers (3 or 5).
    pub nodes: u32,
    /// Length of the fault phase.
    pub time_limit: Duration,
    /// Faults, as parsed by [`nemesis::parse_faults`].
    pub faults: String,
    /// Mean length of quiet and fault periods.
    pub interval: Duration,
    /// Wait after healing before the final read.
    pub recovery: Duration,
    /// The workload (its seed is the run's seed).
    pub workload: WorkloadConfig,
    /// The `ferrolog-broker` executable.
    pub broker_bin: PathBuf,
    /// Namespaces or the proxy.
    pub network: NetworkChoice,
    /// Keep brokers' data directories even when the run passes.
    pub keep_data: bool,
    /// The brokers' `raft.dormant_after_ms`.
    pub dormant_after_ms: u64,
    /// The memory disks' fsync of files with this extension does nothing
    /// (a negative control of the `power` fault).
    pub disk_lies_about: Option<String>,
    /// The share of the offered load that must be acknowledged (see
    /// [`vacuity::min_values_acknowledged`]).
    pub min_acked_fraction: f64,
}

impl TestOptions {
    /// The fewest values this run must acknowledge: `min_acked_fraction`
    /// of what its producers are asked to send.
    pub fn min_values_acknowledged(&self) -> usize {
        vacuity::min_values_acknowledged(
            self.workload.rate,
            self.time_limit.as_secs_f64(),
            self.workload.msgs_per_send_max,
            self.min_acked_fraction,
        )
    }
}

/// What a run found, for the matrix table.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The run directory.
    pub dir: PathBuf,
    /// `queue`, `compact` or `group`.
    pub workload: &'static str,
    /// Faults asked for.
    pub faults: String,
    /// The network the run had (`netns` or `proxy`).
    pub network: &'static str,
    /// The seed.
    pub seed: u64,
    /// Faults injected.
    pub fault_events: usize,
    /// Operations recorded.
    pub ops: usize,
    /// Send operations and their outcomes.
    pub sends_ok: usize,
    /// ...
    pub sends_info: usize,
    /// ...
    pub sends_fail: usize,
    /// Values acknowledged.
    pub values_acknowledged: usize,
    /// Distinct values read.
    pub values_read: usize,
    /// Compacted topic: acknowledged offsets the final read found removed,
    /// tombstones among them, keys whose final state was checked, and keys
    /// found deleted only because an unanswered tombstone may explain it.
    pub compaction: Option<(usize, usize, usize, usize)>,
    /// Anomaly classes found, with counts.
    pub anomalies: Vec<(String, usize)>,
    /// Problems of the run itself (a dump that failed, ...) and the rules
    /// against vacuous runs it broke.
    pub problems: Vec<String>,
    /// No anomaly and no problem.
    pub valid: bool,
}

#[derive(Serialize)]
struct Results<'a> {
    valid: bool,
    workload: &'a str,
    faults: &'a str,
    seed: u64,
    nodes: u32,
    network: &'a str,
    time_limit_s: f64,
    fault_events: &'a [FaultEvent],
    final_read_end_offsets: &'a [(u32, u64)],
    problems: &'a [String],
    run_facts: &'a RunFacts,
    #[serde(flatten)]
    report: &'a Report,
}

fn write_json(path: &Path, v: &impl Serialize) -> anyhow::Result<()> {
    std::fs::write(path, serde_json::to_vec_pretty(v)?).with_context(|| format!("writing {}", path.display()))
}

/// Runs one test into `dir`.
///
/// # Errors
/// Setup failures (`--network netns` where namespaces cannot be made,
/// brokers that do not start); anomalies are not errors but a [`Summary`] with `valid: false`.
pub async fn run_test(opts: &TestOptions, dir: &Path) -> anyhow::Result<Summary> {
    std::fs::create_dir_all(dir)?;
    let faults = nemesis::parse_faults(&opts.faults)?;
    let net = Network::create(opts.network, opts.nodes, faults.contains(&Fault::Netem)).await?;
    let network = net.describe();
    let short_network = net.name();
    let sites: Vec<Site> = (1..=opts.nodes)
        .map(|id| Site { ip: net.broker_ip(id), ns: net.namespace(id), peer_routes: net.peer_routes(id) })
        .collect();
    let more_config = if opts.workload.compacted() {
        workload::COMPACT_BROKER_CONFIG
    } else if opts.workload.group.is_some() {
        workload::GROUP_BROKER_CONFIG
    } else {
        ""
    };
    let mut cluster = Cluster::new(&opts.broker_bin, dir, &sites, opts.dormant_after_ms, more_config)?;
    if faults.contains(&Fault::Power) {
        cluster.use_memory_disks(opts.workload.seed, opts.disk_lies_about.as_deref())?;
    } else {
        anyhow::ensure!(opts.disk_lies_about.is_none(), "--disk-lies-about needs the power fault");
    }
    for id in cluster.ids() {
        cluster.spawn(id)?;
    }
    let mut targets = Targets {
        cluster: Arc::new(Mutex::new(cluster)),
        net: Arc::new(Mutex::new(net)),
        ops: None,
        rejoin: Arc::default(),
    };
    let bootstrap = lock(&targets.cluster).bootstrap();
    cluster::wait_ready(&bootstrap, opts.nodes as usize, Duration::from_secs(60))
        .await
        .context("brokers did not form a cluster")?;

    let client = ClientConfig {
        connect_timeout_ms: 2_000,
        request_timeout_ms: 5_000,
        ..ClientConfig::from_list(&bootstrap)
    };
    let meta = MetadataCache::new(client)?;
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(30));
    let cfg = Arc::new(opts.workload.clone());
    let rf = opts.nodes.min(3);
    if cfg.compacted() {
        let config = workload::compact_topic_config();
        admin
            .create_topic_with_config(&cfg.topic, cfg.partitions, rf, &config, |_| {})
            .await
            .context("creating the compacted topic")?;
    } else {
        admin.create_topic(&cfg.topic, cfg.partitions, rf).await.context("creating the topic")?;
    }
    admin
        .wait_for_leaders(&cfg.topic, Duration::from_secs(30))
        .await
        .context("waiting for partition leaders")?;
    targets.ops = Some(nemesis::Ops {
        admin: admin.clone().with_timeout(Duration::from_secs(10)),
        topic: cfg.topic.clone(),
        partitions: cfg.partitions,
        replication_factor: rf,
    });

    // Faults phase.
    let rec = Recorder::new();
    let ids = Arc::new(Ids::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut clients = tokio::task::JoinSet::new();
    for slot in 0..cfg.producers {
        clients.spawn(workload::producer(
            cfg.clone(),
            meta.clone(),
            rec.clone(),
            ids.clone(),
            slot,
            stop_rx.clone(),
        ));
    }
    // Group members run on until they have processed everything (after
    // the faults), so they stop on a signal of their own.
    let (group_stop_tx, group_stop_rx) = watch::channel(false);
    let mut members = tokio::task::JoinSet::new();
    for slot in 0..cfg.consumers {
        if cfg.group.is_some() {
            members.spawn(workload::group_consumer(
                cfg.clone(),
                meta.clone(),
                rec.clone(),
                ids.clone(),
                cfg.producers + slot,
                group_stop_rx.clone(),
            ));
        } else {
            clients.spawn(workload::consumer(
                cfg.clone(),
                meta.clone(),
                rec.clone(),
                ids.clone(),
                cfg.producers + slot,
                stop_rx.clone(),
            ));
        }
    }
    let nemesis = tokio::spawn(nemesis::run(
        faults.clone(),
        opts.interval,
        cfg.seed,
        targets.clone(),
        rec.clone(),
        stop_rx.clone(),
    ));
    eprintln!(
        "ferrolog-jepsen: {} brokers on {network}, faults {:?}, {} s, seed {}, run dir {}",
        opts.nodes,
        faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
        opts.time_limit.as_secs(),
        cfg.seed,
        dir.display()
    );
    tokio::time::sleep(opts.time_limit).await;

    // Heal and wait.
    let _ = stop_tx.send(true);
    let events = nemesis.await.context("nemesis task")??;
    targets.heal_all()?;
    let drain = Duration::from_millis(cfg.send_timeout_ms + 10_000);
    let drained = tokio::time::timeout(drain, async { while clients.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        clients.abort_all();
    }
    eprintln!(
        "ferrolog-jepsen: healed after {} faults; {} operations; waiting {:?}",
        events.len(),
        rec.len(),
        opts.recovery
    );
    tokio::time::sleep(opts.recovery).await;
    let mut problems = Vec::new();
    if let Err(e) = cluster::wait_ready(&bootstrap, opts.nodes as usize, Duration::from_secs(60)).await {
        problems.push(format!("cluster not ready after healing: {e:#}"));
    }
    if cfg.group.is_some() {
        let behind = workload::group_caught_up(&cfg, meta.clone(), Duration::from_secs(120)).await;
        if !behind.is_empty() {
            problems.push(format!(
                "the group did not process everything within 120 s of healing: (partition, committed, end) {behind:?}"
            ));
        }
        let _ = group_stop_tx.send(true);
        let left = tokio::time::timeout(Duration::from_secs(30), async {
            while members.join_next().await.is_some() {}
        });
        if left.await.is_err() {
            members.abort_all();
        }
    }

    // Final read of every partition.
    let mut ends = Vec::new();
    let mut final_read_failures = std::collections::BTreeMap::new();
    for p in 0..cfg.partitions {
        match workload::final_read(&cfg, meta.clone(), &rec, &ids, p, Duration::from_secs(60)).await {
            Ok((end, took)) => {
                ends.push((p, end));
                // A tombstone is kept delete.retention.ms after a pass
                // reached it: a slower read from the start may miss it and
                // see the older value it deleted, which the checker would
                // call stale.
                let limit = Duration::from_millis(workload::COMPACT_DELETE_RETENTION_MS);
                if cfg.compacted() && took >= limit {
                    problems.push(format!(
                        "final read of partition {p} took {took:?}, not within delete.retention.ms \
                         ({limit:?}): its final state is not guaranteed"
                    ));
                }
            }
            Err(e) => {
                final_read_failures.insert(p, format!("{e:#}"));
            }
        }
    }

    // Each broker's copy.
    let (followers_caught_up, replica_sets) =
        wait_followers(&admin, &cfg.topic, Duration::from_secs(30)).await;
    let mut replicas: Vec<ReplicaCopy> = Vec::new();
    let slots;
    {
        let mut c = lock(&targets.cluster);
        slots = c.brokers.iter().map(|b| (b.broker_id, b.id)).collect();
        for id in c.ids() {
            c.stop(id, Duration::from_secs(10));
        }
        for id in c.ids() {
            match c.dump(id, &cfg.topic, &dir.join(format!("dump-broker-{id}.jsonl"))) {
                Ok(mut copies) => replicas.append(&mut copies),
                Err(e) => problems.push(format!("dump-log of broker {id}: {e:#}")),
            }
        }
        if let Some(d) = c.disk_stats() {
            eprintln!(
                "ferrolog-jepsen: memory disks: {} power cuts of one broker's disk, {} unsynced bytes they lost; \
                 {} file and {} directory fsyncs",
                d.power_cuts, d.lost_bytes, d.file_syncs, d.dir_syncs
            );
        }
    }
    problems.extend(lock(&targets.net).problems());
    let stopping = lock(&targets.net).stop();
    stopping.await;

    // Check and write everything.
    let ops = rec.snapshot();
    history::write_jsonl(&dir.join("history.jsonl"), &ops)?;
    let mut faults_file = String::new();
    for e in &events {
        faults_file.push_str(&serde_json::to_string(e)?);
        faults_file.push('\n');
    }
    std::fs::write(dir.join("faults.jsonl"), faults_file)?;
    write_json(&dir.join("replicas.json"), &replicas)?;
    let facts = RunFacts {
        partitions: cfg.partitions,
        final_read_ends: ends.iter().copied().collect(),
        final_read_failures,
        min_values_acknowledged: opts.min_values_acknowledged(),
        replica_sets,
        slots,
        followers_caught_up,
    };
    let report = checker::check_run(&ops, &replicas, &facts);
    if cfg.compacted() && report.stats.final_offsets_compacted == 0 {
        problems.push(
            "the final read found no record removed by compaction: the compaction checks saw no work".into(),
        );
    }
    if cfg.group.is_some() && (report.stats.group_commits_ok == 0 || report.stats.group_values_delivered == 0)
    {
        problems.push("the group acknowledged no commit or read nothing: its checks saw no work".into());
    }
    if cfg.compacted() && report.stats.final_tombstones_removed == 0 {
        problems.push(
            "the final read found no tombstone removed: delete.retention.ms was never exercised".into(),
        );
    }
    let valid = report.valid && problems.is_empty();
    write_json(
        &dir.join("results.json"),
        &Results {
            valid,
            workload: cfg.name(),
            faults: &opts.faults,
            seed: cfg.seed,
            nodes: opts.nodes,
            network,
            time_limit_s: opts.time_limit.as_secs_f64(),
            fault_events: &events,
            final_read_end_offsets: &ends,
            problems: &problems,
            run_facts: &facts,
            report: &report,
        },
    )?;
    let title = format!(
        "ferrolog-jepsen: faults {}, seed {}, {}",
        opts.faults,
        cfg.seed,
        if valid { "valid" } else { "INVALID" }
    );
    if let Err(e) = crate::plot::draw(&dir.join("plot.svg"), &ops, &events, &title) {
        problems.push(format!("{e:#}"));
    }
    problems.extend(report.violations.iter().map(ToString::to_string));
    if valid && !opts.keep_data {
        let _ = std::fs::remove_dir_all(dir.join("data"));
    }
    let s = &report.stats;
    Ok(Summary {
        dir: dir.to_owned(),
        workload: cfg.name(),
        faults: opts.faults.clone(),
        network: short_network,
        seed: cfg.seed,
        fault_events: events.len(),
        ops: s.ops,
        sends_ok: s.sends_ok,
        sends_info: s.sends_info,
        sends_fail: s.sends_fail,
        values_acknowledged: s.values_acknowledged,
        values_read: s.values_read,
        compaction: cfg.compacted().then_some((
            s.final_offsets_compacted,
            s.final_tombstones_removed,
            s.final_keys_checked,
            s.final_keys_deleted_by_unacknowledged_tombstone,
        )),
        anomalies: report.found().into_iter().map(|(k, n)| (k.to_owned(), n)).collect(),
        problems,
        valid,
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Waits until every follower of every partition of `topic` has no lag (or
/// `timeout`), so that each broker's copy is complete when it is stopped.
/// Returns whether they caught up, and each partition's replica set (broker
/// ids) as last reported (`None` if the cluster never answered).
async fn wait_followers(
    admin: &Admin,
    topic: &str,
    timeout: Duration,
) -> (bool, Option<std::collections::BTreeMap<u32, Vec<u32>>>) {
    let deadline = Instant::now() + timeout;
    let mut sets = None;
    while Instant::now() < deadline {
        if let Ok(status) = admin.cluster_status().await {
            let mine: Vec<_> = status.partitions.iter().filter(|p| p.topic == topic).collect();
            sets = Some(mine.iter().map(|p| (p.partition, p.replicas.clone())).collect());
            let caught_up = !mine.is_empty()
                && mine.iter().all(|p| {
                    p.status.as_ref().is_ok_and(|s| {
                        s.followers.len() + 1 >= p.replicas.len()
                            && s.followers.iter().all(|f| f.lag == Some(0))
                    })
                });
            if caught_up {
                return (true, sets);
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    (false, sets)
}

/// Prints a summary line.
pub fn print_summary(s: &Summary) {
    eprintln!(
        "ferrolog-jepsen: {} — {} ops, {} sends ok / {} info / {} fail, {} values acknowledged, {} read, {} faults; anomalies: {}{}",
        if s.valid { "VALID" } else { "INVALID" },
        s.ops,
        s.sends_ok,
        s.sends_info,
        s.sends_fail,
        s.values_acknowledged,
        s.values_read,
        s.fault_events,
        if s.anomalies.is_empty() { "none".to_owned() } else { format!("{:?}", s.anomalies) },
        if s.problems.is_empty() {
            String::new()
        } else {
            format!("; problems: {} (below)", s.problems.len())
        },
    );
    for p in &s.problems {
        eprintln!("ferrolog-jepsen: problem: {p}");
    }
    if let Some((offsets, tombstones, keys, excused)) = s.compaction {
        eprintln!(
            "ferrolog-jepsen: compacted topic: the final read found {offsets} acknowledged offsets removed \
             ({tombstones} of them tombstones); {keys} keys' final state checked, {excused} of them deleted \
             only if an unanswered tombstone was stored"
        );
    }
    eprintln!("ferrolog-jepsen: results in {}", s.dir.display());
}

/// Refuses a run directory that exists and is not empty.
///
/// # Errors
/// If it does.
pub fn fresh_dir(dir: &Path) -> anyhow::Result<()> {
    if dir.exists() && std::fs::read_dir(dir)?.next().is_some() {
        bail!("{} exists and is not empty", dir.display());
    }
    Ok(())
}

//! `ferrolog dev`: a 3-broker cluster on 127.0.0.1 as child processes of
//! this one, plus (unless `--no-demo`) a demo producer and consumer on
//! topic `demo` with a status line every second.
//!
//! Broker i (1..=3) listens on 127.0.0.1:940i (clients) and :950i (peers),
//! keeps its data, config and log in `<dir>/broker-i/`, and runs as this
//! executable with `broker run --config <dir>/broker-i/broker.toml`, named
//! `ferrolog-broker` in `ps`. A broker that exits is reported with the
//! command to restart it by hand, and never restarted automatically, so
//! that killing one (`kill -9`) shows a failover. Ctrl-C stops everything.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use ferrolog_broker::config::BrokerConfig;
use ferrolog_client::error::ErrorCode;
use ferrolog_client::{
    Admin, Consumer, ConsumerConfig, MetadataCache, Producer, ProducerConfig, Record, Seek,
};
use tokio::sync::mpsc;

/// Brokers in the dev cluster.
const BROKERS: u32 = 3;
/// The demo topic and its shape.
const DEMO_TOPIC: &str = "demo";
const DEMO_PARTITIONS: u32 = 3;
/// Records the demo producer sends per second.
const DEMO_RECORDS_PER_SECOND: u64 = 5;
/// How long to wait for the cluster to form.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long brokers get to stop after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// `ferrolog dev` flags.
#[derive(Args, Debug)]
pub struct DevArgs {
    /// Where the brokers keep their data, configs and logs.
    #[arg(long, default_value = "./ferrolog-data")]
    dir: PathBuf,
    /// Only run the cluster: no demo topic, producer or consumer.
    #[arg(long)]
    no_demo: bool,
    /// Broker i's client port is this plus i (for tests; new configs only).
    #[arg(long, default_value_t = 9400, hide = true)]
    client_port_base: u16,
    /// Broker i's peer port is this plus i (for tests; new configs only).
    #[arg(long, default_value_t = 9500, hide = true)]
    peer_port_base: u16,
    /// Broker i's Kafka port is this plus i - 1: 9092, 9093, 9094 (for
    /// tests; new configs only).
    #[arg(long, default_value_t = 9092, hide = true)]
    kafka_port_base: u16,
}

/// Where broker i listens: `client_base + i` and `peer_base + i` on 127.0.0.1.
#[derive(Debug, Clone, Copy)]
struct Ports {
    client_base: u16,
    peer_base: u16,
    kafka_base: u16,
}

impl Ports {
    fn client(self, id: u32) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.client_base.saturating_add(id as u16)))
    }

    fn peer(self, id: u32) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.peer_base.saturating_add(id as u16)))
    }

    fn kafka(self, id: u32) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.kafka_base.saturating_add(id as u16 - 1)))
    }
}

/// One broker of the dev cluster.
struct Slot {
    id: u32,
    client_addr: SocketAddr,
    peer_addr: SocketAddr,
    kafka_addr: SocketAddr,
    config_path: PathBuf,
    log_path: PathBuf,
}

/// The config of broker `id`.
fn broker_config(id: u32, dir: &Path, ports: Ports) -> BrokerConfig {
    let mut c = BrokerConfig {
        node_id: id,
        client_addr: ports.client(id),
        peer_addr: ports.peer(id),
        kafka_addr: ports.kafka(id),
        data_dir: dir.join(format!("broker-{id}")),
        ..BrokerConfig::default()
    };
    c.initial_cluster = (1..=BROKERS).map(|i| (i, ports.peer(i))).collect();
    c
}

/// Writes each broker's config unless it exists (a restart reuses it).
fn prepare(dir: &Path, ports: Ports) -> anyhow::Result<Vec<Slot>> {
    let mut slots = Vec::new();
    for id in 1..=BROKERS {
        let config = broker_config(id, dir, ports);
        std::fs::create_dir_all(&config.data_dir)
            .with_context(|| format!("creating {}", config.data_dir.display()))?;
        let config_path = config.data_dir.join("broker.toml");
        let (client_addr, peer_addr, kafka_addr) = if config_path.exists() {
            // Reuse, and report, what the existing file says.
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("reading {}", config_path.display()))?;
            let existing =
                BrokerConfig::from_toml(&text).with_context(|| format!("in {}", config_path.display()))?;
            // A file written before the Kafka listener existed has the
            // default Kafka address for every broker: give each its own.
            let kafka = if existing.kafka_addr == BrokerConfig::default().kafka_addr && id != 1 {
                ports.kafka(id)
            } else {
                existing.kafka_addr
            };
            (existing.client_addr, existing.peer_addr, kafka)
        } else {
            let text = format!(
                "# Written by `ferrolog dev` for broker {id}; edit freely, it is not rewritten.\n{}",
                config.to_toml()?
            );
            std::fs::write(&config_path, text)
                .with_context(|| format!("writing {}", config_path.display()))?;
            (config.client_addr, config.peer_addr, config.kafka_addr)
        };
        slots.push(Slot {
            id,
            client_addr,
            peer_addr,
            kafka_addr,
            config_path,
            log_path: config.data_dir.join("broker.log"),
        });
    }
    Ok(slots)
}

/// Fails early, with a useful message, if a port is taken (most often by
/// the brokers of an earlier `ferrolog dev` that is still running).
fn check_ports(slots: &[Slot]) -> anyhow::Result<()> {
    for s in slots {
        for addr in [s.client_addr, s.peer_addr, s.kafka_addr] {
            if let Err(e) = TcpListener::bind(addr) {
                bail!(
                    "cannot use {addr} for broker {}: {e}. Is another `ferrolog dev` (or a broker) still running? \
                     `pgrep -af 'ferrolog.*broker'` lists them (a broker restarted by hand runs as `ferrolog broker run`).",
                    s.id
                );
            }
        }
    }
    Ok(())
}

/// Starts broker `slot` as a child process: this executable, shown as
/// `ferrolog-broker`, its output appended to its log file, in its own
/// process group (so Ctrl-C reaches only us, and we stop it in order), and
/// sent SIGTERM by the kernel if we die without stopping it.
///
/// Must be called on the main thread: the parent-death signal is tied to
/// the thread that forks, and the main thread lives until the process exits.
fn spawn_broker(exe: &Path, slot: &Slot) -> anyhow::Result<tokio::process::Child> {
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&slot.log_path)
        .with_context(|| format!("opening {}", slot.log_path.display()))?;
    writeln!(
        log,
        "==== ferrolog dev: starting broker {} (unix time {} s) ====",
        slot.id,
        unix_now_ms() / 1000
    )?;
    let stderr = log.try_clone()?;
    let mut command = tokio::process::Command::new(exe);
    command
        .arg0("ferrolog-broker")
        .arg("broker")
        .arg("run")
        .arg("--config")
        .arg(&slot.config_path)
        .arg("--kafka-addr")
        .arg(slot.kafka_addr.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(stderr))
        .process_group(0)
        .kill_on_drop(false);
    // SAFETY: the closure runs in the forked child before exec and only
    // calls prctl(2), which is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.spawn().with_context(|| format!("starting broker {} ({})", slot.id, exe.display()))
}

fn unix_now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn describe_exit(status: &std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(0), _) => "exited normally".to_owned(),
            (Some(code), _) => format!("exited with code {code}"),
            (None, Some(sig)) => format!("was killed by signal {sig}{}", signal_name(sig)),
            (None, None) => format!("ended ({s})"),
        },
        Err(e) => format!("could not be waited for: {e}"),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => " (SIGKILL)",
        libc::SIGTERM => " (SIGTERM)",
        libc::SIGINT => " (SIGINT)",
        libc::SIGSEGV => " (SIGSEGV)",
        libc::SIGABRT => " (SIGABRT)",
        _ => "",
    }
}

/// The last `n` lines of a log file (to show why a broker stopped).
fn tail(path: &Path, n: usize) -> Vec<String> {
    let text = std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].iter().map(|l| (*l).to_owned()).collect()
}

/// Runs `ferrolog dev`.
pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = args.dir.canonicalize().with_context(|| format!("resolving {}", args.dir.display()))?;
    let exe = std::env::current_exe().context("finding this executable")?;
    let slots = prepare(
        &dir,
        Ports {
            client_base: args.client_port_base,
            peer_base: args.peer_port_base,
            kafka_base: args.kafka_port_base,
        },
    )?;
    check_ports(&slots)?;

    let (exits_tx, mut exits) = mpsc::unbounded_channel::<(u32, std::io::Result<ExitStatus>)>();
    let mut running: BTreeMap<u32, u32> = BTreeMap::new();
    for slot in &slots {
        let mut child = spawn_broker(&exe, slot)?;
        let pid = child.id().unwrap_or(0);
        running.insert(slot.id, pid);
        let (tx, id) = (exits_tx.clone(), slot.id);
        tokio::spawn(async move {
            let status = child.wait().await;
            let _ = tx.send((id, status));
        });
    }

    let bootstrap: Vec<String> = slots.iter().map(|s| s.client_addr.to_string()).collect();
    // How to run the client commands against this cluster.
    let ferrolog = if bootstrap.join(",") == crate::DEFAULT_BOOTSTRAP {
        exe.display().to_string()
    } else {
        format!("{} --bootstrap {}", exe.display(), bootstrap.join(","))
    };
    println!("ferrolog dev: {BROKERS} brokers on 127.0.0.1, data in {}", dir.display());
    println!("  bootstrap: {}", bootstrap.join(","));
    let kafka: Vec<String> = slots.iter().map(|s| s.kafka_addr.to_string()).collect();
    println!("  Kafka clients: bootstrap.servers={}", kafka.join(","));
    for s in &slots {
        println!(
            "  broker {}: pid {:<7} client {}  kafka {}  peer {}  log {}",
            s.id,
            running.get(&s.id).copied().unwrap_or(0),
            s.client_addr,
            s.kafka_addr,
            s.peer_addr,
            s.log_path.display()
        );
    }
    println!("  restart a stopped broker by hand with:");
    for s in &slots {
        println!("    {}", restart_command(&exe, s));
    }

    let meta = MetadataCache::new(ferrolog_client::ClientConfig::new(bootstrap.clone()))?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);

    let started = Instant::now();
    let ready = wait_ready(&meta);
    tokio::pin!(ready);
    let mut demo: Option<tokio::task::JoinHandle<()>> = None;
    let mut is_ready = false;
    loop {
        tokio::select! {
            _ = &mut ctrl_c => break,
            _ = term.recv() => break,
            r = &mut ready, if !is_ready => {
                is_ready = true;
                match r {
                    Ok(controller) => {
                        println!(
                            "cluster ready after {:.1} s: {BROKERS} brokers, controller is broker {controller}. Ctrl-C stops it.",
                            started.elapsed().as_secs_f64()
                        );
                        if args.no_demo {
                            println!("try: {ferrolog} topic create events --partitions 3 --replication-factor 3");
                        } else {
                            println!(
                                "in another terminal try: {ferrolog} cluster status   or   {ferrolog} consume demo --follow --output json"
                            );
                            demo = Some(tokio::spawn(run_demo(meta.clone())));
                        }
                    }
                    Err(e) => eprintln!("the cluster did not become ready: {e:#}; still watching the brokers (Ctrl-C stops them)"),
                }
            }
            Some((id, status)) = exits.recv() => {
                running.remove(&id);
                report_exit(&exe, &slots, id, &status);
            }
        }
    }

    if let Some(demo) = demo {
        demo.abort();
    }
    println!("stopping {} broker(s)...", running.len());
    for (&id, &pid) in &running {
        if pid != 0 {
            // SAFETY: kill(2) with a pid of our own child, which we have not
            // reaped (its exit would have been reported on `exits`).
            if unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) } != 0 {
                eprintln!("broker {id}: SIGTERM failed: {}", std::io::Error::last_os_error());
            }
        }
    }
    let deadline = tokio::time::Instant::now() + STOP_TIMEOUT;
    while !running.is_empty() {
        match tokio::time::timeout_at(deadline, exits.recv()).await {
            Ok(Some((id, status))) => {
                running.remove(&id);
                println!("  broker {id} {}", describe_exit(&status));
            }
            Ok(None) => break,
            Err(_) => {
                for (&id, &pid) in &running {
                    eprintln!(
                        "  broker {id} (pid {pid}) did not stop within {} s: SIGKILL",
                        STOP_TIMEOUT.as_secs()
                    );
                    // SAFETY: as above.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                }
                deadline_kill_wait(&mut exits, &mut running).await;
                break;
            }
        }
    }
    println!("stopped; data kept in {}", dir.display());
    Ok(())
}

async fn deadline_kill_wait(
    exits: &mut mpsc::UnboundedReceiver<(u32, std::io::Result<ExitStatus>)>,
    running: &mut BTreeMap<u32, u32>,
) {
    while !running.is_empty() {
        match tokio::time::timeout(Duration::from_secs(5), exits.recv()).await {
            Ok(Some((id, _))) => {
                running.remove(&id);
            }
            _ => return,
        }
    }
}

fn restart_command(exe: &Path, slot: &Slot) -> String {
    format!(
        "{} broker run --config {} --kafka-addr {}",
        exe.display(),
        slot.config_path.display(),
        slot.kafka_addr
    )
}

fn report_exit(exe: &Path, slots: &[Slot], id: u32, status: &std::io::Result<ExitStatus>) {
    let Some(slot) = slots.iter().find(|s| s.id == id) else { return };
    println!("!! broker {id} {} (it is not restarted automatically)", describe_exit(status));
    let clean_or_killed = matches!(status, Ok(s) if s.code() == Some(0) || s.signal().is_some());
    if !clean_or_killed {
        println!("   last lines of {}:", slot.log_path.display());
        for line in tail(&slot.log_path, 8) {
            println!("   | {line}");
        }
    }
    println!("   restart it in another terminal with: {}", restart_command(exe, slot));
}

/// Waits until `Metadata` shows every broker alive and a controller;
/// returns the controller's id.
async fn wait_ready(meta: &Arc<MetadataCache>) -> anyhow::Result<u32> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut last = String::from("no answer yet");
    while Instant::now() < deadline {
        match meta.refresh().await {
            Ok(c)
                if c.brokers.len() as u32 >= BROKERS
                    && c.controller != 0
                    && c.brokers.values().all(|b| b.alive) =>
            {
                return Ok(c.controller);
            }
            Ok(c) => {
                last = format!(
                    "{} brokers known, {} alive, controller {}",
                    c.brokers.len(),
                    c.brokers.values().filter(|b| b.alive).count(),
                    c.controller
                )
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("not ready after {} s: {last}", READY_TIMEOUT.as_secs())
}

/// Counters of the demo, shown by the status line.
#[derive(Default)]
struct DemoStats {
    produced: AtomicU64,
    acked: AtomicU64,
    failed: AtomicU64,
    consumed: AtomicU64,
}

/// Creates `demo` if needed, then produces, consumes and reports until aborted.
async fn run_demo(meta: Arc<MetadataCache>) {
    let admin = Admin::new(meta.clone()).with_timeout(Duration::from_secs(60));
    match admin.create_topic(DEMO_TOPIC, DEMO_PARTITIONS, BROKERS).await {
        Ok(()) => println!(
            "demo: created topic {DEMO_TOPIC} ({DEMO_PARTITIONS} partitions, replication factor {BROKERS})"
        ),
        Err(e) if e.code() == Some(ErrorCode::TopicAlreadyExists) => {
            println!("demo: topic {DEMO_TOPIC} exists; reusing it")
        }
        Err(e) => {
            eprintln!("demo: cannot create topic {DEMO_TOPIC}: {e}; the demo does not run");
            return;
        }
    }
    if let Err(e) = admin.wait_for_leaders(DEMO_TOPIC, Duration::from_secs(60)).await {
        eprintln!("demo: topic {DEMO_TOPIC} has no leaders yet ({e}); going on anyway");
    }
    let stats = Arc::new(DemoStats::default());
    let positions = Arc::new(std::sync::Mutex::new(BTreeMap::<u32, u64>::new()));

    // The consumer starts at the end, so it shows this run's records.
    let mut consumer = Consumer::new(meta.clone(), ConsumerConfig::default());
    if let Err(e) = consumer.assign_topic(DEMO_TOPIC, Seek::Latest, Duration::from_secs(30)).await {
        eprintln!("demo: cannot read {DEMO_TOPIC}: {e}; the demo does not run");
        return;
    }
    // Resolve "latest" before producing, so the first records are seen.
    let _ = consumer.poll(Duration::from_millis(300)).await;
    let producer = match Producer::new(meta.clone(), ProducerConfig::default()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("demo: cannot start the producer: {e}");
            return;
        }
    };
    println!(
        "demo: producing {DEMO_RECORDS_PER_SECOND} sensor readings/s to {DEMO_TOPIC} and reading them back; \
         try `kill -9` on a broker's pid"
    );
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(demo_produce(producer, stats.clone()));
    tasks.spawn(demo_consume(consumer, stats.clone(), positions.clone()));
    tasks.spawn(demo_status(meta, stats, positions));
    // Runs until aborted; the tasks end with the JoinSet when it is dropped.
    while tasks.join_next().await.is_some() {}
}

/// The demo's sensors, used as record keys: two per partition of `demo`
/// under Kafka's partitioner with 3 partitions.
const SENSORS: [&str; 6] = ["garage", "cellar", "kitchen", "office", "porch", "lab"];

async fn demo_produce(producer: Producer, stats: Arc<DemoStats>) {
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / DEMO_RECORDS_PER_SECOND));
    let mut seq = 0u64;
    loop {
        tick.tick().await;
        seq += 1;
        // A made-up temperature that wanders deterministically per sensor.
        let index = (seq % SENSORS.len() as u64) as usize;
        let sensor = SENSORS[index];
        let reading = 18.0 + ((seq * 37 + index as u64 * 11) % 80) as f64 / 10.0;
        let now = unix_now_ms();
        let value = format!(r#"{{"sensor":"{sensor}","reading":{reading:.1},"seq":{seq},"ts":{now}}}"#);
        let record = Record::new(value).with_key(sensor).with_timestamp_ms(now);
        let delivery = producer.send(DEMO_TOPIC, record);
        stats.produced.fetch_add(1, Ordering::Relaxed);
        let stats = stats.clone();
        tokio::spawn(async move {
            match delivery.await {
                Ok(_) => stats.acked.fetch_add(1, Ordering::Relaxed),
                Err(e) => {
                    eprintln!("demo: record {seq} not stored: {e}");
                    stats.failed.fetch_add(1, Ordering::Relaxed)
                }
            };
        });
    }
}

async fn demo_consume(
    mut consumer: Consumer,
    stats: Arc<DemoStats>,
    positions: Arc<std::sync::Mutex<BTreeMap<u32, u64>>>,
) {
    loop {
        match consumer.poll(Duration::from_secs(1)).await {
            Ok(records) => {
                let mut p = positions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                for r in &records {
                    p.insert(r.partition, r.offset);
                }
                stats.consumed.fetch_add(records.len() as u64, Ordering::Relaxed);
            }
            Err(ferrolog_client::Error::OffsetOutOfRange { topic, partition, log_start_offset, .. }) => {
                eprintln!("demo: {topic}/{partition} position out of range; moving to {log_start_offset}");
                consumer.seek(&topic, partition, Seek::Offset(log_start_offset));
            }
            Err(e) => {
                eprintln!("demo: reading failed: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

async fn demo_status(
    meta: Arc<MetadataCache>,
    stats: Arc<DemoStats>,
    positions: Arc<std::sync::Mutex<BTreeMap<u32, u64>>>,
) {
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    loop {
        tick.tick().await;
        // Fresh leaders every second, so a failover shows; a failed refresh
        // keeps the last known ones.
        let cluster = match meta.refresh().await {
            Ok(c) => c,
            Err(_) => meta.snapshot(),
        };
        let produced = stats.produced.load(Ordering::Relaxed);
        let acked = stats.acked.load(Ordering::Relaxed);
        let failed = stats.failed.load(Ordering::Relaxed);
        let consumed = stats.consumed.load(Ordering::Relaxed);
        let offsets = positions.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let mut parts = Vec::new();
        for p in 0..DEMO_PARTITIONS {
            let offset = offsets.get(&p).map_or("-".to_owned(), u64::to_string);
            let leader = cluster.leader(DEMO_TOPIC, p).map_or("?".to_owned(), |(id, _)| id.to_string());
            parts.push(format!("p{p}@{offset} (leader {leader})"));
        }
        let pending = produced.saturating_sub(acked + failed);
        println!(
            "[{:>4}s] produced {produced} (stored {acked}, waiting {pending}, failed {failed}), consumed {consumed} | last offsets: {}",
            started.elapsed().as_secs(),
            parts.join("  ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_follow_the_port_plan_and_validate() {
        let dir = Path::new("/tmp/x");
        for id in 1..=BROKERS {
            let c = broker_config(id, dir, Ports { client_base: 9400, peer_base: 9500, kafka_base: 9092 });
            c.validate().expect("valid");
            assert_eq!(c.client_addr.port(), 9400 + id as u16);
            assert_eq!(c.peer_addr.port(), 9500 + id as u16);
            assert_eq!(c.data_dir, dir.join(format!("broker-{id}")));
            assert_eq!(c.initial_cluster.len(), 3);
            let back = BrokerConfig::from_toml(&c.to_toml().expect("toml")).expect("parse");
            assert_eq!(back, c);
        }
    }

    #[test]
    fn demo_sensors_cover_every_partition() {
        let mut per_partition = [0; DEMO_PARTITIONS as usize];
        for s in SENSORS {
            per_partition
                [ferrolog_client::partitioner::partition_for_key(s.as_bytes(), DEMO_PARTITIONS) as usize] +=
                1;
        }
        assert_eq!(per_partition, [2, 2, 2]);
    }

    #[test]
    fn exits_are_described() {
        let killed = Ok(ExitStatus::from_raw(libc::SIGKILL));
        assert_eq!(describe_exit(&killed), "was killed by signal 9 (SIGKILL)");
        let code = Ok(ExitStatus::from_raw(3 << 8));
        assert_eq!(describe_exit(&code), "exited with code 3");
    }
}

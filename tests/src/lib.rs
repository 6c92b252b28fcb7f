//! Harness for integration tests with real broker processes on loopback.
//!
//! [`Cluster`] starts N `ferrolog-broker` processes, each on its own
//! loopback address (127.0.0.x) with its own data directory, and can
//! SIGKILL, restart or wipe any of them. Processes are killed when the
//! cluster is dropped. [`Cluster::start_through_proxy`] puts
//! `ferrolog-jepsen`'s fault-injecting TCP proxy on every link between
//! brokers, for tests of partitions.

pub mod fuse_disk;
pub mod kafka_tools;
pub mod load;
pub mod raw;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
pub use ferrolog_jepsen::proxy::ProxyNet;
use ferrolog_proto::client::MetadataRequest;
use ferrolog_proto::client::ferrolog_client::FerrologClient;

/// One broker process slot.
#[derive(Debug)]
pub struct BrokerProc {
    /// Broker id (1-based).
    pub id: u32,
    /// Client API address.
    pub client_addr: SocketAddr,
    /// Peer address.
    pub peer_addr: SocketAddr,
    /// Kafka listener address.
    pub kafka_addr: SocketAddr,
    /// Data directory.
    pub data_dir: PathBuf,
    /// Its log file.
    pub log: PathBuf,
    child: Option<Child>,
}

/// A cluster of real broker processes.
#[derive(Debug)]
pub struct Cluster {
    /// The brokers, index = id - 1.
    pub brokers: Vec<BrokerProc>,
    initial_cluster: String,
    binary: PathBuf,
    binary_args: Vec<String>,
    /// Flags of one broker only (its `--peer-routes`), index = id - 1.
    broker_args: Vec<Vec<String>>,
    /// Environment of one broker only, index = id - 1.
    broker_env: Vec<Vec<(String, String)>>,
    extra_env: Vec<(String, String)>,
    _root: tempfile::TempDir,
}

/// A port derived from the test's name and the broker id, so concurrently
/// running test binaries do not collide (each also uses its own 127.0.0.x).
fn port_base(name: &str) -> u16 {
    let h = name.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    20_000 + (h % 20_000) as u16
}

impl Cluster {
    /// Starts `n` brokers of the test `name`, using `binary` (the test's
    /// `env!("CARGO_BIN_EXE_ferrolog-test-broker")`). `env` is passed to every
    /// broker (e.g. `FERROLOG_...` overrides).
    ///
    /// # Errors
    /// If a broker cannot be started or the cluster does not form in 30 s.
    pub async fn start(name: &str, binary: &str, n: u32, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        Self::start_with(name, binary, &[], n, env).await
    }

    /// As [`Cluster::start`], running `binary binary_args... <broker flags>`
    /// (e.g. a tool that runs a broker with `ferrolog broker`).
    ///
    /// # Errors
    /// As [`Cluster::start`].
    pub async fn start_with(
        name: &str,
        binary: &str,
        binary_args: &[&str],
        n: u32,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let mut c = Self::describe(name, binary, binary_args, n, env)?;
        c.launch().await?;
        Ok(c)
    }

    /// As [`Cluster::start`] without starting anything: the data
    /// directories are named but not created, for a test to prepare them
    /// (e.g. mount a small file system there) before [`Cluster::launch`].
    ///
    /// # Errors
    /// If the temporary directory cannot be made.
    pub fn prepare(name: &str, binary: &str, n: u32, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        Self::describe(name, binary, &[], n, env)
    }

    /// As [`Cluster::start`], with every broker dialling its peers through
    /// a [`ProxyNet`] (returned, to cut and heal links between brokers).
    ///
    /// # Errors
    /// As [`Cluster::start`], or a proxy listener that cannot bind.
    pub async fn start_through_proxy(name: &str, binary: &str, n: u32) -> anyhow::Result<(Self, ProxyNet)> {
        let mut c = Self::describe(name, binary, &[], n, &[])?;
        let ips: Vec<IpAddr> = c.brokers.iter().map(|b| b.peer_addr.ip()).collect();
        let peer_port = c.brokers[0].peer_addr.port();
        let proxy = ProxyNet::start(&ips, peer_port).await?;
        c.broker_args =
            (1..=n).map(|id| vec!["--peer-routes".to_owned(), proxy.peer_routes(id, peer_port)]).collect();
        c.launch().await?;
        Ok((c, proxy))
    }

    fn describe(
        name: &str,
        binary: &str,
        binary_args: &[&str],
        n: u32,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let mut root = tempfile::Builder::new().prefix(&format!("ferrolog-{name}-")).tempdir()?;
        // FERROLOG_KEEP_DATA=1 keeps the data directories and logs for a
        // post-mortem (their path is printed).
        if std::env::var_os("FERROLOG_KEEP_DATA").is_some() {
            root.disable_cleanup(true);
            eprintln!("cluster {name}: data and logs kept in {}", root.path().display());
        }
        let base = port_base(name);
        let brokers: Vec<BrokerProc> = (1..=n)
            .map(|id| {
                let ip = format!("127.0.0.{}", id + 1);
                BrokerProc {
                    id,
                    client_addr: format!("{ip}:{base}").parse().expect("addr"),
                    peer_addr: format!("{ip}:{}", base + 1).parse().expect("addr"),
                    kafka_addr: format!("{ip}:{}", base + 2).parse().expect("addr"),
                    data_dir: root.path().join(format!("broker-{id}")),
                    log: root.path().join(format!("broker-{id}.log")),
                    child: None,
                }
            })
            .collect();
        let initial_cluster =
            brokers.iter().map(|b| format!("{}={}", b.id, b.peer_addr)).collect::<Vec<_>>().join(",");
        Ok(Self {
            brokers,
            initial_cluster,
            binary: PathBuf::from(binary),
            binary_args: binary_args.iter().map(|a| a.to_string()).collect(),
            broker_args: vec![Vec::new(); n as usize],
            broker_env: vec![Vec::new(); n as usize],
            extra_env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            _root: root,
        })
    }

    /// Starts every broker of a [prepared](Cluster::prepare) cluster and
    /// waits until it forms.
    ///
    /// # Errors
    /// As [`Cluster::start`].
    pub async fn launch(&mut self) -> anyhow::Result<()> {
        let n = self.brokers.len() as u32;
        for id in 1..=n {
            self.spawn(id)?;
        }
        self.wait_ready(n as usize, Duration::from_secs(30)).await
    }

    /// Comma-separated Kafka listener addresses, for a Kafka client's
    /// `bootstrap.servers`.
    pub fn kafka_bootstrap(&self) -> String {
        self.brokers.iter().map(|b| b.kafka_addr.to_string()).collect::<Vec<_>>().join(",")
    }

    /// Comma-separated client addresses, for a client's bootstrap list.
    pub fn bootstrap(&self) -> String {
        self.brokers.iter().map(|b| b.client_addr.to_string()).collect::<Vec<_>>().join(",")
    }

    /// The broker with id `id`.
    pub fn broker(&self, id: u32) -> &BrokerProc {
        &self.brokers[(id - 1) as usize]
    }

    /// Starts (or restarts) broker `id` on its data directory.
    ///
    /// # Errors
    /// If the process cannot be spawned.
    pub fn spawn(&mut self, id: u32) -> anyhow::Result<()> {
        let initial_cluster = self.initial_cluster.clone();
        let (binary, env, args) = (self.binary.clone(), self.extra_env.clone(), self.binary_args.clone());
        let own_args = self.broker_args[(id - 1) as usize].clone();
        let own_env = self.broker_env[(id - 1) as usize].clone();
        let b = &mut self.brokers[(id - 1) as usize];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&b.log)?;
        let child = Command::new(&binary)
            .args(args)
            .arg("--node-id")
            .arg(id.to_string())
            .arg("--client-addr")
            .arg(b.client_addr.to_string())
            .arg("--peer-addr")
            .arg(b.peer_addr.to_string())
            .arg("--kafka-addr")
            .arg(b.kafka_addr.to_string())
            .arg("--data-dir")
            .arg(&b.data_dir)
            .arg("--initial-cluster")
            .arg(&initial_cluster)
            .args(own_args)
            // The log filter: `FERROLOG_TEST_LOG`, else info; a `RUST_LOG`
            // in the cluster's or this broker's environment (a benchmark's
            // `FERROLOG_BENCH_BROKER_LOG`) comes after and wins.
            .env(
                "RUST_LOG",
                std::env::var("FERROLOG_TEST_LOG").unwrap_or_else(|_| "info,openraft=warn".into()),
            )
            .envs(env)
            .envs(own_env)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {}", binary.display()))?;
        b.child = Some(child);
        Ok(())
    }

    /// SIGKILLs broker `id` and reaps it.
    pub fn kill(&mut self, id: u32) {
        if let Some(mut c) = self.brokers[(id - 1) as usize].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGINT to broker `id` and waits up to `wait` for it to exit,
    /// then SIGKILLs it. Returns how long it took to exit by itself, or
    /// `None` if it had to be killed (or was not running).
    pub fn interrupt(&mut self, id: u32, wait: Duration) -> Option<Duration> {
        self.signal_and_wait(id, libc::SIGINT, wait)
    }

    /// As [`Cluster::interrupt`], with SIGTERM (what a service manager
    /// sends).
    pub fn terminate(&mut self, id: u32, wait: Duration) -> Option<Duration> {
        self.signal_and_wait(id, libc::SIGTERM, wait)
    }

    fn signal_and_wait(&mut self, id: u32, signal: libc::c_int, wait: Duration) -> Option<Duration> {
        let mut c = self.brokers[(id - 1) as usize].child.take()?;
        // SAFETY: kill(2) with a pid this harness spawned and has not reaped.
        unsafe { libc::kill(c.id() as libc::pid_t, signal) };
        let t0 = Instant::now();
        while t0.elapsed() < wait {
            if let Ok(Some(_)) = c.try_wait() {
                return Some(t0.elapsed());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }

    /// Size of broker `id`'s log file, bytes (all its runs appended).
    pub fn log_bytes(&self, id: u32) -> u64 {
        std::fs::metadata(&self.brokers[(id - 1) as usize].log).map(|m| m.len()).unwrap_or(0)
    }

    /// Number of brokers.
    pub fn size(&self) -> u32 {
        self.brokers.len() as u32
    }

    /// Whether broker `id`'s process, as the test started it, still runs
    /// (stopped by SIGSTOP counts as running): not killed by the test, not
    /// exited (a zombie waiting to be reaped counts as exited).
    pub fn is_running(&self, id: u32) -> bool {
        let Some(child) = self.brokers[(id - 1) as usize].child.as_ref() else { return false };
        std::fs::read_to_string(format!("/proc/{}/stat", child.id()))
            .ok()
            .and_then(|stat| stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()))
            .is_some_and(|state| state != 'Z' && state != 'X')
    }

    /// Gives broker `id` a new peer address (used from its next
    /// [`Cluster::spawn`]), and every broker's `--initial-cluster` entry for
    /// it, as an operator moving a broker would.
    pub fn set_peer_addr(&mut self, id: u32, addr: SocketAddr) {
        self.brokers[(id - 1) as usize].peer_addr = addr;
        self.initial_cluster =
            self.brokers.iter().map(|b| format!("{}={}", b.id, b.peer_addr)).collect::<Vec<_>>().join(",");
    }

    /// Sets `key`=`value` in broker `id`'s environment only (from its next
    /// [`Cluster::spawn`]), e.g. to run one broker of a mixed cluster.
    pub fn set_env(&mut self, id: u32, key: &str, value: &str) {
        self.broker_env[(id - 1) as usize].push((key.to_owned(), value.to_owned()));
    }

    /// Drops what [`Cluster::set_env`] set for broker `id`.
    pub fn clear_env(&mut self, id: u32) {
        self.broker_env[(id - 1) as usize].clear();
    }

    /// Kills broker `id` and deletes its data directory.
    pub fn wipe(&mut self, id: u32) {
        self.kill(id);
        let _ = std::fs::remove_dir_all(&self.brokers[(id - 1) as usize].data_dir);
    }

    /// Waits until some broker answers Metadata with `brokers` registered
    /// brokers that answer its pings, and a controller.
    ///
    /// # Errors
    /// On timeout, with the last answer or error.
    pub async fn wait_ready(&self, brokers: usize, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last = String::new();
        while Instant::now() < deadline {
            for b in self.brokers.iter().filter(|b| b.child.is_some()) {
                match metadata(b.client_addr).await {
                    Ok(m) if m.brokers.iter().filter(|b| b.alive).count() >= brokers && m.controller != 0 => {
                        return Ok(());
                    }
                    Ok(m) => last = format!("{} brokers, controller {}", m.brokers.len(), m.controller),
                    Err(e) => last = format!("{e:#}"),
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!("cluster not ready after {timeout:?}: {last}\n{}", self.logs_tail(60))
    }

    /// The last `n` lines of every broker log, for failure messages.
    pub fn logs_tail(&self, n: usize) -> String {
        let mut out = String::new();
        for b in &self.brokers {
            let text = std::fs::read_to_string(&b.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- broker {} ({})\n", b.id, b.log.display()));
            for l in &lines[lines.len().saturating_sub(n)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Process id of broker `id`, if running.
    pub fn pid(&self, id: u32) -> Option<u32> {
        self.brokers[(id - 1) as usize].child.as_ref().map(Child::id)
    }

    /// Data directory of broker `id`.
    pub fn data_dir(&self, id: u32) -> &Path {
        &self.brokers[(id - 1) as usize].data_dir
    }

    /// Resident memory of broker `id`'s process, bytes (see [`rss_bytes`]),
    /// if it runs.
    pub fn rss(&self, id: u32) -> Option<u64> {
        self.pid(id).and_then(rss_bytes)
    }

    /// Names of the replica directories in broker `id`'s data directory
    /// (`<data_dir>/partitions/<topic>-<partition>.g<group>`) whose name
    /// starts with `prefix`.
    pub fn replica_dirs(&self, id: u32, prefix: &str) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.data_dir(id).join("partitions")) else { return Vec::new() };
        entries
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(prefix))
            .collect()
    }
}

/// Resident memory of process `pid` (`VmRSS` of `/proc/<pid>/status`), bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What a broker logs when it applies a producer's batch out of sequence
/// (raft-store's state machine): a leader let a batch overtake the one
/// before it, whose records are then stored out of order. Never expected.
pub const OUT_OF_SEQUENCE: &str = "applied a batch out of producer sequence";

impl Cluster {
    /// Lines of the brokers' logs that show a batch applied out of its
    /// producer's sequence ([`OUT_OF_SEQUENCE`]), with their broker id.
    pub fn out_of_sequence_lines(&self) -> Vec<(u32, String)> {
        use std::io::BufRead;
        let mut found = Vec::new();
        for b in &self.brokers {
            let Ok(file) = std::fs::File::open(&b.log) else { continue };
            let lines = std::io::BufReader::new(file).lines().map_while(Result::ok);
            found.extend(lines.filter(|l| l.contains(OUT_OF_SEQUENCE)).map(|l| (b.id, l)));
        }
        found
    }

    /// Whether the brokers were told to run with an injected bug (their
    /// logs may then show anything).
    fn injects_bugs(&self) -> bool {
        let env = self.extra_env.iter().chain(self.broker_env.iter().flatten());
        env.into_iter().any(|(k, _)| k == "FERROLOG_INJECT_BUG")
    }
}

impl Drop for Cluster {
    /// Kills the brokers; then, unless the test is failing already or
    /// injected a bug, fails it if a broker applied a producer's batch out
    /// of sequence: every test with a cluster checks that invariant. (The
    /// line is a warning: a `FERROLOG_TEST_LOG` filter that drops warnings
    /// hides it.)
    fn drop(&mut self) {
        for b in &mut self.brokers {
            if let Some(mut c) = b.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if std::thread::panicking() || self.injects_bugs() {
            return;
        }
        let found = self.out_of_sequence_lines();
        assert!(found.is_empty(), "a broker applied a producer's batch out of sequence: {found:?}");
    }
}

/// A raw client to `addr`.
///
/// # Errors
/// If the connection fails.
pub async fn connect(addr: SocketAddr) -> anyhow::Result<FerrologClient<tonic::transport::Channel>> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(30))
        .connect()
        .await?;
    Ok(FerrologClient::new(ch).max_decoding_message_size(64 << 20))
}

/// One Metadata call to `addr`.
///
/// # Errors
/// Transport errors.
pub async fn metadata(addr: SocketAddr) -> anyhow::Result<ferrolog_proto::client::MetadataResponse> {
    Ok(connect(addr).await?.metadata(MetadataRequest { topics: vec![] }).await?.into_inner())
}

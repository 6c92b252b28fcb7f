//! The broker processes of a run: each `ferrolog-broker` in its own network
//! namespace (see [`crate::net`]), or on 127.0.99.x dialling its peers
//! through the proxy (see [`crate::proxy`]), with
//! its data directory and log file in the run directory. Start, SIGKILL,
//! SIGSTOP/SIGCONT, graceful stop, and `dump-log` of a stopped broker.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferrolog_client::{ClientConfig, MetadataCache};

use crate::checker::{CommittedMarker, ReplicaCopy, ReplicaRecord};

/// Client API port of every broker.
pub const CLIENT_PORT: u16 = 9092;
/// Broker-to-broker port of every broker.
pub const PEER_PORT: u16 = 9093;

/// Brokers' log filter unless `FERROLOG_JEPSEN_BROKER_LOG` says otherwise.
/// openraft warns on every heartbeat whose answer takes longer than
/// `heartbeat_interval`, thousands of lines under the netem fault; those
/// are left out.
const DEFAULT_BROKER_LOG: &str = "info,openraft=warn,openraft::core::heartbeat=error";

/// One broker slot: a machine (address, namespace, data directory) that
/// runs one broker process at a time.
#[derive(Debug)]
pub struct Broker {
    /// Slot number, from 1: the founding broker's id, and how faults,
    /// logs and dumps name the slot.
    pub id: u32,
    /// The broker id the slot runs now: its slot number until it is
    /// decommissioned and re-added empty, when the controller assigns a
    /// new one ([`Cluster::rejoin_empty`]).
    pub broker_id: u32,
    /// Being decommissioned: membership operations leave it alone.
    pub retiring: bool,
    /// Started with `--join` (re-added) rather than `--initial-cluster`.
    joined: bool,
    /// Its address.
    pub ip: IpAddr,
    /// Its network namespace, if any.
    pub ns: Option<String>,
    /// Its `--peer-routes`, if it dials its peers through a proxy.
    pub peer_routes: Option<String>,
    /// Its data directory.
    pub data_dir: PathBuf,
    /// Its log file (appended to across restarts).
    pub log: PathBuf,
    child: Option<Child>,
    paused: bool,
}

impl Broker {
    /// Client API address.
    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, CLIENT_PORT)
    }

    /// Peer address.
    pub fn peer_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, PEER_PORT)
    }
}

/// Where one broker runs and how it reaches its peers.
#[derive(Debug, Clone)]
pub struct Site {
    /// Its address.
    pub ip: IpAddr,
    /// Its network namespace, if any.
    pub ns: Option<String>,
    /// Its `--peer-routes`, if any.
    pub peer_routes: Option<String>,
}

/// The brokers of a run.
#[derive(Debug)]
pub struct Cluster {
    /// Index = id - 1.
    pub brokers: Vec<Broker>,
    binary: PathBuf,
    initial_cluster: String,
    /// The config file every broker reads.
    config: PathBuf,
    /// The in-memory disks at the data directories (index = id - 1), if
    /// [`Cluster::use_memory_disks`] mounted them; unmounted after the
    /// brokers are killed (fields drop after `Drop::drop`).
    disks: Vec<crate::disk::FuseDisk>,
}

fn signal(pid: u32, sig: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return };
    // SAFETY: kill(2) with a pid of a child this process spawned and has not reaped.
    unsafe {
        libc::kill(pid, sig);
    }
}

impl Cluster {
    /// Describes brokers `1..=sites.len()` at `sites`, keeping data and
    /// logs under `dir`, their followers going dormant after
    /// `dormant_after_ms` idle (`raft.dormant_after_ms`), with the further
    /// TOML sections `more_config` (e.g. `[compaction]`). Starts nothing.
    ///
    /// # Errors
    /// The brokers' config file cannot be written in `dir`.
    pub fn new(
        binary: &Path,
        dir: &Path,
        sites: &[Site],
        dormant_after_ms: u64,
        more_config: &str,
    ) -> anyhow::Result<Self> {
        let config = dir.join("broker.toml");
        std::fs::write(&config, format!("[raft]\ndormant_after_ms = {dormant_after_ms}\n{more_config}"))
            .with_context(|| format!("writing {}", config.display()))?;
        let brokers: Vec<Broker> = sites
            .iter()
            .enumerate()
            .map(|(i, site)| {
                let id = i as u32 + 1;
                Broker {
                    id,
                    broker_id: id,
                    retiring: false,
                    joined: false,
                    ip: site.ip,
                    ns: site.ns.clone(),
                    peer_routes: site.peer_routes.clone(),
                    data_dir: dir.join(format!("data/broker-{id}")),
                    log: dir.join(format!("broker-{id}.log")),
                    child: None,
                    paused: false,
                }
            })
            .collect();
        let initial_cluster =
            brokers.iter().map(|b| format!("{}={}", b.id, b.peer_addr())).collect::<Vec<_>>().join(",");
        Ok(Cluster { brokers, binary: binary.to_owned(), initial_cluster, config, disks: Vec::new() })
    }

    /// Mounts an in-memory disk that keeps only what fsync covered
    /// ([`crate::disk::FuseDisk`], seeded by `seed` and the slot) at every
    /// broker's data directory, for [`Cluster::power_cut`]. Before any
    /// broker starts. `lie_about`: an extension whose files' fsync does
    /// nothing (a negative control, [`crate::disk::FuseDisk::lie_about_fsync_of`]).
    ///
    /// # Errors
    /// A disk that cannot be mounted (needs root and `/dev/fuse`).
    pub fn use_memory_disks(&mut self, seed: u64, lie_about: Option<&str>) -> anyhow::Result<()> {
        anyhow::ensure!(self.disks.is_empty(), "the memory disks are mounted already");
        for b in &self.brokers {
            let disk = crate::disk::FuseDisk::mount(
                &b.data_dir,
                seed.wrapping_mul(31).wrapping_add(u64::from(b.id)),
            )?;
            disk.lie_about_fsync_of(lie_about);
            self.disks.push(disk);
        }
        Ok(())
    }

    /// Cuts the power of brokers `ids` at once: SIGKILLs them all, then
    /// their disks lose every write and directory entry no completed fsync
    /// covered, the next unsynced write of each file torn at a random byte
    /// (see [`crate::disk::FuseDisk::power_cut`]). Restart them with
    /// [`Cluster::spawn`].
    ///
    /// # Errors
    /// The cluster runs on real disks ([`Cluster::use_memory_disks`] was
    /// not called).
    pub fn power_cut(&mut self, ids: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(!self.disks.is_empty(), "the power fault needs the memory disks");
        for id in ids {
            self.resume(*id);
            self.kill(*id);
        }
        for id in ids {
            self.disks[(id - 1) as usize].power_cut(ferrolog_raft_store::vfs::PowerCut::Torn);
        }
        Ok(())
    }

    /// Counters of the memory disks, summed (`None` on real disks).
    pub fn disk_stats(&self) -> Option<ferrolog_raft_store::vfs::FaultyStats> {
        let mut all = self.disks.first()?.stats();
        for d in &self.disks[1..] {
            let s = d.stats();
            all.file_syncs += s.file_syncs;
            all.dir_syncs += s.dir_syncs;
            all.injected_errors += s.injected_errors;
            all.power_cuts += s.power_cuts;
            all.lost_bytes += s.lost_bytes;
        }
        Some(all)
    }

    /// Slot numbers (the founding broker ids).
    pub fn ids(&self) -> Vec<u32> {
        self.brokers.iter().map(|b| b.id).collect()
    }

    /// The broker ids the slots run now, leaving out slots being
    /// decommissioned: what membership operations may target.
    pub fn broker_ids(&self) -> Vec<u32> {
        self.brokers.iter().filter(|b| !b.retiring).map(|b| b.broker_id).collect()
    }

    /// Marks slot `id` as being decommissioned (or no longer).
    pub fn set_retiring(&mut self, id: u32, retiring: bool) {
        self.slot(id).retiring = retiring;
    }

    /// Records the broker id slot `id` runs now.
    pub fn set_broker_id(&mut self, id: u32, broker_id: u32) {
        self.slot(id).broker_id = broker_id;
    }

    /// Replaces slot `id`'s broker by a new, empty one: SIGKILLs it,
    /// deletes its data directory and starts it again with `--join`
    /// (no `--node-id`: the controller assigns the id). Only for a broker
    /// that was decommissioned (it holds no replica).
    ///
    /// # Errors
    /// The data directory cannot be deleted, or the broker cannot be spawned.
    pub fn rejoin_empty(&mut self, id: u32) -> anyhow::Result<()> {
        self.resume(id);
        self.kill(id);
        let b = self.slot(id);
        // What is in it, not the directory itself: it may be a mount point.
        if b.data_dir.exists() {
            for entry in std::fs::read_dir(&b.data_dir)? {
                let path = entry?.path();
                let removed =
                    if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
                removed.with_context(|| format!("deleting {}", path.display()))?;
            }
            // Durably empty: a power cut must not bring the old broker back.
            std::fs::File::open(&b.data_dir)?.sync_all()?;
        }
        b.joined = true;
        self.spawn(id)
    }

    /// Comma-separated client addresses.
    pub fn bootstrap(&self) -> String {
        self.brokers.iter().map(|b| b.client_addr().to_string()).collect::<Vec<_>>().join(",")
    }

    fn slot(&mut self, id: u32) -> &mut Broker {
        &mut self.brokers[(id - 1) as usize]
    }

    /// Starts (or restarts) broker `id` on its data directory.
    ///
    /// # Errors
    /// If it cannot be spawned.
    pub fn spawn(&mut self, id: u32) -> anyhow::Result<()> {
        let (binary, initial, config) =
            (self.binary.clone(), self.initial_cluster.clone(), self.config.clone());
        let others: Vec<String> =
            self.brokers.iter().filter(|b| b.id != id).map(|b| b.peer_addr().to_string()).collect();
        let b = self.slot(id);
        if b.child.is_some() {
            return Ok(());
        }
        std::fs::create_dir_all(&b.data_dir)?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&b.log)?;
        let mut cmd = match &b.ns {
            // `ip netns exec` execs the program in place: the child is the broker.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&binary);
                c
            }
            None => Command::new(&binary),
        };
        cmd.arg("--config")
            .arg(&config)
            .arg("--client-addr")
            .arg(b.client_addr().to_string())
            .arg("--peer-addr")
            .arg(b.peer_addr().to_string())
            // No Kafka workload here: any free port on the broker's address.
            .arg("--kafka-addr")
            .arg(format!("{}:0", b.client_addr().ip()))
            .arg("--data-dir")
            .arg(&b.data_dir);
        if b.joined {
            // Its data directory keeps the id the controller gave it.
            cmd.arg("--join").arg(others.join(","));
        } else {
            cmd.arg("--node-id").arg(id.to_string()).arg("--initial-cluster").arg(&initial);
        }
        if let Some(routes) = &b.peer_routes {
            cmd.arg("--peer-routes").arg(routes);
        }
        cmd.env(
            "RUST_LOG",
            std::env::var("FERROLOG_JEPSEN_BROKER_LOG").unwrap_or_else(|_| DEFAULT_BROKER_LOG.into()),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
        b.child = Some(cmd.spawn().with_context(|| format!("spawning {}", binary.display()))?);
        b.paused = false;
        Ok(())
    }

    /// Whether broker `id` runs (possibly paused).
    pub fn is_running(&self, id: u32) -> bool {
        self.brokers[(id - 1) as usize].child.is_some()
    }

    /// SIGKILLs broker `id` and reaps it.
    pub fn kill(&mut self, id: u32) {
        let b = self.slot(id);
        if let Some(mut c) = b.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        b.paused = false;
    }

    /// SIGSTOPs broker `id`.
    pub fn pause(&mut self, id: u32) {
        let b = self.slot(id);
        if let Some(c) = &b.child {
            signal(c.id(), libc::SIGSTOP);
            b.paused = true;
        }
    }

    /// SIGCONTs broker `id`.
    pub fn resume(&mut self, id: u32) {
        let b = self.slot(id);
        if let Some(c) = &b.child
            && b.paused
        {
            signal(c.id(), libc::SIGCONT);
        }
        b.paused = false;
    }

    /// Stops broker `id` with SIGTERM, SIGKILL after `grace`.
    pub fn stop(&mut self, id: u32, grace: Duration) {
        self.resume(id);
        let b = self.slot(id);
        if let Some(mut c) = b.child.take() {
            signal(c.id(), libc::SIGTERM);
            let deadline = Instant::now() + grace;
            loop {
                match c.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        }
    }

    /// Kills every broker (resuming paused ones first).
    pub fn kill_all(&mut self) {
        for id in self.ids() {
            self.resume(id);
            self.kill(id);
        }
    }

    /// Runs `ferrolog-broker dump-log` on stopped broker `id`'s data and
    /// returns its copies of `topic`'s partitions.
    ///
    /// # Errors
    /// If the broker runs, or the command fails or prints malformed lines.
    pub fn dump(&self, id: u32, topic: &str, out_file: &Path) -> anyhow::Result<Vec<ReplicaCopy>> {
        let b = &self.brokers[(id - 1) as usize];
        if b.child.is_some() {
            bail!("broker {id} is running; dump-log reads only stopped brokers");
        }
        let out = Command::new(&self.binary)
            .arg("dump-log")
            .arg("--data-dir")
            .arg(&b.data_dir)
            .output()
            .with_context(|| format!("running {} dump-log", self.binary.display()))?;
        if !out.status.success() {
            bail!("dump-log of broker {id} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::fs::write(out_file, &out.stdout)?;
        parse_dump(id, topic, &String::from_utf8_lossy(&out.stdout))
    }
}

/// Waits until some broker of `bootstrap` reports `brokers` brokers
/// registered and a controller.
///
/// # Errors
/// On timeout, with the last answer.
pub async fn wait_ready(bootstrap: &str, brokers: usize, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    while Instant::now() < deadline {
        let cfg = ClientConfig {
            connect_timeout_ms: 1000,
            request_timeout_ms: 2000,
            ..ClientConfig::from_list(bootstrap)
        };
        match MetadataCache::new(cfg) {
            Ok(m) => match m.refresh().await {
                Ok(c) if c.brokers.len() >= brokers && c.controller != 0 => return Ok(()),
                Ok(c) => last = format!("{} brokers, controller {}", c.brokers.len(), c.controller),
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("cluster not ready after {timeout:?}: {last}")
}

/// Turns `dump-log` lines into copies of `topic`'s partitions: record
/// lines, and each replica's committed marker (`{"replica": {…}}`), which
/// also makes a copy of a replica without records.
///
/// # Errors
/// A malformed line.
pub fn parse_dump(broker: u32, topic: &str, text: &str) -> anyhow::Result<Vec<ReplicaCopy>> {
    let mut by_key: std::collections::BTreeMap<u32, ReplicaCopy> = Default::default();
    let new = |key| ReplicaCopy { broker, key, records: vec![], marker: None };
    for (i, line) in text.lines().enumerate() {
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("dump line {}", i + 1))?;
        if let Some(m) = v.get("replica") {
            if m["topic"].as_str() != Some(topic) {
                continue;
            }
            let field = |name: &str| m[name].as_u64().with_context(|| format!("dump line {}: {name}", i + 1));
            let key = field("partition")? as u32;
            by_key.entry(key).or_insert_with(|| new(key)).marker = Some(CommittedMarker {
                log_start_offset: field("log_start_offset")?,
                log_end_offset: field("log_end_offset")?,
                committed_end: field("committed_end")?,
            });
            continue;
        }
        if v["topic"].as_str() != Some(topic) {
            continue;
        }
        let key = v["partition"].as_u64().context("partition")? as u32;
        let offset = v["offset"].as_u64().context("offset")?;
        // The unique integer: the `id` header where the record has one
        // (every record of the compact workload), else the value.
        let id_header = v["headers"].as_array().and_then(|hs| {
            hs.iter().find(|h| h["key"].as_str() == Some(crate::workload::ID_HEADER)).map(|h| &h["value"])
        });
        let value =
            id_header.unwrap_or(&v["value"]).as_str().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX);
        let committed = v["committed"].as_bool().unwrap_or(false);
        by_key.entry(key).or_insert_with(|| new(key)).records.push(ReplicaRecord {
            offset,
            value,
            committed,
        });
    }
    Ok(by_key.into_values().collect())
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_dump_reads_the_committed_marker() {
        let dump = r#"{"topic":"jepsen","partition":0,"group":5,"offset":0,"committed":true,"value":"7"}
{"topic":"jepsen","partition":0,"group":5,"offset":1,"committed":false,"value":"8"}
{"replica":{"topic":"jepsen","partition":0,"group":5,"log_start_offset":0,"log_end_offset":2,"committed_end":1}}
{"replica":{"topic":"jepsen","partition":1,"group":6,"log_start_offset":0,"log_end_offset":0,"committed_end":0}}
{"replica":{"topic":"other","partition":0,"group":7,"log_start_offset":0,"log_end_offset":0,"committed_end":0}}
{"topic":"jepsen","partition":2,"group":8,"offset":0,"committed":true,"value":"9"}
"#;
        let copies = parse_dump(3, "jepsen", dump).expect("parses");
        assert_eq!(copies.len(), 3);
        assert_eq!(copies[0].records.len(), 2);
        assert_eq!(
            copies[0].marker,
            Some(CommittedMarker { log_start_offset: 0, log_end_offset: 2, committed_end: 1 })
        );
        // A replica without records is a copy, empty, with its marker.
        assert!(copies[1].records.is_empty() && copies[1].marker.is_some());
        // Records without a marker: the copy has none.
        assert_eq!((copies[2].key, copies[2].marker), (2, None));
        assert!(copies.iter().all(|c| c.broker == 3));
    }
}

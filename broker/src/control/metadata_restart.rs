//! Restarts this broker's metadata replica after it stopped on an error,
//! without a broker restart (issue 9, item 2).
//!
//! The metadata log is fsynced on every write, so a full or read-only data
//! directory stops the metadata group's Raft node here at the next metadata
//! change (a topic created, a broker registered). The other brokers' replicas
//! carry on (a controller on this broker loses its leadership with its node);
//! this one would miss every later change, so the broker would never host a
//! replica placed on it afterwards. The loop here does for the metadata group
//! what the reconciler does for partitions (`crate::partitions`):
//!
//! 1. once a second, looks whether the Raft node in place has stopped on an
//!    error, and says so (logged, and in `cluster status` through
//!    [`MetadataFailure`]);
//! 2. waits [`restart_backoff`] (1 s, doubling to 60 s; forgotten after
//!    [`HEALTHY_AFTER`] of running), then until the data directory takes a
//!    write again ([`writable::probe`]);
//! 3. shuts the old node down (or tries again later: two nodes never write
//!    one log), opens the log again in place with every
//!    segment verified and the entries after a failed fsync cut
//!    ([`Replica::reopen`]), starts a new node over it (held out of votes if
//!    the log shows it may have lost acknowledged entries,
//!    `ferrolog_replica::recovery`) and swaps it in everywhere
//!    ([`HostedMetadata::replace`], and the group registry, which routes
//!    peers' messages). The leader sends what the reopened log lacks.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use ferrolog_raft_store::{Flusher, Replica, StoreConfig};
use ferrolog_replica::{RaftNode, ValidSettings};

use crate::control::writable;
use crate::groups::{GroupRegistry, HostedGroup};
use crate::metadata::METADATA_GROUP;
use crate::metadata::hosted::HostedMetadata;
use crate::network::PeerAddresses;
use crate::partitions::{HEALTHY_AFTER, restart_backoff};

/// How often the loop looks at the metadata group's Raft node.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// How long the old node's shutdown may take before the restart goes on.
const SHUTDOWN_WITHIN: Duration = Duration::from_secs(5);

/// Why this broker's metadata replica is not running now, if it is not:
/// shared with `cluster status` (`Metadata`'s own broker entry).
#[derive(Clone, Debug, Default)]
pub struct MetadataFailure(Arc<Mutex<Option<String>>>);

impl MetadataFailure {
    /// The error it stopped on and what its restart waits for; `None`
    /// while it runs.
    pub fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, why: Option<String>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = why;
    }
}

/// What [`run`] needs to start the metadata group's replica again: what
/// the broker started it with.
pub struct MetadataRestart {
    /// The replica in place, replaced on a restart.
    pub metadata: HostedMetadata,
    /// The hosted groups (the metadata group is registered under
    /// [`METADATA_GROUP`]).
    pub groups: GroupRegistry,
    /// The Raft settings the metadata group runs with.
    pub settings: ValidSettings,
    /// Reaches the peers.
    pub peers: PeerAddresses,
    /// The metadata log's storage settings.
    pub storage: StoreConfig,
    /// The broker's flusher.
    pub flusher: Flusher,
    /// The metadata group's directory (its replica and staging area), the
    /// one probed for writes.
    pub dir: PathBuf,
    /// Where incoming snapshots of the metadata group are staged.
    pub staging_dir: PathBuf,
    /// Reported in `cluster status`.
    pub failure: MetadataFailure,
}

/// Watches the metadata group's Raft node and restarts it after it stopped
/// on an error (see the module's documentation). Runs until the broker
/// stops.
pub async fn run(r: MetadataRestart) {
    let mut attempts = 0u32;
    let mut ticks = tokio::time::interval(LOOK_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        ticks.tick().await;
        let raft = r.metadata.raft();
        let Some(fatal) = raft.state(|s| s.fatal()) else {
            if attempts > 0 && r.metadata.started().elapsed() >= HEALTHY_AFTER {
                attempts = 0;
            }
            continue;
        };
        attempts = attempts.saturating_add(1);
        let wait = restart_backoff(attempts);
        tracing::warn!(
            retry_in_ms = wait.as_millis() as u64,
            "the metadata replica stopped on an error; restarting it after repair: {fatal}"
        );
        r.failure.set(Some(format!("stopped: {fatal}; restart in {} ms", wait.as_millis())));
        tokio::time::sleep(wait).await;
        let mut waited_since = None;
        loop {
            // A write and an fsync: off the async threads.
            let (fs, dir) = (r.flusher.fs().clone(), r.dir.clone());
            let on = fs.clone();
            let probed =
                ferrolog_raft_store::runtime::blocking(&*on, move || writable::probe(&*fs, &dir)).await;
            let Err(why) = probed.unwrap_or_else(|e| Err(format!("the write probe failed: {e}"))) else {
                break;
            };
            let since = *waited_since.get_or_insert_with(Instant::now);
            crate::logging::every(
                "metadata.restart.disk",
                Duration::from_secs(30),
                format_args!(
                    "not restarting the metadata replica yet ({} s): {why}",
                    since.elapsed().as_secs()
                ),
            );
            r.failure.set(Some(format!("stopped: {fatal}; restart waits for the disk: {why}")));
            tokio::time::sleep(LOOK_EVERY).await;
        }
        match restart(&r, raft).await {
            Ok(()) => {
                r.failure.set(None);
                tracing::info!(attempt = attempts, "metadata replica restarted");
            }
            Err(e) => {
                r.failure.set(Some(format!("stopped: {fatal}; restart failed: {e:#}")));
                tracing::warn!(attempt = attempts, "cannot restart the metadata replica: {e:#}");
            }
        }
    }
}

/// Replaces the stopped node `old`: shuts it down, reopens its log in
/// place, starts a new node over it and swaps it in.
async fn restart(r: &MetadataRestart, old: RaftNode) -> anyhow::Result<()> {
    // Two nodes must never write one log: no reopen before the old node's
    // tasks are gone (tried again after the next back-off otherwise). An
    // error here is a task that panicked: gone too.
    match tokio::time::timeout(SHUTDOWN_WITHIN, old.shutdown()).await {
        Err(_) => anyhow::bail!("the stopped node did not shut down within {SHUTDOWN_WITHIN:?}"),
        Ok(Err(e)) => tracing::warn!("shutting the stopped metadata node down: {e}"),
        Ok(Ok(())) => {}
    }
    let (replica, storage, flusher) = (r.metadata.replica(), r.storage.clone(), r.flusher.clone());
    let staging = r.staging_dir.clone();
    let fs = flusher.fs().clone();
    let reopened = ferrolog_raft_store::runtime::blocking(&*fs, move || -> anyhow::Result<Replica> {
        ferrolog_replica::snapshot::clear_staging(&**flusher.fs(), &staging)?;
        Ok(replica.reopen(storage, flusher)?)
    })
    .await
    .map_err(|e| anyhow::anyhow!("reopening the metadata log was cut off: {e}"))??;
    let node = r.metadata.node();
    let raft = RaftNode::start(METADATA_GROUP, node, &r.settings, &reopened, r.peers.clone()).await?;
    r.groups.remove(METADATA_GROUP);
    r.groups.insert(
        METADATA_GROUP,
        HostedGroup {
            node_id: node,
            raft: raft.clone(),
            replica: reopened.clone(),
            staging_dir: r.staging_dir.clone(),
            partition: None,
        },
    );
    r.metadata.replace(raft.clone(), reopened);
    // A broker handing its leaderships over before it stops must not win
    // the controller back (crate::control::handover). Looked at after the
    // new node is registered: a drain that began meanwhile switched off
    // the node it found there, this one.
    if r.groups.draining() {
        raft.set_elections(false);
    }
    raft.hold_if_recovering(node);
    Ok(())
}

//! Deterministic simulation of a Raft group (issue 15): three replicas, each
//! on its own in-memory fault-injecting disk (raft-store's `FaultyFs`,
//! which keeps only what a completed fsync covers; `flush = always`), their
//! peer messages delayed at random, all of it on one thread with simulated
//! time. A seed draws everything: the network's delays, the Raft library's
//! election timeouts, the clients' pacing, the disks' torn writes and the
//! nemesis, which isolates replicas, cuts the power of one replica or of
//! all three at once, makes a replica's disk fail (EIO on fsync or on
//! write, or full) until an operator power-cycles it, rots bits (a random
//! bit of a random segment file, on one replica per seed: a majority's
//! disks stay intact), and restarts them.
//! As the broker does, a replica whose group stopped on an error, whose
//! log a read found damaged, or that fails to start is restarted with
//! every segment verified, and a driver does the host's part of recovery
//! (vote floors, release: `ferrolog_replica::recovery`, whose nodes refuse
//! votes themselves). Segments are small (4 KiB), so every seed seals many.
//! One seed replays exactly: the same events at the same simulated times
//! (checked by a test).
//!
//! What makes it deterministic: a current-thread tokio runtime with paused
//! time (a sleep is a jump of the simulated clock); the store's background
//! work (flusher, metadata writer) run in the callers and in tasks of that
//! runtime (`FaultyFs::simulated`); the Raft library's random numbers seeded
//! (`runtime::seed_thread_rng`); no unordered map iterated on the way; and
//! tokio's own generator seeded (it picks the order in which a watch
//! channel's receivers wake), which tokio allows only when built with
//! `--cfg tokio_unstable`. The workspace's `.cargo/config.toml` sets that
//! flag for every build, so
//!
//! ```text
//! cargo test -p ferrolog-replica --test simulation
//! ```
//!
//! (and `cargo test --workspace`, which `.ci/run` runs) runs
//! [`SEEDS_IN_TEST`] (300) seeds, the exact-replay check and the negative
//! controls. A build without the flag (a `RUSTFLAGS` variable replaces the
//! config's list) runs 40 seeds whose interleavings may differ from run to
//! run, and skips the checks that need exact replay; the others hold all
//! the same.
//! `FERROLOG_SIM_SEEDS=10000` (and `--release`) runs more, from
//! `FERROLOG_SIM_SEED` (default 1); `FERROLOG_SIM_SEED=n FERROLOG_SIM_SEEDS=1`
//! replays seed `n`, `FERROLOG_SIM_NOTE=1` adds every AppendEntries sent
//! to the trace a failing seed prints, `FERROLOG_SIM_TAIL` sets how many of
//! its last events it prints (30).
//!
//! The checker holds the guarantees jepsen's checker holds for real
//! clusters: after everything is healed and restarted, a leader is elected
//! and every replica catches up (liveness); the replicas' logs are
//! identical; no value is stored twice; every value acknowledged as
//! committed is stored at the offset it was acknowledged at; every record a
//! reader was served (below a replica's high watermark) is the final log's
//! record at that offset; no replica is still recovering. The runs
//! together must have done work (acknowledged writes, reads, power cuts,
//! failing disks, rotted bits, recoveries), or the test fails. Each
//! negative control runs the same with one bug injected and must break a
//! safety check: a flusher that acknowledges appends without fsyncing them
//! (a test-only switch), a leader that acknowledges before commit, and a
//! recovering replica that votes as if its log were whole.
//!
//! Not simulated: the broker (its gRPC service, partition table and
//! controller) and snapshot transfer (which stages through the OS's file
//! system); the jepsen harness covers the broker with real processes.

mod common;

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Local, value_batch, value_of};
use ferrolog_raft_store::runtime::seed_thread_rng;
use ferrolog_raft_store::vfs::{Faults, FaultyFs, PowerCut, Vfs};
use ferrolog_raft_store::{Flusher, Replica, StoreConfig};
use ferrolog_replica::{InjectedBug, NodeId, RaftNode};

/// Seeds `cargo test` runs: with `--cfg tokio_unstable` (the workspace's
/// default, see the module's documentation) 300; without it, where a seed
/// does not replay every interleaving, fewer.
const SEEDS_IN_TEST: u64 = if cfg!(tokio_unstable) { 300 } else { 40 };
/// Threads the seeds are spread over.
const THREADS: u64 = 2;
const GROUP: u64 = 11;
const NODES: [NodeId; 3] = [1, 2, 3];
/// Nemesis steps per seed.
const STEPS: u32 = 12;
/// Simulated time the group has to recover after healing.
const RECOVER_WITHIN: Duration = Duration::from_secs(60);

/// The seeded sequence of one simulation (xorshift64).
#[derive(Clone)]
struct Rng(Arc<Mutex<u64>>);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)))
    }

    fn next(&self) -> u64 {
        common::xorshift(&mut self.0.lock().expect("rng"))
    }

    fn below(&self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What the transport notes (see `Local::noted`).
type Noted = Arc<Mutex<Option<Vec<String>>>>;

thread_local! {
    /// The transport's notes of the simulation running on this thread.
    static NOTED: std::cell::RefCell<Option<Noted>> = const { std::cell::RefCell::new(None) };
}

/// What happened, in order, with simulated times: hashed for the replay
/// check, kept for a failing seed's report.
#[derive(Clone)]
struct Trace {
    events: Arc<Mutex<Vec<String>>>,
    /// When the simulation began (simulated).
    began: tokio::time::Instant,
}

impl Trace {
    fn new() -> Self {
        Self { events: Arc::default(), began: tokio::time::Instant::now() }
    }

    /// Notes `event` now (and before it the messages the transport noted
    /// since the last event, stamped with this event's time).
    fn log(&self, event: String) {
        let at = self.began.elapsed().as_micros();
        if let Some(net) = NOTED.with(|n| n.borrow().clone()) {
            for e in net.lock().expect("noted").as_mut().map(std::mem::take).unwrap_or_default() {
                self.events.lock().expect("trace").push(format!("{at:>10}µs   {e}"));
            }
        }
        self.events.lock().expect("trace").push(format!("{at:>10}µs {event}"));
    }

    /// Of every event and its time: SipHash with fixed keys, the same on
    /// every run.
    fn digest(&self) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        self.events.lock().expect("trace").hash(&mut h);
        h.finish()
    }

    fn events(&self) -> Vec<String> {
        self.events.lock().expect("trace").clone()
    }

    fn tail(&self, n: usize) -> String {
        let events = self.events.lock().expect("trace");
        events[events.len().saturating_sub(n)..].join("\n")
    }
}

/// The safety bug a run carries, for the negative controls.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(tokio_unstable), allow(dead_code, reason = "the controls need --cfg tokio_unstable"))]
enum Bug {
    None,
    /// Appends are acknowledged as flushed without an fsync (a flusher
    /// that skips it: raft-store's `test-switches`).
    AckBeforeFsync,
    /// The leader answers proposals before they commit (the replica's
    /// `InjectedBug::AckBeforeCommit`, the bug jepsen's control injects).
    AckBeforeCommit,
    /// A replica that found its log damaged votes as if it were whole (the
    /// replica's `InjectedBug::VoteWhileRecovering`).
    VoteWhileRecovering,
}

struct Member {
    id: NodeId,
    node: RaftNode,
    replica: Replica,
}

thread_local! {
    /// The simulation on this thread runs its replicas with `flush =
    /// interval` (see [`interval_seeds`]).
    static INTERVAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The store's settings: small segments, so that every seed seals many;
/// `flush = always`, or `interval` (every 20 ms) in [`interval_seeds`].
fn store_config() -> StoreConfig {
    let flush = if INTERVAL.with(|i| i.get()) {
        ferrolog_raft_store::FlushPolicy::Interval { interval_ms: 20 }
    } else {
        ferrolog_raft_store::FlushPolicy::Always
    };
    StoreConfig { segment_bytes: 4096, index_interval_bytes: 256, flush, ..StoreConfig::default() }
}

/// Starts node `id` on what its disk holds now (a new process); with
/// `rescan`, every segment is verified first. As the broker does, a start
/// that fails is tried again with every segment verified.
async fn start(
    id: NodeId,
    disk: &FaultyFs,
    net: &Local,
    staging: &Path,
    bug: Bug,
    rescan: bool,
) -> Result<Member, String> {
    let mut failed: Option<String> = None;
    for verify in [rescan, true] {
        let attempt = async {
            let flusher = match bug {
                Bug::None | Bug::AckBeforeCommit | Bug::VoteWhileRecovering => {
                    Flusher::spawn_on(&format!("n{id}"), disk.mount())
                }
                Bug::AckBeforeFsync => Flusher::spawn_without_fsync_unsafe(&format!("n{id}"), disk.mount()),
            }
            .map_err(|e| format!("node {id}: flusher: {e}"))?;
            let replica = Replica::open_with(common::replica_dir(), store_config(), flusher, verify)
                .map_err(|e| format!("node {id} does not open after a power cut: {e}"))?;
            let node = RaftNode::start(GROUP, id, &common::disk_settings(), &replica, net.as_node(id))
                .await
                .map_err(|e| format!("node {id} does not start: {e}"))?;
            Ok::<_, String>(Member { id, node, replica })
        };
        match attempt.await {
            Ok(member) => {
                let inject = match bug {
                    Bug::AckBeforeCommit => Some(InjectedBug::AckBeforeCommit),
                    Bug::VoteWhileRecovering => Some(InjectedBug::VoteWhileRecovering),
                    Bug::None | Bug::AckBeforeFsync => None,
                };
                if let Some(b) = inject {
                    assert!(member.node.inject(b), "debug builds inject bugs");
                }
                // The host's part of recovery (as the broker's): a replica
                // that may have lost acknowledged entries starts held.
                member.node.hold_if_recovering(id);
                net.nodes.lock().expect("nodes").insert(id, (member.node.clone(), staging.to_owned()));
                return Ok(member);
            }
            Err(e) if verify => return Err(failed.map_or(e.clone(), |f| format!("{f}; verified: {e}"))),
            Err(e) => failed = Some(e),
        }
    }
    Err(failed.unwrap_or_default())
}

/// Cuts node `id`'s power: its disk keeps only what was fsynced, and
/// nothing of its process reaches it any more.
/// (Clients that still hold the member see its calls fail.)
async fn power_cut(id: NodeId, member: Arc<Member>, disk: &FaultyFs, how: PowerCut, net: &Local) {
    net.power_cut(id, &member.node, disk, how).await;
}

/// Stops node `id` as the broker stops a replica it restarts (a group that
/// stopped on an error, a log a read found damaged): modelled as a clean
/// power cut, which under `flush = always` loses only what was never
/// acknowledged. Under `interval` the broker's in-process restart keeps
/// the page cache, so what was written is synced first: a harness restart
/// must not be a second replica's power loss.
async fn restart_in_place(id: NodeId, member: Arc<Member>, disk: &FaultyFs, net: &Local) {
    if INTERVAL.with(|i| i.get()) {
        let _ = member.replica.sync();
    }
    power_cut(id, member, disk, PowerCut::Clean, net).await;
}

/// What clients were told and served.
#[derive(Default)]
struct History {
    /// Value → base offset, for proposals acknowledged as committed.
    acked: BTreeMap<u64, u64>,
    /// Proposals whose outcome is unknown.
    indefinite: u64,
    /// Base offset → value, for every batch a reader was served.
    served: BTreeMap<u64, u64>,
    /// Batches served to readers (the same batch counts each time).
    reads: u64,
    /// A reader was served two values at one offset.
    conflict: Option<String>,
}

/// The running members, shared with the clients.
type Members = Arc<Mutex<BTreeMap<NodeId, Arc<Member>>>>;

/// The leader as the members see it (lowest id first: a stale leader may
/// still think it leads).
fn leader(members: &Members) -> Option<(Arc<Member>, u64)> {
    let members = members.lock().expect("members");
    members.values().find_map(|m| m.node.leader_term().map(|t| (m.clone(), t)))
}

/// Proposes values to whichever member leads, paced by the seed, until `stop`.
async fn produce(
    members: Members,
    history: Arc<Mutex<History>>,
    trace: Trace,
    rng: Rng,
    stop: Arc<AtomicBool>,
    first: u64,
) {
    let mut value = first;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(1 + rng.below(20))).await;
        let Some((member, term)) = leader(&members) else {
            trace.log("no leader".into());
            continue;
        };
        let v = value;
        value += 1;
        trace.log(format!("propose {v} to n{} in term {term}", member.id));
        let Ok(pending) = member.node.propose(value_batch(v), term).await else { continue };
        match tokio::time::timeout(Duration::from_secs(2), pending.committed()).await {
            Ok(Ok(r)) => {
                trace.log(format!("ack {v} at {}", r.base_offset));
                history.lock().expect("history").acked.insert(v, r.base_offset);
            }
            outcome => {
                trace.log(format!("indefinite {v}: {}", if outcome.is_err() { "timeout" } else { "error" }));
                history.lock().expect("history").indefinite += 1;
            }
        }
    }
}

/// Reads committed batches from a random running member at a random
/// offset, until `stop`. A read that finds a member's log damaged (bit rot
/// it had not read since) is refused and reported in `damaged`, as the
/// broker's partition reports it (and restarts that replica verified).
async fn read(
    members: Members,
    history: Arc<Mutex<History>>,
    trace: Trace,
    rng: Rng,
    stop: Arc<AtomicBool>,
    damaged: Damaged,
) {
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(5 + rng.below(40))).await;
        let member = {
            let members = members.lock().expect("members");
            let ids: Vec<NodeId> = members.keys().copied().collect();
            if ids.is_empty() {
                continue;
            }
            members[&ids[rng.below(ids.len() as u64) as usize]].clone()
        };
        let hw = member.replica.high_watermark();
        trace.log(format!("read from n{} below {hw}", member.id));
        let from = rng.below(hw + 1);
        let batches = match member.replica.read(from, 16 << 10) {
            Ok(b) => b,
            Err(e) if e.is_damage() => {
                trace.log(format!("read from n{} found damage: {e}", member.id));
                damaged.lock().expect("damaged").insert(member.id);
                continue;
            }
            Err(_) => continue,
        };
        let mut h = history.lock().expect("history");
        h.reads += batches.len() as u64;
        for b in &batches {
            if b.header.record_count == 0 {
                continue;
            }
            let Some(v) = value_of(&b.records()) else {
                h.conflict =
                    Some(format!("a batch at {} holds no value this test wrote", b.header.base_offset));
                continue;
            };
            let offset = b.header.base_offset;
            if let Some(old) = h.served.insert(offset, v)
                && old != v
            {
                h.conflict = Some(format!("offset {offset} was served as value {old}, later as {v}"));
            }
        }
        drop(h);
        trace.log(format!("read {} batches from {from}", batches.len()));
    }
}

/// Members whose log a read found damaged.
type Damaged = Arc<Mutex<std::collections::BTreeSet<NodeId>>>;

/// The host's part of recovery, as the broker's reconciler does it: every
/// 200 ms, each recovering member asks every voter for its log (the vote
/// floor) and may campaign only if it holds the most up-to-date one, and is
/// released once a leader has brought it back. Until `done`; returns how
/// many members were released.
async fn drive_recovery(members: Members, trace: Trace, done: Arc<AtomicBool>) -> u64 {
    let mut released = 0;
    let mut allowed: BTreeMap<NodeId, bool> = BTreeMap::new();
    while !done.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let recovering: Vec<Arc<Member>> =
            members.lock().expect("members").values().filter(|m| m.node.is_recovering()).cloned().collect();
        for m in recovering {
            if m.node.release_if_caught_up(true) {
                trace.log(format!("n{} recovered", m.id));
                allowed.remove(&m.id);
                released += 1;
            } else if let Some(may) = m.node.seek_vote_floor(m.id, &NODES).await {
                m.node.set_elections(may);
                if allowed.insert(m.id, may) != Some(may) {
                    trace.log(format!(
                        "n{} recovering: floor {:?}, may campaign: {may}",
                        m.id,
                        m.node.vote_floor()
                    ));
                }
            }
        }
    }
    released
}

/// Flips one bit of a random segment file of `disk`, at a random byte of
/// what it holds (bit rot); returns what it flipped.
fn rot(disk: &FaultyFs, rng: &Rng) -> Option<String> {
    let fs = disk.mount();
    let dir = common::replica_dir().join("log");
    let segments: Vec<String> = fs.list(&dir).ok()?.into_iter().filter(|n| n.ends_with(".seg")).collect();
    let name = segments.get(rng.below(segments.len().max(1) as u64) as usize)?;
    let path = dir.join(name);
    let len = fs.metadata(&path).ok()?.len;
    if len == 0 {
        return None;
    }
    let at = rng.below(len);
    disk.rot(&path, at, rng.below(8) as u8).ok()?;
    Some(format!("{name} at byte {at}"))
}

/// Every member's committed log as (base offset, value) pairs.
fn log_of(member: &Member) -> Result<Vec<(u64, u64)>, String> {
    let mut out = Vec::new();
    let mut from = 0;
    loop {
        let batches = member.replica.read(from, 1 << 20).map_err(|e| format!("read at {from}: {e}"))?;
        if batches.is_empty() {
            return Ok(out);
        }
        for b in &batches {
            from = b.header.next_offset();
            if b.header.record_count == 0 {
                continue;
            }
            let v = value_of(&b.records())
                .ok_or_else(|| format!("a batch at {} holds no value", b.header.base_offset))?;
            out.push((b.header.base_offset, v));
        }
    }
}

/// What seeds did: the work behind the checks, summed over seeds.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    /// Writes acknowledged as committed.
    acked: u64,
    /// Batches served to readers (the same batch counts each time).
    reads: u64,
    power_cuts: u64,
    /// Disks made to fail (EIO on fsync or write, or full).
    disk_faults: u64,
    /// Errors those disks returned to the store.
    injected_errors: u64,
    /// Groups that stopped on an error and were restarted.
    restarts: u64,
    /// Bits flipped in segment files (bit rot).
    rots: u64,
    /// Reads refused because they found a log damaged.
    damage_reads: u64,
    /// Recovering replicas released once a leader had brought them back.
    recoveries: u64,
    /// The longest time, simulated ms, from healing and restarting every
    /// replica to all of them caught up and none recovering (a maximum
    /// over seeds, not a sum).
    slowest_recovery_ms: u64,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Self) {
        self.acked += o.acked;
        self.reads += o.reads;
        self.power_cuts += o.power_cuts;
        self.disk_faults += o.disk_faults;
        self.injected_errors += o.injected_errors;
        self.restarts += o.restarts;
        self.rots += o.rots;
        self.damage_reads += o.damage_reads;
        self.recoveries += o.recoveries;
        self.slowest_recovery_ms = self.slowest_recovery_ms.max(o.slowest_recovery_ms);
    }
}

/// What one seed did.
struct Outcome {
    counts: Counts,
    /// Of the trace: equal for two runs of one seed.
    digest: u64,
    /// The trace's events.
    #[cfg_attr(not(tokio_unstable), allow(dead_code, reason = "read by the replay check"))]
    events: Vec<String>,
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}, digest {:x}", self.counts, self.digest)
    }
}

/// Empties the transport's table of nodes when dropped: each node holds
/// the transport, so the table would keep every node (and its disk) alive.
struct ForgetNodes(Local);

impl Drop for ForgetNodes {
    fn drop(&mut self) {
        self.0.nodes.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Runs seed `seed` on a fresh single-threaded runtime with paused time.
fn simulate(seed: u64, bug: Bug) -> Result<Outcome, String> {
    seed_thread_rng(Some(seed));
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time().start_paused(true);
    // The order in which tokio wakes a watch channel's receivers is drawn
    // from the runtime's generator, which only `tokio_unstable` can seed.
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let runtime = builder.build().expect("runtime");
    let trace = runtime.block_on(async { Trace::new() });
    // A seed that hangs (a call that never returns while Raft's timers keep
    // simulated time going) fails, naming itself.
    let result = runtime.block_on(async {
        match tokio::time::timeout(Duration::from_secs(900), run_seed(seed, bug, trace.clone())).await {
            Ok(r) => r,
            Err(_) => Err("the seed did not finish within 900 s of simulated time".into()),
        }
    });
    drop(runtime);
    seed_thread_rng(None);
    result.map_err(|e| {
        format!(
            "seed {seed}: {e}\nlast events:\n{}\nreplay with FERROLOG_SIM_SEED={seed} FERROLOG_SIM_SEEDS=1 \
             FERROLOG_SIM_NOTE=1 and the command in replica/tests/simulation.rs",
            trace.tail(env("FERROLOG_SIM_TAIL").unwrap_or(30) as usize)
        )
    })
}

async fn run_seed(seed: u64, bug: Bug, trace: Trace) -> Result<Outcome, String> {
    let rng = Rng::new(seed);
    let staging = tempfile::tempdir().expect("staging");
    let net = Local::default();
    let _forget = ForgetNodes(net.clone());
    *net.delay.lock().expect("delay") = Some((rng.next() | 1, 1 + rng.below(10)));
    if std::env::var_os("FERROLOG_SIM_NOTE").is_some() {
        *net.noted.lock().expect("noted") = Some(Vec::new());
        NOTED.with(|n| *n.borrow_mut() = Some(net.noted.clone()));
    }
    let disks: BTreeMap<NodeId, FaultyFs> =
        NODES.iter().map(|id| (*id, FaultyFs::new(rng.next()).simulated())).collect();
    for disk in disks.values() {
        let fs = disk.mount();
        fs.create_dir_all(Path::new("/data")).expect("mkdir");
        fs.sync_dir(Path::new("/")).expect("sync /");
    }
    let members: Members = Arc::default();
    let add = |id: NodeId, m: Member| {
        let last = m.replica.last_log_id().map(|l| l.index);
        match m.replica.recovering() {
            // Up to where the set-aside directory is named (by the wall clock).
            Some(why) => trace.log(format!(
                "n{id} opened to {last:?}, recovering: {}",
                why.split(';').next().unwrap_or("")
            )),
            None => trace.log(format!("n{id} opened to {last:?}")),
        }
        members.lock().expect("members").insert(id, Arc::new(m));
    };
    let take = |id: NodeId| members.lock().expect("members").remove(&id);
    for id in NODES {
        add(id, start(id, &disks[&id], &net, staging.path(), bug, false).await?);
    }
    let voters: BTreeMap<NodeId, String> = NODES.iter().map(|id| (*id, format!("n{id}"))).collect();
    let first = members.lock().expect("members")[&1].node.clone();
    first.initialize(voters).await.map_err(|e| format!("initialize: {e}"))?;

    let history = Arc::new(Mutex::new(History::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for p in 0..2u64 {
        let client =
            produce(members.clone(), history.clone(), trace.clone(), rng.clone(), stop.clone(), p << 40);
        clients.push(tokio::spawn(client));
    }
    let damaged: Damaged = Arc::default();
    clients.push(tokio::spawn(read(
        members.clone(),
        history.clone(),
        trace.clone(),
        rng.clone(),
        stop.clone(),
        damaged.clone(),
    )));
    let recovery_done = Arc::new(AtomicBool::new(false));
    let driver = tokio::spawn(drive_recovery(members.clone(), trace.clone(), recovery_done.clone()));

    let mut counts = Counts::default();
    // Nodes to reopen with every segment verified: their group stopped on
    // an error (the broker's rule).
    let mut rescan: std::collections::BTreeSet<NodeId> = Default::default();
    // Nodes whose power is off, and the step at which each comes back.
    let mut down: BTreeMap<NodeId, u32> = BTreeMap::new();
    // Nodes whose disk fails, and the step at which an operator restarts
    // each (a power cycle, which also ends the disk's fault).
    let mut failing: BTreeMap<NodeId, u32> = BTreeMap::new();
    // The one node whose disk rots (a majority's disks stay intact).
    let mut rotted: Option<NodeId> = None;
    // Rot not found yet: the rotted node's next verified open sets aside
    // everything after it, also entries written since (a latent fault).
    let mut latent_rot = false;
    for step in 0..STEPS {
        tokio::time::sleep(Duration::from_millis(50 + rng.below(400))).await;
        let back: Vec<NodeId> = down.iter().filter(|(_, until)| **until <= step).map(|(id, _)| *id).collect();
        for id in back {
            down.remove(&id);
            let rescan = rescan.remove(&id);
            if rescan && rotted == Some(id) {
                latent_rot = false;
            }
            trace.log(format!("restart {id}{}", if rescan { " with every segment verified" } else { "" }));
            add(id, start(id, &disks[&id], &net, staging.path(), bug, rescan).await?);
        }
        for (id, m) in members.lock().expect("members").iter() {
            let state = m.node.state(|s| {
                format!(
                    "{:?} term {} last {:?} committed {:?} applied {:?}",
                    s.role(),
                    s.term(),
                    s.last_log_index(),
                    s.committed().map(|p| p.index),
                    s.last_applied().map(|p| p.index)
                )
            });
            trace.log(format!("node {id}: {state}"));
        }
        // The broker's part: a group stopped on an error is restarted
        // (here with a power cycle), its segments verified.
        let stopped: Vec<(NodeId, String)> = members
            .lock()
            .expect("members")
            .iter()
            .filter_map(|(id, m)| m.node.state(|s| s.fatal()).map(|e| (*id, e)))
            .collect();
        for (id, error) in stopped {
            trace.log(format!("node {id} stopped ({error}); restarting it"));
            let member = take(id).ok_or("a member is not running")?;
            restart_in_place(id, member, &disks[&id], &net).await;
            failing.remove(&id);
            rescan.insert(id);
            counts.restarts += 1;
            down.insert(id, step + 1);
        }
        // The broker's part again: a replica whose log a read found damaged
        // is restarted with every segment verified.
        let found: Vec<NodeId> = std::mem::take(&mut *damaged.lock().expect("damaged")).into_iter().collect();
        for id in found {
            let Some(member) = take(id) else { continue };
            trace.log(format!("node {id}'s log was found damaged by a read; restarting it verified"));
            restart_in_place(id, member, &disks[&id], &net).await;
            failing.remove(&id);
            rescan.insert(id);
            counts.damage_reads += 1;
            down.insert(id, step + 1);
        }
        let how = if rng.below(2) == 0 { PowerCut::Clean } else { PowerCut::Torn };
        let cycle: Vec<NodeId> = failing.iter().filter(|(_, at)| **at <= step).map(|(id, _)| *id).collect();
        for id in cycle {
            failing.remove(&id);
            trace.log(format!("operator power-cycles {id} {how:?}"));
            let member = take(id).ok_or("a member is not running")?;
            power_cut(id, member, &disks[&id], how, &net).await;
            down.insert(id, step + 1);
        }
        // Under `interval` a power cut, a failing disk or rot makes a replica
        // forget entries it acknowledged: one such replica at a time is
        // promised, so a new one waits until every replica is up, sound
        // and no longer recovering.
        let calm = !INTERVAL.with(|i| i.get())
            || (down.is_empty()
                && !latent_rot
                && failing.is_empty()
                && damaged.lock().expect("damaged").is_empty()
                && members.lock().expect("members").values().all(|m| !m.node.is_recovering()));
        match rng.below(12) {
            0..=2 if down.is_empty() && calm => {
                let id = 1 + rng.below(3);
                trace.log(format!("power cut {id} {how:?}"));
                let member = take(id).ok_or("a member is not running")?;
                power_cut(id, member, &disks[&id], how, &net).await;
                counts.power_cuts += 1;
                failing.remove(&id);
                down.insert(id, step + 1 + rng.below(3) as u32);
            }
            // Not promised under `interval`: power loss of a majority.
            3 if down.is_empty() && !INTERVAL.with(|i| i.get()) => {
                trace.log(format!("power cut of every node {how:?}"));
                for id in NODES {
                    let member = take(id).ok_or("a member is not running")?;
                    power_cut(id, member, &disks[&id], how, &net).await;
                    counts.power_cuts += 1;
                    down.insert(id, step + 1);
                }
                failing.clear();
            }
            4 if down.is_empty() && failing.is_empty() && calm => {
                // fsyncgate: the replica must stop acknowledging and never
                // trust what the failed sync covered; a full disk: a clear
                // error, nothing lost.
                let id = 1 + rng.below(3);
                let (what, faults) = match rng.below(3) {
                    0 => ("EIO on fsync", Faults { eio_on_sync: true, ..Faults::default() }),
                    1 => ("EIO on write", Faults { eio_on_write: true, ..Faults::default() }),
                    _ => ("a full disk", Faults { space_bytes: Some(0), ..Faults::default() }),
                };
                trace.log(format!("disk of {id}: {what}"));
                disks[&id].set_faults(faults);
                counts.disk_faults += 1;
                failing.insert(id, step + 1 + rng.below(3) as u32);
            }
            8 if calm => {
                let id = *rotted.get_or_insert_with(|| 1 + rng.below(3));
                match rot(&disks[&id], &rng) {
                    Some(what) => {
                        trace.log(format!("bit rot on {id}: {what}"));
                        counts.rots += 1;
                        latent_rot = true;
                    }
                    None => trace.log(format!("bit rot on {id}: no segment yet")),
                }
            }
            4..=7 => {
                let id = 1 + rng.below(3);
                trace.log(format!("isolate {id}"));
                net.cut_off.lock().expect("cut off").insert(id);
            }
            _ => {
                trace.log("heal".into());
                net.cut_off.lock().expect("cut off").clear();
            }
        }
    }
    // Heal, restart everything, let the clients go on a little; then stop
    // them and let every replica catch up.
    trace.log("heal and restart all".into());
    net.cut_off.lock().expect("cut off").clear();
    for id in std::mem::take(&mut failing).into_keys() {
        let member = take(id).ok_or("a member is not running")?;
        power_cut(id, member, &disks[&id], PowerCut::Clean, &net).await;
        down.insert(id, 0);
    }
    // The final comparison reads every byte of every log; a read that finds
    // rot restarts its replica verified (the broker's rule), so the rotted
    // node is restarted verified first.
    if let Some(id) = rotted {
        trace.log(format!("node {id} rotted: restarting it verified before the final reads"));
        if let Some(member) = take(id) {
            restart_in_place(id, member, &disks[&id], &net).await;
        }
        rescan.insert(id);
        down.insert(id, 0);
    }
    for id in std::mem::take(&mut down).into_keys() {
        let rescan = rescan.contains(&id);
        add(id, start(id, &disks[&id], &net, staging.path(), bug, rescan).await?);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.map_err(|e| format!("client: {e}"))?;
    }
    let outcome = check(&members, &history, &trace).await;
    recovery_done.store(true, Ordering::Relaxed);
    counts.recoveries = driver.await.map_err(|e| format!("recovery driver: {e}"))?;
    let all: Vec<Arc<Member>> = members.lock().expect("members").values().cloned().collect();
    for m in all {
        let _ = m.node.shutdown().await;
    }
    let (acked, reads, recovered_in) = outcome?;
    counts.acked = acked as u64;
    counts.reads = reads;
    counts.slowest_recovery_ms = recovered_in.as_millis() as u64;
    counts.injected_errors = disks.values().map(|d| d.stats().injected_errors).sum();
    trace.log(format!("done: {counts:?}"));
    Ok(Outcome { counts, digest: trace.digest(), events: trace.events() })
}

/// Liveness, then the safety checks of the module's documentation.
/// Returns how many values were acknowledged, how many batches were read,
/// and how long (simulated) the replicas took to be caught up and none
/// recovering.
async fn check(
    members: &Members,
    history: &Mutex<History>,
    trace: &Trace,
) -> Result<(usize, u64, Duration), String> {
    let began = tokio::time::Instant::now();
    let deadline = began + RECOVER_WITHIN;
    let index = loop {
        if let Some((l, _)) = leader(members)
            && let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), l.node.write_barrier()).await
            && let Some(applied) = l.node.state(|s| s.last_applied())
        {
            break applied.index;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("no leader {RECOVER_WITHIN:?} after healing"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let all: Vec<(NodeId, Arc<Member>)> =
        members.lock().expect("members").iter().map(|(id, m)| (*id, m.clone())).collect();
    for (id, m) in &all {
        if !m.node.wait_applied(index, RECOVER_WITHIN).await {
            return Err(format!("node {id} did not catch up to {index}"));
        }
    }
    // A replica that found its log damaged is back: it votes again.
    for (id, m) in &all {
        while m.node.is_recovering() {
            if tokio::time::Instant::now() >= deadline + RECOVER_WITHIN {
                let state = m.node.state(|s| {
                    format!(
                        "term {} leader {:?} applied {:?} by {:?}",
                        s.term(),
                        s.leader(),
                        s.last_applied().map(|p| p.index),
                        s.last_applied_leadership()
                    )
                });
                return Err(format!(
                    "node {id} still recovering {RECOVER_WITHIN:?} after catching up ({state}; opened at {:?} \
                     in term {})",
                    m.replica.opened_last_log_id(),
                    m.replica.opened_term()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let recovered_in = began.elapsed();
    let mut logs = BTreeMap::new();
    for (id, m) in &all {
        logs.insert(*id, log_of(m).map_err(|e| format!("node {id}: {e}"))?);
    }
    let reference = &logs[&NODES[0]];
    let mut h = std::hash::DefaultHasher::new();
    reference.hash(&mut h);
    trace.log(format!("final log: {} batches, hash {:x}", reference.len(), h.finish()));
    for (id, log) in &logs {
        if log != reference {
            return Err(format!("node {id}'s log differs from node {}'s", NODES[0]));
        }
    }
    let mut at: BTreeMap<u64, u64> = BTreeMap::new();
    for (offset, v) in reference {
        if at.insert(*v, *offset).is_some() {
            return Err(format!("value {v} stored twice"));
        }
    }
    let h = history.lock().expect("history");
    if let Some(c) = &h.conflict {
        return Err(c.clone());
    }
    for (v, offset) in &h.acked {
        match at.get(v) {
            Some(o) if o == offset => {}
            Some(o) => return Err(format!("value {v} acknowledged at offset {offset}, stored at {o}")),
            None => return Err(format!("value {v}, acknowledged at offset {offset}, was lost")),
        }
    }
    let by_offset: BTreeMap<u64, u64> = reference.iter().copied().collect();
    for (offset, v) in &h.served {
        if by_offset.get(offset) != Some(v) {
            return Err(format!(
                "offset {offset} was served as value {v}, the final log has {:?}",
                by_offset.get(offset)
            ));
        }
    }
    Ok((h.acked.len(), h.reads, recovered_in))
}

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

/// Runs `FERROLOG_SIM_SEEDS` (default [`SEEDS_IN_TEST`]) seeds from
/// `FERROLOG_SIM_SEED` (default 1), on [`THREADS`] threads (each seed on
/// its own runtime); fails naming the lowest seed that found a violation.
#[test]
#[allow(clippy::disallowed_methods, reason = "threads that each run whole simulations, one seed at a time")]
fn many_seeds() {
    let first = env("FERROLOG_SIM_SEED").unwrap_or(1);
    let seeds = env("FERROLOG_SIM_SEEDS").unwrap_or(SEEDS_IN_TEST);
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            std::thread::spawn(move || {
                let mut counts = Counts::default();
                for seed in (first + t..first + seeds).step_by(THREADS as usize) {
                    let o = simulate(seed, Bug::None).map_err(|e| (seed, e))?;
                    counts += o.counts;
                    if seeds <= 3 {
                        println!("seed {seed}: {o:?}");
                    }
                }
                Ok::<_, (u64, String)>(counts)
            })
        })
        .collect();
    let mut c = Counts::default();
    let mut failed: Vec<(u64, String)> = Vec::new();
    for t in threads {
        match t.join().expect("a simulation thread panicked") {
            Ok(counts) => c += counts,
            Err(f) => failed.push(f),
        }
    }
    failed.sort();
    if let Some((_, e)) = failed.first() {
        panic!("{e}");
    }
    println!("{seeds} seeds from {first}, no violation: {c:?}");
    // The seeds must have done work, or the checks above checked nothing.
    assert!(c.acked >= 20 * seeds, "only {} writes acknowledged in {seeds} seeds", c.acked);
    assert!(c.reads >= 10 * seeds, "only {} batches read in {seeds} seeds", c.reads);
    if seeds >= 20 {
        assert!(c.power_cuts >= seeds / 2, "only {} power cuts in {seeds} seeds", c.power_cuts);
        assert!(c.disk_faults >= seeds / 10, "only {} failing disks in {seeds} seeds", c.disk_faults);
        assert!(c.rots >= seeds / 10, "only {} bits rotted in {seeds} seeds", c.rots);
        assert!(c.recoveries >= seeds / 20, "only {} replicas recovered in {seeds} seeds", c.recoveries);
    }
    assert!(
        c.disk_faults == 0 || c.injected_errors > 0,
        "failing disks returned no error to the store: {c:?}"
    );
}

/// The same seeds with `flush = interval`: appends are acknowledged before
/// their fsync, so a replica that loses power may forget entries it had
/// acknowledged, and reopens *recovering* (it cannot prove otherwise). The
/// promise is that such a loss on one replica at a time loses nothing
/// acknowledged; on a majority it is not promised. So here the nemesis
/// never cuts every node, and injects a power cut, a failing disk or rot
/// only while every replica is up, sound, not recovering and without rot
/// not found yet (a verified open sets aside everything after the rot,
/// entries written since included). Without that gate seeds 44 and 1300
/// lost a write that a power-cut or failing-disk leader and a rotted
/// follower had both held: two replicas' faults.
#[test]
fn interval_seeds() {
    let seeds = env("FERROLOG_SIM_INTERVAL_SEEDS").unwrap_or(SEEDS_IN_TEST / 3);
    let first = env("FERROLOG_SIM_SEED").unwrap_or(1);
    let mut c = Counts::default();
    for seed in first..first + seeds {
        INTERVAL.with(|i| i.set(true));
        let o = simulate(seed, Bug::None);
        INTERVAL.with(|i| i.set(false));
        c += o.unwrap_or_else(|e| panic!("flush = interval: {e}")).counts;
    }
    println!("flush = interval: {seeds} seeds from {first}, no violation: {c:?}");
    assert!(c.acked >= 20 * seeds && c.power_cuts >= seeds / 2 && c.recoveries > 0, "too little work: {c:?}");
}

/// Seeds that found bugs, kept passing (each replays exactly with `--cfg
/// tokio_unstable`): 5280 (bit rot in a follower's last frame was cut as a
/// torn tail and its flushed record lagged: it elected a lagging replica), 8607 (a recovering follower was released by an entry of the
/// same term before it held what it had acknowledged).
#[cfg(tokio_unstable)]
#[test]
fn seeds_that_found_bugs() {
    for seed in [5280, 8607] {
        let o = simulate(seed, Bug::None).unwrap_or_else(|e| panic!("{e}"));
        assert!(o.counts.rots > 0 && o.counts.acked > 0, "seed {seed} no longer rots or writes: {o:?}");
    }
}

/// Two runs of one seed see the same events at the same simulated times
/// (only with `--cfg tokio_unstable`, which lets tokio's generator be
/// seeded).
#[cfg(tokio_unstable)]
#[test]
fn a_seed_replays_exactly() {
    for seed in [7, 1_000_003, 42_424_242] {
        let a = simulate(seed, Bug::None).unwrap_or_else(|e| panic!("{e}"));
        let b = simulate(seed, Bug::None).unwrap_or_else(|e| panic!("{e}"));
        if a.digest != b.digest {
            let first = a.events.iter().zip(&b.events).position(|(x, y)| x != y).unwrap_or(0);
            panic!(
                "seed {seed} ran differently twice: {a:?} then {b:?}; from event {first}:\n{}\n---\n{}",
                a.events[first..].iter().take(8).cloned().collect::<Vec<_>>().join("\n"),
                b.events[first..].iter().take(8).cloned().collect::<Vec<_>>().join("\n"),
            );
        }
        assert!(a.counts.acked > 0 && a.counts.reads > 0, "seed {seed} did nothing: {a:?}");
    }
}

/// Runs seeds with `bug` until one breaks a safety check (a lost
/// acknowledged write, diverging logs, a record served and later
/// replaced); fails if none does within [`SEEDS_IN_TEST`] seeds. A group
/// that only fails to recover does not count: with acknowledgements before
/// fsync that is the store noticing the loss (its log ends below its
/// recorded flushed index, so it stops voting), not the checker.
#[cfg_attr(not(tokio_unstable), allow(dead_code, reason = "the controls need --cfg tokio_unstable"))]
fn must_break_safety(bug: Bug) {
    let mut unavailable = 0;
    for seed in 1..=SEEDS_IN_TEST {
        let Err(e) = simulate(seed, bug) else { continue };
        let safety = ["was lost", "differs", "was served as", "stored twice", "stored at"];
        if safety.iter().any(|s| e.lines().next().is_some_and(|l| l.contains(s))) {
            println!(
                "{bug:?} caught in seed {seed} ({unavailable} earlier seeds only lost availability): {e}"
            );
            return;
        }
        unavailable += 1;
    }
    panic!("{bug:?} broke no safety check in {SEEDS_IN_TEST} seeds");
}

/// Negative control: appends acknowledged before their fsync (only with
/// `--cfg tokio_unstable`, where its outcome does not vary between runs).
#[cfg(tokio_unstable)]
#[test]
fn negative_control_finds_acks_before_fsync() {
    must_break_safety(Bug::AckBeforeFsync);
}

/// Negative control: a replica that found its log damaged votes as if it
/// were whole (with `--cfg tokio_unstable`).
#[cfg(tokio_unstable)]
#[test]
fn negative_control_finds_votes_while_recovering() {
    must_break_safety(Bug::VoteWhileRecovering);
}

/// Negative control: a leader that acknowledges before commit, the bug
/// jepsen's control injects into whole brokers (in the simulation's own
/// build).
#[cfg(tokio_unstable)]
#[test]
fn negative_control_finds_acks_before_commit() {
    must_break_safety(Bug::AckBeforeCommit);
}

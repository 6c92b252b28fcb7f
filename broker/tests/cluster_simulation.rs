//! A seeded simulation of whole brokers (issue 15): three brokers of this
//! process on in-memory disks that keep only what fsync covered and on an
//! in-memory network, one thread, paused time, every random number drawn
//! from the seed. An idempotent producer writes batches while the seed's
//! faults strike between them, half of them at the leader of the moment,
//! now and then a second broker struck while the first one's fault is in
//! force:
//! - a broker's peer traffic cut off, healed 0.2-3.2 s later (while the
//!   next batches are produced);
//! - a broker's power cut (what no fsync covered is lost: per file a
//!   random part of the unsynced writes reaches the disk, the last of them
//!   torn at a random byte) and the broker started again on what its disk
//!   kept, at once or after up to 2 s;
//! - a broker's power cut, the broker kept down while the next 1-3 batches
//!   are produced by the other two, then started again;
//! - a power cut armed to strike at one of the broker's next 1-60 disk
//!   operations that change something (a write, a sync, a create, a
//!   rename, a removal), wherever that falls; the broker, whose every
//!   file operation fails from then on, is noticed and started again.
//!
//! After about one acknowledgement in three a consumer reads from an
//! offset the dice pick at or below the end, through whichever broker
//! serves it.
//!
//! At the end, with every fault healed and every replica holding the same
//! last entry, committed, the checker asks of the leader's log what
//! jepsen's asks of a partition's final read: every acknowledged record at
//! the offset it was acknowledged with; every record one that was sent,
//! once, batches whole and in the order written; and every read during the
//! run gapless and at the offsets the final log has. Then the brokers stop,
//! their power is cut, and each one's copy is read from what its disk kept
//! (`dump::dump_on`, what `ferrolog-broker dump-log` prints): every copy
//! must hold the leader's log record by record, offsets and values, and
//! end with a committed marker that fits it. (Not yet: several
//! partitions, consumer groups, membership changes.)
//!
//! `cargo test` runs [`SEEDS_IN_TEST`] seeds; more with
//! `FERROLOG_CLUSTER_SIM_SEEDS=N` (from `FERROLOG_CLUSTER_SIM_SEED`, to
//! replay one), on every core (`FERROLOG_CLUSTER_SIM_THREADS`). A failing
//! seed names itself and its last steps.

mod in_process;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use ferrolog_broker::network::memory::MemoryNetwork;
use ferrolog_proto::client::{FetchRequest, RecordSet, ReplicaState};
use ferrolog_raft_store::vfs::{Faults, PowerCut};
use in_process::{
    Disks, Member, Net, api, bind, create_topic, produce, producer_id, start, start_founders, status, stop,
};
use tokio::time::Instant;

/// Seeds `cargo test` runs.
const SEEDS_IN_TEST: u64 = 300;

/// From this many seeds on, a run must have struck every kind of fault
/// (24 seeds did, when `cargo test` ran 24).
const KINDS_CHECKED_FROM: u64 = 24;

/// Simulated seconds after which a batch retried all along counts as never
/// acknowledged (a fault lasts at most about 3 s, an election about one).
const NEVER_ACKNOWLEDGED_AFTER_S: u64 = 120;

/// Seeds the negative control runs with the bug injected.
const CONTROL_SEEDS: u64 = 1;

/// Batches each seed's producer writes.
const BATCHES: i32 = 30;

/// The seed's own decisions (which fault, when, how long): splitmix64.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// What a seed did, for the checks that it did something.
#[derive(Debug, Default)]
struct Outcome {
    /// Records acknowledged.
    acknowledged: usize,
    /// Peer traffic cuts.
    cuts: usize,
    /// Power cuts with the broker started again at once or soon.
    power_cuts: usize,
    /// Power cuts with the broker kept down while batches were produced.
    kept_down: usize,
    /// Batches acknowledged while a broker was kept down.
    acknowledged_while_down: usize,
    /// Armed power cuts that struck at a disk operation (in the middle of
    /// whatever the broker was doing).
    mid_write_cuts: usize,
    /// Faults that struck the broker leading the partition then (not
    /// counting armed cuts: who leads when one strikes is not known).
    leader_faults: usize,
    /// Steps in which a second broker was struck while the first one's
    /// fault was in force (an armed cut does not count: it strikes later).
    double_faults: usize,
    /// Records read from the brokers' disks and compared with the log.
    records_compared: usize,
    /// Records consumers read during the run (a record read twice counts
    /// twice).
    records_read: usize,
    /// Reads that stopped short of what had been acknowledged before them:
    /// stale reads from a leader cut off from its peers (see
    /// [`check_reads`]).
    short_reads: usize,
}

impl Outcome {
    fn add(&mut self, o: &Outcome) {
        self.acknowledged += o.acknowledged;
        self.cuts += o.cuts;
        self.power_cuts += o.power_cuts;
        self.kept_down += o.kept_down;
        self.acknowledged_while_down += o.acknowledged_while_down;
        self.mid_write_cuts += o.mid_write_cuts;
        self.leader_faults += o.leader_faults;
        self.double_faults += o.double_faults;
        self.records_compared += o.records_compared;
        self.records_read += o.records_read;
        self.short_reads += o.short_reads;
    }
}

/// A negative control's change to a seed, so that only the comparison of
/// the copies on the disks can see what it breaks.
#[derive(Clone, Copy, Debug, Default)]
struct Variant {
    /// No fault during the run (only the power cut after the brokers stop).
    without_faults: bool,
    /// A broker whose disk, from the middle of the run on, acknowledges
    /// fsync without persisting anything.
    lying_disk: Option<u32>,
    /// A broker whose power cut after the stop is clean (everything no
    /// fsync covered lost; a torn cut may keep all of it, by chance).
    clean_cut: Option<u32>,
}

/// Runs `seed` on a fresh one-thread runtime with paused time; returns
/// what it did and the steps it took; `Err` names the seed, what was
/// violated and the last steps taken.
fn simulate(seed: u64) -> Result<(Outcome, Vec<String>), String> {
    simulate_with(seed, Variant::default())
}

/// [`simulate`], changed as `variant` says.
fn simulate_with(seed: u64, variant: Variant) -> Result<(Outcome, Vec<String>), String> {
    ferrolog_raft_store::runtime::seed_thread_rng(Some(seed));
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_all().start_paused(true);
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let runtime = builder.build().map_err(|e| e.to_string())?;
    let mut steps = Vec::new();
    let result = runtime.block_on(async {
        ferrolog_raft_store::runtime::simulate_clocks(Some(Duration::from_secs(1_780_000_000)));
        let r = match tokio::time::timeout(Duration::from_secs(1_800), scenario(seed, variant, &mut steps))
            .await
        {
            Ok(r) => r.map_err(|e| format!("{e:#}")),
            Err(_) => Err("did not finish within 1,800 s of simulated time".to_owned()),
        };
        ferrolog_raft_store::runtime::simulate_clocks(None);
        r
    });
    drop(runtime);
    ferrolog_raft_store::runtime::seed_thread_rng(None);
    result.map(|o| (o, steps.clone())).map_err(|e| {
        let last: Vec<&String> = steps.iter().rev().take(16).rev().collect();
        format!(
            "seed {seed}: {e}\nlast steps: {last:#?}\nreplay: FERROLOG_CLUSTER_SIM_SEED={seed} \
             FERROLOG_CLUSTER_SIM_SEEDS=1 cargo test -p ferrolog-broker --test cluster_simulation"
        )
    })
}

/// A fault that struck broker `id`.
struct Struck {
    id: u32,
    /// Whether it is in force from now on (an armed power cut is not, until
    /// it strikes).
    in_force: bool,
    /// For a power cut: how long the broker stays down.
    restart_after: Option<Duration>,
}

/// The three brokers of a seed, and what the seed did to them.
struct Sim<'s> {
    net: Net,
    network: MemoryNetwork,
    disks: Disks,
    members: BTreeMap<u32, Member>,
    /// Every broker's peer address, as each one is configured with.
    cluster: BTreeMap<u32, SocketAddr>,
    /// Power cuts each disk has had that the simulation has seen to (a
    /// disk with more struck at an armed cut).
    cuts_seen: BTreeMap<u32, u64>,
    /// Brokers with a power cut armed that has not struck yet.
    armed: BTreeSet<u32>,
    /// Brokers kept down, with the batch before which each starts again.
    down: BTreeMap<u32, i32>,
    /// Per broker, how many peer-traffic cuts it has had: a heal is for
    /// the cut it was scheduled with, not a later one.
    cut_generation: BTreeMap<u32, std::sync::Arc<std::sync::atomic::AtomicU64>>,
    /// What the seed did, in order (kept by the caller: a seed that
    /// times out still shows them).
    steps: &'s mut Vec<String>,
    outcome: Outcome,
}

impl<'s> Sim<'s> {
    /// Starts the three founding brokers together.
    async fn start(disks: Disks, steps: &'s mut Vec<String>) -> anyhow::Result<Self> {
        let network = MemoryNetwork::new();
        let net = Net::Memory(network.clone());
        let (members, cluster, _) = start_founders(&net, &disks).await?;
        Ok(Self {
            net,
            network,
            disks,
            members,
            cluster,
            cuts_seen: (1..=3).map(|id| (id, 0)).collect(),
            armed: BTreeSet::new(),
            down: BTreeMap::new(),
            cut_generation: (1..=3).map(|id| (id, std::sync::Arc::default())).collect(),
            steps,
            outcome: Outcome::default(),
        })
    }

    fn power_cuts(&self, id: u32) -> u64 {
        self.disks.memory_disk(id).map_or(0, |d| d.stats().power_cuts)
    }

    /// The broker that leads the partition now, as it says itself (the
    /// others' word may be stale).
    async fn leader(&self) -> Option<u32> {
        for (id, m) in self.members.iter().filter(|(_, m)| m.running.is_some()) {
            if let Ok(s) = status(&self.net, m.client).await
                && s.error.is_none()
                && s.leader == *id
            {
                return Some(*id);
            }
        }
        None
    }

    /// Stops broker `id` (if it runs) and starts it again on its
    /// directory, ports and what its disk kept.
    async fn restart(&mut self, id: u32) -> anyhow::Result<()> {
        let m = self.members.get_mut(&id).expect("member");
        if m.running.is_some() {
            stop(m).await?;
        }
        let l = bind(&self.net, m.peer, m.client).await?;
        let (_, stop_tx, serving) = start(self.disks.fs(id), id, m.dir.clone(), &self.cluster, l).await?;
        m.running = Some((stop_tx, serving));
        Ok(())
    }

    /// Cuts broker `id`'s power now (the broker is stopped: its process
    /// is gone).
    async fn cut_power(&mut self, id: u32) -> anyhow::Result<()> {
        self.disks.cut_power(id);
        self.armed.remove(&id);
        self.cuts_seen.insert(id, self.power_cuts(id));
        let m = self.members.get_mut(&id).expect("member");
        stop(m).await
    }

    /// Starts again the brokers whose armed power cut struck, and those
    /// kept down until before batch `batch`.
    async fn recover(&mut self, batch: i32) -> anyhow::Result<()> {
        for id in 1..=3u32 {
            let cuts = self.power_cuts(id);
            if cuts > self.cuts_seen[&id] {
                self.cuts_seen.insert(id, cuts);
                self.armed.remove(&id);
                self.outcome.mid_write_cuts += 1;
                self.steps.push(format!("broker {id}'s armed power cut struck; starting it again"));
                let m = self.members.get_mut(&id).expect("member");
                stop(m).await?;
                self.down.entry(id).or_insert(batch);
            }
        }
        let due: Vec<u32> = self.down.iter().filter(|(_, b)| **b <= batch).map(|(id, _)| *id).collect();
        for id in due {
            self.down.remove(&id);
            self.steps.push(format!("broker {id} starts again"));
            self.restart(id).await?;
        }
        Ok(())
    }

    /// One fault on a broker the dice pick (the leader half the time),
    /// never on `spare` (struck already in this step) or on a broker kept
    /// down; returns what struck. A power cut's broker is started again by
    /// the caller ([`Sim::start_again`]), so that a second fault of the
    /// step strikes while the first is still in force.
    async fn strike(
        &mut self,
        dice: &mut Dice,
        batch: i32,
        spare: Option<u32>,
    ) -> anyhow::Result<Option<Struck>> {
        let leader = self.leader().await;
        let id = match leader {
            Some(l) if dice.below(2) == 0 => l,
            _ => 1 + u32::try_from(dice.below(3))?,
        };
        let kind = dice.below(4);
        if Some(id) == spare || self.down.contains_key(&id) {
            return Ok(None);
        }
        let at_leader = if Some(id) == leader { " (the leader)" } else { "" };
        let struck = match kind {
            0 => {
                let lasts = Duration::from_millis(200 + dice.below(3_000));
                self.steps.push(format!("cut broker {id}'s peer traffic for {lasts:?}{at_leader}"));
                self.outcome.cuts += 1;
                let (n, addr) = (self.network.clone(), self.members[&id].peer);
                let generation = self.cut_generation[&id].clone();
                let this_cut = generation.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                n.cut(addr);
                tokio::spawn(async move {
                    tokio::time::sleep(lasts).await;
                    // A later cut of the same broker keeps its own time.
                    if generation.load(std::sync::atomic::Ordering::Relaxed) == this_cut {
                        n.heal(addr);
                    }
                });
                Struck { id, in_force: true, restart_after: None }
            }
            1 => {
                let down = Duration::from_millis(dice.below(2_000));
                self.steps.push(format!("power cut of broker {id}, down {down:?}{at_leader}"));
                self.outcome.power_cuts += 1;
                self.cut_power(id).await?;
                Struck { id, in_force: true, restart_after: Some(down) }
            }
            // Kept down while batches are produced: not while another is
            // (its batches could then never be acknowledged) or has a cut
            // armed. A cut of another broker's peer traffic may be in force
            // meanwhile: the batches wait for its heal.
            2 if self.down.is_empty() && self.armed.is_empty() => {
                let batches = 1 + i32::try_from(dice.below(3))?;
                self.steps.push(format!("power cut of broker {id}, down for {batches} batches{at_leader}"));
                self.outcome.kept_down += 1;
                self.cut_power(id).await?;
                self.down.insert(id, batch + batches);
                Struck { id, in_force: true, restart_after: None }
            }
            3 if self.down.is_empty() && !self.armed.contains(&id) => {
                let ops = 1 + dice.below(60);
                self.steps.push(format!(
                    "power cut of broker {id} armed for its disk operation {ops} from now{at_leader}"
                ));
                self.armed.insert(id);
                if let Some(disk) = self.disks.memory_disk(id) {
                    disk.power_cut_after(ops, PowerCut::Torn);
                }
                // Where it strikes, and who leads then, is not known yet.
                return Ok(Some(Struck { id, in_force: false, restart_after: None }));
            }
            _ => return Ok(None),
        };
        if Some(id) == leader {
            self.outcome.leader_faults += 1;
        }
        Ok(Some(struck))
    }

    /// Starts again the brokers of `struck` whose power was cut for a
    /// while, each once its own time down has passed (counted from now).
    async fn start_again(&mut self, struck: &[Struck]) -> anyhow::Result<()> {
        let mut due: Vec<(Duration, u32)> =
            struck.iter().filter_map(|s| Some((s.restart_after?, s.id))).collect();
        due.sort_unstable();
        let mut waited = Duration::ZERO;
        for (down, id) in due {
            tokio::time::sleep(down.saturating_sub(waited)).await;
            waited = waited.max(down);
            self.restart(id).await?;
        }
        Ok(())
    }

    /// Produces `values` as one batch with `sequence`, retrying (the same
    /// batch and sequence: KIP-98 answers a retry of a stored batch with
    /// its offset) and starting again brokers whose armed cut struck,
    /// until it is acknowledged or [`NEVER_ACKNOWLEDGED_AFTER_S`] pass.
    async fn produce(
        &mut self,
        producer: (i64, i32),
        batch: i32,
        sequence: i32,
        values: &[String],
    ) -> anyhow::Result<Result<u64, String>> {
        let deadline = Instant::now() + Duration::from_secs(NEVER_ACKNOWLEDGED_AFTER_S);
        loop {
            let up: Vec<&Member> = self.members.values().filter(|m| m.running.is_some()).collect();
            match produce(&up, producer, sequence, values).await {
                Ok(base) => return Ok(Ok(base)),
                Err(e) if Instant::now() < deadline => self.steps.push(format!("  retry: {e:#}")),
                Err(e) => return Ok(Err(format!("batch {batch} never acknowledged: {e:#}"))),
            }
            // Not before the next batch: the other two may need it.
            self.recover(batch).await?;
        }
    }
}

/// One seed: three brokers, a producer, faults, then the checks.
async fn scenario(seed: u64, variant: Variant, steps: &mut Vec<String>) -> anyhow::Result<Outcome> {
    let mut dice = Dice(seed ^ 0x5EED);
    let mut sim = Sim::start(Disks::simulated_from(seed), steps).await?;
    faults_and_checks(&mut sim, &mut dice, variant).await?;
    Ok(std::mem::take(&mut sim.outcome))
}

/// The run and its checks, changed as `variant` says (without faults, the
/// dice the faults would draw are not drawn, so batches and reads differ
/// from the seed's with them).
async fn faults_and_checks(sim: &mut Sim<'_>, dice: &mut Dice, variant: Variant) -> anyhow::Result<()> {
    create_topic(&sim.members[&1], &[]).await?;
    let producer = producer_id(&sim.members.values().collect::<Vec<_>>()).await?;

    // Acknowledged batches: base offset → their values.
    let mut acked: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    // Every batch sent, acknowledged or not, by batch number.
    let mut sent: Vec<Vec<String>> = Vec::new();
    let mut sequence = 0i32;
    // A batch never acknowledged ends the writes; the checks still run
    // (a write lost after its acknowledgement shows there as such).
    let mut stalled = None;
    // What consumers read during the run: (offset, value).
    let mut reads: Vec<Read> = Vec::new();
    for batch in 0..BATCHES {
        sim.recover(batch).await?;
        if let Some(disk) = variant.lying_disk.and_then(|id| sim.disks.memory_disk(id))
            && batch == BATCHES / 2
        {
            disk.set_faults(Faults { fsync_lies: true, ..Faults::default() });
        }
        if dice.below(3) == 0 && !variant.without_faults {
            let mut struck: Vec<Struck> = sim.strike(dice, batch, None).await?.into_iter().collect();
            // Now and then a second broker at once.
            if let Some(first) = struck.first().map(|s| s.id)
                && dice.below(4) == 0
                && let Some(second) = sim.strike(dice, batch, Some(first)).await?
            {
                if struck[0].in_force && second.in_force {
                    sim.outcome.double_faults += 1;
                }
                struck.push(second);
            }
            sim.start_again(&struck).await?;
        }
        let size = 1 + usize::try_from(dice.below(5))?;
        let values: Vec<String> = (0..size).map(|i| format!("b{batch}-{i}")).collect();
        sent.push(values.clone());
        sim.steps.push(format!("produce batch {batch} ({size} records, sequence {sequence})"));
        let base = match sim.produce(producer, batch, sequence, &values).await? {
            Ok(base) => base,
            Err(e) => {
                stalled = Some(e);
                break;
            }
        };
        sim.steps.push(format!("  acknowledged at offset {base}"));
        if !sim.down.is_empty() {
            sim.outcome.acknowledged_while_down += 1;
        }
        anyhow::ensure!(acked.insert(base, values.clone()).is_none(), "offset {base} acknowledged twice");
        sequence += i32::try_from(size)?;
        // After about one acknowledgement in three a consumer reads from
        // an offset at or below the end.
        if dice.below(3) == 0 {
            let acknowledged_end = base + size as u64;
            let from = dice.below(acknowledged_end + 1);
            if let Ok((records, _, by)) = fetch_once(sim, from).await? {
                sim.steps
                    .push(format!("  read {} records from offset {from} from broker {by}", records.len()));
                sim.outcome.records_read += records.len();
                if records.last().map_or(from, |(o, _)| o + 1) < acknowledged_end {
                    // Who says what, for the record (see `check_reads`).
                    let mut views = Vec::new();
                    for (id, m) in sim.members.iter().filter(|(_, m)| m.running.is_some()) {
                        if let Ok(s) = status(&sim.net, m.client).await {
                            views.push(format!("broker {id}: leader {} term {}", s.leader, s.term));
                        }
                    }
                    sim.steps.push(format!("  short of offset {acknowledged_end}; {}", views.join(", ")));
                }
                reads.push(Read { from, acknowledged_end, records });
            }
        }
    }
    sim.outcome.acknowledged = acked.values().map(Vec::len).sum();

    // Every fault healed (an armed cut that never struck strikes now):
    // every replica catches up to the same log.
    for id in std::mem::take(&mut sim.armed) {
        sim.steps.push(format!("broker {id}'s armed power cut struck at the end"));
        sim.cut_power(id).await?;
        sim.down.insert(id, 0);
    }
    // Those still kept down start again now.
    sim.down.values_mut().for_each(|until| *until = BATCHES);
    sim.recover(BATCHES).await?;
    for m in sim.members.values() {
        sim.network.heal(m.peer);
    }
    sim.steps.push("healed; waiting for every replica to catch up".into());
    converge(sim).await?;
    let log = leader_log(sim).await?;
    check(&acked, &sent, &log)?;
    sim.outcome.short_reads += check_reads(&reads, &log)?;
    if let Some(e) = stalled {
        anyhow::bail!("{e}");
    }

    // Every broker's copy, as its disk holds it once the broker stopped
    // and the power went: what no fsync covered is gone (a broker of this
    // process leaves its replicas to the process's exit; the power cut
    // ends them as an exit would).
    for m in sim.members.values_mut() {
        stop(m).await?;
    }
    for id in 1..=3 {
        match sim.disks.memory_disk(id) {
            Some(disk) if variant.clean_cut == Some(id) => disk.power_cut(PowerCut::Clean),
            _ => sim.disks.cut_power(id),
        }
        // A copy that cannot be read is as lost as a missing one.
        let copy = copy_on_disk(sim, id).map_err(|e| {
            if e.to_string().starts_with("violation: ") {
                e
            } else {
                anyhow::anyhow!("violation: broker {id}'s copy on its disk cannot be read: {e:#}")
            }
        })?;
        anyhow::ensure!(
            copy == log,
            "violation: broker {id}'s copy on its disk differs from the leader's log: {} records \
             against {}, first difference at offset {}",
            copy.len(),
            log.len(),
            // Both are gapless from offset 0: a record's index is its offset.
            copy.iter().zip(&log).position(|(a, b)| a != b).unwrap_or(copy.len().min(log.len()))
        );
        sim.outcome.records_compared += copy.len();
    }
    Ok(())
}

/// Waits until every replica runs and holds the same last entry, which a
/// leader has committed. (Not "up to the last acknowledged offset": an
/// acknowledgement the log does not hold is for the checks to report.)
async fn converge(sim: &Sim<'_>) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut states = Vec::new();
        for (id, m) in &sim.members {
            states.push((*id, status(&sim.net, m.client).await.ok()));
        }
        let last = states[0].1.as_ref().map(|f| f.last_log_index);
        // The leader as it says itself (the others' word for it may be
        // stale: a leader that lost power and started again is a follower
        // until the next election).
        let caught_up = states.iter().all(|(_, s)| {
            s.as_ref().is_some_and(|s| {
                s.replica_state == ReplicaState::Running as i32 && Some(s.last_log_index) == last
            })
        }) && states
            .iter()
            .any(|(id, s)| s.as_ref().is_some_and(|s| s.leader == *id && Some(s.commit_index) == last));
        if caught_up {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the replicas did not converge: {states:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One fetch from `offset` through whichever running broker serves it
/// (the leader: a follower refuses fetches): the (offset, value) pairs
/// read from `offset` on, the high watermark and the broker that served
/// them; `Err` with each broker's refusal when none served it.
async fn fetch_once(
    sim: &Sim<'_>,
    offset: u64,
) -> anyhow::Result<Result<(Vec<(u64, String)>, u64, u32), Vec<String>>> {
    let mut refusals = Vec::new();
    for (id, m) in sim.members.iter().filter(|(_, m)| m.running.is_some()) {
        let request = FetchRequest {
            topic: in_process::TOPIC.into(),
            partition: 0,
            offset,
            max_bytes: 16 << 20,
            ..Default::default()
        };
        let r = match api(&sim.net, m.client).await {
            Ok(mut client) => client.fetch(request).await.map(tonic::Response::into_inner),
            Err(e) => {
                refusals.push(format!("broker {id}: {e:#}"));
                continue;
            }
        };
        let r = match r {
            Ok(r) if r.error.is_none() => r,
            Ok(r) => {
                refusals.push(format!("broker {id}: {:?}", r.error));
                continue;
            }
            Err(status) => {
                refusals.push(format!("broker {id}: {status}"));
                continue;
            }
        };
        let mut read = Vec::new();
        for b in &r.batches {
            let set = <RecordSet as prost::Message>::decode(b.records.clone())?;
            for (i, rec) in set.records.iter().enumerate() {
                let at = b.base_offset + i as u64;
                if at >= offset {
                    read.push((at, String::from_utf8_lossy(&rec.value).into_owned()));
                }
            }
        }
        return Ok(Ok((read, r.high_watermark, *id)));
    }
    Ok(Err(refusals))
}

/// The log as the leader serves it, read from offset 0 to the high
/// watermark: (offset, value) pairs. A consumer asks again while no broker
/// serves it (a leader elected a moment ago may not yet), for 30 s.
async fn leader_log(sim: &mut Sim<'_>) -> anyhow::Result<Vec<(u64, String)>> {
    let mut log: Vec<(u64, String)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let next = log.last().map_or(0, |(o, _)| o + 1);
        let (read, high_watermark, _) = match fetch_once(sim, next).await? {
            Ok(served) => served,
            Err(refusals) if Instant::now() < deadline => {
                sim.steps.push(format!("  final read from {next} refused: {refusals:?}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(refusals) => anyhow::bail!("no broker served the partition: {refusals:?}"),
        };
        log.extend(read);
        let after = log.last().map_or(0, |(o, _)| o + 1);
        if after >= high_watermark || after == next {
            return Ok(log);
        }
    }
}

/// Broker `id`'s copy of the partition as its disk holds it (the broker
/// stopped): (offset, value) pairs, read as `dump-log` reads them. The
/// copy must be whole and end with its committed marker: offsets from 0
/// with no gap (nothing here deletes or compacts), the marker after the
/// last record, its log start 0 and its log end the offset after the last
/// record, its committed end not past that.
fn copy_on_disk(sim: &Sim<'_>, id: u32) -> anyhow::Result<Vec<(u64, String)>> {
    let mut out = Vec::new();
    let dir = &sim.members[&id].dir;
    ferrolog_broker::dump::dump_on(&sim.disks.fs(id), dir, &mut out)?;
    let mut copy: Vec<(u64, String)> = Vec::new();
    let mut marker = None;
    for line in out.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let v: serde_json::Value = serde_json::from_slice(line)?;
        if let Some(r) = v.get("replica") {
            if r["topic"] == in_process::TOPIC && r["partition"] == 0 {
                anyhow::ensure!(marker.is_none(), "broker {id}'s copy has two committed markers");
                marker = Some(r.clone());
            }
        } else if v["topic"] == in_process::TOPIC && v["partition"] == 0 {
            anyhow::ensure!(
                marker.is_none(),
                "violation: broker {id}'s copy has a record after its marker: {v}"
            );
            let offset = v["offset"].as_u64().ok_or_else(|| anyhow::anyhow!("no offset: {v}"))?;
            let expected = copy.last().map_or(0, |(o, _)| o + 1);
            anyhow::ensure!(
                offset == expected,
                "violation: broker {id}'s copy has offset {offset} after {expected}"
            );
            // A value the producer never sent (null, not UTF-8) shows as its JSON.
            let value = v["value"].as_str().map_or_else(|| v.to_string(), str::to_owned);
            copy.push((offset, value));
        }
    }
    let marker =
        marker.ok_or_else(|| anyhow::anyhow!("violation: broker {id}'s copy has no committed marker"))?;
    let end = copy.len() as u64;
    anyhow::ensure!(
        marker["log_start_offset"] == 0
            && marker["log_end_offset"] == end
            && marker["committed_end"].as_u64().is_some_and(|c| c <= end),
        "violation: broker {id}'s committed marker {marker} does not fit its {end} records"
    );
    Ok(copy)
}

/// Jepsen's rules for one partition's log: offsets strictly increasing;
/// every acknowledged record at its acknowledged offset; every record one
/// that was sent (`sent[batch][i]` is `b{batch}-{i}`), once; batches in
/// the order written, each whole and in its own order (a batch that was
/// never acknowledged, the last one sent, may be there whole or not at all).
fn check(
    acked: &BTreeMap<u64, Vec<String>>,
    sent: &[Vec<String>],
    log: &[(u64, String)],
) -> anyhow::Result<()> {
    for pair in log.windows(2) {
        anyhow::ensure!(pair[0].0 < pair[1].0, "violation: offset {} after offset {}", pair[1].0, pair[0].0);
    }
    let by_offset: BTreeMap<u64, &str> = log.iter().map(|(o, v)| (*o, v.as_str())).collect();
    for (base, values) in acked {
        for (i, v) in values.iter().enumerate() {
            let at = base + i as u64;
            anyhow::ensure!(
                by_offset.get(&at) == Some(&v.as_str()),
                "violation: acknowledged {v:?} at offset {at}, the log holds {:?} there",
                by_offset.get(&at)
            );
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    // The batch being read and the index of its last record read.
    let mut current: Option<(usize, usize)> = None;
    for (offset, v) in log {
        anyhow::ensure!(seen.insert(v.clone()), "violation: {v:?} is in the log twice (again at {offset})");
        let (batch, i) = v
            .strip_prefix('b')
            .and_then(|s| s.split_once('-'))
            .and_then(|(b, i)| Some((b.parse::<usize>().ok()?, i.parse::<usize>().ok()?)))
            .filter(|(b, i)| sent.get(*b).and_then(|s| s.get(*i)) == Some(v))
            .ok_or_else(|| anyhow::anyhow!("violation: a record never sent: {v:?} at {offset}"))?;
        match current {
            Some((b, last)) if b == batch => {
                anyhow::ensure!(
                    i == last + 1,
                    "violation: {v:?} at {offset} after record {last} of its batch"
                );
            }
            previous => {
                if let Some((b, last)) = previous {
                    anyhow::ensure!(batch > b, "violation: batch {batch} after batch {b} (offset {offset})");
                    anyhow::ensure!(last + 1 == sent[b].len(), "violation: batch {b} is in the log in part");
                }
                anyhow::ensure!(i == 0, "violation: batch {batch} begins with its record {i} at {offset}");
            }
        }
        current = Some((batch, i));
    }
    if let Some((b, last)) = current {
        anyhow::ensure!(last + 1 == sent[b].len(), "violation: batch {b} is in the log in part");
    }
    Ok(())
}

/// A consumer's fetch during the run.
#[derive(Debug)]
struct Read {
    /// The offset it asked for.
    from: u64,
    /// The offset after the last record acknowledged before it was sent.
    acknowledged_end: u64,
    /// What it got: (offset, value).
    records: Vec<(u64, String)>,
}

/// What consumers read during the run against the final log: a read is
/// the records from the offset asked for on, with no gap; every record
/// read (the leader serves only what is committed) is at the same offset
/// in the final log, or a read showed what was later lost or moved.
/// Observed, not required: a read from below the acknowledged end that
/// stops short of it, a stale read (a leader cut off from its peers serves
/// what it committed until CheckQuorum deposes it, while the new leader
/// acknowledges more; the run's steps name each broker's leader and term
/// at such a read); returns how many did.
fn check_reads(reads: &[Read], log: &[(u64, String)]) -> anyhow::Result<usize> {
    let by_offset: BTreeMap<u64, &str> = log.iter().map(|(o, v)| (*o, v.as_str())).collect();
    let mut short = 0;
    for read in reads {
        for (i, (offset, v)) in read.records.iter().enumerate() {
            anyhow::ensure!(
                *offset == read.from + i as u64,
                "violation: a read from offset {} returned offset {offset} as its record {i}",
                read.from
            );
            anyhow::ensure!(
                by_offset.get(offset) == Some(&v.as_str()),
                "violation: {v:?} was read at offset {offset} during the run, the final log holds {:?} there",
                by_offset.get(offset)
            );
        }
        let end = read.records.last().map_or(read.from, |(o, _)| o + 1);
        if end < read.acknowledged_end {
            short += 1;
        }
    }
    Ok(short)
}

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// [`SEEDS_IN_TEST`] seeds (or `FERROLOG_CLUSTER_SIM_SEEDS` from
/// `FERROLOG_CLUSTER_SIM_SEED`), on every core: none may violate the
/// checks, and together they must have acknowledged records, compared
/// every broker's copy, read during the run and struck every kind of
/// fault.
#[test]
fn seeded_clusters_lose_and_reorder_nothing_through_cuts_and_power_cuts() {
    let first = env("FERROLOG_CLUSTER_SIM_SEED").unwrap_or(1);
    let seeds = env("FERROLOG_CLUSTER_SIM_SEEDS").unwrap_or(SEEDS_IN_TEST);
    // Seeds on as many threads as there are cores, or
    // `FERROLOG_CLUSTER_SIM_THREADS`: each seed runs alone on its thread
    // (its runtime, random numbers and clocks are the thread's). At most
    // as many as the broker's process-wide read permits
    // (`partition::READS_IN_FLIGHT`), which the seeds share: a seed holds one at
    // a time, so none ever waits for another seed's (a wait would let its
    // paused clock jump and the seed would not replay).
    let threads = env("FERROLOG_CLUSTER_SIM_THREADS")
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get() as u64))
        .unwrap_or(1)
        .clamp(1, seeds.clamp(1, ferrolog_broker::partition::READS_IN_FLIGHT as u64));
    let next = std::sync::atomic::AtomicU64::new(first);
    let results = std::sync::Mutex::new(BTreeMap::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seed >= first + seeds {
                        break;
                    }
                    // A panic in a seed is that seed's failure, named.
                    let r = std::panic::catch_unwind(|| simulate(seed).map(|(o, _)| o)).unwrap_or_else(|p| {
                        let what = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                            .unwrap_or_default();
                        Err(format!("seed {seed} panicked: {what}"))
                    });
                    results.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(seed, r);
                }
            });
        }
    });
    let results = results.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    assert_eq!(results.len() as u64, seeds, "every seed ran");
    let mut total = Outcome::default();
    let mut failures = Vec::new();
    for r in results.into_values() {
        match r {
            Ok(o) => total.add(&o),
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{} of {seeds} seeds failed:\n{}", failures.len(), failures.join("\n\n"));
    eprintln!("{seeds} seeds: {total:?}");
    assert!(
        total.acknowledged >= BATCHES as usize * seeds as usize,
        "too little was acknowledged: {total:?}"
    );
    // Three copies of at least what was acknowledged were compared.
    assert!(total.records_compared >= 3 * total.acknowledged, "too little was compared: {total:?}");
    if seeds >= KINDS_CHECKED_FROM {
        let kinds = [
            total.cuts,
            total.power_cuts,
            total.kept_down,
            total.acknowledged_while_down,
            total.mid_write_cuts,
            total.leader_faults,
            total.double_faults,
            total.records_read,
        ];
        assert!(kinds.iter().all(|n| *n > 0), "the seeds struck no fault of a kind: {total:?}");
    }
}

/// The checker itself: it must reject a lost, moved, duplicated, invented,
/// partial or reordered record (a checker that passes everything proves
/// nothing), and accept the unacknowledged last batch whole or absent.
#[test]
fn the_checker_rejects_each_kind_of_violation() {
    let sent: Vec<Vec<String>> =
        vec![vec!["b0-0".into(), "b0-1".into()], vec!["b1-0".into()], vec!["b2-0".into(), "b2-1".into()]];
    let acked: BTreeMap<u64, Vec<String>> = [(0, sent[0].clone()), (2, sent[1].clone())].into();
    let log = |pairs: &[(u64, &str)]| pairs.iter().map(|(o, v)| (*o, (*v).to_owned())).collect::<Vec<_>>();
    let good = log(&[(0, "b0-0"), (1, "b0-1"), (2, "b1-0")]);
    check(&acked, &sent, &good).expect("a good log");
    let with_unacked = log(&[(0, "b0-0"), (1, "b0-1"), (2, "b1-0"), (3, "b2-0"), (4, "b2-1")]);
    check(&acked, &sent, &with_unacked).expect("the unacknowledged last batch, whole");
    let bad = [
        log(&[(0, "b0-0"), (1, "b0-1")]),
        log(&[(0, "b0-0"), (1, "b0-1"), (3, "b1-0")]),
        log(&[(0, "b0-0"), (1, "b0-1"), (2, "b1-0"), (3, "b0-0")]),
        log(&[(0, "b0-0"), (1, "b0-1"), (2, "b1-0"), (3, "x")]),
        log(&[(0, "b0-0"), (1, "b0-1"), (2, "b1-0"), (3, "b1-9")]),
        log(&[(0, "b0-0"), (1, "b0-1"), (2, "b1-0"), (3, "b2-0")]),
        log(&[(0, "b0-1"), (1, "b0-0"), (2, "b1-0")]),
        log(&[(0, "b0-0"), (1, "b0-1"), (2, "b1-0"), (2, "b2-0"), (3, "b2-1")]),
        log(&[(0, "b0-0"), (1, "b0-1"), (2, "b1-0"), (3, "b3-0")]),
    ];
    for (i, l) in bad.iter().enumerate() {
        let e = check(&acked, &sent, l).expect_err(&format!("bad log {i} passed: {l:?}"));
        assert!(e.to_string().starts_with("violation: "), "bad log {i}: {e}");
    }
    // Reads during the run: each from its offset on with no gap, and
    // where the final log has it; one that stops short is counted.
    let read = |from: u64, pairs: &[(u64, &str)]| Read { from, acknowledged_end: 3, records: log(pairs) };
    let fine = [read(1, &[(1, "b0-1"), (2, "b1-0")]), read(3, &[]), read(0, &[(0, "b0-0")])];
    assert_eq!(check_reads(&fine, &good).expect("reads of the final log"), 1, "one read stopped short");
    let bad_reads = [
        read(1, &[(1, "b1-0")]),
        read(3, &[(3, "b2-0")]),
        read(0, &[(0, "b0-0"), (2, "b1-0")]),
        read(1, &[(2, "b1-0")]),
    ];
    for (i, r) in bad_reads.iter().enumerate() {
        let e =
            check_reads(std::slice::from_ref(r), &good).expect_err(&format!("bad read {i} passed: {r:?}"));
        assert!(e.to_string().starts_with("violation: "), "bad read {i}: {e}");
    }
}

/// The negative control: the same seeds with a bug injected on purpose
/// (`FERROLOG_INJECT_BUG=ack-before-commit`, `ferrolog_broker::inject`: a
/// leader answers a produce whose commit is slow as if it had committed,
/// at a guessed offset) must fail the checks. Run as a child process of
/// this test binary, as the switch is read once per process (and only by
/// debug builds: a release build of this test has no bug to inject, and
/// this control says so and fails).
#[test]
fn the_simulation_catches_an_injected_ack_before_commit() {
    if !cfg!(debug_assertions) {
        panic!("only debug builds can inject the bug this control needs");
    }
    let out = std::process::Command::new(std::env::current_exe().expect("this test's binary"))
        .args(["--exact", "seeded_clusters_lose_and_reorder_nothing_through_cuts_and_power_cuts"])
        .env(ferrolog_broker::inject::ENV, "ack-before-commit")
        .env("FERROLOG_CLUSTER_SIM_SEED", "1")
        .env("FERROLOG_CLUSTER_SIM_SEEDS", CONTROL_SEEDS.to_string())
        .output()
        .expect("run the seeds with the bug");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "the seeds passed with acknowledgements before commit:\n{text}");
    assert!(
        text.contains("violation: acknowledged"),
        "the seeds failed, but not on an acknowledged record missing or moved:\n{text}"
    );
    eprintln!("{}", text.lines().filter(|l| l.starts_with("seed ")).collect::<Vec<_>>().join("\n"));
    assert!(text.contains("1 passed") || text.contains("1 failed"), "the seeds' test did not run:\n{text}");
}

/// The negative control of the copies' comparison: a seed without faults
/// whose broker 3 has a disk that acknowledges fsync without persisting
/// must fail on broker 3's copy (its brokers' answers were all fine: only
/// what the disk kept after the last power cut shows it); the same seed
/// with an honest disk passes, so the lie alone makes the difference.
#[test]
fn the_copies_on_the_disks_catch_a_disk_that_lies_about_fsync() {
    let honest = Variant { without_faults: true, clean_cut: Some(3), ..Variant::default() };
    let (o, _) = simulate_with(5, honest).unwrap_or_else(|e| panic!("seed 5 without faults failed: {e}"));
    assert!(o.records_compared > 0, "{o:?}");
    let e = simulate_with(5, Variant { lying_disk: Some(3), ..honest })
        .expect_err("a disk that lies about fsync went unnoticed");
    assert!(
        e.contains("violation: broker 3's copy on its disk differs from the leader's log"),
        "the seed failed, but not on broker 3's copy compared with the log:\n{e}"
    );
    eprintln!("{}", e.lines().next().unwrap_or_default());
}

/// A seed replays exactly: run twice, it takes the same steps (faults,
/// batches, retries with their errors, the offsets acknowledged). Without
/// `--cfg tokio_unstable` tokio's own random numbers are not seeded and
/// only the faults and batches are compared.
#[test]
fn a_seed_replays_the_same_steps() {
    let (first, steps) = simulate(3).unwrap_or_else(|e| panic!("{e}"));
    assert!(first.acknowledged > 0 && steps.len() > usize::try_from(BATCHES).unwrap_or(0), "{steps:?}");
    let (_, again) = simulate(3).unwrap_or_else(|e| panic!("{e}"));
    #[cfg(tokio_unstable)]
    assert_eq!(steps, again, "seed 3 took other steps the second time");
    let faults = |s: &[String]| s.iter().filter(|l| !l.starts_with(' ')).cloned().collect::<Vec<_>>();
    assert_eq!(faults(&steps), faults(&again), "seed 3 drew other faults the second time");
}

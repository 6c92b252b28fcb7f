//! Three brokers in one process on a simulation's disks and network, on a
//! one-thread runtime with paused time and every random number drawn from
//! a seed (issue 15: the ground a seeded simulation of whole brokers stands
//! on, where a failing seed must replay exactly): one seed run twice runs
//! the same, also beside another simulation in the process.

mod in_process;

use ferrolog_broker::network::memory::MemoryNetwork;
use in_process::{Disks, Net, run};

/// What a run of the scenario did, as far as the network and disks saw it
/// (which node dialled which address, in order; each disk's syncs), the
/// brokers' boot ids (random numbers drawn from the seed), and when (in
/// simulated time) it ended.
#[derive(Debug, PartialEq, Eq)]
struct Fingerprint {
    boot_ids: Vec<u64>,
    elapsed_ms: u128,
    connections: u64,
    dials: u64,
    disks: Vec<ferrolog_raft_store::vfs::FaultyStats>,
}

/// Runs the scenario on a simulation's disks and network, on a fresh
/// one-thread runtime with paused time, everything drawn from `seed`: the
/// Raft library's and the brokers' random numbers
/// (`ferrolog_raft_store::runtime`), tokio's own (with `tokio_unstable`),
/// and a simulated wall clock.
fn simulate(seed: u64) -> anyhow::Result<Fingerprint> {
    ferrolog_raft_store::runtime::seed_thread_rng(Some(seed));
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_all().start_paused(true);
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let runtime = builder.build()?;
    let result = runtime.block_on(async {
        ferrolog_raft_store::runtime::simulate_clocks(Some(std::time::Duration::from_secs(1_780_000_000)));
        let started = tokio::time::Instant::now();
        let network = MemoryNetwork::new();
        let disks = Disks::simulated_from(seed);
        let ran = run(&disks, Net::Memory(network.clone())).await;
        ferrolog_raft_store::runtime::simulate_clocks(None);
        Ok(Fingerprint {
            boot_ids: ran?,
            elapsed_ms: started.elapsed().as_millis(),
            connections: network.connections(),
            dials: network.dial_digest(),
            disks: disks.stats(),
        })
    });
    drop(runtime);
    ferrolog_raft_store::runtime::seed_thread_rng(None);
    result
}

/// One seed run twice gives the same run: the same boot ids, dials and
/// disk work, ending at the same simulated instant; another seed draws
/// other boot ids (the seed reaches the brokers). Ground for a seeded
/// simulation of whole brokers (issue 15: a failing seed must replay).
/// Without `--cfg tokio_unstable` (`.cargo/config.toml` sets it) tokio's
/// own random numbers are not seeded, and only the boot ids are compared.
#[test]
fn one_seed_run_twice_runs_the_same() -> anyhow::Result<()> {
    let first = simulate(7)?;
    assert!(first.connections > 20 && first.disks.iter().all(|d| d.file_syncs > 0), "{first:?}");
    assert_eq!(first.boot_ids.len(), 4, "{first:?}");
    let again = simulate(7)?;
    #[cfg(tokio_unstable)]
    assert_eq!(first, again, "seed 7 ran differently the second time");
    assert_eq!(first.boot_ids, again.boot_ids, "seed 7 drew other boot ids the second time");
    let other = simulate(8)?;
    assert_ne!(other.boot_ids, first.boot_ids, "seed 8 drew seed 7's boot ids");
    Ok(())
}

/// A simulation run while another runs beside it in the process (on a
/// thread of its own) runs as it did alone: brokers of one simulation must
/// not hear another's. (A process-wide count of segment events made broker
/// 2's disk one file and one directory fsync apart.)
#[test]
fn a_simulation_beside_another_runs_as_it_does_alone() -> anyhow::Result<()> {
    let alone = simulate(9)?;
    let (beside, other) = std::thread::scope(|s| {
        let other = s.spawn(|| simulate(10));
        (simulate(9), other.join())
    });
    let other = other.map_err(|_| anyhow::anyhow!("the other simulation panicked"))??;
    assert!(other.connections > 20, "the other simulation did not run: {other:?}");
    #[cfg(tokio_unstable)]
    assert_eq!(alone, beside?, "seed 9 ran differently beside seed 10");
    #[cfg(not(tokio_unstable))]
    drop((alone, beside?));
    Ok(())
}

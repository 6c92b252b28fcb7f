//! Three brokers in one process (issue 15: the ground a simulation of whole
//! brokers stands on): they form a cluster on loopback listeners bound by
//! the caller, replicate a topic, and one is stopped and started again
//! inside the process on the same data directory and ports. Nothing they
//! keep per process may mix them up: the restarted broker gets a new boot
//! id (its peers tell a restart from a pause by it) and catches up, across
//! a log start that retention moved past everything it held meanwhile.
//! Every record retention kept reads back once, in order.

mod in_process;

use in_process::{Disks, Net, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_brokers_share_a_process_and_one_restarts_in_it_with_a_new_boot_id() -> anyhow::Result<()> {
    run(&Disks::Os(tempfile::tempdir()?), Net::Os).await.map(drop)
}

/// The same on in-memory disks, nothing of them on the OS's file system:
/// every file the brokers keep goes through the store's file-system seam
/// (`Broker::start_on`), and broker 2's disk loses power while it runs.
/// What it had acknowledged was fsynced, so it comes back and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_brokers_run_on_in_memory_disks_and_one_comes_back_from_a_power_cut() -> anyhow::Result<()> {
    run(&Disks::memory(), Net::Os).await.map(drop)
}

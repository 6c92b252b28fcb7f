//! Three brokers in one process on a simulation's disks and network (issue
//! 15: the ground a simulation of whole brokers stands on): disks that ask
//! for the brokers' background work to run as tasks of the runtime
//! (`Vfs::background_on_runtime`), an in-memory network
//! (`ferrolog_broker::network::memory`) for their peer connections and the
//! test's clients, and a runtime of one thread. No broker work may leave
//! that thread for another, where the order of events would be the
//! operating system's scheduler's, not a simulation's, and no connection
//! may go through the operating system's sockets. A test binary of its
//! own: the threads and sockets of the process are this test's.

mod in_process;

use ferrolog_broker::network::memory::MemoryNetwork;
use in_process::{Disks, Net, run};

/// The in-process scenario (`in_process::run`) on a simulation's disks:
/// no thread of tokio's blocking pool (named as tokio's workers) and none
/// of the brokers' own (the flusher's, the metadata writer's, the log
/// cleaner's and the scrub's) may be alive while replicas are opened, read,
/// snapshotted, trimmed by retention, scrubbed, stopped and opened again.
/// With `--cfg tokio_unstable` (`.cargo/config.toml` sets it) tokio's own
/// count of blocking threads must also be 0 at the end. The process holds
/// no socket meanwhile, and every connection went through the in-memory
/// network.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn on_a_simulations_disks_and_network_three_brokers_keep_every_task_on_the_runtimes_thread()
-> anyhow::Result<()> {
    let network = MemoryNetwork::new();
    let metrics = tokio::runtime::Handle::current().metrics();
    assert!(!threads().is_empty(), "no thread of this process could be listed");
    // Threads end with the brokers that started them: they are looked for
    // every 20 ms while the scenario runs (on the runtime's one thread, so
    // between the brokers' steps).
    let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
    // Sockets the process inherited (from whatever started it) are left
    // out: none may be added.
    let inherited = sockets().expect("this process's open files cannot be listed");
    let (looks, watcher) = {
        let seen = seen.clone();
        let looks = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = looks.clone();
        let watcher = tokio::spawn(async move {
            loop {
                let mut found: Vec<String> = threads()
                    .into_iter()
                    .filter(|t| THREADS_OF_A_BROKER.iter().any(|p| t.starts_with(p)))
                    .collect();
                match sockets() {
                    Some(n) if n <= inherited => {}
                    n => found.push(format!("{n:?} sockets ({inherited} inherited)")),
                }
                seen.lock().expect("lock").extend(found);
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        });
        (looks, watcher)
    };
    run(&Disks::simulated(), Net::Memory(network.clone())).await?;
    watcher.abort();
    let looks = looks.load(std::sync::atomic::Ordering::Relaxed);
    assert!(looks >= 10, "the threads were looked at only {looks} times");
    let seen = seen.lock().expect("lock").clone();
    assert!(seen.is_empty(), "threads beside the runtime's, or sockets, while the brokers ran: {seen:?}");
    // Three brokers' peer connections (to two peers each, again after the
    // restart) and the test's clients (one per call).
    assert!(network.connections() > 20, "only {} connections on the network", network.connections());
    #[cfg(tokio_unstable)]
    {
        assert_eq!(metrics.num_blocking_threads(), 0, "broker work went to tokio's blocking pool");
        assert!(metrics.spawned_tasks_count() > 100, "the brokers ran on another runtime");
    }
    Ok(())
}

/// How the threads a broker or tokio could start are named (a thread's name
/// as the kernel keeps it, cut to 15 bytes).
const THREADS_OF_A_BROKER: [&str; 5] =
    ["tokio-runtime", "flusher", "replica-meta", "ferrolog-clean", "ferrolog-scrub"];

/// The names of this process's threads (Linux: `/proc/self/task/*/comm`).
fn threads() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return Vec::new() };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim_end().to_owned())
        .collect()
}

/// Sockets this process holds open (Linux: `/proc/self/fd` links to
/// `socket:[...]`); `None` where that cannot be read.
fn sockets() -> Option<usize> {
    let fds = std::fs::read_dir("/proc/self/fd").ok()?;
    Some(
        fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
            .filter(|target| target.to_string_lossy().starts_with("socket:"))
            .count(),
    )
}

//! Ferrolog's Jepsen-style harness: real broker processes under faults, a
//! recorded history of client operations, and a checker for it.
//!
//! ```text
//!  network = net (namespaces, blackhole routes) | proxy (TCP proxy per link)
//!        ▲          └──> cluster (broker processes, dump-log)
//!        │                                              ▲
//!        └──────────── nemesis (kill, power, pause, partition, netem on a seeded schedule)
//!  workload (producers, consumers, final read) ──ferrolog-client──> brokers
//!        └──> history (ops with invoke/complete times, JSON lines)
//!                 └──> checker (anomaly classes) ──> results.json; plot (SVG)
//!  run: setup → faults → heal → wait → final read → per-broker copies → check
//! ```
//!
//! Modules, one responsibility each:
//! - [`history`]: operations and their JSON-lines form.
//! - [`checker`]: the anomaly classes (lost writes, duplicates, inconsistent
//!   offsets, ordering, skips, aborted reads, replica divergence), and the
//!   rules against vacuous runs ([`checker::vacuity`]).
//! - [`workload`]: producer and consumer processes, and the final read.
//! - [`network`]: the network between brokers, namespaces or proxy, as the
//!   nemesis sees it (cut a direction, heal, slow down).
//! - [`net`]: network namespaces, veth pairs and blackhole routes.
//! - [`proxy`]: the fault-injecting TCP proxy on every directed broker link,
//!   where namespaces cannot be made.
//! - [`cluster`]: the broker processes.
//! - [`disk`]: the in-memory disk over FUSE that keeps only what fsync
//!   covered, for the `power` fault (and the power-loss tests of `tests/`).
//! - [`nemesis`]: the fault schedule.
//! - [`rejoin`]: the `membership` fault's decommission and re-add of a broker.
//! - [`run`]: the phases of one run and its output directory.
//! - [`matrix`]: the `matrix` command's verdict over its runs.
//! - [`plot`]: latency and throughput over time with faults shaded.

pub mod checker;
pub mod cluster;
pub mod disk;
pub mod history;
pub mod matrix;
pub mod nemesis;
pub mod net;
pub mod network;
pub mod plot;
pub mod proxy;
pub mod rejoin;
pub mod run;
pub mod workload;

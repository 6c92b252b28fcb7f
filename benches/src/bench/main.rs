//! `ferrolog-bench`: end-to-end benchmarks against a local 3-broker cluster (4 for `reassign`)
//! of real broker processes (this executable, run as `ferrolog-bench broker`).
//!
//! - `produce`: records/s, MB/s and ack latency percentiles of the client
//!   library's producer (pipelined, or one batch in flight);
//! - `consume`: how fast a consumer reads the topic back from the start;
//! - `e2e`: both for 100 B and 1 KiB records, printing a table;
//! - `idle`: CPU used by a cluster hosting many idle partitions;
//! - `churn`: brokers' resident memory across create/delete loops of a topic;
//! - `restart`: leaders, elections, CPU and logs when one broker of a cluster
//!   with many partitions is SIGKILLed and restarted;
//! - `contention`: appends' p99 alone and beside a 16 MiB fetch loop;
//! - `failover`: the write pause a producer sees when its partition's
//!   leader gets SIGKILL or SIGTERM;
//! - `reassign`: moving a filled partition to a new broker (4 brokers):
//!   its duration and MB/s, and another partition's produce latency
//!   before and during it;
//! - `retention`: disk use and throughput of a topic with `retention.bytes`
//!   beside one without, under pipelined produce;
//! - `compaction`: each replica's compaction pass (MB/s on one core) and
//!   another topic's one-in-flight produce latency before and during it;
//! - `group`: a consumer group's rebalance after a member's death, and a
//!   group of three reading a topic beside one consumer;
//! - `kafka`: produce and consume through the Kafka listener (kcat,
//!   librdkafka) beside the native gRPC client, 100 B and 1 KiB records.
//!
//! Every figure printed is measured in that run; nothing is extrapolated.

mod churn;
mod cluster;
mod compaction;
mod contention;
mod failover;
mod group;
mod idle;
mod kafka;
#[cfg(feature = "rdkafka")]
mod kafka_rdkafka;
mod load;
mod reassign;
mod restart;
mod retention;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "ferrolog-bench", about = "Ferrolog end-to-end benchmarks on a local 3-broker cluster")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a broker (used by the benchmark's own cluster).
    #[command(hide = true)]
    Broker(ferrolog_broker::cli::BrokerArgs),
    /// Produce for a while and report throughput and ack latency.
    Produce(load::ProduceArgs),
    /// Produce, then consume from the start and report read throughput.
    Consume(load::ProduceArgs),
    /// Produce and consume 100 B and 1 KiB records; print a table.
    E2e(load::E2eArgs),
    /// CPU of a cluster hosting idle partitions.
    Idle(idle::IdleArgs),
    /// Resident memory of the brokers across topic create/delete loops.
    Churn(churn::ChurnArgs),
    /// Time until every partition has a leader after one broker's restart.
    Restart(restart::RestartArgs),
    /// p99 of one-in-flight appends alone and beside a 16 MiB fetch loop.
    Contention(contention::ContentionArgs),
    /// The write pause at the client when the leader gets SIGKILL or SIGTERM.
    Failover(failover::FailoverArgs),
    /// Move a filled partition to a new broker under load (4 brokers).
    Reassign(reassign::ReassignArgs),
    /// Disk use and throughput of a topic with retention.bytes under load.
    Retention(retention::RetentionArgs),
    /// Compaction passes and produce latency beside them.
    Compaction(compaction::CompactionArgs),
    /// A consumer group's rebalance after a member dies; group read throughput.
    Group(group::GroupArgs),
    /// Produce and consume through the Kafka listener (kcat) beside gRPC.
    Kafka(kafka::KafkaArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Broker(args) => {
            ferrolog_broker::cli::init_tracing();
            ferrolog_broker::cli::run(args).await
        }
        Cmd::Produce(a) => load::produce_only(a).await,
        Cmd::Consume(a) => load::produce_and_consume(a).await,
        Cmd::E2e(a) => load::e2e(a).await,
        Cmd::Idle(a) => idle::run(a).await,
        Cmd::Churn(a) => churn::run(a).await,
        Cmd::Restart(a) => restart::run(a).await,
        Cmd::Contention(a) => contention::run(a).await,
        Cmd::Failover(a) => failover::run(a).await,
        Cmd::Reassign(a) => reassign::run(a).await,
        Cmd::Retention(a) => retention::run(a).await,
        Cmd::Compaction(a) => compaction::run(a).await,
        Cmd::Group(a) => group::run(a).await,
        Cmd::Kafka(a) => kafka::kafka(a).await,
    }
}

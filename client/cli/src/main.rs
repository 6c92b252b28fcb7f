//! `ferrolog`: the command line for Ferrolog.
//!
//! A thin layer over `ferrolog-client`; each subcommand has its own module:
//! - [`dev`]: `ferrolog dev`, a local 3-broker cluster as child processes, with a demo.
//! - [`admin`]: `ferrolog topic ...` and `ferrolog cluster status`.
//! - [`produce`]: `ferrolog produce`, records from lines or CSV (plain or zipped), read by [`input`].
//! - [`consume`]: `ferrolog consume`, records as values or JSON lines ([`output`]);
//!   with `--group`, as a member of a consumer group ([`consume_group`]).
//! - [`timefmt`]: timestamps as RFC 3339, `YYYY-MM-DD HH:MM:SS` (UTC) or integer ms.
//! - [`reassign`]: `ferrolog partition reassign` and `partition describe`.
//! - [`brokers`]: `ferrolog broker list|decommission` and `ferrolog cluster rebalance`.
//! - [`controller`]: `ferrolog controller add|remove` (the controller quorum).
//! - [`group`]: `ferrolog group list|describe|reset-offsets|delete` (consumer groups' offsets).
//! - `ferrolog broker run`: runs a broker in this process (what `ferrolog dev` starts).

mod admin;
mod brokers;
mod consume;
mod consume_group;
mod controller;
mod dev;
mod group;
mod input;
mod output;
mod produce;
mod reassign;
mod table;
mod timefmt;

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use ferrolog_client::{ClientConfig, MetadataCache};

/// The `ferrolog dev` cluster's client addresses.
pub const DEFAULT_BOOTSTRAP: &str = "127.0.0.1:9401,127.0.0.1:9402,127.0.0.1:9403";

#[derive(Parser, Debug)]
#[command(name = "ferrolog", version, about = "Ferrolog: a distributed commit log", propagate_version = true)]
struct Cli {
    /// Brokers to contact first, host:port[,host:port...]; any one is enough.
    #[arg(long, global = true, env = "FERROLOG_BOOTSTRAP", default_value = DEFAULT_BOOTSTRAP)]
    bootstrap: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start a local 3-broker cluster (and a demo producer and consumer).
    Dev(dev::DevArgs),
    /// Create, list, describe and delete topics.
    #[command(subcommand)]
    Topic(admin::TopicCommand),
    /// Partition operations: describe, leadership transfer, reassignment.
    #[command(subcommand)]
    Partition(admin::PartitionCommand),
    /// Cluster status: brokers, controller, each partition's Raft state.
    #[command(subcommand)]
    Cluster(admin::ClusterCommand),
    /// Send records: one per line, or one per CSV row.
    ///
    /// Lines: a line ends at `\n`; the value is the line without it and
    /// without one `\r` before it (`\r\n`). An empty line is a record with an
    /// empty value; a last line without `\n` is a record too; any other `\r`
    /// is part of the value.
    ///
    /// CSV (RFC 4180): the first row is the header; `\n`, `\r\n` and `\r` end
    /// rows, quoted fields may span lines, blank lines are skipped; a
    /// record's value is the row's text without its line ending. A row whose
    /// field count differs from the header's, a quote never closed, or a bad
    /// --timestamp-field stops the command at that line with an error
    /// (records before it were sent), unless --skip-bad-input.
    ///
    /// Prints how many records were read, stored, refused and of unknown
    /// outcome; exits non-zero unless all were stored.
    Produce(produce::ProduceArgs),
    /// Read records and print them.
    Consume(consume::ConsumeArgs),
    /// Brokers: list them with their state, decommission one (and run one
    /// in this process: `broker run`, what `ferrolog dev` starts).
    #[command(subcommand)]
    Broker(BrokerGroup),
    /// The controller quorum: add or remove a voter.
    #[command(subcommand)]
    Controller(controller::ControllerCommand),
    /// Consumer groups: list, describe (committed offsets and lag), reset
    /// offsets, delete.
    #[command(subcommand)]
    Group(group::GroupCommand),
}

/// `ferrolog broker ...`.
#[derive(Subcommand, Debug)]
enum BrokerGroup {
    /// Run a broker in this process (as the `ferrolog-broker` binary does;
    /// what `ferrolog dev` starts).
    Run(Box<ferrolog_broker::cli::BrokerArgs>),
    #[command(flatten)]
    Admin(brokers::BrokerCommand),
}

/// How long `produce` and `consume` wait for a topic to appear in the
/// metadata (a topic just created reaches every broker within moments).
pub const TOPIC_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// A metadata cache for the `--bootstrap` brokers.
pub fn connect(bootstrap: &str) -> anyhow::Result<Arc<MetadataCache>> {
    Ok(MetadataCache::new(ClientConfig::from_list(bootstrap))?)
}

/// Client-side logs (retries, failovers) at `warn` unless `RUST_LOG` says
/// otherwise, on stderr.
fn init_client_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// Exit status of a command whose standard output was closed under it:
/// 128 + SIGPIPE, what a shell reports for a Unix tool that signal ended.
const CLOSED_STDOUT_EXIT: i32 = 128 + libc::SIGPIPE;

/// Makes a closed standard output (`ferrolog topic describe t | head -1`)
/// end the command quietly with [`CLOSED_STDOUT_EXIT`], as it ends other
/// Unix tools, rather than with a panic. Rust ignores SIGPIPE (a socket
/// closed under a write must be an error, not the end of the process), so
/// `println!` to a closed pipe panics instead; this catches exactly that
/// panic. Not for brokers, which print nothing to standard output.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let text = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if text.starts_with("failed printing to stdout") && text.contains("Broken pipe") {
            std::process::exit(CLOSED_STDOUT_EXIT);
        }
        default(info);
    }));
}

// `ferrolog dev` spawns its brokers from this thread (the main thread, which
// lives as long as the process) so that their parent-death signal fires only
// when this process exits; see `dev::spawn_broker`.
#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Broker(BrokerGroup::Run(_))) {
        quiet_on_closed_stdout();
    }
    let bootstrap = cli.bootstrap.as_str();
    let result = match cli.command {
        Command::Broker(BrokerGroup::Run(args)) => {
            ferrolog_broker::cli::init_tracing();
            ferrolog_broker::cli::run(*args).await
        }
        Command::Broker(BrokerGroup::Admin(c)) => {
            init_client_tracing();
            admin::broker(bootstrap, c).await
        }
        Command::Controller(c) => {
            init_client_tracing();
            admin::controller(bootstrap, c).await
        }
        Command::Dev(args) => {
            init_client_tracing();
            dev::run(args).await
        }
        Command::Topic(c) => {
            init_client_tracing();
            admin::topic(bootstrap, c).await
        }
        Command::Partition(c) => {
            init_client_tracing();
            admin::partition(bootstrap, c).await
        }
        Command::Cluster(c) => {
            init_client_tracing();
            admin::cluster(bootstrap, c).await
        }
        Command::Produce(args) => {
            init_client_tracing();
            produce::run(bootstrap, args).await
        }
        Command::Consume(args) => {
            init_client_tracing();
            consume::run(bootstrap, args).await
        }
        Command::Group(c) => {
            init_client_tracing();
            group::run(bootstrap, c).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            let unreachable = e.chain().any(|c| {
                matches!(
                    c.downcast_ref::<ferrolog_client::Error>(),
                    Some(ferrolog_client::Error::NoBrokerReachable { .. })
                ) || matches!(
                    c.downcast_ref::<ferrolog_client::Error>(),
                    Some(ferrolog_client::Error::Deadline { last: Some(l), .. })
                        if matches!(**l, ferrolog_client::Error::NoBrokerReachable { .. })
                )
            });
            if unreachable {
                eprintln!(
                    "hint: no broker answered at {bootstrap}; is the cluster running? \
                     (`ferrolog dev` starts one; --bootstrap or FERROLOG_BOOTSTRAP picks others)"
                );
            }
            ExitCode::FAILURE
        }
    }
}

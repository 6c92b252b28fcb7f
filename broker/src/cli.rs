//! The `ferrolog-broker` command line, shared by the `ferrolog-broker`
//! binary and `ferrolog dev` (which starts brokers as child processes of
//! its own executable).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::config::{self, BrokerConfig, BrokerId};

/// Flags and environment variables that override the config file.
#[derive(Args, Debug, Clone, Default)]
pub struct BrokerArgs {
    /// TOML config file (template: deploy/broker.toml).
    #[arg(long, env = "FERROLOG_CONFIG")]
    pub config: Option<PathBuf>,
    /// This broker's id (≥ 1). With --join it may be left out: the cluster
    /// assigns the next free one (kept in the data directory).
    #[arg(long, env = "FERROLOG_NODE_ID")]
    pub node_id: Option<BrokerId>,
    /// Client API listen address, host:port.
    #[arg(long, env = "FERROLOG_CLIENT_ADDR")]
    pub client_addr: Option<SocketAddr>,
    /// Kafka listener address, host:port (the address Kafka clients are
    /// told to connect to).
    #[arg(long, env = "FERROLOG_KAFKA_ADDR")]
    pub kafka_addr: Option<SocketAddr>,
    /// Broker-to-broker listen address, host:port.
    #[arg(long, env = "FERROLOG_PEER_ADDR")]
    pub peer_addr: Option<SocketAddr>,
    /// Data directory.
    #[arg(long, env = "FERROLOG_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Founding controller members: `1=host:port,2=host:port,3=host:port`
    /// (peer addresses). Used only when the data directory is new.
    #[arg(long, env = "FERROLOG_INITIAL_CLUSTER")]
    pub initial_cluster: Option<String>,
    /// Join a running cluster instead of founding one: peer addresses
    /// (host:port,...) of any of its brokers. Used only when the data
    /// directory is new. Excludes --initial-cluster.
    #[arg(long, env = "FERROLOG_JOIN", conflicts_with = "initial_cluster")]
    pub join: Option<String>,
    /// Dial peers through other addresses: `peer=via,...`, both host:port
    /// (e.g. through a proxy). Replaces `peer_routes` of the config file.
    #[arg(long, env = "FERROLOG_PEER_ROUTES")]
    pub peer_routes: Option<String>,
}

impl BrokerArgs {
    /// The config file (or defaults) with the flags and environment applied,
    /// validated.
    ///
    /// # Errors
    /// An unreadable or malformed file, a bad flag, or a config that fails
    /// [`BrokerConfig::validate`].
    pub fn resolve(&self) -> anyhow::Result<BrokerConfig> {
        let mut c = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading config file {}", path.display()))?;
                BrokerConfig::from_toml(&text).with_context(|| format!("in {}", path.display()))?
            }
            None => BrokerConfig::default(),
        };
        if let Some(v) = self.node_id {
            c.node_id = v;
        }
        if let Some(v) = self.client_addr {
            c.client_addr = v;
        }
        if let Some(v) = self.peer_addr {
            c.peer_addr = v;
        }
        if let Some(v) = self.kafka_addr {
            c.kafka_addr = v;
        }
        if let Some(v) = &self.data_dir {
            c.data_dir = v.clone();
        }
        if let Some(v) = &self.initial_cluster {
            c.initial_cluster = config::parse_initial_cluster(v)?;
        }
        if let Some(v) = &self.join {
            c.join = config::parse_join(v)?;
            // A joining broker does not also found: the file's founders are
            // for the founders (`deploy/broker.toml` lists them); and
            // without --node-id it is given an id, whatever the file says
            // (a shared file's `node_id` is some founder's).
            c.initial_cluster.clear();
            if self.node_id.is_none() {
                c.node_id = 0;
            }
        }
        if let Some(v) = &self.peer_routes {
            c.peer_routes = config::parse_peer_routes(v)?;
        }
        c.validate()?;
        Ok(c)
    }
}

/// `ferrolog-broker`'s command line.
#[derive(Parser, Debug)]
#[command(name = "ferrolog-broker", version, about = "A Ferrolog broker")]
pub struct Cli {
    /// What to do; the default is to run the broker.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Broker settings.
    #[command(flatten)]
    pub broker: BrokerArgs,
}

/// Subcommands besides running the broker.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Print the effective configuration as TOML and exit.
    PrintConfig,
    /// Print every record of a stopped broker's partition replicas as JSON lines.
    DumpLog {
        /// The stopped broker's data directory.
        #[arg(long)]
        data_dir: PathBuf,
    },
}

/// Runs a broker until SIGINT or SIGTERM, then hands its leaderships over
/// (a second signal cuts that short; see `crate::control::handover`),
/// stops it and ends the
/// process (exit status 0) without waiting for the runtime to drop what is
/// left: with thousands of replicas that teardown alone took seconds, and
/// everything durable is already on disk.
///
/// # Errors
/// A bad configuration, a port already in use, an unreadable data directory.
pub async fn run(args: BrokerArgs) -> anyhow::Result<()> {
    let config = args.resolve()?;
    let listeners = crate::server::Listeners::bind(&config).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    // How many stop signals came: the first starts a controlled shutdown,
    // the second cuts its hand-overs short.
    let (signalled, signal) = tokio::sync::watch::channel(0u32);
    tokio::spawn(async move {
        loop {
            let got = tokio::select! {
                s = int.recv() => s,
                s = term.recv() => s,
            };
            if got.is_none() {
                break;
            }
            signalled.send_modify(|n| *n += 1);
        }
    });
    let mut stop = signal.clone();
    let shutdown = async move {
        let _ = stop.wait_for(|n| *n >= 1).await;
    };
    let mut again = signal.clone();
    let hurry = async move {
        let _ = again.wait_for(|n| *n >= 2).await;
    };
    // A broker still deciding how to enter (founding members unreachable)
    // stops on the signal too.
    let mut early = signal;
    let broker = tokio::select! {
        b = crate::server::Broker::start(config, listeners, shutdown) => b?,
        _ = early.wait_for(|n| *n >= 1) => {
            tracing::info!("stopped while starting");
            std::process::exit(0)
        }
    };
    broker.with_hurry(hurry).serve().await;
    std::process::exit(0)
}

/// Installs the tracing subscriber used by broker processes (see
/// [`crate::logging::init`]): `RUST_LOG` filters, default `info` with the
/// Raft library at `warn`; repeated warnings are rate-limited; colours only
/// when stderr is a terminal.
pub fn init_tracing() {
    crate::logging::init();
}

/// The whole `ferrolog-broker` program: parses the command line, then runs
/// the broker (or prints its configuration).
///
/// # Errors
/// As [`run`] and [`BrokerArgs::resolve`].
pub async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::PrintConfig) => {
            print!("{}", cli.broker.resolve()?.to_toml()?);
            Ok(())
        }
        Some(Command::DumpLog { data_dir }) => crate::dump::run(&data_dir),
        None => {
            init_tracing();
            run(cli.broker).await
        }
    }
}

//! `ferrolog-broker`: runs one Ferrolog broker.

use clap::Parser;
use ferrolog_broker::cli::{Cli, Command, init_tracing, run};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::PrintConfig) => {
            print!("{}", cli.broker.resolve()?.to_toml()?);
            Ok(())
        }
        None => {
            init_tracing();
            run(cli.broker).await
        }
    }
}

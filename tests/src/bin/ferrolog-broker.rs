//! The real broker program, built inside this package so that its tests can
//! start it as a child process (`CARGO_BIN_EXE_ferrolog-broker`).

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    ferrolog_broker::cli::main().await
}

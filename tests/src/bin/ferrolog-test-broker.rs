//! The real broker program (`ferrolog_broker::cli::main`, exactly what the
//! `ferrolog-broker` binary runs), built inside this package under its own
//! name so that the tests can start it as a child process
//! (`CARGO_BIN_EXE_ferrolog-test-broker`).

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    ferrolog_broker::cli::main().await
}

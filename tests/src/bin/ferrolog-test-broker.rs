//! The real broker program (`ferrolog_broker::cli::main`, exactly what the
//! `ferrolog-broker` binary runs), built inside this package under its own
//! name so that the tests can start it as a child process
//! (`CARGO_BIN_EXE_ferrolog-test-broker`).
//!
//! One test hook: `FERROLOG_TEST_PEER_PROTOCOL=MAJOR.MINOR` makes it
//! announce that peer protocol version, for tests of mixed-version clusters
//! (`t15_peer_protocol`). The `ferrolog-broker` binary has no such hook.

use ferrolog_broker::network::protocol;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if let Ok(v) = std::env::var("FERROLOG_TEST_PEER_PROTOCOL") {
        let v = protocol::Version::parse(&v)
            .ok_or_else(|| anyhow::anyhow!("FERROLOG_TEST_PEER_PROTOCOL={v:?} is not MAJOR.MINOR"))?;
        protocol::announce_for_tests(v);
    }
    ferrolog_broker::cli::main().await
}

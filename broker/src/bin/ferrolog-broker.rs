//! `ferrolog-broker`: runs one Ferrolog broker.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    ferrolog_broker::cli::main().await
}

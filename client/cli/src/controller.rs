//! `ferrolog controller add|remove`: changing the controller quorum (the
//! metadata group's voters) one broker at a time, as Kafka's
//! `kafka-metadata-quorum add-controller|remove-controller` (KIP-853). The
//! controller commits the wanted quorum; its leader then changes the
//! group's voters by joint consensus once the added broker caught up.

use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use ferrolog_client::Admin;

/// Controller quorum commands.
#[derive(Subcommand, Debug)]
pub enum ControllerCommand {
    /// Make a broker a controller voter, and wait until it votes.
    Add {
        /// The broker (registered, alive, not decommissioned).
        id: u32,
        /// Longest wait for the change, seconds.
        #[arg(long, default_value_t = 60, value_name = "SECONDS")]
        wait: u64,
    },
    /// Take a broker out of the controller voters (it stays a broker), and
    /// wait until it no longer votes. Refused if a majority of the current
    /// or of the new voters does not answer.
    Remove {
        /// The broker.
        id: u32,
        /// Longest wait for the change, seconds.
        #[arg(long, default_value_t = 60, value_name = "SECONDS")]
        wait: u64,
    },
}

/// Runs a controller command.
pub async fn run(admin: &Admin, command: ControllerCommand) -> anyhow::Result<()> {
    let (id, add, secs) = match command {
        ControllerCommand::Add { id, wait } => (id, true, wait),
        ControllerCommand::Remove { id, wait } => (id, false, wait),
    };
    if add {
        admin
            .add_raft_voter(id)
            .await
            .with_context(|| format!("adding broker {id} to the controller quorum"))?;
    } else {
        admin
            .remove_raft_voter(id)
            .await
            .with_context(|| format!("removing broker {id} from the controller quorum"))?;
    }
    // The voters change once the leader has carried the change out (and
    // the answering broker learnt it): poll the metadata.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let cluster = admin.fresh_metadata().await.context("reading metadata")?;
        let voters = &cluster.controller_voters;
        if !voters.is_empty() && voters.contains(&id) == add {
            let list = voters.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
            println!("controller voters: {list}");
            if voters.len() % 2 == 0 {
                let n = voters.len();
                let tolerated = (n - 1) / 2;
                eprintln!(
                    "note: {n} voters tolerate {tolerated} failure{}, as {} do; an odd count is the usual choice",
                    if tolerated == 1 { "" } else { "s" },
                    n - 1
                );
            }
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the controller accepted the change, but the voters are still {voters:?} after {secs} s; check `ferrolog \
             cluster status` (an added broker must catch up with the metadata first)"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

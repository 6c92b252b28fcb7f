//! Pre-votes against a quiet, healthy leader (Raft thesis §4.2.3, §9.6;
//! `crate::network::server` of the broker): once a partition's leader has
//! parked its heartbeats, the leases that make Raft nodes refuse pre-votes
//! have lapsed, and openraft alone grants the pre-vote of any candidate (a
//! follower whose pings had not caught up could then depose the leader).
//! The leader refuses once a quorum acknowledges it, and a follower refuses
//! while it presumes a live leader other than the candidate. A pre-vote
//! naming the leader itself as candidate is granted (the control: the
//! request is well formed and the rule is what refuses).
//!
//! The pre-votes are sent as a broker would, over the peer protocol, from a
//! candidate that does not exist; they change nothing, so every term stays
//! the same.

use std::time::Duration;

use ferrolog_proto::client::{MetadataRequest, PartitionStatusRequest};
use ferrolog_tests::{Cluster, connect, raw};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_healthy_leader_and_its_followers_refuse_pre_votes() -> anyhow::Result<()> {
    let c = Cluster::start("prevote", BIN, 3, &[]).await?;
    raw::create_topic(&c, "t", 1, 3).await?;
    let leader = raw::leader(&c, "t", 0, Duration::from_secs(30)).await?;
    raw::produce(&c, raw::batch("t", -1, 0, "one"), Duration::from_secs(30)).await?;

    let meta = connect(c.broker(leader).client_addr)
        .await?
        .metadata(MetadataRequest { topics: vec!["t".into()] })
        .await?;
    let group = meta.into_inner().topics[0].partitions[0].group_id;
    let c = &c;
    let status = |id: u32| async move {
        anyhow::Ok(
            connect(c.broker(id).client_addr)
                .await?
                .partition_status(PartitionStatusRequest { topic: "t".into(), partition: 0 })
                .await?
                .into_inner(),
        )
    };
    let led = status(leader).await?;
    anyhow::ensure!(led.followers.len() == 2, "the leader reports {} followers", led.followers.len());
    let (f1, f2) = (&led.followers[0], &led.followers[1]);
    // The leader's node id: the one replica node that is not a follower's.
    let leader_node = raw::node_on(c, leader, group).await?;

    // Parked: 2 s after the write (ACTIVE_AFTER_WRITE), and the followers'
    // leases (one maximum election timeout, 1 s) have lapsed since.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let term = led.term;

    // The control first: the leader's answer below renews the followers'
    // leases (its heartbeat round), after which they refuse on their own.
    let control = raw::pre_vote(c, f2.broker_id, group, f2.node_id, leader_node, term + 1).await?;
    assert!(
        control.vote_granted,
        "the leader's own pre-vote was refused: the refusals below may be for another reason"
    );
    let to_follower = raw::pre_vote(c, f2.broker_id, group, f2.node_id, f1.node_id, term + 1).await?;
    assert!(!to_follower.vote_granted, "a follower of a live leader granted another candidate's pre-vote");
    let to_leader = raw::pre_vote(c, leader, group, leader_node, f1.node_id, term + 1).await?;
    assert!(!to_leader.vote_granted, "a healthy leader granted a pre-vote");

    for id in 1..=3 {
        let s = status(id).await?;
        assert_eq!(s.term, term, "broker {id}: a pre-vote changed the term");
    }
    assert_eq!(raw::leader(c, "t", 0, Duration::from_secs(5)).await?, leader, "the leader changed");
    Ok(())
}

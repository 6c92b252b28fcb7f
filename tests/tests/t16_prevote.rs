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
use ferrolog_proto::raft::{LogId, Vote, VoteRequest, VoteResponse};
use ferrolog_tests::{Cluster, connect, raw};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");

/// A pre-vote for `group` to node `target` on broker `to`, from candidate
/// node `candidate` in `term`, with a log longer than any voter's.
async fn pre_vote(
    c: &Cluster,
    to: u32,
    group: u64,
    target: u64,
    candidate: u64,
    term: u64,
) -> anyhow::Result<VoteResponse> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", c.broker(to).peer_addr))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await?;
    let req = VoteRequest {
        group_id: group,
        target_node: target,
        vote: Some(Vote { term, node: candidate, committed: false }),
        last_log_id: Some(LogId { term, leader_node: candidate, index: 1 << 40 }),
        leadership_transfer: false,
    };
    let answer = ferrolog_broker::network::peer_client(channel).pre_vote(req).await?.into_inner();
    anyhow::ensure!(answer.error.is_none(), "broker {to} refused the request itself: {:?}", answer.error);
    Ok(answer)
}

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
    // Asking its broker for a wrong node is refused with the right one.
    let leader_node = {
        let channel =
            tonic::transport::Endpoint::from_shared(format!("http://{}", c.broker(leader).peer_addr))?
                .connect()
                .await?;
        let probe = VoteRequest { group_id: group, target_node: 0, ..VoteRequest::default() };
        let answer = ferrolog_broker::network::peer_client(channel).pre_vote(probe).await?.into_inner();
        let message = answer.error.map(|e| e.message).unwrap_or_default();
        message
            .split("hosted here as node ")
            .nth(1)
            .and_then(|s| s.split(',').next())
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| anyhow::anyhow!("no node id in {message:?}"))?
    };

    // Parked: 2 s after the write (ACTIVE_AFTER_WRITE), and the followers'
    // leases (one maximum election timeout, 1 s) have lapsed since.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let term = led.term;

    // The control first: the leader's answer below renews the followers'
    // leases (its heartbeat round), after which they refuse on their own.
    let control = pre_vote(c, f2.broker_id, group, f2.node_id, leader_node, term + 1).await?;
    assert!(
        control.vote_granted,
        "the leader's own pre-vote was refused: the refusals below may be for another reason"
    );
    let to_follower = pre_vote(c, f2.broker_id, group, f2.node_id, f1.node_id, term + 1).await?;
    assert!(!to_follower.vote_granted, "a follower of a live leader granted another candidate's pre-vote");
    let to_leader = pre_vote(c, leader, group, leader_node, f1.node_id, term + 1).await?;
    assert!(!to_leader.vote_granted, "a healthy leader granted a pre-vote");

    for id in 1..=3 {
        let s = status(id).await?;
        assert_eq!(s.term, term, "broker {id}: a pre-vote changed the term");
    }
    assert_eq!(raw::leader(c, "t", 0, Duration::from_secs(5)).await?, leader, "the leader changed");
    Ok(())
}

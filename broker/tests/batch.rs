//! Heartbeats and commit notices of many groups travel together (`Batch`,
//! peer protocol 1.2), and so do votes and pre-votes (1.3, in batches of
//! their own), over the real gRPC transport on loopback: every call gets
//! its own answer, refusals included, and concurrent calls share batches;
//! AppendEntries with entries stay single RPCs.

use std::time::Duration;

use ferrolog_broker::groups::GroupRegistry;
use ferrolog_broker::network::batch::Lane;
use ferrolog_broker::network::{PeerAddresses, RaftPeerServer};
use ferrolog_proto::raft as pb;
use ferrolog_replica::PeerTransport;
use futures::future::join_all;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_share_batches_and_each_gets_its_answer() {
    // A broker hosting no group: every call is answered with UNKNOWN_GROUP,
    // naming the group it asked for.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let server = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(RaftPeerServer::new(9, GroupRegistry::default()).into_service())
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
            .expect("serve");
    });
    let peers = PeerAddresses::new([], Duration::from_secs(5));
    // More than one batch holds (`BATCH_CALLS_MAX`).
    const EACH: u64 = 2_100;
    let send = |group: u64, entries: &'static [u8]| {
        let (peers, addr) = (peers.clone(), addr.clone());
        async move {
            let req = pb::AppendEntriesRequest {
                group_id: group,
                target_node: 1,
                entries: entries.into(),
                ..Default::default()
            };
            (group, peers.append_entries(1, &addr, req, Duration::from_secs(5)).await.map(|r| r.error))
        }
    };
    let heartbeats = join_all((0..EACH).map(|g| send(g, b"")));
    // Not batched: AppendEntries with entries (these do not even decode).
    let with_entries = join_all((EACH..EACH + 10).map(|g| send(g, b"not frames")));
    // Batched, in batches of their own: votes and pre-votes.
    const VOTES: u64 = 300;
    let votes = join_all((0..VOTES).map(|g| {
        let (peers, addr) = (peers.clone(), addr.clone());
        async move {
            let req = pb::VoteRequest { group_id: g, target_node: 1, ..pb::VoteRequest::default() };
            (g, peers.vote(1, &addr, req, g % 2 == 0, Duration::from_secs(5)).await)
        }
    }));
    let (heartbeats, with_entries, votes) = tokio::join!(heartbeats, with_entries, votes);
    assert_eq!(heartbeats.len() as u64 + with_entries.len() as u64, EACH + 10);
    for (group, answer) in heartbeats.into_iter().chain(with_entries) {
        let error = answer.unwrap_or_else(|e| panic!("group {group}: {e}")).expect("refused");
        assert_eq!(error.code(), pb::PeerErrorCode::UnknownGroup, "group {group}");
        assert!(error.message.contains(&format!("group {group} ")), "group {group}: {}", error.message);
    }
    assert_eq!(votes.len() as u64, VOTES);
    for (group, vote) in votes {
        let error = vote.unwrap_or_else(|e| panic!("group {group}: {e}")).error.expect("refused");
        assert_eq!(error.code(), pb::PeerErrorCode::UnknownGroup, "group {group}");
        assert!(error.message.contains(&format!("group {group} ")), "group {group}: {}", error.message);
    }
    let (batches, calls) = peers.batch_stats(Lane::Small);
    assert_eq!(calls, EACH, "every heartbeat, and nothing else, went in a batch");
    assert!(batches >= 2 && batches * 4 <= calls, "{calls} calls took {batches} batches");
    let (batches, calls) = peers.batch_stats(Lane::Votes);
    assert_eq!(calls, VOTES, "every vote went in a batch of votes");
    assert!(batches >= 1 && batches * 4 <= calls, "{calls} votes took {batches} batches");
    server.abort();
}

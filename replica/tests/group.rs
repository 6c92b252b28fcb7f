//! A Raft group of real replicas (real segment files, real fsyncs) driven
//! only through Ferrolog's interface: proposals get their offsets once
//! committed, a stale term or a follower is refused, leadership is handed
//! over on request, and a learner joins and replaces a voter by joint
//! consensus with every record intact.
//!
//! The transport delivers peer messages in-process by calling the target
//! node's handlers (the same ones the broker's gRPC service calls), with
//! the messages in their protobuf form and snapshots through the real
//! chunk streaming and staging.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use ferrolog_proto::raft as pb;
use ferrolog_raft_store::{FOUNDING_TERM, Flusher, Founding, RecordBatch, Replica, StoreConfig};
use ferrolog_replica::{NodeId, ProposeError, RaftNode, Role, Settings, ValidSettings};
use futures::StreamExt;

mod common;

use common::Local;

const GROUP: u64 = 42;
const WAIT: Duration = Duration::from_secs(20);

fn settings() -> ValidSettings {
    Settings {
        heartbeat_interval_ms: 50,
        election_timeout_min_ms: 300,
        election_timeout_max_ms: 600,
        snapshot_after_entries: Some(20),
        max_payload_entries: 16,
    }
    .validate()
    .expect("settings")
}

struct Member {
    node: RaftNode,
    replica: Replica,
}

async fn start(id: NodeId, root: &Path, net: &Local, flusher: &Flusher) -> Member {
    start_founded(id, root, net, flusher, None).await
}

/// As [`start`]; with `voters`, founds the group in the replica's log first
/// (as a broker does for a new partition).
async fn start_founded(
    id: NodeId,
    root: &Path,
    net: &Local,
    flusher: &Flusher,
    voters: Option<&BTreeMap<NodeId, String>>,
) -> Member {
    let dir = root.join(format!("n{id}"));
    let staging = dir.join("staging");
    std::fs::create_dir_all(&staging).expect("staging dir");
    let replica =
        Replica::open(&dir.join("replica"), StoreConfig::default(), flusher.clone()).expect("replica");
    if let Some(voters) = voters {
        let founded = replica.found(voters.clone(), None).await.expect("found");
        assert_eq!(founded, Founding::Founded { leader: None }, "an empty log is founded");
        let again = replica.found(voters.clone(), None).await.expect("found again");
        assert_eq!(again, Founding::Existing, "founded once");
    }
    let node = RaftNode::start(GROUP, id, &settings(), &replica, net.clone()).await.expect("start");
    net.nodes.lock().expect("nodes").insert(id, (node.clone(), staging));
    Member { node, replica }
}

fn batch(i: u32) -> RecordBatch {
    RecordBatch {
        record_count: 1 + i % 3,
        first_timestamp_ms: i64::from(i),
        max_timestamp_ms: i64::from(i),
        producer_id: -1,
        records: bytes::Bytes::from(format!("batch {i} ").repeat(1 + i as usize % 5)),
        ..RecordBatch::default()
    }
}

/// The member every node agrees leads, once they all know one.
async fn leader(members: &BTreeMap<NodeId, Member>) -> NodeId {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let leaders: BTreeSet<Option<NodeId>> =
            members.values().map(|m| m.node.state(|s| s.leader())).collect();
        if let [Some(l)] = leaders.iter().copied().collect::<Vec<_>>()[..]
            && members[&l].node.leader_term().is_some()
        {
            return l;
        }
        assert!(tokio::time::Instant::now() < deadline, "no agreed leader: {leaders:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Proposes on the leader of its term; returns (base offset, record count).
async fn produce(m: &Member, i: u32) -> (u64, u32) {
    let term = m.node.leader_term().expect("leads");
    let r = m.node.propose(batch(i), term).await.expect("proposed").committed().await.expect("committed");
    (r.base_offset, r.record_count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_driven_through_the_interface_commits_hands_over_and_changes_voters() {
    let root = tempfile::tempdir().expect("tempdir");
    let flusher = Flusher::spawn("group-test").expect("flusher");
    let net = Local::default();
    let mut members = BTreeMap::new();
    for id in 1..=3 {
        members.insert(id, start(id, root.path(), &net, &flusher).await);
    }
    let voters: BTreeMap<NodeId, String> = (1..=3).map(|id| (id, format!("n{id}"))).collect();
    members[&1].node.initialize(voters.clone()).await.expect("initialize");
    assert!(members[&1].node.is_initialized().await.expect("running"));
    assert!(members[&1].node.initialize(voters).await.is_err(), "initialized twice");

    // Offsets are the prefix sum of record counts, in proposal order.
    let first = leader(&members).await;
    let mut next = 0u64;
    for i in 0..50 {
        let (base, count) = produce(&members[&first], i).await;
        assert_eq!(base, next, "batch {i}");
        next += u64::from(count);
    }
    let view = members[&first].node.state(|s| {
        (s.role(), s.voters().count(), s.matched().map(|m| m.count()), s.since_quorum_ack().is_some())
    });
    assert_eq!(view, (Role::Leader, 3, Some(3), true));

    // A proposal for another term, or on a follower, is refused.
    let term = members[&first].node.leader_term().expect("leads");
    let stale = members[&first].node.propose(batch(0), term + 1).await;
    assert!(matches!(stale, Err(ProposeError::Unavailable(_))), "{stale:?}");
    let follower = *members.keys().find(|id| **id != first).expect("a follower");
    match members[&follower].node.propose(batch(0), term).await {
        Err(ProposeError::NotLeader { leader }) => assert_eq!(leader, Some(first)),
        other => panic!("a follower accepted a proposal: {other:?}"),
    }

    // Leadership moves where it is asked to (Raft thesis §3.10).
    members[&first].node.transfer_leader(follower).await;
    let took_over = members[&follower].node.wait_for(WAIT, "took over", |s| s.is_leader()).await;
    assert!(took_over, "node {follower} did not take over");
    let second = leader(&members).await;
    assert_eq!(second, follower);
    let (base, count) = produce(&members[&second], 50).await;
    assert_eq!(base, next);
    next += u64::from(count);

    // The leader's log is purged up to a snapshot, so a fourth replica
    // joining as a learner can only catch up from the snapshot; then it
    // replaces a voter through joint consensus.
    let l = &members[&second].node;
    l.build_snapshot().await.expect("snapshot");
    assert!(
        l.wait_for(WAIT, "snapshot", |s| s.snapshot().is_some_and(|p| p.index > 10)).await,
        "no snapshot"
    );
    let upto = l.state(|s| s.snapshot()).expect("snapshot").index;
    l.purge_log(upto).await.expect("purge");
    assert!(
        l.wait_for(WAIT, "purged", move |s| s.purged().is_some_and(|p| p.index >= upto)).await,
        "not purged"
    );
    let joining = start(4, root.path(), &net, &flusher).await;
    let leaving = *members.keys().find(|id| **id != second).expect("another voter");
    members[&second].node.add_learner(4, "n4".into()).await.expect("learner added");
    let installed = joining.node.wait_for(WAIT, "snapshot installed", move |s| {
        s.snapshot().is_some_and(|p| p.index >= upto) && s.role() == Role::Learner
    });
    assert!(installed.await, "the learner did not install the leader's snapshot");
    members.insert(4, joining);
    let wanted: BTreeSet<NodeId> = members.keys().copied().filter(|id| *id != leaving).collect();
    members[&second].node.change_voters(wanted.clone()).await.expect("voters changed");
    let voters: BTreeSet<NodeId> = members[&second].node.state(|s| s.voters().collect());
    assert_eq!(voters, wanted);
    assert_eq!(members[&second].node.state(|s| s.voter_sets().len()), 1, "still in joint consensus");

    // The group commits with its new voters; every replica that is still a
    // member holds the same records at the same offsets.
    let (base, count) = produce(&members[&second], 51).await;
    assert_eq!(base, next);
    next += u64::from(count);
    let want = members[&second].replica.read(0, usize::MAX).expect("read leader");
    assert_eq!(want.len(), 52);
    for id in wanted {
        let r = &members[&id].replica;
        let mut hw = r.watch_high_watermark();
        tokio::time::timeout(WAIT, hw.wait_for(|hw| *hw >= next)).await.expect("caught up").expect("open");
        assert_eq!(r.read(0, usize::MAX).expect("read"), want, "replica {id} differs");
    }
    for m in members.values() {
        m.node.shutdown().await.expect("shutdown");
    }
}

/// Every founding member writes the same first entry before its node
/// starts (`Replica::found`), so any of them can lead, including the one
/// with the highest node id, and the group works without `initialize`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn founding_members_share_one_first_entry_and_any_of_them_can_lead() {
    let root = tempfile::tempdir().expect("tempdir");
    let flusher = Flusher::spawn("found-test").expect("flusher");
    let net = Local::default();
    let voters: BTreeMap<NodeId, String> = (1..=3).map(|id| (id, format!("n{id}"))).collect();
    let mut members = BTreeMap::new();
    for id in 1..=3 {
        members.insert(id, start_founded(id, root.path(), &net, &flusher, Some(&voters)).await);
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    for m in members.values() {
        m.node.set_elections(false);
        // The node publishes its state once its core has loaded the log.
        let founded = loop {
            let seen =
                m.node.state(|s| (s.has_membership(), s.voters().collect::<Vec<_>>(), s.last_log_index()));
            if seen.0 || tokio::time::Instant::now() >= deadline {
                break seen;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(founded, (true, vec![1, 2, 3], Some(0)), "the founding entry is the log");
    }
    assert!(members[&3].node.is_initialized().await.expect("running"));
    assert!(members[&3].node.initialize(voters).await.is_err(), "a founded group is initialized");
    members[&3].node.campaign().await;
    assert_eq!(leader(&members).await, 3, "the highest node id leads when it campaigns");
    let (base, count) = produce(&members[&3], 7).await;
    assert_eq!((base, count), (0, 2));
    // Replaced by nothing: every member keeps the one first entry and
    // holds the leader's blank entry and the batch after it.
    let deadline = tokio::time::Instant::now() + WAIT;
    while members.values().any(|m| m.node.state(|s| s.last_applied().map(|p| p.index)) != Some(2)) {
        assert!(tokio::time::Instant::now() < deadline, "not every member applied the batch");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for m in members.values() {
        assert_eq!(m.replica.log_end_offset(), 2);
    }
}

/// A group founded with a leader is led by it from its first start, in
/// the founding term, without a single vote or pre-vote, and commits at
/// once; the founding vote is never written over a recorded one, a
/// follower cannot start as the founding leader, and the founding leader
/// started again elects as any node does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_founded_with_a_leader_is_led_by_it_without_an_election() {
    use ferrolog_raft_store::types::Vote;
    use openraft::storage::RaftLogStorage;
    use std::sync::atomic::Ordering;
    let root = tempfile::tempdir().expect("tempdir");
    let flusher = Flusher::spawn("found-leader-test").expect("flusher");
    let net = Local::default();
    let voters: BTreeMap<NodeId, String> = (1..=3).map(|id| (id, format!("n{id}"))).collect();
    let open = |id: NodeId| {
        let dir = root.path().join(format!("n{id}"));
        std::fs::create_dir_all(dir.join("staging")).expect("staging dir");
        Replica::open(&dir.join("replica"), StoreConfig::default(), flusher.clone()).expect("replica")
    };
    let err = open(9).found(voters.clone(), Some(4)).await.expect_err("a leader outside the voters");
    assert!(err.to_string().contains("not a founding voter"), "{err}");
    let mut members = BTreeMap::new();
    // The followers first, so the leader's first messages find them.
    for id in [1, 3, 2] {
        let replica = open(id);
        let founded = replica.found(voters.clone(), Some(2)).await.expect("found");
        assert_eq!(founded, Founding::Founded { leader: Some(2) });
        let node = if id == 2 {
            RaftNode::start_founding_leader(GROUP, id, &settings(), &replica, net.clone())
                .await
                .expect("start")
        } else {
            let refused =
                RaftNode::start_founding_leader(GROUP, id, &settings(), &replica, net.clone()).await;
            assert!(refused.is_err(), "node {id} was not founded as the leader");
            RaftNode::start(GROUP, id, &settings(), &replica, net.clone()).await.expect("start")
        };
        node.set_elections(false);
        let staging = root.path().join(format!("n{id}")).join("staging");
        net.nodes.lock().expect("nodes").insert(id, (node.clone(), staging));
        members.insert(id, Member { node, replica });
    }
    assert_eq!(leader(&members).await, 2, "the founding leader leads");
    assert_eq!(members[&2].node.leader_term(), Some(FOUNDING_TERM));
    // Its lease starts with a quorum's first acknowledgement (no votes were
    // cast for it): a broker's produce waits for it the same way.
    assert!(members[&2].node.renew_lease(WAIT).await, "a quorum acknowledges the founding leader");
    let (base, count) = produce(&members[&2], 4).await;
    assert_eq!((base, count), (0, 2));
    let deadline = tokio::time::Instant::now() + WAIT;
    while members.values().any(|m| m.node.state(|s| s.last_applied().map(|p| p.index)) != Some(2)) {
        assert!(tokio::time::Instant::now() < deadline, "not every member applied the batch");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(net.votes.load(Ordering::Relaxed), 0, "no vote or pre-vote was asked for");

    assert_eq!(members[&1].replica.vote(), Some(Vote::new_committed(FOUNDING_TERM, 2)), "the founding vote");

    // A vote already recorded is kept: no founding leader then.
    let voted = open(7);
    voted.log_store().save_vote(&Vote::new(5, 3)).await.expect("vote");
    let founded = voted.found(voters.clone(), Some(2)).await.expect("found");
    assert_eq!(founded, Founding::Founded { leader: None });
    assert_eq!(voted.vote(), Some(Vote::new(5, 3)), "the recorded vote stays");

    // Started again, the founding leader does not restore itself: it must
    // win an election (its log is more than the founding entry now, too).
    let l = members.remove(&2).expect("leader");
    l.node.shutdown().await.expect("shutdown");
    assert!(
        RaftNode::start_founding_leader(GROUP, 2, &settings(), &l.replica, net.clone()).await.is_err(),
        "no longer as founded"
    );
    let node = RaftNode::start(GROUP, 2, &settings(), &l.replica, net.clone()).await.expect("restart");
    node.set_elections(false);
    net.nodes.lock().expect("nodes").insert(2, (node.clone(), root.path().join("n2").join("staging")));
    // Once its state is loaded (the library reports the vote it flushed,
    // its committed vote for itself of the founding term):
    assert!(node.wait_for(WAIT, "log loaded", |s| s.last_log_index() == Some(2)).await);
    assert_eq!(node.state(|s| s.role()), Role::Follower, "not restored as leader");
    assert_eq!(node.leader_term(), None, "and not named leader of its old term");
    members.insert(2, Member { node, replica: l.replica });
    // The followers refuse pre-votes until the lease they gave the old
    // term lapses (an election timeout).
    let deadline = tokio::time::Instant::now() + WAIT;
    while members[&2].node.leader_term().is_none() {
        assert!(tokio::time::Instant::now() < deadline, "the restarted node was not elected");
        members[&2].node.campaign().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(leader(&members).await, 2);
    assert!(members[&2].node.leader_term().is_some_and(|t| t > FOUNDING_TERM));
    assert!(net.votes.load(Ordering::Relaxed) > 0, "elected by votes");
}

/// A producer that waits for each acknowledgement before it sends the next
/// batch costs each follower one AppendEntries per batch, not two: the
/// commit notice after each batch rides along with the next batch's
/// entries. The last notice still goes, so every follower learns the
/// final commit index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_notices_ride_along_with_the_next_batch() {
    use std::sync::atomic::Ordering;
    let root = tempfile::tempdir().expect("tempdir");
    let flusher = Flusher::spawn("notice-test").expect("flusher");
    let net = Local::default();
    let voters: BTreeMap<NodeId, String> = (1..=3).map(|id| (id, format!("n{id}"))).collect();
    let mut members = BTreeMap::new();
    for id in 1..=3 {
        members.insert(id, start_founded(id, root.path(), &net, &flusher, Some(&voters)).await);
    }
    let l = leader(&members).await;
    produce(&members[&l], 0).await;
    // Heartbeats are entry-less too: the leader sends one per follower
    // every 50 ms, writes or not; the bound below allows for them.
    const BATCHES: u32 = 100;
    let before = net.empty_appends.load(Ordering::Relaxed);
    let started = tokio::time::Instant::now();
    for i in 1..=BATCHES {
        produce(&members[&l], i).await;
    }
    let took = started.elapsed();
    let empty = net.empty_appends.load(Ordering::Relaxed) - before;
    // Without riding along: a notice per batch per follower (200), plus
    // heartbeats (2 per 50 ms).
    let heartbeats = 2 * (took.as_millis() as usize / 50 + 1);
    assert!(
        empty <= heartbeats + BATCHES as usize / 2,
        "{empty} entry-less AppendEntries for {BATCHES} batches in {took:?} ({heartbeats} heartbeats at most)"
    );
    println!("{empty} entry-less AppendEntries for {BATCHES} batches in {took:?}");
    let last = members[&l].node.state(|s| s.last_log_index());
    assert!(last.is_some_and(|i| i >= u64::from(BATCHES)), "every batch appended: {last:?}");
    // The last notice goes alone, and every follower learns it.
    let deadline = tokio::time::Instant::now() + WAIT;
    while members.values().any(|m| m.node.state(|s| s.committed().map(|p| p.index)) != last) {
        assert!(tokio::time::Instant::now() < deadline, "a follower never learned the last commit index");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A follower made dormant keeps answering for its state, acknowledges its
/// leader's heartbeats without starting (and then refuses other candidates'
/// votes within that leader's lease, as a running one does), is started again by the leader's
/// next append (with both followers dormant nothing commits otherwise),
/// and its change stream goes on across the restart; a leader never goes
/// dormant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dormant_followers_keep_their_state_and_wake_for_the_leaders_appends() {
    let root = tempfile::tempdir().expect("tempdir");
    let flusher = Flusher::spawn("dormant-test").expect("flusher");
    let net = Local::default();
    let mut members = BTreeMap::new();
    for id in 1..=3 {
        members.insert(id, start(id, root.path(), &net, &flusher).await);
    }
    let voters: BTreeMap<NodeId, String> = (1..=3).map(|id| (id, format!("n{id}"))).collect();
    members[&1].node.initialize(voters).await.expect("initialize");
    let l = leader(&members).await;
    let mut next = 0u64;
    for i in 0..10 {
        next += u64::from(produce(&members[&l], i).await.1);
    }
    let followers: Vec<NodeId> = members.keys().copied().filter(|id| *id != l).collect();
    let last = members[&l].node.state(|s| s.last_log_index());
    for f in &followers {
        let node = &members[f].node;
        let caught_up =
            node.wait_for(WAIT, "caught up", move |s| s.last_applied().map(|a| a.index) == last).await;
        let seen = node.state(|s| (s.role(), s.term(), s.leader(), s.last_applied(), s.committed()));
        assert!(caught_up, "follower {f} did not apply up to {last:?}: {seen:?}");
    }
    // Parked heartbeats (an idle, quiesced group): only appends reach the followers.
    members[&l].node.set_ticking(false);
    assert!(!members[&l].node.make_dormant(Duration::ZERO).await.expect("leader"), "a leader went dormant");
    let mut changes = members[&followers[0]].node.changes();
    // A late replication message (the leader's last commit notice) may wake
    // a follower made dormant first: go on until both are dormant at once.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !followers.iter().all(|f| members[f].node.is_dormant()) {
        assert!(tokio::time::Instant::now() < deadline, "the followers never were dormant together");
        for f in &followers {
            let node = &members[f].node;
            let before = node.state(|s| (s.term(), s.leader(), s.last_applied(), s.committed()));
            if node.make_dormant(Duration::ZERO).await.expect("dormant") {
                let after = node.state(|s| (s.term(), s.leader(), s.last_applied(), s.committed()));
                assert_eq!(after, before, "follower {f}: its state changed going dormant");
                assert_eq!(node.state(|s| s.role()), Role::Follower);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(ferrolog_replica::dormant_count(), 2);
    // Going dormant is a change, and the stream does not end with it.
    tokio::time::timeout(WAIT, changes.next()).await.expect("a change").expect("the stream goes on");

    // A heartbeat from the leader they follow, at the end of their logs, is
    // answered from the kept state: the lease renews, nobody wakes.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        members[&l].node.state(|s| s.since_quorum_ack()).is_some_and(|d| d >= Duration::from_millis(300))
    );
    let wakes = ferrolog_replica::woken_count();
    assert!(members[&l].node.renew_lease(WAIT).await, "dormant followers did not acknowledge a heartbeat");
    assert!(members[&l].node.state(|s| s.since_quorum_ack()).is_some_and(|d| d < Duration::from_millis(300)));
    assert!(followers.iter().all(|f| members[f].node.is_dormant()), "a heartbeat woke a follower");
    // renew_lease needs one follower's answer; the other's may still be on
    // its way: wait until both acknowledged since.
    let both_acked = members[&l]
        .node
        .wait_for(WAIT, "both followers acknowledged", |s| {
            s.acknowledged_ago()
                .is_some_and(|mut a| a.all(|(_, ago)| ago.is_some_and(|d| d < Duration::from_millis(300))))
        })
        .await;
    assert!(both_acked, "a dormant follower did not acknowledge the heartbeat");
    assert_eq!(ferrolog_replica::woken_count(), wakes, "a heartbeat woke a follower");
    // Having acknowledged it, a dormant follower keeps the leader's lease as
    // a running one would: another candidate's vote is refused, unwoken.
    let term = members[&l].node.state(|s| s.term());
    let vote = pb::VoteRequest {
        group_id: GROUP,
        target_node: followers[0],
        vote: Some(pb::Vote { term: term + 1, node: followers[1], committed: false }),
        last_log_id: Some(pb::LogId { term: term + 1, leader_node: followers[1], index: 1 << 40 }),
        leadership_transfer: false,
    };
    let answer = members[&followers[0]].node.handle_vote(&vote, false).await.expect("answered");
    assert!(!answer.vote_granted, "a dormant follower within its leader's lease granted a vote");
    assert_eq!(ferrolog_replica::woken_count(), wakes, "a vote within the lease woke a follower");

    // The next write commits only if a dormant follower wakes to store it.
    let t0 = tokio::time::Instant::now();
    let (base, count) = produce(&members[&l], 10).await;
    println!("a write to a group with both followers dormant committed in {:?}", t0.elapsed());
    assert_eq!(base, next);
    next += u64::from(count);
    assert!(followers.iter().any(|f| !members[f].node.is_dormant()), "no follower woke");
    for f in &followers {
        let node = &members[f].node;
        // Replication catches up whichever follower was not needed for the commit.
        let _ = node.wait_for(WAIT, "woke", |s| s.is_running()).await;
        let r = &members[f].replica;
        let mut hw = r.watch_high_watermark();
        tokio::time::timeout(WAIT, hw.wait_for(|hw| *hw >= next)).await.expect("caught up").expect("open");
        assert_eq!(
            r.read(0, usize::MAX).expect("read"),
            members[&l].replica.read(0, usize::MAX).expect("read")
        );
    }
    for m in members.values() {
        m.node.shutdown().await.expect("shutdown");
    }
    // Once shut down for good, the stream ends.
    let ended = tokio::time::timeout(WAIT, async { while changes.next().await.is_some() {} }).await;
    assert!(ended.is_ok(), "the change stream did not end at shutdown");
    assert_eq!(ferrolog_replica::dormant_count(), 0);
}

//! A partition group of three replicas replicating over the real gRPC
//! transport on loopback (127.0.0.1–3): records written on the leader are
//! identical on every replica, and a replica that was down while the leader
//! purged its log catches up through a snapshot that carries the segments.

use std::collections::BTreeMap;
use std::time::Duration;

use ferrolog_broker::groups::{GroupRegistry, HostedGroup};
use ferrolog_broker::network::{PeerAddresses, RaftPeerServer};
use ferrolog_raft_store::{Flusher, RecordBatch, Replica, StoreConfig};
use ferrolog_replica::{NodeId, RaftNode, Settings, ValidSettings};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

const GROUP: u64 = 7;

struct Broker {
    raft: RaftNode,
    groups: GroupRegistry,
    replica: Replica,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<()>,
}

fn raft_settings() -> ValidSettings {
    let s = Settings {
        heartbeat_interval_ms: 100,
        election_timeout_min_ms: 400,
        election_timeout_max_ms: 800,
        snapshot_after_entries: None,
        max_payload_entries: 64,
    };
    s.validate().expect("settings")
}

fn batch(i: u64) -> RecordBatch {
    RecordBatch {
        record_count: 1 + (i % 4) as u32,
        first_timestamp_ms: i as i64,
        max_timestamp_ms: i as i64,
        producer_id: -1,
        records: bytes::Bytes::from(format!("record batch {i} ").repeat(1 + (i % 9) as usize)),
        ..RecordBatch::default()
    }
}

async fn start(id: NodeId, dir: &std::path::Path, listener: TcpListener, peers: &PeerAddresses) -> Broker {
    let flusher = Flusher::spawn(&format!("node{id}")).expect("flusher");
    let config = StoreConfig { segment_bytes: 16 * 1024, ..StoreConfig::default() };
    let replica = Replica::open(&dir.join("replica"), config, flusher).expect("replica");
    let raft = RaftNode::start(GROUP, id, &raft_settings(), &replica, peers.clone()).await.expect("raft");
    let groups = GroupRegistry::default();
    let staging_dir = dir.join("staging");
    std::fs::create_dir_all(&staging_dir).expect("staging");
    groups.insert(
        GROUP,
        HostedGroup {
            node_id: id,
            raft: raft.clone(),
            replica: replica.clone(),
            staging_dir,
            partition: None,
        },
    );
    // Pings report the groups led here from the watcher's view.
    tokio::spawn(groups.clone().watch_leadership());
    let registry = groups.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(RaftPeerServer::new(id as u32, groups).into_service())
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            })
            .await
            .expect("serve");
    });
    Broker { raft, groups: registry, replica, stop, server }
}

/// Writes `b` on the current leader, retrying while leadership settles,
/// as a client following NOT_LEADER redirects would.
async fn write(brokers: &BTreeMap<NodeId, Broker>, b: RecordBatch) -> ferrolog_raft_store::AppendResult {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let leader = leader_of(brokers).await;
        match brokers.get(&leader).map(|l| l.raft.clone()) {
            Some(raft) => match raft.write(b.clone()).await {
                Ok(r) => return r,
                Err(e) if tokio::time::Instant::now() < deadline => eprintln!("write retried: {e}"),
                Err(e) => panic!("write failed: {e}"),
            },
            None => assert!(tokio::time::Instant::now() < deadline, "leader {leader} is not running"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `replica` has applied every record below `offset`.
async fn caught_up(replica: &Replica, offset: u64) {
    let mut hw = replica.watch_high_watermark();
    tokio::time::timeout(Duration::from_secs(30), hw.wait_for(|hw| *hw >= offset))
        .await
        .expect("replica caught up in time")
        .expect("replica open");
}

async fn leader_of(brokers: &BTreeMap<NodeId, Broker>) -> NodeId {
    let any = brokers.values().next().expect("a broker");
    let known = any.raft.wait_for(Duration::from_secs(20), "leader", |s| s.leader().is_some()).await;
    assert!(known, "no leader elected");
    any.raft.state(|s| s.leader()).expect("leader id")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_agree_and_a_lagging_one_catches_up_by_snapshot() {
    let root = tempfile::tempdir().expect("tempdir");
    let peers = PeerAddresses::new([], Duration::from_millis(400)); // election_timeout_min
    let mut listeners = BTreeMap::new();
    let mut members = BTreeMap::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind(format!("127.0.0.{id}:0")).await.expect("bind");
        members.insert(id, l.local_addr().expect("addr").to_string());
        listeners.insert(id, l);
    }
    let mut brokers = BTreeMap::new();
    for (id, l) in listeners {
        brokers.insert(id, start(id, &root.path().join(format!("n{id}")), l, &peers).await);
    }
    brokers[&1].raft.initialize(members.clone()).await.expect("initialize");

    let mut next_offset = 0;
    for i in 0..300 {
        let r = write(&brokers, batch(i)).await;
        assert_eq!(r.base_offset, next_offset);
        next_offset += u64::from(r.record_count);
    }
    let leader = leader_of(&brokers).await;
    for b in brokers.values() {
        caught_up(&b.replica, next_offset).await;
    }
    // Only the leader's broker says it leads the group.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let leading: Vec<(NodeId, Vec<u64>)> =
            brokers.iter().map(|(id, b)| (*id, b.groups.leading().to_vec())).collect();
        if leading.iter().all(|(id, l)| (*id == leader) == (l.as_slice() == [GROUP])) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "leadership reported wrongly: {leading:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let want = brokers[&leader].replica.read(0, usize::MAX).expect("read leader");
    assert_eq!(want.len(), 300);
    for (id, b) in &brokers {
        assert_eq!(b.replica.read(0, usize::MAX).expect("read"), want, "replica {id} differs");
    }

    // Take a follower down; write more; snapshot and purge on the leader so
    // the follower can only catch up from a snapshot.
    let lagging = *brokers.keys().find(|id| **id != leader).expect("a follower");
    let down = brokers.remove(&lagging).expect("follower");
    down.raft.shutdown().await.expect("shutdown");
    let _ = down.stop.send(());
    down.server.await.expect("server");
    down.groups.remove(GROUP);
    drop((down.raft, down.replica, down.groups));
    for i in 300..600 {
        let r = write(&brokers, batch(i)).await;
        assert_eq!(r.base_offset, next_offset);
        next_offset += u64::from(r.record_count);
    }
    let l = &brokers[&leader].raft;
    l.build_snapshot().await.expect("snapshot");
    assert!(l.wait_for(Duration::from_secs(20), "snapshot", |s| s.snapshot().is_some()).await, "no snapshot");
    let upto = l.state(|s| s.snapshot()).expect("snapshot").index;
    l.purge_log(upto).await.expect("purge");
    let purged =
        l.wait_for(Duration::from_secs(20), "purged", move |s| s.purged().map(|p| p.index) == Some(upto));
    assert!(purged.await, "log not purged");

    // Bring it back on its old files and address.
    let addr = members[&lagging].clone();
    let listener = loop {
        match TcpListener::bind(&addr).await {
            Ok(l) => break l,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let back = start(lagging, &root.path().join(format!("n{lagging}")), listener, &peers).await;
    caught_up(&back.replica, next_offset).await;
    let installed = back
        .raft
        .wait_for(Duration::from_secs(10), "installed the leader's snapshot", move |s| {
            s.snapshot().is_some_and(|p| p.index >= upto)
        })
        .await;
    assert!(installed, "not caught up by snapshot");
    let want = brokers[&leader].replica.read(0, usize::MAX).expect("read leader");
    assert_eq!(want.len(), 600);
    assert_eq!(back.replica.read(0, usize::MAX).expect("read caught-up replica"), want);
    assert_eq!(back.replica.high_watermark(), next_offset);
    for b in brokers.into_values().chain([back]) {
        b.raft.shutdown().await.expect("shutdown");
        let _ = b.stop.send(());
    }
}

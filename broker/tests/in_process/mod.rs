//! What the in-process cluster tests share: three brokers started in the
//! test's process on loopback listeners, on the OS's file system or on
//! in-memory disks, and [`run`], the scenario they go through.

#![allow(dead_code, reason = "each test binary uses the disks it needs")]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ferrolog_broker::config::BrokerConfig;
use ferrolog_broker::listener::Listener;
use ferrolog_broker::network::memory::MemoryNetwork;
use ferrolog_broker::server::{Broker, Listeners};
use ferrolog_proto::client::ferrolog_client::FerrologClient;
use ferrolog_proto::client::{
    CreateTopicRequest, FetchRequest, InitProducerIdRequest, PartitionStatusRequest, PartitionStatusResponse,
    ProduceRequest, Record, RecordSet, ReplicaState,
};
use ferrolog_raft_store::vfs::{self, FaultyFs, Fs, PowerCut};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub const TOPIC: &str = "in-process";
/// Records produced in all: 10 with every broker up, the rest while broker 2
/// is down.
pub const RECORDS: i32 = 1_110;

/// One broker of the process: its addresses, and while it runs, the means
/// to stop it.
pub struct Member {
    /// The network its clients dial it on.
    pub net: Net,
    /// Its peer and client addresses.
    pub peer: SocketAddr,
    pub client: SocketAddr,
    /// Its data directory.
    pub dir: PathBuf,
    /// While it runs: the sender that stops it, and its task.
    pub running: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

/// A started broker: its boot id, the sender that stops it, its task.
pub type Started = (u64, oneshot::Sender<()>, JoinHandle<()>);

/// Starts broker `id` of `cluster` on `listeners`, with data in `dir` on
/// `fs`. (A founding broker may wait for its peers to answer before it
/// returns: start the founders together.)
pub async fn start(
    fs: Fs,
    id: u32,
    dir: PathBuf,
    cluster: &BTreeMap<u32, SocketAddr>,
    listeners: Listeners,
) -> anyhow::Result<Started> {
    let mut config = BrokerConfig {
        node_id: id,
        client_addr: listeners.client.local_addr()?,
        peer_addr: listeners.peer.local_addr()?,
        data_dir: dir,
        initial_cluster: cluster.clone(),
        ..BrokerConfig::default()
    };
    // Snapshots every few entries: a restarted broker may be sent one.
    config.raft.snapshot_after_entries = 5;
    // Scrub passes every 200 ms: segments are verified while the scenario
    // runs (on the log cleaner's kind of thread, or on a simulation's task).
    config.scrub.interval_ms = 200;
    let (stop, stopped) = oneshot::channel::<()>();
    let signal = async move {
        let _ = stopped.await;
    };
    let broker = Broker::start_on(fs, config, listeners, signal).await?;
    Ok((broker.boot_id(), stop, tokio::spawn(broker.serve())))
}

pub async fn stop(m: &mut Member) -> anyhow::Result<()> {
    let (stop, serving) = m.running.take().expect("running");
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), serving).await??;
    Ok(())
}

/// The network the brokers and the test's clients are on.
#[derive(Clone, Debug)]
pub enum Net {
    /// The operating system's TCP on loopback.
    Os,
    /// An in-memory network (`ferrolog_broker::network::memory`).
    Memory(MemoryNetwork),
}

impl Net {
    /// A listener on `addr` (port 0: any free one).
    pub async fn listen(&self, addr: SocketAddr) -> anyhow::Result<Listener> {
        Ok(match self {
            Net::Os => TcpListener::bind(addr).await?.into(),
            Net::Memory(n) => n.bind(addr)?.into(),
        })
    }

    /// The IP address broker `id` listens on: loopback on the OS's
    /// network; on an in-memory one an address of TEST-NET-1 (RFC 5737,
    /// 192.0.2.0/24), which no real host has, so a dial that missed the
    /// in-memory network fails instead of reaching some process here.
    pub fn ip_of(&self, id: u32) -> std::net::IpAddr {
        match self {
            Net::Os => std::net::Ipv4Addr::LOCALHOST.into(),
            Net::Memory(_) => std::net::Ipv4Addr::new(192, 0, 2, u8::try_from(id).unwrap_or(u8::MAX)).into(),
        }
    }

    /// The in-memory network, if it is one.
    pub fn memory(&self) -> Option<MemoryNetwork> {
        match self {
            Net::Os => None,
            Net::Memory(n) => Some(n.clone()),
        }
    }
}

pub async fn bind(net: &Net, peer: SocketAddr, client: SocketAddr) -> anyhow::Result<Listeners> {
    Ok(Listeners {
        peer: net.listen(peer).await?,
        client: net.listen(client).await?,
        network: net.memory(),
        kafka: None,
    })
}

/// A client of the broker at `addr` whose every call gives up after 5 s (a
/// stuck call fails the test instead of holding it).
pub async fn api(net: &Net, addr: SocketAddr) -> anyhow::Result<FerrologClient<tonic::transport::Channel>> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    let channel = match net {
        Net::Os => endpoint.connect().await?,
        Net::Memory(n) => endpoint.connect_with_connector(n.connector(None)).await?,
    };
    Ok(FerrologClient::new(channel))
}

/// Creates [`TOPIC`] (one partition, three replicas, `configs`) through
/// `member`, asking again every 100 ms until it answers without an error
/// (its controller may not have a leader yet) or 60 s pass.
pub async fn create_topic(member: &Member, configs: &[(&str, &str)]) -> anyhow::Result<()> {
    let create = CreateTopicRequest {
        name: TOPIC.into(),
        partitions: 1,
        replication_factor: 3,
        configs: configs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = api(&member.net, member.client).await?.create_topic(create.clone()).await?.into_inner();
        let Some(error) = answer.error else { return Ok(()) };
        anyhow::ensure!(Instant::now() < deadline, "the topic was never created: {error:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An idempotent producer's id and epoch (KIP-98), from any running broker.
pub async fn producer_id(members: &[&Member]) -> anyhow::Result<(i64, i32)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for m in members {
            if let Ok(mut c) = api(&m.net, m.client).await
                && let Ok(r) = c.init_producer_id(InitProducerIdRequest {}).await
                && r.get_ref().error.is_none()
            {
                return Ok((r.get_ref().producer_id, r.get_ref().producer_epoch));
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "no producer id");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Produces records `values` as one batch with base sequence number
/// `sequence` of `producer` through whichever running broker leads,
/// retrying until 30 s pass (a retry of a stored batch is answered as a
/// duplicate, with its offset); returns its base offset.
pub async fn produce(
    members: &[&Member],
    producer: (i64, i32),
    sequence: i32,
    values: &[String],
) -> anyhow::Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let request = ProduceRequest {
        topic: TOPIC.into(),
        partition: 0,
        records: values
            .iter()
            .map(|v| Record { value: v.as_bytes().to_vec().into(), ..Default::default() })
            .collect(),
        producer_id: producer.0,
        producer_epoch: producer.1,
        base_sequence: sequence,
        ..Default::default()
    };
    loop {
        for m in members {
            if let Ok(mut c) = api(&m.net, m.client).await
                && let Ok(r) = c.produce(request.clone()).await
                && r.get_ref().error.is_none()
            {
                return Ok(r.into_inner().base_offset);
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "batch {sequence} was never produced");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Record `i`'s value: 1 KiB, so that a few records fill a segment.
pub fn value(i: i32) -> String {
    format!("r{i}-{}", "x".repeat(1024))
}

pub async fn status(net: &Net, addr: SocketAddr) -> anyhow::Result<PartitionStatusResponse> {
    Ok(api(net, addr)
        .await?
        .partition_status(PartitionStatusRequest { topic: TOPIC.into(), partition: 0 })
        .await?
        .into_inner())
}

/// Where each broker's data directory lives.
pub enum Disks {
    /// The operating system's file system, under a temporary directory.
    Os(tempfile::TempDir),
    /// One in-memory disk per broker that keeps only what fsync covered
    /// (the store's fault-injecting file system).
    Memory(BTreeMap<u32, FaultyFs>),
}

impl Disks {
    pub fn memory() -> Self {
        Disks::Memory((1..=3).map(|id| (id, FaultyFs::new(u64::from(id)))).collect())
    }

    /// In-memory disks that ask for the brokers' background work to run as
    /// tasks of the runtime (`Vfs::background_on_runtime`), as a
    /// deterministic simulation's do.
    pub fn simulated() -> Self {
        Self::simulated_from(0)
    }

    /// As [`Disks::simulated`], with the disks' own random numbers (where
    /// a torn write ends) drawn from `seed`, another stream for each disk
    /// (`FaultyFs::new` sets the lowest bit, so the streams differ above it).
    pub fn simulated_from(seed: u64) -> Self {
        let disk = |id: u32| FaultyFs::new(seed.wrapping_mul(8).wrapping_add(2 * u64::from(id))).simulated();
        Disks::Memory((1..=3).map(|id| (id, disk(id))).collect())
    }

    /// Broker `id`'s file system, as a process started now sees it.
    pub fn fs(&self, id: u32) -> Fs {
        match self {
            Disks::Os(_) => vfs::real(),
            Disks::Memory(disks) => disks[&id].mount(),
        }
    }

    pub fn dir(&self, id: u32) -> PathBuf {
        match self {
            Disks::Os(root) => root.path().join(format!("broker-{id}")),
            Disks::Memory(_) => memory_root().join(format!("broker-{id}")),
        }
    }

    /// On an in-memory disk, cuts broker `id`'s power (what no fsync
    /// covered is lost, the last write torn; the running broker's every
    /// file operation fails from then on).
    pub fn cut_power(&self, id: u32) {
        if let Disks::Memory(disks) = self {
            disks[&id].power_cut(PowerCut::Torn);
        }
    }

    /// Broker `id`'s in-memory disk (none on the OS's file system).
    pub fn memory_disk(&self, id: u32) -> Option<&FaultyFs> {
        match self {
            Disks::Os(_) => None,
            Disks::Memory(disks) => disks.get(&id),
        }
    }

    /// Each in-memory disk's counts of syncs, faults and losses.
    pub fn stats(&self) -> Vec<ferrolog_raft_store::vfs::FaultyStats> {
        match self {
            Disks::Os(_) => Vec::new(),
            Disks::Memory(disks) => disks.values().map(FaultyFs::stats).collect(),
        }
    }

    /// On in-memory disks: that every broker's files went there (each disk
    /// saw file and directory fsyncs) and broker 2's lost power once.
    fn assert_used(&self) {
        if let Disks::Memory(disks) = self {
            for (id, disk) in disks {
                let s = disk.stats();
                assert!(s.file_syncs > 0 && s.dir_syncs > 0, "broker {id}'s disk saw no fsync: {s:?}");
                assert_eq!(s.power_cuts, u64::from(*id == 2), "broker {id}'s disk: {s:?}");
            }
            assert!(
                !memory_root().exists(),
                "an in-memory disk's directory was made on the OS's file system"
            );
        }
    }
}

/// Where the in-memory disks keep the data directories: a path that does
/// not exist on this machine's file system, and must not come to.
pub fn memory_root() -> PathBuf {
    PathBuf::from(format!("/ferrolog-in-memory-{}", std::process::id()))
}

/// Starts brokers 1, 2 and 3 together as the founders of a cluster on
/// `net`, each on listeners of its own IP address ([`Net::ip_of`]) and
/// its data directory on `disks`; returns them, their peer addresses (the
/// cluster each is configured with) and their boot ids.
pub async fn start_founders(
    net: &Net,
    disks: &Disks,
) -> anyhow::Result<(BTreeMap<u32, Member>, BTreeMap<u32, SocketAddr>, BTreeMap<u32, u64>)> {
    let mut listeners = BTreeMap::new();
    let mut members = BTreeMap::new();
    for id in 1..=3u32 {
        let ip = net.ip_of(id);
        let l = bind(net, SocketAddr::new(ip, 0), SocketAddr::new(ip, 0)).await?;
        let member = Member {
            net: net.clone(),
            peer: l.peer.local_addr()?,
            client: l.client.local_addr()?,
            dir: disks.dir(id),
            running: None,
        };
        members.insert(id, member);
        listeners.insert(id, l);
    }
    let cluster: BTreeMap<u32, SocketAddr> = members.iter().map(|(id, m)| (*id, m.peer)).collect();
    let started = futures::future::try_join_all(
        listeners.into_iter().map(|(id, l)| start(disks.fs(id), id, members[&id].dir.clone(), &cluster, l)),
    )
    .await?;
    let mut boot_ids = BTreeMap::new();
    for ((id, m), (boot_id, stop, serving)) in members.iter_mut().zip(started) {
        boot_ids.insert(*id, boot_id);
        m.running = Some((stop, serving));
    }
    Ok((members, cluster, boot_ids))
}

/// Three brokers of one process replicate a topic; broker 2 stops (and on
/// in-memory disks loses power), the others take more writes, and broker 2
/// starts again on its directory and ports. Returns the boot ids the
/// brokers had, in order (broker 2's again last).
pub async fn run(disks: &Disks, net: Net) -> anyhow::Result<Vec<u64>> {
    let (mut members, cluster, boot_ids) = start_founders(&net, disks).await?;
    let distinct: std::collections::BTreeSet<u64> = boot_ids.values().copied().collect();
    assert_eq!(distinct.len(), 3, "every broker of the process has its own boot id: {boot_ids:?}");

    // Segments of 4 KiB (the least allowed) and 4 KiB retained: while
    // broker 2 is down the others delete the segments it never got.
    create_topic(&members[&1], &[("segment.bytes", "4096"), ("retention.bytes", "4096")]).await?;
    let all: Vec<&Member> = members.values().collect();
    let producer = producer_id(&all).await?;
    for i in 0..10 {
        assert_eq!(produce(&all, producer, i, &[value(i)]).await?, u64::try_from(i)?);
    }

    // Broker 2 loses power (on in-memory disks) and stops; the other two
    // keep taking writes.
    let two = members.get_mut(&2).expect("member 2");
    disks.cut_power(2);
    stop(two).await?;
    // 1,100 records of 1 KiB in batches of 50: retention (4 KiB kept)
    // moves the log start past all that broker 2 holds.
    for first in (10..RECORDS).step_by(50) {
        let up = [&members[&1], &members[&3]];
        let batch: Vec<String> = (first..(first + 50).min(RECORDS)).map(value).collect();
        assert_eq!(produce(&up, producer, first, &batch).await?, u64::try_from(first)?);
    }

    // Retention on the others catches up: their log start nears the end.
    let deadline = Instant::now() + Duration::from_secs(60);
    let log_start = loop {
        let starts: Vec<u64> = futures::future::join_all([1, 3].map(|id| status(&net, members[&id].client)))
            .await
            .into_iter()
            .map(|s| s.map_or(0, |s| s.log_start_offset))
            .collect();
        if let Some(start) =
            starts.iter().copied().min().filter(|s| *s + 100 > u64::try_from(RECORDS).unwrap_or(0))
        {
            break start;
        }
        anyhow::ensure!(Instant::now() < deadline, "retention did not catch up: {starts:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // It starts again in this process, on its directory and ports.
    let two = members.get_mut(&2).expect("member 2");
    let (again, stop_two, serving) =
        start(disks.fs(2), 2, two.dir.clone(), &cluster, bind(&net, two.peer, two.client).await?).await?;
    two.running = Some((stop_two, serving));
    assert_ne!(again, boot_ids[&2], "a broker restarted in the same process keeps its old boot id");

    // It catches up, across a log start that moved past everything it
    // held: its replica runs, holds everything the leader does, and has
    // moved its log start as far.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut leader = None;
        for m in members.values() {
            if let Ok(s) = status(&net, m.client).await
                && s.error.is_none()
                && s.leader != 0
            {
                leader = Some(s.leader);
                break;
            }
        }
        let mine = status(&net, members[&2].client).await.ok();
        if let (Some(l), Some(mine)) = (leader, &mine) {
            let theirs = status(&net, members[&l].client).await?;
            if mine.replica_state == ReplicaState::Running as i32
                && theirs.high_watermark >= u64::try_from(RECORDS)?
                && mine.last_log_index == theirs.last_log_index
                // The others' log start, applied here too (a follower
                // moves its own once the entry that moves it applies).
                && mine.log_start_offset >= log_start
            {
                break;
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "broker 2 did not catch up: {mine:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Every acknowledged record retention kept, once, in order.
    let (mut values, mut read_from) = (Vec::new(), 0);
    for m in members.values() {
        let Ok(s) = status(&net, m.client).await else { continue };
        let r = api(&m.net, m.client)
            .await?
            .fetch(FetchRequest {
                topic: TOPIC.into(),
                partition: 0,
                offset: s.log_start_offset,
                max_bytes: 16 << 20,
                ..Default::default()
            })
            .await?
            .into_inner();
        if r.error.is_none() {
            read_from = s.log_start_offset;
            for b in &r.batches {
                let set = <RecordSet as prost::Message>::decode(b.records.clone())?;
                values.extend(set.records.iter().map(|r| String::from_utf8_lossy(&r.value).into_owned()));
            }
            break;
        }
    }
    // Retention may have moved the log start on since broker 2 returned.
    assert!(read_from >= log_start, "the log start moved back: {read_from} < {log_start}");
    let want: Vec<String> =
        (read_from..u64::try_from(RECORDS)?).map(|i| value(i32::try_from(i).expect("small"))).collect();
    let names =
        |v: &[String]| v.iter().map(|v| v.split('-').next().unwrap_or("").to_owned()).collect::<Vec<_>>();
    assert_eq!(names(&values), names(&want));
    assert_eq!(values, want);

    for m in members.values_mut() {
        stop(m).await?;
    }
    disks.assert_used();
    Ok(boot_ids.values().copied().chain([again]).collect())
}

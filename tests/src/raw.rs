//! Small helpers over the raw gRPC client, for tests that must see exact
//! wire behaviour (error codes, leader hints) rather than the client
//! library's retries.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::bail;
use ferrolog_proto::client::{
    CreateTopicRequest, ErrorCode, ListOffsetsRequest, ListOffsetsResponse, OffsetSpec,
    PartitionStatusRequest, PartitionStatusResponse, ProduceRequest, ProduceResponse, Record,
};

use crate::{Cluster, connect, metadata};

/// A record with key `k` and value `v`, timestamped by the broker.
pub fn record(k: &str, v: &str) -> Record {
    Record {
        key: Some(k.as_bytes().to_vec().into()),
        value: v.as_bytes().to_vec().into(),
        headers: vec![],
        timestamp_ms: 0,
        ..Record::default()
    }
}

/// The wire error code of an optional error.
pub fn code(e: &Option<ferrolog_proto::client::Error>) -> ErrorCode {
    e.as_ref().map_or(ErrorCode::None, |e| e.code())
}

/// Creates a topic through any running broker, retrying while there is
/// no controller, and waits until every running broker's metadata lists it
/// (a broker whose image has not applied the creation yet answers
/// `UNKNOWN_TOPIC`, as Kafka's brokers do until metadata propagates).
///
/// # Errors
/// Transport errors, the error the controller answered, or a broker that
/// does not learn of the topic within 30 s.
pub async fn create_topic(c: &Cluster, name: &str, partitions: u32, rf: u32) -> anyhow::Result<()> {
    create_topic_with_config(c, name, partitions, rf, &std::collections::BTreeMap::new()).await
}

/// As [`create_topic`], with topic configuration overrides (`retention.bytes`
/// and the like, by Kafka's names).
///
/// # Errors
/// As [`create_topic`].
pub async fn create_topic_with_config(
    c: &Cluster,
    name: &str,
    partitions: u32,
    rf: u32,
    configs: &std::collections::BTreeMap<String, String>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut turn = 0usize;
    loop {
        // Any running broker will do: it forwards to the controller.
        let running: Vec<u32> = c.brokers.iter().map(|b| b.id).filter(|id| c.is_running(*id)).collect();
        anyhow::ensure!(!running.is_empty(), "no broker is running");
        turn += 1;
        let via = running[turn % running.len()];
        let r = match connect(c.broker(via).client_addr).await {
            Ok(mut client) => client
                .create_topic(CreateTopicRequest {
                    name: name.into(),
                    partitions,
                    replication_factor: rf,
                    configs: configs.clone().into_iter().collect(),
                })
                .await?
                .into_inner(),
            Err(_) if Instant::now() < deadline => continue,
            Err(e) => return Err(e),
        };
        match code(&r.error) {
            ErrorCode::None => break,
            ErrorCode::Unavailable | ErrorCode::NotLeader if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            _ => bail!("create topic {name}: {:?}", r.error),
        }
    }
    // The controller applied the creation before it answered: its metadata
    // has the new incarnation's id (a broker that has not applied a
    // deletion of the same name yet still lists the old one).
    let topic_id = loop {
        let controller = metadata(c.broker(via_of(c)?).client_addr).await.map(|m| m.controller).unwrap_or(0);
        if controller != 0
            && c.is_running(controller)
            && let Ok(m) = metadata(c.broker(controller).client_addr).await
            && let Some(t) = m.topics.iter().find(|t| t.name == name)
        {
            break t.topic_id.clone();
        }
        anyhow::ensure!(Instant::now() < deadline, "no controller lists topic {name}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for b in c.brokers.iter().filter(|b| c.is_running(b.id)) {
        loop {
            let known = metadata(b.client_addr)
                .await
                .is_ok_and(|m| m.topics.iter().any(|t| t.name == name && t.topic_id == topic_id));
            if known {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "broker {} never learned of topic {name}", b.id);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// A running broker's id.
fn via_of(c: &Cluster) -> anyhow::Result<u32> {
    c.brokers
        .iter()
        .map(|b| b.id)
        .find(|id| c.is_running(*id))
        .ok_or_else(|| anyhow::anyhow!("no broker is running"))
}

/// The leader broker of `topic`/`partition` as reported by any running
/// broker, waiting up to `timeout` for one.
///
/// # Errors
/// If none is reported in time.
pub async fn leader(c: &Cluster, topic: &str, partition: u32, timeout: Duration) -> anyhow::Result<u32> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        for b in c.brokers.iter().filter(|b| c.is_running(b.id)) {
            let Ok(m) = metadata(b.client_addr).await else { continue };
            if let Some(t) = m.topics.iter().find(|t| t.name == topic)
                && let Some(p) = t.partitions.get(partition as usize)
                && p.leader != 0
                && c.is_running(p.leader)
            {
                return Ok(p.leader);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("no leader for {topic}/{partition} within {timeout:?}")
}

/// Sends one produce request to `addr`.
///
/// # Errors
/// Transport errors.
pub async fn produce_once(addr: SocketAddr, req: ProduceRequest) -> anyhow::Result<ProduceResponse> {
    Ok(connect(addr).await?.produce(req).await?.into_inner())
}

/// Produces `req` to whichever broker leads, following hints, until it is
/// acknowledged or `timeout` passes. Returns the response and the broker
/// that acknowledged.
///
/// # Errors
/// A non-retriable error code, or the timeout.
pub async fn produce(
    c: &Cluster,
    req: ProduceRequest,
    timeout: Duration,
) -> anyhow::Result<(ProduceResponse, u32)> {
    let deadline = Instant::now() + timeout;
    let unknown_until = Instant::now() + Duration::from_secs(5).min(timeout);
    let mut last = String::new();
    while Instant::now() < deadline {
        let id = match leader(c, &req.topic, req.partition, Duration::from_millis(500)).await {
            Ok(id) => id,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        match produce_once(c.broker(id).client_addr, req.clone()).await {
            Ok(r) if r.error.is_none() => return Ok((r, id)),
            Ok(r) => match code(&r.error) {
                ErrorCode::NotLeader | ErrorCode::Unavailable | ErrorCode::DuplicateInFlight => {
                    last = format!("{:?}", r.error);
                }
                // Right after the topic was created, a broker whose metadata
                // has not applied the creation yet does not know it.
                ErrorCode::UnknownTopic if Instant::now() < unknown_until => last = format!("{:?}", r.error),
                _ => bail!("produce: {:?}", r.error),
            },
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("produce not acknowledged within {timeout:?}: {last}")
}

/// ListOffsets by timestamp (`timestamp_ms`, ms since the epoch) for
/// `topic`/`partition`, asked of whichever running broker leads, retrying
/// `NOT_LEADER` and `UNAVAILABLE` until `timeout`. Returns the answer and
/// the broker that gave it.
///
/// # Errors
/// Another error code, or the timeout.
pub async fn offsets_for_time(
    c: &Cluster,
    topic: &str,
    partition: u32,
    timestamp_ms: i64,
    timeout: Duration,
) -> anyhow::Result<(ListOffsetsResponse, u32)> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    while Instant::now() < deadline {
        let id = match leader(c, topic, partition, Duration::from_millis(500)).await {
            Ok(id) => id,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        let req = ListOffsetsRequest {
            topic: topic.into(),
            partition,
            spec: OffsetSpec::Timestamp as i32,
            timestamp_ms,
            ..ListOffsetsRequest::default()
        };
        match connect(c.broker(id).client_addr).await {
            Ok(mut client) => match client.list_offsets(req).await {
                Ok(r) => {
                    let r = r.into_inner();
                    match code(&r.error) {
                        ErrorCode::None => return Ok((r, id)),
                        ErrorCode::NotLeader | ErrorCode::Unavailable => last = format!("{:?}", r.error),
                        _ => bail!("list offsets for {timestamp_ms}: {:?}", r.error),
                    }
                }
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("no answer to list offsets for {timestamp_ms} within {timeout:?}: {last}")
}

/// Raft status of a partition as broker `id` sees it.
///
/// # Errors
/// Transport errors.
pub async fn status(
    c: &Cluster,
    id: u32,
    topic: &str,
    partition: u32,
) -> anyhow::Result<PartitionStatusResponse> {
    Ok(connect(c.broker(id).client_addr)
        .await?
        .partition_status(PartitionStatusRequest { topic: topic.into(), partition })
        .await?
        .into_inner())
}

/// The values (UTF-8) of partition 0 of `topic` from offset 0 up to its
/// high watermark, as the broker at `addr` serves them (fetched 1 MiB at a
/// time).
///
/// # Errors
/// Transport errors, an error the broker answered (not leader, a storage
/// error), or as [`values`].
pub async fn read_values(addr: SocketAddr, topic: &str) -> anyhow::Result<Vec<String>> {
    read_partition(addr, topic, 0).await
}

/// As [`read_values`], for partition `partition`.
///
/// # Errors
/// As [`read_values`].
pub async fn read_partition(addr: SocketAddr, topic: &str, partition: u32) -> anyhow::Result<Vec<String>> {
    let mut client = connect(addr).await?;
    let mut out = Vec::new();
    let mut offset = 0u64;
    loop {
        let req = ferrolog_proto::client::FetchRequest {
            topic: topic.into(),
            partition,
            offset,
            max_bytes: 1 << 20,
            max_wait_ms: 0,
            ..Default::default()
        };
        let response = client.fetch(req).await?.into_inner();
        if let Some(e) = &response.error {
            bail!("{addr} answered the fetch with {:?}: {}", e.code(), e.message);
        }
        let next = response.batches.last().map(|b| b.base_offset + u64::from(b.record_count));
        // The first batch may start before `offset`: skip what was read.
        let skip = response.batches.first().map_or(0, |b| offset.saturating_sub(b.base_offset)) as usize;
        out.extend(values(&response)?.into_iter().skip(skip));
        match next {
            Some(next) if next > offset && next < response.high_watermark => offset = next,
            _ => return Ok(out),
        }
    }
}

/// The values of every record of a fetch response, in order, as UTF-8.
///
/// # Errors
/// A batch that does not decode, or a value that is not UTF-8.
pub fn values(f: &ferrolog_proto::client::FetchResponse) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for b in &f.batches {
        for r in <ferrolog_proto::client::RecordSet as prost::Message>::decode(b.records.clone())?.records {
            out.push(String::from_utf8(r.value.to_vec())?);
        }
    }
    Ok(out)
}

/// One record `k`=`value` to partition 0 of `topic`, as batch number `seq`
/// of idempotent producer `pid` (KIP-98; `pid` -1: not idempotent).
pub fn batch(topic: &str, pid: i64, seq: i32, value: &str) -> ProduceRequest {
    ProduceRequest {
        topic: topic.into(),
        partition: 0,
        records: vec![record("k", value)],
        producer_id: pid,
        producer_epoch: 0,
        base_sequence: seq,
        ..ProduceRequest::default()
    }
}

/// A new producer id from the broker at `addr`.
///
/// # Errors
/// Transport errors.
pub async fn init_producer_id(addr: SocketAddr) -> anyhow::Result<i64> {
    Ok(connect(addr)
        .await?
        .init_producer_id(ferrolog_proto::client::InitProducerIdRequest {})
        .await?
        .into_inner()
        .producer_id)
}

/// The leader of each partition of `topic` (index = partition), counting
/// only leadership a broker claims for itself: broker `b` leads partition
/// `p` when `b`'s own Metadata answer names `b` (a leader that lost its
/// quorum names nobody). A follower's idea of its leader can be stale; a
/// leader's own claim is not. Brokers that do not answer claim nothing.
///
/// # Errors
/// When no running broker knows `topic`.
pub async fn self_claimed_leaders(c: &Cluster, topic: &str) -> anyhow::Result<Vec<Option<u32>>> {
    let mut leaders: Vec<Option<u32>> = Vec::new();
    let mut known = false;
    for id in (1..=c.size()).filter(|id| c.is_running(*id)) {
        let Ok(m) = metadata(c.broker(id).client_addr).await else { continue };
        let Some(t) = m.topics.iter().find(|t| t.name == topic) else { continue };
        known = true;
        leaders.resize(leaders.len().max(t.partitions.len()), None);
        for p in &t.partitions {
            if p.leader == id {
                leaders[p.partition as usize] = Some(id);
            }
        }
    }
    if !known {
        bail!("no running broker knows topic {topic}");
    }
    Ok(leaders)
}

/// The Raft term of every partition of `topic` (index = partition), as
/// broker `id` sees it (`None` where it does not answer).
///
/// # Errors
/// Transport errors connecting to broker `id`.
pub async fn terms(c: &Cluster, id: u32, topic: &str, partitions: u32) -> anyhow::Result<Vec<Option<u64>>> {
    let mut client = connect(c.broker(id).client_addr).await?;
    let mut out = Vec::with_capacity(partitions as usize);
    for partition in 0..partitions {
        let r = client.partition_status(PartitionStatusRequest { topic: topic.into(), partition }).await;
        out.push(r.ok().map(|r| r.into_inner()).filter(|r| r.error.is_none()).map(|r| r.term));
    }
    Ok(out)
}

/// What a broker's restart cost, from each partition's self-claimed leader
/// before it ([`self_claimed_leaders`]) and its term before and after
/// ([`terms`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestartCost {
    /// Partitions whose term was read both times.
    pub compared: usize,
    /// The sum of the term increases: elections held (won or not).
    pub elections: u64,
    /// Partitions led by another broker than `restarted` whose term rose.
    pub disturbed: usize,
    /// The highest term after.
    pub max_term: u64,
}

/// Compares terms before and after the restart of broker `restarted`.
pub fn restart_cost(
    leaders_before: &[Option<u32>],
    terms_before: &[Option<u64>],
    terms_after: &[Option<u64>],
    restarted: u32,
) -> RestartCost {
    let mut cost = RestartCost::default();
    for (i, (before, after)) in terms_before.iter().zip(terms_after).enumerate() {
        let (Some(before), Some(after)) = (before, after) else { continue };
        cost.compared += 1;
        cost.elections += after.saturating_sub(*before);
        cost.max_term = cost.max_term.max(*after);
        if leaders_before.get(i).copied().flatten() != Some(restarted) && after > before {
            cost.disturbed += 1;
        }
    }
    cost
}

/// A pre-vote for `group` to node `target` on broker `to`, from candidate
/// node `candidate` in `term`, with a log longer than any voter's, sent over
/// the peer protocol as a broker would (a pre-vote changes nothing).
///
/// # Errors
/// Transport errors, or the broker refused the request itself.
pub async fn pre_vote(
    c: &Cluster,
    to: u32,
    group: u64,
    target: u64,
    candidate: u64,
    term: u64,
) -> anyhow::Result<ferrolog_proto::raft::VoteResponse> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", c.broker(to).peer_addr))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await?;
    let req = ferrolog_proto::raft::VoteRequest {
        group_id: group,
        target_node: target,
        vote: Some(ferrolog_proto::raft::Vote { term, node: candidate, committed: false }),
        last_log_id: Some(ferrolog_proto::raft::LogId { term, leader_node: candidate, index: 1 << 40 }),
        leadership_transfer: false,
    };
    let answer = ferrolog_broker::network::peer_client(channel).pre_vote(req).await?.into_inner();
    anyhow::ensure!(answer.error.is_none(), "broker {to} refused the request itself: {:?}", answer.error);
    Ok(answer)
}

/// The Raft node id of `group`'s replica on broker `broker`: a pre-vote to
/// node 0 is refused with the node id the broker hosts.
///
/// # Errors
/// Transport errors, or an answer without a node id.
pub async fn node_on(c: &Cluster, broker: u32, group: u64) -> anyhow::Result<u64> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", c.broker(broker).peer_addr))?
        .connect()
        .await?;
    let probe = ferrolog_proto::raft::VoteRequest { group_id: group, target_node: 0, ..Default::default() };
    let answer = ferrolog_broker::network::peer_client(channel).pre_vote(probe).await?.into_inner();
    let message = answer.error.map(|e| e.message).unwrap_or_default();
    message
        .split("hosted here as node ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| anyhow::anyhow!("no node id in {message:?}"))
}

/// Waits up to 60 s until broker `id`'s replica of every partition of
/// `topic` (`0..partitions`) has at least the high watermark its leader had
/// just before (under a steady load the leader's moves on meanwhile), and
/// that is above 0.
///
/// # Errors
/// A partition without a leader, or one not caught up in time (with the
/// brokers' log tails).
pub async fn caught_up(c: &Cluster, topic: &str, id: u32, partitions: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    for p in 0..partitions {
        loop {
            let l = leader(c, topic, p, Duration::from_secs(30)).await?;
            let want = status(c, l, topic, p).await.map_or(u64::MAX, |s| s.high_watermark);
            let got = status(c, id, topic, p).await.map_or(0, |s| s.high_watermark);
            if got >= want && want > 0 {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "broker {id} partition {p}: high watermark {got}, leader has {want}\n{}",
                c.logs_tail(40)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// How a produce through [`produce_to_leader`] ended.
#[derive(Debug)]
pub enum Sent {
    /// Acknowledged.
    Acked,
    /// `OUT_OF_ORDER_SEQUENCE`: the leader expects an earlier sequence
    /// number than the one after what this producer had acknowledged, so
    /// acknowledged batches are gone from its log (KIP-98). The message.
    OutOfOrder(String),
}

/// Produces one record `value` as batch `seq` of idempotent producer
/// `pid` to `topic`/`partition`, through whichever broker the others name
/// leader, retrying (as an idempotent producer does) until acknowledged or
/// `timeout` passes. Takes the brokers' client addresses (index = id - 1)
/// rather than the [`Cluster`], so that a test can restart brokers
/// meanwhile.
///
/// # Errors
/// A non-retriable error code other than `OUT_OF_ORDER_SEQUENCE`, or the
/// timeout (with the last error seen).
pub async fn produce_to_leader(
    addrs: &[SocketAddr],
    topic: &str,
    (partition, pid, seq): (u32, i64, i32),
    value: &str,
    timeout: Duration,
) -> anyhow::Result<Sent> {
    let req = ProduceRequest {
        topic: topic.into(),
        partition,
        records: vec![record("k", value)],
        producer_id: pid,
        producer_epoch: 0,
        base_sequence: seq,
        ..ProduceRequest::default()
    };
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    while Instant::now() < deadline {
        for addr in addrs {
            let Ok(m) = metadata(*addr).await else { continue };
            let leader = m
                .topics
                .iter()
                .find(|t| t.name == topic)
                .and_then(|t| t.partitions.get(partition as usize))
                .map_or(0, |p| p.leader);
            let Some(to) = (leader as usize).checked_sub(1).and_then(|i| addrs.get(i)) else { continue };
            match produce_once(*to, req.clone()).await {
                Ok(r) if r.error.is_none() => return Ok(Sent::Acked),
                Ok(r) => match code(&r.error) {
                    ErrorCode::OutOfOrderSequence => {
                        return Ok(Sent::OutOfOrder(format!("{value}: {:?}", r.error)));
                    }
                    ErrorCode::NotLeader | ErrorCode::Unavailable | ErrorCode::DuplicateInFlight => {
                        last = format!("{:?}", r.error);
                    }
                    _ => bail!("produce {value}: {:?}", r.error),
                },
                Err(e) => last = format!("{e:#}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{value} not acknowledged within {timeout:?}: {last}")
}

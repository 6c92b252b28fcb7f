//! A steady produce load for tests of operations under traffic (rolling
//! restarts, reassignments): one idempotent producer per partition sending
//! `<partition>-<seq>` one record at a time, and the read-back check that
//! every acknowledged record is there exactly once, in order, at the
//! offset it was acknowledged with.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferrolog_proto::client::{ErrorCode, FetchRequest};
use tokio::sync::Mutex;

use crate::raw::{batch, code, leader, values};
use crate::{Cluster, connect};

/// What one partition's producer saw: acknowledged sequence numbers with
/// their offsets, and when each acknowledgement came.
#[derive(Debug, Default)]
pub struct Acks {
    /// Sequence number → offset it was acknowledged at.
    pub offsets: BTreeMap<i32, u64>,
    /// When each acknowledgement arrived.
    pub at: Vec<Instant>,
}

/// Produces `p-<seq>` to partition `p` of `topic` with idempotent producer
/// `pid`, one record at a time, trying the brokers at `addrs` in turn until
/// one acknowledges, until `stop`. Retriable refusals (not leader,
/// unavailable, a duplicate in flight, unknown topic while metadata
/// spreads) and transport errors move on to the next broker; any other
/// refusal panics (the test fails).
pub async fn produce_loop(
    addrs: Vec<SocketAddr>,
    topic: String,
    p: u32,
    pid: i64,
    stop: Arc<AtomicBool>,
    acks: Arc<Mutex<Acks>>,
) {
    let mut to = 0usize;
    let mut seq = 0i32;
    let mut clients = BTreeMap::new();
    while !stop.load(Ordering::Relaxed) {
        let mut req = batch(&topic, pid, seq, &format!("{p}-{seq}"));
        req.partition = p;
        let addr = addrs[to % addrs.len()];
        if !clients.contains_key(&addr)
            && let Ok(c) = connect(addr).await
        {
            clients.insert(addr, c);
        }
        let answer = match clients.get_mut(&addr) {
            Some(c) => c.produce(req).await.map(tonic::Response::into_inner).map_err(|e| e.to_string()),
            None => Err("connect".into()),
        };
        match answer {
            Ok(r) if r.error.is_none() => {
                let mut a = acks.lock().await;
                a.offsets.insert(seq, r.base_offset);
                a.at.push(Instant::now());
                seq += 1;
            }
            Ok(r)
                if matches!(
                    code(&r.error),
                    ErrorCode::NotLeader
                        | ErrorCode::Unavailable
                        | ErrorCode::DuplicateInFlight
                        | ErrorCode::UnknownTopic
                ) =>
            {
                to += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok(r) => panic!("partition {p}: produce refused: {:?}", r.error),
            Err(_) => {
                clients.remove(&addr);
                to += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

/// Every committed value of partition `p` of `topic`, read from its
/// leader from offset 0 up to the high watermark.
///
/// # Errors
/// No leader within 30 s, transport errors, a refused fetch.
pub async fn read_partition(c: &Cluster, topic: &str, p: u32) -> anyhow::Result<Vec<String>> {
    let l = leader(c, topic, p, Duration::from_secs(30)).await?;
    let mut client = connect(c.broker(l).client_addr).await?;
    let mut read = Vec::new();
    loop {
        let f = client
            .fetch(FetchRequest {
                topic: topic.into(),
                partition: p,
                offset: read.len() as u64,
                max_bytes: 1 << 20,
                max_wait_ms: 0,
                ..Default::default()
            })
            .await?
            .into_inner();
        anyhow::ensure!(f.error.is_none(), "fetch partition {p}: {:?}", f.error);
        let v = values(&f)?;
        let done = v.is_empty() || read.len() as u64 + v.len() as u64 >= f.high_watermark;
        read.extend(v);
        if done {
            return Ok(read);
        }
    }
}

/// Checks that partition `p` of `topic` holds exactly `p-0, p-1, …` in
/// order (nothing lost, duplicated or reordered), and every sequence
/// number in `acks` at the offset it was acknowledged with. Returns how
/// many acknowledged records it checked.
///
/// # Errors
/// As [`read_partition`]; a mismatch.
pub async fn check_partition(c: &Cluster, topic: &str, p: u32, acks: &Acks) -> anyhow::Result<usize> {
    let read = read_partition(c, topic, p).await?;
    let expected: Vec<String> = (0..read.len()).map(|i| format!("{p}-{i}")).collect();
    anyhow::ensure!(read == expected, "partition {p}: records lost, duplicated or out of order: {read:?}");
    for (seq, offset) in &acks.offsets {
        anyhow::ensure!(
            read.get(*offset as usize) == Some(&format!("{p}-{seq}")),
            "partition {p}: acknowledged {seq} at offset {offset} is not there"
        );
    }
    Ok(acks.offsets.len())
}

//! Cooperative rebalancing of a consumer group (issue 13, KIP-429), with
//! the client library's group consumer against 3 broker processes: when a
//! second member joins a group whose first member owns all six partitions,
//! the first keeps three throughout (never revoked, never re-assigned),
//! gives up the other three, and only then does the second get them; at no
//! moment do the two own a partition at once (a ledger both members'
//! rebalance listeners write to).

use std::collections::BTreeMap;
use std::fs;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrolog_client::assignor::Assignor;
use ferrolog_client::{
    AutoOffsetReset, ClientConfig, GroupConsumer, GroupConsumerConfig, MetadataCache, RebalanceEvent,
};
use ferrolog_proto::client::ProduceRequest;
use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{create_topic, produce, record};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const CONFIG: &str = "[groups]\nmin_session_timeout_ms = 500\ninitial_rebalance_delay_ms = 100\noffsets_topic_num_partitions = 2\n";

type Tp = (String, u32);

#[derive(Default)]
struct Ledger {
    owner: BTreeMap<Tp, &'static str>,
    violations: Vec<String>,
    events: Vec<(&'static str, RebalanceEvent)>,
}

fn member(meta: Arc<MetadataCache>, name: &'static str, ledger: Arc<Mutex<Ledger>>) -> GroupConsumer {
    let mut config = GroupConsumerConfig::new("coop");
    config.client_id = name.into();
    config.assignors = vec![Assignor::CooperativeSticky];
    config.session_timeout_ms = 3_000;
    config.heartbeat_interval_ms = 300;
    config.auto_commit_interval_ms = 200;
    config.auto_offset_reset = AutoOffsetReset::Earliest;
    let mut c = GroupConsumer::new(meta, config, &["c"]).expect("a group consumer");
    c.on_rebalance(move |e| {
        let mut l = ledger.lock().expect("ledger");
        match e {
            RebalanceEvent::Assigned { partitions, .. } => {
                for tp in partitions {
                    if let Some(other) = l.owner.insert(tp.clone(), name)
                        && other != name
                    {
                        l.violations.push(format!("{tp:?} given to {name} while {other} owned it"));
                    }
                }
            }
            RebalanceEvent::Revoked { partitions, .. } | RebalanceEvent::Lost { partitions, .. } => {
                for tp in partitions {
                    if l.owner.get(tp) == Some(&name) {
                        l.owner.remove(tp);
                    }
                }
            }
            RebalanceEvent::CommitRefused { .. } => {}
        }
        l.events.push((name, e.clone()));
    });
    c
}

fn owned_by(l: &Ledger, name: &str) -> Vec<Tp> {
    l.owner.iter().filter(|(_, o)| **o == name).map(|(tp, _)| tp.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_member_takes_over_only_what_moves_and_never_while_it_is_owned() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    fs::write(&config, CONFIG)?;
    let c = Cluster::start("cooperative", BIN, 3, &[("FERROLOG_CONFIG", &config.to_string_lossy())]).await?;
    create_topic(&c, "c", 6, 3).await?;
    for p in 0..6 {
        let req = ProduceRequest {
            topic: "c".into(),
            partition: p,
            records: vec![record("k", &format!("{p}"))],
            producer_id: -1,
            ..ProduceRequest::default()
        };
        produce(&c, req, Duration::from_secs(30)).await?;
    }
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let run = |mut m: GroupConsumer| {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut read = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                read += m.poll(Duration::from_millis(200)).await?.len();
            }
            m.close().await?;
            Ok::<usize, ferrolog_client::Error>(read)
        })
    };
    let a = run(member(meta.clone(), "a", ledger.clone()));
    let wait_until = async |what: &str, ok: &dyn Fn(&Ledger) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            {
                let l = ledger.lock().expect("ledger");
                if ok(&l) {
                    return Ok(());
                }
                if Instant::now() > deadline {
                    anyhow::bail!("{what} did not happen: {:?}\n{}", l.events, c.logs_tail(20));
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    wait_until("a owning all six", &|l| owned_by(l, "a").len() == 6).await?;
    let b = run(member(meta.clone(), "b", ledger.clone()));
    wait_until("a and b owning three each", &|l| owned_by(l, "a").len() == 3 && owned_by(l, "b").len() == 3)
        .await?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let read_a = a.await??;
    b.await??;
    let l = ledger.lock().expect("ledger");
    assert!(l.violations.is_empty(), "{:?}", l.violations);
    assert!(read_a >= 6, "a read {read_a} records");
    // a was assigned once and revoked once: the three that moved.
    let a_events: Vec<&RebalanceEvent> = l.events.iter().filter(|(n, _)| *n == "a").map(|(_, e)| e).collect();
    let assigned = a_events.iter().filter(|e| matches!(e, RebalanceEvent::Assigned { .. })).count();
    let revoked: Vec<Tp> = a_events
        .iter()
        .filter_map(|e| match e {
            RebalanceEvent::Revoked { partitions, .. } => Some(partitions.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    let b_first = l.events.iter().find(|(n, _)| *n == "b").map(|(_, e)| e.clone());
    assert_eq!(assigned, 1, "{a_events:?}");
    assert_eq!(revoked.len(), 3, "{a_events:?}");
    assert!(
        matches!(&b_first, Some(RebalanceEvent::Assigned { partitions, .. }) if partitions.iter().all(|p| revoked.contains(p))),
        "b got what a gave up: {b_first:?} vs {revoked:?}"
    );
    Ok(())
}

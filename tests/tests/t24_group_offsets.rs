//! Committed offsets of consumer groups (issue 13), on 3 broker processes:
//! kept in `__consumer_offsets` (created on the first group call), served
//! by the leader of the group's partition of it, never moved back by
//! accident, refused from a member the group does not have, not carried
//! into a re-created topic, and still there after the coordinator's broker
//! is SIGKILLed (the next leader reads them back from the log).

use std::collections::BTreeMap;
use std::fs;
use std::time::{Duration, Instant};

use ferrolog_client::error::ErrorCode;
use ferrolog_client::group::OffsetToCommit;
use ferrolog_client::{
    AutoOffsetReset, ClientConfig, GroupConsumer, GroupConsumerConfig, Groups, MetadataCache, RebalanceEvent,
};
use ferrolog_proto::client::{
    DeleteTopicRequest, OffsetCommitPartition, OffsetCommitRequest, ProduceRequest,
};
use ferrolog_tests::raw::{code, create_topic, produce, produce_once, record};
use ferrolog_tests::{Cluster, connect};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const CONFIG: &str =
    "[groups]\noffsets_topic_num_partitions = 4\noffsets_retention_check_interval_ms = 500\n";

fn at(topic: &str, partition: u32, offset: u64) -> OffsetToCommit {
    OffsetToCommit {
        topic: topic.into(),
        partition,
        offset,
        metadata: format!("at {offset}"),
        topic_id: None,
    }
}

/// `group`'s committed offsets as (topic, partition) → offset.
async fn committed(groups: &Groups, group: &str) -> anyhow::Result<BTreeMap<(String, u32), u64>> {
    Ok(groups
        .committed(group, &[])
        .await?
        .into_iter()
        .filter_map(|c| c.offset.map(|o| ((c.topic, c.partition), o)))
        .collect())
}

fn wire_code(e: &ferrolog_client::Error) -> Option<ErrorCode> {
    e.code()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn offsets_are_committed_checked_kept_across_a_coordinator_kill_and_never_carried_into_a_new_topic()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    fs::write(&config, CONFIG)?;
    let mut c =
        Cluster::start("group-offsets", BIN, 3, &[("FERROLOG_CONFIG", &config.to_string_lossy())]).await?;
    create_topic(&c, "orders", 3, 3).await?;
    for p in 0..3 {
        for i in 0..10 {
            let req = ProduceRequest {
                topic: "orders".into(),
                partition: p,
                records: vec![record("k", &format!("{p}-{i}"))],
                producer_id: -1,
                ..ProduceRequest::default()
            };
            produce(&c, req, Duration::from_secs(30)).await?;
        }
    }
    let meta = MetadataCache::new(ClientConfig::from_list(&c.bootstrap()))?;
    let groups = Groups::new(meta).with_timeout(Duration::from_secs(60));

    // The first group call creates __consumer_offsets; the commit is then taken.
    let results =
        groups.commit("g", &[at("orders", 0, 5), at("orders", 1, 7), at("orders", 2, 0)], false).await?;
    for (o, r) in &results {
        assert!(r.is_ok(), "{o:?}: {r:?}");
    }
    let want: BTreeMap<(String, u32), u64> =
        [(("orders".to_string(), 0), 5), (("orders".to_string(), 1), 7), (("orders".to_string(), 2), 0)]
            .into();
    assert_eq!(committed(&groups, "g").await?, want);
    let described = groups.describe("g").await?;
    assert_eq!(described.state, "Empty");
    assert_eq!(described.offsets.len(), 3);
    assert!(described.offsets.iter().any(|o| o.metadata == "at 7"), "{described:?}");

    // auto.offset.reset = none: a member given partitions of which one
    // has no committed offset takes none of them, and reports no loss of
    // partitions it was never given (orders/0 has an offset in "half",
    // orders/1 and /2 do not; the member gets all three).
    assert!(groups.commit("half", &[at("orders", 0, 5)], false).await?[0].1.is_ok());
    let mut config = GroupConsumerConfig::new("half");
    config.auto_offset_reset = AutoOffsetReset::None;
    let mut member = GroupConsumer::new(groups.metadata().clone(), config, &["orders"])?;
    // (A coordinator still loading may refuse a join first: tried again.)
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let e = member.poll(Duration::from_secs(5)).await.expect_err("no committed offset under reset none");
        if e.to_string().contains("no committed offset") {
            // orders/1, not /0: partitions are taken in order, so orders/0's
            // committed offset was found first (the case the check is for).
            assert!(e.to_string().contains("orders/1"), "{e}");
            break;
        }
        assert!(Instant::now() < deadline, "never refused for the missing offset: {e}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(member.assignment().is_empty(), "{:?}", member.assignment());
    let events = member.take_events();
    assert!(
        !events.iter().any(|e| matches!(e, RebalanceEvent::Lost { .. } | RebalanceEvent::Assigned { .. })),
        "{events:?}"
    );
    member.close().await?;

    // A commit that goes back is refused for that partition only; the
    // others of the same request are committed; with allow_backwards it is taken.
    let results =
        groups.commit("g", &[at("orders", 0, 3), at("orders", 1, 8), at("nope", 0, 1)], false).await?;
    let codes: Vec<Option<ErrorCode>> =
        results.iter().map(|(_, r)| r.as_ref().err().and_then(wire_code)).collect();
    assert_eq!(codes, [Some(ErrorCode::OffsetCommitBackwards), None, Some(ErrorCode::UnknownTopic)]);
    let now = committed(&groups, "g").await?;
    assert_eq!((now[&("orders".into(), 0)], now[&("orders".into(), 1)]), (5, 8));
    let results = groups.commit("g", &[at("orders", 0, 2)], true).await?;
    assert!(results[0].1.is_ok(), "{results:?}");
    assert_eq!(committed(&groups, "g").await?[&("orders".into(), 0)], 2);

    // A commit from a member the group does not have is refused whole.
    let coordinator = groups.find_coordinator("g").await?;
    let mut raw = connect(c.broker(coordinator.broker).client_addr).await?;
    let member_commit = OffsetCommitRequest {
        group_id: "g".into(),
        generation_id: 3,
        member_id: "m-1".into(),
        offsets: vec![OffsetCommitPartition {
            topic: "orders".into(),
            partition: 0,
            offset: 9,
            metadata: String::new(),
            ..Default::default()
        }],
        allow_backwards: false,
        ..Default::default()
    };
    let r = raw.offset_commit(member_commit.clone()).await?.into_inner();
    assert_eq!(code(&r.error), ErrorCode::UnknownMemberId, "{r:?}");
    // A broker that is not the coordinator says so, and names it once it
    // knows it (its replica heard from the leader, or the leader's pings
    // listed the partition: within a heartbeat or two).
    let other = (1..=3).find(|b| *b != coordinator.broker).expect("another broker");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = connect(c.broker(other).client_addr)
            .await?
            .offset_commit(member_commit.clone())
            .await?
            .into_inner();
        assert_eq!(code(&r.error), ErrorCode::NotCoordinator, "{r:?}");
        match r.error.and_then(|e| e.leader).map(|l| l.broker_id) {
            Some(named) => {
                assert_eq!(named, coordinator.broker, "broker {other} named another coordinator");
                break;
            }
            None => {
                assert!(Instant::now() < deadline, "broker {other} never named the coordinator");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    // The internal topic takes no produce and no delete from clients.
    let r = produce_once(
        c.broker(1).client_addr,
        ProduceRequest {
            topic: "__consumer_offsets".into(),
            records: vec![record("k", "v")],
            producer_id: -1,
            ..Default::default()
        },
    )
    .await?;
    assert_eq!(code(&r.error), ErrorCode::InternalTopic, "{r:?}");
    let r = connect(c.broker(1).client_addr)
        .await?
        .delete_topic(DeleteTopicRequest { name: "__consumer_offsets".into() })
        .await?
        .into_inner();
    assert_eq!(code(&r.error), ErrorCode::InvalidRequest, "{r:?}");

    // SIGKILL the coordinator's broker: another replica of its partition
    // leads, reads the partition back and answers the same offsets.
    let before = committed(&groups, "g").await?;
    assert_eq!(before.len(), 3);
    // Looked up again: leadership may have moved since (leader balancing).
    let coordinator = groups.find_coordinator("g").await?;
    c.kill(coordinator.broker);
    let after = committed(&groups, "g").await?;
    assert_eq!(after, before, "offsets after the coordinator's broker was killed");
    let moved = groups.find_coordinator("g").await?;
    assert_ne!(moved.broker, coordinator.broker, "the coordinator moved");
    // And it takes commits, checked against what it read back.
    let results = groups.commit("g", &[at("orders", 1, 4)], false).await?;
    assert_eq!(results[0].1.as_ref().err().and_then(wire_code), Some(ErrorCode::OffsetCommitBackwards));
    c.spawn(coordinator.broker)?;

    // Deleted and re-created: the old incarnation's offsets are not answered,
    // and a commit for the old incarnation (by its topic id) is refused.
    let old_id = groups.metadata().refresh().await?.topics["orders"].topic_id.expect("a topic id");
    // Forwarded to the controller, which may be the broker just started
    // again and not listening yet: UNAVAILABLE is retried.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = connect(c.broker(moved.broker).client_addr)
            .await?
            .delete_topic(DeleteTopicRequest { name: "orders".into() })
            .await?
            .into_inner();
        match &r.error {
            None => break,
            Some(_) if code(&r.error) == ErrorCode::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Some(_) => panic!("{r:?}"),
        }
    }
    create_topic(&c, "orders", 3, 3).await?;
    assert_eq!(committed(&groups, "g").await?, BTreeMap::new(), "offsets carried into the new topic");
    let fresh = groups.committed("g", &[("orders".into(), 1)]).await?;
    assert_eq!(fresh[0].offset, None);
    // Nor do they hold the new incarnation's commits back.
    assert!(groups.commit("g", &[at("orders", 1, 0)], false).await?[0].1.is_ok());
    let stale = OffsetToCommit { topic_id: Some(old_id), ..at("orders", 1, 5) };
    let r = groups.commit("g", &[stale], false).await?;
    assert_eq!(r[0].1.as_ref().err().and_then(wire_code), Some(ErrorCode::UnknownTopicId), "{r:?}");
    assert_eq!(committed(&groups, "g").await?[&("orders".into(), 1)], 0);

    // A group whose only offsets are of a topic that is then deleted loses
    // them (the coordinator's expiry removes offsets of deleted topics), and
    // with them the group.
    create_topic(&c, "brief", 1, 3).await?;
    assert!(groups.commit("once", &[at("brief", 0, 0)], false).await?[0].1.is_ok());
    assert!(groups.describe("once").await.is_ok());
    let r = connect(c.broker(1).client_addr)
        .await?
        .delete_topic(DeleteTopicRequest { name: "brief".into() })
        .await?
        .into_inner();
    assert!(r.error.is_none(), "{r:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match groups.describe("once").await {
            Err(e) if wire_code(&e) == Some(ErrorCode::GroupIdNotFound) => break,
            other => {
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "the deleted topic's offsets stayed: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    // Listed on its coordinator; deleted with its offsets.
    let (listed, missing) = groups.list().await?;
    assert!(missing.is_empty(), "{missing:?}");
    assert!(listed.iter().any(|g| g.group == "g" && g.state == "Empty"), "{listed:?}");
    groups.delete("g").await?;
    let e = groups.describe("g").await.unwrap_err();
    assert_eq!(wire_code(&e), Some(ErrorCode::GroupIdNotFound), "{e}");
    let e = groups.delete("g").await.unwrap_err();
    assert_eq!(wire_code(&e), Some(ErrorCode::GroupIdNotFound), "{e}");
    Ok(())
}

//! A broker embedded in a process: started on listeners the caller bound
//! (port 0, advertised with the port it got), serving records, and stopped
//! by the shutdown signal it was given, its background loops ended.

use std::time::Duration;

use ferrolog_broker::config::BrokerConfig;
use ferrolog_broker::server::{Broker, Listeners};
use ferrolog_proto::client::ferrolog_client::FerrologClient;
use ferrolog_proto::client::{CreateTopicRequest, FetchRequest, ProduceRequest, Record};
use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_broker_serves_on_its_listeners_and_stops_on_its_signal() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let peer = TcpListener::bind("127.0.0.1:0").await?;
    let client = TcpListener::bind("127.0.0.1:0").await?;
    let kafka = TcpListener::bind("127.0.0.1:0").await?;
    let kafka_addr = kafka.local_addr()?;
    let peer_addr = peer.local_addr()?;
    let client_addr = client.local_addr()?;
    let config = BrokerConfig {
        node_id: 1,
        client_addr: "127.0.0.1:0".parse()?,
        peer_addr: "127.0.0.1:0".parse()?,
        kafka_addr: "127.0.0.1:0".parse()?,
        data_dir: dir.path().to_owned(),
        initial_cluster: [(1, peer_addr)].into(),
        ..BrokerConfig::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        let _ = stopped.await;
    };
    let broker = Broker::start(
        config,
        Listeners { peer: peer.into(), client: client.into(), kafka: Some(kafka.into()), network: None },
        signal,
    )
    .await?;
    assert_eq!(broker.config().peer_addr, peer_addr, "port 0 is advertised as the port it got");
    assert_eq!(broker.config().client_addr, client_addr);
    assert_eq!(broker.config().kafka_addr, kafka_addr);
    let serving = tokio::spawn(broker.serve());

    let mut api = FerrologClient::connect(format!("http://{client_addr}")).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let create = CreateTopicRequest {
        name: "embedded".into(),
        partitions: 1,
        replication_factor: 1,
        ..Default::default()
    };
    while api.create_topic(create.clone()).await?.into_inner().error.is_some() {
        assert!(tokio::time::Instant::now() < deadline, "the topic was never created");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let produce = ProduceRequest {
        topic: "embedded".into(),
        partition: 0,
        records: vec![Record { value: b"one".to_vec().into(), ..Default::default() }],
        producer_id: -1,
        ..Default::default()
    };
    let base = loop {
        let r = api.produce(produce.clone()).await?.into_inner();
        if r.error.is_none() {
            break r.base_offset;
        }
        assert!(tokio::time::Instant::now() < deadline, "never produced: {:?}", r.error);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(base, 0);
    let fetched = api
        .fetch(FetchRequest {
            topic: "embedded".into(),
            partition: 0,
            offset: 0,
            max_bytes: 1 << 20,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(fetched.high_watermark, 1);

    stop.send(()).expect("the broker waits for its signal");
    tokio::time::timeout(Duration::from_secs(15), serving).await??;
    assert!(
        TcpListener::bind(client_addr).await.is_ok(),
        "the client port is still held after the broker stopped"
    );
    Ok(())
}

//! Broker wiring: opens the data directory, starts the metadata group, the
//! image follower, the partition reconciler and liveness pings, and serves
//! the peer and client gRPC APIs until shut down.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferrolog_raft_store::meta_db::MetaDb;
use ferrolog_raft_store::vfs::{Fs, Vfs};
use ferrolog_raft_store::{Flusher, Replica, create_dir_durable};
use ferrolog_replica::{NodeId, RaftNode, Settings, ValidSettings};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::config::BrokerConfig;
use crate::control::liveness::Liveness;
use crate::groups::{GroupRegistry, HostedGroup};
use crate::grpc::ClientService;
use crate::identity;
use crate::listener::Listener;
use crate::metadata::METADATA_GROUP;
use crate::metadata::command::ControllerRequest;
use crate::metadata::controller::{self, Controller};
use crate::metadata::hosted::HostedMetadata;
use crate::metadata::image::MetadataImage;
use crate::network::memory::MemoryNetwork;
use crate::network::{PeerAddresses, RaftPeerServer};
use crate::partition::records::batch_encoded_bytes_max;
use crate::partitions::{Failures, Reconciler};

/// Entries per AppendEntries request; with `max_batch_bytes` it bounds the
/// largest message a peer may send (see [`peer_message_bytes_max`]).
pub const MAX_PAYLOAD_ENTRIES: u64 = 64;

/// Largest message accepted on the peer port, bytes: a full AppendEntries
/// of [`MAX_PAYLOAD_ENTRIES`] of the largest batches the client port
/// accepts ([`batch_encoded_bytes_max`]) with their frames, plus framing.
pub fn peer_message_bytes_max(max_batch_bytes: usize) -> usize {
    (MAX_PAYLOAD_ENTRIES as usize).saturating_mul(batch_encoded_bytes_max(max_batch_bytes) + (64 << 10))
        + (1 << 20)
}

/// How long a broker's shutdown waits for its replicas to stop.
const STOP_REPLICAS_WITHIN: Duration = Duration::from_secs(6);

/// How long a broker's whole shutdown may take (replicas, the metadata
/// group, then the servers' requests in flight), give or take 1 s.
const STOP_WITHIN: Duration = Duration::from_secs(8);

/// Connections the peer listener accepts at once (brokers use one each,
/// plus short-lived ones while joining).
const PEER_CONNECTIONS_MAX: usize = 4096;

/// How long a broker's shutdown waits for its background loops to end.
const STOP_TASKS_WITHIN: Duration = Duration::from_secs(1);

/// A running broker.
pub struct Broker {
    config: BrokerConfig,
    stop: Vec<oneshot::Sender<()>>,
    servers: Vec<JoinHandle<()>>,
    /// The background loops; each ends at its next await once `stopping`
    /// says so.
    tasks: Vec<JoinHandle<()>>,
    stopping: watch::Sender<bool>,
    /// Resolves when the broker is asked to stop ([`Broker::serve`]).
    shutdown: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    /// Resolves when the broker is asked to stop at once (a second signal):
    /// it cuts the controlled shutdown short ([`Broker::with_hurry`]).
    hurry: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    metadata: HostedMetadata,
    reconciler: Reconciler,
    hand_over: crate::control::handover::HandOver,
    /// This start's boot id, as the broker's pings answer it.
    boot_id: u64,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").field("config", &self.config).finish_non_exhaustive()
    }
}

/// A broker's bound sockets: bound first (by [`Listeners::bind`] or by the
/// caller, e.g. on port 0), then handed to [`Broker::start`].
#[derive(Debug)]
pub struct Listeners {
    /// The peer port (Raft and controller traffic between brokers).
    pub peer: Listener,
    /// The client port (the client API).
    pub client: Listener,
    /// The Kafka listener's port, when `kafka.enabled`.
    pub kafka: Option<Listener>,
    /// The in-memory network the listeners are on, which the broker then
    /// also dials its peers through (as the node of its peer address);
    /// `None`: the operating system's TCP.
    pub network: Option<MemoryNetwork>,
}

impl Listeners {
    /// Binds the configured peer and client addresses.
    ///
    /// # Errors
    /// An address in use or not available, naming it and its setting.
    pub async fn bind(config: &BrokerConfig) -> anyhow::Result<Self> {
        Ok(Self {
            peer: bind(config.peer_addr, "peer_addr").await?.into(),
            client: bind(config.client_addr, "client_addr").await?.into(),
            kafka: match config.kafka.enabled {
                true => Some(bind(config.kafka_addr, "kafka_addr").await?.into()),
                false => None,
            },
            network: None,
        })
    }
}

/// The Raft settings of every group on a broker.
///
/// # Errors
/// Inconsistent timings (see [`Settings::validate`]).
pub fn raft_settings(c: &BrokerConfig) -> anyhow::Result<ValidSettings> {
    let r = &c.raft;
    let settings = Settings {
        heartbeat_interval_ms: r.heartbeat_interval_ms,
        election_timeout_min_ms: r.election_timeout_min_ms,
        election_timeout_max_ms: r.election_timeout_max_ms,
        snapshot_after_entries: Some(r.snapshot_after_entries),
        max_payload_entries: MAX_PAYLOAD_ENTRIES,
    };
    Ok(settings.validate()?)
}

/// Fails, naming the directory, unless a file can be written and fsynced
/// in the data directory: a read-only or failing disk is refused at start
/// with its path rather than met later by the first write.
fn check_writable(fs: &dyn Vfs, dir: &std::path::Path) -> anyhow::Result<()> {
    crate::control::writable::write(fs, dir, 0)
        .with_context(|| format!("data directory {} is not writable", dir.display()))
}

/// Serves `router` on `listener` (see [`crate::listener::incoming`]) in a
/// task, until the returned sender fires or is dropped.
fn serve(
    router: tonic::transport::server::Router,
    listener: Listener,
    max_connections: usize,
    what: &'static str,
    yield_every: Option<usize>,
) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let incoming = crate::listener::incoming(listener, max_connections, what, yield_every);
        let stopped = async {
            let _ = rx.await;
        };
        if let Err(e) = router.serve_with_incoming_shutdown(incoming, stopped).await {
            tracing::error!(server = what, "{e}");
        }
    });
    (tx, task)
}

async fn bind(addr: std::net::SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} ({what})"))
}

impl Broker {
    /// Starts a broker from a validated config on `listeners`; it runs
    /// until `shutdown` resolves (see [`Broker::serve`]). A listener bound
    /// to port 0 is advertised with the port it got. Its data directory is
    /// on the operating system's file system.
    ///
    /// # Errors
    /// An unusable data directory, a failure to open storage, a founding
    /// member that cannot be reached while deciding how to enter.
    pub async fn start(
        config: BrokerConfig,
        listeners: Listeners,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<Self> {
        Self::start_on(ferrolog_raft_store::vfs::real(), config, listeners, shutdown).await
    }

    /// As [`Broker::start`], with the data directory on `fs`: the file
    /// system the store's seam gives (issue 15), e.g. an in-memory disk
    /// that keeps only what fsync covered. Every file the broker and its
    /// replicas read and write goes through it, snapshot transfers between
    /// brokers included.
    ///
    /// # Errors
    /// As [`Broker::start`].
    pub async fn start_on(
        fs: Fs,
        mut config: BrokerConfig,
        listeners: Listeners,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<Self> {
        let Listeners { peer: peer_listener, client: client_listener, kafka: kafka_listener, network } =
            listeners;
        if config.peer_addr.port() == 0 {
            config.peer_addr = peer_listener.local_addr()?;
        }
        if config.client_addr.port() == 0 {
            config.client_addr = client_listener.local_addr()?;
        }
        if let Some(l) = &kafka_listener
            && config.kafka_addr.port() == 0
        {
            config.kafka_addr = l.local_addr()?;
        }
        config.kafka.enabled = kafka_listener.is_some();
        let (stopping, _) = watch::channel(false);
        crate::inject::announce();
        crate::control::files::raise_limit();
        // The broker's top directories are fsynced into their parents (as
        // a replica's own are when it is made): a directory made with a
        // plain mkdir can vanish in a power cut with every fsynced file
        // under it (caught with the power-loss disk of
        // tests/src/fuse_disk.rs).
        create_dir_durable(&*fs, &config.data_dir)
            .with_context(|| format!("creating data directory {}", config.data_dir.display()))?;
        check_writable(&*fs, &config.data_dir)?;
        let peers = PeerAddresses::new(
            config.peer_routes.iter().map(|(peer, via)| (*peer, *via)),
            Duration::from_millis(config.raft.election_timeout_min_ms),
        )
        .with_reassignment_throttle(config.reassignment.replication_throttled_rate)
        .with_network(network, config.peer_addr);
        // A broker joining a running cluster learns its id first.
        enter_by_join(&*fs, &mut config, &peers).await?;
        let me = config.node_id;
        let raft_settings = raft_settings(&config)?;
        let flusher =
            Flusher::spawn_on(&format!("broker-{me}"), fs.clone()).context("starting the flusher")?;
        let groups = GroupRegistry::default();

        // Peer API first: the metadata group needs to reach the others.
        // What the pings say of other brokers: elections here, and the
        // peer service's answer to pre-votes.
        let liveness = Liveness::default();
        let peer_server = RaftPeerServer::new(me, groups.clone())
            .with_message_bytes_max(peer_message_bytes_max(config.limits.max_batch_bytes))
            .with_liveness(liveness.clone());
        let controller_slot = peer_server.controller_slot();
        let boot_id = peer_server.boot_id();
        let mut stop = Vec::new();
        let mut servers = Vec::new();
        // One HTTP/2 connection carries every group's RPCs between two
        // brokers, and a peer cancels (resets) a stream whenever a Raft RPC
        // times out. h2's guard against "rapid reset" floods (CVE-2023-44487)
        // closes a connection after 20 streams were reset before the server
        // accepted them: under an election storm that killed every in-flight
        // RPC of the pair at once, which timed out more RPCs, and so on.
        // Peers are brokers of the cluster, so the guard is raised here (the
        // client listener keeps the default).
        let router = tonic::transport::Server::builder()
            .http2_max_pending_accept_reset_streams(Some(crate::network::PEER_RESETS_MAX))
            .http2_max_local_error_reset_streams(Some(crate::network::PEER_RESETS_MAX))
            .add_service(peer_server.into_service());
        let (tx, server) = serve(router, peer_listener, PEER_CONNECTIONS_MAX, "peer", None);
        stop.push(tx);
        servers.push(server);

        // The metadata group. A new data directory asks the founding members
        // how to enter (`how_to_enter`): found the group, run as a founding
        // member that never ran, or rejoin a wiped broker under new node ids.
        let identity = match identity::load(&*fs, &config.data_dir, me)? {
            Some(id) if id.join_pending() => anyhow::bail!(
                "{} holds an unfinished join: start the broker again with --join",
                config.data_dir.display()
            ),
            Some(id) => id,
            None => {
                anyhow::ensure!(
                    !config.initial_cluster.is_empty(),
                    "{} is a new data directory: give --initial-cluster (the founding brokers' peer addresses)",
                    config.data_dir.display()
                );
                let mut id = identity::fresh(me);
                match how_to_enter(&config, id.incarnation, &peers).await {
                    Entry::Found => id.founder = true,
                    Entry::Pristine => {
                        tracing::info!("joining the formed metadata group as a founding member")
                    }
                    Entry::Wiped => {
                        id.metadata_node = join(&config, id.incarnation, &peers).await?;
                        tracing::info!(metadata_node = id.metadata_node, "rejoined under a new node id");
                    }
                }
                // Only now does the directory get its identity: a crash
                // before this point decides again.
                identity::store(&*fs, &config.data_dir, &id)?;
                id
            }
        };
        let meta_dir = config.data_dir.join("metadata");
        let staging_dir = meta_dir.join("staging");
        create_dir_durable(&*fs, &staging_dir)?;
        ferrolog_replica::snapshot::clear_staging(&*fs, &staging_dir)?;
        // The metadata log is always fsynced before it acknowledges, whatever
        // storage.flush says: its writes are rare, and it must never need
        // the unclean recovery of ferrolog_replica::recovery.
        let meta_storage = ferrolog_raft_store::StoreConfig {
            flush: ferrolog_raft_store::FlushPolicy::Always,
            ..config.storage.clone()
        };
        let meta_replica = Replica::open(&meta_dir.join("replica"), meta_storage.clone(), flusher.clone())
            .context("opening the metadata log")?;
        // Every broker answers Metadata from its own applied image: a
        // commit index it learns late would hide a created topic there.
        let meta_settings = raft_settings.clone().with_commit_notice_hold(Duration::ZERO);
        let metadata = RaftNode::start(
            METADATA_GROUP,
            identity.metadata_node,
            &meta_settings,
            &meta_replica,
            peers.clone(),
        )
        .await
        .context("starting the metadata group")?;
        groups.insert(
            METADATA_GROUP,
            HostedGroup {
                node_id: identity.metadata_node,
                raft: metadata.clone(),
                replica: meta_replica.clone(),
                staging_dir: staging_dir.clone(),
                partition: None,
            },
        );
        metadata.hold_if_recovering(identity.metadata_node);
        if identity.founder && !metadata.is_initialized().await? {
            let members: BTreeMap<NodeId, String> = config
                .initial_cluster
                .iter()
                .map(|(id, addr)| (NodeId::from(*id), addr.to_string()))
                .collect();
            if let Err(e) = metadata.initialize(members).await {
                tracing::debug!("metadata initialize: {e}");
            }
            tracing::info!(members = ?config.initial_cluster, "founded the metadata group");
        }

        let hosted_metadata =
            HostedMetadata::new(identity.metadata_node, metadata.clone(), meta_replica.clone());
        let (image_tx, image_rx) = watch::channel(Arc::new(MetadataImage::new()));
        let metadata_failure = crate::control::metadata_restart::MetadataFailure::default();
        let mut tasks = vec![
            spawn_task(
                "metadata_image",
                me,
                &stopping,
                controller::follow(hosted_metadata.clone(), image_tx),
            ),
            spawn_task(
                "metadata_restart",
                me,
                &stopping,
                crate::control::metadata_restart::run(crate::control::metadata_restart::MetadataRestart {
                    metadata: hosted_metadata.clone(),
                    groups: groups.clone(),
                    settings: meta_settings,
                    peers: peers.clone(),
                    storage: meta_storage,
                    flusher: flusher.clone(),
                    dir: meta_dir.clone(),
                    staging_dir,
                    failure: metadata_failure.clone(),
                }),
            ),
        ];
        let controller = Controller::new(
            hosted_metadata.clone(),
            image_rx.clone(),
            peers.clone(),
            config.limits.clone(),
            me,
            liveness.clone(),
        )
        .with_seeds(
            config
                .initial_cluster
                .iter()
                .map(|(id, addr)| (*id, addr.to_string()))
                // A joined broker's seeds: brokers whose ids it does not know.
                .chain(config.join.iter().map(|addr| (0, addr.to_string()))),
        );
        let _ = controller_slot.set(controller.clone());

        let failures = Failures::default();
        let partitions_root = config.data_dir.join("partitions");
        create_dir_durable(&*fs, &partitions_root)
            .with_context(|| format!("creating {}", partitions_root.display()))?;
        let meta_db =
            MetaDb::open_on(&fs, &partitions_root).context("opening the replicas' metadata database")?;
        let reconciler = Reconciler {
            broker: me,
            root: partitions_root,
            meta_db,
            storage: config.storage.clone(),
            flusher: flusher.clone(),
            raft_settings,
            peers: peers.clone(),
            groups,
            failures: failures.clone(),
            incarnation: identity.incarnation,
            controller: controller.clone(),
            roll_limits: Arc::default(),
        };
        tasks.push(spawn_task("reconciler", me, &stopping, reconciler.clone().run(image_rx.clone())));
        let ping_every = Duration::from_millis(config.raft.heartbeat_interval_ms);
        let dead_after = Duration::from_millis(config.raft.election_timeout_min_ms);
        tasks.push(spawn_task(
            "liveness",
            me,
            &stopping,
            liveness.clone().run(me, image_rx.clone(), peers, ping_every, dead_after),
        ));
        let election_timeout = Duration::from_millis(config.raft.election_timeout_max_ms);
        tasks.push(spawn_task(
            "quiesce",
            me,
            &stopping,
            crate::control::quiesce::run(
                me,
                reconciler.groups.clone(),
                liveness.clone(),
                ping_every,
                election_timeout,
            ),
        ));
        tasks.push(spawn_task(
            "dormant",
            me,
            &stopping,
            crate::control::dormant::run(
                me,
                reconciler.groups.clone(),
                liveness.clone(),
                Duration::from_millis(config.raft.dormant_after_ms),
                fs.clone(),
            ),
        ));
        let hand_over = crate::control::handover::HandOver::new(
            reconciler.groups.clone(),
            liveness.clone(),
            Duration::from_millis(config.raft.election_timeout_max_ms),
        );
        let topic_defaults = Arc::new(config.topic_defaults()?);
        tasks.push(spawn_task(
            "retention",
            me,
            &stopping,
            crate::control::retention::run(
                reconciler.groups.clone(),
                image_rx.clone(),
                topic_defaults.clone(),
                liveness.clone(),
                Duration::from_millis(config.retention.check_interval_ms),
                flusher.clone(),
            ),
        ));
        tasks.push(spawn_task(
            "compaction",
            me,
            &stopping,
            crate::control::compaction::run(
                reconciler.groups.clone(),
                image_rx.clone(),
                topic_defaults.clone(),
                liveness.clone(),
                config.compaction.clone(),
                fs.clone(),
            ),
        ));
        tasks.push(spawn_task(
            "scrub",
            me,
            &stopping,
            crate::control::scrub::run(
                reconciler.groups.clone(),
                Duration::from_millis(config.scrub.interval_ms),
                config.scrub.io_max_bytes_per_second,
                fs.clone(),
            ),
        ));
        tasks.push(spawn_task(
            "producer-expiry",
            me,
            &stopping,
            crate::control::producer_expiry::run(
                reconciler.groups.clone(),
                liveness.clone(),
                Duration::from_millis(config.producers.id_expiration_check_interval_ms),
                i64::try_from(config.producers.id_expiration_ms).unwrap_or(i64::MAX),
            ),
        ));
        tasks.push(spawn_task(
            "balance",
            me,
            &stopping,
            crate::control::balance::run(me, hand_over.clone(), image_rx.clone(), config.balance.clone()),
        ));
        let checker = crate::control::checkquorum::Checker {
            metadata: hosted_metadata.clone(),
            groups: reconciler.groups.clone(),
            liveness: liveness.clone(),
            image: image_rx.clone(),
            timings: crate::control::checkquorum::Timings {
                confirm: Duration::from_millis(config.raft.election_timeout_min_ms),
                resend: Duration::from_millis(config.raft.election_timeout_max_ms),
            },
        };
        // Twice per confirmation window: a lost quorum is acted on within
        // about 1.5 × election_timeout_min; a round visits the groups whose
        // ticker runs (or that it judged last round).
        let check_every = Duration::from_millis(config.raft.election_timeout_min_ms / 2);
        tasks.push(spawn_task(
            "checkquorum",
            me,
            &stopping,
            crate::control::checkquorum::run(checker, check_every),
        ));
        tasks.push(spawn_task(
            "membership",
            me,
            &stopping,
            crate::control::membership::run(
                reconciler.groups.clone(),
                image_rx.clone(),
                crate::control::membership::Env {
                    controller: controller.clone(),
                    hand_over: hand_over.clone(),
                    throttle: reconciler.peers.throttle().clone(),
                },
            ),
        ));
        tasks.push(spawn_task("files", me, &stopping, crate::control::files::watch(fs.clone())));
        tasks.push(spawn_task("leadership", me, &stopping, reconciler.groups.clone().watch_leadership()));
        tasks.push(spawn_task(
            "register",
            me,
            &stopping,
            register(controller.clone(), image_rx, config.clone(), identity.incarnation),
        ));

        let max_connections = config.limits.max_connections;
        let coordinator = crate::coordinator::Coordinator::new(
            me,
            reconciler.groups.clone(),
            liveness.clone(),
            controller.clone(),
            config.groups.clone(),
            config.limits.clone(),
        );
        tasks.push(spawn_task("group-coordinator", me, &stopping, coordinator.clone().run()));
        let service = ClientService {
            broker: me,
            limits: config.limits.clone(),
            coordinator,
            controller,
            groups: reconciler.groups.clone(),
            failures,
            metadata_failure,
            liveness: liveness.clone(),
            hand_over: hand_over.clone(),
            topic_defaults: topic_defaults.clone(),
        };
        if let Some(listener) = kafka_listener {
            let kafka = crate::kafka::KafkaService { core: service.clone(), config: config.kafka.clone() };
            let (tx, server) = crate::kafka::serve(kafka, listener);
            stop.push(tx);
            servers.push(server);
        }
        let router = tonic::transport::Server::builder().add_service(service.into_service());
        let (tx, server) = serve(
            router,
            client_listener,
            max_connections,
            "client",
            Some(crate::listener::WRITE_BYTES_PER_YIELD),
        );
        stop.push(tx);
        servers.push(server);
        let kafka = if config.kafka.enabled { config.kafka_addr.to_string() } else { "off".into() };
        tracing::info!(client = %config.client_addr, peer = %config.peer_addr, %kafka, data = %config.data_dir.display(), "broker started");
        tracing::info!(
            drop_behind_bytes = config.storage.page_cache_drop_behind(),
            "fsynced segment pages further than this behind a segment's end leave the page cache (0: never; \
             storage.page_cache_drop_behind_bytes)"
        );
        let shutdown =
            Some(Box::pin(shutdown) as std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>);
        Ok(Self {
            config,
            stop,
            servers,
            tasks,
            stopping,
            shutdown,
            hurry: None,
            metadata: hosted_metadata,
            reconciler,
            hand_over,
            boot_id,
        })
    }

    /// Gives the signal that cuts a controlled shutdown short (the
    /// process's second SIGTERM): what is not handed over by then moves by
    /// elections once the broker is gone.
    #[must_use]
    pub fn with_hurry(mut self, hurry: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        self.hurry = Some(Box::pin(hurry));
        self
    }

    /// Runs until the shutdown signal given to [`Broker::start`] resolves,
    /// then hands its leaderships over (unless `controlled_shutdown_enable`
    /// is off; see [`Broker::hand_over_leaderships`]) and stops
    /// ([`Broker::shutdown`]).
    pub async fn serve(mut self) {
        if let Some(signal) = self.shutdown.take() {
            signal.await;
        }
        if self.config.shutdown.controlled_shutdown_enable {
            self.hand_over_leaderships().await;
        }
        tracing::info!("shutting down");
        self.shutdown().await;
    }

    /// The controlled shutdown's first step: hands every leadership held
    /// here to a caught-up follower on another live broker, within
    /// `controlled_shutdown_timeout_ms` or until the hurry signal
    /// (`crate::control::handover`), and logs what it came to.
    pub async fn hand_over_leaderships(&mut self) {
        let within = Duration::from_millis(self.config.shutdown.controlled_shutdown_timeout_ms);
        let hurry = self.hurry.take();
        let hurry = async move {
            match hurry {
                Some(h) => h.await,
                None => std::future::pending().await,
            }
        };
        let image = self.reconciler.controller.image();
        tracing::info!(
            led = self.reconciler.groups.leading().len(),
            "controlled shutdown: handing leaderships over"
        );
        let r = self.hand_over.drain(image, within, hurry).await;
        tracing::info!(
            handed_over = r.handed_over,
            controller_handed_over = r.controller_handed_over,
            no_live_follower = r.no_target,
            left = r.left,
            took_ms = r.took.as_millis() as u64,
            "controlled shutdown: leaderships handed over"
        );
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }

    /// This start's boot id (`PingResponse.boot_id`): random, non-zero,
    /// new at every start, even of a broker restarted in the same process.
    pub fn boot_id(&self) -> u64 {
        self.boot_id
    }

    /// Stops serving, stops every Raft group, and waits for the servers,
    /// within about 8 s whatever the load: what is not
    /// done by then is left to the process exit, which is safe (a replica
    /// not marked as cleanly stopped is treated as after a crash when it is
    /// opened again).
    pub async fn shutdown(self) {
        let t0 = tokio::time::Instant::now();
        let hosted = self.reconciler.groups.partitions().len();
        for s in self.stop {
            let _ = s.send(());
        }
        // The background loops end at their next await, and are waited
        // for: none starts a replica or a campaign while replicas stop.
        let _ = self.stopping.send(true);
        let aborts: Vec<_> = self.tasks.iter().map(JoinHandle::abort_handle).collect();
        let ended = tokio::time::timeout(STOP_TASKS_WITHIN, futures::future::join_all(self.tasks)).await;
        if ended.is_err() {
            // One is inside a synchronous call (an fsync on a failing disk,
            // say): it goes at its next await whatever happens here.
            tracing::warn!("background tasks not ended within {STOP_TASKS_WITHIN:?}: aborting them");
            aborts.iter().for_each(tokio::task::AbortHandle::abort);
        }
        // Under flush = always every acknowledged entry is already on disk
        // and a stop writes nothing (Replica::close_cleanly), so the
        // replicas are left to the process exit: stopping 2,000 Raft groups
        // one by one took 2-4 s. Under interval each is stopped and marked
        // as cleanly stopped, within STOP_REPLICAS_WITHIN; those not stopped
        // by then are left unmarked, which is safe (treated as after a
        // crash when opened again).
        let stop_replicas = !matches!(self.config.storage.flush, ferrolog_raft_store::FlushPolicy::Always);
        if stop_replicas
            && tokio::time::timeout(STOP_REPLICAS_WITHIN, self.reconciler.stop_all()).await.is_err()
        {
            tracing::warn!(
                left = self.reconciler.groups.partitions().len(),
                "replicas not stopped within {STOP_REPLICAS_WITHIN:?}: leaving them to the process exit"
            );
        }
        let replicas_stopped = t0.elapsed();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.metadata.raft().shutdown()).await;
        // The servers finish the requests in flight, within what is left.
        let left = STOP_WITHIN.saturating_sub(t0.elapsed()).max(Duration::from_millis(500));
        let _ = tokio::time::timeout(left, futures::future::join_all(self.servers)).await;
        tracing::info!(
            replicas = hosted,
            replicas_ms = replicas_stopped.as_millis() as u64,
            total_ms = t0.elapsed().as_millis() as u64,
            "broker stopped"
        );
    }
}

/// Registers this broker's addresses with the controller, and again
/// whenever the image disagrees with them (a new controller, a changed
/// address), retrying until it succeeds.
async fn register(
    controller: Controller,
    mut image: watch::Receiver<Arc<MetadataImage>>,
    c: BrokerConfig,
    incarnation: u64,
) {
    let (client_addr, peer_addr) = (c.client_addr.to_string(), c.peer_addr.to_string());
    let kafka = kafka_addr(&c);
    let mut failures = 0u64;
    loop {
        let registered = image.borrow().brokers.get(&c.node_id).is_some_and(|b| {
            b.client_addr == client_addr
                && b.peer_addr == peer_addr
                && b.kafka_addr == kafka
                && b.incarnation == incarnation
        });
        if !registered {
            let req = ControllerRequest::RegisterBroker {
                id: c.node_id,
                client_addr: client_addr.clone(),
                peer_addr: peer_addr.clone(),
                incarnation,
                kafka_addr: kafka.clone(),
            };
            match controller.handle_via_any(req).await {
                Ok(_) => tracing::info!("registered with the controller"),
                Err(e) => {
                    failures += 1;
                    // Every 5 s of failing, not every attempt.
                    if failures % 25 == 1 {
                        tracing::warn!(failures, "cannot register with the controller yet: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            }
        }
        if image.changed().await.is_err() {
            return;
        }
    }
}

/// The Kafka listener address a broker registers: empty without one.
fn kafka_addr(c: &BrokerConfig) -> String {
    if c.kafka.enabled { c.kafka_addr.to_string() } else { String::new() }
}

/// How a new data directory enters the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// No founding member has a metadata group: found it (initialize).
    Found,
    /// The group exists and has never recorded this broker: run as node
    /// `broker id` of the founding membership, without initializing.
    Pristine,
    /// The group recorded this broker with another incarnation: its data
    /// was wiped; rejoin under new node ids.
    Wiped,
}

/// Asks every other founding member until the answer is safe. A broker
/// that knows this broker's earlier incarnation means `Wiped`; a formed
/// group whose image is caught up (or which never had a leader) and does
/// not know it means `Pristine`; every member answering with no group
/// means `Found`. Anything less (members unreachable, images behind) waits:
/// a wiped broker must never found a group or reuse its old ids.
async fn how_to_enter(c: &BrokerConfig, incarnation: u64, peers: &PeerAddresses) -> Entry {
    use ferrolog_proto::raft::PingRequest;
    let others: Vec<(u32, String)> = c
        .initial_cluster
        .iter()
        .filter(|(id, _)| **id != c.node_id)
        .map(|(id, a)| (*id, a.to_string()))
        .collect();
    let mut rounds = 0u64;
    loop {
        let (mut answered, mut formed, mut pristine) = (0usize, false, false);
        for (id, addr) in &others {
            let Ok(ch) = peers.channel(addr) else { continue };
            let mut req = tonic::Request::new(PingRequest { from_broker: c.node_id });
            req.set_timeout(Duration::from_millis(500));
            let r = match crate::network::peer_client(ch).ping(req).await {
                Ok(r) => r.into_inner(),
                Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                    tracing::error!(peer = id, "founding member {id} refused this broker: {}", s.message());
                    continue;
                }
                Err(_) => continue,
            };
            // An answer in another major protocol version (or none: version
            // 0) says nothing this broker can rely on.
            if !crate::network::protocol::check_peer(*id, r.protocol_major, r.protocol_minor) {
                continue;
            }
            // An answer from another broker than the founding member
            // listed (a machine replaced at the same address) says nothing
            // about the founders' group.
            if r.broker_id != *id {
                tracing::warn!(
                    peer = id,
                    answered_as = r.broker_id,
                    "a founding member's address answers as another broker"
                );
                continue;
            }
            answered += 1;
            if r.your_incarnation != 0 && r.your_incarnation != incarnation {
                tracing::warn!(peer = id, "this broker's earlier data is known to the cluster: it was wiped");
                return Entry::Wiped;
            }
            if r.metadata_initialized {
                formed = true;
                pristine |= r.image_caught_up || r.metadata_last_index == 0;
            }
        }
        if pristine {
            return Entry::Pristine;
        }
        if !formed && answered == others.len() {
            return Entry::Found;
        }
        if rounds.is_multiple_of(20) {
            tracing::info!(
                answered,
                members = others.len(),
                formed,
                "new data directory: waiting for the founding members to answer"
            );
        }
        rounds += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Registers a new data directory with an existing cluster through any
/// founding member (which forwards to the controller) and returns the node
/// id to use in the metadata group. Retries for up to a minute.
async fn join(c: &BrokerConfig, incarnation: u64, peers: &PeerAddresses) -> anyhow::Result<NodeId> {
    use crate::metadata::command::ControllerReply;
    let req = ControllerRequest::RegisterBroker {
        id: c.node_id,
        client_addr: c.client_addr.to_string(),
        peer_addr: c.peer_addr.to_string(),
        incarnation,
        kafka_addr: kafka_addr(c),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while tokio::time::Instant::now() < deadline {
        for addr in c.initial_cluster.iter().filter(|(id, _)| **id != c.node_id).map(|(_, a)| a.to_string()) {
            match forward_to_controller(peers, &addr, &req).await {
                Ok(Ok(ControllerReply::Registered { metadata_node })) => return Ok(metadata_node),
                Ok(other) => last = format!("{other:?}"),
                Err(e) => last = e,
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    anyhow::bail!("could not join the existing cluster: {last}")
}

/// One controller request sent through the broker at peer address `addr`
/// (which forwards it to the controller): the controller's answer, or why
/// none came (unreachable, or an answer that does not decode).
async fn forward_to_controller(
    peers: &PeerAddresses,
    addr: &str,
    req: &ControllerRequest,
) -> Result<Result<crate::metadata::command::ControllerReply, crate::error::ApiError>, String> {
    use ferrolog_proto::raft::ControllerCall;
    let body = serde_json::to_vec(req).map_err(|e| e.to_string())?;
    let ch = peers.channel(addr).map_err(|e| format!("{addr}: {e}"))?;
    let mut call = tonic::Request::new(ControllerCall { request_json: body.into() });
    call.set_timeout(Duration::from_secs(15));
    let answer = crate::network::peer_client(ch)
        .controller(call)
        .await
        .map_err(|e| format!("{addr}: {}", e.message()))?;
    serde_json::from_slice(&answer.into_inner().result_json)
        .map_err(|e| format!("unreadable answer from {addr} (an older broker?): {e}"))
}

/// Enters a running cluster through `config.join` when the data directory
/// is new (or its join was not answered): registers with the controller
/// (`ControllerRequest::JoinBroker`), which assigns a broker id if
/// `node_id` is 0, and stores the identity. Either way, a broker started
/// without an id takes its directory's. The incarnation is stored before
/// asking, so a broker that crashes before the answer asks again with it
/// and gets the same id.
///
/// # Errors
/// The controller refuses (the id is a live broker's, or was
/// decommissioned), no broker of `join` answers within a minute, or the
/// directory cannot be written.
async fn enter_by_join(fs: &dyn Vfs, config: &mut BrokerConfig, peers: &PeerAddresses) -> anyhow::Result<()> {
    let stored = identity::load_any(fs, &config.data_dir)?;
    if config.node_id == 0
        && let Some(id) = &stored
    {
        config.node_id = id.broker_id;
    }
    if config.join.is_empty() || stored.as_ref().is_some_and(|id| !id.join_pending()) {
        anyhow::ensure!(config.node_id != 0, "no broker id: give --node-id, or --join to be assigned one");
        return Ok(());
    }
    let mut id = stored.unwrap_or_else(|| identity::Identity {
        broker_id: config.node_id,
        incarnation: identity::random_id(),
        metadata_node: 0,
        founder: false,
    });
    anyhow::ensure!(
        id.broker_id == config.node_id,
        "{} belongs to broker {}, but this is broker {}",
        config.data_dir.display(),
        id.broker_id,
        config.node_id
    );
    identity::store(fs, &config.data_dir, &id)?;
    tracing::info!(join = ?config.join, broker = id.broker_id, "joining a running cluster");
    let (broker_id, metadata_node) = ask_to_join(config, id.incarnation, peers).await?;
    id.broker_id = broker_id;
    id.metadata_node = metadata_node;
    identity::store(fs, &config.data_dir, &id)?;
    config.node_id = broker_id;
    tracing::info!(broker = broker_id, metadata_node, "joined the cluster");
    Ok(())
}

/// Asks the brokers of `c.join` in turn (each forwards to the controller)
/// until one answers; retries for up to a minute, but not after a refusal.
async fn ask_to_join(
    c: &BrokerConfig,
    incarnation: u64,
    peers: &PeerAddresses,
) -> anyhow::Result<(crate::config::BrokerId, NodeId)> {
    use crate::error::ApiError;
    use crate::metadata::command::ControllerReply;
    let req = ControllerRequest::JoinBroker {
        id: c.node_id,
        client_addr: c.client_addr.to_string(),
        peer_addr: c.peer_addr.to_string(),
        incarnation,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last = String::from("no broker to ask");
    while tokio::time::Instant::now() < deadline {
        for addr in &c.join {
            match forward_to_controller(peers, &addr.to_string(), &req).await {
                Ok(Ok(ControllerReply::Joined { broker_id, metadata_node })) => {
                    return Ok((broker_id, metadata_node));
                }
                // A broker older than 1.6 does not know the request:
                // another one of `join` may.
                Ok(Err(ApiError::Invalid(m))) if m.contains("does not decode") => {
                    last = format!("{addr} speaks an older peer protocol: {m}");
                }
                Ok(Err(ApiError::Invalid(m))) => anyhow::bail!("the cluster refused this broker: {m}"),
                Ok(other) => last = format!("{other:?}"),
                Err(e) => last = e,
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    anyhow::bail!("could not join the cluster through {:?}: {last}", c.join)
}

/// Spawns one of the broker's background tasks inside a span named `name`
/// that carries the broker's id (`node`), so every line it logs says which
/// broker and which loop it came from (several brokers may share a log,
/// as in the tests' and `ferrolog dev`'s output).
/// Spawns a background loop in a span naming it and this broker (`node`),
/// ending it at its next await once `stopping` turns true.
fn spawn_task<F>(name: &'static str, node: u32, stopping: &watch::Sender<bool>, task: F) -> JoinHandle<()>
where
    F: std::future::Future + Send + 'static,
{
    use tracing::Instrument;
    let mut stopping = stopping.subscribe();
    let run = async move {
        tokio::select! {
            _ = task => {}
            _ = stopping.wait_for(|s| *s) => {}
        }
    };
    tokio::spawn(run.instrument(tracing::info_span!("task", name, node)))
}

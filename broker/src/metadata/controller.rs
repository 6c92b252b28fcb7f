//! The controller: the leader of the metadata group validates administrative
//! requests, chooses placements and ids, and proposes metadata commands;
//! other brokers forward requests to it. Every broker also runs
//! [`follow`], which folds committed metadata records into its image.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferrolog_proto::TopicId;
use ferrolog_proto::client::{Record, RecordSet};
use ferrolog_proto::raft::ControllerCall;
use ferrolog_raft_store::{NO_PRODUCER_ID, RecordBatch};
use ferrolog_replica::RaftNode;
use prost::Message;
use tokio::sync::{Mutex, watch};

use super::command::{ControllerReply, ControllerRequest, MetadataCommand};
use super::decide::{Decision, Facts, decide};
use super::hosted::HostedMetadata;
use super::image::MetadataImage;
use crate::config::{BrokerId, Limits};
use crate::control::liveness::Liveness;
use crate::error::ApiError;
use crate::network::PeerAddresses;
use crate::partition::records;

/// Longest a controller request waits for its command to commit and apply.
const APPLY_WAIT: Duration = Duration::from_secs(10);
/// Longest [`Controller::current_image`] waits for the controller's
/// ReadIndex, and then for this broker's image to fold up to it.
const CONFIRM_WAIT: Duration = Duration::from_secs(2);
/// Least time between the starts of two ReadIndex rounds one broker asks.
const READ_INDEX_GAP: Duration = Duration::from_millis(50);
/// The peer protocol minor version that brought [`ControllerRequest::ReadIndex`].
pub const READ_INDEX_MINOR: u32 = 7;

/// An image confirmed current ([`Controller::current_image`]).
#[derive(Debug, Clone)]
pub struct Confirmed {
    /// The metadata log offset the controller had committed and applied
    /// when asked: every change before it is in `image`.
    pub offset: u64,
    /// This broker's image once it had folded at least that far (it may
    /// have folded more since).
    pub image: Arc<MetadataImage>,
}

impl Confirmed {
    /// Whether `image` holds every change the controller had committed
    /// when asked: an older image than the confirmed one may still do.
    pub fn covers(&self, image: &MetadataImage) -> bool {
        image.applied_offset >= self.offset
    }
}
/// Bytes read from the metadata log per step.
const READ_BYTES: usize = 1 << 20;
/// Most commands in one metadata log entry (`MetadataCommand::Batch`);
/// a bigger batch is split.
pub const BATCH_COMMANDS_MAX: usize = 1000;

/// Kafka's topic name rule: 1 to 249 characters of `[a-zA-Z0-9._-]`, and
/// not `.` or `..`.
///
/// # Errors
/// [`ApiError::Invalid`] saying what is wrong.
pub fn validate_topic_name(name: &str) -> Result<(), ApiError> {
    if name.is_empty() || name.len() > 249 {
        return Err(ApiError::Invalid(format!("topic name must be 1 to 249 characters, got {}", name.len())));
    }
    if name == "." || name == ".." {
        return Err(ApiError::Invalid("topic name cannot be \".\" or \"..\"".into()));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(ApiError::Invalid(format!(
            "topic name {name:?} contains {c:?}; allowed are ASCII letters, digits, '.', '_' and '-'"
        )));
    }
    Ok(())
}

/// The controller side of a broker: proposes when it leads the metadata
/// group, forwards otherwise. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Controller {
    /// The metadata group's replica here (Raft node and storage), asked
    /// each time: a replica that stopped on an error is replaced in place.
    metadata: HostedMetadata,
    image: watch::Receiver<Arc<MetadataImage>>,
    peers: PeerAddresses,
    limits: Limits,
    serial: Arc<Mutex<()>>,
    me: BrokerId,
    liveness: Liveness,
    /// The founding brokers' peer addresses from the configuration
    /// (`initial_cluster`), asked by [`Controller::handle_via_any`] when
    /// the image does not list them (yet).
    seeds: Arc<Vec<(BrokerId, String)>>,
    /// The last ReadIndex asked of the controller: when it was asked and
    /// what it gave (see [`Controller::current_image`]). Held while one is
    /// under way, so callers that wait share the next one.
    confirmed: Arc<Mutex<Option<ReadIndexAnswer>>>,
}

/// When a ReadIndex was asked of the controller, and the metadata log
/// offset it answered (or why it did not).
type ReadIndexAnswer = (tokio::time::Instant, Result<u64, ApiError>);

impl Controller {
    /// A controller over this broker's replica of the metadata group
    /// (`metadata`) and its image; `liveness` tells which brokers may
    /// receive new replicas.
    pub fn new(
        metadata: HostedMetadata,
        image: watch::Receiver<Arc<MetadataImage>>,
        peers: PeerAddresses,
        limits: Limits,
        me: BrokerId,
        liveness: Liveness,
    ) -> Self {
        let (seeds, confirmed) = (Arc::default(), Arc::default());
        Self {
            metadata,
            image,
            peers,
            limits,
            serial: Arc::new(Mutex::new(())),
            me,
            liveness,
            seeds,
            confirmed,
        }
    }

    /// The metadata group's Raft node here, as it is now.
    fn raft(&self) -> RaftNode {
        self.metadata.raft()
    }

    /// Gives the founding brokers' peer addresses (`initial_cluster`), which
    /// [`Controller::handle_via_any`] also asks.
    pub fn with_seeds(mut self, seeds: impl IntoIterator<Item = (BrokerId, String)>) -> Self {
        self.seeds = Arc::new(seeds.into_iter().collect());
        self
    }

    /// Whether this broker's image reflects everything the controller has
    /// committed, as far as this replica knows: a leader is known, the local
    /// replica applied up to the commit index it learned, and the image
    /// folded everything applied. A local hint only: after a restart the
    /// replica knows a lazily saved commit index, possibly of the current
    /// leadership, until the leader tells it more. What a lagging image
    /// must not decide asks [`Controller::current_image`] instead.
    pub fn image_caught_up(&self) -> bool {
        let (leader, applied, committed) = self
            .raft()
            .state(|s| (s.leader(), s.last_applied().map(|l| l.index), s.committed().map(|l| l.index)));
        leader.is_some()
            && applied >= committed
            && self.image.borrow().applied_offset >= self.metadata.replica().high_watermark()
    }

    /// This broker's image, once it holds every metadata change the
    /// controller had committed when this call began: the controller
    /// confirms its leadership with a quorum and says how far its log is
    /// committed (ReadIndex, Raft thesis §6.4; [`ControllerRequest::ReadIndex`]),
    /// and the image is waited for until it has folded that far. For
    /// answers a lagging image must not give: that a topic or an id does
    /// not exist (final for a client), that a replica is no longer placed
    /// here (its data is deleted). After a restart the image may stop at a
    /// lazily saved commit index for a while, even once this replica
    /// follows the current leader; no local view of Raft's state tells
    /// that apart (CI saw a restarted broker call a live topic deleted).
    ///
    /// Concurrent calls share one ReadIndex: a call uses the answer (or
    /// the failure) of one asked after it began, so a burst of requests for
    /// an unknown topic costs the controller one round, not one each.
    ///
    /// A controller older than peer protocol 1.7 does not know the
    /// request: while the controller's broker answers pings as one, the
    /// local view ([`Controller::image_caught_up`]) stands in, as before 1.7.
    ///
    /// # Errors
    /// [`ApiError::Unavailable`] when no controller is known or answers
    /// within [`CONFIRM_WAIT`], or the image does not catch up in time.
    pub async fn current_image(&self) -> Result<Confirmed, ApiError> {
        if let Some(leader) = self.leader()
            && leader != self.me
            && self.liveness.older_than(READ_INDEX_MINOR).iter().any(|(b, _)| *b == leader)
        {
            // A controller older than 1.7 does not know ReadIndex: the
            // local view, as before 1.7, until it is upgraded.
            let image = self.image();
            return if self.image_caught_up() {
                Ok(Confirmed { offset: image.applied_offset, image })
            } else {
                Err(ApiError::Unavailable("this broker's metadata is catching up".into()))
            };
        }
        let began = tokio::time::Instant::now();
        let offset = {
            let mut last = self.confirmed.lock().await;
            match &*last {
                Some((asked, answer)) if *asked >= began => answer.clone(),
                previous => {
                    // Back to back at most every READ_INDEX_GAP: a client
                    // hammering an unknown topic costs the controller a
                    // bounded rate of heartbeat rounds.
                    if let Some((asked, _)) = previous {
                        tokio::time::sleep_until(*asked + READ_INDEX_GAP).await;
                    }
                    let asked = tokio::time::Instant::now();
                    let answer = match tokio::time::timeout(
                        CONFIRM_WAIT,
                        self.handle(ControllerRequest::ReadIndex),
                    )
                    .await
                    {
                        Ok(Ok(ControllerReply::ReadIndex { offset })) => Ok(offset),
                        Ok(Ok(other)) => Err(ApiError::Unavailable(format!(
                            "the controller answered a ReadIndex with {other:?} (an older version?)"
                        ))),
                        Ok(Err(e)) => Err(ApiError::Unavailable(format!(
                            "cannot confirm this broker's metadata with the controller: {e}"
                        ))),
                        Err(_) => Err(ApiError::Unavailable(format!(
                            "the controller did not confirm this broker's metadata within {CONFIRM_WAIT:?}"
                        ))),
                    };
                    *last = Some((asked, answer.clone()));
                    answer
                }
            }
        }?;
        let mut rx = self.image.clone();
        match tokio::time::timeout(CONFIRM_WAIT, rx.wait_for(|i| i.applied_offset >= offset)).await {
            Ok(Ok(image)) => Ok(Confirmed { offset, image: image.clone() }),
            _ => Err(ApiError::Unavailable(format!(
                "this broker's metadata is catching up: not at offset {offset} within {CONFIRM_WAIT:?}"
            ))),
        }
    }

    /// Answers [`ControllerRequest::ReadIndex`] as the controller: confirms
    /// its leadership with a quorum (no entry is written) and returns the
    /// offset its applied log then reaches. Given less time than the asking
    /// broker waits, so that its own reason (no quorum) reaches the asker.
    async fn read_index(&self) -> Result<ControllerReply, ApiError> {
        self.raft().read_index(CONFIRM_WAIT / 2).await.map_err(write_error)?;
        // Everything up to the read index is applied: the high watermark covers it.
        Ok(ControllerReply::ReadIndex { offset: self.metadata.replica().high_watermark() })
    }

    /// The current image.
    pub fn image(&self) -> Arc<MetadataImage> {
        self.image.borrow().clone()
    }

    /// The brokers the cluster consists of, as this broker knows them: the
    /// metadata group's members (founded from `initial_cluster`) and every
    /// registered broker (see [`MetadataImage::cluster_brokers`]). Before
    /// the metadata group has a membership, only the registered ones.
    pub fn cluster_brokers(&self) -> std::collections::BTreeSet<BrokerId> {
        // The image first, then the node's state: never one borrowed inside
        // the other's closure in the other order (CheckQuorum borrows the
        // image, then the state), which could deadlock with writers queued.
        let image = self.image.borrow().clone();
        self.raft().state(|s| image.cluster_brokers(s.members()))
    }

    /// The brokers whose metadata-group replicas vote (the controller
    /// quorum), from this replica's view of the membership.
    pub fn voter_brokers(&self) -> std::collections::BTreeSet<BrokerId> {
        let image = self.image.borrow().clone();
        let voters: Vec<ferrolog_replica::NodeId> = self.raft().state(|s| s.voters().collect());
        voters.into_iter().filter_map(|n| image.broker_of_node(0, n)).collect()
    }

    /// Voters of the metadata group that map to no registered broker.
    pub fn unregistered_voters(&self) -> Vec<ferrolog_replica::NodeId> {
        let image = self.image.borrow().clone();
        let voters: Vec<ferrolog_replica::NodeId> = self.raft().state(|s| s.voters().collect());
        voters.into_iter().filter(|n| image.broker_of_node(0, *n).is_none()).collect()
    }

    /// The controller's broker id (the metadata group's leader), if known.
    pub fn leader(&self) -> Option<BrokerId> {
        let node = self.raft().state(|s| s.leader())?;
        self.image.borrow().broker_of_node(super::METADATA_GROUP, node)
    }

    /// Serves `req`: here if this broker is the controller, else forwarded
    /// to it over the peer API.
    ///
    /// # Errors
    /// The request's own errors, or [`ApiError::Unavailable`] when there is
    /// no controller or it cannot be reached.
    pub async fn handle(&self, req: ControllerRequest) -> Result<ControllerReply, ApiError> {
        if self.raft().leader_term().is_some() {
            return self.execute(req).await;
        }
        let need = req.controller_minor();
        if need > 0
            && let Some(leader) = self.leader()
            && let Some((_, minor)) = self.liveness.older_than(need).into_iter().find(|(b, _)| *b == leader)
        {
            // It would not decode the request, or would drop what is new in it.
            return Err(ApiError::Unavailable(format!(
                "the controller (broker {leader}) speaks peer protocol 1.{minor}; this request needs 1.{need} \
                 (finish the upgrade first)"
            )));
        }
        let (id, recorded) = self
            .raft()
            .leader_address()
            .ok_or_else(|| ApiError::Unavailable("no controller elected yet".into()))?;
        // Where the controller's broker is now, not where the membership
        // recorded it.
        let addr = self.peers.address_of(id, &recorded);
        self.forward(&addr, &req).await
    }

    /// As [`Controller::handle`], but when this broker knows no controller
    /// (a broker that came back on a new peer address is not reached by the
    /// controller until it has registered that address), asks every other
    /// broker of the image in turn to forward `req`: they know the
    /// controller. Only for requests this broker makes itself (a forwarded
    /// request is never forwarded this way again).
    ///
    /// # Errors
    /// As [`Controller::handle`], the last broker's error.
    pub async fn handle_via_any(&self, req: ControllerRequest) -> Result<ControllerReply, ApiError> {
        let first = self.handle(req.clone()).await;
        // No leader known here: none elected, or the one a write was sent
        // to stepped down without naming a successor (`write_error`; a
        // broker of the first versions said it in openraft's words).
        let unknown = |m: &str| m.starts_with("no controller") || m.contains("forward request to: None");
        if !matches!(&first, Err(ApiError::Unavailable(m)) if unknown(m)) {
            return first;
        }
        // The image's addresses, then the configured founding brokers the
        // image does not list: after a restart the image may be empty until
        // this replica hears from the leader, which cannot reach it before it
        // registers a new address.
        let others: Vec<String> = {
            let image = self.image.borrow();
            let listed =
                image.brokers.iter().filter(|(b, _)| **b != self.me).map(|(_, e)| e.peer_addr.clone());
            let seeds = self
                .seeds
                .iter()
                .filter(|(b, _)| *b != self.me && !image.brokers.contains_key(b))
                .map(|(_, a)| a.clone());
            listed.chain(seeds).collect()
        };
        let mut last = first;
        for addr in others {
            last = self.forward(&addr, &req).await;
            if last.is_ok() {
                break;
            }
        }
        last
    }

    /// Why a topic of `rf` replicas cannot be placed on the `live` brokers.
    /// Permanent (`INVALID_REPLICATION_FACTOR`) only when the cluster has
    /// fewer than `rf` brokers at all; while enough brokers exist but some
    /// have not registered yet (a cluster just started) or do not answer,
    /// retriable (`UNAVAILABLE`), saying which.
    async fn forward(&self, addr: &str, req: &ControllerRequest) -> Result<ControllerReply, ApiError> {
        let channel = self.peers.channel(addr).map_err(|e| ApiError::Unavailable(e.to_string()))?;
        let body = serde_json::to_vec(req).map_err(|e| ApiError::Invalid(e.to_string()))?;
        let mut call = tonic::Request::new(ControllerCall { request_json: body.into() });
        call.set_timeout(APPLY_WAIT + Duration::from_secs(5));
        let answer = crate::network::peer_client(channel)
            .controller(call)
            .await
            .map_err(|e| ApiError::Unavailable(format!("controller at {addr}: {}", e.message())))?;
        serde_json::from_slice::<Result<ControllerReply, ApiError>>(&answer.into_inner().result_json)
            .map_err(|e| ApiError::Unavailable(format!("controller at {addr} answered garbage: {e}")))?
    }

    /// Serves a request on the controller itself, one at a time.
    ///
    /// # Errors
    /// As [`Controller::handle`]; [`ApiError::NotLeader`] if leadership moved.
    pub async fn execute(&self, req: ControllerRequest) -> Result<ControllerReply, ApiError> {
        if req == ControllerRequest::ReadIndex {
            // A read: neither serialized with the writes nor behind a barrier.
            return self.read_index().await;
        }
        let _serial = self.serial.lock().await;
        if self.raft().leader_term().is_none() {
            return Err(ApiError::NotLeader { leader: self.leader() });
        }
        // Apply everything committed before deciding anything.
        let barrier = self.raft().write_barrier().await.map_err(write_error)?;
        let image = self.wait_applied(barrier.base_offset).await?;
        let facts = Facts {
            limits: &self.limits,
            live: image
                .brokers
                .keys()
                .copied()
                .filter(|b| *b == self.me || self.liveness.is_alive(*b))
                .collect(),
            cluster: self.cluster_brokers(),
            new_topic_id: TopicId::v4_from_random(ferrolog_raft_store::runtime::random_u128()),
            older_peers: self.liveness.older_than(crate::network::protocol::MINOR),
            controller_voters: self.voter_brokers(),
            unregistered_voters: self.unregistered_voters(),
        };
        match decide(&image, req, &facts)? {
            Decision::Answer(reply) => Ok(reply),
            Decision::Commit { command, reply } => {
                if let MetadataCommand::BrokerReplaced { id, .. } = &command {
                    tracing::warn!(
                        broker = id,
                        "broker came back with a new data directory: replacing its replicas"
                    );
                }
                match command {
                    MetadataCommand::Batch { commands } => {
                        // Brokers older than 1.6 cannot fold a batch: one
                        // entry per command while one answers. Otherwise
                        // entries of at most BATCH_COMMANDS_MAX commands
                        // (about 200 bytes each), well inside one peer message.
                        let one_by_one = facts
                            .older_peers
                            .iter()
                            .any(|(_, minor)| *minor < super::decide::CONTROLLER_VOTERS_MINOR);
                        if one_by_one {
                            for c in commands {
                                self.propose(c).await?;
                            }
                        } else {
                            for chunk in commands.chunks(BATCH_COMMANDS_MAX) {
                                self.propose(MetadataCommand::Batch { commands: chunk.to_vec() }).await?;
                            }
                        }
                    }
                    command => {
                        self.propose(command).await?;
                    }
                }
                Ok(reply)
            }
            Decision::CreateTopic { command, name } => {
                let offset = self.propose(command).await?;
                let image = self.wait_applied(offset + 1).await?;
                match image.topics.get(&name) {
                    Some(t) if t.created_at_offset == offset => Ok(ControllerReply::Ok),
                    _ => Err(ApiError::TopicExists(name)),
                }
            }
        }
    }

    /// Proposes `command`, waits until this broker's image has applied it,
    /// and returns its metadata log offset.
    async fn propose(&self, command: MetadataCommand) -> Result<u64, ApiError> {
        let value = serde_json::to_vec(&command).map_err(|e| ApiError::Invalid(e.to_string()))?;
        let now = now_ms();
        let set = RecordSet {
            records: vec![Record { value: value.into(), timestamp_ms: now, ..Record::default() }],
        };
        let batch = RecordBatch {
            record_count: 1,
            first_timestamp_ms: now,
            max_timestamp_ms: now,
            producer_id: NO_PRODUCER_ID,
            records: Bytes::from(set.encode_to_vec()),
            ..RecordBatch::default()
        };
        let offset = self.raft().write(batch).await.map_err(write_error)?.base_offset;
        self.wait_applied(offset + 1).await?;
        match &command {
            MetadataCommand::Batch { commands } => {
                tracing::info!(offset, commands = commands.len(), first = ?commands.first(), "controller committed a batch");
            }
            command => tracing::info!(offset, ?command, "controller committed"),
        }
        Ok(offset)
    }

    async fn wait_applied(&self, offset: u64) -> Result<Arc<MetadataImage>, ApiError> {
        let mut rx = self.image.clone();
        let wait = rx.wait_for(|i| i.applied_offset >= offset);
        match tokio::time::timeout(APPLY_WAIT, wait).await {
            Ok(Ok(image)) => Ok(image.clone()),
            _ => Err(ApiError::Unavailable(format!("metadata offset {offset} not applied in time"))),
        }
    }
}

fn unavailable<E: std::fmt::Display>(e: E) -> ApiError {
    ApiError::Unavailable(format!("controller: {e}"))
}

/// A metadata write's failure on the wire. A leader that stepped down
/// without naming a successor is "no controller known", which
/// [`Controller::handle_via_any`] answers by asking the other brokers.
fn write_error(e: ferrolog_replica::ProposeError) -> ApiError {
    match e {
        ferrolog_replica::ProposeError::NotLeader { leader: None } => ApiError::Unavailable(
            "no controller known: the metadata leader stepped down without naming a successor".into(),
        ),
        other => unavailable(other),
    }
}

/// Milliseconds since the Unix epoch, by the wall clock a simulation can
/// replace ([`ferrolog_raft_store::runtime::wall_clock`]).
pub fn now_ms() -> i64 {
    ferrolog_raft_store::runtime::wall_clock_ms()
}

/// Folds committed metadata records into the image, forever: reads from
/// this broker's metadata replica up to its high watermark, applies each
/// command, and publishes the new image. Ends when the image's receivers
/// are gone. A replica replaced after it stopped on an error
/// ([`HostedMetadata::replace`]) is followed from where the image stands:
/// the reopened log holds every committed entry the old one held, or gets
/// it back from the leader.
///
/// A record that cannot be applied ([`fold`]) stops the image at its
/// offset, with an error logged every 30 s, until the broker is restarted
/// (upgraded, or its metadata replica rebuilt): the image is never built
/// past a record it did not understand.
pub async fn follow(metadata: HostedMetadata, image: watch::Sender<Arc<MetadataImage>>) {
    let mut replaced = metadata.changes();
    let mut generation = *replaced.borrow_and_update();
    let mut replica = metadata.replica();
    let mut hw = replica.watch_high_watermark();
    let mut current = MetadataImage::new();
    let mut stuck = false;
    loop {
        if *replaced.borrow() != generation {
            generation = *replaced.borrow_and_update();
            replica = metadata.replica();
            hw = replica.watch_high_watermark();
        }
        let mut changed = false;
        while !stuck && current.applied_offset < replica.high_watermark() {
            let (from, r) = (current.applied_offset, replica.clone());
            let fs = r.fs().clone();
            let read = ferrolog_raft_store::runtime::blocking(&*fs, move || r.read(from, READ_BYTES)).await;
            let batches = match read.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string())) {
                Ok(b) => b,
                // Tried again in a second, whether or not more is committed
                // meanwhile (an idle metadata log would leave the image
                // behind otherwise).
                Err(e) => {
                    crate::logging::every(
                        "metadata.read",
                        Duration::from_secs(10),
                        format_args!("cannot read the metadata log at offset {from}: {e}"),
                    );
                    if image.is_closed() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    if *replaced.borrow() != generation {
                        break;
                    }
                    continue;
                }
            };
            if batches.is_empty() {
                break;
            }
            let before = current.applied_offset;
            let folded = fold(&mut current, &batches);
            changed |= current.applied_offset > before;
            if let Err(e) = folded {
                tracing::error!("{e}");
                stuck = true;
            }
        }
        if changed && image.send(Arc::new(current.clone())).is_err() {
            return;
        }
        if stuck {
            // Nothing past the record will be applied; say so now and then,
            // and end with the image's receivers.
            tokio::select! {
                () = image.closed() => return,
                () = tokio::time::sleep(Duration::from_secs(30)) => {}
            }
            tracing::error!(
                offset = current.applied_offset,
                "this broker's metadata is stopped at offset {} (see the error above)",
                current.applied_offset
            );
            continue;
        }
        tokio::select! {
            more = hw.changed() => if more.is_err() { return },
            swapped = replaced.changed() => if swapped.is_err() { return },
        }
    }
}

/// Applies metadata `batches`, read from the metadata log at
/// `image.applied_offset`, to `image` in offset order (records below the
/// applied offset are skipped).
///
/// # Errors
/// A batch whose records do not decode, or a record that is not a command
/// this broker knows (a newer broker wrote it, or the log is damaged): the
/// image stops just before it (`applied_offset` is its offset) and the
/// error names it. Skipping it instead would let this broker's view of
/// topics and placements differ from every other broker's for good.
pub fn fold(image: &mut MetadataImage, batches: &[ferrolog_raft_store::StoredBatch]) -> Result<(), String> {
    for b in batches {
        let base = b.header.base_offset;
        let recs = records::decode(&b.records()).map_err(|e| {
            format!(
                "metadata batch at offset {base} does not decode ({e}); the metadata image stops at offset {}",
                image.applied_offset
            )
        })?;
        for (i, r) in recs.iter().enumerate() {
            let offset = base + i as u64;
            if offset < image.applied_offset {
                continue;
            }
            let cmd = serde_json::from_slice::<MetadataCommand>(&r.value).map_err(|e| {
                format!(
                    "metadata record at offset {offset} is not a command this broker knows ({e}): written by a \
                     newer version, or damaged; the metadata image stops before it"
                )
            })?;
            image.apply(offset, &cmd);
        }
        image.applied_offset = image.applied_offset.max(base + u64::from(b.header.record_count));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stored metadata batch of one record with `value` at `offset`
    /// (log index = offset), as the controller writes them.
    fn stored(offset: u64, value: &[u8]) -> ferrolog_raft_store::StoredBatch {
        use ferrolog_raft_store::types::{Entry, EntryPayload, log_id};
        let set = RecordSet {
            records: vec![Record {
                key: None,
                value: Bytes::copy_from_slice(value),
                headers: vec![],
                timestamp_ms: 1,
                ..Record::default()
            }],
        };
        let batch = RecordBatch {
            record_count: 1,
            producer_id: NO_PRODUCER_ID,
            records: Bytes::from(set.encode_to_vec()),
            ..RecordBatch::default()
        };
        let entry = Entry { log_id: log_id(1, 1, offset), payload: EntryPayload::Normal(batch) };
        let mut frame = Vec::new();
        let header = ferrolog_raft_store::format::encode_entry(&entry, offset, &mut frame).expect("encode");
        ferrolog_raft_store::StoredBatch { header, frame: Bytes::from(frame) }
    }

    fn register(id: BrokerId) -> Vec<u8> {
        serde_json::to_vec(&MetadataCommand::BrokerRegistered {
            id,
            client_addr: format!("127.0.0.{id}:1"),
            peer_addr: format!("127.0.0.{id}:2"),
            incarnation: 1,
            kafka_addr: String::new(),
        })
        .expect("json")
    }

    #[test]
    fn an_unknown_metadata_command_stops_the_image_before_it() {
        let mut image = MetadataImage::new();
        let unknown = br#"{"CommandFromTheFuture":{"x":1}}"#;
        let batches = [stored(0, &register(1)), stored(1, unknown), stored(2, &register(2))];
        let e = fold(&mut image, &batches).expect_err("offset 1 is not a known command");
        assert!(e.contains("offset 1"), "{e}");
        assert_eq!(image.applied_offset, 1, "applied up to the unknown record, not past it");
        assert!(image.brokers.contains_key(&1), "the record before it was applied");
        assert!(!image.brokers.contains_key(&2), "nothing after it was applied");
        // Folding again from where it stopped stops at the same record.
        assert!(fold(&mut image, &batches[1..]).is_err());
        assert_eq!(image.applied_offset, 1);
    }

    #[test]
    fn an_undecodable_metadata_batch_stops_the_image_before_it() {
        let mut image = MetadataImage::new();
        let mut bad = stored(1, &register(2));
        // Valid frame, records that are not a RecordSet.
        let records = b"\xff\xff\xff not protobuf";
        let entry_batch = RecordBatch {
            record_count: 1,
            producer_id: NO_PRODUCER_ID,
            records: Bytes::from_static(records),
            ..RecordBatch::default()
        };
        let entry = ferrolog_raft_store::types::Entry {
            log_id: ferrolog_raft_store::types::log_id(1, 1, 1),
            payload: ferrolog_raft_store::types::EntryPayload::Normal(entry_batch),
        };
        let mut frame = Vec::new();
        bad.header = ferrolog_raft_store::format::encode_entry(&entry, 1, &mut frame).expect("encode");
        bad.frame = Bytes::from(frame);
        let e = fold(&mut image, &[stored(0, &register(1)), bad]).expect_err("offset 1 does not decode");
        assert!(e.contains("offset 1 does not decode"), "{e}");
        assert_eq!(image.applied_offset, 1);
        assert!(image.brokers.contains_key(&1));
    }

    #[test]
    fn topic_names_follow_kafka_rules() {
        for ok in ["a", "flights", "a.b_c-D9", &"x".repeat(249)] {
            assert!(validate_topic_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "a b", "ä", "a/b", &"x".repeat(250)] {
            assert!(validate_topic_name(bad).is_err(), "{bad}");
        }
    }
}

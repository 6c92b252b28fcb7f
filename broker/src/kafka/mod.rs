//! The Kafka listener: Kafka's wire protocol over TCP on its own port, so
//! existing Kafka clients and tools work against Ferrolog unchanged.
//!
//! ```text
//!  TCP ──> listener::incoming (connection limit, first-bytes timeout)
//!      ──> conn: size-prefixed frames (socket_request_max_bytes, idle timeout),
//!          answered in order; produces pipelined (proposed in order, commits
//!          awaited together), anything else after every earlier answer
//!      ──> guard: array lengths checked against the frame before decoding
//!      ──> versions: only what ApiVersions advertises is decoded
//!      ──> handlers, on the same ClientService the gRPC API uses:
//!            metadata  Metadata
//!            produce   Produce, InitProducerId   (batches stored as they came)
//!            fetch     Fetch, ListOffsets        (stored Kafka batches served as stored)
//!            admin     CreateTopics, DeleteTopics, CreatePartitions, DescribeConfigs
//!            groups    FindCoordinator, Join/Sync/Heartbeat/LeaveGroup, OffsetCommit/Fetch/Delete,
//!                      ListGroups, DescribeGroups, DeleteGroups (the coordinator of crate::coordinator)
//! ```
//!
//! A request the listener cannot decode (a malformed frame, an API or
//! version not advertised) closes its connection with a log line; nothing
//! else is affected. ApiVersions at a version not served is answered
//! `UNSUPPORTED_VERSION` at version 0 (KIP-511).

mod admin;
mod conn;
mod errors;
mod fetch;
mod groups;
pub mod guard;
mod metadata;
mod produce;
pub mod versions;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::KafkaConfig;
use crate::grpc::service::ClientService;

/// What the Kafka handlers need: the client API's core (partitions,
/// controller, coordinator) and the listener's limits.
#[derive(Clone, Debug)]
pub struct KafkaService {
    /// The client API core, shared with the gRPC listener.
    pub core: ClientService,
    /// Framing and connection limits.
    pub config: KafkaConfig,
}

/// Serves Kafka clients on `listener` in a task, until the returned sender
/// fires or is dropped. Open connections end with the broker.
pub fn serve(
    service: KafkaService,
    listener: crate::listener::Listener,
) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let (tx, mut rx) = oneshot::channel::<()>();
    let service = Arc::new(service);
    let task = tokio::spawn(async move {
        let mut incoming =
            Box::pin(crate::listener::incoming(listener, service.config.max_connections, "kafka", None));
        loop {
            tokio::select! {
                _ = &mut rx => return,
                next = incoming.next() => match next {
                    Some(Ok(c)) => {
                        tokio::spawn(conn::run(c, service.clone()));
                    }
                    Some(Err(e)) => tracing::warn!(listener = "kafka", "accept: {e}"),
                    None => return,
                },
            }
        }
    });
    (tx, task)
}

/// How long a connection may go without a request before it is closed.
fn idle_timeout(c: &KafkaConfig) -> Duration {
    Duration::from_millis(c.connections_max_idle_ms.max(1))
}

/// An answer still to come ([`dispatch`]); `None` when the request wants
/// none (a produce with `acks=0` that succeeded).
type Pending =
    futures::future::BoxFuture<'static, Result<Option<kafka_protocol::messages::ResponseKind>, String>>;

/// Answers one decoded request. Everything but Produce is answered before
/// this returns; a Produce's batches are proposed before it returns and
/// its answer waits for their commits, so a connection can go on to its
/// next request meanwhile (answers still go out in request order). A
/// request of an API not served never gets here ([`versions::supported`]
/// is checked first).
async fn dispatch(
    s: &KafkaService,
    request: kafka_protocol::messages::RequestKind,
    version: i16,
    client_id: &str,
) -> Result<Pending, String> {
    use futures::FutureExt;
    use kafka_protocol::messages::{RequestKind as Q, ResponseKind as A};
    let now = |a: A| -> Pending { Box::pin(futures::future::ready(Ok(Some(a)))) };
    Ok(match request {
        Q::Produce(r) => produce::produce(s, r).await.map(|r| r.map(|o| o.map(A::Produce))).boxed(),
        Q::ApiVersions(_) => now(A::ApiVersions(versions::api_versions_ok())),
        Q::Metadata(r) => now(A::Metadata(metadata::metadata(s, r, version).await)),
        Q::InitProducerId(r) => now(A::InitProducerId(produce::init_producer_id(s, r).await)),
        Q::Fetch(r) => now(A::Fetch(fetch::fetch(s, r).await)),
        Q::ListOffsets(r) => now(A::ListOffsets(fetch::list_offsets(s, r).await)),
        Q::CreateTopics(r) => now(A::CreateTopics(admin::create_topics(s, r).await)),
        Q::DeleteTopics(r) => now(A::DeleteTopics(admin::delete_topics(s, r).await)),
        Q::CreatePartitions(r) => now(A::CreatePartitions(admin::create_partitions(s, r).await)),
        Q::DescribeConfigs(r) => now(A::DescribeConfigs(admin::describe_configs(s, r).await)),
        Q::FindCoordinator(r) => now(A::FindCoordinator(groups::find_coordinator(s, r, version).await)),
        Q::JoinGroup(r) => now(A::JoinGroup(groups::join_group(s, r, client_id).await)),
        Q::SyncGroup(r) => now(A::SyncGroup(groups::sync_group(s, r).await)),
        Q::Heartbeat(r) => now(A::Heartbeat(groups::heartbeat(s, r).await)),
        Q::LeaveGroup(r) => now(A::LeaveGroup(groups::leave_group(s, r, version).await)),
        Q::OffsetCommit(r) => now(A::OffsetCommit(groups::offset_commit(s, r).await)),
        Q::OffsetFetch(r) => now(A::OffsetFetch(groups::offset_fetch(s, r, version).await)),
        Q::ListGroups(r) => now(A::ListGroups(groups::list_groups(s, r).await)),
        Q::DescribeGroups(r) => now(A::DescribeGroups(groups::describe_groups(s, r).await)),
        Q::DeleteGroups(r) => now(A::DeleteGroups(groups::delete_groups(s, r).await)),
        Q::OffsetDelete(r) => now(A::OffsetDelete(groups::offset_delete(s, r).await)),
        other => return Err(format!("no handler for {other:?}")),
    })
}

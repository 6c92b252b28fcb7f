//! The Ferrolog client library: a metadata cache, an admin client, an
//! idempotent batching producer and a consumer, over the gRPC client API
//! (`proto/ferrolog/client/v1/client.proto`).
//!
//! ```text
//!  Producer::send ──> producer worker (one task) ──> per-partition queues ──> Produce RPC ──> partition leader
//!                       │ batches by size and linger, sequence numbers (KIP-98), ≤ 5 in flight per partition
//!                       └─ NOT_LEADER / UNAVAILABLE / transport ──> MetadataCache::refresh, backoff, resend in order
//!  Consumer::poll ──> one long-poll Fetch per assigned partition ──> decode RecordSet, skip below position
//!  Groups ──FindCoordinator──> any broker; OffsetCommit / OffsetFetch / DescribeGroup ──> the group's coordinator
//!  GroupConsumer::poll ──JoinGroup / SyncGroup (leader: assignor)──> coordinator; heartbeat task; Consumer
//!  Admin ──> CreateTopic / DeleteTopic / Metadata to any broker; PartitionStatus to each partition's leader
//!  MetadataCache ──Metadata RPC──> any known or bootstrap broker; one lazily connected channel per address
//! ```
//!
//! Modules:
//! - [`error`]: the library's error type, carrying the wire's stable error codes, and
//!   which errors are worth a retry.
//! - [`partitioner`]: Kafka's default partitioner (murmur2 of the key; sticky for
//!   records without a key, KIP-480).
//! - [`metadata`]: brokers, topics and partition leaders, cached and refreshed.
//! - [`admin`]: topics, partitions (reassignment, leadership) and cluster status.
//! - [`group`]: consumer group calls: find the coordinator, join, sync, heartbeat,
//!   leave, commit, read back, list, describe, delete.
//! - [`group_consumer`]: a member of a consumer group (Kafka's classic protocol):
//!   rebalances, commits, heartbeats.
//! - [`assignor`]: range, round-robin and cooperative-sticky assignment (run by the
//!   group's leader member).
//! - [`rebalance`]: planning reassignments that even out replicas and
//!   preferred leaders per broker, or drain a broker.
//! - [`producer`]: the idempotent batching producer.
//! - [`consumer`]: assignment, seeks and polling.
//! - [`record`]: records as the application sees them.
//! - [`retry`]: exponential backoff shared by the producer, consumer and admin.
//!
//! ```no_run
//! use std::time::Duration;
//! use ferrolog_client::{Admin, ClientConfig, Consumer, ConsumerConfig, MetadataCache, Producer, ProducerConfig, Record, Seek};
//!
//! # async fn example() -> Result<(), ferrolog_client::Error> {
//! let meta = MetadataCache::new(ClientConfig::from_list("127.0.0.1:9401,127.0.0.1:9402"))?;
//! let admin = Admin::new(meta.clone());
//! admin.create_topic("events", 3, 3).await?;
//! admin.wait_for_leaders("events", Duration::from_secs(30)).await?;
//!
//! let producer = Producer::new(meta.clone(), ProducerConfig::default())?;
//! // `send` enqueues at once; the delivery resolves when a majority stored the record.
//! let delivery = producer.send("events", Record::new("hello").with_key("user-1"));
//! let stored = delivery.await?;
//! println!("partition {} offset {}", stored.partition, stored.offset);
//! producer.close().await;
//!
//! let mut consumer = Consumer::new(meta, ConsumerConfig::default());
//! consumer.assign_topic("events", Seek::Earliest, Duration::from_secs(10)).await?;
//! for r in consumer.poll(Duration::from_secs(1)).await? {
//!     println!("{}/{} {:?}", r.partition, r.offset, r.value);
//! }
//! # Ok(())
//! # }
//! ```

pub mod admin;
pub mod assignor;
pub mod consumer;
pub mod error;
pub mod group;
pub mod group_consumer;
pub mod metadata;
pub mod partitioner;
pub mod producer;
pub mod rebalance;
pub mod record;
pub mod retry;

pub use admin::Admin;
pub use consumer::{Consumer, ConsumerConfig, OnTopicRecreated, Seek, TopicRestart};
pub use error::{Error, Result};
pub use ferrolog_proto::TopicId;
pub use group::Groups;
pub use group_consumer::{
    AutoOffsetReset, EVENTS_KEPT_MAX, GroupConsumer, GroupConsumerConfig, RebalanceEvent,
};
pub use metadata::{ClientConfig, MetadataCache};
pub use producer::{Delivery, Producer, ProducerConfig};
pub use record::{ConsumerRecord, Header, Record, RecordMetadata};

//! CreateTopics, DeleteTopics, CreatePartitions and DescribeConfigs: the
//! same controller operations as the gRPC API's.

use kafka_protocol::ResponseError;
use kafka_protocol::messages::TopicName;
use kafka_protocol::messages::create_partitions_request::CreatePartitionsRequest;
use kafka_protocol::messages::create_partitions_response::{
    CreatePartitionsResponse, CreatePartitionsTopicResult,
};
use kafka_protocol::messages::create_topics_request::CreateTopicsRequest;
use kafka_protocol::messages::create_topics_response::{CreatableTopicResult, CreateTopicsResponse};
use kafka_protocol::messages::delete_topics_request::DeleteTopicsRequest;
use kafka_protocol::messages::delete_topics_response::{DeletableTopicResult, DeleteTopicsResponse};
use kafka_protocol::messages::describe_configs_request::DescribeConfigsRequest;
use kafka_protocol::messages::describe_configs_response::{
    DescribeConfigsResourceResult, DescribeConfigsResponse, DescribeConfigsResult,
};
use kafka_protocol::protocol::StrBytes;
use uuid::Uuid;

use super::{KafkaService, errors, metadata};
use crate::error::ApiError;
use crate::metadata::topic_config::{self, ConfigSource};

/// Replication factor of a topic created with -1 (Kafka's
/// `default.replication.factor`): 3, or every broker of a smaller cluster.
const DEFAULT_REPLICATION_FACTOR: u32 = 3;

/// Why CreateTopics and CreatePartitions refuse explicit assignments.
const NO_ASSIGNMENTS: &str = "explicit replica assignments are not taken: the controller places replicas";

/// Kafka's resource type of a topic in DescribeConfigs.
const TOPIC_RESOURCE: i8 = 2;

/// Longest wait, ms, for the leaders of new partitions, whatever the
/// request's `timeout_ms` asks: well below the 30 s request timeouts of
/// Kafka's clients, so the answer is not taken for a lost one (a retry
/// would then find `TOPIC_ALREADY_EXISTS`).
const LEADERS_WAIT_MS_MAX: i32 = 10_000;

/// How often the wait for leaders looks again.
const LEADERS_POLL: std::time::Duration = std::time::Duration::from_millis(20);

fn message(e: &ApiError) -> Option<StrBytes> {
    Some(StrBytes::from_string(e.to_string()))
}

/// The wait for leaders a request's `timeout_ms` allows (at most
/// [`LEADERS_WAIT_MS_MAX`]); none when it is 0 or less, which asks for no
/// wait (as Kafka's CreateTopics and CreatePartitions read it).
fn leaders_wait(timeout_ms: i32) -> Option<std::time::Duration> {
    let ms = u64::try_from(timeout_ms.min(LEADERS_WAIT_MS_MAX)).ok().filter(|&ms| ms > 0)?;
    Some(std::time::Duration::from_millis(ms))
}

/// The deadline of [`leaders_wait`] from now.
fn leaders_deadline(timeout_ms: i32) -> Option<tokio::time::Instant> {
    leaders_wait(timeout_ms).map(|w| tokio::time::Instant::now() + w)
}

/// New partitions whose leaders a request waits for: partitions
/// `from..to` of topic `name`.
struct NewPartitions {
    name: String,
    from: usize,
    to: usize,
}

/// Waits until a Metadata answer from this broker would name a leader for
/// every partition of `new` ([`metadata::named_leader`]), or until
/// `deadline` (none: no wait). Kafka's controller names a new partition's
/// leader when it creates it; here each new partition is a Raft group that
/// elects one first, so without the wait a client's Metadata request just
/// after CreateTopics or CreatePartitions would find
/// `LEADER_NOT_AVAILABLE` (kafkajs 2.2.4's admin client then fails
/// `fetchTopicMetadata` outright). Other brokers learn the leaders soon
/// after, not necessarily before the answer. A topic deleted meanwhile (or
/// deleted and created again) is waited for no more. Reaching the deadline
/// is not an error: the topics are created either way.
async fn await_leaders(
    s: &KafkaService,
    mut new: Vec<NewPartitions>,
    deadline: Option<tokio::time::Instant>,
) {
    let Some(deadline) = deadline else { return };
    // The topic id each was first seen with.
    let mut seen: Vec<Option<u128>> = vec![None; new.len()];
    loop {
        let image = s.core.controller.image();
        let listed = metadata::listed_ids(s, &image);
        let mut i = 0;
        while i < new.len() {
            let n = &new[i];
            let ready = match image.topics.get(&n.name) {
                // Not in this broker's image yet, or deleted since.
                None => seen[i].is_some(),
                // Deleted and created again meanwhile: not the one asked.
                Some(t) if seen[i].is_some_and(|id| id != t.topic_id.0) => true,
                Some(t) => {
                    seen[i] = Some(t.topic_id.0);
                    t.partitions.len() >= n.to
                        && t.partitions[n.from..n.to]
                            .iter()
                            .all(|a| metadata::named_leader(s, a, &listed) != 0)
                }
            };
            if ready {
                new.swap_remove(i);
                seen.swap_remove(i);
            } else {
                i += 1;
            }
        }
        if new.is_empty() || tokio::time::Instant::now() + LEADERS_POLL > deadline {
            return;
        }
        tokio::time::sleep(LEADERS_POLL).await;
    }
}

/// Answers CreateTopics. `num_partitions` -1 is 1 (Kafka's
/// `num.partitions`); `replication_factor` -1 is 3, or the number of
/// brokers when fewer. Explicit replica assignments are refused
/// (`INVALID_REPLICA_ASSIGNMENT`): placement is the controller's. Every
/// topic is created first; then the answer waits until their partitions
/// have leaders, or for the request's `timeout_ms` (see [`await_leaders`]).
pub async fn create_topics(s: &KafkaService, r: CreateTopicsRequest) -> CreateTopicsResponse {
    let deadline = leaders_deadline(r.timeout_ms);
    // Every topic is created first, then the leaders of all are awaited
    // together against the one deadline.
    let mut results = Vec::with_capacity(r.topics.len());
    let mut new = Vec::new();
    for t in r.topics {
        let name = t.name.0.to_string();
        // Partitions to wait leaders for (-1 is 1; a bad count is refused).
        let want = usize::try_from(t.num_partitions).unwrap_or(1).max(1);
        let result: Result<(), ApiError> = async {
            if !t.assignments.is_empty() {
                return Err(ApiError::InvalidReplicaAssignment(NO_ASSIGNMENTS.into()));
            }
            let partitions = match t.num_partitions {
                -1 => 1,
                n => u32::try_from(n).map_err(|_| ApiError::InvalidPartitions(format!("{n} partitions")))?,
            };
            let replication_factor = match t.replication_factor {
                -1 => {
                    let brokers =
                        s.core.controller.image().brokers.values().filter(|b| !b.decommissioned).count();
                    DEFAULT_REPLICATION_FACTOR.min(u32::try_from(brokers).unwrap_or(1).max(1))
                }
                n => u32::try_from(n)
                    .map_err(|_| ApiError::InvalidReplicationFactor(format!("replication factor {n}")))?,
            };
            let mut config = std::collections::BTreeMap::new();
            for c in &t.configs {
                let Some(v) = &c.value else {
                    return Err(ApiError::InvalidConfig(format!("{} has a null value", &*c.name)));
                };
                config.insert(c.name.to_string(), v.to_string());
            }
            if r.validate_only {
                crate::metadata::controller::validate_topic_name(&name)?;
                topic_config::check_overrides(&config).map_err(ApiError::InvalidConfig)?;
                return Ok(());
            }
            s.core.create_topic_op(name.clone(), partitions, replication_factor, config).await
        }
        .await;
        if result.is_ok() && !r.validate_only {
            new.push(NewPartitions { name: name.clone(), from: 0, to: want });
        }
        results.push((t.name, name, result));
    }
    await_leaders(s, new, deadline).await;
    let mut out = Vec::with_capacity(results.len());
    for (topic, name, result) in results {
        let mut res = CreatableTopicResult::default()
            .with_name(topic)
            .with_num_partitions(-1)
            .with_replication_factor(-1);
        match result {
            Ok(()) => {
                if let Some(e) = s.core.controller.image().topics.get(&name) {
                    res = res
                        .with_topic_id(Uuid::from_u128(e.topic_id.0))
                        .with_num_partitions(e.partitions.len() as i32)
                        .with_replication_factor(i16::try_from(e.replication_factor).unwrap_or(-1));
                }
            }
            Err(e) => res = res.with_error_code(errors::code(&e)).with_error_message(message(&e)),
        }
        out.push(res);
    }
    CreateTopicsResponse::default().with_topics(out)
}

/// Answers DeleteTopics, by name (v0–v5 names; v6 names or topic ids).
pub async fn delete_topics(s: &KafkaService, r: DeleteTopicsRequest) -> DeleteTopicsResponse {
    let mut targets: Vec<(Option<String>, Uuid)> =
        r.topic_names.iter().map(|n| (Some(n.0.to_string()), Uuid::nil())).collect();
    targets.extend(r.topics.iter().map(|t| (t.name.as_ref().map(|n| n.0.to_string()), t.topic_id)));
    let mut out = Vec::with_capacity(targets.len());
    for (name, id) in targets {
        let image = s.core.controller.image();
        let name = name.or_else(|| {
            image.topics.iter().find(|(_, t)| Uuid::from_u128(t.topic_id.0) == id).map(|(n, _)| n.clone())
        });
        let res = DeletableTopicResult::default()
            .with_name(name.clone().map(|n| TopicName(StrBytes::from_string(n))))
            .with_topic_id(id);
        let result = match name {
            Some(n) => s.core.delete_topic_op(n).await,
            None => Err(ApiError::UnknownTopicId { topic: String::new(), id: id.to_string(), current: None }),
        };
        out.push(match result {
            Ok(()) => res,
            Err(e) => res.with_error_code(errors::code(&e)).with_error_message(message(&e)),
        });
    }
    DeleteTopicsResponse::default().with_responses(out)
}

/// Answers CreatePartitions. Explicit assignments are refused, as for
/// CreateTopics. Answers once every new partition has a leader, or after
/// the request's `timeout_ms` (see [`await_leaders`]).
pub async fn create_partitions(s: &KafkaService, r: CreatePartitionsRequest) -> CreatePartitionsResponse {
    let deadline = leaders_deadline(r.timeout_ms);
    let mut out = Vec::with_capacity(r.topics.len());
    let mut new = Vec::new();
    for t in r.topics {
        let result = async {
            if t.assignments.is_some() {
                return Err(ApiError::InvalidReplicaAssignment(NO_ASSIGNMENTS.into()));
            }
            let count = u32::try_from(t.count)
                .map_err(|_| ApiError::InvalidPartitions(format!("{} partitions", t.count)))?;
            if r.validate_only {
                return Ok(());
            }
            let name = t.name.0.to_string();
            // The partitions there before (as this broker knows them; the
            // controller refuses a count that does not grow the topic).
            let before = s.core.controller.image().topics.get(&name).map_or(0, |e| e.partitions.len());
            s.core.create_partitions_op(name.clone(), count).await?;
            new.push(NewPartitions { name, from: before.min(count as usize), to: count as usize });
            Ok(())
        }
        .await;
        let res = CreatePartitionsTopicResult::default().with_name(t.name);
        out.push(match result {
            Ok(()) => res,
            Err(e) => res.with_error_code(errors::code(&e)).with_error_message(message(&e)),
        });
    }
    await_leaders(s, new, deadline).await;
    CreatePartitionsResponse::default().with_results(out)
}

/// Answers DescribeConfigs for topics: every key Ferrolog knows, with its
/// effective value and source. Other resource types (brokers, loggers) get
/// `INVALID_REQUEST`.
pub async fn describe_configs(s: &KafkaService, r: DescribeConfigsRequest) -> DescribeConfigsResponse {
    let mut out = Vec::with_capacity(r.resources.len());
    for res in r.resources {
        let result = DescribeConfigsResult::default()
            .with_resource_type(res.resource_type)
            .with_resource_name(res.resource_name.clone());
        if res.resource_type != TOPIC_RESOURCE {
            out.push(
                result
                    .with_error_code(ResponseError::InvalidRequest.code())
                    .with_error_message(Some(StrBytes::from_static_str("only topic configs are described"))),
            );
            continue;
        }
        match s.core.topic_overrides(res.resource_name.to_string()).await {
            Ok(overrides) => {
                let wanted = res.configuration_keys.as_ref();
                let configs = s
                    .core
                    .topic_defaults
                    .effective(&overrides)
                    .into_iter()
                    .filter(|e| wanted.is_none_or(|w| w.iter().any(|k| &**k == e.name)))
                    .map(|e| {
                        let mut c = DescribeConfigsResourceResult::default()
                            .with_name(StrBytes::from_static_str(e.name))
                            .with_value(Some(StrBytes::from_string(e.value)))
                            // Kafka's ConfigSource: 1 topic, 4 static broker, 5 default.
                            .with_config_source(match e.source {
                                ConfigSource::Topic => 1,
                                ConfigSource::Broker => 4,
                                ConfigSource::Default => 5,
                            });
                        if r.include_documentation {
                            c = c.with_documentation(
                                topic_config::spec(e.name).map(|s| StrBytes::from_static_str(s.doc)),
                            );
                        }
                        c
                    })
                    .collect();
                out.push(result.with_configs(configs));
            }
            Err(e) => out.push(result.with_error_code(errors::code(&e)).with_error_message(message(&e))),
        }
    }
    DescribeConfigsResponse::default().with_results(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_of_zero_or_less_waits_not_and_a_long_one_is_capped() {
        let ms = |t: i32| leaders_wait(t).map(|d| d.as_millis());
        assert_eq!(ms(0), None);
        assert_eq!(ms(-1), None);
        assert_eq!(ms(i32::MIN), None);
        assert_eq!(ms(1), Some(1));
        assert_eq!(ms(5_000), Some(5_000));
        assert_eq!(ms(LEADERS_WAIT_MS_MAX + 1), Some(LEADERS_WAIT_MS_MAX as u128));
        assert_eq!(ms(i32::MAX), Some(LEADERS_WAIT_MS_MAX as u128));
    }
}

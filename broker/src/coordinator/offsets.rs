//! The offset calls of the group coordinator (OffsetCommit, OffsetFetch,
//! DescribeGroup, DeleteGroup, ListGroups) and the expiry of offsets.

use tokio::time::Instant;

use ferrolog_proto::TopicId;
use ferrolog_proto::client::Record;

use super::membership::Membership;
use super::records::{self, Committed};
use super::session::Session;
use super::state;
use super::{
    CommitRequest, CommittedOffset, Coordinator, GroupDescription, MemberDescription, OFFSETS_TOPIC,
};
use crate::error::ApiError;
use crate::metadata::controller::now_ms;
use crate::metadata::image::MetadataImage;

impl Coordinator {
    /// Removes expired offsets ([`Groups::expired`]: empty groups past
    /// `offsets_retention_minutes`, offsets of deleted topics) from every
    /// coordinator partition led here, with tombstones. Each partition is
    /// judged on a metadata image confirmed current with the controller
    /// while the partition is held (a topic created since an earlier look
    /// is not taken for deleted); skipped when none can be had.
    pub(super) async fn expire_offsets(self) {
        let image = self.controller.image();
        let Some(topic) = image.topics.get(OFFSETS_TOPIC) else { return };
        let retention_ms =
            i64::try_from(self.config.offsets_retention_minutes.saturating_mul(60_000)).unwrap_or(i64::MAX);
        for (index, a) in topic.partitions.iter().enumerate() {
            if !self.groups.is_led(a.group) {
                continue;
            }
            let Some(partition) = self.groups.partition_of(a.group) else { continue };
            let Ok(mut s) = self.open(partition, index as u32, a.group, image.clone()).await else {
                continue;
            };
            // Confirmed while the partition is held: every commit made so
            // far was made against metadata no newer than this.
            let Ok(confirmed) = self.controller.current_image().await else { continue };
            let image = confirmed.image;
            let now = now_ms();
            let gone = s.groups().expired(now, retention_ms, |t| image.topics.get(t).map(|e| e.topic_id));
            if gone.is_empty() {
                continue;
            }
            let rows: Vec<Record> = gone
                .iter()
                .map(|(g, what)| match what {
                    Some((t, p)) => records::offset_record(g, t, *p, None, now),
                    None => records::group_record(g, None, now),
                })
                .collect();
            let n = rows.len();
            match s.append_all(rows, &self.limits).await.err() {
                None => {
                    tracing::info!("{OFFSETS_TOPIC}-{index}: removed {n} expired offsets and group records")
                }
                Some(e) => tracing::warn!("{OFFSETS_TOPIC}-{index}: removing expired offsets: {e}"),
            }
        }
    }

    /// Commits `offsets` for `group` (Kafka's OffsetCommit): checks the
    /// member (id, instance id) and generation ([`super::state::Groups::check_member`]) for the whole
    /// request, then each partition (topic exists, metadata size, not
    /// backwards unless `allow_backwards`); the partitions that pass are
    /// written in one batch, acknowledged once a majority stored it.
    /// Returns each partition's outcome, `None` when committed.
    ///
    /// # Errors
    /// Group-level: see [`ApiError::NotCoordinator`],
    /// [`ApiError::UnknownMemberId`], [`ApiError::IllegalGeneration`],
    /// storage and availability errors (the commit may still have been
    /// stored: commit again).
    pub async fn commit(
        &self,
        group: &str,
        generation: i32,
        member: (&str, Option<&str>),
        offsets: Vec<CommitRequest>,
        allow_backwards: bool,
    ) -> Result<Vec<(CommitRequest, Option<ApiError>)>, ApiError> {
        let mut s = self.session(group).await?;
        s.groups_mut().check_member(group, generation, member.0, member.1, Instant::now())?;
        // A topic this broker's metadata does not know, or knows under
        // another id than the caller: the controller's current word decides.
        let unsure = offsets.iter().any(|c| match s.image.topics.get(&c.topic) {
            None => true,
            Some(t) => c.topic_id.is_some_and(|id| id != t.topic_id),
        });
        if unsure && let Ok(confirmed) = self.controller.current_image().await {
            s.image = confirmed.image;
        }
        let now = now_ms();
        let mut seen = std::collections::HashSet::new();
        let mut rows = Vec::new();
        let mut results = Vec::with_capacity(offsets.len());
        for c in offsets {
            let verdict = if seen.insert((c.topic.clone(), c.partition)) {
                self.check_commit(&s, group, &c, allow_backwards)
            } else {
                Err(ApiError::Invalid(format!("{}/{} is named twice in one commit", c.topic, c.partition)))
            };
            match verdict {
                Ok(topic_id) => {
                    let value = Committed {
                        offset: c.offset,
                        metadata: c.metadata.clone(),
                        commit_timestamp_ms: now,
                        topic_id: Some(topic_id),
                    };
                    rows.push(records::offset_record(group, &c.topic, c.partition, Some(&value), now));
                    results.push((c, None));
                }
                Err(e) => results.push((c, Some(e))),
            }
        }
        if !rows.is_empty() {
            s.append(rows, &self.limits).await?;
        }
        Ok(results)
    }

    /// One partition's commit checks; the topic's current id.
    pub(super) fn check_commit(
        &self,
        s: &Session,
        group: &str,
        c: &CommitRequest,
        allow_backwards: bool,
    ) -> Result<TopicId, ApiError> {
        let t = s.image.topics.get(&c.topic);
        if let Some(id) = c.topic_id
            && t.is_none_or(|t| t.topic_id != id)
        {
            return Err(ApiError::UnknownTopicId {
                topic: c.topic.clone(),
                id: id.to_string(),
                current: t.map(|t| t.topic_id.to_string()),
            });
        }
        let t = t.ok_or_else(|| ApiError::UnknownTopic(c.topic.clone()))?;
        if c.partition as usize >= t.partitions.len() {
            return Err(ApiError::UnknownTopic(format!("{} has no partition {}", c.topic, c.partition)));
        }
        if c.metadata.len() > self.config.offset_metadata_max_bytes {
            return Err(ApiError::OffsetMetadataTooLarge(format!(
                "{} bytes; the limit, groups.offset_metadata_max_bytes, is {}",
                c.metadata.len(),
                self.config.offset_metadata_max_bytes
            )));
        }
        s.groups().check_forward(group, &c.topic, c.partition, t.topic_id, c.offset, allow_backwards)?;
        Ok(t.topic_id)
    }

    /// `group`'s committed offsets (Kafka's OffsetFetch): for `partitions`
    /// (topic, partition, the topic id the caller reads if it says), or
    /// every partition it has one for when empty. Offsets of another
    /// incarnation of the topic than the caller's (or, when it does not
    /// say, than the one this broker knows) are not answered (KIP-516).
    ///
    /// # Errors
    /// As [`Coordinator::commit`]'s group-level errors.
    pub async fn fetch(
        &self,
        group: &str,
        partitions: Vec<(String, u32, Option<TopicId>)>,
    ) -> Result<Vec<CommittedOffset>, ApiError> {
        let s = self.session(group).await?;
        let g = s.groups().get(group);
        if partitions.is_empty() {
            return Ok(g.map(|g| current_offsets(g, &s.image)).unwrap_or_default());
        }
        Ok(partitions
            .into_iter()
            .map(|(topic, partition, asked)| {
                // The incarnation the caller reads, else the one known here.
                let id = asked.or_else(|| s.image.topics.get(&topic).map(|t| t.topic_id));
                let committed = id.and_then(|id| g.and_then(|g| g.committed(&topic, partition, id)).cloned());
                CommittedOffset { topic, partition, committed }
            })
            .collect())
    }

    /// `group`'s state, members and offsets (Kafka's DescribeGroups).
    ///
    /// # Errors
    /// [`ApiError::GroupIdNotFound`] for a group with neither members nor
    /// offsets; as [`Coordinator::commit`]'s group-level errors.
    pub async fn describe(&self, group: &str) -> Result<GroupDescription, ApiError> {
        let s = self.session(group).await?;
        let g = s
            .groups()
            .get(group)
            .filter(|g| !g.is_unused())
            .ok_or_else(|| ApiError::GroupIdNotFound(group.to_owned()))?;
        Ok(describe(group, g, &s.image))
    }

    /// Deletes `group`: tombstones for its offsets and its membership
    /// record (Kafka's DeleteGroups).
    ///
    /// # Errors
    /// [`ApiError::NonEmptyGroup`] while it has members;
    /// [`ApiError::GroupIdNotFound`]; as [`Coordinator::commit`]'s
    /// group-level errors.
    pub async fn delete(&self, group: &str) -> Result<(), ApiError> {
        let mut s = self.session(group).await?;
        let g = s.groups().get(group).ok_or_else(|| ApiError::GroupIdNotFound(group.to_owned()))?;
        if g.members() > 0 {
            return Err(ApiError::NonEmptyGroup(group.to_owned()));
        }
        let now = now_ms();
        let mut rows: Vec<Record> =
            g.offsets.keys().map(|(t, p)| records::offset_record(group, t, *p, None, now)).collect();
        rows.push(records::group_record(group, None, now));
        s.append_all(rows, &self.limits).await
    }

    /// Deletes `group`'s committed offsets of `topics` (each with its
    /// partitions; Kafka's OffsetDelete, KIP-496), with tombstones, as
    /// Kafka's coordinator does: a group without members loses the offsets
    /// asked; a "consumer" group with members keeps those of topics a
    /// member subscribes to ([`ApiError::GroupSubscribedToTopic`] for them)
    /// and loses the rest; a group with members of another protocol type
    /// keeps all ([`ApiError::NonEmptyGroup`]). A partition with no
    /// committed offset is answered as deleted. A group without members
    /// left with no offsets is deleted too (its group record tombstoned, as
    /// Kafka's `cleanupGroupMetadata` does). Returns the outcome of each
    /// partition asked, parallel to `topics` (`None`: deleted).
    ///
    /// # Errors
    /// [`ApiError::GroupIdNotFound`]; [`ApiError::NonEmptyGroup`]; as
    /// [`Coordinator::commit`]'s group-level errors.
    pub async fn delete_offsets(
        &self,
        group: &str,
        topics: &[(String, Vec<u32>)],
    ) -> Result<Vec<Vec<Option<ApiError>>>, ApiError> {
        let mut s = self.session(group).await?;
        let g = s
            .groups()
            .get(group)
            .filter(|g| !g.is_unused())
            .ok_or_else(|| ApiError::GroupIdNotFound(group.to_owned()))?;
        // `Some(set)`: the topics members subscribe to, whose offsets stay;
        // `None`: the group has no members and every offset may go.
        let subscribed: Option<std::collections::BTreeSet<String>> = match g.live.as_ref() {
            Some(live) if !live.is_empty() => {
                if live.protocol_type() != "consumer" {
                    return Err(ApiError::NonEmptyGroup(group.to_owned()));
                }
                // Metadata that does not decode: any topic may be subscribed.
                Some(
                    live.subscribed_topics()
                        .unwrap_or_else(|| topics.iter().map(|(t, _)| t.clone()).collect()),
                )
            }
            _ => None,
        };
        let now = now_ms();
        let mut rows = Vec::new();
        let mut gone = std::collections::HashSet::new();
        let mut results = Vec::with_capacity(topics.len());
        for (topic, partitions) in topics {
            if subscribed.as_ref().is_some_and(|t| t.contains(topic)) {
                let why = format!("a member of group {group:?} subscribes to {topic:?}");
                results.push(vec![Some(ApiError::GroupSubscribedToTopic(why)); partitions.len()]);
                continue;
            }
            // The partitions of `topic` the group has an offset for.
            let committed: std::collections::HashSet<u32> = g
                .offsets
                .range((topic.clone(), 0)..=(topic.clone(), u32::MAX))
                .map(|((_, p), _)| *p)
                .collect();
            for p in partitions {
                if committed.contains(p) && gone.insert((topic.as_str(), *p)) {
                    rows.push(records::offset_record(group, topic, *p, None, now));
                }
            }
            results.push(vec![None; partitions.len()]);
        }
        // Kafka writes the group tombstone only for a group it had a record
        // of; offsets of deleted topics still held (until expiry removes
        // them) keep the group, as they are still offsets.
        if subscribed.is_none() && g.meta.is_some() && !rows.is_empty() && gone.len() == g.offsets.len() {
            rows.push(records::group_record(group, None, now));
        }
        s.append_all(rows, &self.limits).await?;
        Ok(results)
    }

    /// The groups of every [`OFFSETS_TOPIC`] partition this broker leads
    /// (Kafka's ListGroups: a client asks every broker), and an error
    /// naming the partitions led here that could not be read now (their
    /// groups are missing from the list: Kafka answers
    /// `COORDINATOR_LOAD_IN_PROGRESS` then).
    pub async fn list(&self) -> (Vec<GroupDescription>, Option<ApiError>) {
        let image = self.controller.image();
        let Some(topic) = image.topics.get(OFFSETS_TOPIC) else { return (Vec::new(), None) };
        let mut out = Vec::new();
        let mut unread = Vec::new();
        for (index, a) in topic.partitions.iter().enumerate() {
            if !self.groups.is_led(a.group) {
                continue;
            }
            let Some(partition) = self.groups.partition_of(a.group) else { continue };
            match self.open(partition, index as u32, a.group, image.clone()).await {
                Ok(s) => out.extend(
                    s.groups()
                        .iter()
                        .filter(|(_, g)| !g.is_unused())
                        .map(|(id, g)| describe(id, g, &s.image)),
                ),
                Err(e) => unread.push(format!("{OFFSETS_TOPIC}-{index}: {e}")),
            }
        }
        let error = (!unread.is_empty()).then(|| {
            ApiError::CoordinatorLoadInProgress(format!(
                "groups of these partitions are missing: {}",
                unread.join("; ")
            ))
        });
        (out, error)
    }
}

/// `g`'s committed offsets of current topic incarnations.
fn current_offsets(g: &state::Group, image: &MetadataImage) -> Vec<CommittedOffset> {
    g.offsets
        .iter()
        .filter(|((t, _), c)| image.topics.get(t).is_some_and(|e| Some(e.topic_id) == c.topic_id))
        .map(|((t, p), c)| CommittedOffset { topic: t.clone(), partition: *p, committed: Some(c.clone()) })
        .collect()
}

fn describe(id: &str, g: &state::Group, image: &MetadataImage) -> GroupDescription {
    let live = g.live.as_ref();
    let members = live
        .map(Membership::describe)
        .unwrap_or_default()
        .into_iter()
        .map(|m| MemberDescription {
            id: m.id,
            client_id: m.client_id,
            instance_id: m.instance_id,
            metadata: m.metadata,
            assignment: m.assignment,
        })
        .collect();
    GroupDescription {
        group: id.to_owned(),
        state: g.phase().name(),
        generation: g.generation(),
        protocol: live.map(|l| l.protocol().to_owned()).unwrap_or_default(),
        protocol_type: live
            .map(|l| l.protocol_type())
            .or_else(|| g.meta.as_ref().map(|m| m.protocol_type.as_str()))
            .unwrap_or_default()
            .to_owned(),
        members,
        offsets: current_offsets(g, image),
    }
}

//! One group's membership: Kafka's classic group protocol (the
//! `GroupCoordinator` of Kafka before KIP-848) as a state machine over
//! explicit time, so its rules are tested without a cluster.
//!
//! ```text
//!   Empty ──first JoinGroup──> PreparingRebalance ──every member rejoined, or the
//!     ^                          rebalance timeout──> CompletingRebalance ──leader's
//!     │                          (new generation,      SyncGroup──> Stable
//!     └── no member left ───────  persisted first)       │ a join, a leave, a session
//!                                                          └─ expiry ──> PreparingRebalance
//! ```
//!
//! The handlers ([`Membership::join`], [`Membership::sync`],
//! [`Membership::heartbeat`], [`Membership::leave`]) change memory only and
//! never wait; an answer that must wait for the rebalance is a
//! [`Waiting::Later`]. What must be stored before anyone learns of it (a new
//! generation, a complete assignment) comes out of [`Membership::step`] as
//! a [`Persist`]; the coordinator writes it to the group's partition and then
//! calls [`Membership::persisted`], which answers the waiting members. A
//! member therefore never sees a generation that a coordinator taking over
//! could not read back: generations only grow, and a commit from an evicted
//! member's generation is refused (`ILLEGAL_GENERATION`, `UNKNOWN_MEMBER_ID`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::consumer_protocol;
use super::records::{GroupMeta, MemberMeta};
use crate::error::ApiError;

/// The broker's bounds on members' timeouts (`[groups]` config).
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Kafka's `group.min.session.timeout.ms`.
    pub min_session: Duration,
    /// Kafka's `group.max.session.timeout.ms`.
    pub max_session: Duration,
    /// Kafka's `group.initial.rebalance.delay.ms`: how long the first
    /// rebalance of an empty group waits for more members.
    pub initial_delay: Duration,
}

/// Longest rebalance timeout a member may ask for (Kafka's field is an
/// int32 of ms; 1 day here, so a typo cannot park a rebalance for weeks).
pub const REBALANCE_TIMEOUT_MAX: Duration = Duration::from_secs(24 * 3600);

/// A JoinGroup request.
#[derive(Clone, Debug)]
pub struct JoinRequest {
    /// Empty on a member's first join.
    pub member_id: String,
    /// Static membership's instance id (KIP-345).
    pub instance_id: Option<String>,
    /// The client's self-given name.
    pub client_id: String,
    /// ms.
    pub session_timeout_ms: i32,
    /// ms.
    pub rebalance_timeout_ms: i32,
    /// "consumer" for consumers.
    pub protocol_type: String,
    /// Assignor names and the member's metadata for each, most preferred first.
    pub protocols: Vec<(String, Bytes)>,
}

/// What a member learns when its join completes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinResult {
    /// The new generation.
    pub generation: i32,
    /// The chosen assignor.
    pub protocol: String,
    /// The leader member's id.
    pub leader: String,
    /// This member's id.
    pub member_id: String,
    /// For the leader only: (member id, instance id, metadata for the chosen protocol).
    pub members: Vec<(String, Option<String>, Bytes)>,
}

/// What a member learns when the generation's assignment is in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncResult {
    /// The assignor.
    pub protocol: String,
    /// This member's assignment.
    pub assignment: Bytes,
}

/// An answer now, or one to wait for (the sender is dropped, and the
/// receiver errs, when the coordinator's state is dropped: the caller
/// answers `NOT_COORDINATOR`).
#[derive(Debug)]
pub enum Waiting<T> {
    /// Answered.
    Now(T),
    /// Answered when the rebalance reaches it.
    Later(oneshot::Receiver<Result<T, ApiError>>),
}

/// Kafka's group states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// No members.
    Empty,
    /// Waiting for members to (re)join.
    PreparingRebalance,
    /// A new generation waits for the leader's assignment.
    CompletingRebalance,
    /// Every member has its assignment.
    Stable,
}

impl Phase {
    /// Kafka's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Empty => "Empty",
            Phase::PreparingRebalance => "PreparingRebalance",
            Phase::CompletingRebalance => "CompletingRebalance",
            Phase::Stable => "Stable",
        }
    }
}

/// What [`Membership::step`] asks to store before it can go on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Persist {
    /// The record's value.
    pub meta: GroupMeta,
    /// What storing it completes.
    pub kind: PersistKind,
}

/// See [`Persist`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PersistKind {
    /// A new generation's members (answers the joins).
    Join,
    /// The generation's assignment (answers the syncs).
    Sync,
    /// A static member's new member id (answers its join).
    Replaced,
}

/// One member as DescribeGroups shows it.
#[derive(Clone, Debug)]
pub struct DescribedMember {
    /// Member id.
    pub id: String,
    /// The client's self-given name.
    pub client_id: String,
    /// Static membership's instance id (KIP-345).
    pub instance_id: Option<String>,
    /// Its metadata for the group's chosen protocol, as it sent it.
    pub metadata: Bytes,
    /// Its assignment, as the leader sent it (empty until then).
    pub assignment: Bytes,
}

#[derive(Debug)]
struct Member {
    instance_id: Option<String>,
    client_id: String,
    session: Duration,
    rebalance: Duration,
    protocols: Vec<(String, Bytes)>,
    assignment: Bytes,
    /// The session ends here unless a heartbeat (or another call) comes.
    expires: Instant,
    /// Rejoined in the rebalance under way.
    rejoined: bool,
    /// Order of first joining (the leader is the earliest).
    joined_seq: u64,
    join: Option<oneshot::Sender<Result<JoinResult, ApiError>>>,
    sync: Option<oneshot::Sender<Result<SyncResult, ApiError>>>,
}

impl Member {
    fn metadata(&self, protocol: &str) -> Bytes {
        self.protocols.iter().find(|(n, _)| n == protocol).map(|(_, m)| m.clone()).unwrap_or_default()
    }

    fn supports(&self, protocol: &str) -> bool {
        self.protocols.iter().any(|(n, _)| n == protocol)
    }

    /// Answers what it waits for with `e` (it left, or was replaced).
    fn fail_waiters(&mut self, e: &ApiError) {
        if let Some(tx) = self.join.take() {
            let _ = tx.send(Err(e.clone()));
        }
        if let Some(tx) = self.sync.take() {
            let _ = tx.send(Err(e.clone()));
        }
    }
}

/// One group's live membership (see the module docs).
#[derive(Debug)]
pub struct Membership {
    phase: Phase,
    generation: i32,
    protocol_type: String,
    protocol: String,
    leader: String,
    members: BTreeMap<String, Member>,
    /// Static members: instance id → member id.
    instances: HashMap<String, String>,
    /// PreparingRebalance: the join ends here at the latest, and not before
    /// `join_not_before` (the initial delay of an empty group).
    join_deadline: Instant,
    join_not_before: Instant,
    /// CompletingRebalance: the leader's assignment, to store.
    pending: Option<BTreeMap<String, Bytes>>,
    /// A static member's new id is to be stored.
    replaced: bool,
    next_seq: u64,
}

impl Membership {
    /// A group without members, at `generation`.
    pub fn empty(generation: i32, now: Instant) -> Self {
        Membership {
            phase: Phase::Empty,
            generation,
            protocol_type: String::new(),
            protocol: String::new(),
            leader: String::new(),
            members: BTreeMap::new(),
            instances: HashMap::new(),
            join_deadline: now,
            join_not_before: now,
            pending: None,
            replaced: false,
            next_seq: 0,
        }
    }

    /// The membership a stored record describes, as a coordinator that
    /// has just read it takes it over at `now`: every member's session
    /// starts again; a generation whose assignment was not stored is
    /// rebalanced again (its members rejoin).
    pub fn from_meta(meta: &GroupMeta, now: Instant) -> Self {
        let mut m = Membership::empty(meta.generation, now);
        if meta.members.is_empty() {
            return m;
        }
        m.protocol_type.clone_from(&meta.protocol_type);
        m.protocol.clone_from(&meta.protocol);
        m.leader.clone_from(&meta.leader);
        for (seq, r) in meta.members.iter().enumerate() {
            let session = Duration::from_millis(u64::try_from(r.session_timeout_ms).unwrap_or(0));
            let rebalance = Duration::from_millis(u64::try_from(r.rebalance_timeout_ms).unwrap_or(0));
            if let Some(i) = &r.instance_id {
                m.instances.insert(i.clone(), r.id.clone());
            }
            m.members.insert(
                r.id.clone(),
                Member {
                    instance_id: r.instance_id.clone(),
                    client_id: r.client_id.clone(),
                    session,
                    rebalance,
                    protocols: vec![(meta.protocol.clone(), r.subscription.clone())],
                    assignment: r.assignment.clone(),
                    expires: now + session,
                    rejoined: false,
                    joined_seq: seq as u64,
                    join: None,
                    sync: None,
                },
            );
        }
        m.next_seq = meta.members.len() as u64;
        if meta.assignment_complete {
            m.phase = Phase::Stable;
        } else {
            m.prepare(now);
        }
        m
    }

    /// The record describing this membership now; `complete` when the
    /// assignment is in.
    fn to_meta(&self, complete: bool, now_ms: i64) -> GroupMeta {
        GroupMeta {
            generation: self.generation,
            protocol: self.protocol.clone(),
            state_timestamp_ms: now_ms,
            protocol_type: self.protocol_type.clone(),
            leader: self.leader.clone(),
            members: self
                .members
                .iter()
                .map(|(id, m)| MemberMeta {
                    id: id.clone(),
                    instance_id: m.instance_id.clone(),
                    client_id: m.client_id.clone(),
                    session_timeout_ms: i32::try_from(m.session.as_millis()).unwrap_or(i32::MAX),
                    rebalance_timeout_ms: i32::try_from(m.rebalance.as_millis()).unwrap_or(i32::MAX),
                    subscription: m.metadata(&self.protocol),
                    assignment: if complete { m.assignment.clone() } else { Bytes::new() },
                })
                .collect(),
            assignment_complete: complete,
        }
    }

    /// Kafka's state.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The current generation.
    pub fn generation(&self) -> i32 {
        self.generation
    }

    /// The assignor in use ("" when empty).
    pub fn protocol(&self) -> &str {
        &self.protocol
    }

    /// The members' protocol type.
    pub fn protocol_type(&self) -> &str {
        &self.protocol_type
    }

    /// Member count.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether it has no members.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Each member as DescribeGroups shows it.
    pub fn describe(&self) -> Vec<DescribedMember> {
        self.members
            .iter()
            .map(|(id, m)| DescribedMember {
                id: id.clone(),
                client_id: m.client_id.clone(),
                instance_id: m.instance_id.clone(),
                metadata: m.metadata(&self.protocol),
                assignment: m.assignment.clone(),
            })
            .collect()
    }

    /// The topics the members subscribe to (the union), for a group of
    /// protocol type "consumer" whose protocol is chosen and whose every
    /// member's metadata decodes ([`consumer_protocol`]); `None` otherwise,
    /// which callers take as "may be subscribed to anything", as Kafka's
    /// `GroupMetadata.isSubscribedToTopic` does.
    pub fn subscribed_topics(&self) -> Option<BTreeSet<String>> {
        if self.protocol_type != "consumer" || self.protocol.is_empty() {
            return None;
        }
        let mut topics = BTreeSet::new();
        for m in self.members.values() {
            topics.extend(consumer_protocol::subscribed_topics(&m.metadata(&self.protocol))?);
        }
        Some(topics)
    }

    /// Every member and its metadata for the chosen protocol (the leader's
    /// JoinGroup answer).
    fn join_members(&self) -> Vec<(String, Option<String>, Bytes)> {
        self.members
            .iter()
            .map(|(id, m)| (id.clone(), m.instance_id.clone(), m.metadata(&self.protocol)))
            .collect()
    }

    /// When the rebalance under way ends at the latest (a join's answer
    /// comes by then, once stored); `None` when none is under way.
    pub fn join_deadline(&self) -> Option<Instant> {
        (self.phase == Phase::PreparingRebalance).then_some(self.join_deadline)
    }

    /// Starts a rebalance at `now`: every member must rejoin; syncs
    /// waiting are told so.
    fn prepare(&mut self, now: Instant) {
        self.phase = Phase::PreparingRebalance;
        let longest = self.members.values().map(|m| m.rebalance).max().unwrap_or_default();
        self.join_deadline = now + longest;
        self.join_not_before = now;
        self.pending = None;
        let rebalancing = ApiError::RebalanceInProgress("the group is rebalancing: rejoin".into());
        for m in self.members.values_mut() {
            // One waiting in a join (a static member's return) has rejoined.
            m.rejoined = m.join.is_some();
            if let Some(tx) = m.sync.take() {
                let _ = tx.send(Err(rebalancing.clone()));
            }
        }
    }

    /// Finds the member a call names: by id, checking a static member's
    /// instance id (KIP-345).
    ///
    /// # Errors
    /// [`ApiError::FencedInstanceId`] when the instance id belongs to
    /// another member id now; [`ApiError::UnknownMemberId`].
    fn member_id_checked(&self, member: &str, instance: Option<&str>) -> Result<(), ApiError> {
        if let Some(i) = instance
            && let Some(current) = self.instances.get(i)
            && current != member
        {
            return Err(ApiError::FencedInstanceId(format!(
                "instance {i:?} is member {current:?} now; {member:?} was replaced by a newer instance"
            )));
        }
        if !self.members.contains_key(member) {
            return Err(ApiError::UnknownMemberId(format!("{member:?} is not a member of the group")));
        }
        Ok(())
    }

    /// Checks that a member call is of the current generation.
    ///
    /// # Errors
    /// [`ApiError::IllegalGeneration`].
    fn generation_checked(&self, generation: i32) -> Result<(), ApiError> {
        if generation == self.generation {
            return Ok(());
        }
        Err(ApiError::IllegalGeneration(format!(
            "generation {generation} is not the group's {}: the member was evicted or the group rebalanced",
            self.generation
        )))
    }

    /// Checks a JoinGroup's own fields.
    fn validate(req: &JoinRequest, bounds: &Bounds) -> Result<(Duration, Duration), ApiError> {
        let session = u64::try_from(req.session_timeout_ms).map(Duration::from_millis).ok();
        let session =
            session.filter(|s| *s >= bounds.min_session && *s <= bounds.max_session).ok_or_else(|| {
                ApiError::InvalidSessionTimeout(format!(
                    "session timeout {} ms is outside [{}, {}] ms (groups.min_session_timeout_ms, \
                 groups.max_session_timeout_ms)",
                    req.session_timeout_ms,
                    bounds.min_session.as_millis(),
                    bounds.max_session.as_millis()
                ))
            })?;
        let rebalance = u64::try_from(req.rebalance_timeout_ms).map(Duration::from_millis).ok();
        let rebalance = rebalance.filter(|r| !r.is_zero() && *r <= REBALANCE_TIMEOUT_MAX).ok_or_else(|| {
            ApiError::Invalid(format!(
                "rebalance timeout {} ms: it must be 1 ms to {} ms (Kafka's consumer sends max.poll.interval.ms)",
                req.rebalance_timeout_ms,
                REBALANCE_TIMEOUT_MAX.as_millis()
            ))
        })?;
        if req.protocol_type.is_empty() || req.protocols.is_empty() {
            return Err(ApiError::Invalid("a join needs a protocol type and at least one protocol".into()));
        }
        Ok((session, rebalance))
    }

    /// Handles a JoinGroup at `now`.
    ///
    /// # Errors
    /// [`ApiError::InvalidSessionTimeout`], [`ApiError::Invalid`] (the
    /// rebalance timeout, no protocol), [`ApiError::InconsistentGroupProtocol`],
    /// [`ApiError::UnknownMemberId`], [`ApiError::FencedInstanceId`].
    pub fn join(
        &mut self,
        req: JoinRequest,
        now: Instant,
        bounds: &Bounds,
    ) -> Result<Waiting<JoinResult>, ApiError> {
        self.join_with_id(req, now, bounds).map(|(_, w)| w)
    }

    /// [`Membership::join`], with the member id the join is for (given by
    /// the coordinator on a first join).
    ///
    /// # Errors
    /// As [`Membership::join`].
    pub fn join_with_id(
        &mut self,
        req: JoinRequest,
        now: Instant,
        bounds: &Bounds,
    ) -> Result<(String, Waiting<JoinResult>), ApiError> {
        let (session, rebalance) = Self::validate(&req, bounds)?;
        let others = self.members.iter().filter(|(id, _)| **id != req.member_id).map(|(_, m)| m);
        let mut others = others.peekable();
        if others.peek().is_some() {
            let same_type = req.protocol_type == self.protocol_type;
            let all: Vec<&Member> = others.collect();
            let common = req.protocols.iter().any(|(n, _)| all.iter().all(|m| m.supports(n)));
            if !same_type || !common {
                return Err(ApiError::InconsistentGroupProtocol(format!(
                    "the group's members use protocol type {:?} with other assignors than {:?}",
                    self.protocol_type,
                    req.protocols.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
                )));
            }
        }
        let (tx, rx) = oneshot::channel();
        if req.member_id.is_empty() {
            let id = format!(
                "{}-{}",
                if req.client_id.is_empty() { "member" } else { req.client_id.as_str() },
                ferrolog_proto::TopicId::v4_from_random(ferrolog_raft_store::runtime::random_u128())
            );
            let replaced = req.instance_id.as_ref().and_then(|i| self.instances.get(i).cloned());
            let mut member = Member {
                instance_id: req.instance_id.clone(),
                client_id: req.client_id.clone(),
                session,
                rebalance,
                protocols: req.protocols.clone(),
                assignment: Bytes::new(),
                expires: now + session,
                rejoined: true,
                joined_seq: self.next_seq,
                join: None,
                sync: None,
            };
            self.next_seq += 1;
            if let Some(old_id) = replaced {
                // A static member restarted (KIP-345): it takes the old
                // member's place and assignment; the old id is fenced.
                if let Some(mut old) = self.members.remove(&old_id) {
                    old.fail_waiters(&ApiError::FencedInstanceId(format!(
                        "a newer instance of {:?} joined",
                        req.instance_id.as_deref().unwrap_or_default()
                    )));
                    member.assignment = old.assignment.clone();
                    member.joined_seq = old.joined_seq;
                    if self.leader == old_id {
                        self.leader.clone_from(&id);
                    }
                    // Kafka's rule: the same assignor as the group's (its
                    // subscription may name other owned partitions now).
                    if self.phase == Phase::Stable && member.supports(&self.protocol) {
                        // Answered once the new id is stored
                        // ([`PersistKind::Replaced`]): a coordinator taking
                        // over must not bring the fenced id back.
                        member.join = Some(tx);
                        self.members.insert(id.clone(), member);
                        if let Some(i) = &req.instance_id {
                            self.instances.insert(i.clone(), id.clone());
                        }
                        self.replaced = true;
                        return Ok((id, Waiting::Later(rx)));
                    }
                }
            }
            member.join = Some(tx);
            if let Some(i) = &req.instance_id {
                self.instances.insert(i.clone(), id.clone());
            }
            if self.members.is_empty() {
                self.protocol_type.clone_from(&req.protocol_type);
            }
            self.members.insert(id.clone(), member);
            match self.phase {
                Phase::Empty => {
                    // The first rebalance of an empty group waits a little
                    // for the others (Kafka's group.initial.rebalance.delay.ms).
                    self.prepare(now);
                    self.join_not_before = now + bounds.initial_delay;
                    self.join_deadline = self.join_deadline.max(self.join_not_before);
                }
                Phase::CompletingRebalance | Phase::Stable => self.prepare(now),
                // Kafka: the rebalance's deadline was set when it began.
                Phase::PreparingRebalance => {}
            }
            // prepare() cleared every member's flag.
            for m in self.members.values_mut() {
                if m.join.is_some() {
                    m.rejoined = true;
                }
            }
            return Ok((id, Waiting::Later(rx)));
        }
        self.member_id_checked(&req.member_id, req.instance_id.as_deref())?;
        let unchanged = self.members.get(&req.member_id).is_some_and(|m| m.protocols == req.protocols);
        let is_leader = req.member_id == self.leader;
        // Kafka: a member that lost the answer to its join asks again; with
        // the same metadata it gets the generation under way (the leader,
        // its members, while the assignment is awaited) without another
        // rebalance.
        let current = match self.phase {
            Phase::CompletingRebalance if unchanged => Some(is_leader),
            Phase::Stable if unchanged && !is_leader => Some(false),
            _ => None,
        };
        if let Some(with_members) = current {
            let m = self.members.get_mut(&req.member_id).expect("checked above");
            m.expires = now + session;
            let members = if with_members { self.join_members() } else { Vec::new() };
            let result = JoinResult {
                generation: self.generation,
                protocol: self.protocol.clone(),
                leader: self.leader.clone(),
                member_id: req.member_id.clone(),
                members,
            };
            return Ok((req.member_id, Waiting::Now(result)));
        }
        if self.phase != Phase::PreparingRebalance {
            self.prepare(now);
        }
        let m = self.members.get_mut(&req.member_id).expect("checked above");
        m.protocols = req.protocols.clone();
        m.session = session;
        m.rebalance = rebalance;
        m.expires = now + session;
        m.rejoined = true;
        m.join = Some(tx);
        Ok((req.member_id, Waiting::Later(rx)))
    }

    /// Handles a SyncGroup: the leader's carries every member's assignment.
    ///
    /// # Errors
    /// [`ApiError::UnknownMemberId`], [`ApiError::FencedInstanceId`],
    /// [`ApiError::IllegalGeneration`], [`ApiError::RebalanceInProgress`].
    pub fn sync(
        &mut self,
        generation: i32,
        member: &str,
        instance: Option<&str>,
        assignments: Vec<(String, Bytes)>,
        now: Instant,
    ) -> Result<Waiting<SyncResult>, ApiError> {
        self.member_id_checked(member, instance)?;
        self.generation_checked(generation)?;
        match self.phase {
            Phase::Empty => Err(ApiError::UnknownMemberId(format!("{member:?}: the group has no members"))),
            Phase::PreparingRebalance => {
                Err(ApiError::RebalanceInProgress("the group is rebalancing: rejoin".into()))
            }
            Phase::Stable => {
                let m = self.members.get_mut(member).expect("checked above");
                m.expires = now + m.session;
                Ok(Waiting::Now(SyncResult {
                    protocol: self.protocol.clone(),
                    assignment: m.assignment.clone(),
                }))
            }
            Phase::CompletingRebalance => {
                let (tx, rx) = oneshot::channel();
                let m = self.members.get_mut(member).expect("checked above");
                m.expires = now + m.session;
                m.sync = Some(tx);
                if member == self.leader {
                    let mut by_member: BTreeMap<String, Bytes> =
                        self.members.keys().map(|id| (id.clone(), Bytes::new())).collect();
                    for (id, a) in assignments {
                        if let Some(slot) = by_member.get_mut(&id) {
                            *slot = a;
                        }
                    }
                    self.pending = Some(by_member);
                }
                Ok(Waiting::Later(rx))
            }
        }
    }

    /// Handles a Heartbeat: the member's session starts again (when its
    /// generation is the current one).
    ///
    /// # Errors
    /// [`ApiError::UnknownMemberId`], [`ApiError::FencedInstanceId`],
    /// [`ApiError::IllegalGeneration`]; [`ApiError::RebalanceInProgress`]
    /// while the group waits for its members to rejoin.
    pub fn heartbeat(
        &mut self,
        generation: i32,
        member: &str,
        instance: Option<&str>,
        now: Instant,
    ) -> Result<(), ApiError> {
        self.member_id_checked(member, instance)?;
        self.generation_checked(generation)?;
        let m = self.members.get_mut(member).expect("checked above");
        m.expires = now + m.session;
        if self.phase == Phase::PreparingRebalance {
            return Err(ApiError::RebalanceInProgress("the group is rebalancing: rejoin".into()));
        }
        Ok(())
    }

    /// Handles a LeaveGroup (by member id, or by instance id alone).
    ///
    /// # Errors
    /// [`ApiError::UnknownMemberId`], [`ApiError::FencedInstanceId`].
    pub fn leave(&mut self, member: &str, instance: Option<&str>, now: Instant) -> Result<(), ApiError> {
        let id = match (member.is_empty(), instance) {
            (true, Some(i)) => self
                .instances
                .get(i)
                .cloned()
                .ok_or_else(|| ApiError::UnknownMemberId(format!("no member has instance id {i:?}")))?,
            _ => {
                self.member_id_checked(member, instance)?;
                member.to_owned()
            }
        };
        self.remove(&id, &ApiError::UnknownMemberId(format!("{id:?} left the group")), now);
        Ok(())
    }

    fn remove(&mut self, id: &str, why: &ApiError, now: Instant) {
        if let Some(mut m) = self.members.remove(id) {
            m.fail_waiters(why);
            if let Some(i) = &m.instance_id {
                self.instances.remove(i);
            }
            if matches!(self.phase, Phase::Stable | Phase::CompletingRebalance) {
                self.prepare(now);
            }
        }
    }

    /// Checks an OffsetCommit's member and generation (Kafka's rules): a
    /// commit from outside any membership (generation < 0, no member id)
    /// only while the group has no members; otherwise a member of the
    /// current generation, not while the new generation waits for its
    /// assignment (a member of the generation being left may commit what
    /// it processed before it rejoins).
    ///
    /// # Errors
    /// [`ApiError::UnknownMemberId`], [`ApiError::FencedInstanceId`],
    /// [`ApiError::IllegalGeneration`], [`ApiError::RebalanceInProgress`].
    pub fn check_commit(
        &mut self,
        generation: i32,
        member: &str,
        instance: Option<&str>,
        now: Instant,
    ) -> Result<(), ApiError> {
        if generation < 0 && member.is_empty() {
            if self.members.is_empty() {
                return Ok(());
            }
            return Err(ApiError::UnknownMemberId(format!(
                "the group has {} members: a commit from outside the group (generation -1) is refused",
                self.members.len()
            )));
        }
        self.member_id_checked(member, instance)?;
        self.generation_checked(generation)?;
        if self.phase == Phase::CompletingRebalance {
            return Err(ApiError::RebalanceInProgress("the new generation waits for its assignment".into()));
        }
        let m = self.members.get_mut(member).expect("checked above");
        m.expires = now + m.session;
        Ok(())
    }

    /// Moves the group on at `now`: members whose session ended are
    /// removed; a join whose members are all in (or whose time is up)
    /// makes a new generation; a leader's assignment completes it. Returns
    /// what must be stored first, if anything; call
    /// [`Membership::persisted`] once it is.
    pub fn step(&mut self, now: Instant, now_ms: i64) -> Option<Persist> {
        let expired: Vec<String> = self
            .members
            .iter()
            .filter(|(_, m)| {
                // A member waiting for the rebalance (its join, or its sync
                // while the leader assigns) is not silent.
                m.expires <= now
                    && !(self.phase == Phase::PreparingRebalance && m.join.is_some())
                    && !(self.phase == Phase::CompletingRebalance && m.sync.is_some())
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            tracing::info!(member = %id, "group member's session expired: removed");
            self.remove(&id, &ApiError::UnknownMemberId(format!("{id:?}'s session expired")), now);
        }
        match self.phase {
            Phase::PreparingRebalance => {
                let all_in = self.members.values().all(|m| m.rejoined);
                if now < self.join_not_before || (!all_in && now < self.join_deadline) {
                    return None;
                }
                let late: Vec<String> =
                    self.members.iter().filter(|(_, m)| !m.rejoined).map(|(id, _)| id.clone()).collect();
                for id in late {
                    tracing::info!(member = %id, "group member did not rejoin within the rebalance timeout: removed");
                    if let Some(mut m) = self.members.remove(&id) {
                        m.fail_waiters(&ApiError::UnknownMemberId(format!("{id:?} did not rejoin in time")));
                        if let Some(i) = &m.instance_id {
                            self.instances.remove(i);
                        }
                    }
                }
                self.generation = self.generation.saturating_add(1);
                if self.members.is_empty() {
                    self.phase = Phase::Empty;
                    self.protocol.clear();
                    self.leader.clear();
                    return Some(Persist { meta: self.to_meta(true, now_ms), kind: PersistKind::Join });
                }
                self.protocol = self.choose_protocol();
                if !self.members.contains_key(&self.leader) {
                    let first =
                        self.members.iter().min_by_key(|(_, m)| m.joined_seq).map(|(id, _)| id.clone());
                    self.leader = first.unwrap_or_default();
                }
                self.phase = Phase::CompletingRebalance;
                Some(Persist { meta: self.to_meta(false, now_ms), kind: PersistKind::Join })
            }
            Phase::CompletingRebalance if self.pending.is_some() => {
                let pending = self.pending.clone().unwrap_or_default();
                for (id, a) in pending {
                    if let Some(m) = self.members.get_mut(&id) {
                        m.assignment = a;
                    }
                }
                Some(Persist { meta: self.to_meta(true, now_ms), kind: PersistKind::Sync })
            }
            Phase::Stable if self.replaced => {
                Some(Persist { meta: self.to_meta(true, now_ms), kind: PersistKind::Replaced })
            }
            _ => None,
        }
    }

    /// The assignor most members prefer among those every member supports
    /// (ties: the leader's order, else the first member's).
    fn choose_protocol(&self) -> String {
        let first =
            self.members.get(&self.leader).or_else(|| self.members.values().min_by_key(|m| m.joined_seq));
        let Some(first) = first else { return String::new() };
        let candidates: Vec<&str> = first
            .protocols
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| self.members.values().all(|m| m.supports(n)))
            .collect();
        let mut votes: Vec<usize> = vec![0; candidates.len()];
        for m in self.members.values() {
            if let Some(i) = m.protocols.iter().find_map(|(n, _)| candidates.iter().position(|c| c == n)) {
                votes[i] += 1;
            }
        }
        let best = votes.iter().copied().max().unwrap_or(0);
        candidates
            .iter()
            .zip(&votes)
            .find(|(_, v)| **v == best)
            .map(|(c, _)| (*c).to_owned())
            .unwrap_or_default()
    }

    /// Answers the members waiting for what `kind` completed, once it is
    /// stored.
    pub fn persisted(&mut self, kind: PersistKind, now: Instant) {
        match kind {
            PersistKind::Join => {
                let members = self.join_members();
                for (id, m) in &mut self.members {
                    // Kafka: every session starts again when the join
                    // completes (a member waited in it, not heartbeating).
                    m.expires = now + m.session;
                    if let Some(tx) = m.join.take() {
                        let _ = tx.send(Ok(JoinResult {
                            generation: self.generation,
                            protocol: self.protocol.clone(),
                            leader: self.leader.clone(),
                            member_id: id.clone(),
                            members: if *id == self.leader { members.clone() } else { Vec::new() },
                        }));
                    }
                }
            }
            PersistKind::Sync => {
                self.pending = None;
                self.phase = Phase::Stable;
                for m in self.members.values_mut() {
                    if let Some(tx) = m.sync.take() {
                        let _ = tx.send(Ok(SyncResult {
                            protocol: self.protocol.clone(),
                            assignment: m.assignment.clone(),
                        }));
                    }
                }
            }
            PersistKind::Replaced => {
                self.replaced = false;
                for (id, m) in &mut self.members {
                    if let Some(tx) = m.join.take() {
                        // Its assignment stands: no one recomputes it.
                        let _ = tx.send(Ok(JoinResult {
                            generation: self.generation,
                            protocol: self.protocol.clone(),
                            leader: self.leader.clone(),
                            member_id: id.clone(),
                            members: Vec::new(),
                        }));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds {
        min_session: Duration::from_millis(100),
        max_session: Duration::from_secs(60),
        initial_delay: Duration::from_millis(0),
    };

    fn join_req(member: &str, protocols: &[&str]) -> JoinRequest {
        JoinRequest {
            member_id: member.into(),
            instance_id: None,
            client_id: "c".into(),
            session_timeout_ms: 1_000,
            rebalance_timeout_ms: 5_000,
            protocol_type: "consumer".into(),
            protocols: protocols
                .iter()
                .map(|p| ((*p).to_owned(), Bytes::from(format!("{member}:{p}"))))
                .collect(),
        }
    }

    fn later<T: std::fmt::Debug>(w: Waiting<T>) -> oneshot::Receiver<Result<T, ApiError>> {
        match w {
            Waiting::Later(rx) => rx,
            Waiting::Now(v) => panic!("answered at once: {v:?}"),
        }
    }

    /// Runs step/persisted until nothing is left to store; the kinds stored.
    fn settle(m: &mut Membership, now: Instant) -> Vec<PersistKind> {
        let mut kinds = Vec::new();
        while let Some(p) = m.step(now, 0) {
            kinds.push(p.kind);
            m.persisted(p.kind, now);
        }
        kinds
    }

    /// Two members join, the leader assigns, both are Stable in generation 1.
    fn two_stable(now: Instant) -> (Membership, String, String) {
        let mut m = Membership::empty(0, now);
        let mut a = later(m.join(join_req("", &["range"]), now, &BOUNDS).unwrap());
        let mut b = later(m.join(join_req("", &["roundrobin", "range"]), now, &BOUNDS).unwrap());
        assert_eq!(settle(&mut m, now), [PersistKind::Join]);
        let ja = a.try_recv().unwrap().unwrap();
        let jb = b.try_recv().unwrap().unwrap();
        assert_eq!((ja.generation, jb.generation), (1, 1));
        assert_eq!(ja.protocol, "range", "the only one both support");
        assert_eq!(ja.leader, ja.member_id, "the first to join leads");
        assert_eq!(ja.members.len(), 2);
        assert!(jb.members.is_empty(), "only the leader gets the members");
        // b asks again (its answer was lost): the same generation, no rebalance.
        match m.join(
            JoinRequest { member_id: jb.member_id.clone(), ..join_req("", &["roundrobin", "range"]) },
            now,
            &BOUNDS,
        ) {
            Ok(Waiting::Now(again)) => assert_eq!((again.generation, again.members.len()), (1, 0)),
            other => panic!("a repeated join rebalanced: {other:?}"),
        }
        let mut sb = later(m.sync(1, &jb.member_id, None, vec![], now).unwrap());
        let assignments =
            vec![(ja.member_id.clone(), Bytes::from("A")), (jb.member_id.clone(), Bytes::from("B"))];
        let mut sa = later(m.sync(1, &ja.member_id, None, assignments, now).unwrap());
        assert_eq!(m.phase(), Phase::CompletingRebalance);
        assert_eq!(settle(&mut m, now), [PersistKind::Sync]);
        assert_eq!(m.phase(), Phase::Stable);
        assert_eq!(sa.try_recv().unwrap().unwrap().assignment, "A");
        assert_eq!(sb.try_recv().unwrap().unwrap().assignment, "B");
        (m, ja.member_id, jb.member_id)
    }

    #[test]
    fn a_group_forms_assigns_and_answers_only_after_persisting() {
        let now = Instant::now();
        let mut m = Membership::empty(0, now);
        let mut rx = later(m.join(join_req("", &["range"]), now, &BOUNDS).unwrap());
        let p = m.step(now, 7).expect("a new generation to store");
        assert_eq!((p.meta.generation, p.meta.assignment_complete, p.meta.members.len()), (1, false, 1));
        assert!(rx.try_recv().is_err(), "nobody learns of a generation before it is stored");
        m.persisted(p.kind, now);
        assert_eq!(rx.try_recv().unwrap().unwrap().generation, 1);
        let (_m, _, _) = two_stable(now);
    }

    #[test]
    fn stale_generations_and_unknown_members_are_refused_and_a_join_rebalances() {
        let now = Instant::now();
        let (mut m, a, b) = two_stable(now);
        assert!(m.heartbeat(1, &a, None, now).is_ok());
        assert!(matches!(m.heartbeat(0, &a, None, now), Err(ApiError::IllegalGeneration(_))));
        assert!(matches!(m.heartbeat(1, "x", None, now), Err(ApiError::UnknownMemberId(_))));
        assert!(m.check_commit(1, &b, None, now).is_ok());
        assert!(matches!(m.check_commit(-1, "", None, now), Err(ApiError::UnknownMemberId(_))));
        // A third member: a rebalance; heartbeats say so; commits of
        // generation 1 are still taken until the new generation forms.
        let _c = later(m.join(join_req("", &["range"]), now, &BOUNDS).unwrap());
        assert_eq!(m.phase(), Phase::PreparingRebalance);
        assert!(matches!(m.heartbeat(1, &a, None, now), Err(ApiError::RebalanceInProgress(_))));
        assert!(m.check_commit(1, &b, None, now).is_ok());
        assert!(m.step(now, 0).is_none(), "a and b have not rejoined");
        let _ra = later(m.join(join_req(&a, &["range"]), now, &BOUNDS).unwrap());
        let _rb = later(m.join(join_req(&b, &["range"]), now, &BOUNDS).unwrap());
        assert_eq!(settle(&mut m, now), [PersistKind::Join]);
        assert_eq!(m.generation(), 2);
        assert!(matches!(m.check_commit(1, &b, None, now), Err(ApiError::IllegalGeneration(_))));
        assert!(matches!(m.check_commit(2, &b, None, now), Err(ApiError::RebalanceInProgress(_))));
    }

    #[test]
    fn a_silent_member_is_evicted_and_its_commit_refused() {
        let now = Instant::now();
        let (mut m, a, b) = two_stable(now);
        // a keeps heartbeating, b falls silent past its 1 s session.
        let later_on = now + Duration::from_millis(600);
        m.heartbeat(1, &a, None, later_on).unwrap();
        let gone = now + Duration::from_millis(1_100);
        assert!(m.step(gone, 0).is_none(), "a has not rejoined yet");
        assert_eq!(m.len(), 1);
        assert!(matches!(m.check_commit(1, &b, None, gone), Err(ApiError::UnknownMemberId(_))));
        assert!(matches!(m.heartbeat(1, &a, None, gone), Err(ApiError::RebalanceInProgress(_))));
        let mut ra = later(m.join(join_req(&a, &["range"]), gone, &BOUNDS).unwrap());
        assert_eq!(settle(&mut m, gone), [PersistKind::Join]);
        let j = ra.try_recv().unwrap().unwrap();
        assert_eq!((j.generation, j.members.len()), (2, 1));
    }

    #[test]
    fn a_member_that_does_not_rejoin_is_dropped_at_the_rebalance_timeout() {
        let now = Instant::now();
        let (mut m, a, b) = two_stable(now);
        let mut ra = later(m.join(join_req(&a, &["range"]), now, &BOUNDS).unwrap());
        // b keeps its session alive (its heartbeats are told to rejoin) but never rejoins.
        for ms in (800..=4_800).step_by(800) {
            let at = now + Duration::from_millis(ms);
            assert!(matches!(m.heartbeat(1, &b, None, at), Err(ApiError::RebalanceInProgress(_))));
            assert!(m.step(at, 0).is_none(), "at {ms} ms");
        }
        assert!(m.step(now + Duration::from_millis(4_900), 0).is_none());
        let end = now + Duration::from_millis(5_000);
        let p = m.step(end, 0).expect("the join ends at the rebalance timeout");
        m.persisted(p.kind, end);
        assert_eq!(m.len(), 1);
        assert_eq!(ra.try_recv().unwrap().unwrap().generation, 2);
        // a waited 5 s in its join, past its 1 s session: its session
        // starts again with the new generation (it is not evicted).
        assert!(m.step(end, 0).is_none());
        assert_eq!(m.len(), 1);
        assert!(m.heartbeat(2, &a, None, end + Duration::from_millis(900)).is_ok());
    }

    #[test]
    fn leaving_last_empties_the_group_in_a_new_generation() {
        let now = Instant::now();
        let (mut m, a, b) = two_stable(now);
        m.leave(&a, None, now).unwrap();
        m.leave(&b, None, now).unwrap();
        assert!(matches!(m.leave(&b, None, now), Err(ApiError::UnknownMemberId(_))));
        assert_eq!(settle(&mut m, now), [PersistKind::Join]);
        assert_eq!((m.phase(), m.generation()), (Phase::Empty, 2));
        assert!(m.check_commit(-1, "", None, now).is_ok());
    }

    #[test]
    fn a_static_member_restarting_keeps_its_assignment_without_a_rebalance() {
        let now = Instant::now();
        let mut m = Membership::empty(0, now);
        let mut req = join_req("", &["range"]);
        req.instance_id = Some("host-1".into());
        let mut rx = later(m.join(req.clone(), now, &BOUNDS).unwrap());
        settle(&mut m, now);
        let j = rx.try_recv().unwrap().unwrap();
        let _s = later(
            m.sync(1, &j.member_id, Some("host-1"), vec![(j.member_id.clone(), Bytes::from("P"))], now)
                .unwrap(),
        );
        settle(&mut m, now);
        // Restarted: a new process joins with the same instance id (and
        // other metadata: only the assignor must match).
        req.protocols = vec![("range".into(), Bytes::from("other metadata"))];
        let mut rx = later(m.join(req, now, &BOUNDS).unwrap());
        assert!(rx.try_recv().is_err(), "answered before the new member id is stored");
        assert_eq!(settle(&mut m, now), [PersistKind::Replaced]);
        let r = rx.try_recv().unwrap().unwrap();
        assert_eq!((r.generation, m.phase()), (1, Phase::Stable), "no rebalance");
        assert_ne!(r.member_id, j.member_id);
        let s = m.sync(1, &r.member_id, Some("host-1"), vec![], now).unwrap();
        assert!(matches!(s, Waiting::Now(SyncResult { ref assignment, .. }) if assignment == "P"));
        // The old process is fenced.
        let e = m.heartbeat(1, &j.member_id, Some("host-1"), now).unwrap_err();
        assert!(matches!(e, ApiError::FencedInstanceId(_)), "{e}");
    }

    #[test]
    fn a_returning_static_member_counts_as_rejoined_when_a_rebalance_starts() {
        let now = Instant::now();
        let mut m = Membership::empty(0, now);
        let mut statik = join_req("", &["range"]);
        statik.instance_id = Some("s".into());
        let mut ra = later(m.join(statik.clone(), now, &BOUNDS).unwrap());
        let mut rb = later(m.join(join_req("", &["range"]), now, &BOUNDS).unwrap());
        settle(&mut m, now);
        let (ja, jb) = (ra.try_recv().unwrap().unwrap(), rb.try_recv().unwrap().unwrap());
        let leader = if ja.members.is_empty() { &jb } else { &ja };
        let _s = m.sync(1, &leader.member_id, None, vec![], now).unwrap();
        settle(&mut m, now);
        assert_eq!(m.phase(), Phase::Stable);
        // The static member returns; before its new id is stored the other
        // member leaves: the rebalance that starts counts it as rejoined.
        let mut back = later(m.join(statik, now, &BOUNDS).unwrap());
        m.leave(&jb.member_id, None, now).unwrap();
        assert!(settle(&mut m, now).contains(&PersistKind::Join), "the rebalance did not complete at once");
        let r = back.try_recv().unwrap().unwrap();
        assert_eq!((r.generation, m.len()), (2, 1));
    }

    #[test]
    fn bad_timeouts_and_protocols_are_refused_without_a_rebalance() {
        let now = Instant::now();
        let mut m = Membership::empty(0, now);
        for (session, rebalance) in [(50, 1_000), (61_000, 1_000), (1_000, 0), (1_000, -5), (-1, 1_000)] {
            let mut r = join_req("", &["range"]);
            r.session_timeout_ms = session;
            r.rebalance_timeout_ms = rebalance;
            let e = m.join(r, now, &BOUNDS).unwrap_err();
            assert!(
                matches!(e, ApiError::InvalidSessionTimeout(_) | ApiError::Invalid(_)),
                "{session}/{rebalance}: {e}"
            );
        }
        assert_eq!(m.phase(), Phase::Empty);
        let _a = later(m.join(join_req("", &["range"]), now, &BOUNDS).unwrap());
        let e = m.join(join_req("", &["roundrobin"]), now, &BOUNDS).unwrap_err();
        assert!(matches!(e, ApiError::InconsistentGroupProtocol(_)), "{e}");
    }

    #[test]
    fn a_generation_read_back_without_its_assignment_is_rebalanced_again() {
        let now = Instant::now();
        let mut m = Membership::empty(0, now);
        let _rx = later(m.join(join_req("", &["range"]), now, &BOUNDS).unwrap());
        let p = m.step(now, 0).unwrap();
        let taken_over = Membership::from_meta(&p.meta, now);
        assert_eq!(
            (taken_over.phase(), taken_over.generation(), taken_over.len()),
            (Phase::PreparingRebalance, 1, 1)
        );
        let (stable, _, _) = two_stable(now);
        let meta = stable.to_meta(true, 0);
        let back = Membership::from_meta(&meta, now);
        assert_eq!((back.phase(), back.generation(), back.len()), (Phase::Stable, 1, 2));
        let mut assignments: Vec<Bytes> = back.describe().into_iter().map(|d| d.assignment).collect();
        assignments.sort();
        assert_eq!(assignments, ["A", "B"].map(Bytes::from));
    }

    #[test]
    fn the_initial_delay_gathers_members_into_one_generation() {
        let now = Instant::now();
        let bounds = Bounds { initial_delay: Duration::from_millis(300), ..BOUNDS };
        let mut m = Membership::empty(0, now);
        let _a = later(m.join(join_req("", &["range"]), now, &bounds).unwrap());
        assert!(m.step(now + Duration::from_millis(100), 0).is_none());
        let _b = later(m.join(join_req("", &["range"]), now + Duration::from_millis(200), &bounds).unwrap());
        let p = m.step(now + Duration::from_millis(300), 0).unwrap();
        assert_eq!((p.meta.generation, p.meta.members.len()), (1, 2));
    }
}

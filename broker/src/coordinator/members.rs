//! The membership calls of the group coordinator (JoinGroup, SyncGroup,
//! Heartbeat, LeaveGroup) over [`super::membership::Membership`], and the
//! background loop that stores what rebalances need stored and answers the
//! members waiting for it.

use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;

use super::membership::{Bounds, JoinRequest, JoinResult, SyncResult, Waiting};
use super::records;
use super::session::{Cell, Session};
use super::{Coordinator, OFFSETS_TOPIC};
use crate::error::ApiError;
use crate::metadata::controller::now_ms;

/// A first join's member, removed from the group (LeaveGroup, in a task of
/// its own) when dropped still armed: its call ended without an answer, so
/// no client knows the member id, and it would otherwise hold partitions
/// nobody reads until its session ends (Kafka avoids this with KIP-394's
/// MEMBER_ID_REQUIRED, not built here).
struct UnansweredJoin {
    coordinator: Coordinator,
    group: String,
    /// The member to remove; `None` once answered.
    member: Option<String>,
}

impl Drop for UnansweredJoin {
    fn drop(&mut self) {
        if let Some(member) = self.member.take() {
            let (c, group) = (self.coordinator.clone(), std::mem::take(&mut self.group));
            tokio::spawn(async move {
                let _ = c.leave(&group, &member, None).await;
            });
        }
    }
}

impl Coordinator {
    pub(super) fn bounds(&self) -> Bounds {
        Bounds {
            min_session: Duration::from_millis(self.config.min_session_timeout_ms),
            max_session: Duration::from_millis(self.config.max_session_timeout_ms),
            initial_delay: Duration::from_millis(self.config.initial_rebalance_delay_ms),
        }
    }

    /// Stores what `group`'s membership needs stored, answering its
    /// waiting members after each write ([`Membership::step`]).
    pub(super) async fn advance(&self, s: &mut Session, group: &str) -> Result<(), ApiError> {
        loop {
            let now = Instant::now();
            let Some(g) = s.groups_mut().get_mut(group) else { return Ok(()) };
            let Some(p) = g.live.as_mut().and_then(|l| l.step(now, now_ms())) else { return Ok(()) };
            let row = records::group_record(group, Some(&p.meta), now_ms());
            if let Err(e) = s.append(vec![row], &self.limits).await {
                // The step changed memory already.
                s.forget();
                return Err(e);
            }
            if let Some(l) = s.groups_mut().get_mut(group).and_then(|g| g.live.as_mut()) {
                l.persisted(p.kind, Instant::now());
            }
            tracing::info!(
                group,
                generation = p.meta.generation,
                members = p.meta.members.len(),
                stored = ?p.kind,
                "group state stored"
            );
        }
    }

    /// Moves every group of the partitions led here on, every 100 ms and
    /// whenever a membership call asks: ends sessions and rebalances whose
    /// time is up, stores new generations and assignments and answers the
    /// members waiting for them; every `offsets_retention_check_interval_ms`
    /// starts `Coordinator::expire_offsets`. Runs until the process ends.
    pub async fn run(self) {
        let every = Duration::from_millis(self.config.offsets_retention_check_interval_ms);
        let mut next_expiry = Instant::now() + every;
        let mut expiry: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            let _ = tokio::time::timeout(Duration::from_millis(100), self.kick.notified()).await;
            // In a task of its own, one at a time: it waits for the
            // controller and for partitions, which members must not.
            if Instant::now() >= next_expiry && expiry.as_ref().is_none_or(|t| t.is_finished()) {
                next_expiry = Instant::now() + every;
                expiry = Some(tokio::spawn(self.clone().expire_offsets()));
            }
            let cells: Vec<(u64, Cell)> = {
                let loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
                loaded.iter().map(|(g, c)| (*g, c.clone())).collect()
            };
            let image = self.controller.image();
            let Some(topic) = image.topics.get(OFFSETS_TOPIC) else { continue };
            for (raft_group, cell) in cells {
                // Asked of the replica itself: the registry's view
                // (`GroupRegistry::is_led`) follows the leadership watcher
                // and can still say "not led" just after a group call
                // loaded the partition for its new term, which dropped the
                // waiting JoinGroup (NOT_COORDINATOR) and read it back twice.
                let leads =
                    self.groups.partition_of(raft_group).is_some_and(|p| p.raft.leader_term().is_some());
                if !leads {
                    // Read back again when it leads again; its waiting
                    // members are answered NOT_COORDINATOR now.
                    if let Ok(mut state) = cell.try_lock() {
                        *state = None;
                    }
                    continue;
                }
                let Some(index) = topic.partitions.iter().position(|a| a.group == raft_group) else {
                    continue;
                };
                let Some(partition) = self.groups.partition_of(raft_group) else { continue };
                // Only a partition already read in this term: a group call loads it.
                let active = {
                    let Ok(state) = cell.try_lock() else { continue };
                    match state.as_ref() {
                        Some(l) if partition.raft.leader_term() == Some(l.term) => l.groups.active(),
                        _ => continue,
                    }
                };
                if active.is_empty() {
                    continue;
                }
                let Ok(mut s) = self.open(partition, index as u32, raft_group, image.clone()).await else {
                    continue;
                };
                for group in active {
                    if let Err(e) = self.advance(&mut s, &group).await {
                        tracing::warn!(group, "could not store the group's state: {e}");
                        break;
                    }
                }
            }
        }
    }

    /// Kafka's JoinGroup: waits until the rebalance it joins (or starts)
    /// has its new generation stored, then answers it. A first join that
    /// ends unanswered (its wait timed out, or its caller went away) is
    /// removed from the group again (`UnansweredJoin`).
    ///
    /// # Errors
    /// See [`super::membership::Membership::join`]; [`ApiError::NotCoordinator`] when the
    /// coordinator's state was dropped meanwhile (leadership lost);
    /// [`ApiError::CoordinatorNotAvailable`] when no answer came by the
    /// group's rebalance deadline (and 5 s).
    pub async fn join(&self, group: &str, req: JoinRequest) -> Result<JoinResult, ApiError> {
        let own = Duration::from_millis(u64::try_from(req.rebalance_timeout_ms).unwrap_or(0));
        let first = req.member_id.is_empty();
        let (member, waiting, deadline) = {
            let mut s = self.session(group).await?;
            let bounds = self.bounds();
            let now = Instant::now();
            let live = s.groups_mut().entry(group).live_mut(now);
            match live.join_with_id(req, now, &bounds) {
                // Answered by the time the group's rebalance ends (or, for
                // a static member's return, once its id is stored).
                Ok((member, w)) => {
                    let deadline = live.join_deadline().unwrap_or(now + own).max(now + own);
                    (member, w, deadline)
                }
                Err(e) => {
                    // A refused first join leaves no group behind.
                    s.groups_mut().forget_if_unused(group);
                    return Err(e);
                }
            }
        };
        self.kick.notify_one();
        let mut unanswered = UnansweredJoin {
            coordinator: self.clone(),
            group: group.to_owned(),
            member: first.then_some(member),
        };
        let at_most = deadline.saturating_duration_since(Instant::now());
        let r = self.wait(waiting, at_most).await;
        if r.is_ok() {
            unanswered.member = None;
        }
        r
    }

    /// Kafka's SyncGroup: the leader's carries the assignment; every
    /// member's waits until it is stored, then gets its own.
    ///
    /// # Errors
    /// See [`super::membership::Membership::sync`].
    pub async fn sync(
        &self,
        group: &str,
        generation: i32,
        member: &str,
        instance: Option<&str>,
        assignments: Vec<(String, Bytes)>,
    ) -> Result<SyncResult, ApiError> {
        let waiting = {
            let mut s = self.session(group).await?;
            let g = s
                .groups_mut()
                .get_mut(group)
                .ok_or_else(|| ApiError::UnknownMemberId(format!("{group:?} has no members")))?;
            g.live_mut(Instant::now()).sync(generation, member, instance, assignments, Instant::now())?
        };
        self.kick.notify_one();
        self.wait(waiting, Duration::from_millis(self.config.max_session_timeout_ms)).await
    }

    pub(super) async fn wait<T>(&self, w: Waiting<T>, at_most: Duration) -> Result<T, ApiError> {
        match w {
            Waiting::Now(v) => Ok(v),
            Waiting::Later(rx) => match tokio::time::timeout(at_most + Duration::from_secs(5), rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(ApiError::NotCoordinator { coordinator: None }),
                Err(_) => {
                    Err(ApiError::CoordinatorNotAvailable("the rebalance did not complete in time".into()))
                }
            },
        }
    }

    /// Kafka's Heartbeat.
    ///
    /// # Errors
    /// See [`super::membership::Membership::heartbeat`].
    pub async fn heartbeat(
        &self,
        group: &str,
        generation: i32,
        member: &str,
        instance: Option<&str>,
    ) -> Result<(), ApiError> {
        let mut s = self.session(group).await?;
        let g = s
            .groups_mut()
            .get_mut(group)
            .ok_or_else(|| ApiError::UnknownMemberId(format!("{group:?} has no members")))?;
        g.live_mut(Instant::now()).heartbeat(generation, member, instance, Instant::now())
    }

    /// Kafka's LeaveGroup: the group rebalances without the member.
    ///
    /// # Errors
    /// See [`super::membership::Membership::leave`].
    pub async fn leave(&self, group: &str, member: &str, instance: Option<&str>) -> Result<(), ApiError> {
        {
            let mut s = self.session(group).await?;
            let g = s
                .groups_mut()
                .get_mut(group)
                .ok_or_else(|| ApiError::UnknownMemberId(format!("{group:?} has no members")))?;
            g.live_mut(Instant::now()).leave(member, instance, Instant::now())?;
        }
        self.kick.notify_one();
        Ok(())
    }
}

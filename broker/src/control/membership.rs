//! Keeps each group's Raft membership equal to what the metadata says, on
//! the groups this broker leads: a replica with a new node id (its broker's
//! data was wiped, or a reassignment adds it) is added as a learner, and
//! once it has caught up the voter set is changed to the wanted one by
//! joint consensus (Raft paper §6), which also removes the retired node id
//! or the replicas a reassignment drops. Learners the metadata no longer
//! wants (a cancelled reassignment's) are removed. Once a reassignment's
//! target is the committed membership, the leader reports it to the
//! controller, which commits the completion (KIP-455's last step); the
//! brokers left out then delete their replicas (`crate::partitions`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use ferrolog_replica::NodeId;
use futures::StreamExt;
use tokio::sync::watch;

use crate::config::BrokerId;
use crate::control::handover::HandOver;
use crate::groups::{GroupId, GroupRegistry, HostedGroup};
use crate::metadata::METADATA_GROUP;
use crate::metadata::command::{CompletionReport, ControllerRequest, PartitionAssignment};
use crate::metadata::controller::Controller;
use crate::metadata::image::MetadataImage;
use crate::network::throttle::Throttle;

/// How often memberships are compared with the metadata.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// A learner this close to the leader's last log index (entries) may become a voter.
pub const CAUGHT_UP_ENTRIES: u64 = 100;
/// How long a leader leaving its group's voters tries to hand over.
pub const HAND_OVER_WITHIN: Duration = Duration::from_secs(5);

/// Groups at most this many of whose memberships change at once (each
/// change waits for Raft commits; one at a time, a bulk move of N
/// partitions led here took N times as long).
pub const CHANGES_AT_ONCE: usize = 32;

/// Most membership changes of partitions led by one broker under way at
/// once (learners added, not yet done); more wait for their turn.
pub const MOVES_AT_ONCE: usize = 1024;

/// The partition groups led here whose membership change is under way
/// (see [`MOVES_AT_ONCE`]).
#[derive(Debug, Default)]
struct Moves(std::sync::Mutex<BTreeSet<GroupId>>);

impl Moves {
    /// Whether `group`'s change may go on: it is under way already, or
    /// there is room for one more.
    fn admit(&self, group: GroupId) -> bool {
        let mut active = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if active.contains(&group) {
            return true;
        }
        if active.len() >= MOVES_AT_ONCE {
            return false;
        }
        active.insert(group)
    }

    /// Frees the places of groups no longer led here.
    fn keep_only(&self, leading: &[GroupId]) {
        let mut active = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        active.retain(|g| leading.binary_search(g).is_ok());
    }

    /// `group` needs nothing more (or is not led here): its place is free.
    fn done(&self, group: GroupId) {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&group);
    }
}

/// The voter set `group` should have, or `None` if the metadata does not
/// say; `p` is the group's partition, if it is one.
pub fn wanted_voters(
    image: &MetadataImage,
    group: GroupId,
    p: Option<&PartitionAssignment>,
    current: &BTreeSet<NodeId>,
) -> Option<BTreeSet<NodeId>> {
    if group == METADATA_GROUP {
        return Some(image.metadata_voters(current.iter().copied()));
    }
    Some(p?.wanted_replicas().iter().map(|r| r.node).collect())
}

/// What the membership changes use besides the groups and the image.
#[derive(Clone, Debug)]
pub struct Env {
    /// To report completed reassignments.
    pub controller: Controller,
    /// To hand a leaving leader's leadership over.
    pub hand_over: HandOver,
    /// The reassignment throttle: learners of groups led here are throttled.
    pub throttle: Throttle,
}

/// Compares and fixes memberships every [`CHECK_INTERVAL`], forever: every
/// group led here when the image or the set of groups led here changed,
/// otherwise only the groups whose change is still under way (a learner
/// catching up), so an idle broker reads no group's state.
pub async fn run(groups: GroupRegistry, image: watch::Receiver<Arc<MetadataImage>>, env: Env) {
    let mut tick = tokio::time::interval(CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen: Option<(Arc<MetadataImage>, Arc<Vec<GroupId>>)> = None;
    let mut pending: BTreeSet<GroupId> = BTreeSet::new();
    let moves = Moves::default();
    loop {
        tick.tick().await;
        let img = image.borrow().clone();
        let leading = groups.leading();
        let changed = seen.as_ref().is_none_or(|(i, l)| !Arc::ptr_eq(i, &img) || !Arc::ptr_eq(l, &leading));
        let visit: Vec<GroupId> = if changed { leading.to_vec() } else { pending.iter().copied().collect() };
        if changed {
            moves.keep_only(&leading);
        }
        seen = Some((img.clone(), leading));
        pending.clear();
        if visit.is_empty() {
            continue;
        }
        // One pass over the topics, not one per group visited.
        let placed: HashMap<GroupId, &PartitionAssignment> =
            img.topics.values().flat_map(|t| t.partitions.iter()).map(|p| (p.group, p)).collect();
        let reports = std::sync::Mutex::new(Vec::new());
        let confirmed = Confirmed::default();
        let (img, placed, groups, env, reports_ref, moves_ref, confirmed) =
            (&img, &placed, &groups, &env, &reports, &moves, &confirmed);
        let outcomes: Vec<(GroupId, anyhow::Result<bool>)> = futures::stream::iter(visit)
            .map(|group| async move {
                let Some(hosted) = groups.get(group) else { return (group, Ok(true)) };
                if !hosted.raft.is_leader() {
                    return (group, Ok(true));
                }
                (
                    group,
                    reconcile(
                        img,
                        group,
                        placed.get(&group).copied(),
                        &hosted,
                        env,
                        (reports_ref, moves_ref, confirmed),
                    )
                    .await,
                )
            })
            .buffer_unordered(CHANGES_AT_ONCE)
            .collect()
            .await;
        let reports = reports.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !reports.is_empty() {
            report_completions(&env.controller, reports).await;
        }
        for (group, outcome) in outcomes {
            match outcome {
                Ok(true) => moves.done(group),
                Ok(false) => {
                    pending.insert(group);
                }
                Err(e) => {
                    tracing::warn!(group, "membership change: {e}");
                    pending.insert(group);
                }
            }
        }
    }
}

/// Whether one pass's image holds every metadata change the controller
/// had committed (asked once per pass, when a group first needs it).
type Confirmed = tokio::sync::OnceCell<bool>;

/// Whether `image` is confirmed current with the controller (ReadIndex,
/// [`Controller::current_image`]): an image behind the controller's
/// commits may miss a reassignment or a quorum change, and acting on it
/// would undo them. After a restart the image can stop at a lazily saved
/// commit index while the replica already follows the current leader, so
/// no local view of Raft's state can tell.
async fn confirmed_current(confirmed: &Confirmed, controller: &Controller, image: &MetadataImage) -> bool {
    *confirmed
        .get_or_init(|| async {
            controller.current_image().await.is_ok_and(|confirmed| confirmed.covers(image))
        })
        .await
}

/// One group's comparison and next step; returns whether its membership
/// is what the metadata wants (nothing left to do).
async fn reconcile(
    image: &MetadataImage,
    group: GroupId,
    p: Option<&PartitionAssignment>,
    h: &HostedGroup,
    env: &Env,
    (reports, moves, confirmed): (&std::sync::Mutex<Vec<CompletionReport>>, &Moves, &Confirmed),
) -> anyhow::Result<bool> {
    let (voters, joint, learners, last, matched, committed) = h.raft.state(|s| {
        let voters: BTreeSet<NodeId> = s.voters().collect();
        let learners: BTreeSet<NodeId> = s.learners().collect();
        let matched: BTreeMap<NodeId, Option<u64>> =
            s.matched().map(|r| r.map(|(n, m)| (n, m.map(|l| l.index))).collect()).unwrap_or_default();
        let joint = s.voter_sets().len() > 1;
        (voters, joint, learners, s.last_log_index().unwrap_or(0), matched, s.membership_committed())
    });
    let partition = group != METADATA_GROUP;
    if partition {
        // Throttle catch-up traffic to learners only (`crate::network::throttle`).
        for n in &learners {
            env.throttle.set_node(*n, true);
        }
        for n in &voters {
            env.throttle.set_node(*n, false);
        }
        // Never act on an image older than the group's membership: it
        // would undo a reassignment (a member with a node id the image has
        // not handed out yet proves the image is behind), and an image
        // behind the controller's commits may miss a reassignment's start.
        let newer = voters.iter().chain(&learners).find(|n| **n >= image.next_node_id);
        if let Some(n) = newer {
            tracing::debug!(
                group,
                node = n,
                "the metadata image is older than the group's membership: waiting"
            );
            return Ok(false);
        }
    }
    let Some(wanted) = wanted_voters(image, group, p, &voters) else { return Ok(true) };
    // Nothing to do for a partition group as this image has it: no need to
    // ask whether the image is current.
    let settled = wanted == voters
        && !joint
        && committed
        && learners.is_subset(&wanted)
        && p.is_none_or(|p| p.reassignment.is_none());
    if partition && settled {
        return Ok(true);
    }
    // An image behind the metadata log (after a restart, before the
    // leader's first commit) would undo changes it has not seen.
    if !confirmed_current(confirmed, &env.controller, image).await {
        return Ok(false);
    }
    // The metadata group's learners first, whatever the voters' state: a
    // wanted voter that cannot catch up must not keep new brokers from
    // getting the metadata.
    if !partition && !metadata_learners(image, h, &wanted, &voters, &learners).await? {
        return Ok(false);
    }
    if wanted.is_empty() {
        // Never a group without voters; the metadata must be wrong.
        anyhow::bail!("the metadata wants no voter in group {group}: left as it is");
    }
    let in_order = |nodes: &BTreeSet<NodeId>| -> Vec<(NodeId, BrokerId)> {
        let mut out: Vec<(NodeId, BrokerId)> =
            nodes.iter().filter_map(|n| broker_of(image, group, p, *n).map(|b| (*n, b))).collect();
        if let Some(p) = p {
            let wanted = p.wanted_replicas();
            out.sort_by_key(|(n, _)| wanted.iter().position(|r| r.node == *n).unwrap_or(usize::MAX));
        }
        out
    };
    // `voters` merges both halves of a joint configuration: equal to
    // `wanted` is done only once the configuration is a single one (a
    // leader that took over mid-change finishes it below).
    if wanted == voters && !joint {
        if !partition {
            return Ok(true);
        }
        if !committed {
            return Ok(false);
        }
        let unwanted: BTreeSet<NodeId> = learners.difference(&wanted).copied().collect();
        if !unwanted.is_empty() {
            tracing::info!(group, ?unwanted, "removing learners the metadata no longer places");
            timed(h.raft.remove_learners(unwanted)).await?;
            return Ok(false);
        }
        let epoch = p.and_then(|p| p.reassignment.as_ref().map(|r| r.epoch));
        if epoch.is_some() && !wanted.contains(&h.node_id) {
            // A leader the change removed (every replica moved) hands over
            // before the move is reported done, so that once it is, the
            // partition is led by one of its new replicas (as Kafka's
            // controller elects one from the target before completing);
            // the new leader reports it.
            if !env.hand_over.groups.draining() {
                let outcome = env
                    .hand_over
                    .hand_over(
                        group,
                        &in_order(&wanted),
                        None,
                        tokio::time::Instant::now() + HAND_OVER_WITHIN,
                    )
                    .await;
                tracing::info!(group, ?outcome, "removed leader hands over before the move is reported done");
            }
            return Ok(false);
        }
        if let Some(epoch) = epoch {
            let voters: Vec<NodeId> = voters.into_iter().collect();
            tracing::info!(
                group,
                ?voters,
                epoch,
                "reassignment's target is the membership: reporting it done"
            );
            // Reported with the pass's others (`report_completions`); done
            // once the image shows it (the next pass over a new image).
            reports.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(CompletionReport {
                group,
                voters,
                epoch,
            });
            return Ok(false);
        }
        return Ok(true);
    }
    // A change that has not begun (no learner added yet) waits while
    // MOVES_AT_ONCE others led here are under way: every group with a
    // learner copying stays awake (heartbeats, replication), and 10,000 at
    // once saturated a small machine until heartbeats timed out.
    let starting = wanted.difference(&voters).any(|n| !learners.contains(n));
    if partition && starting && !moves.admit(group) {
        return Ok(false);
    }
    if !h.raft.renew_lease(CHECK_INTERVAL).await {
        return Ok(false);
    }
    let mut ready = true;
    for n in wanted.difference(&voters) {
        if !learners.contains(n) {
            let broker =
                broker_of(image, group, p, *n).ok_or_else(|| anyhow::anyhow!("no broker for node {n}"))?;
            let addr = image.brokers.get(&broker).map(|b| b.peer_addr.clone()).unwrap_or_default();
            tracing::info!(group, node = n, broker, "adding a replica as a learner");
            if partition {
                env.throttle.set_node(*n, true);
            }
            timed(h.raft.add_learner(*n, addr)).await?;
            ready = false;
            continue;
        }
        let matched = matched.get(n).copied().flatten();
        if matched.is_none_or(|i| i + CAUGHT_UP_ENTRIES < last) {
            ready = false;
        }
    }
    if !ready {
        return Ok(false);
    }
    // A leader the change drops hands over first to a voter that stays, so
    // that the change is made by a leader of the new configuration (Raft
    // thesis §4.2.2 lets a leader outside it finish the change and step
    // down; openraft then demotes it after a delay, racing any hand-over).
    // Not while this broker drains: its own hand-overs move the leadership.
    let staying: BTreeSet<NodeId> = wanted.intersection(&voters).copied().collect();
    if !wanted.contains(&h.node_id) && !staying.is_empty() {
        if env.hand_over.groups.draining() {
            return Ok(false);
        }
        let to = in_order(&staying);
        tracing::debug!(
            group,
            ?to,
            "this replica leaves the group: handing its leadership to one that stays"
        );
        let outcome =
            env.hand_over.hand_over(group, &to, None, tokio::time::Instant::now() + HAND_OVER_WITHIN).await;
        if matches!(outcome, crate::control::handover::Outcome::HandedOver(_)) {
            tracing::info!(
                group,
                ?outcome,
                "this replica leaves the group: handed its leadership over first"
            );
        } else {
            tracing::debug!(group, ?outcome, "hand-over before a membership change");
        }
        return Ok(false);
    }
    tracing::info!(group, ?voters, ?wanted, joint, "changing voters");
    if partition {
        timed(h.raft.change_voters(wanted.clone())).await?;
    } else {
        // A broker leaving the controller quorum still follows the metadata.
        timed(h.raft.change_voters_keeping_learners(wanted.clone())).await?;
    }
    // Both phases of the joint change are committed: a majority of the
    // new voters alone now decides.
    tracing::info!(group, ?wanted, "voters changed");
    for n in &wanted {
        env.throttle.set_node(*n, false);
    }
    if partition && !wanted.contains(&h.node_id) && !env.hand_over.groups.draining() {
        // No voter stayed (every replica moved): the new voters take over.
        let outcome = env
            .hand_over
            .hand_over(group, &in_order(&wanted), None, tokio::time::Instant::now() + HAND_OVER_WITHIN)
            .await;
        tracing::info!(group, ?outcome, "leaving leader handed over to the new voters");
    }
    Ok(false)
}

/// The metadata group's learners made what the image wants, given the
/// wanted voters: every registered broker outside the quorum follows the
/// metadata; a learner that is neither wanted as one nor about to vote
/// (a decommissioned broker's, a wiped broker's old node) is removed.
/// One step per pass; returns whether they were already right.
async fn metadata_learners(
    image: &MetadataImage,
    h: &HostedGroup,
    wanted_voters: &BTreeSet<NodeId>,
    voters: &BTreeSet<NodeId>,
    learners: &BTreeSet<NodeId>,
) -> anyhow::Result<bool> {
    // A voter the change drops is a learner afterwards (kept), so it counts.
    let mut wanted = image.metadata_learners(wanted_voters);
    wanted.retain(|n| !voters.contains(n));
    let unwanted: BTreeSet<NodeId> =
        learners.iter().copied().filter(|n| !wanted.contains(n) && !wanted_voters.contains(n)).collect();
    if !unwanted.is_empty() {
        tracing::info!(?unwanted, "removing metadata learners of decommissioned or retired brokers");
        timed(h.raft.remove_learners(unwanted)).await?;
        return Ok(false);
    }
    let missing: Vec<NodeId> = wanted.difference(learners).copied().collect();
    if missing.is_empty() {
        return Ok(true);
    }
    for n in missing {
        let Some(broker) = image.broker_of_node(METADATA_GROUP, n) else { continue };
        let addr = image.brokers.get(&broker).map(|b| b.peer_addr.clone()).unwrap_or_default();
        tracing::info!(node = n, broker, "adding a broker to the metadata group as a learner");
        timed(h.raft.add_learner(n, addr)).await?;
    }
    Ok(false)
}

/// Reports a pass's completed reassignments to the controller in one
/// request (one metadata entry); a controller older than 1.6, which does
/// not know that request, gets them one by one. What fails is reported
/// again next pass (the groups stay pending).
async fn report_completions(controller: &Controller, reports: Vec<CompletionReport>) {
    let n = reports.len();
    match controller.handle(ControllerRequest::CompleteReassignments { reports: reports.clone() }).await {
        Ok(_) => tracing::debug!(reports = n, "completed reassignments reported"),
        Err(crate::error::ApiError::Invalid(m)) if m.contains("does not decode") => {
            for r in reports {
                let group = r.group;
                if let Err(e) = controller.handle(r.into_request()).await {
                    tracing::warn!(group, "reporting a completed reassignment: {e}");
                }
            }
        }
        Err(e) => tracing::warn!(reports = n, "reporting completed reassignments: {e}"),
    }
}

/// The broker of node `n` of `group`: from its partition's replicas, or
/// the image for the metadata group.
fn broker_of(
    image: &MetadataImage,
    group: GroupId,
    p: Option<&PartitionAssignment>,
    n: NodeId,
) -> Option<BrokerId> {
    match p {
        Some(p) => p.replicas.iter().find(|r| r.node == n).map(|r| r.broker),
        None => image.broker_of_node(group, n),
    }
}

/// Longest one membership change may take before the pass moves on (the
/// group is visited again next pass).
pub const CHANGE_WITHIN: Duration = Duration::from_secs(10);

/// `change` within [`CHANGE_WITHIN`].
async fn timed<E: std::error::Error + Send + Sync + 'static>(
    change: impl std::future::Future<Output = Result<(), E>>,
) -> anyhow::Result<()> {
    match tokio::time::timeout(CHANGE_WITHIN, change).await {
        Ok(r) => Ok(r?),
        Err(_) => anyhow::bail!("not done within {CHANGE_WITHIN:?}; tried again next pass"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_moves_at_once_changes_run_and_freed_places_are_reused() {
        let moves = Moves::default();
        let n = MOVES_AT_ONCE as u64;
        assert!((0..n).all(|g| moves.admit(g)));
        assert!(!moves.admit(n), "one more than the limit waits");
        assert!(moves.admit(3), "one under way goes on");
        moves.done(3);
        assert!(moves.admit(n), "a freed place is taken");
        // Groups led elsewhere now give their places back.
        moves.keep_only(&[1, 2]);
        assert!((n + 1..2 * n - 1).all(|g| moves.admit(g)));
        assert!(!moves.admit(2 * n), "full again");
    }
}

//! Keeps each group's Raft membership equal to what the metadata says, on
//! the groups this broker leads: a replica with a new node id (its broker's
//! data was wiped) is added as a learner, and once it has caught up the
//! voter set is changed to the wanted one by joint consensus (Raft paper
//! §6), which also removes the retired node id.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferrolog_replica::NodeId;
use tokio::sync::watch;

use crate::groups::{GroupId, GroupRegistry, HostedGroup};
use crate::metadata::METADATA_GROUP;
use crate::metadata::image::MetadataImage;

/// How often memberships are compared with the metadata.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// A learner this close to the leader's last log index (entries) may become a voter.
pub const CAUGHT_UP_ENTRIES: u64 = 100;

/// The voter set `group` should have, or `None` if the metadata does not say.
pub fn wanted_voters(
    image: &MetadataImage,
    group: GroupId,
    current: &BTreeSet<NodeId>,
) -> Option<BTreeSet<NodeId>> {
    if group == METADATA_GROUP {
        return Some(image.metadata_voters(current.iter().copied()));
    }
    let p = image.topics.values().flat_map(|t| t.partitions.iter()).find(|p| p.group == group)?;
    Some(p.replicas.iter().map(|r| r.node).collect())
}

/// Compares and fixes memberships every [`CHECK_INTERVAL`], forever: every
/// group led here when the image or the set of groups led here changed,
/// otherwise only the groups whose change is still under way (a learner
/// catching up), so an idle broker reads no group's state.
pub async fn run(groups: GroupRegistry, image: watch::Receiver<Arc<MetadataImage>>) {
    let mut tick = tokio::time::interval(CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen: Option<(Arc<MetadataImage>, Arc<Vec<GroupId>>)> = None;
    let mut pending: BTreeSet<GroupId> = BTreeSet::new();
    loop {
        tick.tick().await;
        let img = image.borrow().clone();
        let leading = groups.leading();
        let changed = seen.as_ref().is_none_or(|(i, l)| !Arc::ptr_eq(i, &img) || !Arc::ptr_eq(l, &leading));
        let visit: Vec<GroupId> = if changed { leading.to_vec() } else { pending.iter().copied().collect() };
        seen = Some((img.clone(), leading));
        pending.clear();
        for group in visit {
            let Some(hosted) = groups.get(group) else { continue };
            if !hosted.raft.is_leader() {
                continue;
            }
            match reconcile(&img, group, &hosted).await {
                Ok(true) => {}
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

/// One group's comparison and next step; returns whether its membership
/// is what the metadata wants (nothing left to do).
async fn reconcile(image: &MetadataImage, group: GroupId, h: &HostedGroup) -> anyhow::Result<bool> {
    let (voters, learners, last, matched) = h.raft.state(|s| {
        let voters: BTreeSet<NodeId> = s.voters().collect();
        let learners: BTreeSet<NodeId> = s.learners().collect();
        let matched: BTreeMap<NodeId, Option<u64>> =
            s.matched().map(|r| r.map(|(n, m)| (n, m.map(|l| l.index))).collect()).unwrap_or_default();
        (voters, learners, s.last_log_index().unwrap_or(0), matched)
    });
    let Some(wanted) = wanted_voters(image, group, &voters) else { return Ok(true) };
    if wanted == voters || wanted.is_empty() {
        return Ok(true);
    }
    if !h.raft.renew_lease(CHECK_INTERVAL).await {
        return Ok(false);
    }
    let mut ready = true;
    for n in wanted.difference(&voters) {
        if !learners.contains(n) {
            let broker =
                image.broker_of_node(group, *n).ok_or_else(|| anyhow::anyhow!("no broker for node {n}"))?;
            let addr = image.brokers.get(&broker).map(|b| b.peer_addr.clone()).unwrap_or_default();
            tracing::info!(group, node = n, broker, "adding a replacement replica as a learner");
            h.raft.add_learner(*n, addr).await?;
            ready = false;
            continue;
        }
        let matched = matched.get(n).copied().flatten();
        if matched.is_none_or(|i| i + CAUGHT_UP_ENTRIES < last) {
            ready = false;
        }
    }
    if ready {
        tracing::info!(group, ?voters, ?wanted, "changing voters");
        h.raft.change_voters(wanted.clone()).await?;
        // Both phases of the joint change are committed: a majority of the
        // new voters alone now decides.
        tracing::info!(group, ?wanted, "voters changed");
    }
    Ok(false)
}

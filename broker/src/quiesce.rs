//! Quiescing idle partitions, so a broker hosting thousands of Raft groups
//! does not spend its CPU on heartbeats (as CockroachDB quiesces ranges).
//!
//! With openraft's per-group ticker, 1,000 idle groups at a 100 ms heartbeat
//! keep two cores busy. Instead, failure detection is done once per broker
//! pair ([`crate::liveness`]), and each group's ticker (which drives its
//! heartbeats and election timeouts) runs only while it is needed:
//!
//! - a **leader** ticks while it wrote within [`ACTIVE_AFTER_WRITE`] or a
//!   follower has not matched its log yet; otherwise it parks its ticker;
//! - a **follower** parks its ticker while its leader's broker answers
//!   pings and lists the group among those it leads. Otherwise (the broker
//!   stopped answering, or restarted and no longer leads) the ticker runs
//!   again (so it elects after its election timeout), and the first live
//!   replica in node-id order starts an election at once (with pre-vote, so
//!   a leader that is still healthy for a quorum is not disrupted).
//!
//! Safety does not depend on this: it only decides when openraft's timers
//! run; votes and commits are Raft's (§5.2, §5.4).

use std::sync::Arc;
use std::time::Duration;

use openraft::async_runtime::watch::WatchReceiver;

use crate::liveness::Liveness;
use crate::partition::Partition;
use crate::partitions::PartitionTable;

/// How long a leader keeps ticking after its last write, so followers learn
/// the final commit index from heartbeats.
pub const ACTIVE_AFTER_WRITE: Duration = Duration::from_secs(2);

/// What a group's ticker should do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run the ticker.
    Tick,
    /// Park it.
    Park,
    /// Run it and start an election now.
    TickAndElect,
}

/// Inputs of the decision for one group, all read from local state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupView {
    /// This replica leads.
    pub is_leader: bool,
    /// A write was proposed within [`ACTIVE_AFTER_WRITE`].
    pub recently_written: bool,
    /// Leader: every follower matched the last log index.
    pub followers_caught_up: bool,
    /// Follower: the leader's broker answers pings and says it leads the
    /// group (after a restart a node may still name an old leader that no
    /// longer leads).
    pub leader_alive: bool,
    /// Follower: this is the first live replica in node-id order (it starts
    /// the election when the leader dies).
    pub first_live_follower: bool,
    /// The ticker is running now.
    pub ticking: bool,
}

/// The quiescence rule, a pure function.
pub fn decide(v: GroupView) -> Decision {
    if v.is_leader {
        return if v.recently_written || !v.followers_caught_up { Decision::Tick } else { Decision::Park };
    }
    if v.leader_alive {
        Decision::Park
    } else if !v.ticking && v.first_live_follower {
        Decision::TickAndElect
    } else {
        Decision::Tick
    }
}

fn view(p: &Partition, liveness: &Liveness, me: u32) -> GroupView {
    let m = p.raft.metrics().borrow_watched().clone();
    let is_leader = m.state.is_leader();
    let last = m.last_log_index;
    let followers_caught_up =
        m.replication.as_ref().is_some_and(|r| r.iter().all(|(_, matched)| matched.map(|l| l.index) == last));
    let leader_broker = m.current_leader.and_then(|n| p.broker_of(n));
    let leader_alive = leader_broker.is_some_and(|b| b != me && liveness.leads(b, p.group));
    let first_live_follower = p
        .replicas()
        .iter()
        .filter(|r| Some(r.broker) != leader_broker && (r.broker == me || liveness.is_alive(r.broker)))
        .min_by_key(|r| r.node)
        .is_some_and(|r| r.node == p.node_id);
    GroupView {
        is_leader,
        recently_written: p.written_within(ACTIVE_AFTER_WRITE),
        followers_caught_up,
        leader_alive,
        first_live_follower,
        ticking: p.is_ticking(),
    }
}

/// Applies [`decide`] to every hosted partition every `period`, forever.
pub async fn run(me: u32, table: PartitionTable, liveness: Liveness, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for p in table.all() {
            apply(&p, decide(view(&p, &liveness, me))).await;
        }
    }
}

async fn apply(p: &Arc<Partition>, d: Decision) {
    match d {
        Decision::Tick => p.set_ticking(true),
        Decision::Park => p.set_ticking(false),
        Decision::TickAndElect if p.replica.is_recovering() => p.set_ticking(true),
        Decision::TickAndElect => {
            p.set_ticking(true);
            tracing::info!(topic = %p.topic, partition = p.partition, "leader's broker is not answering: starting an election");
            let _ = p.raft.trigger().elect(true).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: GroupView = GroupView {
        is_leader: false,
        recently_written: false,
        followers_caught_up: true,
        leader_alive: true,
        first_live_follower: false,
        ticking: true,
    };

    #[test]
    fn idle_groups_park_and_dead_leaders_trigger_one_election() {
        let leader = GroupView { is_leader: true, ..BASE };
        assert_eq!(decide(leader), Decision::Park);
        assert_eq!(decide(GroupView { recently_written: true, ..leader }), Decision::Tick);
        assert_eq!(decide(GroupView { followers_caught_up: false, ..leader }), Decision::Tick);
        assert_eq!(decide(BASE), Decision::Park);
        let dead = GroupView { leader_alive: false, ticking: false, ..BASE };
        assert_eq!(decide(dead), Decision::Tick);
        assert_eq!(decide(GroupView { first_live_follower: true, ..dead }), Decision::TickAndElect);
        assert_eq!(decide(GroupView { first_live_follower: true, ticking: true, ..dead }), Decision::Tick);
    }
}

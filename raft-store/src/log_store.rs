//! openraft's `RaftLogStorage` and `RaftLogReader` over [`PartitionLog`](crate::log::PartitionLog).

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};

use openraft::OptionalSend;
use openraft::storage::{RaftLogReader, RaftLogStorage};

use crate::appends::{Leadership, ProposalKey};
use crate::replica::Replica;
use crate::types::{Entry, EntryPayload, IoFlushed, LogId, LogState, TypeConfig, Vote};

/// The log half of a replica, as openraft drives it. Clones share state;
/// the reader handed to replication tasks is a clone.
#[derive(Clone, Debug)]
pub struct LogStore {
    pub(crate) replica: Replica,
}

fn bounds(range: &impl RangeBounds<u64>) -> (u64, u64) {
    let start = match range.start_bound() {
        Bound::Included(s) => *s,
        Bound::Excluded(s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(e) => e.saturating_add(1),
        Bound::Excluded(e) => *e,
        Bound::Unbounded => u64::MAX,
    };
    (start, end)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let (start, end) = bounds(&range);
        Ok(self.replica.log().entries(start, end)?)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(self.replica.log().vote())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState, io::Error> {
        Ok(self.replica.log().log_state())
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        // Queued under the log's lock, awaited without it.
        let saved = self.replica.log().queue_vote(vote)?;
        saved.await?;
        self.replica.log().vote_saved(*vote);
        Ok(())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        Ok(self.replica.log().save_committed(committed)?)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.replica.log().committed())
    }

    async fn append<I>(&mut self, entries: I, callback: IoFlushed) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut entries: Vec<Entry> = entries.into_iter().collect();
        let done = Box::new(move |r: io::Result<()>| callback.io_completed(r));
        let watch = self.replica.append_watch();
        // Only a leader registers its proposals (crate::appends), so a
        // follower's appends skip the gate; a deposed leader's leftover
        // registrations match only entries of its own leadership.
        if !watch.is_idle() {
            for e in &mut entries {
                let EntryPayload::Normal(b) = &e.payload else { continue };
                let Some(key) = ProposalKey::of(b) else { continue };
                let leadership =
                    Leadership { term: e.log_id.leader_id.term, node: e.log_id.leader_id.node_id };
                if !watch.admit(key, leadership) {
                    tracing::warn!(log_id = %e.log_id, batch = %b,
                        "stored blank: an earlier batch of its producer was refused by Raft");
                    e.payload = EntryPayload::Blank;
                }
            }
        }
        self.replica.log().append(entries, done)?;
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        Ok(self.replica.log().truncate_after(last_log_id)?)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        Ok(self.replica.purge(log_id)?)
    }
}

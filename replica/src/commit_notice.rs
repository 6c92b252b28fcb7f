//! Commit notices ride along with the next append of their stream.
//!
//! A follower learns the commit index from the leader's AppendEntries
//! (Raft paper §5.3). When the leader's commit index advances and it has no
//! new entries for a follower, the Raft library sends that follower an
//! AppendEntries without entries only to carry it: a commit notice. With
//! one batch in flight (a producer that waits for each acknowledgement
//! before it sends the next), that is one more round trip per record per
//! follower, and because a replication stream sends one request at a time,
//! the next record's entries wait behind it. Measured on 2026-12-01: four
//! peer RPCs per record at the leader, two of them notices.
//!
//! So a request without entries waits up to [`HOLD`] for the next request
//! of its stream. If that one continues from the same place (the same
//! leader vote and previous log id, as the next request of one stream
//! does), it is sent instead, carrying the larger commit index, and its
//! answer acknowledges both: the library matches answers to requests by
//! log id, and a follower that accepts the later request also matches at
//! the earlier one's previous log id (the log matching property, §5.3). If
//! nothing comes, the notice goes unchanged, [`HOLD`] late; if the stream
//! ends (a one-request stream: a heartbeat, a probe), at once.
//!
//! Nothing changes about what a follower stores or when the leader
//! commits: only a follower's commit index, when no write follows, is
//! learned up to [`HOLD`] later. So a group whose followers answer reads
//! from what they applied (the metadata group: every broker answers
//! Metadata from its own image) sends its notices at once
//! (`ValidSettings::with_commit_notice_hold`). The leader's lease counts
//! from when the library made a request, which for a held notice is
//! earlier than when it went, so holding can only shorten it. The library
//! sends heartbeats as streams of one request, which end at once: they are
//! never held.

use std::time::Duration;

use ferrolog_raft_store::types::AppendEntriesRequest;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};

/// How long a request without entries waits for the next request of its
/// replication stream to ride along with: longer than a producer's turn
/// around between an acknowledgement and its next batch (under 2 ms here),
/// and than its round over a few partitions with one batch in flight (6
/// partitions at ~800 batches/s: 7.5 ms per partition); short beside the
/// heartbeat interval, whose heartbeats carry the commit index too, and the
/// election timeout (a partition follower's commit index serves no read or
/// election). Measured 2026-12-02 with one batch in flight over 6
/// partitions, alternating with the build before commit notices rode along
/// and before lazy metadata rounds: with 2 ms, within the noise (each
/// partition's next batch came later); with 10 ms, p99 1.80–2.07 against
/// 2.34–2.50 ms, three pairs.
pub(crate) const HOLD: Duration = Duration::from_millis(10);

/// Whether `next` can carry `held` (a request without entries): it
/// continues from the same place, with the same leader vote and previous
/// log id.
pub(crate) fn can_carry(held: &AppendEntriesRequest, next: &AppendEntriesRequest) -> bool {
    debug_assert!(held.entries.is_empty(), "only a request without entries is held");
    held.vote == next.vote && held.prev_log_id == next.prev_log_id
}

/// `next` carrying `held` ([`can_carry`]): with the larger of the two
/// commit indexes.
pub(crate) fn carry(held: &AppendEntriesRequest, next: AppendEntriesRequest) -> AppendEntriesRequest {
    let leader_commit = held.leader_commit.max(next.leader_commit);
    AppendEntriesRequest { leader_commit, ..next }
}

/// The requests of one replication stream, with each request without
/// entries held up to `hold` for the next to carry it ([`carry`]).
pub(crate) fn ride_along<S>(input: S, hold: Duration) -> BoxStream<'static, AppendEntriesRequest>
where
    S: Stream<Item = AppendEntriesRequest> + Send + Unpin + 'static,
{
    struct State<S> {
        input: S,
        /// A request read while holding that could not carry the held one.
        next: Option<AppendEntriesRequest>,
        /// The input has ended (it must not be polled again).
        ended: bool,
    }
    let state = State { input, next: None, ended: false };
    futures::stream::unfold(state, move |mut st| async move {
        let mut req = match st.next.take() {
            Some(r) => r,
            None if st.ended => return None,
            None => st.input.next().await?,
        };
        let deadline = tokio::time::Instant::now() + hold;
        while req.entries.is_empty() && !st.ended {
            match tokio::time::timeout_at(deadline, st.input.next()).await {
                // Nothing came: the notice goes as it is.
                Err(_elapsed) => break,
                Ok(None) => st.ended = true,
                // Still without entries if `next` is a second notice:
                // then held on until the same deadline.
                Ok(Some(next)) if can_carry(&req, &next) => req = carry(&req, next),
                // Not seen within one replication stream (its requests
                // share the vote and go on from where the last ended); if
                // it were, the notice would go first, then this one.
                Ok(Some(next)) => {
                    st.next = Some(next);
                    break;
                }
            }
        }
        Some((req, st))
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use ferrolog_raft_store::types::{Entry, EntryPayload, LogId, Vote};
    use openraft::vote::RaftLeaderId;

    use super::*;

    fn log_id(term: u64, index: u64) -> LogId {
        LogId::new(ferrolog_raft_store::types::LeaderId::new(term, 1), index)
    }

    fn request(term: u64, prev: u64, entries: u64, commit: u64) -> AppendEntriesRequest {
        AppendEntriesRequest {
            vote: Vote::new_committed(term, 1),
            prev_log_id: Some(log_id(term, prev)),
            leader_commit: Some(log_id(term, commit)),
            entries: (prev + 1..=prev + entries)
                .map(|i| Entry { log_id: log_id(term, i), payload: EntryPayload::Blank })
                .collect(),
        }
    }

    #[test]
    fn a_notice_rides_with_the_next_request_of_its_stream_only() {
        let notice = request(2, 10, 0, 10);
        let next = request(2, 10, 3, 9);
        assert!(can_carry(&notice, &next), "the stream's next");
        let merged = carry(&notice, next);
        assert_eq!(merged.entries.len(), 3);
        assert_eq!(merged.leader_commit, Some(log_id(2, 10)), "the larger commit index");
        assert_eq!(merged.prev_log_id, Some(log_id(2, 10)));
        assert_eq!(carry(&notice, request(2, 10, 1, 11)).leader_commit, Some(log_id(2, 11)));
        assert!(!can_carry(&notice, &request(2, 11, 1, 11)), "another previous log id");
        assert!(!can_carry(&notice, &request(3, 10, 1, 10)), "another leader vote");
    }

    async fn collect(
        sent: Vec<(Duration, AppendEntriesRequest)>,
        hold: Duration,
    ) -> Vec<(u64, usize, Option<LogId>)> {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            for (after, r) in sent {
                tokio::time::sleep(after).await;
                tx.send(r).await.expect("send");
            }
        });
        let input = tokio_stream::wrappers::ReceiverStream::new(rx);
        ride_along(input, hold)
            .map(|r| (r.prev_log_id.map_or(0, |l| l.index), r.entries.len(), r.leader_commit))
            .collect()
            .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_one_request_stream_is_never_held() {
        // As the library sends heartbeats: a stream of one request.
        let started = tokio::time::Instant::now();
        let input = futures::stream::iter([request(2, 10, 0, 10)]);
        let got: Vec<_> = ride_along(input, Duration::from_secs(60)).collect().await;
        assert_eq!(got.len(), 1);
        assert_eq!(started.elapsed(), Duration::ZERO, "sent at once");
    }

    #[tokio::test(start_paused = true)]
    async fn held_notices_go_with_the_next_append_or_alone_after_the_hold() {
        let hold = Duration::from_millis(2);
        let ms = Duration::from_millis;
        let got = collect(
            vec![
                (ms(0), request(2, 10, 2, 9)),
                // Commit notice, then the next append within the hold.
                (ms(5), request(2, 12, 0, 12)),
                (ms(1), request(2, 12, 1, 12)),
                // A notice nothing follows within the hold, then an append.
                (ms(5), request(2, 13, 0, 13)),
                (ms(10), request(2, 13, 1, 13)),
                // Two notices in a row and an append, all within one hold.
                (ms(5), request(2, 14, 0, 13)),
                (ms(0), request(2, 14, 0, 14)),
                (ms(1), request(2, 14, 2, 14)),
                // A notice followed by one from elsewhere (a new leader).
                (ms(5), request(2, 16, 0, 16)),
                (ms(0), request(3, 16, 1, 16)),
                // A notice the stream ends after.
                (ms(5), request(3, 17, 0, 17)),
            ],
            hold,
        )
        .await;
        let c = |t, i| Some(log_id(t, i));
        assert_eq!(
            got,
            vec![
                (10, 2, c(2, 9)),
                (12, 1, c(2, 12)),
                (13, 0, c(2, 13)),
                (13, 1, c(2, 13)),
                (14, 2, c(2, 14)),
                (16, 0, c(2, 16)),
                (16, 1, c(3, 16)),
                (17, 0, c(3, 17)),
            ]
        );
    }
}

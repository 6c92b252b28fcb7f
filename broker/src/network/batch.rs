//! Many groups' heartbeats and commit notices to one broker in one `Batch`
//! RPC (peer protocol 1.2; `proto/ferrolog/raft/v1/raft.proto`).
//!
//! A broker leading thousands of partitions sends thousands of heartbeats
//! and commit notices (AppendEntries without entries) a second, and more
//! while they are elected: when many partitions are created, after a
//! restart. As single RPCs each costs an HTTP/2 stream, its headers and
//! trailers, a task on each side and a timer. Here the calls to one peer
//! broker wait in a queue; one sender task per peer takes what is queued
//! (up to [`BATCH_CALLS_MAX`]) and sends it as one `Batch` request, at most
//! one batch per [`BATCH_GAP`] so that calls arriving meanwhile share the
//! next. The receiver handles the calls concurrently and streams each
//! answer back as it is ready, so a slow group delays only its own answer,
//! and gives up on a call after the time its caller waits (`timeout_ms`:
//! the transport's wait, at least the minimum RPC timeout; openraft's
//! heartbeat worker may stop waiting sooner). A batch whose callers all
//! gave up is dropped, which resets its stream. Entries never go this way:
//! an AppendEntries with entries is its own RPC.
//!
//! Votes and pre-votes (peer protocol 1.3) go in batches too, but through
//! a queue and sender of their own per peer ([`Lane::Votes`]): behind
//! heartbeats, pre-votes waited and timed out, and at 10,000 partitions
//! elections stalled for minutes (measured 2026-12-01, when votes shared
//! the one queue). Batched, the campaigns a broker starts in one round
//! reach each peer in one request instead of one HTTP/2 stream each.
//!
//! A peer that answers `UNIMPLEMENTED` (a broker older than 1.2), or, on
//! the votes lane, answers votes as calls it does not know (1.2), is
//! remembered for [`UNBATCHED_FOR`] ([`PeerQueue::refused_by_peer`]); the
//! refused batch's calls, and calls meanwhile, go as single RPCs, and after
//! that a batch is tried again (the peer may have been upgraded).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrolog_proto::raft as pb;
use ferrolog_replica::PeerUnreachable;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Channel;

use super::protocol::peer_client;

/// The least time between two batches to one peer (when it has to be waited
/// out, timers round it up to about 2 ms), so calls arriving meanwhile
/// share the next.
pub const BATCH_GAP: Duration = Duration::from_millis(1);
/// Calls in one batch at most.
pub const BATCH_CALLS_MAX: usize = 2048;
/// How often a batch in flight checks whether anyone still waits for it.
const ABANDONED_CHECK: Duration = Duration::from_millis(20);
/// How long calls to a peer that refused a batch go singly before a batch
/// is tried again.
pub const UNBATCHED_FOR: Duration = Duration::from_secs(60);

/// When the peer last refused a batch (`UNIMPLEMENTED`), or batched votes.
type Refused = Arc<Mutex<Option<tokio::time::Instant>>>;

/// Which calls a peer queue carries: each lane has its own queue and
/// sender per peer, so one kind never waits behind the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// AppendEntries without entries: heartbeats and commit notices.
    Small,
    /// Votes and pre-votes (peer protocol 1.3).
    Votes,
}

/// A call waiting for its batch.
struct Queued {
    call: pb::batch_call::Call,
    /// How long the caller waits for the answer.
    timeout: Duration,
    reply: oneshot::Sender<Result<pb::batch_answer::Answer, PeerUnreachable>>,
}

/// The queue of calls to one peer broker, drained by its sender task.
#[derive(Clone, Debug)]
pub struct PeerQueue {
    tx: mpsc::UnboundedSender<Queued>,
    refused: Refused,
    sent: Arc<BatchStats>,
}

/// What one peer queue has handed to the network: batches, and calls in
/// them (a batch may still fail or be refused).
#[derive(Debug, Default)]
pub struct BatchStats {
    batches: AtomicU64,
    calls: AtomicU64,
}

impl BatchStats {
    /// (batches handed to the network, calls in them).
    pub fn get(&self) -> (u64, u64) {
        (self.batches.load(Ordering::Relaxed), self.calls.load(Ordering::Relaxed))
    }
}

impl PeerQueue {
    /// A queue to the peer behind `channel`, with its sender task; the task
    /// ends when the last clone of the queue is dropped.
    pub fn spawn(peer: String, channel: Channel) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let refused = Refused::default();
        let sent = Arc::<BatchStats>::default();
        tokio::spawn(send_batches(peer, channel, rx, refused.clone(), sent.clone()));
        Self { tx, refused, sent }
    }

    /// (batches handed to the network, calls in them) so far.
    pub fn sent(&self) -> (u64, u64) {
        self.sent.get()
    }

    /// Whether calls to the peer go in batches: it has not refused one in
    /// the last [`UNBATCHED_FOR`].
    pub fn batches(&self) -> bool {
        batches(&self.refused)
    }

    /// Records that the peer refused these calls batched (`why` is logged
    /// once per [`UNBATCHED_FOR`]): calls go singly for that long.
    pub fn refused_by_peer(&self, peer: &str, why: &str) {
        refuse(&self.refused, peer, why);
    }

    /// Whether the sender task still runs (it ends only with the queue).
    pub fn is_open(&self) -> bool {
        !self.tx.is_closed()
    }

    /// Sends `call` in the next batch and waits up to `timeout` for its
    /// answer.
    ///
    /// # Errors
    /// [`PeerUnreachable`]: the batch failed or timed out, the peer refused
    /// batches, or it answered without this call.
    pub async fn call(
        &self,
        call: pb::batch_call::Call,
        timeout: Duration,
    ) -> Result<pb::batch_answer::Answer, PeerUnreachable> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Queued { call, timeout, reply })
            .map_err(|_| PeerUnreachable("the peer's batch sender has stopped".into()))?;
        match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(PeerUnreachable("the batch was dropped before its answer".into())),
            Err(_) => Err(PeerUnreachable(format!("no answer within {} ms (batched)", timeout.as_millis()))),
        }
    }
}

/// The sender task of one peer: takes what is queued (up to
/// [`BATCH_CALLS_MAX`]), at most one batch per [`BATCH_GAP`], and sends each
/// batch in a task of its own; while the peer refuses batches, sends the
/// calls singly instead.
async fn send_batches(
    peer: String,
    channel: Channel,
    mut rx: mpsc::UnboundedReceiver<Queued>,
    refused: Refused,
    sent: Arc<BatchStats>,
) {
    let mut last = tokio::time::Instant::now();
    while let Some(first) = rx.recv().await {
        // The clock is checked first: a timer set for a moment already past
        // still waits for the timer wheel's next turn (about 1 ms), and a
        // commit notice waiting there holds back its group's next append to
        // that follower (openraft sends a group's requests to one follower
        // one after another): measured 2026-12-02 with one produce in
        // flight on one partition, notices waited 0.65 ms (median) in this
        // queue, and 1 µs with the check (p99 1.8 ms: a notice that follows
        // the last batch within the gap). The gap itself stays: sending
        // lone calls at once, as tried the same day, multiplied the batches
        // while thousands of partitions elected (a 5,000-partition restart
        // took 51 and 80 s instead of 27–28 s).
        if tokio::time::Instant::now() < last + BATCH_GAP {
            tokio::time::sleep_until(last + BATCH_GAP).await;
        }
        let mut calls = vec![first];
        while calls.len() < BATCH_CALLS_MAX {
            match rx.try_recv() {
                Ok(q) => calls.push(q),
                Err(_) => break,
            }
        }
        last = tokio::time::Instant::now();
        // Callers that gave up already need no answer.
        calls.retain(|q| !q.reply.is_closed());
        if calls.is_empty() {
            continue;
        }
        if !batches(&refused) {
            send_singly(&channel, calls);
            continue;
        }
        sent.batches.fetch_add(1, Ordering::Relaxed);
        sent.calls.fetch_add(calls.len() as u64, Ordering::Relaxed);
        tokio::spawn(send_batch(peer.clone(), channel.clone(), calls, refused.clone()));
    }
}

/// Whether the peer has not refused a batch in the last [`UNBATCHED_FOR`].
fn batches(refused: &Refused) -> bool {
    let refused = refused.lock().unwrap_or_else(|p| p.into_inner());
    refused.is_none_or(|at| at.elapsed() >= UNBATCHED_FOR)
}

/// Records a refusal of batched calls at `refused`, logging `why` unless
/// one was recorded within [`UNBATCHED_FOR`].
fn refuse(refused: &Refused, peer: &str, why: &str) {
    let before = refused.lock().unwrap_or_else(|p| p.into_inner()).replace(tokio::time::Instant::now());
    if before.is_none_or(|at| at.elapsed() >= UNBATCHED_FOR) {
        tracing::info!(peer, "{why}: sending them singly for {} s", UNBATCHED_FOR.as_secs());
    }
}

/// Sends each call as its own RPC (to a peer that refuses batches),
/// answering its caller.
fn send_singly(channel: &Channel, calls: Vec<Queued>) {
    for q in calls {
        let client = peer_client(channel.clone()).max_decoding_message_size(usize::MAX);
        tokio::spawn(async move {
            let _ = q.reply.send(send_one(client, q.call, q.timeout).await);
        });
    }
}

/// One call as its own RPC, waiting up to `timeout`.
async fn send_one(
    mut client: ferrolog_proto::raft::peer_client::PeerClient<
        tonic::service::interceptor::InterceptedService<Channel, super::protocol::Stamp>,
    >,
    call: pb::batch_call::Call,
    timeout: Duration,
) -> Result<pb::batch_answer::Answer, PeerUnreachable> {
    use pb::batch_answer::Answer;
    use pb::batch_call::Call;
    fn request<T>(m: T, timeout: Duration) -> tonic::Request<T> {
        let mut req = tonic::Request::new(m);
        req.set_timeout(timeout);
        req
    }
    let answer = match call {
        Call::AppendEntries(r) => {
            client.append_entries(request(r, timeout)).await.map(|r| Answer::AppendEntries(r.into_inner()))
        }
        Call::Vote(r) => client.vote(request(r, timeout)).await.map(|r| Answer::Vote(r.into_inner())),
        Call::PreVote(r) => client.pre_vote(request(r, timeout)).await.map(|r| Answer::Vote(r.into_inner())),
    };
    answer.map_err(|s| PeerUnreachable(s.to_string()))
}

/// Sends one batch (of at least one call) and hands each answer to its
/// caller as it arrives. A refused batch (`UNIMPLEMENTED`) is sent again
/// singly.
async fn send_batch(peer: String, channel: Channel, calls: Vec<Queued>, refused: Refused) {
    let timeout = calls.iter().map(|q| q.timeout).max().unwrap_or_default();
    // Kept to send singly if the peer refuses the batch: requests without
    // entries are a few dozen bytes each.
    let copies: Vec<pb::batch_call::Call> = calls.iter().map(|q| q.call.clone()).collect();
    let (calls, mut waiting): (Vec<_>, Vec<_>) = calls
        .into_iter()
        .map(|q| {
            let timeout_ms = u32::try_from(q.timeout.as_millis()).unwrap_or(u32::MAX).max(1);
            (pb::BatchCall { call: Some(q.call), timeout_ms }, Some((q.reply, q.timeout)))
        })
        .unzip();
    let mut req = tonic::Request::new(pb::BatchRequest { calls });
    req.set_timeout(timeout);
    let mut client = peer_client(channel.clone()).max_decoding_message_size(usize::MAX);
    let fail_all = |waiting: &mut Vec<Option<(oneshot::Sender<_>, Duration)>>, why: &str| {
        for (w, _) in waiting.iter_mut().filter_map(Option::take) {
            let _ = w.send(Err(PeerUnreachable(why.to_owned())));
        }
    };
    let answers = match tokio::time::timeout(timeout, client.batch(req)).await {
        Err(_) => return fail_all(&mut waiting, "no answer to the batch in time"),
        Ok(answers) => answers,
    };
    let mut answers = match answers {
        Ok(r) => r.into_inner(),
        Err(s) if s.code() == tonic::Code::Unimplemented => {
            refuse(&refused, &peer, "the peer does not take batched calls (peer protocol older than 1.2)");
            let singles = copies
                .into_iter()
                .zip(waiting)
                .filter_map(|(call, w)| w.map(|(reply, timeout)| Queued { call, timeout, reply }))
                .collect();
            return send_singly(&channel, singles);
        }
        Err(s) => return fail_all(&mut waiting, &s.to_string()),
    };
    let mut check = tokio::time::interval(ABANDONED_CHECK);
    loop {
        let next = tokio::select! {
            next = answers.message() => next,
            _ = check.tick() => {
                // Every caller gave up: drop the call, which resets its
                // stream, and the peer stops working on it.
                if waiting.iter().flatten().all(|(w, _)| w.is_closed()) {
                    return;
                }
                continue;
            }
        };
        match next {
            Ok(Some(a)) => {
                let w = usize::try_from(a.index).ok().and_then(|i| waiting.get_mut(i)).and_then(Option::take);
                match (w, a.answer) {
                    (Some((w, _)), Some(answer)) => {
                        let _ = w.send(Ok(answer));
                    }
                    (Some((w, _)), None) => {
                        let _ = w.send(Err(PeerUnreachable(
                            "the peer answered a batched call with nothing".into(),
                        )));
                    }
                    (None, _) => {
                        tracing::warn!(peer, index = a.index, "an answer to no call of the batch, ignored");
                    }
                }
            }
            Ok(None) => {
                return fail_all(&mut waiting, "the peer ended the batch without answering this call");
            }
            Err(s) => return fail_all(&mut waiting, &s.to_string()),
        }
    }
}

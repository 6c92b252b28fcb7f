//! One Kafka connection: size-prefixed request frames in, responses out in
//! the same order.
//!
//! Requests are taken in order. A Produce's batches are proposed before
//! the next request is taken, and its answer waits for their commits while
//! the connection goes on, so a client that pipelines produce requests
//! (librdkafka's `max.in.flight`) keeps several commits under way, proposed
//! in the order it sent them. Any other request is taken only once every
//! earlier answer is written, and is answered before the next is taken, so
//! it sees the effects of the requests before it, as on Kafka's
//! one-request-at-a-time connections. At most [`MAX_PIPELINED`] answers
//! wait at once, and no further request is read while the requests
//! waiting for answers hold `socket_request_max_bytes` or more (a
//! pending produce may hold its request's bytes), so a connection pins at
//! most about three requests' worth of memory however a client pipelines;
//! answers are written strictly in request order, and a connection closed
//! for a bad frame first writes the answers owed. The idle timeout
//! (`connections_max_idle_ms`) runs only while nothing is owed: a request
//! that waits long (a JoinGroup during a rebalance) does not make its
//! connection idle.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use futures::{FutureExt, StreamExt};
use kafka_protocol::messages::{ApiKey, RequestHeader, RequestKind, ResponseHeader, ResponseKind};
use kafka_protocol::protocol::{Decodable, Encodable};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::mpsc;
use tracing::Instrument;

use super::{KafkaService, guard, versions};
use crate::listener::Conn;

/// Bytes read into a request's buffer per step: memory grows with what a
/// client actually sends, not with the size it announces.
const READ_STEP_BYTES: usize = 64 << 10;

/// Most answers of one connection waiting at once (produce commits under
/// way); the next request is read when one is written.
pub const MAX_PIPELINED: usize = 16;

/// A framed answer still to come (`None`: the request wants none).
type Answer = BoxFuture<'static, Result<Option<Bytes>, String>>;

/// Serves one connection until the client closes it, goes idle, or sends
/// something that cannot be a request (logged, then closed).
pub async fn run(conn: Conn, service: Arc<KafkaService>) {
    let peer = conn.peer().map(|p| p.to_string()).unwrap_or_default();
    let (rd, wr) = tokio::io::split(conn);
    let mut wr = BufWriter::new(wr);
    // Frames are read by their own task, so reading is never cut short by
    // an answer becoming ready (a cancelled read would lose bytes).
    let (tx, mut frames) = mpsc::channel::<Result<Bytes, String>>(1);
    // Requests taken and not yet answered: the reader's idle timer waits
    // while there are any.
    let owed = Arc::new(AtomicUsize::new(0));
    let reader = tokio::spawn(read_frames(BufReader::new(rd), service.clone(), tx, owed.clone()));
    let mut answers = Pending { answers: FuturesOrdered::new(), sizes: VecDeque::new(), bytes: 0, owed };
    let budget = service.config.socket_request_max_bytes;
    let outcome: Result<(), String> = async {
        loop {
            tokio::select! {
                biased;
                Some(done) = answers.next(), if !answers.is_empty() => {
                    if let Some(out) = done? {
                        write(&mut wr, &out).await?;
                    }
                }
                frame = frames.recv(), if answers.len() < MAX_PIPELINED && answers.bytes < budget => {
                    // The client is done, or sent what cannot be a request:
                    // what it asked before is answered first, then the
                    // connection closes.
                    let frame = match frame {
                        None => return drain(&mut answers, &mut wr).await,
                        Some(Err(why)) => {
                            drain(&mut answers, &mut wr).await?;
                            return Err(why);
                        }
                        Some(Ok(frame)) => frame,
                    };
                    if frame.get(..2) == Some(&(ApiKey::Produce as i16).to_be_bytes()[..]) {
                        // Produces pipeline; answers already there go out first.
                        while let Some(done) = answers.next_now() {
                            if let Some(out) = done? {
                                write(&mut wr, &out).await?;
                            }
                        }
                    } else {
                        // Anything else sees the effects of every request
                        // before it (Kafka's connections run one request at
                        // a time): earlier produces are answered first.
                        drain(&mut answers, &mut wr).await?;
                    }
                    let size = frame.len();
                    answers.owed.fetch_add(1, Ordering::Relaxed);
                    match respond(&service, frame).await {
                        Ok(answer) => answers.push_back(answer, size),
                        Err(why) => {
                            drain(&mut answers, &mut wr).await?;
                            return Err(why);
                        }
                    }
                }
            }
        }
    }
    .await;
    reader.abort();
    if let Err(why) = outcome
        && !why.is_empty()
    {
        tracing::warn!(%peer, "kafka: {why}; closing the connection");
    }
}

/// The answers a connection owes, in request order, with the sizes of
/// their requests.
struct Pending {
    answers: FuturesOrdered<Answer>,
    /// The request size of each answer, in the same order.
    sizes: VecDeque<usize>,
    /// Sum of `sizes`, bytes.
    bytes: usize,
    /// Requests taken and not yet answered (shared with the reader).
    owed: Arc<AtomicUsize>,
}

impl Pending {
    fn push_back(&mut self, answer: Answer, size: usize) {
        self.answers.push_back(answer);
        self.sizes.push_back(size);
        self.bytes += size;
    }

    fn len(&self) -> usize {
        self.answers.len()
    }

    fn is_empty(&self) -> bool {
        self.answers.is_empty()
    }

    /// The next answer in order, once ready; `None` when none is owed.
    async fn next(&mut self) -> Option<Result<Option<Bytes>, String>> {
        let done = self.answers.next().await?;
        self.settle();
        Some(done)
    }

    /// The next answer if it is ready now.
    fn next_now(&mut self) -> Option<Result<Option<Bytes>, String>> {
        let done = self.answers.next().now_or_never()??;
        self.settle();
        Some(done)
    }

    fn settle(&mut self) {
        self.bytes -= self.sizes.pop_front().unwrap_or(0);
        self.owed.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Writes and flushes one answer; an error (the client gone) is empty:
/// nothing to log.
async fn write(wr: &mut (impl AsyncWrite + Unpin), out: &[u8]) -> Result<(), String> {
    wr.write_all(out).await.map_err(|_| String::new())?;
    wr.flush().await.map_err(|_| String::new())
}

/// Writes every pending answer, in order.
///
/// # Errors
/// The first answer that fails (an `acks=0` produce's failure, an encoding
/// error), after the answers before it were written; or the client gone.
async fn drain(answers: &mut Pending, wr: &mut (impl AsyncWrite + Unpin)) -> Result<(), String> {
    while let Some(done) = answers.next().await {
        if let Some(out) = done? {
            write(wr, &out).await?;
        }
    }
    Ok(())
}

/// Reads frames into `tx` until the client closes, goes idle (no request
/// for the idle timeout while nothing is `owed`), or sends a size out of
/// bounds (sent as an error, to be logged).
async fn read_frames(
    mut rd: BufReader<impl AsyncRead + Unpin>,
    service: Arc<KafkaService>,
    tx: mpsc::Sender<Result<Bytes, String>>,
    owed: Arc<AtomicUsize>,
) {
    let idle = super::idle_timeout(&service.config);
    let max = service.config.socket_request_max_bytes;
    loop {
        // Wait for the next request's first bytes: `fill_buf` keeps what
        // it reads in the buffer, so a wait cut by the timer loses nothing
        // and is taken again while answers are owed.
        loop {
            match tokio::time::timeout(idle, rd.fill_buf()).await {
                Err(_) if owed.load(Ordering::Relaxed) > 0 => continue,
                Err(_) => {
                    tracing::debug!("kafka: closing an idle connection");
                    return;
                }
                Ok(Ok(b)) if !b.is_empty() => break,
                Ok(_) => return, // closed by the client
            }
        }
        let size = match tokio::time::timeout(idle, rd.read_i32()).await {
            Ok(Ok(n)) => n,
            _ => return, // closed, or stalled inside the size
        };
        let Some(size) = usize::try_from(size).ok().filter(|s| (8..=max).contains(s)) else {
            let _ = tx
                .send(Err(format!(
                    "a request size of {size} bytes is out of bounds (8 to socket_request_max_bytes = {max})"
                )))
                .await;
            return;
        };
        let mut buf = BytesMut::new();
        while buf.len() < size {
            buf.reserve((size - buf.len()).min(READ_STEP_BYTES));
            let want = size - buf.len();
            let read = tokio::time::timeout(idle, (&mut rd).take(want as u64).read_buf(&mut buf)).await;
            match read {
                Ok(Ok(n)) if n > 0 => {}
                _ => {
                    let _ = tx
                        .send(Err(format!(
                            "the connection ended {} bytes into a {size}-byte request",
                            buf.len()
                        )))
                        .await;
                    return;
                }
            }
        }
        if tx.send(Ok(buf.freeze())).await.is_err() {
            return;
        }
    }
}

/// The framed answer to one request frame, to come; `None` when the
/// request wants none (a produce with `acks=0`).
///
/// # Errors
/// Why the frame cannot be answered (the connection is then closed).
pub async fn respond(service: &KafkaService, frame: Bytes) -> Result<Answer, String> {
    let mut peek = &frame[..];
    let (key, version, correlation_id) = (peek.get_i16(), peek.get_i16(), peek.get_i32());
    let api = ApiKey::try_from(key).map_err(|_| format!("unknown API key {key}"))?;
    if api == ApiKey::ApiVersions && !versions::supported(api, version) {
        // KIP-511: answered at version 0, which every client reads.
        let body = versions::api_versions(kafka_protocol::ResponseError::UnsupportedVersion.code());
        let out = encode(correlation_id, api, 0, ResponseKind::ApiVersions(body))?;
        return Ok(Box::pin(futures::future::ready(Ok(Some(out)))));
    }
    if !versions::supported(api, version) {
        return Err(format!(
            "{api:?} v{version} is not served (ApiVersions lists what is: {:?})",
            versions::range(api)
        ));
    }
    let mut body = frame.clone();
    let header = RequestHeader::decode(&mut body, api.request_header_version(version))
        .map_err(|e| format!("{api:?} v{version}: malformed request header: {e}"))?;
    guard::check(api, version, &body).map_err(|e| format!("{api:?} v{version}: malformed request: {e}"))?;
    let request = RequestKind::decode(api, &mut body, version)
        .map_err(|e| format!("{api:?} v{version}: malformed request: {e}"))?;
    let client = header.client_id.as_ref().map(|c| c.to_string()).unwrap_or_default();
    let span = tracing::debug_span!("kafka", api = ?api, version, client = %client);
    let pending = super::dispatch(service, request, version, &client).instrument(span).await?;
    Ok(Box::pin(async move {
        match pending.await? {
            Some(response) => encode(correlation_id, api, version, response).map(Some),
            None => Ok(None),
        }
    }))
}

/// A response frame: size, header, body.
fn encode(correlation_id: i32, api: ApiKey, version: i16, body: ResponseKind) -> Result<Bytes, String> {
    let mut out = BytesMut::with_capacity(64);
    out.put_i32(0);
    ResponseHeader::default()
        .with_correlation_id(correlation_id)
        .encode(&mut out, api.response_header_version(version))
        .map_err(|e| format!("{api:?} v{version}: encoding the response header: {e}"))?;
    body.encode(&mut out, version).map_err(|e| format!("{api:?} v{version}: encoding the response: {e}"))?;
    let len = i32::try_from(out.len() - 4).map_err(|_| format!("{api:?}: a response over 2 GiB"))?;
    out[..4].copy_from_slice(&len.to_be_bytes());
    Ok(out.freeze())
}

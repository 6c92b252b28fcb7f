//! Fetch answers sent without copying their records.
//!
//! tonic encodes a unary answer into one buffer: a 16 MiB `FetchResponse`
//! became a 16 MiB `memmove` on an async worker thread, in one piece that
//! kept the thread (and any task waiting behind it on that core) for
//! milliseconds, and it was the largest single cost of serving reads
//! (`perf record` of a leader under `ferrolog-bench contention`: 7.3% of
//! its CPU samples in `prost`'s copy of `bytes` fields). Kafka answers a
//! fetch with `sendfile` for the same reason.
//!
//! Here the `Fetch` method of the client API is answered by
//! [`ClientRoutes`], in front of the generated service: the request is
//! decoded by tonic's own decoder (its limits and errors), the
//! answer is built by [`ClientService::fetch_answer`], and its gRPC
//! message is sent as a list of chunks ([`message_chunks`]): the
//! protobuf fields around each batch are encoded into small buffers, and
//! each batch's records (already a shared [`Bytes`] slice of what was read
//! from the segment) go out as they are. On the wire the message is byte
//! for byte what `prost` would have written (`fetch_wire` tests check
//! it), so every gRPC client decodes it unchanged; HTTP/2 sends the
//! chunks as DATA frames with vectored writes.
//!
//! Every other method, `Subscribe` included, goes to the generated
//! service.

use std::convert::Infallible;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use ferrolog_proto::client::ferrolog_server::FerrologServer;
use ferrolog_proto::client::{FetchRequest, FetchResponse, RecordBatch};
use http_body::Frame;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};
use tonic::Status;
use tonic::codec::{Codec, Streaming};
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::NamedService;

use super::ClientService;

/// The path of the client API's `Fetch` method.
pub const FETCH_PATH: &str = "/ferrolog.client.v1.Ferrolog/Fetch";

/// Records smaller than this are copied into the surrounding chunk rather
/// than sent as a chunk of their own, bytes: a chunk is at least one
/// HTTP/2 DATA frame (9 bytes of header, a write), which costs more than
/// copying a few KiB.
pub const OWN_CHUNK_MIN_BYTES: usize = 16 << 10;

/// A chunk of copied fields and small records is handed on once it holds
/// this many bytes, so that an answer of many small batches is not one
/// growing buffer (reallocated and copied as it doubles).
pub const COPIED_CHUNK_MAX_BYTES: usize = 64 << 10;

/// The client API: `Fetch` answered here without copying records, every
/// other method by the generated tonic service. Registered under the
/// generated service's name, so clients see one service.
#[derive(Clone, Debug)]
pub struct ClientRoutes {
    generated: FerrologServer<ClientService>,
    service: ClientService,
    /// Largest request message decoded, bytes (as the generated service's).
    max_request_bytes: usize,
    /// Largest answer sent, bytes (as the generated service's).
    max_answer_bytes: usize,
}

impl ClientRoutes {
    /// The routes of `service`, with the message limits the generated
    /// service was given (bytes).
    pub fn new(
        generated: FerrologServer<ClientService>,
        service: ClientService,
        max_request_bytes: usize,
        max_answer_bytes: usize,
    ) -> Self {
        // The gRPC length prefix is a u32: larger answers are refused
        // (`OUT_OF_RANGE`), never encoded.
        let max_answer_bytes = max_answer_bytes.min(u32::MAX as usize);
        Self { generated, service, max_request_bytes, max_answer_bytes }
    }
}

impl NamedService for ClientRoutes {
    const NAME: &'static str = <FerrologServer<ClientService> as NamedService>::NAME;
}

impl Service<http::Request<tonic::body::Body>> for ClientRoutes {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        if req.uri().path() != FETCH_PATH {
            return Box::pin(self.generated.call(req));
        }
        let (service, max_request, max_answer) =
            (self.service.clone(), self.max_request_bytes, self.max_answer_bytes);
        Box::pin(async move {
            let answer = match decode_request(req, max_request).await {
                Ok(request) => service.fetch_answer(request).await,
                Err(status) => return Ok(status.into_http()),
            };
            Ok(respond(&answer, max_answer))
        })
    }
}

/// Decodes the one `FetchRequest` of a unary call with tonic's decoder
/// (its framing, size limit and errors), reading the request to its end
/// as tonic's unary handler does (bytes after the message are an error).
/// A `grpc-encoding` other than `identity` is `UNIMPLEMENTED`, with
/// `grpc-accept-encoding: identity`: this port accepts no compression (as
/// the generated service).
async fn decode_request(
    req: http::Request<tonic::body::Body>,
    max_bytes: usize,
) -> Result<FetchRequest, Status> {
    if let Some(encoding) = req.headers().get("grpc-encoding")
        && encoding.as_bytes() != b"identity"
    {
        let mut status = Status::unimplemented(format!(
            "Content is compressed with `{}`, which this broker does not accept",
            String::from_utf8_lossy(encoding.as_bytes())
        ));
        status
            .metadata_mut()
            .insert("grpc-accept-encoding", tonic::metadata::MetadataValue::from_static("identity"));
        return Err(status);
    }
    let mut codec = tonic_prost::ProstCodec::<FetchResponse, FetchRequest>::default();
    let mut stream = Streaming::new_request(codec.decoder(), req.into_body(), None, Some(max_bytes));
    let request = stream.message().await?.ok_or_else(|| Status::internal("Missing request message."))?;
    stream.trailers().await?;
    Ok(request)
}

/// The HTTP answer of a unary call: `answer` as one gRPC message sent in
/// chunks, then the `grpc-status: 0` trailer. An answer over `max_bytes`
/// is `OUT_OF_RANGE`, as tonic's encoder reports it.
fn respond(answer: &FetchResponse, max_bytes: usize) -> http::Response<tonic::body::Body> {
    let len = answer.encoded_len();
    if len > max_bytes {
        return Status::out_of_range(format!(
            "Error, encoded message length too large: found {len} bytes, the limit is: {max_bytes} bytes"
        ))
        .into_http();
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert(Status::GRPC_STATUS, http::HeaderValue::from_static("0"));
    // The chunks, then the trailers. A stream body gives no size hint, so no
    // `content-length` is sent (tonic's answers carry none).
    let frames: Vec<Result<Frame<Bytes>, Infallible>> = message_chunks(answer)
        .into_iter()
        .map(Frame::data)
        .chain(std::iter::once(Frame::trailers(trailers)))
        .map(Ok)
        .collect();
    let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
    let mut response = http::Response::new(tonic::body::Body::new(body));
    response.headers_mut().insert(http::header::CONTENT_TYPE, tonic::metadata::GRPC_CONTENT_TYPE);
    response
}

/// `r` as a gRPC length-prefixed message (gRPC over HTTP/2: a 0 flag byte
/// for "not compressed", the length as a big-endian u32, the protobuf
/// bytes), split into chunks whose concatenation is exactly that: records
/// of at least [`OWN_CHUNK_MIN_BYTES`] are chunks of their own (the same
/// `Bytes`, not copied); everything else is encoded as `prost` encodes
/// `FetchResponse` (fields in tag order, proto3 defaults left out).
///
/// # Panics
/// If the message is 4 GiB or more (a fetch is capped far below, by
/// `limits.max_fetch_bytes`; [`respond`] refuses anything over its limit
/// first).
pub fn message_chunks(r: &FetchResponse) -> Vec<Bytes> {
    let len = u32::try_from(r.encoded_len()).expect("a fetch answer is smaller than 4 GiB");
    // Every field named: one added to the message fails to compile here
    // until it is encoded.
    let FetchResponse { error, batches, high_watermark, log_start_offset } = r;
    let mut out = Vec::new();
    let mut head = BytesMut::with_capacity(256);
    head.put_u8(0);
    head.put_u32(len);
    if let Some(e) = error {
        prost::encoding::message::encode(1, e, &mut head);
    }
    for b in batches {
        encode_key(2, WireType::LengthDelimited, &mut head);
        encode_varint(b.encoded_len() as u64, &mut head);
        batch_fields(b, &mut head, &mut out);
    }
    if *high_watermark != 0 {
        prost::encoding::uint64::encode(3, high_watermark, &mut head);
    }
    if *log_start_offset != 0 {
        prost::encoding::uint64::encode(4, log_start_offset, &mut head);
    }
    if !head.is_empty() {
        out.push(head.freeze());
    }
    out
}

/// The fields of one `RecordBatch` (as `prost` encodes them) onto `head`;
/// large records become a chunk of their own after what `head` held.
fn batch_fields(b: &RecordBatch, head: &mut BytesMut, out: &mut Vec<Bytes>) {
    let RecordBatch { base_offset, record_count, records } = b;
    if *base_offset != 0 {
        prost::encoding::uint64::encode(1, base_offset, head);
    }
    if *record_count != 0 {
        prost::encoding::uint32::encode(2, record_count, head);
    }
    if records.is_empty() {
        return;
    }
    encode_key(3, WireType::LengthDelimited, head);
    encode_varint(records.len() as u64, head);
    if records.len() < OWN_CHUNK_MIN_BYTES {
        head.extend_from_slice(records);
        if head.len() >= COPIED_CHUNK_MAX_BYTES {
            out.push(head.split().freeze());
        }
    } else {
        out.push(head.split().freeze());
        out.push(records.clone());
    }
}

#[cfg(test)]
mod tests {
    use ferrolog_proto::client::{Error, ErrorCode, LeaderHint};
    use proptest::prelude::*;

    use super::*;

    /// What tonic would have sent: the prefix, then `prost`'s encoding.
    fn expected(r: &FetchResponse) -> Vec<u8> {
        let body = r.encode_to_vec();
        let mut v = vec![0u8];
        v.extend_from_slice(&(body.len() as u32).to_be_bytes());
        v.extend_from_slice(&body);
        v
    }

    fn batch(base_offset: u64, record_count: u32, len: usize) -> RecordBatch {
        RecordBatch { base_offset, record_count, records: Bytes::from(vec![0xa5; len]) }
    }

    #[test]
    fn the_path_is_the_generated_services() {
        assert_eq!(FETCH_PATH, format!("/{}/Fetch", <ClientRoutes as NamedService>::NAME));
    }

    #[test]
    fn large_records_are_sent_as_they_are_not_copied() {
        let big = batch(7, 3, OWN_CHUNK_MIN_BYTES);
        let r = FetchResponse {
            error: None,
            batches: vec![batch(1, 1, 10), big.clone(), batch(0, 0, 0)],
            high_watermark: 9,
            log_start_offset: 0,
        };
        let chunks = message_chunks(&r);
        assert_eq!(chunks.concat(), expected(&r));
        let shared: Vec<&Bytes> = chunks.iter().filter(|c| c.as_ptr() == big.records.as_ptr()).collect();
        assert_eq!(shared.len(), 1, "the large records went out as their own chunk, same memory");
        assert_eq!(chunks.len(), 3, "the fields before, the records, the fields after");
    }

    #[test]
    fn many_small_batches_go_out_in_bounded_chunks() {
        let r = FetchResponse {
            batches: (0..1000).map(|i| batch(i, 1, 1000)).collect(),
            high_watermark: 1000,
            ..FetchResponse::default()
        };
        let chunks = message_chunks(&r);
        assert_eq!(chunks.concat(), expected(&r));
        assert!(chunks.len() > 10, "about 1 MB in {} chunks", chunks.len());
        let largest = chunks.iter().map(Bytes::len).max().unwrap_or(0);
        assert!(largest < COPIED_CHUNK_MAX_BYTES + OWN_CHUNK_MIN_BYTES, "a chunk of {largest} bytes");
    }

    #[test]
    fn an_error_answer_encodes_as_prost_does() {
        let r = FetchResponse {
            error: Some(Error {
                code: ErrorCode::NotLeader as i32,
                message: "not the leader".into(),
                leader: Some(LeaderHint::default()),
                log_start_offset: 0,
                log_end_offset: 12,
            }),
            ..FetchResponse::default()
        };
        assert_eq!(message_chunks(&r).concat(), expected(&r));
        assert_eq!(message_chunks(&FetchResponse::default()).concat(), expected(&FetchResponse::default()));
    }

    proptest! {
        /// Whatever the answer, the chunks are byte for byte `prost`'s
        /// message behind the gRPC prefix, and decode to the answer.
        #[test]
        fn chunks_are_prosts_encoding(
            batches in prop::collection::vec(
                (prop_oneof![Just(0u64), any::<u64>()], prop_oneof![Just(0u32), any::<u32>()],
                 prop_oneof![Just(0usize), 1usize..300, 8000usize..OWN_CHUNK_MIN_BYTES,
                             (OWN_CHUNK_MIN_BYTES - 2)..(OWN_CHUNK_MIN_BYTES + 300)]),
                0..40),
            high_watermark in prop_oneof![Just(0u64), any::<u64>()],
            log_start_offset in prop_oneof![Just(0u64), any::<u64>()],
            with_error in any::<bool>(),
        ) {
            let r = FetchResponse {
                error: with_error.then(|| Error { code: ErrorCode::OffsetOutOfRange as i32, ..Error::default() }),
                batches: batches.into_iter().map(|(o, c, n)| batch(o, c, n)).collect(),
                high_watermark,
                log_start_offset,
            };
            let wire = message_chunks(&r).concat();
            prop_assert_eq!(&wire, &expected(&r));
            prop_assert_eq!(FetchResponse::decode(&wire[5..]).expect("decodes"), r);
        }
    }
}

//! One Kafka connection: size-prefixed request frames in, responses out in
//! the same order, one request at a time (Kafka's own broker mutes a
//! connection while a request is in progress, so clients expect no more).

use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kafka_protocol::messages::{ApiKey, RequestHeader, RequestKind, ResponseHeader, ResponseKind};
use kafka_protocol::protocol::{Decodable, Encodable};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tracing::Instrument;

use super::{KafkaService, guard, versions};
use crate::listener::Conn;

/// Bytes read into a request's buffer per step: memory grows with what a
/// client actually sends, not with the size it announces.
const READ_STEP_BYTES: usize = 64 << 10;

/// Serves one connection until the client closes it, goes idle, or sends
/// something that cannot be a request (logged, then closed).
pub async fn run(conn: Conn, service: Arc<KafkaService>) {
    let peer = conn.peer().map(|p| p.to_string()).unwrap_or_default();
    let (rd, wr) = tokio::io::split(conn);
    let (mut rd, mut wr) = (BufReader::new(rd), BufWriter::new(wr));
    let idle = super::idle_timeout(&service.config);
    let max = service.config.socket_request_max_bytes;
    loop {
        let size = match tokio::time::timeout(idle, rd.read_i32()).await {
            Err(_) => {
                tracing::debug!(%peer, "kafka: closing an idle connection");
                return;
            }
            Ok(Err(_)) => return, // closed by the client
            Ok(Ok(n)) => n,
        };
        let Some(size) = usize::try_from(size).ok().filter(|s| (8..=max).contains(s)) else {
            tracing::warn!(
                %peer,
                size,
                socket_request_max_bytes = max,
                "kafka: closing a connection whose request size is out of bounds"
            );
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
                    tracing::warn!(%peer, size, got = buf.len(), "kafka: connection ended mid-request");
                    return;
                }
            }
        }
        match respond(&service, buf.freeze()).await {
            Ok(Some(out)) => {
                if wr.write_all(&out).await.is_err() || wr.flush().await.is_err() {
                    return;
                }
            }
            Ok(None) => {}
            Err(why) => {
                tracing::warn!(%peer, "kafka: {why}; closing the connection");
                return;
            }
        }
    }
}

/// The framed response to one request frame; `None` when the request
/// wants none (a produce with `acks=0`).
///
/// # Errors
/// Why the frame cannot be answered (the connection is then closed).
pub async fn respond(service: &KafkaService, frame: Bytes) -> Result<Option<Bytes>, String> {
    let mut peek = &frame[..];
    let (key, version, correlation_id) = (peek.get_i16(), peek.get_i16(), peek.get_i32());
    let api = ApiKey::try_from(key).map_err(|_| format!("unknown API key {key}"))?;
    if api == ApiKey::ApiVersions && !versions::supported(api, version) {
        // KIP-511: answered at version 0, which every client reads.
        let body = versions::api_versions(kafka_protocol::ResponseError::UnsupportedVersion.code());
        return encode(correlation_id, api, 0, ResponseKind::ApiVersions(body)).map(Some);
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
    match super::dispatch(service, request, version, &client).instrument(span).await? {
        Some(response) => encode(correlation_id, api, version, response).map(Some),
        None => Ok(None),
    }
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

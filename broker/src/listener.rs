//! Accepted connections for the gRPC servers: Nagle's algorithm off (with
//! it, a small response waiting on a delayed ACK stalls ~40 ms), at most
//! `max_connections` open at once (past that a new connection is closed at
//! once and counted in the log), and a connection that sends nothing for
//! [`FIRST_BYTES_TIMEOUT`] is closed.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// An accepted connection holding one of the listener's permits.
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl Conn {
    /// The remote address, if the socket still knows it.
    pub fn peer(&self) -> Option<std::net::SocketAddr> {
        self.stream.peer_addr().ok()
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// How long a new connection may stay silent before it is closed: a socket
/// that never sends its first bytes (the HTTP/2 preface) would otherwise
/// hold one of the `max_connections` slots forever.
pub const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(10);

/// The connections accepted on `listener`, at most `max_connections` open,
/// each handed on once it has sent its first bytes (within
/// [`FIRST_BYTES_TIMEOUT`]). `what` names the listener in log lines. The
/// listener closes when the returned stream is dropped.
pub fn incoming(
    listener: TcpListener,
    max_connections: usize,
    what: &'static str,
) -> impl Stream<Item = io::Result<Conn>> + Send + 'static {
    let permits = Arc::new(Semaphore::new(max_connections));
    let (tx, rx) = mpsc::channel::<io::Result<Conn>>(64);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (stream, peer) = match accepted {
                Ok(s) => s,
                Err(e) => {
                    // Accept errors (EMFILE, ECONNABORTED) are per connection:
                    // note and keep serving.
                    tracing::warn!(listener = what, "accept: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                tracing::warn!(listener = what, %peer, max_connections, "connection refused: too many connections");
                drop(stream);
                continue;
            };
            let _ = stream.set_nodelay(true);
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                match tokio::time::timeout(FIRST_BYTES_TIMEOUT, stream.peek(&mut first)).await {
                    Ok(Ok(n)) if n > 0 => {
                        let _ = tx.send(Ok(Conn { stream, _permit: permit })).await;
                    }
                    _ => tracing::debug!(listener = what, %peer, "closed a connection that sent nothing"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

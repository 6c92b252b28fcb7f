//! Accepted connections for the gRPC servers: Nagle's algorithm off (with
//! it, a small response waiting on a delayed ACK stalls ~40 ms), and at most
//! `max_connections` open at once: past that a new connection is closed at
//! once and counted in the log.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// An accepted connection holding one of the listener's permits.
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
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

/// The connections accepted on `listener`, at most `max_connections` open.
/// `what` names the listener in log lines.
pub fn incoming(
    listener: TcpListener,
    max_connections: usize,
    what: &'static str,
) -> impl Stream<Item = io::Result<Conn>> + Send + 'static {
    let permits = Arc::new(Semaphore::new(max_connections));
    futures::stream::unfold((listener, permits), move |(listener, permits)| async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    // Accept errors (EMFILE, ECONNABORTED) are per connection:
                    // note and keep serving.
                    tracing::warn!(listener = what, "accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            };
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                tracing::warn!(listener = what, %peer, max_connections, "connection refused: too many connections");
                drop(stream);
                continue;
            };
            let _ = stream.set_nodelay(true);
            return Some((Ok(Conn { stream, _permit: permit }), (listener, permits)));
        }
    })
}

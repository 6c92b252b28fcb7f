//! Accepted connections for the gRPC servers: Nagle's algorithm off (with
//! it, a small response waiting on a delayed ACK stalls ~40 ms), at most
//! `max_connections` open at once (past that a new connection is closed at
//! once and counted in the log), a connection that sends nothing for
//! [`FIRST_BYTES_TIMEOUT`] is closed, and a client-port connection writing
//! a large answer yields its CPU every [`WRITE_BYTES_PER_YIELD`].
//!
//! A listener is the operating system's TCP or an address of an in-memory
//! network ([`crate::network::memory`], for a simulation); connections of
//! the latter are handed on at once (nothing but the process dials them).

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

use crate::network::memory::{MemoryListener, MemoryStream};

/// A listening socket: the operating system's TCP, or an address of an
/// in-memory network.
#[derive(Debug)]
pub enum Listener {
    /// A TCP listener.
    Tcp(TcpListener),
    /// An address of a [`crate::network::memory::MemoryNetwork`].
    Memory(MemoryListener),
}

impl From<TcpListener> for Listener {
    fn from(l: TcpListener) -> Self {
        Listener::Tcp(l)
    }
}

impl From<MemoryListener> for Listener {
    fn from(l: MemoryListener) -> Self {
        Listener::Memory(l)
    }
}

impl Listener {
    /// The address it listens on.
    ///
    /// # Errors
    /// The OS's, for a TCP listener.
    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        match self {
            Listener::Tcp(l) => l.local_addr(),
            Listener::Memory(l) => Ok(l.local_addr()),
        }
    }

    async fn accept(&mut self) -> io::Result<(Socket, std::net::SocketAddr)> {
        match self {
            Listener::Tcp(l) => l.accept().await.map(|(s, a)| (Socket::Tcp(s), a)),
            Listener::Memory(l) => l.accept().await.map(|(s, a)| (Socket::Memory(s), a)),
        }
    }
}

/// An accepted connection's stream.
#[derive(Debug)]
enum Socket {
    Tcp(TcpStream),
    Memory(MemoryStream),
}

/// An accepted connection holding one of the listener's permits.
#[derive(Debug)]
pub struct Conn {
    stream: Socket,
    _permit: OwnedSemaphorePermit,
    /// Bytes written between yields of the CPU; `None`: never yields.
    yield_every: Option<usize>,
    /// Bytes written since this connection last yielded the CPU or found
    /// its socket full.
    written: usize,
}

/// Bytes a client-port connection writes without a pause before it yields
/// its thread's CPU (`sched_yield(2)`, before the next write).
///
/// Writing a large answer (a 16 MiB fetch) is thousands of socket writes
/// that never block, in one task poll after another on one worker thread,
/// and on loopback each write also runs the receiver's TCP processing. The
/// scheduler lets such a thread run its whole slice: measured with
/// `perf sched timehist` under `ferrolog-bench contention` (Linux 6.18,
/// 2 vCPUs), a leader worker wrote for 3.6–4.3 ms straight while Raft
/// workers of all three brokers waited 1.5–4.3 ms to run on that CPU. A
/// yield every 256 KiB puts them first whenever they wait (one system call
/// per 256 KiB when nothing does): the fetch loop's cost to one-in-flight
/// appends' p99 went from +4.1–5.9 ms to +1.3–2.2 ms (six runs), for less
/// read throughput under that contention (340–473 MB/s, from 570–660), and
/// less for a consumer on the same two vCPUs (`ferrolog-bench e2e`,
/// alternating builds: 8–13% at 1 KiB, up to 31% for one-record batches).
/// 1 MiB between yields gave +1.8 and +2.3 ms.
///
/// Only the client port yields: peer answers are small, and the Kafka
/// port writes through `tokio::io::split`, whose lock a yield would hold.
pub const WRITE_BYTES_PER_YIELD: usize = 256 << 10;

impl Conn {
    /// Yields the thread's CPU if the connection wrote its
    /// `yield_every` bytes since the last yield or full socket.
    fn maybe_yield(&mut self) {
        if self.yield_every.is_some_and(|every| self.written >= every) {
            self.written = 0;
            std::thread::yield_now();
        }
    }

    /// Counts what a write wrote; a full socket (`Pending`) starts the
    /// count again, as the task then gives up its thread anyway.
    fn count(&mut self, r: &Poll<io::Result<usize>>) {
        match r {
            Poll::Ready(Ok(n)) => self.written = self.written.saturating_add(*n),
            Poll::Pending => self.written = 0,
            Poll::Ready(Err(_)) => {}
        }
    }

    /// The remote address, if the socket still knows it.
    pub fn peer(&self) -> Option<std::net::SocketAddr> {
        match &self.stream {
            Socket::Tcp(s) => s.peer_addr().ok(),
            Socket::Memory(s) => Some(s.peer_addr()),
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match &self.stream {
            Socket::Tcp(s) => s.connect_info(),
            Socket::Memory(s) => {
                TcpConnectInfo { local_addr: Some(s.local_addr()), remote_addr: Some(s.peer_addr()) }
            }
        }
    }
}

/// Calls `$call` on the stream inside a `Socket`.
macro_rules! on_stream {
    ($stream:expr, $s:ident => $call:expr) => {
        match $stream {
            Socket::Tcp($s) => $call,
            Socket::Memory($s) => $call,
        }
    };
}

impl AsyncRead for Socket {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        on_stream!(self.get_mut(), s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Socket {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        on_stream!(self.get_mut(), s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        on_stream!(self.get_mut(), s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        on_stream!(self.get_mut(), s => Pin::new(s).poll_shutdown(cx))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        on_stream!(self.get_mut(), s => Pin::new(s).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        on_stream!(self, s => s.is_write_vectored())
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
        self.maybe_yield();
        let r = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.count(&r);
        r
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
        self.maybe_yield();
        let r = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.count(&r);
        r
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
/// [`FIRST_BYTES_TIMEOUT`]). `what` names the listener in log lines.
/// `yield_every`: bytes a connection writes without a pause between yields
/// of its CPU ([`WRITE_BYTES_PER_YIELD`]); `None`: never. The listener
/// closes when the returned stream is dropped.
pub fn incoming(
    mut listener: Listener,
    max_connections: usize,
    what: &'static str,
    yield_every: Option<usize>,
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
            let stream = match stream {
                Socket::Tcp(s) => s,
                memory @ Socket::Memory(_) => {
                    let _ =
                        tx.send(Ok(Conn { stream: memory, _permit: permit, yield_every, written: 0 })).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                match tokio::time::timeout(FIRST_BYTES_TIMEOUT, stream.peek(&mut first)).await {
                    Ok(Ok(n)) if n > 0 => {
                        let stream = Socket::Tcp(stream);
                        let _ = tx.send(Ok(Conn { stream, _permit: permit, yield_every, written: 0 })).await;
                    }
                    _ => tracing::debug!(listener = what, %peer, "closed a connection that sent nothing"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

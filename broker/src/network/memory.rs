//! An in-memory network: brokers of one process listen on and dial socket
//! addresses of it, and each connection is a pair of in-memory pipes
//! (`tokio::io::duplex`), so no connection leaves the process and none
//! touches the operating system's sockets. For a deterministic simulation
//! of whole brokers (issue 15), whose runtime runs everything on one thread
//! and whose network must be its own to cut and heal; also for tests.
//!
//! It behaves as loopback TCP does where a broker can tell: an address is
//! bound once (`AddrInUse` otherwise) until its listener is dropped, a
//! dial to an address nobody listens on is refused (`ConnectionRefused`),
//! and a connection's bytes arrive in order, once. [`MemoryNetwork::cut`]
//! isolates an address: dials to it, and from the node that dials as it
//! (a broker dials its peers as its peer address), are refused, and the
//! open connections to and from it fail (`ConnectionReset`, waking any
//! task waiting on them), until [`MemoryNetwork::heal`]. A broker's other
//! listeners (client, Kafka) are addresses of their own.
//!
//! Listeners asking for port 0 get ports from 1024 up, in turn (a port
//! freed is not handed out again at once, as an OS avoids); diallers' own
//! ends get ports from the ephemeral range, 49152 up.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::sync::mpsc;

/// Bytes a connection's pipe holds in each direction before a writer
/// waits for its reader (a TCP socket's buffers are of this order).
pub const PIPE_BYTES: usize = 256 << 10;

/// Connections waiting to be accepted, per listener (a TCP listener's
/// backlog).
const BACKLOG: usize = 128;

/// The first port of diallers' ends (the IANA ephemeral range); listeners
/// asking for port 0 get one below it.
const EPHEMERAL_FIRST: u16 = 49152;

/// The first port a listener asking for port 0 gets.
const LISTEN_FIRST: u16 = 1024;

/// A connection as a listener accepts it: the stream and the dialler's
/// address.
pub type Accepted = (MemoryStream, SocketAddr);

/// An in-memory network. Clones share it.
#[derive(Clone, Debug, Default)]
pub struct MemoryNetwork {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Bound addresses: the listener's id and where its connections go.
    listening: BTreeMap<SocketAddr, (u64, mpsc::Sender<Accepted>)>,
    /// Nodes cut off ([`MemoryNetwork::cut`]).
    cut: BTreeSet<SocketAddr>,
    /// Open connections: the dialling node (if it said), the dialled
    /// address, and what fails both ends.
    links: Vec<(Option<SocketAddr>, SocketAddr, Weak<Link>)>,
    /// The last listener id handed out.
    next_id: u64,
    /// The next port tried for a listener asking for port 0, and the last
    /// dialler port handed out.
    next_listen_port: u16,
    next_dial_port: u16,
    /// Dials that reached a listener.
    connections: u64,
    /// A digest of those dials, in order (dialler node, dialled address).
    dial_digest: u64,
}

/// What the two ends of a connection share: whether the network cut it,
/// and the tasks waiting on either end, woken when it does.
#[derive(Debug, Default)]
struct Link {
    failed: AtomicBool,
    /// Per end (0: the dialler's), a reader's and a writer's waker.
    wakers: Mutex<[Option<Waker>; 4]>,
}

impl Link {
    /// Fails both ends and wakes whoever waits on them.
    fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
        let wakers =
            std::mem::take(&mut *self.wakers.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        for w in wakers.into_iter().flatten() {
            w.wake();
        }
    }

    /// Remembers `cx`'s waker in `slot`, then fails if the link is cut
    /// (registered first, so a cut between the two still wakes it).
    fn check(&self, slot: usize, cx: &Context<'_>) -> io::Result<()> {
        {
            let mut wakers = self.wakers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !wakers[slot].as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                wakers[slot] = Some(cx.waker().clone());
            }
        }
        if self.failed.load(Ordering::SeqCst) {
            return Err(io::Error::new(io::ErrorKind::ConnectionReset, "the network cut this connection"));
        }
        Ok(())
    }
}

impl Inner {
    fn isolated(&self, a: Option<SocketAddr>) -> bool {
        a.is_some_and(|a| self.cut.contains(&a))
    }
}

impl MemoryNetwork {
    /// A network with nothing bound.
    pub fn new() -> Self {
        Self::default()
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Listens on `addr`; port 0 picks a free port of that address's IP.
    ///
    /// # Errors
    /// `AddrInUse` if a listener holds `addr` already; `AddrNotAvailable`
    /// if port 0 finds every port of the IP taken.
    pub fn bind(&self, addr: SocketAddr) -> io::Result<MemoryListener> {
        let mut inner = self.inner();
        let mut addr = addr;
        if addr.port() == 0 {
            let start = inner.next_listen_port.clamp(LISTEN_FIRST, EPHEMERAL_FIRST - 1);
            let free = (start..EPHEMERAL_FIRST)
                .chain(LISTEN_FIRST..start)
                .find(|p| !inner.listening.contains_key(&SocketAddr::new(addr.ip(), *p)));
            let port = free.ok_or_else(|| io::Error::from(io::ErrorKind::AddrNotAvailable))?;
            inner.next_listen_port = port + 1;
            addr.set_port(port);
        }
        if inner.listening.contains_key(&addr) {
            return Err(io::Error::new(io::ErrorKind::AddrInUse, format!("{addr} is bound already")));
        }
        inner.next_id += 1;
        let id = inner.next_id;
        let (tx, rx) = mpsc::channel(BACKLOG);
        inner.listening.insert(addr, (id, tx));
        Ok(MemoryListener { addr, id, rx, network: self.clone() })
    }

    /// Connects to the listener at `to`, as the node `from` (an address it
    /// listens on, for [`MemoryNetwork::cut`]; `None`: a client, cut off
    /// only with what it dials).
    ///
    /// # Errors
    /// `ConnectionRefused` if nothing listens there, its backlog is full,
    /// or either end is cut off.
    pub fn connect(&self, from: Option<SocketAddr>, to: SocketAddr) -> io::Result<MemoryStream> {
        let mut inner = self.inner();
        let refused =
            || io::Error::new(io::ErrorKind::ConnectionRefused, format!("{to}: connection refused"));
        if inner.isolated(Some(to)) || inner.isolated(from) {
            return Err(refused());
        }
        let Some((_, tx)) = inner.listening.get(&to).cloned() else { return Err(refused()) };
        inner.next_dial_port = inner.next_dial_port.checked_add(1).unwrap_or(0).max(EPHEMERAL_FIRST);
        let ip = from.map_or(std::net::Ipv4Addr::LOCALHOST.into(), |f| f.ip());
        let dialler = SocketAddr::new(ip, inner.next_dial_port);
        let (mine, theirs) = tokio::io::duplex(PIPE_BYTES);
        let link = Arc::new(Link::default());
        let local = MemoryStream { pipe: mine, link: link.clone(), end: 0, local: dialler, remote: to };
        let remote = MemoryStream { pipe: theirs, link: link.clone(), end: 1, local: to, remote: dialler };
        tx.try_send((remote, dialler)).map_err(|_| refused())?;
        inner.links.retain(|(_, _, l)| l.strong_count() > 0);
        inner.links.push((from, to, Arc::downgrade(&link)));
        inner.connections += 1;
        inner.dial_digest = digest(inner.dial_digest, &format!("{from:?}>{to}"));
        Ok(local)
    }

    /// Isolates `node`: dials to it and from the node that dials as it
    /// are refused, and the open connections to and from it fail (tasks
    /// waiting on them are woken), until [`MemoryNetwork::heal`]. A
    /// broker's peer address cuts its peer traffic; its client and Kafka
    /// addresses are cut on their own.
    pub fn cut(&self, node: SocketAddr) {
        let failing: Vec<Arc<Link>> = {
            let mut inner = self.inner();
            inner.cut.insert(node);
            inner
                .links
                .iter()
                .filter(|(from, to, _)| *from == Some(node) || *to == node)
                .filter_map(|(_, _, l)| l.upgrade())
                .collect()
        };
        for link in failing {
            link.fail();
        }
    }

    /// Undoes [`MemoryNetwork::cut`] of `node` (its failed connections stay
    /// failed; new ones are made).
    pub fn heal(&self, node: SocketAddr) {
        self.inner().cut.remove(&node);
    }

    /// Dials that reached a listener so far.
    pub fn connections(&self) -> u64 {
        self.inner().connections
    }

    /// A digest of the dials that reached a listener, in order (which node
    /// dialled which address): equal for runs that connected alike.
    pub fn dial_digest(&self) -> u64 {
        self.inner().dial_digest
    }

    /// A connector for tonic's `Endpoint::connect_with_connector_lazy`:
    /// dials the URI's `ip:port` on this network as the node `from`.
    pub fn connector(&self, from: Option<SocketAddr>) -> MemoryConnector {
        MemoryConnector { network: self.clone(), from }
    }
}

/// A bound address of a [`MemoryNetwork`]; dropping it unbinds it.
#[derive(Debug)]
pub struct MemoryListener {
    addr: SocketAddr,
    id: u64,
    rx: mpsc::Receiver<Accepted>,
    network: MemoryNetwork,
}

impl MemoryListener {
    /// The address it is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next connection and the dialler's address.
    ///
    /// # Errors
    /// `NotConnected` if the network dropped it (it does not while bound).
    pub async fn accept(&mut self) -> io::Result<Accepted> {
        self.rx.recv().await.ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))
    }
}

impl Drop for MemoryListener {
    fn drop(&mut self) {
        let mut inner = self.network.inner();
        if inner.listening.get(&self.addr).is_some_and(|(id, _)| *id == self.id) {
            inner.listening.remove(&self.addr);
        }
    }
}

/// FNV-1a of `text` continuing from `h` (0: a fresh digest).
fn digest(h: u64, text: &str) -> u64 {
    let mut h = if h == 0 { 0xcbf2_9ce4_8422_2325 } else { h };
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// One end of a connection of a [`MemoryNetwork`].
#[derive(Debug)]
pub struct MemoryStream {
    pipe: DuplexStream,
    /// Shared with the other end: cut by the network, every call fails.
    link: Arc<Link>,
    /// Which end this is (0: the dialler's), for its wakers' slots.
    end: usize,
    local: SocketAddr,
    remote: SocketAddr,
}

impl MemoryStream {
    /// This end's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The other end's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.remote
    }
}

impl AsyncRead for MemoryStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.link.check(self.end * 2, cx)?;
        Pin::new(&mut self.pipe).poll_read(cx, buf)
    }
}

impl AsyncWrite for MemoryStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.link.check(self.end * 2 + 1, cx)?;
        Pin::new(&mut self.pipe).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.link.check(self.end * 2 + 1, cx)?;
        Pin::new(&mut self.pipe).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.pipe).poll_shutdown(cx)
    }
}

/// Dials a [`MemoryNetwork`] for tonic (a `tower` service from URI to
/// connection).
#[derive(Clone, Debug)]
pub struct MemoryConnector {
    network: MemoryNetwork,
    from: Option<SocketAddr>,
}

impl tonic::codegen::Service<tonic::codegen::http::Uri> for MemoryConnector {
    type Response = hyper_util::rt::TokioIo<MemoryStream>;
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<Self::Response>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: tonic::codegen::http::Uri) -> Self::Future {
        let (network, from) = (self.network.clone(), self.from);
        Box::pin(async move {
            let addr = uri
                .authority()
                .and_then(|a| a.as_str().parse::<SocketAddr>().ok())
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("not ip:port: {uri}")))?;
            network.connect(from, addr).map(hyper_util::rt::TokioIo::new)
        })
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    #[tokio::test]
    async fn binds_once_refuses_the_unbound_and_carries_bytes_both_ways() {
        let net = MemoryNetwork::new();
        let mut l = net.bind(addr("127.0.0.1:9000")).expect("bind");
        assert_eq!(net.bind(addr("127.0.0.1:9000")).expect_err("again").kind(), io::ErrorKind::AddrInUse);
        let e = net.connect(None, addr("127.0.0.1:9001")).expect_err("nobody there");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        let mut a = net.connect(Some(addr("127.0.0.2:9000")), l.local_addr()).expect("dial");
        let (mut b, from) = l.accept().await.expect("accept");
        assert_eq!(from.ip(), addr("127.0.0.2:1").ip(), "the dialler's node's IP");
        a.write_all(b"ping").await.expect("write");
        let mut got = [0u8; 4];
        b.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"ping");
        b.write_all(b"pong").await.expect("write");
        a.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"pong");
        assert_eq!(net.connections(), 1);
        drop(l);
        net.bind(addr("127.0.0.1:9000")).expect("free again once its listener is dropped");
    }

    #[tokio::test]
    async fn a_cut_node_is_refused_and_its_connections_fail_until_healed() {
        let net = MemoryNetwork::new();
        let (one, two) = (addr("127.0.0.1:9000"), addr("127.0.0.2:9000"));
        let mut l1 = net.bind(one).expect("bind");
        let mut l2 = net.bind(two).expect("bind");
        let mut a = net.connect(Some(two), one).expect("dial");
        let (mut b, _) = l1.accept().await.expect("accept");
        net.cut(two);
        assert_eq!(a.write_all(b"x").await.expect_err("cut").kind(), io::ErrorKind::ConnectionReset);
        let mut buf = [0u8; 1];
        assert_eq!(b.read(&mut buf).await.expect_err("cut").kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(net.connect(None, two).expect_err("to").kind(), io::ErrorKind::ConnectionRefused);
        assert_eq!(net.connect(Some(two), one).expect_err("from").kind(), io::ErrorKind::ConnectionRefused);
        net.heal(two);
        // A reader already waiting when the cut comes is woken with it.
        let mut c = net.connect(Some(two), one).expect("healed");
        let (_d, _) = l1.accept().await.expect("accept");
        let blocked = tokio::spawn(async move {
            let mut buf = [0u8; 1];
            c.read(&mut buf).await
        });
        tokio::task::yield_now().await;
        assert!(!blocked.is_finished(), "the reader has nothing to read yet");
        net.cut(one);
        let e = tokio::time::timeout(std::time::Duration::from_secs(5), blocked)
            .await
            .expect("the blocked reader was not woken by the cut")
            .expect("task")
            .expect_err("cut");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        net.heal(one);
        net.connect(None, two).expect("healed");
        let _ = l2.accept().await.expect("accept");
    }
}

//! Partitions without network namespaces: a fault-injecting TCP proxy on
//! every directed link between brokers.
//!
//! Broker `a` dials broker `b` through a listener of its own, at `a`'s
//! address on a port the system picks (the broker's `peer_routes` setting
//! says so); the proxy forwards to `b`'s peer port. Faults are kept
//! per *direction of bytes*, `(from, to)`, and apply to every connection
//! between the two brokers whoever opened it, so a one-way cut behaves like
//! dropped packets in one direction:
//!
//! - **cut** `(a, b)`: bytes from `a` to `b` are held (not dropped, not
//!   reset), as TCP would keep retransmitting them, and so is a close or a
//!   reset by `a`; a new connection from either side is accepted but not
//!   forwarded until both directions flow again (with dropped packets the
//!   dialler's connect itself would hang instead). Healing releases what
//!   was held, in order.
//! - **slow**: every chunk of bytes waits `delay` ± `jitter`, and a fraction
//!   of chunks waits a further retransmission time, the way a lost segment
//!   delays a TCP stream; order is kept.
//!
//! Each listener counts the bytes its dialler sent through it, so a run can
//! check that every broker really dialled every peer through the proxy
//! ([`ProxyNet::silent_links`]).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Chunks of at most this many bytes are read, held and forwarded.
const CHUNK_BYTES: usize = 64 * 1024;

/// Chunks in flight per direction of a connection before reading stops.
const CHUNKS_IN_FLIGHT: usize = 64;

/// Delay on every chunk while the `slow` fault is on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slow {
    /// Base delay, ms.
    pub delay_ms: u64,
    /// Uniform jitter added or removed, ms (≤ `delay_ms`).
    pub jitter_ms: u64,
    /// Fraction of chunks held a further `retransmit_ms`, as after a loss.
    pub loss: f64,
    /// Extra wait of a "lost" chunk, ms (Linux's minimum TCP RTO is 200 ms).
    pub retransmit_ms: u64,
}

impl Slow {
    /// 50 ms ± 25 ms, 3% of chunks held a further 200 ms: the proxy's
    /// stand-in for `tc netem delay 50ms 25ms loss 3%`.
    pub const DEFAULT: Slow = Slow { delay_ms: 50, jitter_ms: 25, loss: 0.03, retransmit_ms: 200 };

    /// How long one chunk waits.
    fn sample(&self, rng: &mut impl Rng) -> Duration {
        let jitter = self.jitter_ms.min(self.delay_ms) as i64;
        let base = self.delay_ms as i64 + if jitter > 0 { rng.gen_range(-jitter..=jitter) } else { 0 };
        let lost = self.loss > 0.0 && rng.gen_bool(self.loss.min(1.0));
        Duration::from_millis(base.max(0) as u64 + if lost { self.retransmit_ms } else { 0 })
    }
}

impl std::fmt::Display for Slow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "delay {}ms ±{}ms, {}% of chunks +{}ms",
            self.delay_ms,
            self.jitter_ms,
            self.loss * 100.0,
            self.retransmit_ms
        )
    }
}

/// The faults in force on every link.
#[derive(Debug, Clone, Default, PartialEq)]
struct Faults {
    /// Directions `(from, to)` whose bytes are held.
    cut: BTreeSet<(u32, u32)>,
    /// Delay on every direction.
    slow: Option<Slow>,
}

/// The proxies of one run, and their faults.
#[derive(Debug)]
pub struct ProxyNet {
    ips: Vec<IpAddr>,
    /// Listener of each directed link `(a, b)`, index `(a - 1) * n + (b - 1)`.
    listen: Vec<Option<SocketAddr>>,
    faults: watch::Sender<Faults>,
    counters: Arc<Counters>,
    tasks: JoinSet<()>,
}

/// Byte counters, each indexed `(a - 1) * n + (b - 1)`.
#[derive(Debug)]
struct Counters {
    n: usize,
    /// Bytes forwarded from broker `a` to broker `b`, on any connection.
    direction: Vec<AtomicU64>,
    /// Bytes broker `a` sent through its listener for `b` (connections `a` opened).
    dialled: Vec<AtomicU64>,
}

impl Counters {
    fn index(&self, (a, b): (u32, u32)) -> usize {
        (a as usize - 1) * self.n + (b as usize - 1)
    }
}

impl ProxyNet {
    /// Starts a listener for every directed link between brokers
    /// `1..=ips.len()` (broker `id` at `ips[id - 1]`, peer port `peer_port`),
    /// each on a port the system picks at the dialler's address.
    ///
    /// # Errors
    /// A listener that cannot bind.
    pub async fn start(ips: &[IpAddr], peer_port: u16) -> anyhow::Result<ProxyNet> {
        let n = ips.len();
        let (faults, _) = watch::channel(Faults::default());
        let zeros = || (0..n * n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        let counters = Arc::new(Counters { n, direction: zeros(), dialled: zeros() });
        let mut net = ProxyNet {
            ips: ips.to_vec(),
            listen: vec![None; n * n],
            faults,
            counters,
            tasks: JoinSet::new(),
        };
        for a in 1..=n as u32 {
            for b in (1..=n as u32).filter(|b| *b != a) {
                let at = SocketAddr::new(ips[a as usize - 1], 0);
                let listener =
                    TcpListener::bind(at).await.with_context(|| format!("proxy listener on {at}"))?;
                net.listen[net.counters.index((a, b))] = Some(listener.local_addr()?);
                let link = Link {
                    a,
                    b,
                    upstream: SocketAddr::new(ips[b as usize - 1], peer_port),
                    faults: net.faults.subscribe(),
                    counters: net.counters.clone(),
                };
                net.tasks.spawn(link.accept_loop(listener));
            }
        }
        Ok(net)
    }

    /// Where broker `a` dials broker `b`.
    ///
    /// # Panics
    /// If `a == b` or either is not a broker of this proxy (a harness bug).
    pub fn listen_addr(&self, a: u32, b: u32) -> SocketAddr {
        self.listen[self.counters.index((a, b))].expect("a listener for every pair of distinct brokers")
    }

    /// Broker `a`'s `--peer-routes` flag: every other broker's peer address
    /// (`ip:peer_port`) → its listener on this proxy.
    pub fn peer_routes(&self, a: u32, peer_port: u16) -> String {
        (1..=self.ips.len() as u32)
            .filter(|b| *b != a)
            .map(|b| {
                format!("{}={}", SocketAddr::new(self.ips[b as usize - 1], peer_port), self.listen_addr(a, b))
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Holds every byte from broker `from` to broker `to`.
    pub fn cut(&self, from: u32, to: u32) {
        self.faults.send_modify(|f| {
            f.cut.insert((from, to));
        });
    }

    /// Releases every cut.
    pub fn heal(&self) {
        self.faults.send_modify(|f| f.cut.clear());
    }

    /// Delays every link as `slow` says.
    pub fn slow(&self, slow: Slow) {
        self.faults.send_modify(|f| f.slow = Some(slow));
    }

    /// Ends the delay.
    pub fn clear_slow(&self) {
        self.faults.send_modify(|f| f.slow = None);
    }

    /// Bytes forwarded from `from` to `to` so far, on any connection.
    pub fn bytes(&self, from: u32, to: u32) -> u64 {
        self.counters.direction[self.counters.index((from, to))].load(Ordering::Relaxed)
    }

    /// Links `(a, b)` through which broker `a` sent no byte: `a` did not
    /// dial `b` through the proxy (its route missing, or it bypassed it).
    pub fn silent_links(&self) -> Vec<(u32, u32)> {
        let n = self.ips.len() as u32;
        (1..=n)
            .flat_map(|a| (1..=n).filter(move |b| *b != a).map(move |b| (a, b)))
            .filter(|link| self.counters.dialled[self.counters.index(*link)].load(Ordering::Relaxed) == 0)
            .collect()
    }

    /// Stops every listener and connection; the returned future ends when
    /// they are closed (so their ports are free again).
    pub fn stop(&mut self) -> impl std::future::Future<Output = ()> + 'static {
        let mut tasks = std::mem::take(&mut self.tasks);
        async move { tasks.shutdown().await }
    }
}

/// What a direction of a connection forwards, in order.
enum Held {
    /// Bytes, to be written not before the instant.
    Data(Instant, Bytes),
    /// The sender closed (`None`) or failed (`Some`): close this side too.
    End(Option<std::io::Error>),
}

/// One directed link's listener: broker `a` dialling broker `b`.
struct Link {
    a: u32,
    b: u32,
    upstream: SocketAddr,
    faults: watch::Receiver<Faults>,
    counters: Arc<Counters>,
}

impl Link {
    async fn accept_loop(self, listener: TcpListener) {
        let link = Arc::new(self);
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((down, _)) => {
                        conns.spawn(link.clone().serve(down));
                    }
                    Err(e) => {
                        tracing::warn!("proxy {}→{}: accept: {e}", link.a, link.b);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    }

    /// Forwards one connection both ways until both sides have closed.
    async fn serve(self: Arc<Self>, down: TcpStream) {
        let (a, b) = (self.a, self.b);
        // The handshake needs both directions.
        let mut faults = self.faults.clone();
        if faults.wait_for(|f| !f.cut.contains(&(a, b)) && !f.cut.contains(&(b, a))).await.is_err() {
            return;
        }
        let Ok(up) = TcpStream::connect(self.upstream).await else { return };
        let _ = down.set_nodelay(true);
        let _ = up.set_nodelay(true);
        let (down_r, down_w) = down.into_split();
        let (up_r, up_w) = up.into_split();
        let dialled = &self.counters.dialled[self.counters.index((a, b))];
        tokio::join!(self.pump(down_r, up_w, (a, b), Some(dialled)), self.pump(up_r, down_w, (b, a), None));
    }

    /// Copies `r` to `w` under the faults of direction `dir`, counting the
    /// bytes also in `extra`. A close or an error of `r` reaches `w` after
    /// every byte before it, and only while `dir` is not cut.
    async fn pump(
        &self,
        mut r: tokio::net::tcp::OwnedReadHalf,
        mut w: tokio::net::tcp::OwnedWriteHalf,
        dir: (u32, u32),
        extra: Option<&AtomicU64>,
    ) {
        let (tx, mut rx) = mpsc::channel::<Held>(CHUNKS_IN_FLIGHT);
        let faults = self.faults.clone();
        let reader = async move {
            let mut rng = rand::rngs::StdRng::from_entropy();
            let mut buf = vec![0u8; CHUNK_BYTES];
            loop {
                let held = match r.read(&mut buf).await {
                    Ok(0) => Held::End(None),
                    Ok(got) => {
                        let wait = faults.borrow().slow.map_or(Duration::ZERO, |s| s.sample(&mut rng));
                        Held::Data(Instant::now() + wait, Bytes::copy_from_slice(&buf[..got]))
                    }
                    Err(e) => Held::End(Some(e)),
                };
                let end = matches!(held, Held::End(_));
                if tx.send(held).await.is_err() || end {
                    return;
                }
            }
        };
        let mut faults = self.faults.clone();
        let counter = &self.counters.direction[self.counters.index(dir)];
        let writer = async move {
            let mut not_before = Instant::now();
            while let Some(held) = rx.recv().await {
                if let Held::Data(due, _) = &held {
                    // Order is kept: a chunk never overtakes the one before it.
                    not_before = not_before.max(*due);
                    tokio::time::sleep_until(not_before).await;
                }
                if faults.wait_for(|f| !f.cut.contains(&dir)).await.is_err() {
                    return;
                }
                match held {
                    Held::Data(_, chunk) => {
                        if w.write_all(&chunk).await.is_err() {
                            return; // dropping `rx` ends the reader at its next chunk
                        }
                        counter.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                        if let Some(extra) = extra {
                            extra.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                        }
                    }
                    // A failed sender: drop `w` (the other side sees the close).
                    Held::End(Some(_)) => return,
                    Held::End(None) => {
                        let _ = w.shutdown().await;
                        return;
                    }
                }
            }
        };
        tokio::join!(reader, writer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server standing in for broker 2's peer port; broker 1 dials
    /// it through the proxy.
    async fn echo_server(ip: IpAddr) -> anyhow::Result<u16> {
        let l = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
        let port = l.local_addr()?.port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        Ok(port)
    }

    /// The byte counters `(1→2, 2→1)` once they reach `want` (a write is
    /// counted just after it completes), or as they are after 2 s.
    async fn counters(net: &ProxyNet, want: (u64, u64)) -> (u64, u64) {
        for _ in 0..200 {
            if (net.bytes(1, 2), net.bytes(2, 1)) == want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (net.bytes(1, 2), net.bytes(2, 1))
    }

    async fn round_trip(s: &mut TcpStream, msg: &[u8], within: Duration) -> Option<Vec<u8>> {
        s.write_all(msg).await.ok()?;
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(within, s.read_exact(&mut got)).await.ok()?.ok()?;
        Some(got)
    }

    #[tokio::test]
    async fn forwards_holds_and_releases_in_order() -> anyhow::Result<()> {
        // Broker 1 at 127.0.97.11, broker 2 (the echo server) at 127.0.97.12.
        let ips: Vec<IpAddr> = vec!["127.0.97.11".parse()?, "127.0.97.12".parse()?];
        let port = echo_server(ips[1]).await?;
        let net = ProxyNet::start(&ips, port).await?;
        assert_eq!(net.peer_routes(1, port), format!("127.0.97.12:{port}={}", net.listen_addr(1, 2)));
        assert_eq!(net.listen_addr(1, 2).ip(), ips[0]);
        // Nobody has dialled anybody yet.
        assert_eq!(net.silent_links(), vec![(1, 2), (2, 1)]);
        let mut s = TcpStream::connect(net.listen_addr(1, 2)).await?;
        assert_eq!(
            round_trip(&mut s, b"hello", Duration::from_secs(5)).await.as_deref(),
            Some(&b"hello"[..])
        );
        assert_eq!(counters(&net, (5, 5)).await, (5, 5));
        // Replies from 2 count for the direction 2→1, not for 2's own listener.
        assert_eq!(net.silent_links(), vec![(2, 1)]);

        // One-way cut of the replies: the request reaches broker 2, the echo is held.
        net.cut(2, 1);
        assert_eq!(round_trip(&mut s, b"held", Duration::from_millis(300)).await, None);
        assert_eq!(counters(&net, (9, 5)).await, (9, 5));
        // A new connection is held too (its handshake needs both directions).
        let mut s2 = TcpStream::connect(net.listen_addr(1, 2)).await?;
        assert_eq!(round_trip(&mut s2, b"new", Duration::from_millis(300)).await, None);

        // Healing releases the held bytes in order on both connections.
        net.heal();
        let mut got = vec![0u8; 4];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got)).await??;
        assert_eq!(&got, b"held");
        let mut got = vec![0u8; 3];
        tokio::time::timeout(Duration::from_secs(5), s2.read_exact(&mut got)).await??;
        assert_eq!(&got, b"new");

        // Slow: a round trip takes at least two delays; bytes stay in order.
        net.slow(Slow { delay_ms: 100, jitter_ms: 50, loss: 0.5, retransmit_ms: 10 });
        let started = std::time::Instant::now();
        let msg: Vec<u8> = (0..=255u8).collect();
        for chunk in msg.chunks(16) {
            s.write_all(chunk).await?;
        }
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut got)).await??;
        assert_eq!(got, msg);
        assert!(started.elapsed() >= Duration::from_millis(100), "{:?}", started.elapsed());
        net.clear_slow();

        // A close is held behind a cut like the bytes before it.
        net.cut(1, 2);
        s.shutdown().await?;
        let mut one = [0u8; 1];
        let early = tokio::time::timeout(Duration::from_millis(300), s.read(&mut one)).await;
        assert!(early.is_err(), "the close went through the cut: {early:?}");
        net.heal();
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), s.read(&mut one)).await??, 0);

        // Stopping frees the listeners' ports.
        let listener = net.listen_addr(1, 2);
        let mut net = net;
        net.stop().await;
        TcpListener::bind(listener).await?;
        Ok(())
    }

    #[test]
    fn slow_samples_stay_in_range() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let s = Slow::DEFAULT;
        let (mut lost, mut min, mut max) = (0, u64::MAX, 0);
        for _ in 0..10_000 {
            let ms = s.sample(&mut rng).as_millis() as u64;
            if ms > 75 {
                lost += 1;
            }
            min = min.min(ms);
            max = max.max(ms);
        }
        assert!(min >= 25 && max <= 275, "{min}..{max}");
        assert!((200..=400).contains(&lost), "{lost} of 10000 held back, 3% expected");
    }
}

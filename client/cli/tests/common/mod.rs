//! Addresses for the brokers a test starts, that nothing else on this
//! machine binds.
//!
//! Ports taken as `127.0.0.1:0` and released again were taken back, in CI,
//! by the source port of some other test's outgoing connection before the
//! broker could bind them ("Address already in use"). Outgoing loopback
//! connections take their source address 127.0.0.1, so a test whose
//! brokers listen on a loopback address of their own cannot lose a port
//! that way.

use std::net::{Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicU8, Ordering};

/// A loopback address used by this test only (127.X.Y.Z: X and Y from the
/// process id, so two test processes running at once differ unless their
/// ids are equal modulo 60,000; Z counting the calls in this process; never
/// 127.0.0.x, which the cluster harness and `ferrolog dev` use), and `n`
/// distinct ports free on it. Linux routes all of 127.0.0.0/8 to the
/// loopback device.
///
/// # Panics
/// After 250 calls in one process, or if the ports cannot be bound.
pub fn private_addrs(n: usize) -> (Ipv4Addr, Vec<u16>) {
    static CALLS: AtomicU8 = AtomicU8::new(1);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    assert!((1..=250).contains(&call), "too many test clusters in one process");
    let pid = std::process::id();
    let ip = Ipv4Addr::new(127, 10 + (pid % 240) as u8, (pid / 240 % 250) as u8, call);
    // All n listeners are held until every port is known, so the ports are
    // distinct.
    let held: Vec<TcpListener> =
        (0..n).map(|_| TcpListener::bind((ip, 0)).expect("bind a loopback port")).collect();
    let ports = held.iter().map(|l| l.local_addr().expect("local address").port()).collect();
    (ip, ports)
}

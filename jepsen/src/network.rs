//! The network between brokers, whichever way it is made: network
//! namespaces ([`crate::net`]) where this machine allows them, else a
//! fault-injecting proxy on every directed link ([`crate::proxy`]). The
//! nemesis sees one interface: cut a direction, heal, slow down, clear.

use std::net::{IpAddr, Ipv4Addr};

use crate::cluster::PEER_PORT;
use crate::net::{self, Net};
use crate::proxy::{ProxyNet, Slow};

/// Which network a run asks for (`--network`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NetworkChoice {
    /// Namespaces when they can be made (and `tc netem` works, if netem
    /// faults are asked for), else the proxy.
    Auto,
    /// Network namespaces (root, iproute2); fails where they cannot be made.
    Netns,
    /// The TCP proxy, brokers on 127.0.X.1I (X picked per run); works anywhere.
    Proxy,
}

/// `tc netem` settings of the netem fault in namespaces; the proxy's
/// stand-in is [`Slow::DEFAULT`].
const NETEM_SPEC: [&str; 5] = ["delay", "50ms", "25ms", "loss", "3%"];

/// The network of one run.
#[derive(Debug)]
pub enum Network {
    /// Each broker in its own namespace.
    Namespaces(Net),
    /// Brokers on loopback at 127.0.X.1I, dialling each other through [`ProxyNet`].
    Proxy(ProxyNet, u8),
}

impl Network {
    /// Makes the network for `nodes` brokers; `wants_netem` says whether
    /// netem faults will be injected (namespaces need the kernel's
    /// `sch_netem` for them).
    ///
    /// # Errors
    /// `--network netns` where namespaces (or netem) are unavailable, with
    /// the reason; a proxy port in use.
    pub async fn create(choice: NetworkChoice, nodes: u32, wants_netem: bool) -> anyhow::Result<Network> {
        if choice == NetworkChoice::Proxy {
            return Self::proxy(nodes).await;
        }
        let netns = net::probe().and_then(|()| if wants_netem { net::probe_netem() } else { Ok(()) });
        match (choice, netns) {
            (NetworkChoice::Netns, Err(e)) => Err(e.context("--network netns")),
            (_, Ok(())) => Ok(Network::Namespaces(Net::create(nodes)?)),
            (_, Err(e)) => {
                eprintln!("ferrolog-jepsen: using the TCP proxy: {e:#}");
                Self::proxy(nodes).await
            }
        }
    }

    /// Brokers at 127.0.X.1I, with X from the process id so that concurrent
    /// runs do not share addresses.
    async fn proxy(nodes: u32) -> anyhow::Result<Network> {
        let x = 100 + (std::process::id() % 150) as u8;
        let ips: Vec<IpAddr> =
            (1..=nodes).map(|id| IpAddr::V4(Ipv4Addr::new(127, 0, x, 10 + id as u8))).collect();
        Ok(Network::Proxy(ProxyNet::start(&ips, PEER_PORT).await?, x))
    }

    /// Its short name, as `--network` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Network::Namespaces(_) => "netns",
            Network::Proxy(..) => "proxy",
        }
    }

    /// What it is, for output.
    pub fn describe(&self) -> &'static str {
        match self {
            Network::Namespaces(_) => "network namespaces",
            Network::Proxy(..) => "loopback with a TCP proxy on every broker link",
        }
    }

    /// Broker `id`'s address.
    pub fn broker_ip(&self, id: u32) -> IpAddr {
        match self {
            Network::Namespaces(n) => IpAddr::V4(n.broker_ip(id)),
            Network::Proxy(_, x) => IpAddr::V4(Ipv4Addr::new(127, 0, *x, 10 + id as u8)),
        }
    }

    /// Broker `id`'s namespace, if any.
    pub fn namespace(&self, id: u32) -> Option<String> {
        match self {
            Network::Namespaces(n) => Some(n.ns(id)),
            Network::Proxy(..) => None,
        }
    }

    /// Broker `id`'s `--peer-routes`, if its peers are dialled elsewhere.
    pub fn peer_routes(&self, id: u32) -> Option<String> {
        match self {
            Network::Namespaces(_) => None,
            Network::Proxy(p, _) => Some(p.peer_routes(id, PEER_PORT)),
        }
    }

    /// Drops (namespaces) or holds (proxy) every packet from broker `from`
    /// to broker `to`.
    ///
    /// # Errors
    /// An `ip route` failure.
    pub fn cut(&mut self, from: u32, to: u32) -> anyhow::Result<()> {
        match self {
            Network::Namespaces(n) => n.cut(from, to),
            Network::Proxy(p, _) => {
                p.cut(from, to);
                Ok(())
            }
        }
    }

    /// Restores every direction.
    ///
    /// # Errors
    /// An `ip route` failure.
    pub fn heal(&mut self) -> anyhow::Result<()> {
        match self {
            Network::Namespaces(n) => n.heal(),
            Network::Proxy(p, _) => {
                p.heal();
                Ok(())
            }
        }
    }

    /// Delays (and in namespaces drops) packets on every broker link;
    /// returns what was done.
    ///
    /// # Errors
    /// A `tc` failure.
    pub fn slow(&mut self) -> anyhow::Result<String> {
        match self {
            Network::Namespaces(n) => {
                n.netem(&NETEM_SPEC)?;
                Ok(format!("tc netem {}", NETEM_SPEC.join(" ")))
            }
            Network::Proxy(p, _) => {
                p.slow(Slow::DEFAULT);
                Ok(format!("proxy {}", Slow::DEFAULT))
            }
        }
    }

    /// Ends [`Network::slow`].
    pub fn clear_slow(&mut self) {
        match self {
            Network::Namespaces(n) => n.clear_netem(),
            Network::Proxy(p, _) => p.clear_slow(),
        }
    }

    /// Removes the namespaces, or stops the proxy; the future ends when the
    /// proxy's ports are free. Stop the brokers first.
    pub fn stop(&mut self) -> impl std::future::Future<Output = ()> + 'static {
        let proxy = match self {
            Network::Namespaces(n) => {
                n.teardown();
                None
            }
            Network::Proxy(p, _) => Some(p.stop()),
        };
        async move {
            if let Some(stopping) = proxy {
                stopping.await;
            }
        }
    }

    /// Problems of the network itself after a run: proxy links through
    /// which the dialling broker sent no byte (a broker that bypassed the
    /// proxy would make the partitions of the run no-ops).
    pub fn problems(&self) -> Vec<String> {
        match self {
            Network::Namespaces(_) => Vec::new(),
            Network::Proxy(p, _) => p
                .silent_links()
                .into_iter()
                .map(|(a, b)| {
                    format!("proxy: broker {a} sent no byte to broker {b} through its proxy listener")
                })
                .collect(),
        }
    }
}

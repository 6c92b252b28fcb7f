//! Real network partitions: every broker in its own network namespace,
//! joined by veth pairs to one bridge in the host namespace, where the
//! harness and its clients run.
//!
//! ```text
//!  host ns: harness, clients ── bridge fljNbr (10.77.N.1) ──┬── fljNv1 ═ veth ═ fljNp1 (ns fljN-b1, 10.77.N.11) broker 1
//!                                                           ├── fljNv2 ═ veth ═ fljNp2 (ns fljN-b2, 10.77.N.12) broker 2
//!                                                           └── ...
//! ```
//!
//! A cut from broker a to broker b is a blackhole route to b in a's
//! namespace: every packet from a to b is dropped (a symmetric partition
//! cuts both directions), while clients still reach both. `N` (the tag) keeps
//! concurrent runs apart. Everything made here is removed by
//! [`Net::teardown`] (also on drop) and by [`cleanup_all`].

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::{Context, bail};

/// Prefix of every namespace and interface this module makes.
pub const PREFIX: &str = "flj";

/// Runs `ip`/`tc` with `args`, failing with its stderr.
fn sh(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} (is iproute2 installed? apt-get install -y iproute2)"))?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn sh_out(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program).args(args).output().with_context(|| format!("running {program}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether network namespaces can be made here: `Ok`, or why not.
///
/// # Errors
/// The reason (no `ip` command, not root, no CAP_SYS_ADMIN, ...).
pub fn probe() -> anyhow::Result<()> {
    let name = format!("{PREFIX}probe{}", std::process::id());
    sh("ip", &["netns", "add", &name]).context("cannot create a network namespace")?;
    sh("ip", &["netns", "del", &name])?;
    Ok(())
}

/// Whether `tc qdisc ... netem` works (needs the kernel's sch_netem).
///
/// # Errors
/// The reason.
pub fn probe_netem() -> anyhow::Result<()> {
    let ns = format!("{PREFIX}probenetem{}", std::process::id());
    sh("ip", &["netns", "add", &ns])?;
    let r =
        sh("ip", &["netns", "exec", &ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]);
    let _ = sh("ip", &["netns", "del", &ns]);
    r.context("tc netem is unavailable (the kernel needs the sch_netem module)")
}

/// Removes every namespace and interface named with [`PREFIX`], left by
/// any earlier run (e.g. one killed with SIGKILL).
pub fn cleanup_all() -> Vec<String> {
    let mut removed = Vec::new();
    for line in sh_out("ip", &["netns", "list"]).unwrap_or_default().lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if name.starts_with(PREFIX) && sh("ip", &["netns", "del", name]).is_ok() {
            removed.push(format!("netns {name}"));
        }
    }
    for line in sh_out("ip", &["-o", "link", "show"]).unwrap_or_default().lines() {
        // "12: fljNbr: <...>" or "13: fljNv1@if2: <...>"
        let Some(name) = line.split(':').nth(1).map(|s| s.trim().split('@').next().unwrap_or("")) else {
            continue;
        };
        if name.starts_with(PREFIX) && sh("ip", &["link", "del", name]).is_ok() {
            removed.push(format!("link {name}"));
        }
    }
    removed
}

/// The namespaces, bridge and cuts of one run.
#[derive(Debug)]
pub struct Net {
    tag: u8,
    nodes: u32,
    made_ns: Vec<String>,
    made_bridge: bool,
    cuts: BTreeSet<(u32, u32)>,
    netem: bool,
}

impl Net {
    /// Makes namespaces for brokers `1..=nodes`, with a tag not in use.
    ///
    /// # Errors
    /// Any `ip` command failing; what was made so far is removed.
    pub fn create(nodes: u32) -> anyhow::Result<Net> {
        let existing = sh_out("ip", &["netns", "list"]).unwrap_or_default();
        let links = sh_out("ip", &["-o", "link", "show"]).unwrap_or_default();
        let start = (std::process::id() % 200) as u8 + 20;
        let tag = (0..200u8)
            .map(|i| start.wrapping_add(i) % 220 + 20)
            .find(|t| {
                !existing.contains(&format!("{PREFIX}{t}-")) && !links.contains(&format!("{PREFIX}{t}br"))
            })
            .context("no free network tag")?;
        let mut net =
            Net { tag, nodes, made_ns: Vec::new(), made_bridge: false, cuts: BTreeSet::new(), netem: false };
        net.build()?;
        Ok(net)
    }

    fn bridge(&self) -> String {
        format!("{PREFIX}{}br", self.tag)
    }

    /// The namespace of broker `id`.
    pub fn ns(&self, id: u32) -> String {
        format!("{PREFIX}{}-b{id}", self.tag)
    }

    fn ns_if(&self, id: u32) -> String {
        format!("{PREFIX}{}p{id}", self.tag)
    }

    /// The address of broker `id`.
    pub fn broker_ip(&self, id: u32) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.tag, 10 + id as u8)
    }

    /// The host's address on the bridge.
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.tag, 1)
    }

    fn build(&mut self) -> anyhow::Result<()> {
        let br = self.bridge();
        sh("ip", &["link", "add", &br, "type", "bridge"])?;
        self.made_bridge = true;
        sh("ip", &["addr", "add", &format!("{}/24", self.host_ip()), "dev", &br])?;
        sh("ip", &["link", "set", &br, "up"])?;
        for id in 1..=self.nodes {
            let ns = self.ns(id);
            sh("ip", &["netns", "add", &ns])?;
            self.made_ns.push(ns.clone());
            let host_if = format!("{PREFIX}{}v{id}", self.tag);
            let ns_if = self.ns_if(id);
            sh("ip", &["link", "add", &host_if, "type", "veth", "peer", "name", &ns_if, "netns", &ns])?;
            sh("ip", &["link", "set", &host_if, "master", &br, "up"])?;
            let addr = format!("{}/24", self.broker_ip(id));
            sh("ip", &["-n", &ns, "addr", "add", &addr, "dev", &ns_if])?;
            sh("ip", &["-n", &ns, "link", "set", &ns_if, "up"])?;
            sh("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    /// Drops every packet from broker `from` to broker `to`: a blackhole
    /// route to `to` in `from`'s namespace (one direction; cut both for a
    /// symmetric partition).
    ///
    /// # Errors
    /// An `ip route` failure.
    pub fn cut(&mut self, from: u32, to: u32) -> anyhow::Result<()> {
        if from == to || !self.cuts.insert((from, to)) {
            return Ok(());
        }
        sh("ip", &["-n", &self.ns(from), "route", "add", "blackhole", &format!("{}/32", self.broker_ip(to))])
    }

    /// Restores every direction.
    ///
    /// # Errors
    /// The first `ip route` failure (the others are still tried).
    pub fn heal(&mut self) -> anyhow::Result<()> {
        let mut first = Ok(());
        for (from, to) in std::mem::take(&mut self.cuts) {
            let r = sh(
                "ip",
                &["-n", &self.ns(from), "route", "del", "blackhole", &format!("{}/32", self.broker_ip(to))],
            );
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Adds `tc netem` (e.g. `delay 50ms 20ms loss 2%`) to every broker's interface.
    ///
    /// # Errors
    /// A `tc` failure (no sch_netem in the kernel, for one).
    pub fn netem(&mut self, spec: &[&str]) -> anyhow::Result<()> {
        for id in 1..=self.nodes {
            let (ns, dev) = (self.ns(id), self.ns_if(id));
            let mut args = vec!["-n", &ns, "qdisc", "replace", "dev", &dev, "root", "netem"];
            args.extend_from_slice(spec);
            sh("tc", &args)?;
            self.netem = true;
        }
        Ok(())
    }

    /// Removes netem from every broker's interface.
    pub fn clear_netem(&mut self) {
        if std::mem::take(&mut self.netem) {
            for id in 1..=self.nodes {
                let _ = sh("tc", &["-n", &self.ns(id), "qdisc", "del", "dev", &self.ns_if(id), "root"]);
            }
        }
    }

    /// Removes the namespaces (and with them their veth ends and routes)
    /// and the bridge. Processes still running in a namespace keep it
    /// alive until they exit: stop them first.
    pub fn teardown(&mut self) {
        self.cuts.clear();
        for ns in std::mem::take(&mut self.made_ns) {
            if let Err(e) = sh("ip", &["netns", "del", &ns]) {
                eprintln!("ferrolog-jepsen: removing namespace {ns}: {e:#}");
            }
        }
        if std::mem::take(&mut self.made_bridge) {
            let _ = sh("ip", &["link", "del", &self.bridge()]);
        }
        for id in 1..=self.nodes {
            // Normally gone with its namespace.
            let _ = sh("ip", &["link", "del", &format!("{PREFIX}{}v{id}", self.tag)]);
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.teardown();
    }
}

//! Cluster readiness with real `ferrolog broker` processes: `ferrolog topic
//! create` issued before every broker has registered waits for them
//! instead of failing, `ferrolog cluster status` says who is missing, and
//! with a broker down and a replication factor above the live brokers the
//! create gives up after `--timeout` with the controller's reason.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog");
/// Bound on waits for things that must happen (never asserted on).
const PATIENCE: Duration = Duration::from_secs(90);

/// Three broker slots of one cluster (`initial_cluster` names all three);
/// each is started on demand and killed when dropped.
struct Slots {
    children: Vec<Option<Child>>,
    /// The loopback address every broker of this test listens on.
    ip: std::net::Ipv4Addr,
    client: Vec<u16>,
    peer: Vec<u16>,
    /// A port on `ip` nothing listens on.
    closed: u16,
    dir: tempfile::TempDir,
}

impl Drop for Slots {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Slots {
    fn new() -> Slots {
        let (ip, ports) = common::private_addrs(7);
        Slots {
            children: vec![None, None, None],
            ip,
            client: ports[0..3].to_vec(),
            peer: ports[3..6].to_vec(),
            closed: ports[6],
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    /// Starts broker `id` (1-based).
    fn start(&mut self, id: usize) {
        self.start_with(id, &[]);
    }

    /// Starts broker `id` with extra broker flags.
    fn start_with(&mut self, id: usize, flags: &[&str]) {
        let initial =
            (0..3).map(|i| format!("{}={}:{}", i + 1, self.ip, self.peer[i])).collect::<Vec<_>>().join(",");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("broker-{id}.log")))
            .expect("log");
        let child = Command::new(BIN)
            .args(["broker", "run", "--node-id", &id.to_string()])
            .args(["--client-addr", &format!("{}:{}", self.ip, self.client[id - 1])])
            .args(["--peer-addr", &format!("{}:{}", self.ip, self.peer[id - 1])])
            .args(["--kafka-addr", &format!("{}:0", self.ip)])
            .arg("--data-dir")
            .arg(self.dir.path().join(format!("broker-{id}")))
            .args(["--initial-cluster", &initial])
            .args(flags)
            .env_remove("FERROLOG_CONFIG")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start a broker");
        self.children[id - 1] = Some(child);
    }

    /// SIGKILLs broker `id`.
    fn kill(&mut self, id: usize) {
        if let Some(mut c) = self.children[id - 1].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Every broker's client address, running or not.
    fn bootstrap(&self) -> String {
        self.client.iter().map(|p| format!("{}:{p}", self.ip)).collect::<Vec<_>>().join(",")
    }

    fn command(&self, bootstrap: &str, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("--bootstrap").arg(bootstrap).args(args).stdin(Stdio::null());
        c
    }

    fn run(&self, bootstrap: &str, args: &[&str]) -> Output {
        self.command(bootstrap, args).output().expect("run ferrolog")
    }

    fn logs(&self) -> String {
        (1..=3)
            .map(|i| {
                let p = self.dir.path().join(format!("broker-{i}.log"));
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                format!("--- {}:\n{}", p.display(), tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Runs `ferrolog cluster status` through `bootstrap` until its output
    /// satisfies `ok`; returns that output.
    fn status_until(&self, bootstrap: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let out = self.run(bootstrap, &["cluster", "status"]);
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if out.status.success() && ok(&text) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: status never showed it:\n{text}\n{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

/// The row of broker `id` in a status table, if listed.
fn broker_row(status: &str, id: usize) -> Option<&str> {
    status.lines().find(|l| l.split_whitespace().next() == Some(&id.to_string()))
}

#[test]
fn topic_create_waits_for_registration_and_gives_up_clearly() {
    let mut c = Slots::new();
    // Brokers 1 and 2 reach broker 3, but broker 3's own connections to them
    // go to a closed port: it answers the founding pings (so 1 and 2 found
    // the metadata group, all three its members, and elect a controller),
    // but cannot learn that the group formed, so it never registers. This
    // holds open the window a cluster has just after it starts, when some
    // brokers have not registered yet.
    c.start(1);
    c.start(2);
    let nowhere = format!("{}:{}", c.ip, c.closed);
    let routes = format!("{ip}:{}={nowhere},{ip}:{}={nowhere}", c.peer[0], c.peer[1], ip = c.ip);
    c.start_with(3, &["--peer-routes", &routes]);

    // Create at once, without waiting for anything.
    let mut create = c
        .command(
            &c.bootstrap(),
            &[
                "topic",
                "create",
                "early",
                "--partitions",
                "2",
                "--replication-factor",
                "3",
                "--timeout",
                "120",
            ],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ferrolog topic create");
    let stderr = create.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The create is refused for want of registered brokers and says it
    // waits, once per distinct reason: right after start-up brokers 1 and 2
    // may not have registered either, so wait for the reason naming only 3.
    let mut seen = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    loop {
        match rx.recv_timeout(Duration::from_millis(500)) {
            Ok(line) => {
                let waits_for_registration = line.starts_with("waiting:")
                    && line.contains("registered")
                    && line.contains("not yet: 3)");
                seen.push(line);
                if waits_for_registration {
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let out = create.wait_with_output().expect("wait");
                panic!(
                    "topic create ended ({}) instead of waiting for broker 3:\nstderr: {}\nstdout: {}",
                    out.status,
                    seen.join("\n"),
                    String::from_utf8_lossy(&out.stdout)
                );
            }
        }
        assert!(Instant::now() < deadline, "no waiting message: {seen:?}\n{}", c.logs());
    }
    let waiting = seen.last().expect("a line").clone();
    assert!(waiting.contains("not yet: 3"), "names the missing broker: {waiting}");

    // Meanwhile the status says the cluster is not ready, and why.
    let status = c.status_until(&c.bootstrap(), "broker 3 unregistered", |s| {
        s.contains("ready: NO") && broker_row(s, 3).is_some_and(|r| r.contains("not registered"))
    });
    assert!(status.contains("not registered yet: 3"), "{status}");

    // Broker 3 restarts able to reach the others: it joins the formed
    // group as a founding member that never ran, and registers; the
    // waiting create succeeds.
    c.kill(3);
    c.start(3);
    let out = create.wait_with_output().expect("wait for topic create");
    let _ = reader.join();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "topic create failed: {}\nstderr: {}", out.status, seen.join("\n"));
    assert!(stdout.contains("created topic early: 2 partitions, replication factor 3"), "{stdout}");
    c.status_until(&c.bootstrap(), "ready", |s| {
        s.contains("ready: yes (3 of 3 brokers registered and alive)")
    });

    // Broker 3 down: once both others see it silent, a replication factor
    // of 3 cannot be placed; the create gives up after --timeout.
    c.kill(3);
    for id in [1, 2] {
        let one = format!("{}:{}", c.ip, c.client[id - 1]);
        c.status_until(&one, "broker 3 not alive", |s| {
            broker_row(s, 3).is_some_and(|r| r.split_whitespace().any(|w| w == "NO"))
        });
    }
    let out = c.run(
        &c.bootstrap(),
        &["topic", "create", "late", "--partitions", "1", "--replication-factor", "3", "--timeout", "3"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "created with a broker down: {}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains("could not place it within --timeout 3 s"), "{stderr}");
    assert!(stderr.contains("gave up after 3000 ms"), "{stderr}");
    assert!(
        stderr.contains("needs 3 live brokers; 2 of the 3 registered answer (not answering: 3)"),
        "{stderr}"
    );
    // A factor the cluster can never hold fails at once, not after a wait.
    let out = c.run(
        &c.bootstrap(),
        &["topic", "create", "wide", "--partitions", "1", "--replication-factor", "4", "--timeout", "600"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("INVALID_REPLICATION_FACTOR") && stderr.contains("the cluster has 3"),
        "{stderr}"
    );
}

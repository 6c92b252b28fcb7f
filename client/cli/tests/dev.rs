//! `ferrolog dev` as a new user runs it: the cluster comes up, the demo
//! shows records flowing, a broker killed with SIGKILL is reported (with the
//! command to restart it) and not restarted, the demo carries on, and
//! Ctrl-C stops the rest. Runs on free ports instead of 9401-9503.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog");

/// Whether ports base+1..=base+3 are free on 127.0.0.1.
fn free_run(base: u16) -> bool {
    (1..=3).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok())
}

/// The lowest port the kernel hands out as a source port
/// (`net.ipv4.ip_local_port_range`; Linux's default 32768 if unreadable).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next().and_then(|p| p.parse().ok()))
        .unwrap_or(32_768)
}

/// Bases such that base+1..=base+3 are free, for client, peer and Kafka
/// ports (Kafka's base+0..=base+2 of its own base),
/// below the ephemeral range: `ferrolog dev` binds them after this check,
/// and a port in that range could meanwhile become some outgoing
/// connection's source port (CI failed that way once in another test).
fn port_bases() -> (u16, u16, u16) {
    const LOW: u16 = 10_000;
    let high = ephemeral_low().saturating_sub(20).max(LOW + 20);
    let span = (high - LOW) / 20;
    let mut candidate = LOW + (std::process::id() % u32::from(span)) as u16 * 20;
    loop {
        if free_run(candidate) && free_run(candidate + 5) && free_run(candidate + 9) {
            return (candidate, candidate + 5, candidate + 10);
        }
        candidate = if candidate + 40 >= high { LOW } else { candidate + 20 };
    }
}

/// The dev process, its stdout lines arriving on a channel; killed (with
/// its brokers, through their parent-death signal) if the test fails.
struct Dev {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Dev {
    /// Waits for a line containing `needle`; returns it.
    fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no line with {needle:?} within {timeout:?}; output so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }
}

fn pid_of(line: &str) -> u32 {
    // "  broker 2: pid 12345   client ..."
    let after = line.split("pid").nth(1).expect("a pid");
    after.split_whitespace().next().expect("pid value").parse().expect("numeric pid")
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

/// A status line's "consumed N".
fn consumed(line: &str) -> u64 {
    let after = line.split("consumed ").nth(1).expect("consumed");
    after
        .split_whitespace()
        .next()
        .expect("n")
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .expect("n")
}

#[test]
fn dev_cluster_shows_records_flowing_and_survives_a_kill() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (client_base, peer_base, kafka_base) = port_bases();
    let mut child = Command::new(BIN)
        .args(["dev", "--dir"])
        .arg(dir.path())
        .args(["--client-port-base", &client_base.to_string(), "--peer-port-base", &peer_base.to_string()])
        .args(["--kafka-port-base", &kafka_base.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start ferrolog dev");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut dev = Dev { child, lines, seen: Vec::new() };

    let pids: Vec<u32> = (1..=3)
        .map(|i| pid_of(&dev.wait_for(&format!("broker {i}: pid"), Duration::from_secs(30))))
        .collect();
    for (i, pid) in pids.iter().enumerate() {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
        assert!(
            cmdline.starts_with(b"ferrolog-broker\0broker\0run\0--config\0"),
            "broker {}: {:?}",
            i + 1,
            String::from_utf8_lossy(&cmdline)
        );
        let config = std::fs::read_to_string(dir.path().join(format!("broker-{}/broker.toml", i + 1)))
            .expect("config");
        assert!(config.contains(&format!("node_id = {}", i + 1)), "{config}");
        assert!(config.contains(&format!("127.0.0.1:{}", client_base + i as u16 + 1)), "{config}");
    }
    dev.wait_for("broker run --config", Duration::from_secs(5));
    dev.wait_for("cluster ready", Duration::from_secs(60));
    dev.wait_for("demo: producing", Duration::from_secs(60));
    let first = consumed(&dev.wait_for("] produced", Duration::from_secs(30)));
    let later = loop {
        let line = dev.wait_for("] produced", Duration::from_secs(10));
        if consumed(&line) > first + 5 {
            break line;
        }
    };
    assert!(later.contains("failed 0"), "{later}");

    // SIGKILL broker 2: reported with the restart command, not restarted.
    // SAFETY: kill(2) on a pid this test just read from the dev output.
    assert_eq!(unsafe { libc::kill(pids[1] as libc::pid_t, libc::SIGKILL) }, 0);
    let report = dev.wait_for("!! broker 2", Duration::from_secs(10));
    assert!(report.contains("killed by signal 9 (SIGKILL)") && report.contains("not restarted"), "{report}");
    let restart = dev.wait_for("restart it", Duration::from_secs(5));
    assert!(
        restart
            .contains(&format!("broker run --config {}", dir.path().join("broker-2/broker.toml").display())),
        "{restart}"
    );
    // The demo goes on with two brokers.
    let before = consumed(&dev.wait_for("] produced", Duration::from_secs(10)));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let line = dev.wait_for("] produced", Duration::from_secs(10));
        if consumed(&line) > before + 10 {
            assert!(line.contains("failed 0"), "{line}");
            break;
        }
        assert!(Instant::now() < deadline, "the demo stalled after the kill: {line}");
    }
    assert!(!dev.seen.iter().any(|l| l.contains("!! broker 1") || l.contains("!! broker 3")));

    // Ctrl-C: the other brokers are stopped, then dev exits cleanly.
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(dev.child.id() as libc::pid_t, libc::SIGINT) }, 0);
    dev.wait_for("stopped; data kept in", Duration::from_secs(30));
    let status = dev.child.wait().expect("wait");
    assert!(status.success(), "{status}");
    for (i, pid) in pids.iter().enumerate() {
        assert!(!alive(*pid), "broker {} (pid {pid}) still runs", i + 1);
    }
}

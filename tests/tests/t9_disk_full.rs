//! A broker whose disk fills up (issue 9, item 2): its partition's leader
//! elsewhere takes over, produces go on (no acknowledged record lost, none
//! stored twice), the full broker reports its replica as failed and waiting
//! for the disk, and once space is freed it restarts the replica by itself
//! and catches up, with no broker restart.
//!
//! Each broker's data directory is a size-limited tmpfs (a real file system
//! that answers ENOSPC); mounting needs root, as this project's test machines
//! and CI run. Without it the test fails and says so.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ferrolog_proto::client::ReplicaState;
use ferrolog_tests::Cluster;
use ferrolog_tests::raw::{batch, create_topic, init_producer_id, leader, produce, read_values, status};

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog-test-broker");
const DISK: &str = "64m";

/// Unmounts what it mounted, last first, when dropped.
#[derive(Default)]
struct Mounts(Vec<PathBuf>);

impl Mounts {
    /// Mounts a `DISK`-sized tmpfs on `dir`.
    fn tmpfs(&mut self, dir: &Path) -> anyhow::Result<()> {
        self.mount(dir, &format!("size={DISK}"))
    }

    /// Mounts an empty read-only tmpfs on `dir`.
    fn read_only(&mut self, dir: &Path) -> anyhow::Result<()> {
        self.mount(dir, "ro,size=1m")
    }

    fn mount(&mut self, dir: &Path, options: &str) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir)?;
        let out = Command::new("mount").args(["-t", "tmpfs", "-o", options, "tmpfs"]).arg(dir).output()?;
        anyhow::ensure!(
            out.status.success(),
            "this test mounts tmpfs file systems ({options}) and needs root: mount {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        self.0.push(dir.to_owned());
        Ok(())
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for dir in self.0.iter().rev() {
            let _ = Command::new("umount").arg("-l").arg(dir).status();
        }
    }
}

/// Fills the file system of `dir` with `filler` until it answers ENOSPC.
fn fill(filler: &Path) -> anyhow::Result<u64> {
    let mut f = std::fs::File::create(filler)?;
    let chunk = vec![0xAAu8; 1 << 20];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => return Err(e.into()),
        }
    }
    let _ = f.sync_all();
    Ok(written)
}

async fn replica_state(c: &Cluster, id: u32) -> Option<(i32, String, u64)> {
    status(c, id, "t", 0).await.ok().map(|s| (s.replica_state, s.replica_detail, s.last_log_index))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_moves_the_leader_and_the_replica_returns_when_space_is_freed() -> anyhow::Result<()> {
    let mut mounts = Mounts::default();
    let mut c = Cluster::prepare("diskfull", BIN, 3, &[])?;
    for id in 1..=3 {
        let dir = c.data_dir(id).to_owned();
        mounts.tmpfs(&dir)?;
    }
    c.launch().await?;
    create_topic(&c, "t", 1, 3).await?;
    let pid = init_producer_id(c.broker(1).client_addr).await?;
    let mut written = Vec::new();
    let mut seq = 0;
    let mut send =
        async |c: &Cluster, tag: &str, n: usize, written: &mut Vec<String>| -> anyhow::Result<u32> {
            let mut by = 0;
            for i in 0..n {
                let value = format!("{tag}-{i}-{}", "v".repeat(1000));
                by = produce(c, batch("t", pid, seq, &value), Duration::from_secs(30)).await?.1;
                seq += 1;
                written.push(value);
            }
            Ok(by)
        };
    send(&c, "before", 20, &mut written).await?;
    let full = leader(&c, "t", 0, Duration::from_secs(30)).await?;

    // The leader's disk fills up; produces keep being acknowledged, by
    // another leader.
    let filler = c.data_dir(full).join("filler");
    let filled = fill(&filler)?;
    assert!(filled > 0, "nothing was written to fill the disk");
    let by = send(&c, "full", 50, &mut written).await?;
    let now_leader = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    assert_ne!(now_leader, full, "the broker with the full disk still leads");
    assert_ne!(by, full, "the last produce was acknowledged by the broker with the full disk");

    // The full broker says why its replica is out of service.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = replica_state(&c, full).await;
        if let Some((state, detail, _)) = &s
            && *state == ReplicaState::Failed as i32
            && detail.contains("restart waits for the disk")
        {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "broker {full} does not report its replica waiting for the disk: {s:?}\n{}",
            c.logs_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // Space is freed: the replica comes back by itself and catches up.
    std::fs::remove_file(&filler)?;
    send(&c, "freed", 10, &mut written).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
        let want = status(&c, l, "t", 0).await?.last_log_index;
        let s = replica_state(&c, full).await;
        if let Some((state, _, last)) = &s
            && *state == ReplicaState::Running as i32
            && *last == want
        {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "broker {full} did not come back after space was freed: {s:?}, leader at {want}\n{}",
            c.logs_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(c.is_running(full), "the broker itself was restarted");

    // Every acknowledged record once, in order.
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    assert_eq!(read_values(c.broker(l).client_addr, "t").await?, written);
    drop(c);
    Ok(())
}

/// A read-only data directory at start-up (issue 15): the broker exits
/// with an error naming the directory, not with a bare OS error later.
#[test]
fn a_read_only_data_directory_is_refused_at_start_naming_it() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let ro = tmp.path().join("ro");
    let mut mounts = Mounts::default();
    mounts.read_only(&ro)?;
    let out = Command::new(BIN)
        .args(["--node-id", "1", "--client-addr", "127.0.0.1:0", "--peer-addr", "127.0.0.2:1"])
        .args(["--initial-cluster", "1=127.0.0.2:1"])
        .arg("--data-dir")
        .arg(&ro)
        .env("RUST_BACKTRACE", "0")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a broker on a read-only data directory started: {stderr}");
    assert!(
        stderr.contains(&format!("data directory {} is not writable", ro.display())),
        "the error must name the directory: {stderr}"
    );
    assert!(stderr.contains("Read-only file system"), "the error must say why: {stderr}");
    drop(mounts);
    Ok(())
}

//! A broker whose disk fills up (issue 9, item 2): its partition's leader
//! elsewhere takes over, produces go on (no acknowledged record lost, none
//! stored twice), the full broker reports its replica as failed and waiting
//! for the disk, and once space is freed it restarts the replica by itself
//! and catches up, with no broker restart.
//!
//! The same for the broker's replica of the metadata group, and a data
//! directory that turns read-only under load (ext4 remounting itself
//! read-only after an error): its partition's leader moves elsewhere.
//!
//! Each broker's data directory is a size-limited tmpfs (a real file system
//! that answers ENOSPC), or for the read-only case a loop-mounted ext4 image
//! (`mkfs.ext4` from e2fsprogs, `findmnt` from util-linux, which `.ci/run`
//! installs if missing, and `/sys/fs/ext4/<device>/trigger_fs_error`).
//! Mounting needs root, as this project's test machines and CI run. Without
//! these the tests fail and say so.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ferrolog_proto::client::ReplicaState;
use ferrolog_tests::raw::{batch, create_topic, init_producer_id, leader, produce, read_values, status};
use ferrolog_tests::{Cluster, metadata};

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

    /// Mounts a new `size`-byte ext4 file system, kept in the file
    /// `image`, on `dir`, with `errors=remount-ro` (as production mounts
    /// do: the kernel turns it read-only after an error). Returns the name
    /// of its device under /sys/fs/ext4 (e.g. `loop3`).
    fn ext4(&mut self, dir: &Path, image: &Path, size: u64) -> anyhow::Result<String> {
        std::fs::File::create(image)?.set_len(size)?;
        let out = Command::new("mkfs.ext4").args(["-q", "-F"]).arg(image).output()?;
        anyhow::ensure!(
            out.status.success(),
            "mkfs.ext4 {}: {}",
            image.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::create_dir_all(dir)?;
        let out =
            Command::new("mount").args(["-o", "loop,errors=remount-ro"]).arg(image).arg(dir).output()?;
        anyhow::ensure!(
            out.status.success(),
            "this test mounts loop devices and needs root: mount {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        self.0.push(dir.to_owned());
        let out = Command::new("findmnt").args(["-n", "-o", "SOURCE"]).arg(dir).output()?;
        let source = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let device = source.rsplit('/').next().unwrap_or_default().to_owned();
        anyhow::ensure!(
            device.starts_with("loop"),
            "{} is mounted from {source:?}, not a loop device",
            dir.display()
        );
        // A fresh ext4 holds lost+found, which a new data directory must not.
        std::fs::remove_dir(dir.join("lost+found"))?;
        Ok(device)
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

async fn replica_state(c: &Cluster, id: u32, topic: &str) -> Option<(i32, String, u64)> {
    status(c, id, topic, 0).await.ok().map(|s| (s.replica_state, s.replica_detail, s.last_log_index))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_moves_the_leader_and_the_replica_returns_when_space_is_freed() -> anyhow::Result<()> {
    let mut c = Cluster::prepare("diskfull", BIN, 3, &[])?;
    // Unmounted before the cluster's directory is removed (dropped first).
    let mut mounts = Mounts::default();
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
        let s = replica_state(&c, full, "t").await;
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
    hosts_caught_up(&c, full, "t").await?;
    assert!(c.is_running(full), "broker {full}'s process exited (a broker restart is not asked for)");

    // Every acknowledged record once, in order.
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    assert_eq!(read_values(c.broker(l).client_addr, "t").await?, written);
    drop(mounts);
    drop(c);
    Ok(())
}

/// An ext4 error on `device` (as a failing disk causes): the kernel makes
/// the file system read-only at once (`errors=remount-ro`), under open
/// files, and every later write fails with EROFS.
fn fail_ext4(device: &str) -> anyhow::Result<()> {
    std::fs::write(format!("/sys/fs/ext4/{device}/trigger_fs_error"), "ferrolog test")?;
    Ok(())
}

/// The leader of `topic`-0 that broker `id` names in its `Metadata`
/// answer (0: none), `None` if it does not answer.
async fn leader_named_by(c: &Cluster, id: u32, topic: &str) -> Option<u32> {
    let m = metadata(c.broker(id).client_addr).await.ok()?;
    m.topics.iter().find(|t| t.name == topic)?.partitions.first().map(|p| p.leader)
}

/// The data directory of a partition's leader turns read-only under load
/// (ext4 remounting itself read-only after an error). Its replica stops;
/// every broker, itself included, soon names a leader elsewhere; produces
/// go on there, and no acknowledged record is lost or stored twice. Before,
/// the broker went on naming itself leader for 25 s and more, answering
/// NOT_LEADER with its own id, and the partition took no write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_directory_turning_read_only_under_load_moves_its_leader() -> anyhow::Result<()> {
    let images = tempfile::tempdir()?;
    let mut c = Cluster::prepare("diskro", BIN, 3, &[])?;
    // Unmounted before the cluster's directory is removed (dropped first).
    let mut mounts = Mounts::default();
    let mut devices = std::collections::BTreeMap::new();
    for id in 1..=3 {
        let dir = c.data_dir(id).to_owned();
        let image = images.path().join(format!("broker-{id}.ext4"));
        devices.insert(id, mounts.ext4(&dir, &image, 160 << 20)?);
    }
    c.launch().await?;
    create_topic(&c, "t", 1, 3).await?;
    let pid = init_producer_id(c.broker(1).client_addr).await?;
    let mut written = Vec::new();
    for i in 0..20 {
        let value = format!("before-{i}-{}", "v".repeat(1000));
        produce(&c, batch("t", pid, i, &value), Duration::from_secs(30)).await?;
        written.push(value);
    }
    let failing = leader(&c, "t", 0, Duration::from_secs(30)).await?;

    // The disk fails while a producer keeps writing, one record at a time
    // (each retried until acknowledged, as an idempotent producer does).
    let failed_at = Instant::now();
    fail_ext4(&devices[&failing])?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let producing = async {
        let (mut values, mut by) = (Vec::new(), Vec::new());
        let mut seq = written.len() as i32;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let value = format!("during-{seq}-{}", "v".repeat(1000));
            let (_, id) = produce(&c, batch("t", pid, seq, &value), Duration::from_secs(60)).await?;
            values.push(value);
            by.push((id, failed_at.elapsed()));
            seq += 1;
        }
        anyhow::Ok((values, by))
    };
    let watching = async {
        // Every broker, the failing one too, names a leader elsewhere.
        let deadline = Instant::now() + Duration::from_secs(30);
        let moved = loop {
            let mut named = Vec::new();
            for id in 1..=3 {
                named.push(leader_named_by(&c, id, "t").await);
            }
            if named.iter().all(|l| l.is_some_and(|l| l != 0 && l != failing)) {
                break failed_at.elapsed();
            }
            if Instant::now() >= deadline {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                anyhow::bail!("30 s after broker {failing}'s disk failed, brokers name leaders {named:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // The failing broker says why its replica is out of service.
        let deadline = Instant::now() + Duration::from_secs(30);
        let detail = loop {
            let s = replica_state(&c, failing, "t").await;
            if let Some((state, detail, _)) = &s
                && *state == ReplicaState::Failed as i32
            {
                break detail.clone();
            }
            if Instant::now() >= deadline {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                anyhow::bail!("broker {failing} does not report its replica failed: {s:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        // Some load after the move.
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        anyhow::Ok((moved, detail))
    };
    let (produced, watched) = tokio::join!(producing, watching);
    let (moved, detail) = watched?;
    let (values, by) = produced?;
    // The file system turns read-only as the error is handled; a write
    // caught in between may fail with EIO instead.
    assert!(
        detail.contains("Read-only file system") || detail.contains("Input/output error"),
        "the failure must name the error: {detail}"
    );
    let first_elsewhere = by.iter().find(|(id, _)| *id != failing).map(|(_, t)| *t);
    let after_move = by.iter().filter(|(id, t)| *id != failing && *t > moved).count();
    eprintln!(
        "broker {failing}'s disk turned read-only: every broker named another leader after {} ms; \
         first produce acknowledged elsewhere after {:?} ms; {} produced meanwhile, {after_move} after the move",
        moved.as_millis(),
        first_elsewhere.map(|t| t.as_millis()),
        values.len()
    );
    assert!(after_move > 0, "no produce was acknowledged after the leader moved: the test saw no load");
    // A bound on behaviour, not a speed target: before, the partition
    // stayed on the failed broker for 25 s and more. Election timeouts
    // here are 0.5–1 s and the issue asks for about twice that (1.45 s
    // measured alone); the bound leaves room for a loaded CI machine.
    assert!(moved < Duration::from_secs(20), "the leader took {moved:?} to move off the read-only broker");
    written.extend(values);

    // Every acknowledged record once, in order.
    let l = leader(&c, "t", 0, Duration::from_secs(30)).await?;
    assert_ne!(l, failing);
    assert_eq!(read_values(c.broker(l).client_addr, "t").await?, written);
    drop(mounts);
    drop(c);
    Ok(())
}

/// What broker `id` says of its own metadata replica: why it is not
/// running (empty while it runs); `None` if it does not answer.
async fn metadata_failure(c: &Cluster, id: u32) -> Option<String> {
    let m = metadata(c.broker(id).client_addr).await.ok()?;
    m.brokers.into_iter().find(|b| b.id == id).map(|b| b.metadata_replica_failure)
}

/// Waits until broker `id` reports its metadata replica failed, and returns
/// the failure (polled every 200 ms, without end).
async fn reported_metadata_failure(c: &Cluster, id: u32) -> String {
    loop {
        if let Some(f) = metadata_failure(c, id).await.filter(|f| !f.is_empty()) {
            return f;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until broker `id` runs a replica of `topic`-0 holding everything
/// its leader holds.
async fn hosts_caught_up(c: &Cluster, id: u32, topic: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let l = leader(c, topic, 0, Duration::from_secs(30)).await?;
        let want = status(c, l, topic, 0).await?.last_log_index;
        let s = replica_state(c, id, topic).await;
        if let Some((state, _, last)) = &s
            && *state == ReplicaState::Running as i32
            && *last == want
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "broker {id} does not host a caught-up replica of {topic}: {s:?}, leader at {want}\n{}",
            c.logs_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A broker whose disk fills up stops its replica of the metadata group at
/// the next metadata change (the metadata log is fsynced on every write),
/// says so in its `Metadata` answer, and once space is freed restarts that
/// replica by itself, with no broker restart: it learns the topics created
/// meanwhile and afterwards and hosts their replicas. Before, its metadata
/// stopped for good: it never hosted a partition created after its disk
/// had filled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_stops_the_metadata_replica_and_it_comes_back_when_space_is_freed() -> anyhow::Result<()>
{
    let mut c = Cluster::prepare("metafull", BIN, 3, &[])?;
    // Unmounted before the cluster's directory is removed (dropped first).
    let mut mounts = Mounts::default();
    for id in 1..=3 {
        let dir = c.data_dir(id).to_owned();
        mounts.tmpfs(&dir)?;
    }
    c.launch().await?;
    create_topic(&c, "before", 1, 3).await?;
    // Not the controller: its own metadata write failing would also move
    // the controller, which is not what this test looks at.
    let deadline = Instant::now() + Duration::from_secs(30);
    let controller = loop {
        let m = metadata(c.broker(1).client_addr).await?.controller;
        if m != 0 {
            break m;
        }
        anyhow::ensure!(Instant::now() < deadline, "no controller known");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let full = (1..=3).find(|id| *id != controller).expect("three brokers");
    assert_eq!(
        metadata_failure(&c, full).await.as_deref(),
        Some(""),
        "a failure reported before the disk filled"
    );

    let filler = c.data_dir(full).join("filler");
    assert!(fill(&filler)? > 0, "nothing was written to fill the disk");
    // Metadata changes until one no longer fits (the last page of the
    // metadata log's segment may take a few small records still).
    let mut during = Vec::new();
    let failure = loop {
        anyhow::ensure!(
            during.len() < 40,
            "broker {full}'s metadata replica took {} topic creations on a full disk",
            during.len()
        );
        let name = format!("during-{}", during.len());
        // The creation waits until every broker lists the topic, which the
        // full one may never do, its metadata replica having stopped: the
        // failure it reports meanwhile ends the wait.
        let step = tokio::select! {
            f = reported_metadata_failure(&c, full) => Err(f),
            created = create_topic(&c, &name, 1, 3) => Ok(created),
        };
        let created = match step {
            Err(f) => {
                // The creation, cut short, may not have reached the
                // controller: the topic is checked later only if it exists.
                if metadata(c.broker(controller).client_addr)
                    .await
                    .is_ok_and(|m| m.topics.iter().any(|t| t.name == name))
                {
                    during.push(name);
                }
                break f;
            }
            Ok(created) => {
                during.push(name);
                created
            }
        };
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut seen = None;
        while Instant::now() < deadline {
            seen = metadata_failure(&c, full).await;
            if seen.as_ref().is_some_and(|f| !f.is_empty()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if let Some(f) = seen.filter(|f| !f.is_empty()) {
            break f;
        }
        if let Err(e) = created {
            anyhow::bail!("{e:#}; broker {full} reports no metadata failure\n{}", c.logs_tail(30));
        }
    };
    // It says why, and that it waits for the disk.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut failure = failure;
    while !failure.contains("restart waits for the disk") {
        anyhow::ensure!(
            Instant::now() < deadline,
            "broker {full} does not say its metadata replica waits for the disk: {failure:?}\n{}",
            c.logs_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        failure = metadata_failure(&c, full).await.unwrap_or_default();
    }
    assert!(failure.contains("No space left on device"), "the failure must name the error: {failure}");

    // Space is freed: the metadata replica comes back by itself, and the
    // broker hosts what was created meanwhile and afterwards.
    std::fs::remove_file(&filler)?;
    if let Err(e) = create_topic(&c, "after", 1, 3).await {
        let now = metadata_failure(&c, full).await;
        anyhow::bail!("{e:#}; broker {full}'s metadata replica: {now:?}\n{}", c.logs_tail(40));
    }
    for topic in during.iter().map(String::as_str).chain(["after", "before"]) {
        hosts_caught_up(&c, full, topic).await?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while metadata_failure(&c, full).await.as_deref() != Some("") {
        anyhow::ensure!(Instant::now() < deadline, "broker {full} still reports its metadata replica failed");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(c.is_running(full), "broker {full}'s process exited (a broker restart is not asked for)");
    drop(mounts);
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

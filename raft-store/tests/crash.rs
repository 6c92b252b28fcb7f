//! Crash test: a real writer process appends with `flush = always` and is
//! killed with SIGKILL at random points, hundreds of times; after each kill
//! the log is reopened and checked: every entry whose flush was acknowledged
//! is present and CRC-valid, nothing torn is visible, offsets are unchanged.
//!
//! The writer is this test binary itself, re-run with `--ignored --exact
//! crash_writer_child` and the directory in `FERROLOG_CRASH_DIR`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use ferrolog_raft_store::types::EntryPayload;
use ferrolog_raft_store::{Flusher, Replica, StoreConfig};
use openraft::storage::RaftLogStorage;

const DIR_ENV: &str = "FERROLOG_CRASH_DIR";

fn small_segments() -> StoreConfig {
    // 64 KiB segments so kills also land around rolls and index writes.
    StoreConfig { segment_bytes: 64 * 1024, index_interval_bytes: 512, ..StoreConfig::default() }
}

/// The writer: appends forever, 1 to 4 entries per call, up to 8 calls in
/// flight, printing `acked N` once entry N is durable.
#[test]
#[ignore = "run as a child process by crash_recovery_keeps_every_acknowledged_entry"]
fn crash_writer_child() {
    let Ok(dir) = std::env::var(DIR_ENV) else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    rt.block_on(async move {
        let flusher = Flusher::spawn("crash").expect("flusher");
        let replica = Replica::open(std::path::Path::new(&dir), small_segments(), flusher).expect("open");
        let mut store = replica.log_store();
        let state = store.get_log_state().await.expect("state");
        let mut next = state.last_log_id.map_or(0, |l| l.index + 1);
        let (ack_tx, mut ack_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
        let say = |line: String| {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        };
        say(format!("ready {next}"));
        tokio::spawn(async move {
            while let Some(i) = ack_rx.recv().await {
                say(format!("acked {i}"));
            }
        });
        let in_flight = std::sync::Arc::new(tokio::sync::Semaphore::new(8));
        loop {
            let n = 1 + next % 4;
            let entries: Vec<_> =
                (next..next + n).map(|i| common::entry(1, i, 200 + (i % 7) as usize * 300)).collect();
            let last = next + n - 1;
            next += n;
            let permit = in_flight.clone().acquire_owned().await.expect("semaphore");
            let (cb, done) = ferrolog_raft_store::types::flush_signal();
            store.append(entries, cb).await.expect("append");
            let ack_tx = ack_tx.clone();
            tokio::spawn(async move {
                if let Ok(()) = done.await {
                    let _ = ack_tx.send(last);
                }
                drop(permit);
            });
        }
    });
}

fn iterations() -> u32 {
    std::env::var("FERROLOG_CRASH_ITERATIONS").ok().and_then(|s| s.parse().ok()).unwrap_or(200)
}

#[test]
fn crash_recovery_keeps_every_acknowledged_entry() {
    let mut dir = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("current exe");
    let mut seed: u64 = ferrolog_raft_store::runtime::random_u64() | 1;
    println!("seed {seed}");
    let mut max_acked: Option<u64> = None;
    let mut total_acks = 0u64;
    let mut highest = None;
    for round in 0..iterations() {
        if round % 25 == 0 {
            // A fresh log every 25 kills keeps each reopen's full check cheap.
            dir = tempfile::tempdir().expect("tempdir");
            max_acked = None;
        }
        let mut child = Command::new(&exe)
            .args(["--ignored", "--exact", "crash_writer_child", "--nocapture", "--test-threads=1"])
            .env(DIR_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn writer");
        let stdout = child.stdout.take().expect("stdout");
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (acked_tx, acked_rx) = std::sync::mpsc::channel();
        #[allow(clippy::disallowed_methods, reason = "the test's reader of a child process, no store work")]
        let reader = std::thread::spawn(move || {
            let mut acked = None;
            let mut ready = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may have printed "test crash_writer_child ... "
                // without a newline just before it.
                if line.contains("ready ") {
                    ready = true;
                    let _ = ready_tx.send(());
                } else if let Some(i) = line.strip_prefix("acked ").and_then(|s| s.parse::<u64>().ok()) {
                    if acked.is_none() {
                        let _ = acked_tx.send(());
                    }
                    acked = acked.max(Some(i));
                }
            }
            (ready, acked)
        });
        // Once the writer has opened the log (and, in three rounds of four,
        // had a first append acknowledged: on a disk with slow fsyncs the
        // random delay alone could end most rounds before any), kill it at
        // a random point in the next 0 to 40 ms (xorshift).
        let _ = ready_rx.recv_timeout(Duration::from_secs(10));
        if round % 4 != 0 {
            let _ = acked_rx.recv_timeout(Duration::from_secs(10));
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_micros(seed % 40_000));
        child.kill().expect("SIGKILL writer");
        child.wait().expect("wait");
        let (_ready, acked) = reader.join().expect("reader");
        if acked.is_some() {
            total_acks += 1;
        }
        max_acked = max_acked.max(acked);
        highest = highest.max(max_acked);
        verify(dir.path(), max_acked, round);
    }
    println!(
        "{} kills, {total_acks} after acknowledged appends, highest acknowledged index {highest:?}",
        iterations()
    );
    assert!(
        total_acks > u64::from(iterations()) / 2,
        "the writer was mostly killed before writing: the test did not test"
    );
}

/// Reopens the log and checks it against the deterministic writer.
fn verify(dir: &std::path::Path, max_acked: Option<u64>, round: u32) {
    let flusher = Flusher::spawn("verify").expect("flusher");
    let log = Replica::open_log(dir, small_segments(), flusher)
        .unwrap_or_else(|e| panic!("round {round}: reopen failed: {e}"));
    let last = log.log_state().last_log_id.map(|l| l.index);
    assert!(last >= max_acked, "round {round}: acknowledged index {max_acked:?} lost; log ends at {last:?}");
    let Some(last) = last else { return };
    let entries = log.entries(0, last + 1).unwrap_or_else(|e| panic!("round {round}: read failed: {e}"));
    assert_eq!(entries.len() as u64, last + 1, "round {round}: a gap in the log");
    for (i, e) in entries.iter().enumerate() {
        let want = common::entry(1, i as u64, 200 + (i % 7) * 300);
        assert_eq!(e, &want, "round {round}: entry {i} differs from what was written");
    }
    let batches = log.read(0, usize::MAX, u64::MAX).expect("read batches");
    assert_eq!(batches.len() as u64, last + 1);
    let mut offset = 0;
    for b in &batches {
        assert_eq!(b.header.base_offset, offset, "round {round}: offset of entry {} moved", b.header.index());
        offset += u64::from(common::record_count(b.header.index()));
        let EntryPayload::Normal(_) = &entries[b.header.index() as usize].payload else {
            panic!("not a batch")
        };
    }
}

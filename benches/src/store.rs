//! `ferrolog-bench-store`: write and read throughput of the partition store
//! (`ferrolog-raft-store`) against the raw disk it runs on.
//!
//! Every append goes through openraft's `RaftLogStorage::append` of a
//! [`Replica`]'s log store with `flush = always`, and is timed from the call
//! to the moment its `IOFlushed` callback reports it durable. Each Raft entry
//! is one producer record batch of 16 KiB of records (16 KiB / record size
//! records), so the figures are directly comparable with the raw disk
//! measured in the same run and the same directory: sequential 16 KiB
//! `write(2)` + `fdatasync(2)` of a fresh file, one at a time.
//!
//! For each record size (`--record-sizes`, default 100 B and 1 KiB) it runs,
//! each for `--seconds`:
//!
//! 0. **raw**: 16 KiB write + fdatasync loop on a new file (the baseline);
//! 1. **1 partition, 1 in flight**: append, wait for the flush, repeat;
//! 2. **1 partition, pipelined**: up to `--window` entries in flight;
//! 3. **N partitions** (`--partitions`), replicas in subdirectories of one
//!    data directory sharing one [`Flusher`], one entry in flight each;
//! 4. **read**: reopens the log written by scenario 2 as a [`PartitionLog`]
//!    and reads it back from the page cache with 1 MiB fetches
//!    (`PartitionLog::read`), in passes until `--seconds` have elapsed. Each
//!    fetch starts where the previous one ended, as a consumer's would;
//!    batches returned past the expected offset are counted as gaps and
//!    reported with a warning.
//!
//! It prints entries/s, records/s, MB/s (10⁶ bytes of record payload per
//! second), p50/p99 append-to-flush latency, the ratio to the raw disk, the
//! flusher's counters (sync rounds, fdatasyncs, syncfs calls) of each
//! scenario, and p50/p99 of the time spent inside the append call itself
//! (the time Raft's log IO is held up); with `--json` also one JSON line
//! with every figure. The raw figure is noisy on virtual disks: compare
//! ratios of several runs rather than one.
//!
//! Run it in release mode from the workspace root:
//!
//! ```text
//! cargo run --release -p ferrolog-benches --bin ferrolog-bench-store -- --seconds 3
//! ```
//!
//! Data goes to a temporary directory (removed at exit) under `--dir`, by
//! default under `./target` if it exists, else the system temp directory.
//! A tmpfs or ramfs directory is refused: it would measure memory, not disk.

use std::collections::VecDeque;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use clap::Parser;
use ferrolog_raft_store::flusher::FlushStats;
use ferrolog_raft_store::types::{Entry, EntryPayload, TypeConfig, log_id};
use ferrolog_raft_store::{
    FlushPolicy, Flusher, LogStore, NO_PRODUCER_ID, PartitionLog, RecordBatch, Replica, StoreConfig,
};
use hdrhistogram::Histogram;
use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::type_config::TypeConfigExt;
use serde_json::{Value, json};
use tokio::sync::oneshot;

/// Bytes of records in one batch, and of one raw write.
const BATCH_BYTES: usize = 16 * 1024;
/// `max_bytes` of one consumer read.
const READ_MAX_BYTES: usize = 1 << 20;
/// Bytes in a megabyte as printed (SI, like disk vendors and `dd`).
const BYTES_PER_MB: f64 = 1e6;
/// Largest latency the histograms hold, µs (an hour).
const LATENCY_US_MAX: u64 = 3_600_000_000;
/// `statfs(2)` magic number of ramfs (absent from `libc`).
const RAMFS_MAGIC: libc::c_long = 0x8584_58f6;
/// Raft term of every appended entry.
const TERM: u64 = 1;
/// Raft node id of the (pretend) leader that proposed every entry.
const LEADER: u64 = 1;

/// Command-line flags of the storage benchmark.
#[derive(Parser, Debug)]
#[command(name = "ferrolog-bench-store", about = "Throughput and latency of the Ferrolog partition store")]
pub struct Args {
    /// Directory to put the data under (a temporary subdirectory is created
    /// and removed). Default: ./target if present, else the system temp
    /// directory. Must be on a real disk, not tmpfs.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Duration of each scenario, seconds.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Record sizes to test, bytes, comma-separated (each at most 16384).
    #[arg(long, value_delimiter = ',', default_value = "100,1024")]
    pub record_sizes: Vec<usize>,
    /// Partitions of the multi-partition scenario.
    #[arg(long, default_value_t = 100)]
    pub partitions: usize,
    /// Entries in flight in the pipelined scenario.
    #[arg(long, default_value_t = 64)]
    pub window: usize,
    /// Also print one JSON line with every result.
    #[arg(long)]
    pub json: bool,
}

/// Flusher counters over one scenario (differences of [`FlushStats`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct FlushCounts {
    /// Sync rounds run.
    pub rounds: u64,
    /// `fdatasync(2)` calls.
    pub fdatasyncs: u64,
    /// `syncfs(2)` calls.
    pub syncfs: u64,
    /// Flush requests completed.
    pub requests: u64,
}

impl FlushCounts {
    /// The current values of a flusher's counters.
    fn read(stats: &FlushStats) -> Self {
        Self {
            rounds: stats.rounds.load(Ordering::Relaxed),
            fdatasyncs: stats.fdatasyncs.load(Ordering::Relaxed),
            syncfs: stats.syncfs.load(Ordering::Relaxed),
            requests: stats.requests.load(Ordering::Relaxed),
        }
    }

    /// What happened between `earlier` and `self`.
    fn since(self, earlier: Self) -> Self {
        Self {
            rounds: self.rounds - earlier.rounds,
            fdatasyncs: self.fdatasyncs - earlier.fdatasyncs,
            syncfs: self.syncfs - earlier.syncfs,
            requests: self.requests - earlier.requests,
        }
    }

    /// The counters as JSON.
    fn to_json(self) -> Value {
        json!({"rounds": self.rounds, "fdatasyncs": self.fdatasyncs, "syncfs": self.syncfs,
               "requests": self.requests})
    }
}

/// What one worker (a task, or the raw loop) wrote and how long each write
/// took to become durable.
#[derive(Debug)]
pub struct Tally {
    /// Writes (entries, or raw 16 KiB writes) made durable.
    pub entries: u64,
    /// Records in them.
    pub records: u64,
    /// Bytes of record payload (raw: bytes written).
    pub bytes: u64,
    /// Write-to-durable latency, µs.
    pub latency_us: Histogram<u64>,
    /// Time spent inside the append call itself (raw: inside `write(2)`),
    /// µs: how long the caller, Raft's log IO, is held up per entry.
    pub call_us: Histogram<u64>,
}

impl Tally {
    /// An empty tally.
    fn new() -> Result<Self> {
        let latency_us = Histogram::new_with_bounds(1, LATENCY_US_MAX, 3).context("latency histogram")?;
        let call_us = Histogram::new_with_bounds(1, LATENCY_US_MAX, 3).context("call histogram")?;
        Ok(Self { entries: 0, records: 0, bytes: 0, latency_us, call_us })
    }

    /// Records the duration of one append (or write) call started at `started`.
    fn record_call(&mut self, started: Instant) {
        self.call_us.saturating_record(micros_since(started));
    }

    /// Counts one durable write of `records` records, `bytes` bytes, that
    /// was started at `started`.
    fn record(&mut self, started: Instant, records: u64, bytes: u64) {
        self.latency_us.saturating_record(micros_since(started));
        self.entries += 1;
        self.records += records;
        self.bytes += bytes;
    }

    /// Adds another worker's tally to this one.
    fn merge(&mut self, other: &Self) -> Result<()> {
        self.entries += other.entries;
        self.records += other.records;
        self.bytes += other.bytes;
        self.latency_us.add(&other.latency_us).context("merge latency histograms")?;
        self.call_us.add(&other.call_us).context("merge call histograms")
    }
}

/// Microseconds elapsed since `started`, at least 1.
fn micros_since(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX).max(1)
}

/// The result of one timed write scenario.
#[derive(Debug)]
pub struct WriteResult {
    /// What was written, with latencies.
    pub tally: Tally,
    /// Wall time from the first write to the last flush.
    pub elapsed: Duration,
    /// Flusher counters over the scenario (`None` for the raw disk).
    pub flush: Option<FlushCounts>,
}

impl WriteResult {
    /// Entries (or raw writes) per second.
    fn entries_per_s(&self) -> f64 {
        self.tally.entries as f64 / self.elapsed.as_secs_f64()
    }

    /// Records per second.
    fn records_per_s(&self) -> f64 {
        self.tally.records as f64 / self.elapsed.as_secs_f64()
    }

    /// Megabytes of payload per second.
    fn mb_per_s(&self) -> f64 {
        self.tally.bytes as f64 / BYTES_PER_MB / self.elapsed.as_secs_f64()
    }

    /// Latency at quantile `q`, milliseconds.
    fn latency_ms(&self, q: f64) -> f64 {
        self.tally.latency_us.value_at_quantile(q) as f64 / 1000.0
    }

    /// Duration of the append call at quantile `q`, microseconds.
    fn call_us(&self, q: f64) -> u64 {
        self.tally.call_us.value_at_quantile(q)
    }

    /// The result as JSON.
    fn to_json(&self) -> Value {
        json!({
            "entries": self.tally.entries,
            "seconds": self.elapsed.as_secs_f64(),
            "entries_per_s": self.entries_per_s(),
            "records_per_s": self.records_per_s(),
            "mb_per_s": self.mb_per_s(),
            "p50_ms": self.latency_ms(0.5),
            "p99_ms": self.latency_ms(0.99),
            "call_p50_us": self.call_us(0.5),
            "call_p99_us": self.call_us(0.99),
            "flusher": self.flush.map(FlushCounts::to_json),
        })
    }
}

/// The result of the read scenario.
#[derive(Debug)]
pub struct ReadResult {
    /// Time to reopen the log (recovery scan of the active segment).
    pub open: Duration,
    /// Segment files of the log.
    pub segments: usize,
    /// Bytes of frames in one pass over the log.
    pub log_bytes: u64,
    /// Full passes made.
    pub passes: u64,
    /// `PartitionLog::read` calls made.
    pub reads: u64,
    /// Bytes of frames returned, over all passes.
    pub bytes: u64,
    /// Places per pass where a read skipped offsets (a store bug if > 0).
    pub gaps: u64,
    /// Offsets per pass a consumer never received because of those gaps.
    pub skipped_offsets: u64,
    /// Wall time of all passes.
    pub elapsed: Duration,
}

impl ReadResult {
    /// Megabytes of frames read per second.
    fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / BYTES_PER_MB / self.elapsed.as_secs_f64()
    }

    /// Megabytes per second of the recovery scan done by the reopen.
    fn open_mb_per_s(&self) -> f64 {
        self.log_bytes as f64 / BYTES_PER_MB / self.open.as_secs_f64()
    }

    /// The result as JSON.
    fn to_json(&self) -> Value {
        json!({
            "log_bytes": self.log_bytes,
            "segments": self.segments,
            "gaps": self.gaps,
            "skipped_offsets": self.skipped_offsets,
            "passes": self.passes,
            "reads": self.reads,
            "seconds": self.elapsed.as_secs_f64(),
            "mb_per_s": self.mb_per_s(),
            "reopen_seconds": self.open.as_secs_f64(),
            "reopen_mb_per_s": self.open_mb_per_s(),
        })
    }
}

/// Every result for one record size.
#[derive(Debug)]
pub struct SizeResults {
    /// Bytes per record.
    pub record_bytes: usize,
    /// Records per batch (entry).
    pub records_per_batch: u32,
    /// Raw disk: 16 KiB write + fdatasync, one at a time.
    pub raw: WriteResult,
    /// Scenario 1: one partition, one entry in flight.
    pub single: WriteResult,
    /// Scenario 2: one partition, a window of entries in flight.
    pub pipelined: WriteResult,
    /// Scenario 3: many partitions, one in flight each, one flusher.
    pub partitions: WriteResult,
    /// Scenario 4: reading scenario 2's log back.
    pub read: ReadResult,
}

impl SizeResults {
    /// The results as JSON.
    fn to_json(&self) -> Value {
        let raw = self.raw.mb_per_s();
        json!({
            "record_bytes": self.record_bytes,
            "records_per_batch": self.records_per_batch,
            "raw": self.raw.to_json(),
            "single": self.single.to_json(),
            "pipelined": self.pipelined.to_json(),
            "partitions": self.partitions.to_json(),
            "read": self.read.to_json(),
            "single_vs_raw": self.single.mb_per_s() / raw,
            "pipelined_vs_raw": self.pipelined.mb_per_s() / raw,
            "partitions_vs_raw": self.partitions.mb_per_s() / raw,
            "partitions_vs_single": self.partitions.mb_per_s() / self.single.mb_per_s(),
        })
    }
}

/// The benchmark's settings, derived from [`Args`].
#[derive(Debug)]
struct Plan {
    duration: Duration,
    partitions: usize,
    window: usize,
}

/// Parses the flags, runs every scenario for every record size and prints
/// the results.
#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    validate(&args)?;
    let root = data_root(args.dir.as_deref())?;
    let plan = Plan {
        duration: Duration::from_secs(args.seconds),
        partitions: args.partitions,
        window: args.window,
    };
    print_preamble(root.path(), &plan)?;
    let mut all = Vec::new();
    for (i, &record_bytes) in args.record_sizes.iter().enumerate() {
        let dir = root.path().join(format!("{i}-rec{record_bytes}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let results = bench_record_size(&dir, record_bytes, &plan).await?;
        print_table(&results, &plan);
        all.push(results);
    }
    print_summary(&all);
    if args.json {
        print_json(root.path(), &plan, &all);
    }
    Ok(())
}

/// Rejects flag values the benchmark cannot run with.
fn validate(args: &Args) -> Result<()> {
    ensure!(args.seconds > 0, "--seconds must be > 0");
    ensure!(args.partitions > 0, "--partitions must be > 0");
    ensure!(args.window > 0, "--window must be > 0");
    ensure!(!args.record_sizes.is_empty(), "--record-sizes is empty");
    for &s in &args.record_sizes {
        ensure!((1..=BATCH_BYTES).contains(&s), "record size {s} is outside 1..={BATCH_BYTES}");
    }
    Ok(())
}

/// Creates the temporary data directory, on a real disk.
fn data_root(dir: Option<&Path>) -> Result<tempfile::TempDir> {
    let base = match dir {
        Some(d) => d.to_owned(),
        None => {
            let target = std::env::current_dir().context("current directory")?.join("target");
            if target.is_dir() { target } else { std::env::temp_dir() }
        }
    };
    std::fs::create_dir_all(&base).with_context(|| format!("create {}", base.display()))?;
    ensure_real_disk(&base)?;
    tempfile::Builder::new()
        .prefix("ferrolog-bench-store.")
        .tempdir_in(&base)
        .with_context(|| format!("create a temporary directory in {}", base.display()))
}

/// Fails if `dir` is on tmpfs or ramfs, where fsync costs nothing.
fn ensure_real_disk(dir: &Path) -> Result<()> {
    let c_path = CString::new(dir.as_os_str().as_bytes()).context("directory path has a NUL byte")?;
    // SAFETY: an all-zero `statfs` is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated and outlives the call; `st` is a
    // valid, writable `statfs`.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("statfs {}", dir.display()));
    }
    if st.f_type == libc::TMPFS_MAGIC || st.f_type == RAMFS_MAGIC {
        bail!(
            "{} is on tmpfs/ramfs, which measures memory, not disk; pass --dir on a real disk",
            dir.display()
        );
    }
    Ok(())
}

/// Runs every scenario for one record size, in `dir`.
async fn bench_record_size(dir: &Path, record_bytes: usize, plan: &Plan) -> Result<SizeResults> {
    let batch = make_batch(record_bytes)?;
    let raw = bench_raw(dir.join("raw.dat"), plan.duration).await?;
    let single = bench_single(&dir.join("single"), &batch, plan.duration).await?;
    let pipelined_dir = dir.join("pipelined");
    let pipelined = bench_pipelined(&pipelined_dir, &batch, plan.window, plan.duration).await?;
    let partitions =
        bench_partitions(&dir.join("partitions"), &batch, plan.partitions, plan.duration).await?;
    let duration = plan.duration;
    let read = tokio::task::spawn_blocking(move || bench_read(&pipelined_dir, duration))
        .await
        .context("read benchmark task")??;
    Ok(SizeResults {
        record_bytes,
        records_per_batch: batch.record_count,
        raw,
        single,
        pipelined,
        partitions,
        read,
    })
}

/// A record batch of `BATCH_BYTES / record_bytes` records of incompressible
/// bytes, timestamped now. Every entry of a run carries (a clone of) it.
fn make_batch(record_bytes: usize) -> Result<RecordBatch> {
    let record_count = BATCH_BYTES / record_bytes;
    let now_ms = i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis())?;
    Ok(RecordBatch {
        record_count: u32::try_from(record_count)?,
        first_timestamp_ms: now_ms,
        max_timestamp_ms: now_ms,
        producer_id: NO_PRODUCER_ID,
        producer_epoch: 0,
        base_sequence: 0,
        records: pseudo_random_bytes(record_count * record_bytes),
    })
}

/// `len` bytes of xorshift output, so nothing along the way can compress them.
fn pseudo_random_bytes(len: usize) -> Bytes {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    Bytes::from(out)
}

/// Scenario 0: sequential 16 KiB writes + fdatasync each to a new file at
/// `path`, for `duration`, on a blocking thread.
async fn bench_raw(path: PathBuf, duration: Duration) -> Result<WriteResult> {
    tokio::task::spawn_blocking(move || raw_write_loop(&path, duration))
        .await
        .context("raw benchmark task")?
}

/// The raw disk loop: write 16 KiB at the end of the file, fdatasync, repeat.
fn raw_write_loop(path: &Path, duration: Duration) -> Result<WriteResult> {
    let mut file = create_new_file(path)?;
    let block = pseudo_random_bytes(BATCH_BYTES);
    let mut tally = Tally::new()?;
    let start = Instant::now();
    let deadline = start + duration;
    while Instant::now() < deadline {
        let t = Instant::now();
        file.write_all(&block).with_context(|| format!("write {}", path.display()))?;
        tally.record_call(t);
        file.sync_data().with_context(|| format!("fdatasync {}", path.display()))?;
        tally.record(t, 0, BATCH_BYTES as u64);
    }
    Ok(WriteResult { tally, elapsed: start.elapsed(), flush: None })
}

/// Creates `path` (which must not exist) and fsyncs its directory, so the
/// timed loop only pays for data and size updates, as the store does.
fn create_new_file(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    let parent = path.parent().unwrap_or(Path::new("."));
    File::open(parent).and_then(|d| d.sync_all()).with_context(|| format!("fsync {}", parent.display()))?;
    Ok(file)
}

/// Store settings of every replica: the defaults, with `flush = always`.
fn store_config() -> StoreConfig {
    StoreConfig { flush: FlushPolicy::Always, ..StoreConfig::default() }
}

/// Opens (creates) a replica in `dir` using `flusher`.
fn open_replica(dir: &Path, flusher: &Flusher) -> Result<Replica> {
    Replica::open(dir, store_config(), flusher.clone())
        .with_context(|| format!("open replica {}", dir.display()))
}

/// Spawns a flusher for one scenario's data directory.
fn spawn_flusher(dir: &Path) -> Result<Flusher> {
    Flusher::spawn(&dir.display().to_string()).with_context(|| format!("spawn flusher for {}", dir.display()))
}

/// Receives the result of one append's `IOFlushed` callback.
type FlushedRx = oneshot::Receiver<io::Result<()>>;

/// Appends the entry with Raft index `index` carrying `batch`, returning
/// the receiver that resolves once it is durable.
async fn append_entry(log_store: &mut LogStore, index: u64, batch: &RecordBatch) -> Result<FlushedRx> {
    let entry = Entry { log_id: log_id(TERM, LEADER, index), payload: EntryPayload::Normal(batch.clone()) };
    let (tx, rx) = TypeConfig::oneshot::<io::Result<()>>();
    RaftLogStorage::append(log_store, vec![entry], IOFlushed::signal(tx))
        .await
        .with_context(|| format!("append entry {index}"))?;
    Ok(rx)
}

/// Waits for one append's flush callback and returns its result.
async fn wait_flushed(rx: FlushedRx) -> Result<()> {
    rx.await.context("flush callback dropped")?.context("flush failed")
}

/// Appends entries one at a time, each waiting for its flush, until
/// `deadline`. Indexes start at 1.
async fn one_in_flight(mut log_store: LogStore, batch: RecordBatch, deadline: Instant) -> Result<Tally> {
    let mut tally = Tally::new()?;
    let (records, bytes) = (u64::from(batch.record_count), batch.records.len() as u64);
    let mut index = 1;
    while Instant::now() < deadline {
        let t = Instant::now();
        let rx = append_entry(&mut log_store, index, &batch).await?;
        tally.record_call(t);
        wait_flushed(rx).await?;
        tally.record(t, records, bytes);
        index += 1;
    }
    Ok(tally)
}

/// Scenario 1: one partition, one entry in flight.
async fn bench_single(dir: &Path, batch: &RecordBatch, duration: Duration) -> Result<WriteResult> {
    let flusher = spawn_flusher(dir)?;
    let replica = open_replica(dir, &flusher)?;
    let before = FlushCounts::read(flusher.stats());
    let start = Instant::now();
    let tally = one_in_flight(replica.log_store(), batch.clone(), start + duration).await?;
    let elapsed = start.elapsed();
    let flush = Some(FlushCounts::read(flusher.stats()).since(before));
    Ok(WriteResult { tally, elapsed, flush })
}

/// Scenario 2: one partition, up to `window` entries in flight.
async fn bench_pipelined(
    dir: &Path,
    batch: &RecordBatch,
    window: usize,
    duration: Duration,
) -> Result<WriteResult> {
    let flusher = spawn_flusher(dir)?;
    let replica = open_replica(dir, &flusher)?;
    let before = FlushCounts::read(flusher.stats());
    let start = Instant::now();
    let tally = windowed(replica.log_store(), batch, window, start + duration).await?;
    let elapsed = start.elapsed();
    let flush = Some(FlushCounts::read(flusher.stats()).since(before));
    Ok(WriteResult { tally, elapsed, flush })
}

/// Keeps up to `window` appends in flight until `deadline`, then drains.
/// The flusher completes requests in order, so the oldest is awaited and
/// every younger one already completed is collected with it.
async fn windowed(
    mut log_store: LogStore,
    batch: &RecordBatch,
    window: usize,
    deadline: Instant,
) -> Result<Tally> {
    let mut tally = Tally::new()?;
    let (records, bytes) = (u64::from(batch.record_count), batch.records.len() as u64);
    let mut in_flight: VecDeque<(Instant, FlushedRx)> = VecDeque::with_capacity(window);
    let mut index = 1;
    loop {
        while in_flight.len() < window && Instant::now() < deadline {
            let t = Instant::now();
            in_flight.push_back((t, append_entry(&mut log_store, index, batch).await?));
            tally.record_call(t);
            index += 1;
        }
        let Some((t, rx)) = in_flight.pop_front() else { break };
        wait_flushed(rx).await?;
        tally.record(t, records, bytes);
        collect_completed(&mut in_flight, &mut tally, records, bytes)?;
    }
    Ok(tally)
}

/// Records and removes the oldest in-flight appends that are already durable.
fn collect_completed(
    in_flight: &mut VecDeque<(Instant, FlushedRx)>,
    tally: &mut Tally,
    records: u64,
    bytes: u64,
) -> Result<()> {
    while let Some((t, rx)) = in_flight.front_mut() {
        match rx.try_recv() {
            Ok(result) => {
                result.context("flush failed")?;
                tally.record(*t, records, bytes);
                in_flight.pop_front();
            }
            Err(oneshot::error::TryRecvError::Empty) => break,
            Err(oneshot::error::TryRecvError::Closed) => bail!("flush callback dropped"),
        }
    }
    Ok(())
}

/// Scenario 3: `partitions` replicas under `dir` sharing one flusher, each
/// driven by its own task with one entry in flight.
async fn bench_partitions(
    dir: &Path,
    batch: &RecordBatch,
    partitions: usize,
    duration: Duration,
) -> Result<WriteResult> {
    let flusher = spawn_flusher(dir)?;
    let replicas = (0..partitions)
        .map(|p| open_replica(&dir.join(format!("p{p:04}")), &flusher))
        .collect::<Result<Vec<_>>>()?;
    let before = FlushCounts::read(flusher.stats());
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = replicas
        .iter()
        .map(|r| tokio::spawn(one_in_flight(r.log_store(), batch.clone(), deadline)))
        .collect();
    let mut tally = Tally::new()?;
    for task in tasks {
        tally.merge(&task.await.context("partition task")??)?;
    }
    let elapsed = start.elapsed();
    let flush = Some(FlushCounts::read(flusher.stats()).since(before));
    Ok(WriteResult { tally, elapsed, flush })
}

/// Scenario 4: reopens the log of the replica in `replica_dir` (closed by
/// now) and reads it front to back with 1 MiB fetches, in passes, until
/// `duration` has elapsed (one pass at least). Checks that the batches
/// come back contiguous and complete.
fn bench_read(replica_dir: &Path, duration: Duration) -> Result<ReadResult> {
    let log_dir = replica_dir.join(ferrolog_raft_store::replica::LOG_DIR);
    let flusher = spawn_flusher(&log_dir)?;
    let t = Instant::now();
    let log = Replica::open_log(replica_dir, store_config(), flusher)
        .with_context(|| format!("open log {}", log_dir.display()))?;
    let open = t.elapsed();
    let mut result = ReadResult {
        open,
        segments: log.segment_count(),
        log_bytes: 0,
        passes: 0,
        reads: 0,
        bytes: 0,
        gaps: 0,
        skipped_offsets: 0,
        elapsed: Duration::ZERO,
    };
    let start = Instant::now();
    while result.passes == 0 || start.elapsed() < duration {
        let pass = read_pass(&log)?;
        result.log_bytes = pass.bytes;
        result.reads += pass.reads;
        result.bytes += pass.bytes;
        result.gaps = pass.gaps;
        result.skipped_offsets = pass.skipped_offsets;
        result.passes += 1;
    }
    result.elapsed = start.elapsed();
    Ok(result)
}

/// What one pass over a log read.
#[derive(Debug, Default)]
struct ReadPass {
    /// `PartitionLog::read` calls.
    reads: u64,
    /// Bytes of frames returned.
    bytes: u64,
    /// Places where a read returned a batch past the next expected offset.
    gaps: u64,
    /// Offsets never returned because of those gaps.
    skipped_offsets: u64,
}

/// Reads every batch of `log` once, as a consumer would: each fetch starts
/// at the offset after the last batch received. Batches must come back in
/// order; a batch *after* the expected offset is counted as a gap (the
/// consumer would never see the offsets in between) and reading goes on
/// from it, one *before* it is an error.
fn read_pass(log: &PartitionLog) -> Result<ReadPass> {
    let end = log.log_end_offset();
    let mut offset = log.log_start_offset();
    let mut pass = ReadPass::default();
    while offset < end {
        let batches =
            log.read(offset, READ_MAX_BYTES, u64::MAX).with_context(|| format!("read at offset {offset}"))?;
        pass.reads += 1;
        ensure!(!batches.is_empty(), "read at offset {offset} returned nothing before the end {end}");
        for b in &batches {
            let base = b.header.base_offset;
            ensure!(base >= offset, "read returned batch at {base} where {offset} was next (backwards)");
            if base > offset {
                pass.gaps += 1;
                pass.skipped_offsets += base - offset;
            }
            offset = b.header.next_offset();
            pass.bytes += b.frame.len() as u64;
        }
    }
    Ok(pass)
}

/// Prints where the data goes and what will run.
fn print_preamble(root: &Path, plan: &Plan) -> Result<()> {
    let cpus = std::thread::available_parallelism().map(usize::from).unwrap_or(1);
    println!("ferrolog-bench-store: data in {} ({} CPUs)", root.display(), cpus);
    println!(
        "each scenario {} s; batch = 1 Raft entry = {} B of records; flush=always; MB = 10^6 B of record payload",
        plan.duration.as_secs(),
        BATCH_BYTES
    );
    println!("latency = append call to IOFlushed callback (raw: write + fdatasync)");
    println!("call = time inside the append call (raw: inside write)");
    io::stdout().flush().context("flush stdout")
}

/// Prints the table of one record size.
fn print_table(r: &SizeResults, plan: &Plan) {
    let raw = r.raw.mb_per_s();
    println!();
    println!(
        "== records of {} B: {} records/batch, {} B/batch ==",
        r.record_bytes,
        r.records_per_batch,
        r.records_per_batch as usize * r.record_bytes
    );
    println!(
        "{:<38} {:>10} {:>11} {:>8} {:>8} {:>8} {:>7} {:>7} {:>9} {:>7} {:>13}",
        "scenario",
        "entries/s",
        "records/s",
        "MB/s",
        "p50 ms",
        "p99 ms",
        "vs raw",
        "rounds",
        "fdatasync",
        "syncfs",
        "call p50/p99"
    );
    print_row("raw 16 KiB write+fdatasync", &r.raw, raw);
    print_row("1 partition, 1 in flight", &r.single, raw);
    print_row(&format!("1 partition, window {}", plan.window), &r.pipelined, raw);
    print_row(&format!("{} partitions, 1 in flight each", plan.partitions), &r.partitions, raw);
    print_read_row(&r.read);
}

/// Prints the row of the read scenario, and a warning if reads skipped data.
fn print_read_row(r: &ReadResult) {
    println!(
        "{:<38} {:>10} {:>11} {:>8.1}   ({} passes over {:.1} MB in {} segments, {} reads; reopen {:.3} s = {:.0} MB/s)",
        "read scenario-2 log, 1 MiB fetches",
        "",
        "",
        r.mb_per_s(),
        r.passes,
        r.log_bytes as f64 / BYTES_PER_MB,
        r.segments,
        r.reads,
        r.open.as_secs_f64(),
        r.open_mb_per_s()
    );
    if r.gaps > 0 {
        println!(
            "WARNING: PartitionLog::read skipped {} offsets in {} places per pass: a consumer reading \
             from the start would miss them (store bug at segment boundaries)",
            r.skipped_offsets, r.gaps
        );
    }
}

/// Prints one row of a write scenario.
fn print_row(name: &str, w: &WriteResult, raw_mb_per_s: f64) {
    let f = w.flush.unwrap_or_default();
    let (rounds, syncs, syncfs) = match w.flush {
        Some(_) => (f.rounds.to_string(), f.fdatasyncs.to_string(), f.syncfs.to_string()),
        None => ("-".into(), w.tally.entries.to_string(), "-".into()),
    };
    let records = if w.flush.is_some() { format!("{:.0}", w.records_per_s()) } else { "-".into() };
    println!(
        "{:<38} {:>10.0} {:>11} {:>8.1} {:>8.3} {:>8.3} {:>7.2} {:>7} {:>9} {:>7} {:>13}",
        name,
        w.entries_per_s(),
        records,
        w.mb_per_s(),
        w.latency_ms(0.5),
        w.latency_ms(0.99),
        w.mb_per_s() / raw_mb_per_s,
        rounds,
        syncs,
        syncfs,
        format!("{}/{} us", w.call_us(0.5), w.call_us(0.99))
    );
}

/// Prints the targets and whether each record size met them.
fn print_summary(all: &[SizeResults]) {
    println!();
    println!(
        "targets: 1-partition/raw >= 0.80; N-partitions >= 1-partition MB/s; read >= 1000 MB/s with no gaps"
    );
    for r in all {
        let single = r.single.mb_per_s() / r.raw.mb_per_s();
        let multi = r.partitions.mb_per_s() / r.single.mb_per_s();
        let read = r.read.mb_per_s();
        let read_ok = read >= 1000.0 && r.read.gaps == 0;
        println!(
            "{:>5} B records: 1-partition/raw {:.2} [{}]  N-partitions/1-partition {:.2} [{}]  read {:.0} MB/s [{}]",
            r.record_bytes,
            single,
            verdict(single >= 0.8),
            multi,
            verdict(multi >= 1.0),
            read,
            verdict(read_ok)
        );
    }
}

/// "ok" or "MISS".
fn verdict(ok: bool) -> &'static str {
    if ok { "ok" } else { "MISS" }
}

/// Prints every result as one JSON line.
fn print_json(root: &Path, plan: &Plan, all: &[SizeResults]) {
    let line = json!({
        "bench": "ferrolog-bench-store",
        "dir": root.display().to_string(),
        "seconds_per_scenario": plan.duration.as_secs(),
        "batch_bytes": BATCH_BYTES,
        "partitions": plan.partitions,
        "window": plan.window,
        "results": all.iter().map(SizeResults::to_json).collect::<Vec<_>>(),
    });
    println!("{line}");
}

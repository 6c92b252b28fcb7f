//! The benchmark's cluster: three brokers, each this executable running
//! `ferrolog-bench broker`, on 127.0.0.2–4 with data in a temporary
//! directory (or `--data-dir`), flush = always (the default).

use ferrolog_tests::Cluster;

/// Starts a 3-broker cluster for benchmark `name`.
///
/// # Errors
/// If the brokers cannot start or form a cluster.
pub async fn start(name: &str) -> anyhow::Result<Cluster> {
    let exe = std::env::current_exe()?;
    let exe = exe.to_string_lossy().into_owned();
    let env = [("RUST_LOG", "warn")];
    Cluster::start_with(name, &exe, &["broker"], 3, &env).await
}

/// Resident memory of process `pid` (VmRSS of /proc/<pid>/status), bytes.
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Open file descriptors of process `pid` (entries of `/proc/<pid>/fd`).
pub fn open_files(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// CPU time (user + system) process `pid` has used, seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) / ticks)
}

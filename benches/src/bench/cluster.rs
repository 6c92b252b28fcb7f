//! The benchmark's cluster: three brokers, each this executable running
//! `ferrolog-bench broker`, on 127.0.0.2–4 with data in a temporary
//! directory (or `--data-dir`), flush = always (the default).

use ferrolog_tests::Cluster;

/// Starts a 3-broker cluster for benchmark `name`.
///
/// # Errors
/// If the brokers cannot start or form a cluster.
pub async fn start(name: &str) -> anyhow::Result<Cluster> {
    Ok(start_with_dormant(name, None).await?.0)
}

/// As [`start`], with the brokers' `raft.dormant_after_ms` set to
/// `dormant_after_ms` if given (their default otherwise), through a config
/// file returned with the cluster: keep it while the brokers may restart.
///
/// # Errors
/// As [`start`], or a config file that cannot be written.
pub async fn start_with_dormant(
    name: &str,
    dormant_after_ms: Option<u64>,
) -> anyhow::Result<(Cluster, Option<tempfile::TempPath>)> {
    let exe = std::env::current_exe()?;
    let exe = exe.to_string_lossy().into_owned();
    // FERROLOG_BENCH_BROKER_LOG: the brokers' log filter (with
    // FERROLOG_KEEP_DATA=1 to keep their logs); by default the test
    // cluster's (`FERROLOG_TEST_LOG`, else the broker's own: info), whose
    // volume `restart` reports.
    let mut env = Vec::new();
    if let Ok(filter) = std::env::var("FERROLOG_BENCH_BROKER_LOG") {
        env.push(("RUST_LOG".to_owned(), filter));
    }
    let mut config = None;
    if let Some(ms) = dormant_after_ms {
        let file = tempfile::Builder::new().prefix("ferrolog-bench-").suffix(".toml").tempfile()?;
        std::fs::write(file.path(), format!("[raft]\ndormant_after_ms = {ms}\n"))?;
        let path = file.into_temp_path();
        env.push(("FERROLOG_CONFIG".to_owned(), path.to_string_lossy().into_owned()));
        config = Some(path);
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Ok((Cluster::start_with(name, &exe, &["broker"], 3, &env).await?, config))
}

/// A cluster of `n` brokers whose config file holds `config` (TOML), kept
/// with the cluster (return value) while the brokers may restart.
///
/// # Errors
/// As [`start`], or a config file that cannot be written.
pub async fn start_configured(
    name: &str,
    n: u32,
    config: &str,
) -> anyhow::Result<(Cluster, tempfile::TempPath)> {
    let exe = std::env::current_exe()?;
    let exe = exe.to_string_lossy().into_owned();
    let file = tempfile::Builder::new().prefix("ferrolog-bench-").suffix(".toml").tempfile()?;
    std::fs::write(file.path(), config)?;
    let path = file.into_temp_path();
    let mut env = vec![("FERROLOG_CONFIG".to_owned(), path.to_string_lossy().into_owned())];
    if let Ok(filter) = std::env::var("FERROLOG_BENCH_BROKER_LOG") {
        env.push(("RUST_LOG".to_owned(), filter));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Ok((Cluster::start_with(name, &exe, &["broker"], n, &env).await?, path))
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

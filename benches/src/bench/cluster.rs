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

/// CPU time (user + system) a process has used, seconds, from /proc.
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

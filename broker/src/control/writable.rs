//! Whether a data directory can take writes again, before a replica that
//! failed on it is restarted.
//!
//! A replica whose disk filled up (ENOSPC) or turned read-only (EROFS, as
//! ext4 does after an error) stops on the storage error; its group elects a
//! leader among the replicas that can write. Restarting it while the disk
//! is still full would only have it fail again (and, if it won an election
//! first, stall the partition for another election timeout). So the
//! reconciler restarts such a replica only once this probe passes: at least
//! [`RESTART_FREE_BYTES_MIN`] free, and a small file can be written,
//! fsynced and removed. It needs no broker restart: the probe runs on every
//! reconcile pass (each second) while a replica waits.

use std::path::Path;

use ferrolog_raft_store::vfs::{OpenMode, Vfs};

/// Free space a data directory needs before a failed replica on it is
/// started again, bytes (16 MiB: room for the metadata of a replica and
/// some appends; below it a restart would fail again at once).
pub const RESTART_FREE_BYTES_MIN: u64 = 16 << 20;

/// Name of the probe file written in the directory.
const PROBE_FILE: &str = ".ferrolog-write-probe";

/// Checks that `dir` on `fs` has at least [`RESTART_FREE_BYTES_MIN`]
/// available to unprivileged writers (on the operating system's file
/// system: another one has no such count, and shows a full disk by refusing
/// the write) and takes a durable write.
///
/// # Errors
/// A message saying which check failed: too little space (with the bytes
/// available), or the OS error of the write (e.g. read-only file system).
pub fn probe(fs: &dyn Vfs, dir: &Path) -> Result<(), String> {
    if fs.is_os() {
        let st = rustix::fs::statvfs(dir).map_err(|e| format!("statvfs {}: {e}", dir.display()))?;
        let available = st.f_bavail.saturating_mul(st.f_frsize);
        if available < RESTART_FREE_BYTES_MIN {
            return Err(format!(
                "{} has {available} bytes available, below the {RESTART_FREE_BYTES_MIN} needed to restart a replica",
                dir.display()
            ));
        }
    }
    write(fs, dir, PROBE_BYTES).map_err(|e| format!("cannot write to {}: {e}", dir.display()))
}

/// Bytes [`probe`] writes: a block, as a replica's next append would need.
const PROBE_BYTES: usize = 4096;

/// Creates a file of `bytes` zeros in `dir` on `fs`, fsyncs it and removes
/// it (also after a failure): whether the directory takes durable writes
/// now. The broker checks its data directory so at start with 0 bytes (a
/// full disk still lets a broker start and serve what it holds; its
/// replicas then fail on their first append), before [`probe`]'s rules
/// apply to restarts of failed replicas.
///
/// # Errors
/// The file system's error for the create, write or fsync.
pub fn write(fs: &dyn Vfs, dir: &Path, bytes: usize) -> std::io::Result<()> {
    let path = dir.join(PROBE_FILE);
    let written = fs.open(&path, OpenMode::CreateTruncate).and_then(|f| {
        if bytes > 0 {
            f.write_all_at(&vec![0u8; bytes], 0)?;
        }
        f.sync_all()
    });
    let _ = fs.remove_file(&path);
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writable_directory_with_space_passes_and_leaves_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        probe(&ferrolog_raft_store::RealFs, dir.path()).expect("probe");
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 0, "the probe file was left behind");
    }

    #[test]
    fn a_missing_directory_fails_with_its_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let gone = dir.path().join("gone");
        let e = probe(&ferrolog_raft_store::RealFs, &gone).expect_err("probe of a missing directory");
        assert!(e.contains("gone"), "{e}");
    }
}

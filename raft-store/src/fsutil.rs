//! Small file-system helpers: positional reads, durable renames, directory
//! fsync. Every call that can fail returns a [`StoreError`] naming the path.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{Result, StoreError};

/// Reads up to `len` bytes at `position`, fewer only at end of file.
pub fn read_up_to(file: &File, path: &Path, position: u64, len: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut done = 0;
    while done < len {
        match file.read_at(&mut buf[done..], position + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(StoreError::io("read", path, e)),
        }
    }
    buf.truncate(done);
    Ok(buf)
}

/// fsyncs a directory so that entries created, renamed or removed in it are
/// durable (POSIX leaves that to the directory's own fsync).
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| StoreError::io("fsync directory", dir, e))
}

/// Writes `bytes` to `path` atomically and durably: temp file, fsync,
/// rename over `path`, fsync of the directory.
pub fn write_durable(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| StoreError::io("create", &tmp, e))?;
    f.write_all(bytes).map_err(|e| StoreError::io("write", &tmp, e))?;
    f.sync_data().map_err(|e| StoreError::io("fsync", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| StoreError::io("rename", path, e))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Cuts the file at `path` to its first `len` bytes, durably, and returns
/// it opened for reading and writing. A file that other names also link
/// (a snapshot's hard link to a segment) is not cut in place, which would
/// cut theirs too: its first `len` bytes are copied to a new file, fsynced
/// and renamed over `path` (then the directory is fsynced), so the other
/// names keep what they had.
///
/// # Errors
/// [`StoreError::Io`].
pub fn cut_file(path: &Path, len: u64) -> Result<File> {
    use std::os::unix::fs::MetadataExt;
    let open = |p: &Path| {
        OpenOptions::new().read(true).write(true).open(p).map_err(|e| StoreError::io("open", p, e))
    };
    let links = fs::metadata(path).map_err(|e| StoreError::io("stat", path, e))?.nlink();
    if links > 1 {
        let tmp = path.with_extension("cut.tmp");
        crate::snapshot::copy_prefix(path, &tmp, len)?;
        fs::rename(&tmp, path).map_err(|e| StoreError::io("rename", path, e))?;
        sync_dir(path.parent().unwrap_or(Path::new(".")))?;
        return open(path);
    }
    let file = open(path)?;
    file.set_len(len).map_err(|e| StoreError::io("truncate", path, e))?;
    file.sync_data().map_err(|e| StoreError::io("fsync", path, e))?;
    Ok(file)
}

/// Removes a file if it exists.
pub fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io("remove", path, e)),
    }
}

/// Removes a directory and everything in it; a missing one is not an error.
pub fn remove_dir_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io("remove", path, e)),
    }
}

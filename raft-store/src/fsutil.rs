//! Small file-system helpers over the [`Vfs`] seam: whole reads, positional
//! reads, copies, durable writes and renames, directory fsync. Every call
//! that can fail returns a [`StoreError`] naming the path.

use std::path::Path;

use crate::error::{Result, StoreError};
use crate::vfs::{OpenMode, Vfs, VfsFile};

/// Reads up to `len` bytes at `position`, fewer only at end of file (into
/// a buffer that is not zeroed first: [`VfsFile::read_into_spare`]).
pub fn read_up_to(file: &dyn VfsFile, path: &Path, position: u64, len: usize) -> Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(len);
    while buf.len() < len {
        let at = position + buf.len() as u64;
        match file.read_into_spare(&mut buf, at) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(StoreError::io("read", path, e)),
        }
    }
    // Never more than `len` (a Vec<u8>'s capacity is what was asked); kept
    // so that no read can return more than asked.
    buf.truncate(len);
    Ok(buf)
}

/// Reads the whole file at `path`.
///
/// # Errors
/// [`StoreError::Io`], `NotFound` included.
pub fn read(fs: &dyn Vfs, path: &Path) -> Result<Vec<u8>> {
    let f = fs.open(path, OpenMode::Read).map_err(|e| StoreError::io("open", path, e))?;
    let len = f.len().map_err(|e| StoreError::io("stat", path, e))?;
    read_up_to(&*f, path, 0, usize::try_from(len).unwrap_or(usize::MAX))
}

/// Reads the whole file at `path`, or `None` if there is none.
///
/// # Errors
/// [`StoreError::Io`] other than `NotFound`.
pub fn read_if_exists(fs: &dyn Vfs, path: &Path) -> Result<Option<Vec<u8>>> {
    match fs.open(path, OpenMode::Read) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StoreError::io("open", path, e)),
        Ok(f) => {
            let len = f.len().map_err(|e| StoreError::io("stat", path, e))?;
            read_up_to(&*f, path, 0, usize::try_from(len).unwrap_or(usize::MAX)).map(Some)
        }
    }
}

/// Whether `path` exists; an error other than `NotFound` is an error.
///
/// # Errors
/// [`StoreError::Io`].
pub fn exists(fs: &dyn Vfs, path: &Path) -> Result<bool> {
    match fs.metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(StoreError::io("stat", path, e)),
    }
}

/// fsyncs a directory so that entries created, renamed or removed in it are
/// durable (POSIX leaves that to the directory's own fsync).
pub fn sync_dir(fs: &dyn Vfs, dir: &Path) -> Result<()> {
    fs.sync_dir(dir).map_err(|e| StoreError::io("fsync directory", dir, e))
}

/// Creates `dir` and its missing parents, durably: each directory created
/// is fsynced into its parent, so a power cut cannot take away a directory
/// whose files were made durable.
///
/// # Errors
/// [`StoreError::Io`].
pub fn create_dir_durable(fs: &dyn Vfs, dir: &Path) -> Result<()> {
    if exists(fs, dir)? {
        return Ok(());
    }
    let mut missing = vec![dir];
    while let Some(parent) = missing.last().and_then(|d| d.parent()) {
        if parent.as_os_str().is_empty() || exists(fs, parent)? {
            break;
        }
        missing.push(parent);
    }
    fs.create_dir_all(dir).map_err(|e| StoreError::io("create directory", dir, e))?;
    for d in missing.iter().rev() {
        sync_dir(fs, d.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))?;
    }
    Ok(())
}

/// Writes `bytes` to a new file at `path` (replacing one there) and fsyncs
/// it; the name is durable only after the directory's fsync.
///
/// # Errors
/// [`StoreError::Io`].
pub fn write_synced(fs: &dyn Vfs, path: &Path, bytes: &[u8]) -> Result<()> {
    let f = fs.open(path, OpenMode::CreateTruncate).map_err(|e| StoreError::io("create", path, e))?;
    f.write_all_at(bytes, 0).map_err(|e| StoreError::io("write", path, e))?;
    f.sync_data().map_err(|e| StoreError::io("fsync", path, e))
}

/// Writes `bytes` to `path` atomically and durably: temp file, fsync,
/// rename over `path`, fsync of the directory.
///
/// # Errors
/// [`StoreError::Io`].
pub fn write_durable(fs: &dyn Vfs, path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    write_synced(fs, &tmp, bytes)?;
    fs.rename(&tmp, path).map_err(|e| StoreError::io("rename", path, e))?;
    sync_dir(fs, path.parent().unwrap_or(Path::new(".")))
}

/// Copies the first `len` bytes of `src` (all of it for `None`) to a new
/// file `dst`, fsynced (its name is durable after the directory's fsync).
///
/// # Errors
/// [`StoreError::Io`].
pub fn copy_prefix(fs: &dyn Vfs, src: &Path, dst: &Path, len: Option<u64>) -> Result<()> {
    const CHUNK: u64 = 1 << 20;
    let from = fs.open(src, OpenMode::Read).map_err(|e| StoreError::io("open", src, e))?;
    let len = match len {
        Some(l) => l,
        None => from.len().map_err(|e| StoreError::io("stat", src, e))?,
    };
    let to = fs.open(dst, OpenMode::CreateTruncate).map_err(|e| StoreError::io("create", dst, e))?;
    let mut at = 0;
    while at < len {
        let chunk = read_up_to(&*from, src, at, (len - at).min(CHUNK) as usize)?;
        if chunk.is_empty() {
            return Err(StoreError::Invalid(format!("{} ends at {at} bytes, below {len}", src.display())));
        }
        to.write_all_at(&chunk, at).map_err(|e| StoreError::io("write", dst, e))?;
        at += chunk.len() as u64;
    }
    to.sync_data().map_err(|e| StoreError::io("fsync", dst, e))
}

/// Hard-links `src` to `dst`, or where links cannot be made copies it
/// (fsynced). Returns whether it linked.
///
/// # Errors
/// [`StoreError::Io`].
pub fn link_or_copy(fs: &dyn Vfs, src: &Path, dst: &Path) -> Result<bool> {
    if fs.hard_link(src, dst).is_ok() {
        return Ok(true);
    }
    copy_prefix(fs, src, dst, None)?;
    Ok(false)
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
pub fn cut_file(fs: &dyn Vfs, path: &Path, len: u64) -> Result<crate::vfs::FileRef> {
    let open = |p: &Path| fs.open(p, OpenMode::ReadWrite).map_err(|e| StoreError::io("open", p, e));
    let links = fs.metadata(path).map_err(|e| StoreError::io("stat", path, e))?.links;
    if links > 1 {
        let tmp = path.with_extension("cut.tmp");
        copy_prefix(fs, path, &tmp, Some(len))?;
        fs.rename(&tmp, path).map_err(|e| StoreError::io("rename", path, e))?;
        sync_dir(fs, path.parent().unwrap_or(Path::new(".")))?;
        return open(path);
    }
    let file = open(path)?;
    file.set_len(len).map_err(|e| StoreError::io("truncate", path, e))?;
    file.sync_data().map_err(|e| StoreError::io("fsync", path, e))?;
    Ok(file)
}

/// Removes a file if it exists.
pub fn remove_if_exists(fs: &dyn Vfs, path: &Path) -> Result<()> {
    match fs.remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io("remove", path, e)),
    }
}

/// Removes a directory and everything in it; a missing one is not an error.
pub fn remove_dir_if_exists(fs: &dyn Vfs, path: &Path) -> Result<()> {
    match fs.remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io("remove", path, e)),
    }
}

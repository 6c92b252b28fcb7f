//! The file-system seam: every file operation of the store goes through
//! [`Vfs`] and [`VfsFile`], so that tests can run the store on a file
//! system that loses what was not fsynced.
//!
//! ```text
//!  segment, log, snapshot, compaction, meta_db (redb backend), flusher
//!        │
//!        ▼
//!  Fs = Arc<dyn Vfs> ──┬── RealFs:   std::fs and the OS (production)
//!                      └── FaultyFs: in memory; tracks what a completed
//!                          fsync covers; power cuts, torn writes, EIO, ENOSPC
//! ```
//!
//! The operations are the ones the store uses, with POSIX meanings: data
//! written to a file is durable once a `sync_data` of that file completed
//! after the write; a name created, renamed or removed in a directory is
//! durable once that directory was synced (`fsync(2)` of the directory, as
//! POSIX leaves it to). The fault-injecting file system holds the store to
//! exactly that and nothing more (in the spirit of LazyFS, which Jepsen
//! uses, and of raft-engine's file-system env).

mod faulty;
mod real;

use std::fmt::Debug;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

pub use faulty::{Faults, FaultyFs, FaultyMount, FaultyStats, PowerCut};
pub use real::RealFs;

/// A shared handle to a file system.
pub type Fs = Arc<dyn Vfs>;
/// A shared handle to an open file.
pub type FileRef = Arc<dyn VfsFile>;

/// The real file system, as an [`Fs`].
pub fn real() -> Fs {
    Arc::new(RealFs)
}

/// How a file is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// Reading only; the file must exist.
    Read,
    /// Reading and writing; the file must exist.
    ReadWrite,
    /// Reading and writing, created if missing and emptied if present.
    CreateTruncate,
}

/// What [`Vfs::metadata`] tells of a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileMeta {
    /// Length, bytes (0 for a directory).
    pub len: u64,
    /// Whether the path is a directory.
    pub is_dir: bool,
    /// Number of names (hard links) of the file.
    pub links: u64,
    /// Last modification time.
    pub modified: SystemTime,
}

/// The file operations the store uses. Every error is an `io::Error` as
/// the OS would give it (`NotFound`, `AlreadyExists`, EIO, ENOSPC, ...);
/// callers add the path and the operation ([`crate::StoreError::io`]).
pub trait Vfs: Send + Sync + Debug {
    /// Opens `path` as `mode` says.
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<FileRef>;
    /// Length, kind, link count and modification time of `path`.
    fn metadata(&self, path: &Path) -> io::Result<FileMeta>;
    /// Names of the entries of directory `dir`, in no particular order.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Creates `dir` and its missing parents (not durable until each
    /// parent is synced: see [`crate::fsutil::create_dir_durable`]).
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Renames `from` to `to`, replacing a file at `to`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Gives the file at `src` a second name `dst` (`AlreadyExists` if
    /// `dst` exists; `Unsupported` where links cannot be made).
    fn hard_link(&self, src: &Path, dst: &Path) -> io::Result<()>;
    /// Removes the name `path` of a file.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Removes directory `path` and everything under it.
    fn remove_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Makes the entries of directory `dir` durable (`fsync(2)` of it).
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// The absolute, normalised form of existing `path`.
    fn canonicalize(&self, path: &Path) -> io::Result<PathBuf>;
    /// Whether paths name files of the OS itself, so that a library that
    /// opens files on its own (redb) may be handed them.
    fn is_os(&self) -> bool {
        false
    }
    /// Identifies this file system's current incarnation: registries of
    /// open databases key by it (with the path), so that after a simulated
    /// power cut nothing opened before it is handed out again.
    fn incarnation(&self) -> u64;

    /// Whether the store's background work on this file system (the
    /// flusher's sync rounds, the metadata database's writer) runs as tasks
    /// of the tokio runtime that opens it instead of on threads of its own.
    /// Only for a deterministic simulation, which runs everything on one
    /// thread with simulated time; only an in-memory file system, whose
    /// syncs never block, may say yes. Default: no.
    fn background_on_runtime(&self) -> bool {
        false
    }
}

/// An open file.
pub trait VfsFile: Send + Sync + Debug {
    /// Reads at most `buf.len()` bytes at `position`; 0 at end of file.
    fn read_at(&self, buf: &mut [u8], position: u64) -> io::Result<usize>;
    /// Reads at `position` into `buf`'s spare capacity (at most
    /// `buf.capacity() - buf.len()` bytes), appending what was read to
    /// `buf`; returns how many bytes, 0 at end of file. Unlike
    /// [`VfsFile::read_at`], the buffer need not be zeroed first: a 16 MiB
    /// fetch read into a zeroed buffer spent 4.6% of a leader's CPU in
    /// `memset` (`ferrolog-bench contention`). Callers leave spare
    /// capacity (with none, 0 would read as end of file). Default: zeroes
    /// the spare capacity, then `read_at`.
    ///
    /// # Errors
    /// As `read_at`; `buf` is unchanged then.
    fn read_into_spare(&self, buf: &mut Vec<u8>, position: u64) -> io::Result<usize> {
        let start = buf.len();
        buf.resize(buf.capacity(), 0);
        let read = self.read_at(&mut buf[start..], position);
        buf.truncate(start + *read.as_ref().unwrap_or(&0));
        read
    }
    /// Writes all of `buf` at `position`, growing the file if needed.
    fn write_all_at(&self, buf: &[u8], position: u64) -> io::Result<()>;
    /// Cuts or extends (with zeros) the file to `len` bytes.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Current length, bytes.
    fn len(&self) -> io::Result<u64>;
    /// Whether the file is empty.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Makes the file's data and length durable (`fdatasync(2)`). After a
    /// failure the state of unsynced data is unknown and a retry proves
    /// nothing ("fsyncgate"): callers must not report those writes durable.
    fn sync_data(&self) -> io::Result<()>;
    /// As `sync_data`, and the file's metadata too (its modification
    /// time): `fsync(2)`.
    fn sync_all(&self) -> io::Result<()> {
        self.sync_data()
    }
    /// Makes everything written on this file's file system durable
    /// (`syncfs(2)`); one call instead of many `sync_data`. Only where
    /// [`VfsFile::syncfs_domain`] says it does.
    fn sync_file_system(&self) -> io::Result<()>;
    /// Which file system a [`VfsFile::sync_file_system`] of this file makes
    /// durable (files with equal values share one), or `None` where it is
    /// not known to make anything durable: then each file must be synced
    /// on its own. `syncfs(2)` writes back the page cache and asks the
    /// file system to commit; a FUSE file system never hears of it (Linux
    /// sends `FUSE_SYNCFS` to virtiofs only) and returns success with the
    /// data nowhere safe, a network file system may do as little, and
    /// before Linux 5.8 `syncfs` reported no writeback error at all.
    /// Default: `None`.
    fn syncfs_domain(&self) -> Option<u64> {
        None
    }
    /// Sets the file's modification time.
    fn set_modified(&self, time: SystemTime) -> io::Result<()>;
    /// Tells the OS that the file's cached pages in `[offset, offset +
    /// len)` (bytes) will not be read soon (`posix_fadvise(2)`
    /// `POSIX_FADV_DONTNEED`): clean pages the range covers whole, and
    /// nobody maps or holds, leave the page cache; writeback of dirty ones
    /// starts and they stay. Afterwards a read returns what the disk holds,
    /// which is what was written only where a sync that succeeded covered
    /// it (after a failed fsync, pages the disk never got may be clean): so
    /// callers drop only bytes a successful sync made durable, on a file
    /// whose syncs never failed ([`crate::flusher::CacheDrop`]). Default
    /// (file systems without a page cache): nothing.
    ///
    /// # Errors
    /// As the OS reports them (EBADF, EINVAL); callers may ignore them.
    fn drop_cached(&self, offset: u64, len: u64) -> io::Result<()> {
        let _ = (offset, len);
        Ok(())
    }
}

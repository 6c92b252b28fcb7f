//! The real file system: `std::fs` and, for `syncfs(2)` and
//! `posix_fadvise(2)`, libc.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use super::{FileMeta, FileRef, OpenMode, Vfs, VfsFile};

/// The operating system's file system.
#[derive(Clone, Copy, Debug, Default)]
pub struct RealFs;

impl Vfs for RealFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<FileRef> {
        let mut o = OpenOptions::new();
        match mode {
            OpenMode::Read => o.read(true),
            OpenMode::ReadWrite => o.read(true).write(true),
            OpenMode::CreateTruncate => o.read(true).write(true).create(true).truncate(true),
        };
        let file = o.open(path)?;
        let syncfs_domain = syncfs_domain(&file);
        Ok(Arc::new(RealFile { file, syncfs_domain }))
    }

    fn metadata(&self, path: &Path) -> io::Result<FileMeta> {
        let m = fs::metadata(path)?;
        Ok(FileMeta { len: m.len(), is_dir: m.is_dir(), links: m.nlink(), modified: m.modified()? })
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        fs::read_dir(dir)?.map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned())).collect()
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn hard_link(&self, src: &Path, dst: &Path) -> io::Result<()> {
        fs::hard_link(src, dst)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        fs::remove_dir_all(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn canonicalize(&self, path: &Path) -> io::Result<PathBuf> {
        fs::canonicalize(path)
    }

    fn is_os(&self) -> bool {
        true
    }

    fn incarnation(&self) -> u64 {
        0
    }
}

/// Local block file systems whose `syncfs(2)` writes back every file's
/// data and commits it to the disk (`statfs(2)`'s `f_type`, from
/// `linux/magic.h`): ext2/3/4, XFS, Btrfs, F2FS, and tmpfs (where nothing
/// survives a power cut either way). Any other (FUSE, NFS, overlays,
/// unknown) gets one `fdatasync(2)` per file. Unlike `fdatasync`, `syncfs`
/// reports a writeback error only once per open file (and only since Linux
/// 5.8): the flusher stops using it after any failed round.
const SYNCFS_DURABLE_MAGICS: [u32; 5] = [0xEF53, 0x5846_5342, 0x9123_683E, 0xF2F5_2010, 0x0102_1994];

/// Whether this kernel's `syncfs(2)` reports writeback errors: Linux 5.8
/// and later (before, it returned 0 whatever writeback did).
static SYNCFS_REPORTS_ERRORS: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().ok());
    matches!((parts.next().flatten(), parts.next().flatten()), (Some(major), Some(minor)) if (major, minor) >= (5, 8))
});

/// The device of `file`'s file system if its `syncfs(2)` is known to make
/// its data durable and to report failures (see [`VfsFile::syncfs_domain`]).
fn syncfs_domain(file: &File) -> Option<u64> {
    if !*SYNCFS_REPORTS_ERRORS {
        return None;
    }
    let st = rustix::fs::fstatfs(file).ok()?;
    // Magic numbers are 32 bits; `f_type` is wider and signed on some
    // architectures, where a sign-extended value would not compare equal.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let magic = st.f_type as u32;
    if !SYNCFS_DURABLE_MAGICS.contains(&magic) {
        return None;
    }
    Some(file.metadata().ok()?.dev())
}

/// A file of the OS.
#[derive(Debug)]
struct RealFile {
    file: File,
    /// See [`VfsFile::syncfs_domain`]; found at open.
    syncfs_domain: Option<u64>,
}

impl VfsFile for RealFile {
    fn read_at(&self, buf: &mut [u8], position: u64) -> io::Result<usize> {
        self.file.read_at(buf, position)
    }

    fn read_into_spare(&self, buf: &mut Vec<u8>, position: u64) -> io::Result<usize> {
        Ok(rustix::io::pread(&self.file, rustix::buffer::spare_capacity(buf), position)?)
    }

    fn write_all_at(&self, buf: &[u8], position: u64) -> io::Result<()> {
        self.file.write_all_at(buf, position)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn sync_all(&self) -> io::Result<()> {
        self.file.sync_all()
    }

    fn sync_file_system(&self) -> io::Result<()> {
        // SAFETY: the descriptor is valid for the call (self owns the
        // file); syncfs only reads it. Since Linux 5.8, syncfs reports
        // writeback errors of the file system, once per open file.
        let rc = unsafe { libc::syncfs(self.file.as_raw_fd()) };
        if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
    }

    fn syncfs_domain(&self) -> Option<u64> {
        self.syncfs_domain
    }

    fn set_modified(&self, time: SystemTime) -> io::Result<()> {
        self.file.set_modified(time)
    }

    fn drop_cached(&self, offset: u64, len: u64) -> io::Result<()> {
        // For posix_fadvise a length of 0 means "to the end of the file".
        if len == 0 {
            return Ok(());
        }
        let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        // SAFETY: the descriptor is valid for the call (self owns the
        // file); the advice only affects the page cache.
        let rc =
            unsafe { libc::posix_fadvise(self.file.as_raw_fd(), offset, len, libc::POSIX_FADV_DONTNEED) };
        // posix_fadvise returns the error number instead of setting errno.
        if rc == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(rc)) }
    }
}

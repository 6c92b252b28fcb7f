//! A disk for real broker processes that keeps only what fsync covered:
//! the store's in-memory fault-injecting file system
//! ([`ferrolog_raft_store::vfs::FaultyFs`]) served over FUSE at a broker's
//! data directory, by a thread of the test process.
//!
//! A SIGKILL leaves everything a process wrote in the page cache, so a
//! broker that never called fsync passes every SIGKILL test (issue 15).
//! Here the test kills a broker and then cuts the power of its disk
//! ([`FuseDisk::power_cut`]): every write and directory entry that no
//! completed `fdatasync`/`fsync` of the file (or of the directory) covered
//! is gone, as after a real power loss, optionally with the next write
//! torn at a random byte. The same disk injects EIO on fsync, write or
//! read, ENOSPC, and a disk whose fsync lies ([`FuseDisk::set_faults`]).
//! In the spirit of LazyFS (a FUSE file system that Jepsen uses to lose
//! unsynced data), with the store's own durability model, so both
//! kinds of tests hold the store to one definition of "durable".
//!
//! ```text
//!  broker process ── syscalls ──▶ kernel FUSE ──▶ /dev/fuse ──▶ Server (thread of the test)
//!                                                                 │ inode ↔ path table
//!                                                                 ▼
//!                                                     FaultyMount ─▶ FaultyFs (memory)
//! ```
//!
//! Files are opened `FOPEN_DIRECT_IO` and entries and attributes are not
//! cached (TTL 0), so no page cache of the kernel stands between a process
//! and the model: what a process reads after a power cut is what the model
//! kept. Mounting needs root (as this project's test machines and CI run)
//! and `/dev/fuse`; `syncfs(2)` on a FUSE mount does not reach the server
//! (the kernel sends `FUSE_SYNCFS` only to virtiofs), as on any FUSE file
//! system a broker might be given.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use ferrolog_raft_store::vfs::{
    Faults, FaultyFs, FaultyMount, FaultyStats, FileMeta, FileRef, OpenMode, PowerCut, Vfs,
};
use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, LockOwner, MountOption, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request,
    TimeOrNow, WriteFlags,
};

/// Nothing the kernel learns of a name or a file is cached: after a power
/// cut it asks again.
const TTL: Duration = Duration::ZERO;
/// What `statfs` reports: 4 KiB blocks and their number (16 GiB), free.
const BLOCK_BYTES: u32 = 4096;
const BLOCKS: u64 = 1 << 22;

/// One mounted in-memory disk. Dropping it unmounts it: stop the
/// processes using it first.
pub struct FuseDisk {
    fs: FaultyFs,
    table: Arc<Mutex<Table>>,
    dir: PathBuf,
    session: Option<BackgroundSession>,
}

impl std::fmt::Debug for FuseDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseDisk").field("dir", &self.dir).field("stats", &self.fs.stats()).finish()
    }
}

impl FuseDisk {
    /// Mounts an empty disk at `dir` (created if missing); `seed` drives
    /// where torn power cuts tear.
    ///
    /// # Errors
    /// If `dir` cannot be made or the mount fails (no `/dev/fuse`, not
    /// root): the message says so.
    pub fn mount(dir: &Path, seed: u64) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let fs = FaultyFs::new(seed);
        let table = Arc::new(Mutex::new(Table::new(fs.mount())));
        let server = Server { table: table.clone() };
        let mut config = Config::default();
        config.mount_options = vec![MountOption::FSName("ferrolog-faulty".into()), MountOption::NoAtime];
        config.n_threads = Some(1);
        let session = fuser::spawn_mount(server, dir, &config).with_context(|| {
            format!("mounting the fault-injecting disk at {} needs root and /dev/fuse", dir.display())
        })?;
        Ok(Self { fs, table, dir: dir.to_owned(), session: Some(session) })
    }

    /// Cuts the power: every write and directory entry no completed fsync
    /// covered is lost (see [`FaultyFs::power_cut`]). Kill the processes
    /// using the disk first: their open files fail from now on.
    pub fn power_cut(&self, how: PowerCut) {
        let mut t = self.table();
        self.fs.power_cut(how);
        t.mount = self.fs.mount();
        t.handles.clear();
    }

    /// Replaces the injected faults (EIO, ENOSPC, a lying fsync).
    pub fn set_faults(&self, faults: Faults) {
        self.fs.set_faults(faults);
    }

    /// Makes `fsync`/`fdatasync` of files whose name ends in `.{extension}`
    /// succeed without making anything durable (`None`: honest again):
    /// a negative control's disk, as if the store skipped those syncs.
    pub fn lie_about_fsync_of(&self, extension: Option<&str>) {
        self.table().lying_extension = extension.map(str::to_owned);
    }

    /// The disk's counters: syncs, injected errors, power cuts, bytes lost.
    pub fn stats(&self) -> FaultyStats {
        self.fs.stats()
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for FuseDisk {
    fn drop(&mut self) {
        drop(self.session.take());
        // If a process still held a file, that unmount failed: detach it
        // lazily (quietly: usually there is nothing left to unmount).
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// What the server knows of the disk: the mount of the current power
/// cycle, the path of each inode it has handed out, and open files.
struct Table {
    mount: Arc<FaultyMount>,
    /// FUSE inode number (the disk's inode + 1) → the paths it was seen
    /// at (a file with hard links has several; some may be gone since).
    paths: HashMap<u64, Vec<PathBuf>>,
    handles: HashMap<u64, FileRef>,
    /// Directory listings taken at `opendir`, by handle: `readdir` serves
    /// offsets into one fixed listing while entries are removed.
    listings: HashMap<u64, Vec<(INodeNo, FileType, String)>>,
    next_fh: u64,
    /// See [`FuseDisk::lie_about_fsync_of`].
    lying_extension: Option<String>,
}

impl Table {
    fn new(mount: Arc<FaultyMount>) -> Self {
        let mut paths = HashMap::new();
        paths.insert(INodeNo::ROOT.0, vec![PathBuf::from("/")]);
        Self {
            mount,
            paths,
            handles: HashMap::new(),
            listings: HashMap::new(),
            next_fh: 1,
            lying_extension: None,
        }
    }

    /// A path of inode `ino` that still leads to it.
    fn path(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        let paths = self.paths.get(&ino.0).ok_or(Errno::ENOENT)?;
        let mut error = Errno::ENOENT;
        for path in paths {
            match self.mount.inode(path) {
                Ok(i) if i + 1 == ino.0 => return Ok(path.clone()),
                Ok(_) => {}
                Err(e) => error = errno(&e),
            }
        }
        Err(error)
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<PathBuf, Errno> {
        Ok(self.path(parent)?.join(name))
    }

    /// The attributes of `path`, remembering its inode's path.
    fn attr(&mut self, path: &Path) -> Result<FileAttr, Errno> {
        let ino = self.mount.inode(path).map_err(|e| errno(&e))? + 1;
        let meta = self.mount.metadata(path).map_err(|e| errno(&e))?;
        let known = self.paths.entry(ino).or_default();
        if !known.iter().any(|p| p == path) {
            known.push(path.to_owned());
        }
        Ok(attr(INodeNo(ino), &meta))
    }

    /// The attributes of inode `ino`: by a path of it, or by the handle
    /// the kernel names once no name leads to it (`ftruncate` of an
    /// unlinked file; `fstat` carries no handle and gets ENOENT then).
    fn attr_of(&mut self, ino: INodeNo, fh: Option<FileHandle>) -> Result<FileAttr, Errno> {
        match self.path(ino) {
            Ok(path) => self.attr(&path),
            Err(e) => {
                let h = fh.and_then(|fh| self.handles.get(&fh.0)).ok_or(e)?;
                let len = h.len().map_err(|e| errno(&e))?;
                let meta = FileMeta { len, is_dir: false, links: 0, modified: SystemTime::now() };
                Ok(attr(ino, &meta))
            }
        }
    }

    fn handle(&self, fh: FileHandle) -> Result<&FileRef, Errno> {
        self.handles.get(&fh.0).ok_or(Errno::EBADF)
    }

    fn open_handle(&mut self, file: FileRef) -> FileHandle {
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, file);
        FileHandle(fh)
    }

    /// After `from` was renamed to `to`: every remembered path under
    /// `from` now lives under `to`.
    fn renamed(&mut self, from: &Path, to: &Path) {
        for p in self.paths.values_mut().flatten() {
            if let Ok(rest) = p.strip_prefix(from) {
                *p = if rest.as_os_str().is_empty() { to.to_owned() } else { to.join(rest) };
            }
        }
    }
}

fn attr(ino: INodeNo, meta: &FileMeta) -> FileAttr {
    // SAFETY: geteuid/getegid cannot fail and touch no memory.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    FileAttr {
        ino,
        size: meta.len,
        blocks: meta.len.div_ceil(512),
        atime: meta.modified,
        mtime: meta.modified,
        ctime: meta.modified,
        crtime: meta.modified,
        kind: if meta.is_dir { FileType::Directory } else { FileType::RegularFile },
        perm: if meta.is_dir { 0o755 } else { 0o644 },
        nlink: if meta.is_dir { 2 } else { u32::try_from(meta.links).unwrap_or(u32::MAX) },
        uid,
        gid,
        rdev: 0,
        blksize: BLOCK_BYTES,
        flags: 0,
    }
}

/// The errno a process sees for `e`.
fn errno(e: &io::Error) -> Errno {
    if let Some(raw) = e.raw_os_error() {
        return Errno::from_i32(raw);
    }
    match e.kind() {
        io::ErrorKind::NotFound => Errno::ENOENT,
        io::ErrorKind::AlreadyExists => Errno::EEXIST,
        io::ErrorKind::IsADirectory => Errno::EISDIR,
        io::ErrorKind::NotADirectory => Errno::ENOTDIR,
        io::ErrorKind::DirectoryNotEmpty => Errno::ENOTEMPTY,
        io::ErrorKind::PermissionDenied => Errno::EPERM,
        io::ErrorKind::InvalidInput => Errno::EINVAL,
        io::ErrorKind::StorageFull => Errno::ENOSPC,
        // Injected EIO, and "the power was cut" for a process's leftovers.
        _ => Errno::EIO,
    }
}

/// The FUSE request handler. One thread serves each mount, so requests
/// are handled one at a time, in the order the kernel sends them.
struct Server {
    table: Arc<Mutex<Table>>,
}

impl Server {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Filesystem for Server {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut t = self.table();
        match t.child(parent, name).and_then(|p| t.attr(&p)) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.table().attr_of(ino, fh) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut t = self.table();
        let result = (|| {
            if size.is_some() || mtime.is_some() {
                let file = match fh {
                    // A handle from before a power cut is gone with its process.
                    Some(fh) => t.handle(fh)?.clone(),
                    None => t.mount.open(&t.path(ino)?, OpenMode::ReadWrite).map_err(|e| errno(&e))?,
                };
                if let Some(len) = size {
                    file.set_len(len).map_err(|e| errno(&e))?;
                }
                if let Some(m) = mtime {
                    let m = match m {
                        TimeOrNow::SpecificTime(t) => t,
                        TimeOrNow::Now => SystemTime::now(),
                    };
                    file.set_modified(m).map_err(|e| errno(&e))?;
                }
            }
            t.attr_of(ino, fh)
        })();
        match result {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let mut t = self.table();
        let result = t.child(parent, name).and_then(|p| {
            if t.mount.metadata(&p).is_ok() {
                return Err(Errno::EEXIST);
            }
            t.mount.create_dir_all(&p).map_err(|e| errno(&e))?;
            t.attr(&p)
        });
        match result {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let t = self.table();
        match t.child(parent, name).and_then(|p| t.mount.remove_file(&p).map_err(|e| errno(&e))) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let t = self.table();
        let result = t.child(parent, name).and_then(|p| {
            let entries = t.mount.list(&p).map_err(|e| errno(&e))?;
            if !entries.is_empty() {
                return Err(Errno::ENOTEMPTY);
            }
            t.mount.remove_dir_all(&p).map_err(|e| errno(&e))
        });
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut t = self.table();
        let result = (|| {
            let from = t.child(parent, name)?;
            let to = t.child(newparent, newname)?;
            if flags.contains(RenameFlags::RENAME_EXCHANGE) || flags.contains(RenameFlags::RENAME_WHITEOUT) {
                return Err(Errno::EINVAL);
            }
            if flags.contains(RenameFlags::RENAME_NOREPLACE) && t.mount.metadata(&to).is_ok() {
                return Err(Errno::EEXIST);
            }
            t.mount.rename(&from, &to).map_err(|e| errno(&e))?;
            t.renamed(&from, &to);
            Ok(())
        })();
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let mut t = self.table();
        let result = (|| {
            let from = t.path(ino)?;
            let to = t.child(newparent, newname)?;
            t.mount.hard_link(&from, &to).map_err(|e| errno(&e))?;
            t.attr(&to)
        })();
        match result {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let mut t = self.table();
        let result = (|| {
            let path = t.path(ino)?;
            let mode =
                if flags.acc_mode() == OpenAccMode::O_RDONLY { OpenMode::Read } else { OpenMode::ReadWrite };
            let file = t.mount.open(&path, mode).map_err(|e| errno(&e))?;
            if flags.0 & libc::O_TRUNC != 0 && mode == OpenMode::ReadWrite {
                file.set_len(0).map_err(|e| errno(&e))?;
            }
            Ok(t.open_handle(file))
        })();
        match result {
            Ok(fh) => reply.opened(fh, FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut t = self.table();
        let result = (|| {
            let path = t.child(parent, name)?;
            let file = if t.mount.metadata(&path).is_ok() {
                if flags & libc::O_EXCL != 0 {
                    return Err(Errno::EEXIST);
                }
                let file = t.mount.open(&path, OpenMode::ReadWrite).map_err(|e| errno(&e))?;
                if flags & libc::O_TRUNC != 0 {
                    file.set_len(0).map_err(|e| errno(&e))?;
                }
                file
            } else {
                t.mount.open(&path, OpenMode::CreateTruncate).map_err(|e| errno(&e))?
            };
            let a = t.attr(&path)?;
            Ok((a, t.open_handle(file)))
        })();
        match result {
            Ok((a, fh)) => reply.created(&TTL, &a, Generation(0), fh, FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let t = self.table();
        let result = t.handle(fh).and_then(|h| {
            let mut buf = vec![0; size as usize];
            let n = h.read_at(&mut buf, offset).map_err(|e| errno(&e))?;
            buf.truncate(n);
            Ok(buf)
        });
        match result {
            Ok(buf) => reply.data(&buf),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let t = self.table();
        match t.handle(fh).and_then(|h| h.write_all_at(data, offset).map_err(|e| errno(&e))) {
            Ok(()) => reply.written(u32::try_from(data.len()).unwrap_or(u32::MAX)),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.table().handles.remove(&fh.0);
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let t = self.table();
        if let Some(ext) = &t.lying_extension
            && t.paths
                .get(&ino.0)
                .into_iter()
                .flatten()
                .any(|p| p.extension().is_some_and(|e| e == ext.as_str()))
        {
            reply.ok();
            return;
        }
        let result = t.handle(fh).and_then(|h| {
            let synced = if datasync { h.sync_data() } else { h.sync_all() };
            synced.map_err(|e| errno(&e))
        });
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut t = self.table();
        let result = (|| {
            let path = t.path(ino)?;
            let mut names = t.mount.list(&path).map_err(|e| errno(&e))?;
            names.sort();
            let mut entries =
                vec![(ino, FileType::Directory, ".".to_owned()), (ino, FileType::Directory, "..".to_owned())];
            for name in names {
                // A name removed meanwhile is skipped.
                if let Ok(a) = t.attr(&path.join(&name)) {
                    entries.push((a.ino, a.kind, name));
                }
            }
            let fh = t.next_fh;
            t.next_fh += 1;
            t.listings.insert(fh, entries);
            Ok(FileHandle(fh))
        })();
        match result {
            Ok(fh) => reply.opened(fh, FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let t = self.table();
        let Some(entries) = t.listings.get(&fh.0) else {
            reply.error(Errno::EBADF);
            return;
        };
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.table().listings.remove(&fh.0);
        reply.ok();
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let t = self.table();
        match t.path(ino).and_then(|p| t.mount.sync_dir(&p).map_err(|e| errno(&e))) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: ReplyXattr) {
        // No extended attributes: the kernel stops asking (it asks for
        // `security.capability` before writes).
        reply.error(Errno::ENOSYS);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: ReplyXattr) {
        reply.error(Errno::ENOSYS);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(BLOCKS, BLOCKS, BLOCKS, 1 << 20, 1 << 20, BLOCK_BYTES, 255, BLOCK_BYTES);
    }
}

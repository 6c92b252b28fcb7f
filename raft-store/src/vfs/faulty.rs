//! A file system in memory that keeps exactly what POSIX promises to keep
//! across a power cut, and injects disk errors: for power-loss and
//! disk-fault tests of the store.
//!
//! Every file (inode) holds its *current* bytes (what reads see: the page
//! cache) and its *durable* bytes (what the disk holds), and the list of
//! writes since its last completed `sync_data`. Every directory holds its
//! current entries and its durable entries (as of its last `sync_dir`).
//! [`FaultyFs::power_cut`] throws away everything not durable: each file
//! goes back to its durable bytes (optionally with some of its unsynced
//! writes applied in order and the next torn at a random byte, as a disk
//! that wrote part of what it was given), each directory to its durable
//! entries. [`FaultyFs::power_cut_after`] does it just before the n-th
//! operation that changes anything, so a test can cut at every point of
//! the store's work, not only where a timer happens to land.
//!
//! The store sees the disk through a [`FaultyMount`] ([`FaultyFs::mount`]):
//! the mount and every file opened through it belong to the process that
//! was running, and fail from the cut on, as that process is gone.
//!
//! A failed `sync_data` behaves as Linux does since the "fsyncgate"
//! discussion (2018): the writes it covered are dropped from what will ever
//! reach the disk, yet reads still return them, and a later `sync_data`
//! succeeds without writing them. A store that retries the fsync and then
//! trusts those writes loses them at the next power cut.
//!
//! `drop_cached` behaves as `POSIX_FADV_DONTNEED`: each whole
//! [`PAGE_BYTES`] page of the range that no unsynced write touches (a clean
//! page) is read from the disk afterwards, so after a failed fsync a drop
//! shows what the disk lost; dirty pages stay.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use super::{FileMeta, FileRef, OpenMode, Vfs, VfsFile};

/// Which disk errors to inject; change them at any time with
/// [`FaultyFs::set_faults`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// `sync_data`, `sync_file_system` and `sync_dir` fail with EIO.
    pub eio_on_sync: bool,
    /// Writes and `set_len` fail with EIO.
    pub eio_on_write: bool,
    /// Reads fail with EIO.
    pub eio_on_read: bool,
    /// Total bytes the files may hold; a write past it fails with ENOSPC.
    pub space_bytes: Option<u64>,
    /// Syncs succeed without making anything durable: a disk that
    /// acknowledges fsync without persisting (what Ferrolog does not
    /// promise to survive; negative controls use it).
    pub fsync_lies: bool,
}

/// How a [`FaultyFs::power_cut`] treats writes no fsync covered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PowerCut {
    /// All of them are lost.
    Clean,
    /// Per file, a random number of them reached the disk in order, and
    /// the next one only up to a random byte (seeded by the file system's
    /// seed: the same seed and the same operations tear the same way).
    Torn,
}

/// Counters of a [`FaultyFs`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultyStats {
    /// Completed `sync_data` / `sync_file_system` calls.
    pub file_syncs: u64,
    /// Completed `sync_dir` calls.
    pub dir_syncs: u64,
    /// Injected errors returned.
    pub injected_errors: u64,
    /// Power cuts so far.
    pub power_cuts: u64,
    /// Bytes of unsynced writes thrown away by power cuts, in files that
    /// survived them.
    pub lost_bytes: u64,
}

/// The in-memory, fault-injecting disk. Cloning shares it; the store
/// uses it through a [`FaultyFs::mount`].
#[derive(Clone, Debug)]
pub struct FaultyFs {
    inner: Arc<Mutex<State>>,
    id: u64,
}

/// The file system of a [`FaultyFs`] as one run of a process sees it:
/// every operation fails once the power was cut after it was mounted.
#[derive(Clone, Debug)]
pub struct FaultyMount {
    fs: FaultyFs,
    incarnation: u64,
}

type Ino = u64;
/// Largest file this in-memory disk holds (EFBIG past it), bytes.
const MAX_FILE_BYTES: u64 = 1 << 32;
const ROOT: Ino = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    File(Ino),
    Dir(Ino),
}

#[derive(Clone, Debug)]
enum Op {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

#[derive(Debug, Default)]
struct FileNode {
    data: Vec<u8>,
    durable: Vec<u8>,
    unsynced: Vec<Op>,
    modified: Option<SystemTime>,
}

#[derive(Debug, Default)]
struct DirNode {
    entries: BTreeMap<String, Entry>,
    durable: BTreeMap<String, Entry>,
}

#[derive(Debug)]
struct State {
    incarnation: u64,
    files: HashMap<Ino, FileNode>,
    dirs: HashMap<Ino, DirNode>,
    next_ino: Ino,
    faults: Faults,
    rng: u64,
    stats: FaultyStats,
    /// Cut the power before this many more changing operations.
    cut_after: Option<(u64, PowerCut)>,
    /// See [`FaultyFs::simulated`].
    on_runtime: bool,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn err(kind: io::ErrorKind, what: &str) -> io::Error {
    io::Error::new(kind, what.to_owned())
}
fn eio(what: &str) -> io::Error {
    io::Error::new(io::Error::from_raw_os_error(libc::EIO).kind(), format!("injected EIO on {what}"))
}
fn not_found() -> io::Error {
    io::Error::from_raw_os_error(libc::ENOENT)
}

/// The components of an absolute path, with `.` dropped and `..` refused.
fn components(path: &Path) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(s) => out.push(s.to_string_lossy().into_owned()),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(err(io::ErrorKind::InvalidInput, "paths must be absolute, without '..'"));
            }
        }
    }
    if !path.is_absolute() {
        return Err(err(io::ErrorKind::InvalidInput, "paths must be absolute, without '..'"));
    }
    Ok(out)
}

impl Default for FaultyFs {
    fn default() -> Self {
        Self::new(1)
    }
}

impl FaultyFs {
    /// An empty file system (only `/`); `seed` drives torn power cuts.
    pub fn new(seed: u64) -> Self {
        let mut dirs = HashMap::new();
        dirs.insert(ROOT, DirNode::default());
        let state = State {
            incarnation: 0,
            files: HashMap::new(),
            dirs,
            next_ino: 1,
            faults: Faults::default(),
            rng: seed | 1,
            stats: FaultyStats::default(),
            cut_after: None,
            on_runtime: false,
        };
        Self { inner: Arc::new(Mutex::new(state)), id: NEXT_ID.fetch_add(1, Ordering::Relaxed) }
    }

    /// Makes the store run its background work on this file system as tasks
    /// of the tokio runtime that opens it (see
    /// [`Vfs::background_on_runtime`]): for a deterministic simulation.
    pub fn simulated(self) -> Self {
        self.state().on_runtime = true;
        self
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the injected faults.
    pub fn set_faults(&self, faults: Faults) {
        self.state().faults = faults;
    }

    /// The counters so far.
    pub fn stats(&self) -> FaultyStats {
        self.state().stats
    }

    /// The file system as a process started now sees it.
    pub fn mount(&self) -> Arc<FaultyMount> {
        Arc::new(FaultyMount { fs: self.clone(), incarnation: self.state().incarnation })
    }

    /// Whether the power was cut since `mount` was made.
    pub fn was_cut_since(&self, mount: &FaultyMount) -> bool {
        self.state().incarnation != mount.incarnation
    }

    /// Cuts the power: everything not durable is lost (see the module
    /// comment), injected errors are cleared (not `fsync_lies`), and every mount and handle
    /// made before fails from now on (the process that held it is gone).
    pub fn power_cut(&self, how: PowerCut) {
        self.state().cut(how);
    }

    /// Bit rot: flips bit `bit % 8` of the byte at `position` of the file
    /// `path`, in what the disk holds and in what reads see, without any
    /// process writing it (nothing a running process did changes, and the
    /// store learns of it only by checking what it reads).
    ///
    /// # Errors
    /// `NotFound` (or not a file); `InvalidInput` if `position` is not
    /// within the file's durable bytes.
    pub fn rot(&self, path: &Path, position: u64, bit: u8) -> io::Result<()> {
        let mut s = self.state();
        let Entry::File(ino) = s.lookup(path)? else { return Err(not_found()) };
        let f = s.files.get_mut(&ino).ok_or_else(not_found)?;
        let at = usize::try_from(position).map_err(|_| err(io::ErrorKind::InvalidInput, "position"))?;
        if at >= f.durable.len() {
            return Err(err(io::ErrorKind::InvalidInput, "rot past the file's durable bytes"));
        }
        let mask = 1u8 << (bit % 8);
        f.durable[at] ^= mask;
        if let Some(b) = f.data.get_mut(at) {
            *b ^= mask;
        }
        Ok(())
    }

    /// Cuts the power (as [`FaultyFs::power_cut`]) just before the `ops`-th
    /// operation from now that would change anything (a write, truncate,
    /// sync, create, rename, link or removal); that operation fails.
    pub fn power_cut_after(&self, ops: u64, how: PowerCut) {
        self.state().cut_after = Some((ops.max(1), how));
    }
}

impl State {
    fn cut(&mut self, how: PowerCut) {
        let s = self;
        s.cut_after = None;
        s.incarnation += 1;
        s.stats.power_cuts += 1;
        // Injected errors end with the power; a lying disk stays one.
        s.faults = Faults { fsync_lies: s.faults.fsync_lies, ..Faults::default() };
        // Directories: back to their durable entries; keep what is reachable.
        for d in s.dirs.values_mut() {
            d.entries = d.durable.clone();
        }
        let mut reachable_dirs = vec![ROOT];
        let mut reachable_files = Vec::new();
        let mut i = 0;
        while i < reachable_dirs.len() {
            let d = reachable_dirs[i];
            for e in
                s.dirs.get(&d).map(|d| d.entries.values().copied().collect::<Vec<_>>()).unwrap_or_default()
            {
                match e {
                    Entry::Dir(c) if !reachable_dirs.contains(&c) => reachable_dirs.push(c),
                    Entry::File(f) => reachable_files.push(f),
                    Entry::Dir(_) => {}
                }
            }
            i += 1;
        }
        s.dirs.retain(|ino, _| reachable_dirs.contains(ino));
        s.files.retain(|ino, _| reachable_files.contains(ino));
        let mut inos: Vec<Ino> = s.files.keys().copied().collect();
        inos.sort_unstable();
        for ino in inos {
            let unsynced = s.files.get_mut(&ino).map(|f| std::mem::take(&mut f.unsynced)).unwrap_or_default();
            let lost: u64 =
                unsynced.iter().map(|o| if let Op::Write(_, b) = o { b.len() as u64 } else { 0 }).sum();
            let (keep, tear) = if how == PowerCut::Torn && !unsynced.is_empty() {
                let k = (s.next_random() % (unsynced.len() as u64 + 1)) as usize;
                let tear = s.next_random();
                (k, Some(tear))
            } else {
                (0, None)
            };
            s.stats.lost_bytes += lost;
            let Some(f) = s.files.get_mut(&ino) else { continue };
            let mut disk = std::mem::take(&mut f.durable);
            for op in &unsynced[..keep] {
                apply(&mut disk, op);
            }
            if let (Some(r), Some(Op::Write(pos, bytes))) = (tear, unsynced.get(keep)) {
                let cut = (r % (bytes.len() as u64 + 1)) as usize;
                apply(&mut disk, &Op::Write(*pos, bytes[..cut].to_vec()));
            }
            f.data = disk.clone();
            f.durable = disk;
        }
    }

    /// Counts one changing operation of a process mounted at `incarnation`:
    /// fails if that process is gone, or if the power is cut now.
    fn change(&mut self, incarnation: u64) -> io::Result<()> {
        if incarnation != self.incarnation {
            return Err(err(io::ErrorKind::Other, "the power was cut: this process is gone"));
        }
        if let Some((n, how)) = self.cut_after {
            if n <= 1 {
                self.cut(how);
                return Err(err(io::ErrorKind::Other, "the power was cut: this process is gone"));
            }
            self.cut_after = Some((n - 1, how));
        }
        Ok(())
    }

    fn alive(&self, incarnation: u64) -> io::Result<()> {
        if incarnation == self.incarnation {
            Ok(())
        } else {
            Err(err(io::ErrorKind::Other, "the power was cut: this process is gone"))
        }
    }
}

impl FaultyMount {
    fn state(&self) -> MutexGuard<'_, State> {
        self.fs.state()
    }

    /// The state, if this mount's process is still running.
    fn live(&self) -> io::Result<MutexGuard<'_, State>> {
        let s = self.state();
        s.alive(self.incarnation)?;
        Ok(s)
    }

    /// As `live`, counting a changing operation.
    fn changing(&self) -> io::Result<MutexGuard<'_, State>> {
        let mut s = self.state();
        s.change(self.incarnation)?;
        Ok(s)
    }

    /// The inode number of the file or directory at `path` (`/` is 0): two
    /// names of one file (hard links) give the same number, and a file
    /// keeps its number across renames and power cuts. For a file-system
    /// server that exposes this disk to other processes (FUSE), which
    /// names files by inode.
    ///
    /// # Errors
    /// `NotFound`, `NotADirectory` on the way, or the power was cut since
    /// this mount was made.
    pub fn inode(&self, path: &Path) -> io::Result<u64> {
        match self.live()?.lookup(path)? {
            Entry::File(ino) | Entry::Dir(ino) => Ok(ino),
        }
    }

    fn handle(&self, ino: Ino, writable: bool) -> FileRef {
        Arc::new(FaultyFile { fs: self.fs.clone(), ino, writable, incarnation: self.incarnation })
    }
}

/// Page size of [`VfsFile::drop_cached`]'s model, bytes.
pub const PAGE_BYTES: u64 = 4096;

impl Op {
    /// Whether this unsynced change leaves page `[start, end)` dirty.
    fn touches(&self, start: u64, end: u64) -> bool {
        match self {
            Op::Write(pos, bytes) => *pos < end && pos + bytes.len() as u64 > start,
            // A length change dirties the page it falls in and everything after.
            Op::SetLen(len) => end > *len / PAGE_BYTES * PAGE_BYTES,
        }
    }
}

fn apply(data: &mut Vec<u8>, op: &Op) {
    match op {
        Op::Write(pos, bytes) => {
            let end = *pos as usize + bytes.len();
            if data.len() < end {
                data.resize(end, 0);
            }
            data[*pos as usize..end].copy_from_slice(bytes);
        }
        Op::SetLen(len) => data.resize(*len as usize, 0),
    }
}

impl State {
    fn next_random(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn lookup(&self, path: &Path) -> io::Result<Entry> {
        let mut at = Entry::Dir(ROOT);
        for c in components(path)? {
            let Entry::Dir(d) = at else { return Err(err(io::ErrorKind::NotADirectory, "not a directory")) };
            at = *self.dirs.get(&d).and_then(|d| d.entries.get(&c)).ok_or_else(not_found)?;
        }
        Ok(at)
    }

    /// The directory holding `path` and the last component's name.
    fn parent(&self, path: &Path) -> io::Result<(Ino, String)> {
        let mut parts = components(path)?;
        let name = parts.pop().ok_or_else(|| err(io::ErrorKind::InvalidInput, "no file name"))?;
        let dir: PathBuf = std::iter::once("/".to_owned()).chain(parts).collect();
        match self.lookup(&dir)? {
            Entry::Dir(d) => Ok((d, name)),
            Entry::File(_) => Err(err(io::ErrorKind::NotADirectory, "not a directory")),
        }
    }

    fn dir_mut(&mut self, d: Ino) -> io::Result<&mut DirNode> {
        self.dirs.get_mut(&d).ok_or_else(not_found)
    }

    fn used_bytes(&self) -> u64 {
        self.files.values().map(|f| f.data.len() as u64).sum()
    }

    fn injected(&mut self, what: &str) -> io::Error {
        self.stats.injected_errors += 1;
        eio(what)
    }

    fn links(&self, ino: Ino) -> u64 {
        self.dirs.values().flat_map(|d| d.entries.values()).filter(|e| **e == Entry::File(ino)).count() as u64
    }
}

impl Vfs for FaultyMount {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<FileRef> {
        let mut s = if mode == OpenMode::CreateTruncate { self.changing()? } else { self.live()? };
        let ino = match (s.lookup(path), mode) {
            (Ok(Entry::File(ino)), OpenMode::CreateTruncate) => {
                if s.faults.eio_on_write {
                    return Err(s.injected("truncate"));
                }
                let f = s.files.get_mut(&ino).ok_or_else(not_found)?;
                f.data.clear();
                f.unsynced.push(Op::SetLen(0));
                f.modified = Some(crate::runtime::wall_clock());
                ino
            }
            (Ok(Entry::File(ino)), _) => ino,
            (Ok(Entry::Dir(_)), _) => return Err(err(io::ErrorKind::IsADirectory, "is a directory")),
            (Err(e), OpenMode::CreateTruncate) if e.kind() == io::ErrorKind::NotFound => {
                let (dir, name) = s.parent(path)?;
                let ino = s.next_ino;
                s.next_ino += 1;
                s.files.insert(
                    ino,
                    FileNode { modified: Some(crate::runtime::wall_clock()), ..FileNode::default() },
                );
                s.dir_mut(dir)?.entries.insert(name, Entry::File(ino));
                ino
            }
            (Err(e), _) => return Err(e),
        };
        drop(s);
        Ok(self.handle(ino, mode != OpenMode::Read))
    }

    fn metadata(&self, path: &Path) -> io::Result<FileMeta> {
        let s = self.live()?;
        match s.lookup(path)? {
            Entry::Dir(_) => {
                Ok(FileMeta { len: 0, is_dir: true, links: 1, modified: SystemTime::UNIX_EPOCH })
            }
            Entry::File(ino) => {
                let f = s.files.get(&ino).ok_or_else(not_found)?;
                Ok(FileMeta {
                    len: f.data.len() as u64,
                    is_dir: false,
                    links: s.links(ino),
                    modified: f.modified.unwrap_or(SystemTime::UNIX_EPOCH),
                })
            }
        }
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let s = self.live()?;
        match s.lookup(dir)? {
            Entry::Dir(d) => {
                Ok(s.dirs.get(&d).map(|d| d.entries.keys().cloned().collect()).unwrap_or_default())
            }
            Entry::File(_) => Err(err(io::ErrorKind::NotADirectory, "not a directory")),
        }
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.changing()?;
        let mut at = ROOT;
        for c in components(dir)? {
            let next = s.dirs.get(&at).and_then(|d| d.entries.get(&c)).copied();
            at = match next {
                Some(Entry::Dir(d)) => d,
                Some(Entry::File(_)) => {
                    return Err(err(io::ErrorKind::AlreadyExists, "a file is in the way"));
                }
                None => {
                    let d = s.next_ino;
                    s.next_ino += 1;
                    s.dirs.insert(d, DirNode::default());
                    s.dir_mut(at)?.entries.insert(c, Entry::Dir(d));
                    d
                }
            };
        }
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.changing()?;
        let entry = s.lookup(from)?;
        let (from_dir, from_name) = s.parent(from)?;
        let (to_dir, to_name) = s.parent(to)?;
        if let (Entry::Dir(_), Ok(Entry::Dir(d))) = (entry, s.lookup(to))
            && s.dirs.get(&d).is_some_and(|d| !d.entries.is_empty())
        {
            return Err(err(io::ErrorKind::DirectoryNotEmpty, "target directory not empty"));
        }
        s.dir_mut(from_dir)?.entries.remove(&from_name);
        s.dir_mut(to_dir)?.entries.insert(to_name, entry);
        Ok(())
    }

    fn hard_link(&self, src: &Path, dst: &Path) -> io::Result<()> {
        let mut s = self.changing()?;
        let Entry::File(ino) = s.lookup(src)? else {
            return Err(err(io::ErrorKind::PermissionDenied, "cannot link a directory"));
        };
        if s.lookup(dst).is_ok() {
            return Err(err(io::ErrorKind::AlreadyExists, "link target exists"));
        }
        let (dir, name) = s.parent(dst)?;
        s.dir_mut(dir)?.entries.insert(name, Entry::File(ino));
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut s = self.changing()?;
        let Entry::File(_) = s.lookup(path)? else {
            return Err(err(io::ErrorKind::IsADirectory, "is a directory"));
        };
        let (dir, name) = s.parent(path)?;
        s.dir_mut(dir)?.entries.remove(&name);
        Ok(())
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut s = self.changing()?;
        let Entry::Dir(removed) = s.lookup(path)? else {
            return Err(err(io::ErrorKind::NotADirectory, "not a directory"));
        };
        let (dir, name) = s.parent(path)?;
        s.dir_mut(dir)?.entries.remove(&name);
        // Everything under it is unlinked now; the durable entries stay, to
        // come back if a power cut brings the name back.
        let mut stack = vec![removed];
        while let Some(d) = stack.pop() {
            if let Some(node) = s.dirs.get_mut(&d) {
                for e in std::mem::take(&mut node.entries).into_values() {
                    if let Entry::Dir(c) = e {
                        stack.push(c);
                    }
                }
            }
        }
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.changing()?;
        if s.faults.eio_on_sync {
            return Err(s.injected("directory fsync"));
        }
        if s.faults.fsync_lies {
            return Ok(());
        }
        let Entry::Dir(d) = s.lookup(dir)? else {
            return Err(err(io::ErrorKind::NotADirectory, "not a directory"));
        };
        let node = s.dir_mut(d)?;
        node.durable = node.entries.clone();
        s.stats.dir_syncs += 1;
        Ok(())
    }

    fn canonicalize(&self, path: &Path) -> io::Result<PathBuf> {
        let s = self.live()?;
        s.lookup(path)?;
        Ok(std::iter::once("/".to_owned()).chain(components(path)?).collect())
    }

    fn incarnation(&self) -> u64 {
        (self.fs.id << 32) | self.incarnation
    }

    fn background_on_runtime(&self) -> bool {
        self.fs.state().on_runtime
    }
}

/// A handle to a file of a [`FaultyFs`].
#[derive(Debug)]
struct FaultyFile {
    fs: FaultyFs,
    ino: Ino,
    writable: bool,
    incarnation: u64,
}

impl FaultyFile {
    /// The state, if this handle's process is still running.
    fn live(&self) -> io::Result<MutexGuard<'_, State>> {
        let s = self.fs.state();
        s.alive(self.incarnation)?;
        Ok(s)
    }

    /// As `live`, for a changing operation (counted; may cut the power).
    fn changing(&self) -> io::Result<MutexGuard<'_, State>> {
        let mut s = self.fs.state();
        s.change(self.incarnation)?;
        Ok(s)
    }

    fn writable(&self) -> io::Result<MutexGuard<'_, State>> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EBADF));
        }
        self.changing()
    }
}

impl VfsFile for FaultyFile {
    fn read_at(&self, buf: &mut [u8], position: u64) -> io::Result<usize> {
        let mut s = self.live()?;
        if s.faults.eio_on_read {
            return Err(s.injected("read"));
        }
        let f = s.files.get(&self.ino).ok_or_else(not_found)?;
        let start = (position as usize).min(f.data.len());
        let n = buf.len().min(f.data.len() - start);
        buf[..n].copy_from_slice(&f.data[start..start + n]);
        Ok(n)
    }

    fn write_all_at(&self, buf: &[u8], position: u64) -> io::Result<()> {
        let mut s = self.writable()?;
        if s.faults.eio_on_write {
            return Err(s.injected("write"));
        }
        let used = s.used_bytes();
        let f = s.files.get(&self.ino).ok_or_else(not_found)?;
        let end = position
            .checked_add(buf.len() as u64)
            .filter(|e| *e <= MAX_FILE_BYTES)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EFBIG))?;
        let grows = end.saturating_sub(f.data.len() as u64);
        if s.faults.space_bytes.is_some_and(|cap| used + grows > cap) {
            s.stats.injected_errors += 1;
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let f = s.files.get_mut(&self.ino).ok_or_else(not_found)?;
        let op = Op::Write(position, buf.to_vec());
        apply(&mut f.data, &op);
        f.unsynced.push(op);
        f.modified = Some(crate::runtime::wall_clock());
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut s = self.writable()?;
        if s.faults.eio_on_write {
            return Err(s.injected("truncate"));
        }
        if len > MAX_FILE_BYTES {
            return Err(io::Error::from_raw_os_error(libc::EFBIG));
        }
        let used = s.used_bytes();
        let f = s.files.get(&self.ino).ok_or_else(not_found)?;
        let grows = len.saturating_sub(f.data.len() as u64);
        if s.faults.space_bytes.is_some_and(|cap| used + grows > cap) {
            s.stats.injected_errors += 1;
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let f = s.files.get_mut(&self.ino).ok_or_else(not_found)?;
        let op = Op::SetLen(len);
        apply(&mut f.data, &op);
        f.unsynced.push(op);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let s = self.live()?;
        Ok(s.files.get(&self.ino).ok_or_else(not_found)?.data.len() as u64)
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut s = self.changing()?;
        if s.faults.fsync_lies {
            return Ok(());
        }
        let failing = s.faults.eio_on_sync;
        let f = s.files.get_mut(&self.ino).ok_or_else(not_found)?;
        let unsynced = std::mem::take(&mut f.unsynced);
        if failing {
            // Linux marks the pages clean after a failed writeback: these
            // writes never reach the disk, though reads still see them.
            return Err(s.injected("fsync"));
        }
        for op in &unsynced {
            apply(&mut f.durable, op);
        }
        s.stats.file_syncs += 1;
        Ok(())
    }

    fn syncfs_domain(&self) -> Option<u64> {
        // One syncfs of the model covers every file of this disk.
        Some(self.fs.id)
    }

    fn sync_file_system(&self) -> io::Result<()> {
        let mut s = self.changing()?;
        if s.faults.fsync_lies {
            return Ok(());
        }
        let failing = s.faults.eio_on_sync;
        for f in s.files.values_mut() {
            let unsynced = std::mem::take(&mut f.unsynced);
            if !failing {
                for op in &unsynced {
                    apply(&mut f.durable, op);
                }
            }
        }
        if failing {
            return Err(s.injected("syncfs"));
        }
        s.stats.file_syncs += 1;
        Ok(())
    }

    fn set_modified(&self, time: SystemTime) -> io::Result<()> {
        let mut s = self.writable()?;
        s.files.get_mut(&self.ino).ok_or_else(not_found)?.modified = Some(time);
        Ok(())
    }

    fn drop_cached(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut s = self.live()?;
        let f = s.files.get_mut(&self.ino).ok_or_else(not_found)?;
        let size = f.data.len() as u64;
        let (first, end) = (offset.div_ceil(PAGE_BYTES), offset.saturating_add(len) / PAGE_BYTES);
        for page in first..end {
            let start = page * PAGE_BYTES;
            if start >= size {
                break;
            }
            let stop = (start + PAGE_BYTES).min(size);
            if f.unsynced.iter().any(|op| op.touches(start, start + PAGE_BYTES)) {
                continue;
            }
            // A clean page is read back from the disk (zeros where it holds
            // nothing yet, as an unwritten block). Not modelled: a shrink
            // a failed sync lost, then a write past a gap, would show old
            // disk bytes in the gap where Linux reads zeros; the store's
            // appends are contiguous from any cut, so it never makes one.
            for at in start as usize..stop as usize {
                f.data[at] = f.durable.get(at).copied().unwrap_or(0);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    fn read_all(fs: &FaultyMount, path: &str) -> io::Result<Vec<u8>> {
        let f = fs.open(&p(path), OpenMode::Read)?;
        let mut buf = vec![0; f.len()? as usize];
        let n = f.read_at(&mut buf, 0)?;
        buf.truncate(n);
        Ok(buf)
    }

    #[test]
    fn unsynced_writes_and_names_are_lost_at_a_power_cut() {
        let disk = FaultyFs::new(7);
        let fs = disk.mount();
        fs.create_dir_all(&p("/d")).unwrap();
        fs.sync_dir(&p("/")).unwrap();
        let f = fs.open(&p("/d/a"), OpenMode::CreateTruncate).unwrap();
        f.write_all_at(b"hello", 0).unwrap();
        f.sync_data().unwrap();
        f.write_all_at(b" world", 5).unwrap();
        // Data synced but the name not: the file is gone.
        disk.power_cut(PowerCut::Clean);
        assert!(f.read_at(&mut [0; 1], 0).is_err(), "a handle from before the cut must fail");
        assert!(fs.list(&p("/d")).is_err(), "a mount from before the cut must fail");
        let fs = disk.mount();
        assert!(fs.open(&p("/d/a"), OpenMode::Read).is_err());

        let f = fs.open(&p("/d/a"), OpenMode::CreateTruncate).unwrap();
        f.write_all_at(b"hello", 0).unwrap();
        f.sync_data().unwrap();
        fs.sync_dir(&p("/d")).unwrap();
        f.write_all_at(b" world", 5).unwrap();
        assert_eq!(read_all(&fs, "/d/a").unwrap(), b"hello world");
        disk.power_cut(PowerCut::Clean);
        assert_eq!(read_all(&disk.mount(), "/d/a").unwrap(), b"hello");
        // Counted for files that survive the cut: the second cut's " world".
        assert_eq!(disk.stats().lost_bytes, 6);
    }

    #[test]
    fn rot_flips_a_stored_bit_that_reads_and_power_cuts_keep() {
        let disk = FaultyFs::new(3);
        let fs = disk.mount();
        let f = fs.open(&p("/a"), OpenMode::CreateTruncate).unwrap();
        f.write_all_at(b"abc", 0).unwrap();
        f.sync_data().unwrap();
        fs.sync_dir(&p("/")).unwrap();
        f.write_all_at(b"d", 3).unwrap();
        disk.rot(&p("/a"), 1, 0).unwrap();
        assert_eq!(read_all(&fs, "/a").unwrap(), b"accd", "a running process reads the rotted byte");
        assert!(disk.rot(&p("/a"), 3, 0).is_err(), "only stored bytes rot");
        assert!(disk.rot(&p("/b"), 0, 0).is_err());
        disk.power_cut(PowerCut::Clean);
        assert_eq!(read_all(&disk.mount(), "/a").unwrap(), b"acc", "the disk holds it");
    }

    #[test]
    fn a_rename_is_durable_only_with_its_directory() {
        let disk = FaultyFs::new(1);
        let fs = disk.mount();
        fs.create_dir_all(&p("/d")).unwrap();
        fs.sync_dir(&p("/")).unwrap();
        let f = fs.open(&p("/d/t"), OpenMode::CreateTruncate).unwrap();
        f.write_all_at(b"x", 0).unwrap();
        f.sync_data().unwrap();
        fs.sync_dir(&p("/d")).unwrap();
        fs.rename(&p("/d/t"), &p("/d/x")).unwrap();
        disk.power_cut(PowerCut::Clean);
        let fs = disk.mount();
        assert_eq!(fs.list(&p("/d")).unwrap(), vec!["t".to_owned()]);
        fs.rename(&p("/d/t"), &p("/d/x")).unwrap();
        fs.sync_dir(&p("/d")).unwrap();
        disk.power_cut(PowerCut::Clean);
        assert_eq!(disk.mount().list(&p("/d")).unwrap(), vec!["x".to_owned()]);
    }

    #[test]
    fn a_failed_fsync_drops_its_writes_though_reads_still_see_them() {
        let disk = FaultyFs::new(1);
        let fs = disk.mount();
        let f = fs.open(&p("/a"), OpenMode::CreateTruncate).unwrap();
        fs.sync_dir(&p("/")).unwrap();
        f.write_all_at(b"abc", 0).unwrap();
        disk.set_faults(Faults { eio_on_sync: true, ..Faults::default() });
        assert!(f.sync_data().is_err());
        disk.set_faults(Faults::default());
        assert_eq!(read_all(&fs, "/a").unwrap(), b"abc");
        f.sync_data().expect("the retry succeeds, as on Linux");
        disk.power_cut(PowerCut::Clean);
        assert_eq!(
            read_all(&disk.mount(), "/a").unwrap(),
            b"",
            "the retried fsync must not have saved the writes"
        );
    }

    #[test]
    fn a_drop_after_a_failed_fsync_shows_what_the_disk_lost_and_keeps_dirty_pages() {
        let disk = FaultyFs::new(1);
        let fs = disk.mount();
        let f = fs.open(&p("/a"), OpenMode::CreateTruncate).unwrap();
        fs.sync_dir(&p("/")).unwrap();
        let page = PAGE_BYTES as usize;
        f.write_all_at(&vec![1; page], 0).unwrap();
        f.sync_data().unwrap();
        f.write_all_at(&vec![2; page], page as u64).unwrap();
        disk.set_faults(Faults { eio_on_sync: true, ..Faults::default() });
        assert!(f.sync_data().is_err());
        disk.set_faults(Faults::default());
        f.sync_data().expect("the retry succeeds, as on Linux");
        f.write_all_at(&vec![3; page], 2 * page as u64).unwrap();

        // Synced page: unchanged. Page the failed fsync lost: what the disk
        // holds (nothing). Dirty page: kept.
        f.drop_cached(0, 3 * PAGE_BYTES).unwrap();
        let data = read_all(&fs, "/a").unwrap();
        assert_eq!(data.len(), 3 * page);
        assert!(data[..page].iter().all(|b| *b == 1), "a durable page changed");
        assert!(data[page..2 * page].iter().all(|b| *b == 0), "the lost page still reads as written");
        assert!(data[2 * page..].iter().all(|b| *b == 3), "a dirty page was dropped");
    }

    #[test]
    fn a_cut_after_n_operations_stops_the_process_at_that_operation() {
        let disk = FaultyFs::new(1);
        let fs = disk.mount();
        let f = fs.open(&p("/a"), OpenMode::CreateTruncate).unwrap();
        fs.sync_dir(&p("/")).unwrap();
        disk.power_cut_after(3, PowerCut::Clean);
        f.write_all_at(b"a", 0).unwrap();
        f.sync_data().unwrap();
        assert!(f.write_all_at(b"b", 1).is_err(), "the third change meets the cut");
        assert!(disk.was_cut_since(&fs));
        assert!(fs.open(&p("/b"), OpenMode::CreateTruncate).is_err(), "nothing of the old process runs on");
        assert_eq!(read_all(&disk.mount(), "/a").unwrap(), b"a");
    }

    #[test]
    fn enospc_past_the_space_and_torn_cuts_keep_an_in_order_prefix() {
        let disk = FaultyFs::new(3);
        let fs = disk.mount();
        let f = fs.open(&p("/a"), OpenMode::CreateTruncate).unwrap();
        fs.sync_dir(&p("/")).unwrap();
        disk.set_faults(Faults { space_bytes: Some(10), ..Faults::default() });
        f.write_all_at(b"0123456789", 0).unwrap();
        let e = f.write_all_at(b"x", 10).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        disk.set_faults(Faults::default());
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..64 {
            let fs = disk.mount();
            let f = fs.open(&p("/a"), OpenMode::CreateTruncate).unwrap();
            f.sync_data().unwrap();
            for (i, chunk) in [b"aaaa", b"bbbb", b"cccc"].iter().enumerate() {
                f.write_all_at(*chunk, i as u64 * 4).unwrap();
            }
            disk.power_cut(PowerCut::Torn);
            let got = read_all(&disk.mount(), "/a").unwrap();
            assert!(b"aaaabbbbcccc".starts_with(&got), "{got:?} is not a prefix");
            seen.insert(got.len());
        }
        assert!(seen.len() > 3, "torn cuts should land at many lengths, saw {seen:?}");
    }
}

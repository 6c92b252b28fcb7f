//! What a failed fsync leaves behind, and how a log forgets it.
//!
//! After an fsync fails, Linux has already marked the pages it could not
//! write clean (the "fsyncgate" discussion, 2018): reads still return the
//! data, a retried fsync succeeds, and yet the data never reaches the disk.
//! So nothing written since the last fsync that succeeded may be trusted,
//! however it looks afterwards. The rule here:
//!
//! 1. Each log keeps a [`SyncMark`]: the index below which every entry is
//!    known durable (raised by each flush that succeeded).
//! 2. On the first failed flush the mark *trips*: the log records
//!    `from` = that index, in a marker file of the log directory (written
//!    without trusting its own fsync: it only has to outlive the page
//!    cache's lie, which it does, being in the same page cache) and in a
//!    process-wide table (in case even that write fails, e.g. ENOSPC).
//!    Every flush callback of the log from then on reports failure, even
//!    if its fsync "succeeds", so no later entry is acknowledged on top of
//!    a hole; the log takes no more appends; the Raft group stops on the
//!    storage error and the broker restarts it with backoff.
//! 3. The next open of the log (in this process, or after a restart that
//!    kept the page cache) cuts every entry from `from` on before anything
//!    reads it: none of them was acknowledged, so Raft lets the replica
//!    forget them (the leader sends them again). If the cut itself fails
//!    (the disk still failing) the open fails, and the replica stays down,
//!    retried with backoff, until the disk works or an operator acts.
//!
//! After a power cut the page cache is gone and the disk holds only what
//! was durable: the marker may be gone too, and is not needed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};

use crate::error::Result;
use crate::fsutil;
use crate::vfs::Fs;

/// Name of the marker file in a log directory: the decimal index from
/// which entries may not be durable, a space, and the CRC32C of those
/// digits in hex (a marker torn by a power cut does not verify, and is
/// ignored: the cut took the page cache, and its lie, with it).
pub const MARKER_FILE: &str = "unsynced-from";

fn encode(from: u64) -> String {
    let digits = from.to_string();
    format!("{digits} {:08x}", crc32c::crc32c(digits.as_bytes()))
}

fn decode(text: &str) -> Option<u64> {
    let (digits, crc) = text.trim().split_once(' ')?;
    let crc = u32::from_str_radix(crc, 16).ok()?;
    (crc32c::crc32c(digits.as_bytes()) == crc).then(|| digits.parse().ok()).flatten()
}

/// Markers by (file-system incarnation, log directory), for when the
/// marker file cannot be written.
static TRIPPED: LazyLock<Mutex<HashMap<(u64, PathBuf), u64>>> = LazyLock::new(Default::default);

/// The durable point of one log, shared with its flush callbacks.
///
/// One mutex holds it all, so a flush callback's success and a trip never
/// interleave (a success after the trip is refused; a trip sees every
/// success before it). Each lowering of the point (the log's end moved
/// back) starts a new *generation*: a callback of a flush requested before
/// it does not raise the point, since it covered entries that are gone.
#[derive(Debug)]
pub struct SyncMark {
    fs: Fs,
    dir: PathBuf,
    state: Mutex<MarkState>,
}

#[derive(Debug)]
struct MarkState {
    /// Every entry below this index is durable.
    synced_to: u64,
    tripped: bool,
    generation: u64,
}

/// What a flush request covers, taken when it is made
/// ([`SyncMark::request`]).
#[derive(Clone, Copy, Debug)]
pub struct Covered {
    next_index: u64,
    generation: u64,
}

impl SyncMark {
    /// A mark for the log in `dir`, whose entries below `synced_to` are
    /// known durable.
    pub fn new(fs: Fs, dir: &Path, synced_to: u64) -> Self {
        Self {
            fs,
            dir: dir.to_owned(),
            state: Mutex::new(MarkState { synced_to, tripped: false, generation: 0 }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MarkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What a flush requested now covers: every entry below `next_index`
    /// (the log's end when the request is made).
    pub fn request(&self, next_index: u64) -> Covered {
        Covered { next_index, generation: self.state().generation }
    }

    /// The result a flush callback must report for a flush (`result`) of
    /// what `covered` says: a failure trips the mark; after a trip every
    /// flush reports failure (its success proves nothing); a success
    /// raises the durable point unless the log's end moved back since the
    /// request.
    ///
    /// # Errors
    /// The flush's error, or one saying an earlier fsync failed.
    pub fn checked(&self, result: std::io::Result<()>, covered: Covered) -> std::io::Result<()> {
        let mut st = self.state();
        match result {
            Ok(()) if st.tripped => {
                Err(std::io::Error::other("an earlier fsync of this log failed; this one proves nothing"))
            }
            Ok(()) => {
                if covered.generation == st.generation {
                    st.synced_to = st.synced_to.max(covered.next_index);
                }
                Ok(())
            }
            Err(e) => {
                self.trip_locked(&mut st, &e);
                Err(e)
            }
        }
    }

    /// The index below which every entry is known durable.
    pub fn synced_to(&self) -> u64 {
        self.state().synced_to
    }

    /// Lowers the durable point to `next_index` after the log's end moved
    /// back (a Raft truncation, a log replaced): entries at or past it are
    /// new writes, durable only once flushed. Starts a new generation.
    pub fn lower_to(&self, next_index: u64) {
        let mut st = self.state();
        st.synced_to = st.synced_to.min(next_index);
        st.generation += 1;
    }

    /// Raises the durable point to `next_index`: everything below it was
    /// made durable by other means (a new segment or a snapshot's files,
    /// fsynced when put in place). Ignored after a trip.
    pub fn raise_to(&self, next_index: u64) {
        let mut st = self.state();
        if !st.tripped {
            st.synced_to = st.synced_to.max(next_index);
        }
    }

    /// Whether a flush failed on this log.
    pub fn is_tripped(&self) -> bool {
        self.state().tripped
    }

    /// Records a failed sync of the log's data (once): from the durable
    /// point on, entries are of unknown durability (see the module
    /// comment).
    pub fn trip(&self, error: &dyn std::fmt::Display) {
        let mut st = self.state();
        self.trip_locked(&mut st, error);
    }

    fn trip_locked(&self, st: &mut MarkState, error: &dyn std::fmt::Display) {
        if st.tripped {
            return;
        }
        st.tripped = true;
        let from = st.synced_to;
        tracing::error!(dir = %self.dir.display(), from_index = from, %error,
            "fsync failed: entries from this index are of unknown durability; the replica stops and cuts them when reopened");
        TRIPPED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((self.fs.incarnation(), self.dir.clone()))
            .and_modify(|f| *f = (*f).min(from))
            .or_insert(from);
        // The marker's own fsync proves nothing here; the write is what
        // matters (see the module comment).
        let path = self.dir.join(MARKER_FILE);
        let write = self.fs.open(&path, crate::vfs::OpenMode::CreateTruncate).and_then(|f| {
            f.write_all_at(encode(from).as_bytes(), 0)?;
            let _ = f.sync_data();
            Ok(())
        });
        if let Err(e) = write {
            tracing::error!(path = %path.display(), error = %e,
                "cannot write the unsynced marker; this process remembers it");
        }
    }
}

/// The index from which entries of the log in `dir` are of unknown
/// durability, if a failed fsync tripped its mark (in this process, or
/// before a restart that kept the page cache).
///
/// # Errors
/// [`StoreError::Io`] if the marker cannot be read.
pub fn marker(fs: &Fs, dir: &Path) -> Result<Option<u64>> {
    let remembered =
        TRIPPED.lock().unwrap_or_else(|p| p.into_inner()).get(&(fs.incarnation(), dir.to_owned())).copied();
    let path = dir.join(MARKER_FILE);
    let written = if fsutil::exists(&**fs, &path)? {
        let text = fsutil::read(&**fs, &path)?;
        let found = decode(&String::from_utf8_lossy(&text));
        if found.is_none() {
            tracing::warn!(path = %path.display(), "ignoring a torn unsynced marker (a power cut took the page cache)");
        }
        found
    } else {
        None
    };
    Ok(match (remembered, written) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    })
}

/// Forgets the marker of the log in `dir` once its tail was cut, durably.
///
/// # Errors
/// [`StoreError::Io`].
pub fn clear(fs: &Fs, dir: &Path) -> Result<()> {
    fsutil::remove_if_exists(&**fs, &dir.join(MARKER_FILE))?;
    fsutil::sync_dir(&**fs, dir)?;
    TRIPPED.lock().unwrap_or_else(|p| p.into_inner()).remove(&(fs.incarnation(), dir.to_owned()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_verifies_and_a_torn_one_does_not() {
        assert_eq!(decode(&encode(123)), Some(123));
        let whole = encode(123);
        for cut in 0..whole.len() {
            assert_eq!(decode(&whole[..cut]), None, "torn at {cut}: {:?}", &whole[..cut]);
        }
    }
}

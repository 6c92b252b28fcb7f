//! Snapshots of a partition replica.
//!
//! For a log, the state a new or lagging replica needs is the log itself:
//! a snapshot carries the **retained segment files** up to its last log id,
//! not just metadata, so a replica that installs it can serve every
//! retained record to consumers. Sealed segments are hard-linked (they never
//! change), the part of a segment that is still being written is copied.
//!
//! ```text
//! <replica>/snapshots/<last index>-<n>/manifest.json   meta, offsets, file list
//!                                     /<base>.seg ...   segment files
//! ```
//! The manifest leaves room for a compacted key map (`compaction` field)
//! for compacted topics.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};
use crate::fsutil;
use crate::log::PartitionLog;
use crate::producer::ProducerStates;
use crate::types::SnapshotMeta;

/// Snapshot data handed to openraft: a directory holding a manifest and
/// segment files. Read-only once built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotFiles {
    /// The snapshot directory.
    pub dir: PathBuf,
}

/// Version of the manifest format.
pub const MANIFEST_VERSION: u32 = 1;
const MANIFEST_FILE: &str = "manifest.json";

/// What a snapshot holds, written as `manifest.json` in its directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotManifest {
    /// Manifest format version.
    pub version: u32,
    /// Raft metadata: last included log id and membership.
    pub meta: SnapshotMeta,
    /// Offset one past the last record at `meta.last_log_id`: the high
    /// watermark the snapshot represents.
    pub next_offset: u64,
    /// Segment file names in the directory, in log order.
    pub segments: Vec<String>,
    /// Reserved for compacted topics: the key map file, when present.
    #[serde(default)]
    pub compaction: Option<String>,
    /// Idempotent producer state at `meta.last_log_id` (KIP-98).
    #[serde(default)]
    pub producers: ProducerStates,
}

impl SnapshotFiles {
    /// Reads and checks the manifest.
    ///
    /// # Errors
    /// [`StoreError::Io`] if it cannot be read, [`StoreError::Invalid`] if it
    /// does not parse or has an unknown version.
    pub fn manifest(&self) -> Result<SnapshotManifest> {
        let path = self.dir.join(MANIFEST_FILE);
        let bytes = fs::read(&path).map_err(|e| StoreError::io("read", &path, e))?;
        let m: SnapshotManifest = serde_json::from_slice(&bytes)
            .map_err(|e| StoreError::Invalid(format!("snapshot manifest {}: {e}", path.display())))?;
        if m.version != MANIFEST_VERSION {
            return Err(StoreError::Invalid(format!("snapshot manifest version {}", m.version)));
        }
        // Names come from another broker: plain segment file names only, so
        // none can reach outside the snapshot directory.
        if let Some(bad) = m.segments.iter().find(|n| crate::segment::parse_segment_file_name(n).is_none()) {
            return Err(StoreError::Invalid(format!("snapshot manifest names {bad:?}, not a segment file")));
        }
        Ok(m)
    }

    /// Paths of the snapshot's segment files, in log order.
    ///
    /// # Errors
    /// As [`SnapshotFiles::manifest`].
    pub fn segment_paths(&self) -> Result<Vec<PathBuf>> {
        Ok(self.manifest()?.segments.iter().map(|s| self.dir.join(s)).collect())
    }
}

/// Builds a snapshot of `log` up to `meta.last_log_id` in a new directory
/// under `root`, durably (files and directories fsynced, then renamed into
/// place).
///
/// # Errors
/// [`StoreError::Io`] on IO failure, [`StoreError::Corruption`] if a segment
/// being copied does not verify.
pub fn build(
    log: &PartitionLog,
    root: &Path,
    meta: SnapshotMeta,
    next_offset: u64,
    producers: ProducerStates,
) -> Result<SnapshotFiles> {
    let upto = meta.last_log_id.map(|l| l.index);
    let name = format!("{:020}-{}", upto.unwrap_or(0), unique_suffix());
    let building = root.join(format!("{name}.building"));
    fs::create_dir_all(&building).map_err(|e| StoreError::io("create directory", &building, e))?;
    let mut segments = Vec::new();
    if let Some(upto) = upto {
        for (src, prefix) in log.snapshot_sources(upto)? {
            let file_name = src.file_name().map(|n| n.to_owned()).unwrap_or_default();
            let dst = building.join(&file_name);
            match prefix {
                None => link_or_copy(&src, &dst)?,
                Some(len) => copy_prefix(&src, &dst, len)?,
            }
            segments.push(file_name.to_string_lossy().into_owned());
        }
    }
    let manifest = SnapshotManifest {
        version: MANIFEST_VERSION,
        meta,
        next_offset,
        segments,
        compaction: None,
        producers,
    };
    let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| StoreError::Invalid(e.to_string()))?;
    fsutil::write_durable(&building.join(MANIFEST_FILE), &bytes)?;
    let dir = root.join(&name);
    fs::rename(&building, &dir).map_err(|e| StoreError::io("rename", &dir, e))?;
    fsutil::sync_dir(root)?;
    Ok(SnapshotFiles { dir })
}

/// Copies a snapshot received from elsewhere into `root`, so it stays
/// available after the sender removes its copy.
///
/// # Errors
/// [`StoreError::Io`], or the manifest's errors.
pub fn adopt(src: &SnapshotFiles, root: &Path) -> Result<SnapshotFiles> {
    if src.dir.parent() == Some(root) {
        return Ok(src.clone());
    }
    let m = src.manifest()?;
    let name = format!("{:020}-{}", m.meta.last_log_id.map_or(0, |l| l.index), unique_suffix());
    let building = root.join(format!("{name}.building"));
    fs::create_dir_all(&building).map_err(|e| StoreError::io("create directory", &building, e))?;
    for s in m.segments.iter().map(String::as_str).chain([MANIFEST_FILE]) {
        link_or_copy(&src.dir.join(s), &building.join(s))?;
    }
    fsutil::sync_dir(&building)?;
    let dir = root.join(&name);
    fs::rename(&building, &dir).map_err(|e| StoreError::io("rename", &dir, e))?;
    fsutil::sync_dir(root)?;
    Ok(SnapshotFiles { dir })
}

/// Removes every snapshot directory under `root` except `keep`; half-built
/// ones (`*.building`) only with `building` (at open, when none is in
/// progress).
///
/// # Errors
/// [`StoreError::Io`].
pub fn remove_others(root: &Path, keep: Option<&Path>, building: bool) -> Result<()> {
    let Ok(rd) = fs::read_dir(root) else { return Ok(()) };
    for ent in rd.flatten() {
        let p = ent.path();
        let is_building = p.extension().is_some_and(|e| e == "building");
        if Some(p.as_path()) != keep && (building || !is_building) {
            fs::remove_dir_all(&p).map_err(|e| StoreError::io("remove snapshot", &p, e))?;
        }
    }
    Ok(())
}

fn unique_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn link_or_copy(src: &Path, dst: &Path) -> Result<()> {
    if fs::hard_link(src, dst).is_ok() {
        return Ok(());
    }
    fs::copy(src, dst).map_err(|e| StoreError::io("copy", dst, e))?;
    File::open(dst).and_then(|f| f.sync_data()).map_err(|e| StoreError::io("fsync", dst, e))
}

fn copy_prefix(src: &Path, dst: &Path, len: u64) -> Result<()> {
    let mut from = File::open(src).map_err(|e| StoreError::io("open", src, e))?.take(len);
    let mut to = File::create(dst).map_err(|e| StoreError::io("create", dst, e))?;
    std::io::copy(&mut from, &mut to).map_err(|e| StoreError::io("copy", dst, e))?;
    to.flush().and_then(|_| to.sync_data()).map_err(|e| StoreError::io("fsync", dst, e))
}

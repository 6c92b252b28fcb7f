//! Snapshots of a partition replica.
//!
//! For a log, the state a new or lagging replica needs is the log itself:
//! a snapshot carries the **retained segment files** up to its last log id,
//! not just metadata, so a replica that installs it can serve every
//! retained record to consumers. Every segment is hard-linked (copied only
//! where the file system cannot link): sealed segments never change, and the segment still being
//! written is only appended to past what the snapshot holds, so the
//! manifest records how many of its bytes belong to the snapshot
//! (`prefix_bytes`); that prefix is fsynced before the link is made. A
//! snapshot of a log being written therefore costs no disk space and no
//! copy: it used to copy the active segment's prefix, up to a whole
//! segment per snapshot, which at high write rates doubled the bytes
//! written and held disk space retention had freed.
//!
//! Whoever reads a linked file reads only its prefix: the sender streams
//! that many bytes ([`SnapshotFiles::segments`]), and an install copies
//! just the prefix of a file longer than it. The log never cuts a file
//! another name links to in place (`Segment::truncate_at` copies the kept
//! part instead), so a snapshot's prefix cannot shrink.
//!
//! ```text
//! <replica>/snapshots/<last index>-<n>/manifest.json   meta, offsets, file list, prefixes
//!                                     /<base>.seg ...   segment files (hard links)
//! ```
//! The manifest leaves room for a compacted key map (`compaction` field)
//! for compacted topics.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};
use crate::fsutil;
use crate::log::PartitionLog;
use crate::producer::ProducerStates;
use crate::types::SnapshotMeta;
use crate::vfs::{Fs, Vfs};

/// Snapshot data handed to openraft: a directory holding a manifest and
/// segment files. Read-only once built. Two are equal when they name the
/// same directory.
#[derive(Clone, Debug)]
pub struct SnapshotFiles {
    /// The file system the directory is on.
    pub fs: Fs,
    /// The snapshot directory.
    pub dir: PathBuf,
}

impl PartialEq for SnapshotFiles {
    fn eq(&self, other: &Self) -> bool {
        self.dir == other.dir
    }
}
impl Eq for SnapshotFiles {}

/// Newest version of the manifest format. Version 1 (still read) held
/// the Raft library's own JSON of the snapshot metadata; version 2 holds
/// Ferrolog's (`meta_json`), since the manifest travels to other brokers
/// with the snapshot's files; version 3 adds `prefix_bytes`. A manifest
/// with prefixes is written as version 3, so a broker of an older version
/// (after a downgrade) refuses it instead of reading a linked file whole;
/// one without, and every manifest sent to a peer
/// ([`SnapshotFiles::manifest_for_peer`]), as version 2.
pub const MANIFEST_VERSION: u32 = 3;
/// The version written for a manifest without prefixes.
const MANIFEST_VERSION_WHOLE: u32 = 2;
/// The manifest's file name in a snapshot directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// What a snapshot holds, written as `manifest.json` in its directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotManifest {
    /// Manifest format version.
    pub version: u32,
    /// Raft metadata: last included log id and membership.
    #[serde(with = "meta_json")]
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
    /// The log start offset retention had set (0 in manifests written
    /// before retention): the installing replica serves nothing below it.
    #[serde(default)]
    pub log_start_offset: u64,
    /// The compaction target applied at `meta.last_log_id` (absent before
    /// compaction): the installing replica compacts its copy to it.
    #[serde(default)]
    pub compaction_target: Option<crate::compaction::CompactionTarget>,
    /// Segment files of which the snapshot holds only the first so many
    /// bytes (the log's active segment, linked while it grows); any other
    /// file is held whole. Absent in manifests of older versions, which
    /// ignore it: a sender streams only the prefix, so what they receive
    /// is whole.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prefix_bytes: BTreeMap<String, u64>,
}

impl SnapshotFiles {
    /// The snapshot in `dir` on `fs`.
    pub fn new(fs: Fs, dir: PathBuf) -> Self {
        Self { fs, dir }
    }

    /// Reads and checks the manifest.
    ///
    /// # Errors
    /// [`StoreError::Io`] if it cannot be read, [`StoreError::Invalid`] if it
    /// does not parse or has an unknown version.
    pub fn manifest(&self) -> Result<SnapshotManifest> {
        let path = self.dir.join(MANIFEST_FILE);
        let bytes = fsutil::read(&*self.fs, &path)?;
        let m: SnapshotManifest = serde_json::from_slice(&bytes)
            .map_err(|e| StoreError::Invalid(format!("snapshot manifest {}: {e}", path.display())))?;
        if !(1..=MANIFEST_VERSION).contains(&m.version) {
            return Err(StoreError::Invalid(format!("snapshot manifest version {}", m.version)));
        }
        // Names come from another broker: plain segment file names only, so
        // none can reach outside the snapshot directory.
        if let Some(bad) = m.segments.iter().find(|n| crate::segment::parse_segment_file_name(n).is_none()) {
            return Err(StoreError::Invalid(format!("snapshot manifest names {bad:?}, not a segment file")));
        }
        if let Some(bad) = m.prefix_bytes.keys().find(|n| !m.segments.contains(n)) {
            return Err(StoreError::Invalid(format!(
                "snapshot manifest gives a prefix of {bad:?}, not one of its segments"
            )));
        }
        Ok(m)
    }

    /// The manifest as a peer receives it: the sender streams only each
    /// file's prefix, so every file arrives whole, and the manifest goes
    /// without `prefix_bytes`, as version 2 (which brokers of older minor
    /// versions read).
    ///
    /// # Errors
    /// As [`SnapshotFiles::manifest`].
    pub fn manifest_for_peer(&self) -> Result<Vec<u8>> {
        let mut m = self.manifest()?;
        m.prefix_bytes.clear();
        m.version = m.version.min(MANIFEST_VERSION_WHOLE);
        serde_json::to_vec_pretty(&m).map_err(|e| StoreError::Invalid(e.to_string()))
    }

    /// Checks that every file the manifest lists holds at least the bytes
    /// the snapshot needs of it (its whole length, or its prefix), before
    /// anything is replaced with it.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] naming a file that is missing or too short;
    /// as [`SnapshotFiles::manifest`].
    pub fn check_lengths(&self) -> Result<()> {
        for (path, prefix) in self.segments()? {
            let len = self.fs.metadata(&path).map_err(|e| StoreError::io("stat", &path, e))?.len;
            if prefix.is_some_and(|p| len < p) {
                return Err(StoreError::Invalid(format!(
                    "snapshot file {} holds {len} bytes, its manifest {}",
                    path.display(),
                    prefix.unwrap_or(0)
                )));
            }
        }
        Ok(())
    }

    /// The snapshot's segment files, in log order, each with the bytes of
    /// it the snapshot holds: `None` for the whole file, `Some(n)` for its
    /// first `n` bytes (see the module comment).
    ///
    /// # Errors
    /// As [`SnapshotFiles::manifest`].
    pub fn segments(&self) -> Result<Vec<(PathBuf, Option<u64>)>> {
        let m = self.manifest()?;
        Ok(m.segments.iter().map(|s| (self.dir.join(s), m.prefix_bytes.get(s).copied())).collect())
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
    log_start_offset: u64,
    compaction_target: crate::compaction::CompactionTarget,
) -> Result<SnapshotFiles> {
    let upto = meta.last_log_id.map(|l| l.index);
    let name = format!("{:020}-{}", upto.unwrap_or(0), unique_suffix());
    let building = root.join(format!("{name}.building"));
    let fs = log.fs().clone();
    fs.create_dir_all(&building).map_err(|e| StoreError::io("create directory", &building, e))?;
    let mut segments = Vec::new();
    let mut prefix_bytes = BTreeMap::new();
    if let Some(upto) = upto {
        for (src, prefix) in log.snapshot_sources(upto, log_start_offset)? {
            let file_name = src.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let dst = building.join(&file_name);
            match prefix {
                None => {
                    fsutil::link_or_copy(&*fs, &src, &dst)?;
                }
                Some(len) => {
                    // The prefix must survive a power cut whatever the flush
                    // policy: fsynced through the log's durable point, which
                    // refuses after a failed fsync ([`crate::unsynced`]).
                    log.sync()?;
                    if link_prefix(&*fs, &src, &dst, len)? {
                        prefix_bytes.insert(file_name.clone(), len);
                    }
                }
            }
            segments.push(file_name);
        }
    }
    let manifest = SnapshotManifest {
        version: if prefix_bytes.is_empty() { MANIFEST_VERSION_WHOLE } else { MANIFEST_VERSION },
        meta,
        next_offset,
        segments,
        compaction: None,
        producers,
        log_start_offset,
        compaction_target: (compaction_target.through > 0).then_some(compaction_target),
        prefix_bytes,
    };
    let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| StoreError::Invalid(e.to_string()))?;
    fsutil::write_durable(&*fs, &building.join(MANIFEST_FILE), &bytes)?;
    let dir = root.join(&name);
    fs.rename(&building, &dir).map_err(|e| StoreError::io("rename", &dir, e))?;
    fsutil::sync_dir(&*fs, root)?;
    Ok(SnapshotFiles { fs, dir })
}

/// Copies a snapshot received from elsewhere into `root`, so it stays
/// available after the sender removes its copy.
///
/// # Errors
/// [`StoreError::Io`], or the manifest's errors.
pub fn adopt(src: &SnapshotFiles, root: &Path) -> Result<SnapshotFiles> {
    src.check_lengths()?;
    if src.dir.parent() == Some(root) {
        return Ok(src.clone());
    }
    let m = src.manifest()?;
    let name = format!("{:020}-{}", m.meta.last_log_id.map_or(0, |l| l.index), unique_suffix());
    let building = root.join(format!("{name}.building"));
    let fs = src.fs.clone();
    fs.create_dir_all(&building).map_err(|e| StoreError::io("create directory", &building, e))?;
    for s in m.segments.iter().map(String::as_str).chain([MANIFEST_FILE]) {
        fsutil::link_or_copy(&*fs, &src.dir.join(s), &building.join(s))?;
    }
    fsutil::sync_dir(&*fs, &building)?;
    let dir = root.join(&name);
    fs.rename(&building, &dir).map_err(|e| StoreError::io("rename", &dir, e))?;
    fsutil::sync_dir(&*fs, root)?;
    Ok(SnapshotFiles { fs, dir })
}

/// Removes every snapshot directory under `root` except `keep`; half-built
/// ones (`*.building`) only with `building` (at open, when none is in
/// progress).
///
/// # Errors
/// [`StoreError::Io`].
pub fn remove_others(fs: &dyn Vfs, root: &Path, keep: Option<&Path>, building: bool) -> Result<()> {
    let Ok(names) = fs.list(root) else { return Ok(()) };
    for name in names {
        let p = root.join(name);
        let is_building = p.extension().is_some_and(|e| e == "building");
        if Some(p.as_path()) != keep && (building || !is_building) {
            fs.remove_dir_all(&p).map_err(|e| StoreError::io("remove snapshot", &p, e))?;
        }
    }
    Ok(())
}

/// A suffix no other snapshot directory of the replica has: random, from
/// the generator a simulation seeds (a clock's reading could repeat there).
fn unique_suffix() -> u64 {
    crate::runtime::random_u64()
}

/// Makes the first `len` bytes of `src` (a segment still being appended
/// to, which the caller fsynced so the prefix survives a power cut
/// whatever the flush policy) part of a snapshot at `dst`: hard-links it.
/// Returns true
/// for a link (only the prefix belongs to the snapshot), false when linking
/// is not possible and the prefix was copied instead.
///
/// # Errors
/// [`StoreError::Io`].
fn link_prefix(fs: &dyn Vfs, src: &Path, dst: &Path, len: u64) -> Result<bool> {
    if fs.hard_link(src, dst).is_ok() {
        return Ok(true);
    }
    fsutil::copy_prefix(fs, src, dst, Some(len))?;
    Ok(false)
}

/// The manifest's snapshot metadata in Ferrolog's own JSON: the same fields
/// as the peer protocol's `SnapshotMeta` (`ferrolog_raft_store::wire`).
/// Reads the Raft library's JSON too (manifest version 1).
mod meta_json {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::types::{Membership, Node, SnapshotMeta, StoredMembership, log_id};

    #[derive(Serialize, Deserialize)]
    struct LogIdJson {
        term: u64,
        leader_node: u64,
        index: u64,
    }

    #[derive(Serialize, Deserialize)]
    struct NodeJson {
        node: u64,
        addr: String,
    }

    #[derive(Serialize, Deserialize)]
    struct MetaJson {
        last_log_id: Option<LogIdJson>,
        membership_log_id: Option<LogIdJson>,
        /// Voter sets: one, or two during a joint-consensus change.
        voters: Vec<Vec<u64>>,
        /// Voters and learners with their peer addresses, ids ascending.
        nodes: Vec<NodeJson>,
    }

    fn to_json(l: Option<&crate::types::LogId>) -> Option<LogIdJson> {
        l.map(|l| LogIdJson { term: l.leader_id.term, leader_node: l.leader_id.node_id, index: l.index })
    }

    pub(super) fn serialize<S: Serializer>(m: &SnapshotMeta, s: S) -> Result<S::Ok, S::Error> {
        let membership = m.last_membership.membership();
        MetaJson {
            last_log_id: to_json(m.last_log_id.as_ref()),
            membership_log_id: to_json(m.last_membership.log_id().as_ref()),
            voters: membership.get_joint_config().iter().map(|set| set.iter().copied().collect()).collect(),
            nodes: membership.nodes().map(|(id, n)| NodeJson { node: *id, addr: n.addr.clone() }).collect(),
        }
        .serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SnapshotMeta, D::Error> {
        // The manifest is always JSON: look at the shape, then read it.
        let value = serde_json::Value::deserialize(d)?;
        if value.get("voters").is_none() {
            let m = serde_json::from_value::<SnapshotMeta>(value).map_err(serde::de::Error::custom)?;
            // The Raft library's JSON is not checked as it is read: check its
            // membership as the current form is checked, or a manifest would
            // be accepted here that its copy for a peer (written in the
            // current form) makes the peer refuse (found by fuzzing).
            let membership = m.last_membership.membership();
            let membership = crate::wire::membership_from_wire(&crate::wire::membership_to_wire(membership))
                .map_err(serde::de::Error::custom)?;
            return Ok(SnapshotMeta {
                last_log_id: m.last_log_id,
                last_membership: StoredMembership::new(*m.last_membership.log_id(), membership),
            });
        }
        let m: MetaJson = serde_json::from_value(value).map_err(serde::de::Error::custom)?;
        let from = |l: Option<LogIdJson>| l.map(|l| log_id(l.term, l.leader_node, l.index));
        let nodes: BTreeMap<u64, Node> =
            m.nodes.into_iter().map(|n| (n.node, Node { addr: n.addr })).collect();
        let membership =
            Membership::new(m.voters.into_iter().map(|v| v.into_iter().collect()).collect(), nodes)
                .map_err(serde::de::Error::custom)?;
        Ok(SnapshotMeta {
            last_log_id: from(m.last_log_id),
            last_membership: StoredMembership::new(from(m.membership_log_id), membership),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Membership, Node, StoredMembership, log_id};

    #[test]
    fn manifests_hold_our_own_metadata_json_and_old_ones_still_read() {
        let nodes: std::collections::BTreeMap<u64, Node> =
            (1..=3).map(|id| (id, Node { addr: format!("10.0.0.{id}:9093") })).collect();
        let membership = Membership::new(vec![[1, 2].into(), [2, 3].into()], nodes).unwrap();
        let manifest = SnapshotManifest {
            version: MANIFEST_VERSION_WHOLE,
            meta: SnapshotMeta {
                last_log_id: Some(log_id(4, 2, 99)),
                last_membership: StoredMembership::new(Some(log_id(3, 1, 50)), membership),
            },
            next_offset: 1234,
            segments: vec!["00000000000000000000.seg".into()],
            compaction: None,
            producers: ProducerStates::default(),
            log_start_offset: 17,
            compaction_target: None,
            prefix_bytes: BTreeMap::new(),
        };
        let text = serde_json::to_value(&manifest).unwrap();
        assert_eq!(text["log_start_offset"], 17);
        assert!(text.get("prefix_bytes").is_none(), "no prefixes, no field: {text}");
        assert_eq!(text["version"], 2);
        assert_eq!(
            text["meta"],
            serde_json::json!({
                "last_log_id": {"term": 4, "leader_node": 2, "index": 99},
                "membership_log_id": {"term": 3, "leader_node": 1, "index": 50},
                "voters": [[1, 2], [2, 3]],
                "nodes": [
                    {"node": 1, "addr": "10.0.0.1:9093"},
                    {"node": 2, "addr": "10.0.0.2:9093"},
                    {"node": 3, "addr": "10.0.0.3:9093"},
                ],
            })
        );
        assert_eq!(serde_json::from_value::<SnapshotManifest>(text.clone()).unwrap(), manifest);

        // Version 1, literal as the first brokers wrote it (openraft
        // 0.10.0-alpha.37's JSON of the same metadata; not made by the
        // openraft linked now, so an upgrade that changes it fails here).
        let old = r#"{"compaction":null,"meta":{"last_log_id":{"index":99,"leader_id":{"node_id":2,"term":4}},"last_membership":{"log_id":{"index":50,"leader_id":{"node_id":1,"term":3}},"membership":{"configs":[[1,2],[2,3]],"nodes":{"1":{"addr":"10.0.0.1:9093"},"2":{"addr":"10.0.0.2:9093"},"3":{"addr":"10.0.0.3:9093"}}}},"snapshot_id":""},"next_offset":1234,"producers":{"producers":{}},"segments":["00000000000000000000.seg"],"version":1}"#;
        let read = serde_json::from_str::<SnapshotManifest>(old).unwrap();
        assert_eq!(read.version, 1);
        assert_eq!(read.meta, manifest.meta);
    }

    /// Found by the `snapshot_manifest` fuzz target
    /// (fuzz/regressions/snapshot_manifest/): a version 1 manifest whose
    /// membership is not a valid configuration (an empty voter set, a voter
    /// without an address) was accepted, and its copy for a peer, written
    /// in the current form, was refused by the peer.
    #[test]
    fn version_1_manifests_with_an_invalid_membership_are_refused() {
        let crash = r#"{"meta":{"l":{"k":{}},"last_membership":{"membership":{"configs":[[]],"nodes":{"1":{"addr":""}}}},"":""},"next_offset":4,"segments":[],"version":1}"#;
        let no_address = r#"{"meta":{"last_log_id":null,"last_membership":{"log_id":null,"membership":{"configs":[[1,2,3]],"nodes":{"1":{"addr":"a"},"2":{"addr":"b"}}}},"snapshot_id":""},"next_offset":4,"segments":[],"version":1}"#;
        for json in [crash, no_address] {
            assert!(serde_json::from_str::<SnapshotManifest>(json).is_err(), "{json}");
        }
    }
}

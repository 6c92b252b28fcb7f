//! A data directory's identity: `<data_dir>/broker.json` holds the broker id,
//! a random incarnation created with the directory, and the broker's node
//! id in the metadata group. A broker that comes back with a new
//! incarnation lost its data (a wiped disk): the controller gives its
//! replicas new Raft node ids, so a node id is never reused with an empty
//! log (a replica that forgot its votes must not vote under its old id).

use std::path::Path;

use ferrolog_raft_store::vfs::Vfs;

use serde::{Deserialize, Serialize};

use crate::config::BrokerId;

/// File name of the identity inside the data directory.
pub const IDENTITY_FILE: &str = "broker.json";

/// What `broker.json` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The broker id the directory belongs to.
    pub broker_id: BrokerId,
    /// Random, non-zero, fixed for the directory's lifetime.
    pub incarnation: u64,
    /// This broker's Raft node id in the metadata group; 0 while a join
    /// (`BrokerConfig::join`) is under way: the controller has not answered
    /// yet, and the next start asks again with the same incarnation.
    pub metadata_node: u64,
    /// This directory founded the metadata group (it may initialize it);
    /// false for a broker that joined a formed cluster.
    #[serde(default)]
    pub founder: bool,
}

impl Identity {
    /// Whether this directory's join has not been answered yet (see
    /// [`Identity::metadata_node`]).
    pub fn join_pending(&self) -> bool {
        self.metadata_node == 0
    }
}

/// A random non-zero id (incarnations, boot ids), from the generator a
/// simulation seeds ([`ferrolog_raft_store::runtime::random_u64`]).
pub fn random_id() -> u64 {
    ferrolog_raft_store::runtime::random_u64().max(1)
}

/// Loads the identity of `data_dir`, or `None` for a directory that has
/// none yet (new, or wiped).
///
/// # Errors
/// An unreadable or malformed file, or one that names another broker id.
pub fn load(fs: &dyn Vfs, data_dir: &Path, broker_id: BrokerId) -> anyhow::Result<Option<Identity>> {
    let id = load_any(fs, data_dir)?;
    if let Some(id) = &id {
        anyhow::ensure!(
            id.broker_id == broker_id,
            "{} belongs to broker {}, but this is broker {broker_id}",
            data_dir.join(IDENTITY_FILE).display(),
            id.broker_id
        );
    }
    Ok(id)
}

/// Loads the identity of `data_dir` whatever broker id it names (a broker
/// started without an id takes the one its directory was given).
///
/// # Errors
/// An unreadable or malformed file.
pub fn load_any(fs: &dyn Vfs, data_dir: &Path) -> anyhow::Result<Option<Identity>> {
    let path = data_dir.join(IDENTITY_FILE);
    match ferrolog_raft_store::read_if_exists(fs, &path) {
        Ok(Some(bytes)) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("{} is damaged: {e}", path.display())),
        Ok(None) => Ok(None),
        Err(e) => Err(anyhow::anyhow!("reading {}: {e}", path.display())),
    }
}

/// A new identity for `broker_id` (not stored: the caller stores it once it
/// has decided how the directory enters the cluster).
pub fn fresh(broker_id: BrokerId) -> Identity {
    Identity { broker_id, incarnation: random_id(), metadata_node: u64::from(broker_id), founder: false }
}

/// Writes the identity durably on `fs` (temp file, fsync, rename, fsync of
/// the directory).
///
/// # Errors
/// IO errors, naming the file.
pub fn store(fs: &dyn Vfs, data_dir: &Path, id: &Identity) -> anyhow::Result<()> {
    let path = data_dir.join(IDENTITY_FILE);
    let bytes = serde_json::to_vec_pretty(id)?;
    ferrolog_raft_store::write_durable(fs, &path, &bytes)
        .map_err(|e| anyhow::anyhow!("writing the broker identity {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use ferrolog_raft_store::RealFs;
    use ferrolog_raft_store::vfs::{FaultyFs, PowerCut};

    use super::*;

    #[test]
    fn stored_then_loaded_and_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(load(&RealFs, dir.path(), 3).expect("load"), None);
        let a = fresh(3);
        assert_ne!(a.incarnation, 0);
        store(&RealFs, dir.path(), &a).expect("store");
        assert_eq!(load(&RealFs, dir.path(), 3).expect("load"), Some(a));
        assert!(load(&RealFs, dir.path(), 4).is_err());
        std::fs::write(dir.path().join(IDENTITY_FILE), b"{").expect("write");
        assert!(load(&RealFs, dir.path(), 3).is_err());
    }

    /// On the disk that keeps only what fsync covered: a stored identity
    /// survives a power cut, and a rewrite cut by the power at any of its
    /// steps leaves the old identity or the new one, whole, never none or
    /// a torn file (the broker would refuse to start on either).
    #[test]
    fn a_power_cut_leaves_the_old_identity_or_the_new_one_whole() {
        let dir = Path::new("/data");
        let (old, new) = (fresh(3), fresh(3));
        let mut outcomes = std::collections::BTreeSet::new();
        for ops in 1..=8u64 {
            for how in [PowerCut::Clean, PowerCut::Torn] {
                let disk = FaultyFs::new(ops);
                let fs = disk.mount();
                ferrolog_raft_store::create_dir_durable(&*fs, dir).expect("mkdir");
                store(&*fs, dir, &old).expect("store");
                disk.power_cut(PowerCut::Torn);
                let fs = disk.mount();
                assert_eq!(
                    load(&*fs, dir, 3).expect("load"),
                    Some(old.clone()),
                    "a stored identity was lost"
                );
                disk.power_cut_after(ops, how);
                let stored = store(&*fs, dir, &new).is_ok();
                if stored {
                    disk.power_cut(how);
                }
                let after = load(&*disk.mount(), dir, 3).expect("a whole identity after the cut");
                if stored {
                    assert_eq!(after.as_ref(), Some(&new), "an identity stored before the cut was lost");
                }
                assert!(after.as_ref() == Some(&old) || after.as_ref() == Some(&new), "{after:?}");
                outcomes.insert(after.as_ref() == Some(&new));
            }
        }
        assert_eq!(outcomes.len(), 2, "the cuts must land both before and after the rewrite took");
    }
}

//! Small, crash-safe metadata of a partition replica in a redb database:
//! the vote, the committed log id, the Raft purge pointer and the current
//! snapshot's metadata. Values are JSON so an operator can read them.

use std::path::{Path, PathBuf};

use redb::{Database, Durability, ReadableDatabase, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Result, StoreError};

const TABLE: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("replica_meta");

/// Key of the persisted vote (Raft paper Figure 2: `currentTerm`, `votedFor`).
pub const KEY_VOTE: &str = "vote";
/// Key of the last committed log id known to this replica.
pub const KEY_COMMITTED: &str = "committed";
/// Key of the Raft purge pointer (last purged log id).
pub const KEY_PURGED: &str = "purged";
/// Key of `(index, offset)` where the log begins when no segment file
/// exists, written durably before the log is replaced.
pub const KEY_EMPTY_START: &str = "empty_start";
/// Key of the current snapshot's metadata.
pub const KEY_SNAPSHOT: &str = "snapshot";
/// Key of the reason this replica may have lost acknowledged entries and
/// must not vote until a leader has brought it back (absent: it has not).
pub const KEY_RECOVERING: &str = "recovering";
/// Key present (durably) only between a clean stop, with every segment
/// fsynced, and the next open: its absence at open means the replica may
/// have lost writes it had not fsynced.
pub const KEY_CLEAN_STOP: &str = "clean_stop";

/// How durable a metadata write must be when it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sync {
    /// fsynced before returning (the vote: Raft paper §5.2 requires it).
    Durable,
    /// Atomic, and durable with the next durable write; a crash may roll it
    /// back to an earlier value, never to a torn one.
    Lazy,
}

/// The metadata database of one replica.
pub struct MetaStore {
    db: Database,
    path: PathBuf,
}

impl std::fmt::Debug for MetaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaStore").field("path", &self.path).finish()
    }
}

/// redb's page cache per replica's metadata database, bytes.
const META_CACHE_BYTES: usize = 16 << 10;

impl MetaStore {
    /// Opens or creates the database at `path`.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if redb cannot open it.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.exists() {
            // redb's first write of a new file is not atomic: a crash during
            // it leaves a file redb refuses to open. Create it aside, make
            // it durable, then rename it into place.
            let fresh = path.with_extension("redb-new");
            crate::fsutil::remove_if_exists(&fresh)?;
            drop(Database::create(&fresh).map_err(|e| meta_err(&fresh, e))?);
            std::fs::File::open(&fresh)
                .and_then(|f| f.sync_all())
                .map_err(|e| StoreError::io("fsync", &fresh, e))?;
            std::fs::rename(&fresh, path).map_err(|e| StoreError::io("rename", path, e))?;
            crate::fsutil::sync_dir(path.parent().unwrap_or(Path::new(".")))?;
        }
        // A few keys of a few bytes each: redb's default page cache (sized
        // for large databases) only costs memory, once per replica.
        let db = redb::Builder::new()
            .set_cache_size(META_CACHE_BYTES)
            .create(path)
            .map_err(|e| meta_err(path, e))?;
        let me = Self { db, path: path.to_owned() };
        // Create the table so reads never see it missing.
        let txn = me.db.begin_write().map_err(|e| meta_err(path, e))?;
        txn.open_table(TABLE).map_err(|e| meta_err(path, e))?;
        txn.commit().map_err(|e| meta_err(path, e))?;
        Ok(me)
    }

    /// Reads and decodes the value under `key`.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if redb fails or the value does not decode.
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        let p = &self.path;
        let txn = self.db.begin_read().map_err(|e| meta_err(p, e))?;
        let table = txn.open_table(TABLE).map_err(|e| meta_err(p, e))?;
        let Some(v) = table.get(key).map_err(|e| meta_err(p, e))? else { return Ok(None) };
        serde_json::from_slice(v.value()).map(Some).map_err(|e| meta_err(p, format!("decode {key}: {e}")))
    }

    /// Writes `value` under `key` (or removes the key for `None`).
    ///
    /// # Errors
    /// [`StoreError::Meta`] if redb fails, including a full disk.
    pub fn put<T: Serialize>(&self, key: &str, value: Option<&T>, sync: Sync) -> Result<()> {
        let p = &self.path;
        let mut txn = self.db.begin_write().map_err(|e| meta_err(p, e))?;
        let durability = match sync {
            Sync::Durable => Durability::Immediate,
            Sync::Lazy => Durability::None,
        };
        txn.set_durability(durability).map_err(|e| meta_err(p, e))?;
        {
            let mut table = txn.open_table(TABLE).map_err(|e| meta_err(p, e))?;
            match value {
                Some(v) => {
                    let bytes = serde_json::to_vec(v).map_err(|e| meta_err(p, e))?;
                    table.insert(key, bytes.as_slice()).map_err(|e| meta_err(p, e))?;
                }
                None => {
                    table.remove(key).map_err(|e| meta_err(p, e))?;
                }
            }
        }
        txn.commit().map_err(|e| meta_err(p, e))
    }
}

fn meta_err(path: &Path, e: impl std::fmt::Display) -> StoreError {
    StoreError::Meta { path: path.to_owned(), detail: e.to_string() }
}

//! Small, crash-safe metadata of a partition replica: the vote, the
//! committed log id, the Raft purge pointer and the current snapshot's
//! metadata. Kept in the shared database of its directory
//! ([`MetaDb`](crate::meta_db::MetaDb), which commits many replicas'
//! writes together). Values are JSON so an operator can read them.

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Result, StoreError};
use crate::meta_db::{Claim, MetaDb};

/// Name of the metadata database each replica kept in its log directory
/// before metadata moved to one database per directory of replicas; moved
/// into the shared one (and removed) when the replica opens.
pub const LEGACY_META_FILE: &str = "meta.redb";

/// The replica name of a log or replica that has a database of its own
/// (the shared database in its own directory, under the name `.`).
pub const ALONE: &str = ".";

/// Key of the persisted vote (Raft paper Figure 2: `currentTerm`, `votedFor`).
pub const KEY_VOTE: &str = "vote";
/// Key of the last committed log id known to this replica.
pub const KEY_COMMITTED: &str = "committed";
/// Key of the Raft purge pointer (last purged log id).
pub const KEY_PURGED: &str = "purged";
/// Key of `(index, offset)` where the log begins when no segment file
/// exists, written durably before the log is replaced.
pub const KEY_EMPTY_START: &str = "empty_start";
/// Key set (durably) while a snapshot's segments are being imported into
/// the log and cleared once the imported tail is rolled past: an open that
/// finds it rolls a tail another name links, so a file a snapshot holds
/// whole is never appended to.
pub const KEY_IMPORTING: &str = "importing";
/// Key of the log start offset set by retention (absent: 0; see
/// [`crate::PartitionLog::advance_log_start`]).
pub const KEY_LOG_START: &str = "log_start";
/// Key of the compaction target the replica applied (absent: none; see
/// [`crate::PartitionLog::set_compaction_target`]).
pub const KEY_COMPACTION: &str = "compaction";
/// Key of the current snapshot's metadata.
pub const KEY_SNAPSHOT: &str = "snapshot";
/// Key of the reason this replica may have lost acknowledged entries and
/// must not vote until a leader has brought it back (absent: it has not).
pub const KEY_RECOVERING: &str = "recovering";
/// Key of the index below which every entry was flushed (acknowledged as
/// durable), recorded lazily: a log found ending below it at open lost
/// entries it had acknowledged (bit rot in its last frames, say, which
/// looks like a torn tail), so it must not vote until a leader brought it
/// back. Lowered durably before the log's end moves back.
pub const KEY_FLUSHED: &str = "flushed_to";
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

/// The metadata of one replica: its keys in the shared database, and the
/// values in memory (a few small ones) so reads cost nothing. Holds the
/// replica's claim on its name (see [`MetaDb::claim`]) until dropped (or
/// until a failed open returns).
pub struct MetaStore {
    db: Arc<MetaDb>,
    claim: Claim,
    values: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

impl std::fmt::Debug for MetaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaStore").field("db", &self.db.path()).field("name", &self.claim.name()).finish()
    }
}

impl MetaStore {
    /// Opens the metadata of replica `name` in `db`. With `fresh` (the
    /// replica's directory was just created), keys an earlier replica of
    /// that name may have left are removed first. A database the replica
    /// kept itself in an earlier version (`legacy`, if it exists) replaces
    /// its keys: its rows are written durably, then the file is removed
    /// (there is no way back to that layout: a downgrade would find no
    /// metadata).
    ///
    /// # Errors
    /// [`StoreError::Meta`] if the replica is open already, or a database
    /// cannot be read or written; [`StoreError::Io`] if the legacy file
    /// cannot be checked or removed.
    pub fn open(db: Arc<MetaDb>, name: &str, legacy: Option<&Path>, fresh: bool) -> Result<Self> {
        let claim = db.claim(name)?;
        // Earlier versions kept it in a file of the OS's file system.
        let legacy = match legacy.filter(|_| db.fs().is_os()) {
            Some(l) if l.try_exists().map_err(|e| StoreError::io("stat", l, e))? => Some(l),
            _ => None,
        };
        if let Some(legacy) = legacy {
            let rows = read_legacy(legacy)?;
            let keys = rows.len();
            futures::executor::block_on(db.replace(&claim, rows))?;
            std::fs::remove_file(legacy).map_err(|e| StoreError::io("remove", legacy, e))?;
            crate::fsutil::sync_dir(&crate::vfs::RealFs, legacy.parent().unwrap_or(Path::new(".")))?;
            tracing::info!(from = %legacy.display(), to = %db.path().display(), keys,
                "moved a replica's metadata into its directory's shared database");
        }
        let loaded = db.load(&claim, fresh && legacy.is_none());
        let values = futures::executor::block_on(loaded)?.into_iter().collect();
        Ok(Self { db, claim, values: Arc::new(Mutex::new(values)) })
    }

    /// A new handle on the same replica's metadata, taking its claim over
    /// ([`MetaDb::reclaim`]): for reopening a replica in place after a
    /// storage error, while clones of the old handle may still be alive.
    /// Its values are read back from the database after everything queued
    /// so far (as [`MetaStore::open`] does), not copied from this handle: a
    /// reopen that failed midway may have written decisions since (the
    /// replica recovering, the unsynced tail cut) that this handle never
    /// saw. The old handle's writes are refused from now on.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if the database cannot be read (or the commit
    /// queued before the read failed: the disk still failing).
    pub fn reopen(&self) -> Result<Self> {
        let claim = self.db.reclaim(self.claim.name());
        let values = futures::executor::block_on(self.db.load(&claim, false))?.into_iter().collect();
        Ok(Self { db: self.db.clone(), claim, values: Arc::new(Mutex::new(values)) })
    }

    /// Reads and decodes the value under `key`.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if the value does not decode.
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        let values = self.values.lock().unwrap_or_else(|p| p.into_inner());
        let Some(v) = values.get(key) else { return Ok(None) };
        serde_json::from_slice(v).map(Some).map_err(|e| self.err(format!("decode {key}: {e}")))
    }

    /// Writes `value` under `key` (or removes the key for `None`); a
    /// durable write returns once it is fsynced.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if a durable write fails, including a full disk.
    pub fn put<T: Serialize>(&self, key: &str, value: Option<&T>, sync: Sync) -> Result<()> {
        match sync {
            Sync::Durable => futures::executor::block_on(self.put_durable(key, value)?),
            Sync::Lazy => {
                let bytes = encode(value).map_err(|e| self.err(e))?;
                remember(&self.values, key, bytes.clone());
                self.db.put_lazy(&self.claim, key, bytes);
                Ok(())
            }
        }
    }

    /// Queues a durable write of `value` under `key` and returns a future
    /// that resolves once it is fsynced (for async callers: a Raft vote
    /// waits there without holding a thread, so votes of many replicas
    /// share one commit). [`MetaStore::get`] sees the value once written.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if the value does not encode; the future's
    /// error if the write fails.
    pub fn put_durable<T: Serialize>(
        &self,
        key: &str,
        value: Option<&T>,
    ) -> Result<impl Future<Output = Result<()>> + Send + 'static + use<T>> {
        let bytes = encode(value).map_err(|e| self.err(e))?;
        let written = self.db.put_durable(&self.claim, key, bytes.clone());
        let (values, key) = (self.values.clone(), key.to_owned());
        Ok(async move {
            written.await?;
            remember(&values, &key, bytes);
            Ok(())
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Meta { path: self.db.path().to_owned(), detail: format!("{}: {e}", self.claim.name()) }
    }
}

fn encode<T: Serialize>(value: Option<&T>) -> serde_json::Result<Option<Vec<u8>>> {
    value.map(serde_json::to_vec).transpose()
}

fn remember(values: &Mutex<HashMap<String, Vec<u8>>>, key: &str, bytes: Option<Vec<u8>>) {
    let mut values = values.lock().unwrap_or_else(|p| p.into_inner());
    match bytes {
        Some(b) => values.insert(key.to_owned(), b),
        None => values.remove(key),
    };
}

/// Every row of a per-replica database of an earlier version.
fn read_legacy(path: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    const TABLE: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("replica_meta");
    let err = |e: &dyn std::fmt::Display| StoreError::Meta { path: path.to_owned(), detail: e.to_string() };
    let db = Database::open(path).map_err(|e| err(&e))?;
    let txn = db.begin_read().map_err(|e| err(&e))?;
    let table = match txn.open_table(TABLE) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(err(&e)),
    };
    let mut rows = Vec::new();
    for row in table.iter().map_err(|e| err(&e))? {
        let (k, v) = row.map_err(|e| err(&e))?;
        rows.push((k.value().to_owned(), v.value().to_vec()));
    }
    Ok(rows)
}

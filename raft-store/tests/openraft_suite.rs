//! openraft's own storage conformance suite, run against the real store on
//! real files.

use openraft::StorageError;
use openraft::testing::log::{StoreBuilder, Suite};
use openraft::type_config::TypeConfigExt;

use ferrolog_raft_store::types::TypeConfig;
use ferrolog_raft_store::{Flusher, LogStore, PartitionStateMachine, Replica, StoreConfig};

struct Builder {
    flusher: Flusher,
}

impl StoreBuilder<TypeConfig, LogStore, PartitionStateMachine, tempfile::TempDir> for Builder {
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, PartitionStateMachine), StorageError<TypeConfig>> {
        let dir = tempfile::tempdir().map_err(|e| StorageError::read(TypeConfig::err_from_error(&e)))?;
        let replica = Replica::open(dir.path(), StoreConfig::default(), self.flusher.clone())
            .map_err(|e| StorageError::read(TypeConfig::err_from_error(&std::io::Error::from(e))))?;
        Ok((dir, replica.log_store(), replica.state_machine()))
    }
}

#[test]
fn openraft_storage_suite_passes() {
    let flusher = Flusher::spawn("suite").expect("flusher");
    TypeConfig::run(async move {
        Suite::test_all(Builder { flusher }).await.expect("openraft storage suite");
    });
}

#[test]
fn openraft_storage_suite_passes_with_tiny_segments() {
    // Segments of 4 KiB with a 1-byte index interval: every entry lands near
    // a roll or an index row, so the suite exercises multi-segment paths.
    struct Tiny(Flusher);
    impl StoreBuilder<TypeConfig, LogStore, PartitionStateMachine, tempfile::TempDir> for Tiny {
        async fn build(
            &self,
        ) -> Result<(tempfile::TempDir, LogStore, PartitionStateMachine), StorageError<TypeConfig>> {
            let dir = tempfile::tempdir().map_err(|e| StorageError::read(TypeConfig::err_from_error(&e)))?;
            let config =
                StoreConfig { segment_bytes: 4096, index_interval_bytes: 1, ..StoreConfig::default() };
            let replica = Replica::open(dir.path(), config, self.0.clone())
                .map_err(|e| StorageError::read(TypeConfig::err_from_error(&std::io::Error::from(e))))?;
            Ok((dir, replica.log_store(), replica.state_machine()))
        }
    }
    let flusher = Flusher::spawn("suite-tiny").expect("flusher");
    TypeConfig::run(async move {
        Suite::test_all(Tiny(flusher)).await.expect("openraft storage suite, tiny segments");
    });
}

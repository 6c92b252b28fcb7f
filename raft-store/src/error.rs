//! Errors of the storage layer.

use std::io;
use std::path::PathBuf;

use crate::format::DecodeError;

/// An error from the partition store. Converted to `std::io::Error` at the
/// openraft boundary (openraft's storage traits speak `io::Error`), keeping
/// the message with file and position.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An IO call failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Data on disk failed its checksum or does not parse, at a place where
    /// a torn write is impossible (a sealed segment, or before the tail).
    /// The replica refuses to serve it rather than drop it silently.
    #[error("corruption in {path} at byte {position}: {source}")]
    Corruption {
        /// The file.
        path: PathBuf,
        /// Byte position of the bad structure in the file.
        position: u64,
        /// What was wrong.
        #[source]
        source: DecodeError,
    },
    /// The metadata database failed.
    #[error("metadata store {path}: {detail}")]
    Meta {
        /// The database file.
        path: PathBuf,
        /// redb's message.
        detail: String,
    },
    /// A caller broke the store's contract (for example appended a
    /// non-consecutive index). Never caused by disk or network input.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The requested offset is outside the log: below the log start offset
    /// or above the log end offset.
    #[error("offset {offset} out of range [{log_start_offset}, {log_end_offset}]")]
    OffsetOutOfRange {
        /// The offset asked for.
        offset: u64,
        /// First offset still stored.
        log_start_offset: u64,
        /// Offset the next record will get.
        log_end_offset: u64,
    },
}

impl StoreError {
    /// Wraps an `io::Error` with the operation and path.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io { op, path: path.into(), source }
    }
}

impl From<StoreError> for io::Error {
    fn from(e: StoreError) -> Self {
        let kind = match &e {
            StoreError::Io { source, .. } => source.kind(),
            StoreError::Corruption { .. } => io::ErrorKind::InvalidData,
            StoreError::Meta { .. } => io::ErrorKind::Other,
            StoreError::Invalid(_) | StoreError::OffsetOutOfRange { .. } => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, e)
    }
}

/// Result of a storage operation.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

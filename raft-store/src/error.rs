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

/// The field a [`StoreError::Corruption`] names when a batch's frame
/// verified but its records did not decode as the caller's codec expects
/// (see [`StoreError::is_damage`]).
pub const RECORD_TIMESTAMPS_FIELD: &str = "record timestamps";

impl StoreError {
    /// Wraps an `io::Error` with the operation and path.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io { op, path: path.into(), source }
    }

    /// Whether this is damage to what the disk holds: a frame that fails
    /// its checksum or does not parse, which opening the log with every
    /// segment verified finds and sets aside. Records that do not decode
    /// inside a frame that verified are not (the caller's codec disagrees
    /// with what was stored; verifying the segments again would not help).
    pub fn is_damage(&self) -> bool {
        match self {
            Self::Corruption { source: DecodeError::Invalid { field, .. }, .. } => {
                *field != RECORD_TIMESTAMPS_FIELD
            }
            Self::Corruption { .. } => true,
            _ => false,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn corruption(source: DecodeError) -> StoreError {
        StoreError::Corruption { path: "/x.seg".into(), position: 8, source }
    }

    #[test]
    fn damage_is_what_verifying_the_segments_finds() {
        assert!(corruption(DecodeError::Checksum { stored: 1, computed: 2 }).is_damage());
        assert!(corruption(DecodeError::Truncated { needed: 9, available: 3 }).is_damage());
        assert!(corruption(DecodeError::Invalid { field: "length", detail: "too long".into() }).is_damage());
        let codec = DecodeError::Invalid { field: RECORD_TIMESTAMPS_FIELD, detail: "bad varint".into() };
        assert!(!corruption(codec).is_damage(), "a codec's disagreement is not damage");
        assert!(!StoreError::Invalid("caller".into()).is_damage());
    }
}

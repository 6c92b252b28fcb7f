//! Checksums and lengths recomputed in place. A fuzzer almost never
//! guesses a CRC32C, so without these every mutation of a checksummed
//! structure stops at its checksum check; a target applies them when a
//! flag bit of its input says so, and otherwise feeds the bytes as they
//! are (which keeps the checksum checks themselves under test).

use ferrolog_raft_store::format;

/// Recomputes the CRC32C of every segment frame laid back to back in
/// `b` (the layout of a segment file after its header, and of an
/// AppendEntries request's `entries`), from the start until a length
/// prefix is out of bounds or runs past the end.
pub fn frame_crcs(b: &mut [u8]) {
    let mut at = 0;
    while let Ok(len) = format::frame_len(&b[at..]) {
        if at + len > b.len() {
            return; // a frame cut short: the torn tail stays torn
        }
        let crc = crc32c::crc32c(&b[at + 8..at + len]);
        b[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
        at += len;
    }
}

/// Recomputes the trailing CRC32C of a sealed segment's index file (the
/// last 4 bytes, over every byte before them).
pub fn index_crc(b: &mut [u8]) {
    if b.len() < 4 {
        return;
    }
    let n = b.len() - 4;
    let crc = crc32c::crc32c(&b[..n]);
    b[n..].copy_from_slice(&crc.to_le_bytes());
}

/// Recomputes the CRC32C of a segment file header (bytes 32..36, over
/// bytes 0..32).
pub fn segment_header_crc(b: &mut [u8]) {
    if b.len() < format::SEGMENT_HEADER_BYTES {
        return;
    }
    let crc = crc32c::crc32c(&b[..32]);
    b[32..36].copy_from_slice(&crc.to_le_bytes());
}

/// Makes a Kafka record batch's length field (bytes 8..12, big-endian:
/// the bytes after it) and CRC-32C (bytes 17..21, over bytes 21..) agree
/// with the bytes given.
pub fn kafka_batch(b: &mut [u8]) {
    if b.len() < 21 {
        return;
    }
    let len = i32::try_from(b.len() - 12).unwrap_or(i32::MAX);
    b[8..12].copy_from_slice(&len.to_be_bytes());
    let crc = crc32c::crc32c(&b[21..]);
    b[17..21].copy_from_slice(&crc.to_be_bytes());
}

/// Makes a stored Kafka payload's CRC-32C (bytes 1..5: the payload tag,
/// then the batch from its CRC on) agree with the bytes after it.
pub fn kafka_payload(b: &mut [u8]) {
    if b.len() < 5 {
        return;
    }
    let crc = crc32c::crc32c(&b[5..]);
    b[1..5].copy_from_slice(&crc.to_be_bytes());
}

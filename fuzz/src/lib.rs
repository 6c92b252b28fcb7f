//! Helpers shared by Ferrolog's fuzz targets (`fuzz_targets/*.rs`) and the
//! seed generator (`examples/seeds.rs`). See `fuzz/README.md`.
//!
//! - [`Input`]: takes flags and numbers off the front of a fuzz input.
//! - [`fixup`]: recomputes the checksums and lengths a fuzzer cannot
//!   forge, so that a target can reach the code behind a CRC check.
//! - [`kafka`]: the invariants of a Kafka record batch that the produce
//!   path accepted, shared by the `kafka_request` and
//!   `kafka_record_batch` targets.
//! - [`seeds`]: small valid inputs made by Ferrolog's own encoders.

pub mod fixup;
pub mod kafka;
pub mod seeds;

/// A cursor over a fuzz input: flags and numbers are taken off the front,
/// and what is left is the body. A short input gives zeros, never a panic.
#[derive(Debug)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    /// The next byte (0 once the input is used up).
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                *b
            }
            None => 0,
        }
    }

    /// The next 8 bytes, little-endian (missing bytes read as 0).
    pub fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        let n = self.data.len().min(8);
        b[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        u64::from_le_bytes(b)
    }

    /// The next 2 bytes, little-endian (missing bytes read as 0).
    pub fn u16(&mut self) -> u16 {
        u16::from(self.u8()) | (u16::from(self.u8()) << 8)
    }

    /// The next `n` bytes, or fewer at the end.
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (a, b) = self.data.split_at(n);
        self.data = b;
        a
    }

    /// Whether everything was taken.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Everything not taken yet.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

/// The positions a segment's three lookups give for fuzzed queries: by
/// log index (folded into the segment's span from `base_index`), by offset
/// and by timestamp; the ones that found something.
pub fn lookup_positions(
    seg: &ferrolog_raft_store::segment::Segment,
    base_index: u64,
    (by_index, by_offset, by_time): (u64, u64, u64),
) -> impl Iterator<Item = u64> {
    let span = seg.next_index().wrapping_sub(base_index).wrapping_add(1).max(1);
    [
        seg.position_of_index(base_index.wrapping_add(by_index % span)),
        seg.position_of_offset(by_offset),
        seg.position_of_timestamp(by_time as i64),
    ]
    .into_iter()
    .flatten()
}

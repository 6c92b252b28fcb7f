//! Kafka's default partitioner, so that a key lands on the same partition
//! number as it would in Kafka with the same partition count.
//!
//! - Records with a key: `(murmur2(key) & 0x7fffffff) % partitions`, with
//!   murmur2 exactly as Kafka's `org.apache.kafka.common.utils.Utils.murmur2`
//!   (seed `0x9747b28c`, little-endian 4-byte blocks, Java `int` arithmetic).
//! - Records without a key: sticky partitioning (KIP-480): all go to one
//!   partition until its batch is closed, then to the next partition
//!   (round-robin here, where Kafka picks at random), so that keyless
//!   records fill whole batches instead of many small ones.

use std::collections::HashMap;

/// Kafka's murmur2 hash of `data` (`Utils.murmur2`), as a Java `int`.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;

    let mut h: u32 = SEED ^ data.len() as u32;
    let mut blocks = data.chunks_exact(4);
    for block in &mut blocks {
        let mut k = u32::from_le_bytes([block[0], block[1], block[2], block[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = blocks.remainder();
    if !tail.is_empty() {
        // Kafka's switch falls through from case 3 to case 1.
        if tail.len() == 3 {
            h ^= u32::from(tail[2]) << 16;
        }
        if tail.len() >= 2 {
            h ^= u32::from(tail[1]) << 8;
        }
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition of a keyed record among `partitions` (> 0), as Kafka's
/// `BuiltInPartitioner.partitionForKey`: `toPositive(murmur2(key)) % partitions`.
pub fn partition_for_key(key: &[u8], partitions: u32) -> u32 {
    debug_assert!(partitions > 0);
    ((murmur2(key) & 0x7fff_ffff) as u32) % partitions.max(1)
}

/// Chooses partitions for keyless records: sticks to one partition per
/// topic until [`StickyPartitioner::batch_closed`] reports that its batch
/// was closed, then moves to the next one (KIP-480).
#[derive(Debug, Default)]
pub struct StickyPartitioner {
    current: HashMap<String, u32>,
}

impl StickyPartitioner {
    /// The partition for the next keyless record of `topic`.
    pub fn partition(&mut self, topic: &str, partitions: u32) -> u32 {
        let partitions = partitions.max(1);
        if let Some(p) = self.current.get(topic)
            && *p < partitions
        {
            return *p;
        }
        // Spread producers that start together: begin at a partition derived
        // from the process id and topic rather than always at 0.
        let start = partition_for_key(format!("{}/{topic}", std::process::id()).as_bytes(), partitions);
        self.current.insert(topic.to_owned(), start);
        start
    }

    /// The batch of `topic`'s `partition` was closed (full or sent): the
    /// next keyless record goes to the following partition. Batches closed
    /// on other partitions do not move the sticky choice.
    pub fn batch_closed(&mut self, topic: &str, partition: u32, partitions: u32) {
        if let Some(p) = self.current.get_mut(topic)
            && *p == partition
        {
            *p = (partition + 1) % partitions.max(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values of Kafka's `Utils.murmur2`: the first four and the last one
    /// from Kafka's `UtilsTest`, the rest computed by an independent
    /// Python transcription of the Java code.
    #[test]
    fn murmur2_matches_kafka() {
        let cases: &[(&[u8], i32)] = &[
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58_897_971),
            (b"", 275_646_681),
            (b"a", -1_563_381_124),
            (b"ab", 316_155_434),
            (b"abc", 479_470_107),
            (b"abcd", -1_323_649_548),
            (b"N14228", -1_499_626_080),
            (b"\xff\xfe\x80", -160_726_397),
        ];
        for (data, want) in cases {
            assert_eq!(murmur2(data), *want, "murmur2({:?})", String::from_utf8_lossy(data));
        }
    }

    #[test]
    fn keyed_partitions_match_kafka() {
        assert_eq!(partition_for_key(b"21", 7), 3);
        assert_eq!(partition_for_key(b"foobar", 12), 6);
        assert_eq!(partition_for_key(b"a-little-bit-long-string", 3), 2);
        assert_eq!(partition_for_key(b"N14228", 12), 8);
        assert_eq!(partition_for_key(b"", 12), 9);
        assert_eq!(partition_for_key(b"anything", 1), 0);
    }

    #[test]
    fn sticky_moves_only_when_its_batch_closes() {
        let mut s = StickyPartitioner::default();
        let first = s.partition("t", 3);
        assert_eq!(s.partition("t", 3), first);
        s.batch_closed("t", (first + 1) % 3, 3);
        assert_eq!(s.partition("t", 3), first, "another partition's batch does not move it");
        s.batch_closed("t", first, 3);
        assert_eq!(s.partition("t", 3), (first + 1) % 3);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..3 {
            let p = s.partition("t", 3);
            seen.insert(p);
            s.batch_closed("t", p, 3);
        }
        assert_eq!(seen.len(), 3, "round-robin visits every partition");
        assert!(s.partition("t", 1) < 1, "a shrunken count is respected");
    }
}

//! Kafka's compression codecs for record batches (the attributes' bits
//! 0–2): gzip (RFC 1952), snappy (raw, or in snappy-java's "xerial"
//! framing), LZ4 frames (KIP-57) and zstd (KIP-110), each through a
//! well-kept crate.
//!
//! Decompression is bounded (a zip bomb costs an error, not memory);
//! compression is used only where a topic's `compression.type` names a
//! codec other than the producer's, and writes what every Kafka client
//! reads: gzip members, xerial-framed snappy in 32 KiB blocks (as the Java
//! client writes it), LZ4 frames of independent 64 KiB blocks, zstd at
//! level 3 (Kafka's default level).

use std::io::{Read, Write};

use super::kafka_batch::BatchError;

/// A compression codec of the attributes (Kafka's `compression.type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// Not compressed.
    None,
    /// gzip (RFC 1952).
    Gzip,
    /// Snappy, raw or in snappy-java's ("xerial") framing.
    Snappy,
    /// LZ4 frame format (KIP-57).
    Lz4,
    /// Zstandard (KIP-110).
    Zstd,
}

impl Codec {
    /// The codec of id `id` (a batch's attribute bits 0–2).
    ///
    /// # Errors
    /// An id Kafka does not define.
    pub fn from_id(id: i16) -> Result<Self, String> {
        Ok(match id {
            0 => Codec::None,
            1 => Codec::Gzip,
            2 => Codec::Snappy,
            3 => Codec::Lz4,
            4 => Codec::Zstd,
            other => return Err(format!("unknown compression codec {other} in the batch attributes")),
        })
    }

    /// Its id in a batch's attributes (bits 0–2).
    pub fn id(self) -> i16 {
        match self {
            Codec::None => 0,
            Codec::Gzip => 1,
            Codec::Snappy => 2,
            Codec::Lz4 => 3,
            Codec::Zstd => 4,
        }
    }

    /// The codec a topic's `compression.type` asks for: `None` for
    /// `producer` (batches kept as the producer compressed them), else the
    /// codec (`uncompressed` is [`Codec::None`]). Values are checked when
    /// the config is set (`metadata::topic_config`); an unknown one reads as
    /// `producer`.
    pub fn for_topic(compression_type: &str) -> Option<Self> {
        Some(match compression_type {
            "uncompressed" => Codec::None,
            "gzip" => Codec::Gzip,
            "snappy" => Codec::Snappy,
            "lz4" => Codec::Lz4,
            "zstd" => Codec::Zstd,
            _ => return None,
        })
    }

    /// Kafka's name of the codec (a producer's `compression.type`).
    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Gzip => "gzip",
            Codec::Snappy => "snappy",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }
}

/// Decompresses `data` of `codec`, at most `max` bytes out.
///
/// # Errors
/// [`BatchError::Corrupt`] when the data does not decompress;
/// [`BatchError::TooLarge`] past `max`.
pub fn decompress(codec: Codec, data: &[u8], max: usize) -> Result<Vec<u8>, BatchError> {
    let corrupt = |e: &dyn std::fmt::Display| BatchError::Corrupt(format!("{} data: {e}", codec.name()));
    let too_large = || {
        BatchError::TooLarge(format!(
            "the batch's records decompress ({}) to more than {max} bytes",
            codec.name()
        ))
    };
    let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
    let mut out = Vec::new();
    match codec {
        Codec::None => out.extend_from_slice(data),
        Codec::Gzip => {
            flate2::read::MultiGzDecoder::new(data)
                .take(limit)
                .read_to_end(&mut out)
                .map_err(|e| corrupt(&e))?;
        }
        Codec::Zstd => {
            let mut d = zstd::stream::read::Decoder::new(data).map_err(|e| corrupt(&e))?;
            // A window of at most 16 MiB (2^24): zstd's default cap is 128 MiB.
            d.window_log_max(24).map_err(|e| corrupt(&e))?;
            d.take(limit).read_to_end(&mut out).map_err(|e| corrupt(&e))?;
        }
        Codec::Lz4 => {
            lz4_flex::frame::FrameDecoder::new(data)
                .take(limit)
                .read_to_end(&mut out)
                .map_err(|e| corrupt(&e))?;
        }
        Codec::Snappy => snappy(data, max, &mut out).map_err(|e| match e {
            SnappyError::TooLarge => too_large(),
            SnappyError::Corrupt(m) => corrupt(&m),
        })?,
    }
    if out.len() > max {
        return Err(too_large());
    }
    Ok(out)
}

/// The header of snappy-java's framing ("xerial"), which the Java client
/// and librdkafka write: magic, then version 1 and compatible version 1.
const XERIAL_MAGIC: &[u8; 8] = b"\x82SNAPPY\x00";

enum SnappyError {
    TooLarge,
    Corrupt(String),
}

/// Snappy: xerial-framed (16-byte header, then blocks each preceded by its
/// big-endian i32 length) or one raw block.
fn snappy(data: &[u8], max: usize, out: &mut Vec<u8>) -> Result<(), SnappyError> {
    let block = |b: &[u8], out: &mut Vec<u8>| -> Result<(), SnappyError> {
        let n = snap::raw::decompress_len(b).map_err(|e| SnappyError::Corrupt(e.to_string()))?;
        if out.len().saturating_add(n) > max {
            return Err(SnappyError::TooLarge);
        }
        let at = out.len();
        out.resize(at + n, 0);
        snap::raw::Decoder::new()
            .decompress(b, &mut out[at..])
            .map_err(|e| SnappyError::Corrupt(e.to_string()))?;
        Ok(())
    };
    if data.len() >= 16 && &data[..8] == XERIAL_MAGIC {
        let mut at = 16;
        while at < data.len() {
            let len_bytes: [u8; 4] = data
                .get(at..at + 4)
                .and_then(|s| s.try_into().ok())
                .ok_or_else(|| SnappyError::Corrupt("a block length is cut short".into()))?;
            let len = usize::try_from(i32::from_be_bytes(len_bytes))
                .map_err(|_| SnappyError::Corrupt("a negative block length".into()))?;
            let b = data
                .get(at + 4..at + 4 + len)
                .ok_or_else(|| SnappyError::Corrupt("a block is cut short".into()))?;
            block(b, out)?;
            at += 4 + len;
        }
        Ok(())
    } else {
        block(data, out)
    }
}

/// Compresses `data` with `codec` (see the module comment for the forms
/// written).
///
/// # Errors
/// A message when the codec's library fails (it does not on memory input).
pub fn compress(codec: Codec, data: &[u8]) -> Result<Vec<u8>, String> {
    let fail = |e: &dyn std::fmt::Display| format!("{} compression: {e}", codec.name());
    match codec {
        Codec::None => Ok(data.to_vec()),
        Codec::Gzip => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(data).map_err(|e| fail(&e))?;
            e.finish().map_err(|e| fail(&e))
        }
        Codec::Snappy => {
            let mut out = Vec::with_capacity(16 + data.len() / 2);
            out.extend_from_slice(XERIAL_MAGIC);
            out.extend_from_slice(&1i32.to_be_bytes());
            out.extend_from_slice(&1i32.to_be_bytes());
            let mut encoder = snap::raw::Encoder::new();
            for block in data.chunks(XERIAL_BLOCK_BYTES) {
                let compressed = encoder.compress_vec(block).map_err(|e| fail(&e))?;
                let len = i32::try_from(compressed.len()).map_err(|e| fail(&e))?;
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(&compressed);
            }
            Ok(out)
        }
        Codec::Lz4 => {
            let info = lz4_flex::frame::FrameInfo::new()
                .block_size(lz4_flex::frame::BlockSize::Max64KB)
                .block_mode(lz4_flex::frame::BlockMode::Independent);
            let mut e = lz4_flex::frame::FrameEncoder::with_frame_info(info, Vec::new());
            e.write_all(data).map_err(|e| fail(&e))?;
            e.finish().map_err(|e| fail(&e))
        }
        Codec::Zstd => zstd::bulk::compress(data, ZSTD_LEVEL).map_err(|e| fail(&e)),
    }
}

/// Block size of the xerial snappy framing written, bytes (snappy-java's default).
const XERIAL_BLOCK_BYTES: usize = 32 << 10;

/// zstd level written (Kafka's default, `compression.zstd.level`).
const ZSTD_LEVEL: i32 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_codec_round_trips_and_refuses_past_the_bound() {
        let data: Vec<u8> = (0..200_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        for codec in [Codec::None, Codec::Gzip, Codec::Snappy, Codec::Lz4, Codec::Zstd] {
            let c = compress(codec, &data).expect("compress");
            if codec != Codec::None {
                assert!(c.len() < data.len() / 2, "{codec:?} compressed {} to {}", data.len(), c.len());
            }
            assert_eq!(decompress(codec, &c, data.len()).expect("decompress"), data, "{codec:?}");
            assert!(
                matches!(decompress(codec, &c, data.len() - 1), Err(BatchError::TooLarge(_))),
                "{codec:?}: a bound one byte short is refused"
            );
            assert_eq!(Codec::from_id(codec.id()), Ok(codec));
        }
        assert!(Codec::from_id(5).is_err());
        assert_eq!(Codec::for_topic("producer"), None);
        assert_eq!(Codec::for_topic("uncompressed"), Some(Codec::None));
        assert_eq!(Codec::for_topic("zstd"), Some(Codec::Zstd));
    }
}

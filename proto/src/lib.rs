//! Ferrolog's protobuf schema and the gRPC code generated from it.
//!
//! - [`raft`]: the broker-to-broker Raft transport (`ferrolog/raft/v1/raft.proto`).
//! - [`client`]: the client API: produce, fetch, offsets, metadata, topics
//!   (`ferrolog/client/v1/client.proto`).
//! - [`groups`]: the records of the internal topic `__consumer_offsets`
//!   (`ferrolog/groups/v1/offsets.proto`): committed offsets and group state.

/// Broker-to-broker Raft transport, package `ferrolog.raft.v1`.
#[allow(missing_docs, clippy::all, rust_2018_idioms)]
pub mod raft {
    tonic::include_proto!("ferrolog.raft.v1");
}

/// The client API, package `ferrolog.client.v1`.
#[allow(missing_docs, clippy::all, rust_2018_idioms)]
pub mod client {
    tonic::include_proto!("ferrolog.client.v1");
}

/// The records of `__consumer_offsets`, package `ferrolog.groups.v1`.
#[allow(missing_docs, clippy::all, rust_2018_idioms)]
pub mod groups {
    tonic::include_proto!("ferrolog.groups.v1");
}

/// A topic's identity (Kafka's KIP-516 topic id): 128 bits assigned by the
/// controller when the topic is created, never given to another topic or to
/// a later incarnation of the same name. On the wire it is 16 bytes,
/// big-endian (`TopicInfo.topic_id` and the `topic_id` of Produce, Fetch,
/// Subscribe and ListOffsets requests); empty bytes mean "no id" (a client
/// from before topic ids). Shown as a UUID, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
///
/// New topics get random version-4 UUIDs, so they are never below 2^64;
/// topics created before ids existed get their first partition's Raft group
/// id (below 2^64, and group ids are never reused), so the two never meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TopicId(pub u128);

impl TopicId {
    /// Length of the wire form, bytes.
    pub const WIRE_LEN: usize = 16;

    /// A random version-4 UUID (RFC 4122 version and variant bits set) from
    /// 128 random bits.
    pub fn v4_from_random(random: u128) -> Self {
        let version_cleared = random & !(0xF_u128 << 76);
        let variant_cleared = version_cleared & !(0x3_u128 << 62);
        TopicId(variant_cleared | (0x4_u128 << 76) | (0x2_u128 << 62))
    }

    /// The wire form: 16 bytes, big-endian.
    pub fn to_wire(self) -> prost::bytes::Bytes {
        prost::bytes::Bytes::copy_from_slice(&self.0.to_be_bytes())
    }

    /// Decodes a request's `topic_id` field: `Ok(None)` for empty bytes
    /// (not checked) and for all zeros (the nil UUID, never assigned).
    ///
    /// # Errors
    /// A message naming the length when it is neither 0 nor 16 bytes.
    pub fn from_wire(bytes: &[u8]) -> Result<Option<Self>, String> {
        if bytes.is_empty() {
            return Ok(None);
        }
        let array: [u8; Self::WIRE_LEN] =
            bytes.try_into().map_err(|_| format!("topic_id must be 0 or 16 bytes, got {}", bytes.len()))?;
        let id = u128::from_be_bytes(array);
        Ok((id != 0).then_some(TopicId(id)))
    }
}

impl std::fmt::Display for TopicId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = format!("{:032x}", self.0);
        write!(f, "{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
    }
}

impl std::str::FromStr for TopicId {
    type Err = String;

    /// Parses the UUID form (dashes optional, 32 hex digits).
    fn from_str(s: &str) -> Result<Self, String> {
        let hex: String = s.chars().filter(|c| *c != '-').collect();
        if hex.len() != 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(format!("{s:?} is not a topic id (32 hex digits, as a UUID)"));
        }
        u128::from_str_radix(&hex, 16).map(TopicId).map_err(|e| format!("{s:?}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::TopicId;

    #[test]
    fn topic_ids_round_trip_and_v4_ids_stay_clear_of_group_ids() {
        let id = TopicId::v4_from_random(u128::MAX);
        assert_eq!(TopicId::from_wire(&id.to_wire()), Ok(Some(id)));
        assert_eq!(id.to_string().parse::<TopicId>(), Ok(id));
        assert_eq!(&id.to_string()[14..15], "4", "version 4: {id}");
        assert!(TopicId::v4_from_random(0).0 > u128::from(u64::MAX));
        assert_eq!(TopicId(5).to_string(), "00000000-0000-0000-0000-000000000005");
        assert_eq!(TopicId::from_wire(&[]), Ok(None));
        assert_eq!(TopicId::from_wire(&[0; 16]), Ok(None));
        assert!(TopicId::from_wire(&[1; 3]).is_err());
        assert!("xyz".parse::<TopicId>().is_err());
    }
}

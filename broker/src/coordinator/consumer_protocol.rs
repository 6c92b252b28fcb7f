//! What the coordinator reads of a "consumer" group's member metadata and
//! assignments, which it otherwise stores and passes on as opaque bytes.
//! They come in two encodings:
//!
//! - Kafka clients: `ConsumerProtocolSubscription` and
//!   `ConsumerProtocolAssignment` (Kafka's `ConsumerProtocol`): a
//!   big-endian int16 version, then the fields of that version, not
//!   flexible. Every version begins with the field read here (the
//!   subscribed topics; the assigned topic-partitions), and later versions
//!   only add fields after it, so any version ≥ 0 is read the same way, as
//!   Kafka's own reader does.
//! - Ferrolog's client library: the protobuf `ConsumerSubscription` and
//!   `ConsumerAssignment` of `proto/ferrolog/client/v1`.
//!
//! A Kafka encoding is at least 2 bytes and begins with 0x00 (the version's
//! high byte); a protobuf message never does (field number 0 is invalid),
//! so the first byte tells them apart. The bytes come from clients: the
//! reader checks every length against the bytes left, allocates only for
//! what it has read, and refuses a topic name longer than Kafka's 249
//! bytes, so what it returns is never much larger than its input.
//!
//! Kafka clients describing a group (DescribeGroups) decode these bytes as
//! Kafka's encoding: [`kafka_subscription`] and [`kafka_assignment`] give
//! them that, converting the client library's protobuf.

use bytes::{BufMut, Bytes, BytesMut};
use ferrolog_proto::client::{ConsumerAssignment, ConsumerSubscription};
use prost::Message;

/// Longest topic name Kafka allows, bytes.
const TOPIC_NAME_MAX_BYTES: usize = 249;

/// The topics a member's metadata subscribes to; `None` when it decodes as
/// neither encoding, or is empty (a member without metadata for the
/// group's protocol: Kafka cannot read that either, and takes it as
/// subscribed to anything).
pub fn subscribed_topics(metadata: &[u8]) -> Option<Vec<String>> {
    if metadata.is_empty() {
        return None;
    }
    if is_kafka(metadata) {
        let mut r = Reader(&metadata[2..]);
        return r.array(Reader::topic);
    }
    ConsumerSubscription::decode(metadata).ok().map(|s| s.topics)
}

/// The topics of an assignment, each with its partitions; `None` when it
/// decodes as neither encoding (empty bytes are no partitions).
pub fn assigned_partitions(assignment: &[u8]) -> Option<Vec<(String, Vec<u32>)>> {
    if is_kafka(assignment) {
        let mut r = Reader(&assignment[2..]);
        return r.array(|r| {
            let topic = r.topic()?;
            let partitions = r.array(|r| u32::try_from(r.i32()?).ok())?;
            Some((topic, partitions))
        });
    }
    let a = ConsumerAssignment::decode(assignment).ok()?;
    let mut out: Vec<(String, Vec<u32>)> = Vec::new();
    for p in a.partitions {
        match out.last_mut() {
            Some((t, ps)) if *t == p.topic => ps.push(p.partition),
            _ => out.push((p.topic, vec![p.partition])),
        }
    }
    Some(out)
}

/// A member's metadata as Kafka clients read it: Kafka's encoding as it
/// came; the client library's protobuf as a `ConsumerProtocolSubscription`
/// v0 (its topics, no user data); empty when it is neither.
pub fn kafka_subscription(metadata: &Bytes) -> Bytes {
    if metadata.is_empty() || is_kafka(metadata) {
        return metadata.clone();
    }
    let Ok(s) = ConsumerSubscription::decode(metadata.as_ref()) else { return Bytes::new() };
    if s.topics.iter().any(|t| t.len() > TOPIC_NAME_MAX_BYTES) {
        return Bytes::new();
    }
    let mut b = BytesMut::new();
    b.put_i16(0);
    b.put_i32(s.topics.len() as i32);
    for t in &s.topics {
        put_string(&mut b, t);
    }
    b.put_i32(-1); // null user data
    b.freeze()
}

/// An assignment as Kafka clients read it: Kafka's encoding as it came;
/// the client library's protobuf as a `ConsumerProtocolAssignment` v0
/// (topics and partitions, no user data); empty when it is neither.
pub fn kafka_assignment(assignment: &Bytes) -> Bytes {
    if assignment.is_empty() || is_kafka(assignment) {
        return assignment.clone();
    }
    let Some(topics) = assigned_partitions(assignment) else { return Bytes::new() };
    if topics.iter().any(|(t, _)| t.len() > TOPIC_NAME_MAX_BYTES) {
        return Bytes::new();
    }
    let mut b = BytesMut::new();
    b.put_i16(0);
    b.put_i32(topics.len() as i32);
    for (t, partitions) in &topics {
        put_string(&mut b, t);
        b.put_i32(partitions.len() as i32);
        for p in partitions {
            b.put_i32(*p as i32);
        }
    }
    b.put_i32(-1); // null user data
    b.freeze()
}

/// A Kafka STRING of at most [`TOPIC_NAME_MAX_BYTES`] (callers check).
fn put_string(b: &mut BytesMut, s: &str) {
    b.put_i16(s.len() as i16);
    b.put_slice(s.as_bytes());
}

fn is_kafka(b: &[u8]) -> bool {
    b.len() >= 2 && b[0] == 0
}

/// A bounds-checked big-endian reader over Kafka's non-flexible encoding.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn i16(&mut self) -> Option<i16> {
        self.take(2).map(|b| i16::from_be_bytes([b[0], b[1]]))
    }

    fn i32(&mut self) -> Option<i32> {
        self.take(4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A topic name: a non-null STRING (int16 length, UTF-8) of at most
    /// [`TOPIC_NAME_MAX_BYTES`].
    fn topic(&mut self) -> Option<String> {
        let n = usize::try_from(self.i16()?).ok().filter(|n| *n <= TOPIC_NAME_MAX_BYTES)?;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }

    /// An ARRAY (int32 count; -1 is null, read as empty). Elements are
    /// read one by one, so a count beyond the bytes fails at the first
    /// element missing, having allocated only for those read.
    fn array<T>(&mut self, mut element: impl FnMut(&mut Self) -> Option<T>) -> Option<Vec<T>> {
        let n = self.i32()?;
        let mut out = Vec::new();
        for _ in 0..n.max(0) {
            out.push(element(self)?);
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolog_proto::client::TopicPartition;

    fn kafka_string(b: &mut Vec<u8>, s: &str) {
        b.extend_from_slice(&(s.len() as i16).to_be_bytes());
        b.extend_from_slice(s.as_bytes());
    }

    #[test]
    fn reads_kafka_subscriptions_and_assignments_of_any_version() {
        for version in [0i16, 1, 3, 7] {
            let mut sub = version.to_be_bytes().to_vec();
            sub.extend_from_slice(&2i32.to_be_bytes());
            kafka_string(&mut sub, "a");
            kafka_string(&mut sub, "bb");
            sub.extend_from_slice(&(-1i32).to_be_bytes()); // null user data; later fields ignored
            assert_eq!(subscribed_topics(&sub), Some(vec!["a".to_owned(), "bb".to_owned()]));

            let mut asg = version.to_be_bytes().to_vec();
            asg.extend_from_slice(&1i32.to_be_bytes());
            kafka_string(&mut asg, "a");
            asg.extend_from_slice(&2i32.to_be_bytes());
            asg.extend_from_slice(&0i32.to_be_bytes());
            asg.extend_from_slice(&5i32.to_be_bytes());
            assert_eq!(assigned_partitions(&asg), Some(vec![("a".to_owned(), vec![0, 5])]));
        }
    }

    #[test]
    fn reads_ferrolog_protobuf() {
        let sub = ConsumerSubscription { topics: vec!["t".into()], ..Default::default() }.encode_to_vec();
        assert_eq!(subscribed_topics(&sub), Some(vec!["t".to_owned()]));
        let asg = ConsumerAssignment {
            partitions: vec![TopicPartition { topic: "t".into(), partition: 3, ..Default::default() }],
        }
        .encode_to_vec();
        assert_eq!(assigned_partitions(&asg), Some(vec![("t".to_owned(), vec![3])]));
        assert_eq!(assigned_partitions(&[]), Some(vec![]), "an empty assignment is no partitions");
        assert_eq!(subscribed_topics(&[]), None, "no metadata is not 'no topics'");
        // Converted for Kafka clients, and read back as Kafka's encoding.
        let k = kafka_subscription(&Bytes::from(sub));
        assert_eq!((k[0], subscribed_topics(&k)), (0, Some(vec!["t".to_owned()])));
        let k = kafka_assignment(&Bytes::from(asg));
        assert_eq!((k[0], assigned_partitions(&k)), (0, Some(vec![("t".to_owned(), vec![3])])));
        assert!(kafka_assignment(&Bytes::from_static(&[0xff, 0xff])).is_empty(), "neither encoding");
    }

    #[test]
    fn damaged_bytes_are_refused_without_allocating_their_claims() {
        // A count of two billion topics in 6 bytes.
        let claim = [0u8, 0, 0x7f, 0xff, 0xff, 0xff];
        assert_eq!(subscribed_topics(&claim), None);
        assert_eq!(assigned_partitions(&claim), None);
        // A topic name over 249 bytes.
        let mut long = vec![0u8, 0, 0, 0, 0, 1, 0x01, 0x00];
        long.extend_from_slice(&[b'a'; 256]);
        assert_eq!(subscribed_topics(&long), None);
        // A string longer than what follows; invalid UTF-8; a negative partition.
        assert_eq!(subscribed_topics(&[0, 0, 0, 0, 0, 1, 0, 9, b'a']), None);
        assert_eq!(subscribed_topics(&[0, 0, 0, 0, 0, 1, 0, 1, 0xff]), None);
        let negative = [0u8, 0, 0, 0, 0, 1, 0, 1, b'a', 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(assigned_partitions(&negative), None);
    }
}

//! Walks a request body by its schema before the codec decodes it, so
//! that a malformed request costs nothing.
//!
//! The codec (kafka-protocol 0.18) sizes each array by the count it reads
//! before it has read a single element: a request of a few bytes that
//! claims two billion topics makes it ask for gigabytes at once, and a
//! failed allocation aborts the process (kafka-protocol-rs pull requests
//! 152, 161 and 200 are open on this). Here every array, string and byte
//! field of every served request is walked first, each length checked
//! against the bytes that are actually left, so the codec only ever sees
//! requests whose every element exists: what it allocates is bounded by
//! the frame (`kafka.socket_request_max_bytes`).
//!
//! The schemas below are those of Kafka's request definitions
//! (`clients/src/main/resources/common/message/*Request.json`) for the
//! versions served ([`super::versions::SUPPORTED`]). A test encodes a
//! request of every served API at every served version with the codec and
//! checks that the walk takes exactly its bytes, so a field missing here
//! fails that test rather than a client.

use kafka_protocol::messages::ApiKey;

/// A field's type.
#[derive(Clone, Copy, Debug)]
enum T {
    I8,
    I16,
    I32,
    I64,
    Bool,
    Uuid,
    /// A string (nullable ones too: the walk takes both).
    Str,
    /// Bytes, and Produce's records.
    Bytes,
    /// An array of structs of these fields.
    Arr(&'static [F]),
    /// An array of `i32`.
    I32s,
    /// An array of strings.
    Strs,
}

/// A field present in versions `from..=to`.
#[derive(Clone, Copy, Debug)]
struct F(T, i16, i16);

const ALL: i16 = i16::MAX;

const fn f(t: T, from: i16) -> F {
    F(t, from, ALL)
}

const fn upto(t: T, from: i16, to: i16) -> F {
    F(t, from, to)
}

use T::*;

const API_VERSIONS: &[F] = &[f(Str, 3), f(Str, 3)];
const METADATA: &[F] = &[f(Arr(&[f(Uuid, 10), f(Str, 0)]), 0), f(Bool, 4), upto(Bool, 8, 10), f(Bool, 8)];
const PRODUCE: &[F] = &[
    f(Str, 3),
    f(I16, 0),
    f(I32, 0),
    f(Arr(&[upto(Str, 0, 12), f(Uuid, 13), f(Arr(&[f(I32, 0), f(Bytes, 0)]), 0)]), 0),
];
const FETCH: &[F] = &[
    upto(I32, 0, 14),
    f(I32, 0),
    f(I32, 0),
    f(I32, 3),
    f(I8, 4),
    f(I32, 7),
    f(I32, 7),
    f(
        Arr(&[
            upto(Str, 0, 12),
            f(Uuid, 13),
            f(Arr(&[f(I32, 0), f(I32, 9), f(I64, 0), f(I32, 12), f(I64, 5), f(I32, 0)]), 0),
        ]),
        0,
    ),
    f(Arr(&[upto(Str, 7, 12), f(Uuid, 13), f(I32s, 7)]), 7),
    f(Str, 11),
];
const LIST_OFFSETS: &[F] = &[
    f(I32, 0),
    f(I8, 2),
    f(Arr(&[f(Str, 0), f(Arr(&[f(I32, 0), f(I32, 4), f(I64, 0), upto(I32, 0, 0)]), 0)]), 0),
    f(I32, 10),
];
const OFFSET_COMMIT: &[F] = &[
    f(Str, 0),
    f(I32, 1),
    f(Str, 1),
    f(Str, 7),
    upto(I64, 2, 4),
    f(Arr(&[f(Str, 0), f(Arr(&[f(I32, 0), f(I64, 0), f(I32, 6), upto(I64, 1, 1), f(Str, 0)]), 0)]), 0),
];
const OFFSET_FETCH: &[F] = &[upto(Str, 0, 7), upto(Arr(&[f(Str, 0), f(I32s, 0)]), 0, 7), f(Bool, 7)];
const FIND_COORDINATOR: &[F] = &[upto(Str, 0, 3), f(I8, 1), f(Strs, 4)];
const JOIN_GROUP: &[F] = &[
    f(Str, 0),
    f(I32, 0),
    f(I32, 1),
    f(Str, 0),
    f(Str, 5),
    f(Str, 0),
    f(Arr(&[f(Str, 0), f(Bytes, 0)]), 0),
    f(Str, 8),
];
const HEARTBEAT: &[F] = &[f(Str, 0), f(I32, 0), f(Str, 0), f(Str, 3)];
const LEAVE_GROUP: &[F] = &[f(Str, 0), upto(Str, 0, 2), f(Arr(&[f(Str, 3), f(Str, 3), f(Str, 5)]), 3)];
const SYNC_GROUP: &[F] =
    &[f(Str, 0), f(I32, 0), f(Str, 0), f(Str, 3), f(Str, 5), f(Str, 5), f(Arr(&[f(Str, 0), f(Bytes, 0)]), 0)];
const DESCRIBE_GROUPS: &[F] = &[f(Strs, 0), f(Bool, 3)];
const LIST_GROUPS: &[F] = &[f(Strs, 4), f(Strs, 5)];
const CREATE_TOPICS: &[F] = &[
    f(
        Arr(&[
            f(Str, 0),
            f(I32, 0),
            f(I16, 0),
            f(Arr(&[f(I32, 0), f(I32s, 0)]), 0),
            f(Arr(&[f(Str, 0), f(Str, 0)]), 0),
        ]),
        0,
    ),
    f(I32, 0),
    f(Bool, 1),
];
const DELETE_TOPICS: &[F] = &[f(Arr(&[f(Str, 6), f(Uuid, 6)]), 6), upto(Strs, 0, 5), f(I32, 0)];
const INIT_PRODUCER_ID: &[F] = &[f(Str, 0), f(I32, 0), f(I64, 3), f(I16, 3), f(Bool, 6)];
const DESCRIBE_CONFIGS: &[F] = &[f(Arr(&[f(I8, 0), f(Str, 0), f(Strs, 0)]), 0), f(Bool, 1), f(Bool, 3)];
const CREATE_PARTITIONS: &[F] =
    &[f(Arr(&[f(Str, 0), f(I32, 0), f(Arr(&[f(I32s, 0)]), 0)]), 0), f(I32, 0), f(Bool, 0)];
const DELETE_GROUPS: &[F] = &[f(Strs, 0)];
const OFFSET_DELETE: &[F] = &[f(Str, 0), f(Arr(&[f(Str, 0), f(Arr(&[f(I32, 0)]), 0)]), 0)];

/// The request schema of `api`, if it is served.
fn schema(api: ApiKey) -> Option<&'static [F]> {
    Some(match api {
        ApiKey::ApiVersions => API_VERSIONS,
        ApiKey::Metadata => METADATA,
        ApiKey::Produce => PRODUCE,
        ApiKey::Fetch => FETCH,
        ApiKey::ListOffsets => LIST_OFFSETS,
        ApiKey::OffsetCommit => OFFSET_COMMIT,
        ApiKey::OffsetFetch => OFFSET_FETCH,
        ApiKey::FindCoordinator => FIND_COORDINATOR,
        ApiKey::JoinGroup => JOIN_GROUP,
        ApiKey::Heartbeat => HEARTBEAT,
        ApiKey::LeaveGroup => LEAVE_GROUP,
        ApiKey::SyncGroup => SYNC_GROUP,
        ApiKey::DescribeGroups => DESCRIBE_GROUPS,
        ApiKey::ListGroups => LIST_GROUPS,
        ApiKey::CreateTopics => CREATE_TOPICS,
        ApiKey::DeleteTopics => DELETE_TOPICS,
        ApiKey::InitProducerId => INIT_PRODUCER_ID,
        ApiKey::DescribeConfigs => DESCRIBE_CONFIGS,
        ApiKey::CreatePartitions => CREATE_PARTITIONS,
        ApiKey::DeleteGroups => DELETE_GROUPS,
        ApiKey::OffsetDelete => OFFSET_DELETE,
        _ => return None,
    })
}

/// Checks `body` (the request after its header) of `api` at `version`:
/// every field present, every length within the bytes left. Bytes after
/// the request are allowed (the codec ignores them, as Kafka does).
///
/// # Errors
/// The first field that does not fit, or an API without a schema here.
pub fn check(api: ApiKey, version: i16, body: &[u8]) -> Result<(), String> {
    walked(api, version, body).map(|_| ())
}

/// [`check`], returning the bytes the request took.
fn walked(api: ApiKey, version: i16, body: &[u8]) -> Result<usize, String> {
    let fields = schema(api).ok_or_else(|| format!("no request schema for {api:?}"))?;
    // The request header is v2 exactly when the body is in the flexible
    // (compact, tagged) encoding (KIP-482).
    let flexible = api.request_header_version(version) >= 2;
    let mut w = Walk { b: body, at: 0, version, flexible, elements: 0 };
    w.fields(fields)?;
    Ok(w.at)
}

struct Walk<'a> {
    b: &'a [u8],
    at: usize,
    version: i16,
    flexible: bool,
    /// Array elements seen so far, over every array of the request.
    elements: usize,
}

/// Most array elements one request may hold, over all its arrays: a
/// decoded element takes up to a few hundred bytes where its encoding may
/// take one, so the frame limit alone would let a 100 MiB request of empty
/// strings decode into tens of GB. 200,000 is far above what a client
/// sends (a fetch of every partition of a broker hosting 10,000).
pub const MAX_ELEMENTS: usize = 200_000;

impl Walk<'_> {
    fn left(&self) -> usize {
        self.b.len() - self.at
    }

    fn skip(&mut self, n: usize, what: &str) -> Result<(), String> {
        if n > self.left() {
            return Err(format!("{what} of {n} bytes with {} left", self.left()));
        }
        self.at += n;
        Ok(())
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let s = self.b.get(self.at..self.at + N).ok_or("the request ends early")?;
        self.at += N;
        s.try_into().map_err(|_| "the request ends early".to_owned())
    }

    fn uvarint(&mut self) -> Result<u32, String> {
        let mut v = 0u32;
        for i in 0..5 {
            let [b] = self.fixed::<1>()?;
            v |= u32::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("an unsigned varint longer than 5 bytes".into())
    }

    /// A length (string: i16, bytes and arrays: i32; compact: uvarint − 1);
    /// `None` for null.
    fn len(&mut self, wide: bool) -> Result<Option<usize>, String> {
        let n: i64 = if self.flexible {
            i64::from(self.uvarint()?) - 1
        } else if wide {
            i64::from(i32::from_be_bytes(self.fixed::<4>()?))
        } else {
            i64::from(i16::from_be_bytes(self.fixed::<2>()?))
        };
        match n {
            -1 => Ok(None),
            n if n < -1 => Err(format!("negative length {n}")),
            // Every element or byte takes at least one byte.
            n if n as u64 > self.left() as u64 => {
                Err(format!("a length of {n} with {} bytes left", self.left()))
            }
            n => Ok(Some(n as usize)),
        }
    }

    fn field(&mut self, t: T) -> Result<(), String> {
        match t {
            I8 | Bool => self.skip(1, "a byte"),
            I16 => self.skip(2, "an int16"),
            I32 => self.skip(4, "an int32"),
            I64 => self.skip(8, "an int64"),
            Uuid => self.skip(16, "a uuid"),
            Str => {
                let n = self.len(false)?.unwrap_or(0);
                self.skip(n, "a string")
            }
            Bytes => {
                let n = self.len(true)?.unwrap_or(0);
                self.skip(n, "a bytes field")
            }
            I32s | Strs | Arr(_) => {
                let n = self.len(true)?.unwrap_or(0);
                self.elements = self.elements.saturating_add(n);
                if self.elements > MAX_ELEMENTS {
                    return Err(format!("more than {MAX_ELEMENTS} array elements in one request"));
                }
                for _ in 0..n {
                    match t {
                        I32s => self.field(I32)?,
                        Strs => self.field(Str)?,
                        Arr(inner) => self.fields(inner)?,
                        _ => unreachable!("arrays only"),
                    }
                }
                Ok(())
            }
        }
    }

    /// The fields of a struct present at this version, then (flexible) its
    /// tagged fields, skipped by their sizes.
    fn fields(&mut self, fields: &[F]) -> Result<(), String> {
        for F(t, from, to) in fields {
            if (*from..=*to).contains(&self.version) {
                self.field(*t)?;
            }
        }
        if self.flexible {
            let n = self.uvarint()?;
            if n as usize > self.left() {
                return Err(format!("{n} tagged fields with {} bytes left", self.left()));
            }
            for _ in 0..n {
                let _tag = self.uvarint()?;
                let size = self.uvarint()? as usize;
                self.skip(size, "a tagged field")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use bytes::{Bytes, BytesMut};
    use kafka_protocol::messages::*;
    use kafka_protocol::protocol::StrBytes;

    use super::*;
    use crate::kafka::versions::SUPPORTED;

    fn s(v: &str) -> StrBytes {
        StrBytes::from_string(v.to_owned())
    }

    fn two<X: Clone>(x: X) -> Vec<X> {
        vec![x; 2]
    }

    /// A request of `api` at version `v` with every array present at `v`
    /// holding two elements. Other fields keep their defaults: whether a
    /// field is encoded depends on the version, not on its value, so the
    /// walk is tested all the same.
    fn sample(api: ApiKey, v: i16) -> RequestKind {
        use create_partitions_request as cp;
        use create_topics_request as ct;
        use delete_topics_request as dt;
        use describe_configs_request as dc;
        use fetch_request as fr;
        use join_group_request as jg;
        use leave_group_request as lg;
        use list_offsets_request as lo;
        use metadata_request as md;
        use offset_commit_request as oc;
        use offset_fetch_request as of;
        use produce_request as pr;
        use sync_group_request as sg;
        let t = || TopicName(s("t"));
        match api {
            ApiKey::ApiVersions => RequestKind::ApiVersions(ApiVersionsRequest::default()),
            ApiKey::Metadata => RequestKind::Metadata(
                MetadataRequest::default()
                    .with_topics(Some(two(md::MetadataRequestTopic::default().with_name(Some(t()))))),
            ),
            ApiKey::Produce => RequestKind::Produce(ProduceRequest::default().with_topic_data(two(
                pr::TopicProduceData::default().with_name(t()).with_partition_data(two(
                    pr::PartitionProduceData::default().with_records(Some(Bytes::from_static(b"abc"))),
                )),
            ))),
            ApiKey::Fetch => {
                let mut r = FetchRequest::default().with_topics(two(fr::FetchTopic::default()
                    .with_topic(t())
                    .with_partitions(two(fr::FetchPartition::default()))));
                if v >= 7 {
                    r = r.with_forgotten_topics_data(two(fr::ForgottenTopic::default()
                        .with_topic(t())
                        .with_partitions(vec![1, 2])));
                }
                RequestKind::Fetch(r)
            }
            ApiKey::ListOffsets => RequestKind::ListOffsets(
                ListOffsetsRequest::default().with_topics(two(lo::ListOffsetsTopic::default()
                    .with_name(t())
                    .with_partitions(two(lo::ListOffsetsPartition::default())))),
            ),
            ApiKey::OffsetCommit => RequestKind::OffsetCommit(
                OffsetCommitRequest::default().with_topics(two(oc::OffsetCommitRequestTopic::default()
                    .with_name(t())
                    .with_partitions(two(oc::OffsetCommitRequestPartition::default())))),
            ),
            ApiKey::OffsetFetch => RequestKind::OffsetFetch(OffsetFetchRequest::default().with_topics(Some(
                two(of::OffsetFetchRequestTopic::default().with_name(t()).with_partition_indexes(vec![0, 1])),
            ))),
            ApiKey::FindCoordinator => {
                let r = FindCoordinatorRequest::default();
                RequestKind::FindCoordinator(if v >= 4 {
                    r.with_coordinator_keys(vec![s("g"), s("h")])
                } else {
                    r
                })
            }
            ApiKey::JoinGroup => RequestKind::JoinGroup(
                JoinGroupRequest::default().with_protocols(two(jg::JoinGroupRequestProtocol::default())),
            ),
            ApiKey::Heartbeat => RequestKind::Heartbeat(HeartbeatRequest::default()),
            ApiKey::LeaveGroup => {
                let r = LeaveGroupRequest::default();
                RequestKind::LeaveGroup(if v >= 3 {
                    r.with_members(two(lg::MemberIdentity::default()))
                } else {
                    r
                })
            }
            ApiKey::SyncGroup => RequestKind::SyncGroup(
                SyncGroupRequest::default().with_assignments(two(sg::SyncGroupRequestAssignment::default())),
            ),
            ApiKey::DescribeGroups => RequestKind::DescribeGroups(
                DescribeGroupsRequest::default().with_groups(vec![GroupId(s("g")); 2]),
            ),
            ApiKey::ListGroups => {
                let r = ListGroupsRequest::default();
                RequestKind::ListGroups(if v >= 4 { r.with_states_filter(vec![s("Stable"); 2]) } else { r })
            }
            ApiKey::CreateTopics => RequestKind::CreateTopics(
                CreateTopicsRequest::default().with_topics(two(ct::CreatableTopic::default()
                    .with_name(t())
                    .with_assignments(two(
                        ct::CreatableReplicaAssignment::default().with_broker_ids(vec![BrokerId(1); 2])
                    ))
                    .with_configs(two(ct::CreatableTopicConfig::default()
                        .with_name(s("k"))
                        .with_value(Some(s("v"))))))),
            ),
            ApiKey::DeleteTopics => {
                let r = DeleteTopicsRequest::default();
                RequestKind::DeleteTopics(if v >= 6 {
                    r.with_topics(two(dt::DeleteTopicState::default().with_name(Some(t()))))
                } else {
                    r.with_topic_names(vec![t(); 2])
                })
            }
            ApiKey::InitProducerId => RequestKind::InitProducerId(InitProducerIdRequest::default()),
            ApiKey::DescribeConfigs => RequestKind::DescribeConfigs(
                DescribeConfigsRequest::default().with_resources(two(dc::DescribeConfigsResource::default()
                    .with_configuration_keys(Some(vec![s("a"), s("b")])))),
            ),
            ApiKey::CreatePartitions => RequestKind::CreatePartitions(
                CreatePartitionsRequest::default()
                    .with_topics(two(cp::CreatePartitionsTopic::default().with_assignments(Some(two(
                        cp::CreatePartitionsAssignment::default().with_broker_ids(vec![BrokerId(1); 2]),
                    ))))),
            ),
            ApiKey::DeleteGroups => {
                RequestKind::DeleteGroups(DeleteGroupsRequest::default().with_groups_names(vec![
                    GroupId(s(
                        "g"
                    ));
                    2
                ]))
            }
            ApiKey::OffsetDelete => {
                use offset_delete_request as od;
                RequestKind::OffsetDelete(
                    OffsetDeleteRequest::default().with_topics(two(od::OffsetDeleteRequestTopic::default()
                        .with_name(t())
                        .with_partitions(two(od::OffsetDeleteRequestPartition::default())))),
                )
            }
            other => panic!("no sample for {other:?}"),
        }
    }

    fn encoded(api: ApiKey, v: i16) -> Bytes {
        let mut b = BytesMut::new();
        sample(api, v).encode(&mut b, v).unwrap_or_else(|e| panic!("{api:?} v{v}: {e}"));
        b.freeze()
    }

    #[test]
    fn the_walk_takes_exactly_every_served_request_the_codec_writes() {
        let mut walked_any = 0;
        for (api, lo, hi) in SUPPORTED {
            for v in *lo..=*hi {
                let b = encoded(*api, v);
                let took = walked(*api, v, &b).unwrap_or_else(|e| panic!("{api:?} v{v}: {e}"));
                assert_eq!(took, b.len(), "{api:?} v{v}: the walk took {took} of {} bytes", b.len());
                // And every proper prefix is refused: nothing is read past the end.
                for cut in 0..b.len() {
                    let w = walked(*api, v, &b[..cut]);
                    assert!(w.is_err() || w.is_ok_and(|n| n <= cut), "{api:?} v{v} cut at {cut}");
                }
                walked_any += 1;
            }
        }
        assert!(walked_any > 100, "{walked_any} API versions walked");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Arbitrary bytes, and served requests with bytes changed: the walk
        /// never panics, and what it lets through the codec decodes or
        /// fails without panicking.
        #[test]
        fn no_bytes_make_the_walk_or_the_codec_panic(
            which in 0usize..SUPPORTED.len(),
            at in 0usize..1000,
            version_pick in 0u8..=255,
            flips in proptest::collection::vec((0usize..512, 0u8..=255), 0..6),
            random in proptest::collection::vec(0u8..=255, 0..64),
        ) {
            let (api, lo, hi) = SUPPORTED[which];
            let v = lo + (version_pick as i16 % (hi - lo + 1));
            let mut mutated = BytesMut::from(&encoded(api, v)[..]);
            for (i, x) in flips {
                if !mutated.is_empty() {
                    let n = mutated.len();
                    mutated[i % n] = x;
                }
            }
            let cut = at.min(mutated.len());
            for body in [mutated.split_to(cut).freeze(), Bytes::from(random)] {
                if check(api, v, &body).is_ok() {
                    let _ = RequestKind::decode(api, &mut body.clone(), v);
                }
            }
        }
    }

    #[test]
    fn a_huge_array_count_is_refused_before_decoding() {
        // Metadata v0 claiming 54 million topics in 5 bytes (like the request
        // of kafka-protocol-rs#152), and v9 (compact) claiming 2^28.
        let e = check(ApiKey::Metadata, 0, &[0x03, 0x3c, 0x0c, 0x00, 0xb6]).expect_err("refused");
        assert!(e.contains("54266880"), "{e}");
        assert!(check(ApiKey::Metadata, 9, &[0x80, 0x80, 0x80, 0x80, 0x01, 0]).is_err());
        assert!(check(ApiKey::Produce, 3, &[0xff, 0xff, 0, 1, 0, 0, 0, 0, 0x7f, 0xff, 0xff, 0xff]).is_err());
        // Many elements that each take one byte: refused past the cap, so
        // a request's decoded size stays proportionate.
        let mut groups = vec![0u8; 0];
        let n = MAX_ELEMENTS as i32 + 1;
        groups.extend_from_slice(&n.to_be_bytes());
        groups.extend(std::iter::repeat_n([0u8, 0u8], MAX_ELEMENTS + 1).flatten());
        groups.push(0);
        let e = check(ApiKey::DescribeGroups, 3, &groups).expect_err("refused");
        assert!(e.contains("array elements"), "{e}");
        let ok = {
            let mut b = 2i32.to_be_bytes().to_vec();
            b.extend_from_slice(&[0, 0, 0, 0, 0]);
            b
        };
        check(ApiKey::DescribeGroups, 3, &ok).expect("two empty names and the flag");
    }
}

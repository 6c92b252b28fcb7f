//! The Kafka APIs and versions this listener serves: one table, which both
//! ApiVersions advertises and the dispatcher enforces, so what is
//! advertised is exactly what works.
//!
//! Lowest versions follow Kafka 4.0 (KIP-896 removed older ones); highest
//! are those whose every field is served. Left out: transactions, ACLs,
//! quotas, SASL, and the consumer protocol of KIP-848.

use kafka_protocol::messages::ApiKey;
use kafka_protocol::messages::api_versions_response::{ApiVersion, ApiVersionsResponse};

use super::errors;

/// `(API, lowest version, highest version)` served.
pub const SUPPORTED: &[(ApiKey, i16, i16)] = &[
    (ApiKey::Produce, 3, 9),
    (ApiKey::Fetch, 4, 12),
    // v7 adds the max-timestamp query (KIP-734), not served.
    (ApiKey::ListOffsets, 1, 6),
    (ApiKey::Metadata, 0, 12),
    (ApiKey::OffsetCommit, 2, 8),
    // v8 batches several groups in one request.
    (ApiKey::OffsetFetch, 1, 7),
    (ApiKey::FindCoordinator, 0, 4),
    (ApiKey::JoinGroup, 0, 9),
    (ApiKey::Heartbeat, 0, 4),
    (ApiKey::LeaveGroup, 0, 5),
    (ApiKey::SyncGroup, 0, 5),
    (ApiKey::DescribeGroups, 0, 5),
    (ApiKey::ListGroups, 0, 4),
    (ApiKey::ApiVersions, 0, 3),
    (ApiKey::CreateTopics, 2, 7),
    (ApiKey::DeleteTopics, 1, 6),
    (ApiKey::InitProducerId, 0, 4),
    (ApiKey::DescribeConfigs, 1, 4),
    (ApiKey::CreatePartitions, 0, 3),
    (ApiKey::DeleteGroups, 0, 2),
    (ApiKey::OffsetDelete, 0, 0),
];

/// The versions of `key` served, if any.
pub fn range(key: ApiKey) -> Option<(i16, i16)> {
    SUPPORTED.iter().find(|(k, _, _)| *k == key).map(|(_, lo, hi)| (*lo, *hi))
}

/// Whether version `v` of `key` is served.
pub fn supported(key: ApiKey, v: i16) -> bool {
    range(key).is_some_and(|(lo, hi)| (lo..=hi).contains(&v))
}

/// The ApiVersions answer: every served API, and `error_code`
/// (`UNSUPPORTED_VERSION` when the request's own version is not served;
/// KIP-511: that answer is encoded as version 0 so any client can read it).
pub fn api_versions(error_code: i16) -> ApiVersionsResponse {
    let mut r = ApiVersionsResponse::default();
    r.error_code = error_code;
    r.api_keys = SUPPORTED
        .iter()
        .map(|(k, lo, hi)| {
            let mut v = ApiVersion::default();
            v.api_key = *k as i16;
            v.min_version = *lo;
            v.max_version = *hi;
            v
        })
        .collect();
    r
}

/// [`api_versions`] without error.
pub fn api_versions_ok() -> ApiVersionsResponse {
    api_versions(errors::NONE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_served_version_is_one_the_codec_knows() {
        for (k, lo, hi) in SUPPORTED {
            let known = k.valid_versions();
            assert!(known.min <= *lo && *hi <= known.max, "{k:?} {lo}..={hi} outside {known:?}");
            assert!(lo <= hi);
        }
        assert!(supported(ApiKey::Produce, 9) && !supported(ApiKey::Produce, 2));
        assert!(range(ApiKey::EndTxn).is_none(), "transactions are not advertised");
    }
}

//! How `ferrolog consume` prints a record: its value alone, or a JSON line.

use base64::Engine;
use ferrolog_client::ConsumerRecord;
use serde::Serialize;
use serde_json::{Value, json};

/// Bytes as JSON: a string when they are UTF-8, else `{"base64": "..."}`.
pub fn bytes_json(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(s) => Value::String(s.to_owned()),
        Err(_) => json!({ "base64": base64::engine::general_purpose::STANDARD.encode(bytes) }),
    }
}

#[derive(Serialize)]
struct HeaderJson<'a> {
    key: &'a str,
    value: Value,
}

/// The JSON form of a record, fields in this order.
#[derive(Serialize)]
struct RecordJson<'a> {
    partition: u32,
    offset: u64,
    key: Value,
    value: Value,
    /// Milliseconds since the Unix epoch.
    timestamp: i64,
    headers: Vec<HeaderJson<'a>>,
}

/// A record as one line of JSON: `partition`, `offset`, `key` (null when
/// absent), `value` (null for a tombstone), `timestamp` (ms since the epoch) and `headers` (a list
/// of `{"key", "value"}` in order, so repeated names survive).
pub fn record_json(r: &ConsumerRecord) -> String {
    let line = RecordJson {
        partition: r.partition,
        offset: r.offset,
        key: r.key.as_ref().map_or(Value::Null, |k| bytes_json(k)),
        value: if r.null_value { Value::Null } else { bytes_json(&r.value) },
        timestamp: r.timestamp_ms,
        headers: r.headers.iter().map(|h| HeaderJson { key: &h.key, value: bytes_json(&h.value) }).collect(),
    };
    // Serializing strings, numbers and Values to a String cannot fail.
    serde_json::to_string(&line).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use ferrolog_client::Header;

    #[test]
    fn json_lines_carry_every_field() {
        let r = ConsumerRecord {
            topic: "t".into(),
            partition: 2,
            offset: 41,
            key: Some(Bytes::from_static(b"\xff\x00")),
            value: Bytes::from_static(b"{\"a\":1}"),
            null_value: false,
            timestamp_ms: 1_357_034_400_000,
            headers: vec![Header { key: "h".into(), value: Bytes::from_static(b"v"), null_value: false }],
        };
        assert_eq!(
            record_json(&r),
            r#"{"partition":2,"offset":41,"key":{"base64":"/wA="},"value":"{\"a\":1}","timestamp":1357034400000,"headers":[{"key":"h","value":"v"}]}"#
        );
        let no_key = ConsumerRecord { key: None, headers: vec![], ..r };
        assert!(record_json(&no_key).contains(r#""key":null"#));
        let tombstone = ConsumerRecord { value: Bytes::new(), null_value: true, ..no_key.clone() };
        assert!(record_json(&tombstone).contains(r#""value":null"#));
        let empty = ConsumerRecord { value: Bytes::new(), ..no_key };
        assert!(record_json(&empty).contains(r#""value":"""#), "empty is not null");
    }
}

//! Per-topic configuration: Kafka's topic-level keys, with Kafka's names,
//! meanings, units and defaults, their checks, and the effective value of
//! each key for a topic.
//!
//! A topic stores only its overrides (`TopicCreated::config`,
//! `TopicConfigAltered`, in the metadata log); every other key takes the
//! broker's default (`topic_defaults` in the broker config, and for
//! `segment.bytes`, `segment.ms` and `max.message.bytes` the broker's
//! `storage` and `limits`), else the built-in default listed here. Like
//! Kafka's static broker configs, broker defaults are per broker: keep them
//! the same on every broker.
//!
//! Values are stored as text in the form a check returns (so `"1000 "` is
//! stored as `"1000"`, `"compact, delete"` as `"compact,delete"`).

use std::collections::BTreeMap;

/// Where an effective value comes from (Kafka's `ConfigSource` in
/// DescribeConfigs, KIP-226).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigSource {
    /// Set on the topic (Kafka's `DYNAMIC_TOPIC_CONFIG`).
    Topic,
    /// Set in the answering broker's config file (Kafka's `STATIC_BROKER_CONFIG`).
    Broker,
    /// Ferrolog's built-in default (Kafka's `DEFAULT_CONFIG`).
    Default,
}

/// One key's effective value for a topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigEntry {
    /// Kafka's topic-level key, e.g. `retention.ms`.
    pub name: &'static str,
    /// The value in force, as text.
    pub value: String,
    /// Where it comes from.
    pub source: ConfigSource,
}

/// What a value may be.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// An integer in `min..=max`; unit in the key's doc.
    Int { min: i64, max: i64 },
    /// A fraction in `[0, 1]`.
    Ratio,
    /// `delete`, `compact`, or both separated by a comma (Kafka's `cleanup.policy`).
    CleanupPolicy,
    /// `CreateTime` or `LogAppendTime`.
    TimestampType,
    /// `producer`, `uncompressed`, `gzip`, `snappy`, `lz4` or `zstd`.
    CompressionType,
}

/// One topic-level key: its name, the values it takes and its built-in
/// default.
#[derive(Clone, Copy, Debug)]
pub struct KeySpec {
    /// Kafka's name.
    pub name: &'static str,
    kind: Kind,
    /// The built-in default, as text.
    pub default: &'static str,
    /// What it means, with its unit (shown by `ferrolog topic describe`
    /// and the README's reference).
    pub doc: &'static str,
}

const I32_MAX: i64 = i32::MAX as i64;

/// Every topic-level key Ferrolog knows, in the order `describe` lists them.
/// Defaults and bounds are Kafka's, except `segment.bytes` (at least 4 KiB,
/// the store's minimum) and `max.message.bytes` (1 MiB, the broker's
/// `limits.max_batch_bytes`).
pub const KEYS: &[KeySpec] = &[
    KeySpec {
        name: "cleanup.policy",
        kind: Kind::CleanupPolicy,
        default: "delete",
        doc: "delete old segments (retention), keep the latest record per key (compact), or both",
    },
    KeySpec {
        name: "retention.ms",
        kind: Kind::Int { min: -1, max: i64::MAX },
        default: "604800000",
        doc: "ms a segment is kept after its newest record's timestamp; -1: no limit",
    },
    KeySpec {
        name: "retention.bytes",
        kind: Kind::Int { min: -1, max: i64::MAX },
        default: "-1",
        doc: "bytes a partition keeps before its oldest segments are deleted; -1: no limit",
    },
    KeySpec {
        name: "segment.bytes",
        kind: Kind::Int { min: 4096, max: I32_MAX },
        default: "1073741824",
        doc: "bytes at which the active segment is rolled",
    },
    KeySpec {
        name: "segment.ms",
        kind: Kind::Int { min: 1, max: i64::MAX },
        default: "604800000",
        doc: "ms after which the active segment is rolled",
    },
    KeySpec {
        name: "min.compaction.lag.ms",
        kind: Kind::Int { min: 0, max: i64::MAX },
        default: "0",
        doc: "ms a record stays uncompacted after it is written",
    },
    KeySpec {
        name: "max.compaction.lag.ms",
        kind: Kind::Int { min: 1, max: i64::MAX },
        default: "9223372036854775807",
        doc: "ms after which a record is compacted whatever the dirty ratio",
    },
    KeySpec {
        name: "delete.retention.ms",
        kind: Kind::Int { min: 0, max: i64::MAX },
        default: "86400000",
        doc: "ms a tombstone (null value) is kept after compaction reaches it",
    },
    KeySpec {
        name: "min.cleanable.dirty.ratio",
        kind: Kind::Ratio,
        default: "0.5",
        doc: "fraction of a log not yet compacted above which it is compacted",
    },
    KeySpec {
        name: "max.message.bytes",
        kind: Kind::Int { min: 0, max: I32_MAX },
        default: "1048576",
        doc: "largest produce batch, bytes of keys, values and headers (the broker's limits.max_batch_bytes caps it)",
    },
    KeySpec {
        name: "message.timestamp.type",
        kind: Kind::TimestampType,
        default: "CreateTime",
        doc: "record timestamps as the producer set them (CreateTime) or as the leader appended them (LogAppendTime)",
    },
    KeySpec {
        name: "compression.type",
        kind: Kind::CompressionType,
        default: "producer",
        doc: "codec of stored batches: as the producer compressed them (producer), or recompressed by the leader (uncompressed, gzip, snappy, lz4, zstd)",
    },
];

/// The spec of `name`, if Ferrolog knows the key.
pub fn spec(name: &str) -> Option<&'static KeySpec> {
    KEYS.iter().find(|k| k.name == name)
}

/// Checks one value of `key` and returns it in stored form.
///
/// # Errors
/// A message naming the key: unknown key, or a value outside what it takes.
pub fn check_value(key: &str, value: &str) -> Result<String, String> {
    let Some(spec) = spec(key) else {
        return Err(format!("unknown topic config {key:?} (known: {})", known_keys()));
    };
    let v = value.trim();
    let bad = |what: &str| Err(format!("{key}={value:?}: {what}"));
    match spec.kind {
        Kind::Int { min, max } => match v.parse::<i64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(n.to_string()),
            Ok(_) if max == i64::MAX => bad(&format!("must be ≥ {min}")),
            Ok(_) => bad(&format!("must be in {min}..={max}")),
            Err(_) => bad("not an integer"),
        },
        Kind::Ratio => match v.parse::<f64>() {
            Ok(r) if (0.0..=1.0).contains(&r) => Ok(r.to_string()),
            _ => bad("must be a number in [0, 1]"),
        },
        Kind::CleanupPolicy => {
            let mut delete = false;
            let mut compact = false;
            for part in v.split(',').map(str::trim) {
                match part {
                    "delete" => delete = true,
                    "compact" => compact = true,
                    _ => return bad("must be delete, compact, or compact,delete"),
                }
            }
            Ok(match (compact, delete) {
                (true, true) => "compact,delete",
                (true, false) => "compact",
                _ => "delete",
            }
            .to_owned())
        }
        Kind::TimestampType => match v {
            "CreateTime" | "LogAppendTime" => Ok(v.to_owned()),
            _ => bad("must be CreateTime or LogAppendTime"),
        },
        Kind::CompressionType => match v {
            "producer" | "uncompressed" | "gzip" | "snappy" | "lz4" | "zstd" => Ok(v.to_owned()),
            _ => bad("must be producer, uncompressed, gzip, snappy, lz4 or zstd"),
        },
    }
}

fn known_keys() -> String {
    KEYS.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
}

/// Checks a whole set of overrides (each value, then rules between keys:
/// Kafka's `min.compaction.lag.ms` ≤ `max.compaction.lag.ms`) and returns
/// it in stored form.
///
/// # Errors
/// A message naming the first offending key.
pub fn check_overrides(config: &BTreeMap<String, String>) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (k, v) in config {
        out.insert(k.clone(), check_value(k, v)?);
    }
    let lag = |k: &str| -> i64 {
        out.get(k)
            .map(String::as_str)
            .or_else(|| spec(k).map(|s| s.default))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    if lag("min.compaction.lag.ms") > lag("max.compaction.lag.ms") {
        return Err(format!(
            "min.compaction.lag.ms ({}) is above max.compaction.lag.ms ({})",
            lag("min.compaction.lag.ms"),
            lag("max.compaction.lag.ms")
        ));
    }
    Ok(out)
}

/// The overrides after an incremental alter (Kafka's
/// IncrementalAlterConfigs, KIP-339: `SET` and `DELETE`), checked as a whole.
///
/// # Errors
/// A key both set and deleted, an unknown key to delete, or what
/// [`check_overrides`] refuses.
pub fn altered(
    current: &BTreeMap<String, String>,
    set: &BTreeMap<String, String>,
    delete: &[String],
) -> Result<BTreeMap<String, String>, String> {
    let mut next = current.clone();
    for k in delete {
        if spec(k).is_none() {
            return Err(format!("unknown topic config {k:?} (known: {})", known_keys()));
        }
        if set.contains_key(k) {
            return Err(format!("{k} is both set and deleted"));
        }
        next.remove(k);
    }
    next.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
    check_overrides(&next)
}

/// A broker's defaults for topic-level keys: what a topic without an
/// override gets on this broker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopicDefaults {
    /// Key → stored-form value, for keys the broker config sets.
    set: BTreeMap<String, String>,
}

impl TopicDefaults {
    /// Defaults from a broker config's `topic_defaults` table, plus the
    /// keys its other sections decide (`segment.bytes`, `segment.ms`,
    /// `max.message.bytes`) where they differ from the built-in default.
    ///
    /// # Errors
    /// A message naming the first bad key of `table`.
    pub fn from_broker(
        table: &BTreeMap<String, String>,
        segment_bytes: u64,
        segment_ms: u64,
        max_batch_bytes: usize,
    ) -> Result<Self, String> {
        let mut set = BTreeMap::new();
        for (k, v) in [
            ("segment.bytes", segment_bytes.to_string()),
            ("segment.ms", segment_ms.to_string()),
            ("max.message.bytes", max_batch_bytes.to_string()),
        ] {
            if spec(k).is_some_and(|s| s.default != v) {
                set.insert(k.to_owned(), v);
            }
        }
        for (k, v) in check_overrides(table).map_err(|e| format!("topic_defaults: {e}"))? {
            if matches!(k.as_str(), "segment.bytes" | "segment.ms" | "max.message.bytes") {
                return Err(format!(
                    "topic_defaults: set {k} in the broker's storage / limits section, not here"
                ));
            }
            set.insert(k, v);
        }
        Ok(Self { set })
    }

    /// The effective value of `key` for a topic whose overrides are
    /// `overrides`: the override, else this broker's default, else the
    /// built-in one ("" for a key Ferrolog does not know).
    pub fn value<'a>(&'a self, overrides: &'a BTreeMap<String, String>, key: &str) -> &'a str {
        overrides
            .get(key)
            .or_else(|| self.set.get(key))
            .map(String::as_str)
            .or_else(|| spec(key).map(|s| s.default))
            .unwrap_or("")
    }

    /// Whether a topic with `overrides` stamps records at append
    /// (`message.timestamp.type` = `LogAppendTime`; the built-in default is
    /// `CreateTime`). Two map lookups: this is asked on every produce.
    pub fn log_append_time(&self, overrides: &BTreeMap<String, String>) -> bool {
        const KEY: &str = "message.timestamp.type";
        overrides.get(KEY).or_else(|| self.set.get(KEY)).is_some_and(|v| v == "LogAppendTime")
    }

    /// A topic's `compression.type` with `overrides` (`producer` unless
    /// set). Two map lookups: this is asked on every produce.
    pub fn compression_type<'a>(&'a self, overrides: &'a BTreeMap<String, String>) -> &'a str {
        const KEY: &str = "compression.type";
        overrides.get(KEY).or_else(|| self.set.get(KEY)).map_or("producer", String::as_str)
    }

    /// Whether a topic with `overrides` is compacted (its `cleanup.policy`
    /// holds `compact`). Two map lookups: this is asked on every produce.
    pub fn compacts(&self, overrides: &BTreeMap<String, String>) -> bool {
        const KEY: &str = "cleanup.policy";
        overrides.get(KEY).or_else(|| self.set.get(KEY)).is_some_and(|v| v.split(',').any(|p| p == "compact"))
    }

    /// Every key's effective value for a topic whose overrides are
    /// `overrides`, in [`KEYS`] order.
    pub fn effective(&self, overrides: &BTreeMap<String, String>) -> Vec<ConfigEntry> {
        KEYS.iter()
            .map(|k| {
                let (value, source) = match (overrides.get(k.name), self.set.get(k.name)) {
                    (Some(v), _) => (v.clone(), ConfigSource::Topic),
                    (None, Some(v)) => (v.clone(), ConfigSource::Broker),
                    (None, None) => (k.default.to_owned(), ConfigSource::Default),
                };
                ConfigEntry { name: k.name, value, source }
            })
            .collect()
    }
}

/// A topic's `max.message.bytes` override, if it has one (a stored value
/// always parses; a value that does not is ignored).
pub fn max_message_bytes(overrides: &BTreeMap<String, String>) -> Option<u64> {
    overrides.get("max.message.bytes").and_then(|v| v.parse().ok())
}

/// When a topic's replicas roll their active segment: its `segment.bytes`
/// and `segment.ms` overrides, else the broker's `storage` values (bytes, ms).
pub fn roll_limits(overrides: &BTreeMap<String, String>, broker_bytes: u64, broker_ms: u64) -> (u64, u64) {
    let get = |k: &str, default: u64| overrides.get(k).and_then(|v| v.parse().ok()).unwrap_or(default);
    (get("segment.bytes", broker_bytes), get("segment.ms", broker_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn every_default_passes_its_own_check() {
        for k in KEYS {
            assert_eq!(check_value(k.name, k.default).as_deref(), Ok(k.default), "{}", k.name);
        }
    }

    #[test]
    fn bad_keys_and_values_are_refused_with_the_key_named() {
        let e = check_value("retention.msec", "1").unwrap_err();
        assert!(e.contains("\"retention.msec\"") && e.contains("retention.ms"), "{e}");
        for (k, v) in [
            ("retention.ms", "-2"),
            ("retention.ms", "1h"),
            ("retention.bytes", ""),
            ("segment.bytes", "4095"),
            ("segment.bytes", "4294967296"),
            ("segment.ms", "0"),
            ("min.cleanable.dirty.ratio", "1.5"),
            ("min.cleanable.dirty.ratio", "NaN"),
            ("cleanup.policy", "compact,deleted"),
            ("cleanup.policy", ""),
            ("message.timestamp.type", "createtime"),
            ("max.message.bytes", "-1"),
            ("compression.type", "none"),
            ("compression.type", "ZSTD"),
        ] {
            let e = check_value(k, v).unwrap_err();
            assert!(e.starts_with(&format!("{k}=")), "{k}={v}: {e}");
        }
    }

    #[test]
    fn values_are_stored_in_one_form() {
        assert_eq!(check_value("retention.ms", " 1000 ").unwrap(), "1000");
        assert_eq!(check_value("cleanup.policy", "delete, compact").unwrap(), "compact,delete");
        assert_eq!(check_value("cleanup.policy", "compact").unwrap(), "compact");
        assert_eq!(check_value("min.cleanable.dirty.ratio", "0.50").unwrap(), "0.5");
        assert_eq!(check_value("retention.bytes", "-1").unwrap(), "-1");
    }

    #[test]
    fn compaction_lags_must_be_ordered() {
        let e = check_overrides(&map(&[("min.compaction.lag.ms", "10"), ("max.compaction.lag.ms", "5")]))
            .unwrap_err();
        assert!(e.contains("min.compaction.lag.ms"), "{e}");
        assert!(
            check_overrides(&map(&[("min.compaction.lag.ms", "5"), ("max.compaction.lag.ms", "5")])).is_ok()
        );
        // Against the default maximum.
        assert!(check_overrides(&map(&[("min.compaction.lag.ms", "5")])).is_ok());
    }

    #[test]
    fn an_alter_sets_and_deletes_and_is_checked_as_a_whole() {
        let current = map(&[("retention.ms", "1000"), ("max.compaction.lag.ms", "100")]);
        let next = altered(&current, &map(&[("retention.bytes", "4096")]), &["retention.ms".into()]).unwrap();
        assert_eq!(next, map(&[("retention.bytes", "4096"), ("max.compaction.lag.ms", "100")]));
        // Deleting a key the topic does not set is fine; an unknown key is not.
        assert!(altered(&current, &BTreeMap::new(), &["segment.ms".into()]).is_ok());
        assert!(altered(&current, &BTreeMap::new(), &["segment.msec".into()]).is_err());
        // The result must hold together with what stays.
        let e = altered(&current, &map(&[("min.compaction.lag.ms", "200")]), &[]).unwrap_err();
        assert!(e.contains("min.compaction.lag.ms"), "{e}");
        let e = altered(&current, &map(&[("retention.ms", "5")]), &["retention.ms".into()]).unwrap_err();
        assert!(e.contains("both set and deleted"), "{e}");
    }

    #[test]
    fn effective_values_say_where_they_come_from() {
        let defaults =
            TopicDefaults::from_broker(&map(&[("retention.ms", "3600000")]), 1 << 30, 1000, 1 << 20).unwrap();
        let topic = map(&[("cleanup.policy", "compact")]);
        let eff = defaults.effective(&topic);
        assert_eq!(eff.len(), KEYS.len());
        let get = |n: &str| eff.iter().find(|e| e.name == n).unwrap().clone();
        assert_eq!(
            (get("cleanup.policy").value.as_str(), get("cleanup.policy").source),
            ("compact", ConfigSource::Topic)
        );
        assert_eq!(
            (get("retention.ms").value.as_str(), get("retention.ms").source),
            ("3600000", ConfigSource::Broker)
        );
        assert_eq!(
            (get("segment.ms").value.as_str(), get("segment.ms").source),
            ("1000", ConfigSource::Broker)
        );
        assert_eq!(
            (get("segment.bytes").value.as_str(), get("segment.bytes").source),
            ("1073741824", ConfigSource::Default)
        );
        assert_eq!(get("retention.bytes").source, ConfigSource::Default);
        assert_eq!(defaults.value(&topic, "cleanup.policy"), "compact");
        assert_eq!(defaults.value(&topic, "retention.ms"), "3600000");
        assert_eq!(defaults.value(&topic, "message.timestamp.type"), "CreateTime");
        assert_eq!(defaults.value(&topic, "no.such.key"), "");
        assert!(!defaults.log_append_time(&topic));
        assert_eq!(defaults.compression_type(&topic), "producer");
        assert_eq!(defaults.compression_type(&map(&[("compression.type", "lz4")])), "lz4");
        assert!(defaults.log_append_time(&map(&[("message.timestamp.type", "LogAppendTime")])));
        let stamping =
            TopicDefaults::from_broker(&map(&[("message.timestamp.type", "LogAppendTime")]), 1 << 30, 1, 1)
                .unwrap();
        assert!(stamping.log_append_time(&topic));
        assert!(!stamping.log_append_time(&map(&[("message.timestamp.type", "CreateTime")])));
    }

    #[test]
    fn broker_defaults_are_checked_too() {
        let e = TopicDefaults::from_broker(&map(&[("retention.ms", "soon")]), 1 << 30, 1, 1).unwrap_err();
        assert!(e.contains("topic_defaults") && e.contains("retention.ms"), "{e}");
        let e = TopicDefaults::from_broker(&map(&[("segment.bytes", "8192")]), 1 << 30, 1, 1).unwrap_err();
        assert!(e.contains("storage"), "{e}");
    }

    #[test]
    fn roll_limits_take_the_topic_override_else_the_broker_value() {
        assert_eq!(roll_limits(&BTreeMap::new(), 1 << 30, 7), (1 << 30, 7));
        assert_eq!(roll_limits(&map(&[("segment.bytes", "8192")]), 1 << 30, 7), (8192, 7));
        assert_eq!(roll_limits(&map(&[("segment.ms", "60000")]), 1 << 30, 7), (1 << 30, 60_000));
    }

    #[test]
    fn a_max_message_bytes_override_is_read_back() {
        assert_eq!(max_message_bytes(&map(&[("max.message.bytes", "512")])), Some(512));
        assert_eq!(max_message_bytes(&BTreeMap::new()), None);
    }
}

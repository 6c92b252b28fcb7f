"""Consumer-group administration through kafka-python's admin client
(DescribeGroups, OffsetDelete of KIP-496), around a live group member.

Writes 10 records to partition 0 of each of two topics; a consumer in
GROUP subscribes to SUBSCRIBED, reads its 10 records and commits them, and
commits offset 7 of OTHER (a topic it does not subscribe to). Then, while
it is a member: describes the group and deletes the offsets of both
topics (the subscribed one must be kept); after it leaves: deletes the
subscribed topic's offset. Also asks for a group that does not exist and
a topic that does not exist. Prints one JSON line:
{"describe": {...}, "first": {...}, "after_first": {...}, "second": {...},
"after_second": {...}, "unknown_group": "...", "unknown_topic": {...}}.
Usage: group_admin.py BOOTSTRAP SUBSCRIBED OTHER GROUP
   or: group_admin.py describe BOOTSTRAP GROUP   (prints the group's
       description as JSON, nothing else)"""
import json
import logging
import sys
import time

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient
from kafka.structs import OffsetAndMetadata

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="kafka-python %(levelname)s %(name)s: %(message)s")


def names(result):
    """{TopicPartition: error class} -> {"topic-partition": error name}."""
    return {f"{tp.topic}-{tp.partition}": err.__name__ for tp, err in result.items()}


def committed(bootstrap, group, topics):
    """The group's committed offsets of partition 0 of `topics` (None: none),
    read by a consumer that does not join the group."""
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        return {t: c.committed(TopicPartition(t, 0)) for t in topics}
    finally:
        c.close(autocommit=False)


def plain(value):
    """The admin client's answer as JSON-able data (decoded consumer
    protocol structs included)."""
    if hasattr(value, "to_dict"):
        return plain(value.to_dict())
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return plain(vars(value)) if hasattr(value, "__dict__") else str(value)


def describe(bootstrap, group):
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    print(json.dumps(plain(admin.describe_groups([group])[group])), flush=True)
    admin.close()


def main():
    if sys.argv[1] == "describe":
        describe(sys.argv[2], sys.argv[3])
        return
    bootstrap, subscribed, other, group = sys.argv[1:5]
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for t in (subscribed, other):
        for i in range(10):
            producer.send(t, value=b"v%d" % i, partition=0)
    producer.flush()
    producer.close()

    consumer = KafkaConsumer(
        subscribed,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    read = 0
    deadline = time.time() + 120
    while read < 10 and time.time() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            read += len(records)
    if read < 10:
        raise SystemExit(f"read {read} of 10 records")
    consumer.commit()
    consumer.commit({TopicPartition(other, 0): OffsetAndMetadata(7, "", -1)})

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    out = {"describe": plain(admin.describe_groups([group])[group])}
    both = [TopicPartition(subscribed, 0), TopicPartition(other, 0)]
    out["first"] = names(admin.delete_group_offsets(group, both))
    out["after_first"] = committed(bootstrap, group, [subscribed, other])
    out["unknown_topic"] = names(admin.delete_group_offsets(group, [TopicPartition("no-such-topic", 0)]))

    consumer.close(autocommit=False)
    out["second"] = names(admin.delete_group_offsets(group, [TopicPartition(subscribed, 0)]))
    out["after_second"] = committed(bootstrap, group, [subscribed, other])
    try:
        admin.delete_group_offsets("no-such-group", [TopicPartition(subscribed, 0)])
        out["unknown_group"] = "NoError"
    except Exception as e:  # the admin client raises the group-level error
        out["unknown_group"] = type(e).__name__
    admin.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

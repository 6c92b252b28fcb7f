"""Produces N records with kafka-python's idempotent producer (acks=all) to
partition 0 of a topic; once half are sent and a quarter acknowledged it
prints "half" and waits for a line on stdin (the test SIGKILLs the
partition's leader, then answers), sends the rest, then reads the partition back in a
consumer group that commits after each poll. Prints one JSON line:
{"acked": [...], "failed": [...], "read": [...], "committed": offset,
"acked_at_half": count}.
Usage: idempotent_kill.py BOOTSTRAP TOPIC N GROUP"""
import json
import logging
import os
import sys
import time

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="kafka-python %(levelname)s %(name)s: %(message)s")

def main():
    bootstrap, topic, n, group = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        enable_idempotence=True,
        acks="all",
        linger_ms=5,
        request_timeout_ms=10000,
        delivery_timeout_ms=120000,
        max_in_flight_requests_per_connection=5,
    )
    acked, failed = [], []
    t0 = time.time()
    said_half = False
    acked_at_half = 0
    futures = []
    for i in range(n):
        f = producer.send(topic, key=str(i).encode(), value=str(i).encode(), partition=0)
        f.add_callback(lambda _m, i=i: acked.append(i))
        f.add_errback(lambda e, i=i: failed.append((i, str(e))))
        futures.append(f)
        if i % 10000 == 0:
            print(f"sent {i}, acked {len(acked)}, failed {len(failed)} at {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        if i == n // 2:
            # Half sent and a quarter acknowledged: the leader dies now,
            # with records in flight and half still to send.
            while len(acked) < n // 4 and time.time() - t0 < 120:
                time.sleep(0.01)
            print("half", flush=True)
            # Wait until the test has killed the leader, then send the rest.
            sys.stdin.readline()
            acked_at_half = len(acked)
            said_half = True
    producer.flush(timeout=180)
    print(f"produce: {len(acked)} acked, {len(failed)} failed in {time.time() - t0:.1f} s", file=sys.stderr)
    if not said_half:
        print("half", flush=True)
    producer.close()
    
    tp = TopicPartition(topic, 0)
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    consumer.subscribe([topic])
    read = []
    deadline = time.time() + 120
    want = set(acked)
    while time.time() < deadline and not want.issubset(set(read)):
        for records in consumer.poll(timeout_ms=1000).values():
            read.extend(int(r.value) for r in records)
        consumer.commit()
    committed = consumer.committed(tp)
    consumer.close()
    print(json.dumps({"acked": sorted(acked), "failed": failed[:10], "read": read, "committed": committed, "acked_at_half": acked_at_half}), flush=True)


try:
    main()
except Exception as e:  # report, never hang: the test reads one line
    print(json.dumps({"error": repr(e)}), flush=True)
# kafka-python's network threads may linger; the report is out.
os._exit(0)

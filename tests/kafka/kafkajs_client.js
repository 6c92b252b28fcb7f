// kafkajs (a Kafka client written in JavaScript, independent of librdkafka
// and kafka-python) against a Ferrolog cluster's Kafka listeners. Prints one
// JSON line for the test to check; never hangs (a watchdog ends it).
//
// Usage:
//   node kafkajs_client.js fields BOOTSTRAP TOPIC
//     Creates TOPIC (3 partitions, replication factor 3) with the admin
//     client, produces 3,000 records with an idempotent producer (acks=all)
//     in batches alternating uncompressed and gzip, with null and empty keys
//     and values, headers (one empty) and explicit timestamps, then reads the
//     topic in a consumer group and compares every field, offset and the
//     order per partition. Report: {"sent", "read", "mismatches": [...],
//     "committed": [per partition], "partitions_after": n}.
//   node kafkajs_client.js kill BOOTSTRAP TOPIC N GROUP
//     Produces N records (values "0".."N-1") to partition 0 of TOPIC with an
//     idempotent producer, in sends of 100 records one at a time. Halfway
//     it prints "half" and waits for a line on stdin (the test SIGSTOPs the
//     partition's leader), starts the next send, prints "sent" 300 ms later
//     and waits for a line again (the test SIGKILLs the stopped leader), then
//     sends the rest into the failover,
//     and reads the partition back in group GROUP, committing. Report:
//     {"acked": [...], "failed": [...], "read": [[offset, value], ...] once
//     per offset, "again": deliveries of an offset already read, "retried":
//     failed sends the producer logged (each then retried), "half_ms": the
//     time the send across the kill took, "settled_before_kill": whether it
//     had been answered when "sent" was printed (it may not), "committed":
//     offset}.
'use strict';
const { Kafka, logLevel, CompressionTypes, Partitioners } = require('kafkajs');
const readline = require('readline');

const [mode, bootstrap, topic] = process.argv.slice(2);
const logged = new Map();
const kafka = new Kafka({
  clientId: 'ferrolog-test',
  brokers: bootstrap.split(','),
  logLevel: logLevel.WARN,
  // kafkajs logs to stdout by default; the report owns stdout. Each
  // message is printed once (a failover repeats some hundreds of times).
  logCreator: () => ({ namespace, log }) => {
    const key = `${namespace}: ${log.message}`;
    logged.set(key, (logged.get(key) || 0) + 1);
    if (logged.get(key) === 1) process.stderr.write(`kafkajs ${key} ${log.error || ''} (repeats not shown)\n`);
  },
  retry: { retries: 30, initialRetryTime: 100, maxRetryTime: 2000 },
});
// An idempotent producer retries without limit (a limit may break its
// guarantees, kafkajs warns); the watchdog bounds the run.
const idempotent = () => kafka.producer({
  idempotent: true,
  maxInFlightRequests: 1,
  createPartitioner: Partitioners.DefaultPartitioner,
  retry: { retries: Number.MAX_SAFE_INTEGER, initialRetryTime: 100, maxRetryTime: 2000 },
});
// Exits once the line is written: stdout to a pipe is asynchronous, and
// exiting at once would cut a long line.
const report = (o) => process.stdout.write(JSON.stringify(o) + '\n', () => process.exit(0));
setTimeout(() => report({ error: 'watchdog: no report after 240 s' }), 240_000).unref();

// Reads messages of `topic` in group `groupId` until `want` distinct
// offsets arrived or `seconds` passed. Returns the messages per partition in
// offset order, once each, and how many were delivered again (a consumer
// group delivers at least once: after a rebalance it starts again from the
// committed offset), and the offsets delivered again with another value
// (none may be).
async function consume(groupId, want, seconds) {
  const consumer = kafka.consumer({ groupId, maxBytesPerPartition: 16384, maxBytes: 65536 });
  await consumer.connect();
  await consumer.subscribe({ topic, fromBeginning: true });
  const byOffset = new Map();
  let n = 0, again = 0;
  const changed = [];
  await new Promise((resolve) => {
    const timer = setTimeout(resolve, seconds * 1000);
    consumer.run({
      autoCommitInterval: 100,
      eachMessage: async ({ partition, message }) => {
        if (!byOffset.has(partition)) byOffset.set(partition, new Map());
        const seen = byOffset.get(partition);
        if (seen.has(message.offset)) {
          again++;
          const first = seen.get(message.offset);
          if (text(first.value) !== text(message.value)) changed.push(`partition ${partition} offset ${message.offset}`);
          return;
        }
        seen.set(message.offset, message);
        if (++n >= want) { clearTimeout(timer); resolve(); }
      },
    }).catch((e) => report({ error: `consumer.run: ${e && e.stack || e}` }));
  });
  await consumer.disconnect(); // commits what was consumed
  const got = new Map();
  for (const [p, seen] of byOffset) got.set(p, [...seen.values()].sort((a, b) => Number(a.offset) - Number(b.offset)));
  return { got, again, changed };
}

const text = (b) => (b === null || b === undefined ? null : b.toString());

async function fields() {
  const admin = kafka.admin();
  await admin.connect();
  await admin.createTopics({ topics: [{ topic, numPartitions: 3, replicationFactor: 3 }], waitForLeaders: true });
  const producer = idempotent();
  await producer.connect();
  const N = 3000, sent = [], t0 = Date.now() - 60_000;
  for (let i = 0; i < N; i += 50) {
    const batch = [];
    for (let j = i; j < i + 50; j++) {
      batch.push({
        partition: j % 3,
        key: j % 7 === 0 ? null : j % 13 === 0 ? '' : `k${j}`,
        value: j % 11 === 0 ? null : j % 17 === 0 ? '' : `v${j}`,
        headers: { h: `x${j}`, empty: '' },
        timestamp: String(t0 + j),
      });
    }
    await producer.send({ topic, acks: -1, messages: batch, compression: (i / 50) % 2 ? CompressionTypes.GZIP : CompressionTypes.None });
    sent.push(...batch);
  }
  await producer.disconnect();
  const group = `${topic}-g`;
  const { got, again, changed } = await consume(group, N, 60);
  const mismatches = [];
  let read = 0;
  for (let p = 0; p < 3; p++) {
    const want = sent.filter((m) => m.partition === p);
    const have = got.get(p) || [];
    read += have.length;
    if (have.length !== want.length) mismatches.push(`partition ${p}: ${have.length} read, ${want.length} sent`);
    for (let i = 0; i < Math.min(have.length, want.length); i++) {
      const [w, g] = [want[i], have[i]];
      const diff = [];
      if (Number(g.offset) !== i) diff.push(`offset ${g.offset}`);
      if (text(g.key) !== w.key) diff.push(`key ${JSON.stringify(text(g.key))} != ${JSON.stringify(w.key)}`);
      if (text(g.value) !== w.value) diff.push(`value ${JSON.stringify(text(g.value))} != ${JSON.stringify(w.value)}`);
      if (text(g.headers.h) !== w.headers.h || text(g.headers.empty) !== '') diff.push(`headers ${JSON.stringify(g.headers)}`);
      if (g.timestamp !== w.timestamp) diff.push(`timestamp ${g.timestamp} != ${w.timestamp}`);
      if (diff.length && mismatches.length < 10) mismatches.push(`partition ${p} record ${i}: ${diff.join(', ')}`);
    }
  }
  const offsets = await admin.fetchOffsets({ groupId: group, topics: [topic] });
  const committed = [0, 1, 2].map((p) => Number(offsets[0].partitions.find((x) => x.partition === p).offset));
  await admin.createPartitions({ topicPartitions: [{ topic, count: 4 }] });
  const md = await admin.fetchTopicMetadata({ topics: [topic] });
  await admin.disconnect();
  report({ sent: sent.length, read, again, changed, mismatches, committed, partitions_after: md.topics[0].partitions.length });
}

async function kill() {
  const n = Number(process.argv[5]), group = process.argv[6];
  const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
  const producer = idempotent();
  await producer.connect();
  const acked = [], failed = [];
  const send = (first, count) => {
    const batch = [];
    for (let j = first; j < first + count; j++) batch.push({ partition: 0, value: String(j) });
    return producer.send({ topic, acks: -1, messages: batch }).then(
      () => { for (let j = first; j < first + count; j++) acked.push(j); },
      (e) => { if (failed.length < 10) failed.push(`${first}: ${e.message}`); },
    );
  };
  // One send at a time: kafkajs's idempotent producer keeps its guarantee
  // only so. With sends overlapping, it gives a retried batch the sequence
  // number current when the retry is built: seen here after a leader kill,
  // a batch stored twice (under two sequence numbers) and another
  // acknowledged as a duplicate of a different batch that had taken its
  // number, never stored. The broker checked every number as Kafka does.
  let halfMs = null, settledBeforeKill = null;
  for (let i = 0; i < n; i += 100) {
    if (halfMs === null && i >= n / 2) {
      // The test stops the leader (SIGSTOP); this send goes to it and waits
      // there; once it has been on the wire a while the test kills the
      // leader, so it is in flight across the kill by construction.
      process.stdout.write('half\n');
      await lines.next();
      const t0 = Date.now();
      let settled = false;
      const sent = send(i, Math.min(100, n - i)).finally(() => { settled = true; });
      await new Promise((resolve) => setTimeout(resolve, 300));
      settledBeforeKill = settled;
      process.stdout.write('sent\n');
      await lines.next();
      await sent;
      halfMs = Date.now() - t0;
      continue;
    }
    await send(i, Math.min(100, n - i));
  }
  await producer.disconnect();
  const { got, again, changed } = await consume(group, acked.length, 120);
  const read = (got.get(0) || []).map((m) => [Number(m.offset), Number(text(m.value))]);
  const admin = kafka.admin();
  await admin.connect();
  const offsets = await admin.fetchOffsets({ groupId: group, topics: [topic] });
  await admin.disconnect();
  acked.sort((a, b) => a - b);
  // How many times the producer logged a failed send it then retried.
  const retried = [...logged].filter(([k]) => k.startsWith('Producer:')).reduce((n, [, c]) => n + c, 0);
  report({ acked, failed, read, again, changed, retried, half_ms: halfMs, settled_before_kill: settledBeforeKill, committed: Number(offsets[0].partitions.find((x) => x.partition === 0).offset) });
}

(mode === 'fields' ? fields() : kill()).catch((e) => report({ error: String(e && e.stack || e) }));

//! The recorded history: one [`Op`] per client operation, with invoke and
//! complete times, the process that ran it, and what it sent or read. Stored
//! as JSON lines (`history.jsonl`), one completed operation per line.
//!
//! A *key* is a partition of the test topic; a *value* is a unique integer
//! (no value is ever sent twice), so each read can be traced to one send.
//! In the `compact` workload each record also has a *record key* (the
//! Kafka key that compaction keeps the latest record of, within its
//! partition), and may be a tombstone (a null value; its unique integer
//! then travels in the record's `id` header).

use std::io::{BufRead, BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// A partition of the test topic.
pub type Key = u32;
/// A unique value.
pub type Value = u64;

/// What an operation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OpType {
    /// Produce one or more values.
    Send,
    /// One consumer poll.
    Poll,
    /// A consumer-group member's offset commit (`group` workload): each
    /// msg is a partition (`key`) and the position committed (`offset`);
    /// its `value` means nothing.
    Commit,
}

/// How an operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// It happened, with the results recorded.
    Ok,
    /// It definitely did not happen.
    Fail,
    /// Unknown (a timeout, a lost connection): it may or may not have happened.
    Info,
}

/// One value sent or read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Msg {
    /// The partition.
    pub key: Key,
    /// The value.
    pub value: Value,
    /// Its offset: for a send, the offset acknowledged (absent when not
    /// acknowledged); for a poll, the offset read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// The record key, in the `compact` workload (absent in the queue
    /// workload, whose records are keyed by their partition only).
    #[serde(default, rename = "rkey", skip_serializing_if = "Option::is_none")]
    pub record_key: Option<u32>,
    /// A tombstone (null value), in the `compact` workload.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tombstone: bool,
}

impl Msg {
    /// A message with an offset.
    pub fn at(key: Key, value: Value, offset: u64) -> Self {
        Msg { key, value, offset: Some(offset), record_key: None, tombstone: false }
    }

    /// A message without an offset (a send that was not acknowledged).
    pub fn unacked(key: Key, value: Value) -> Self {
        Msg { key, value, offset: None, record_key: None, tombstone: false }
    }

    /// The same message with record key `record_key` (a value, or a
    /// tombstone when `tombstone`).
    pub fn keyed(self, record_key: u32, tombstone: bool) -> Self {
        Msg { record_key: Some(record_key), tombstone, ..self }
    }
}

/// One completed operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Op {
    /// Order of completion in the history, from 0.
    pub index: u64,
    /// The logical process (one client, single-threaded). A producer whose
    /// operation ended `info` continues as a new process, as in Jepsen.
    pub process: u32,
    /// Send or poll.
    #[serde(rename = "type")]
    pub op_type: OpType,
    /// ok, fail or info.
    pub outcome: Outcome,
    /// Invocation time, ns since the start of the run.
    pub invoke_ns: u64,
    /// Completion time, ns since the start of the run.
    pub complete_ns: u64,
    /// Values sent, in send order, or read, in the order returned.
    pub msgs: Vec<Msg>,
    /// For a poll: the consumer (re)assigned or sought before this poll, so
    /// its offsets need not follow the previous poll's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reset: bool,
    /// For a poll in the final phase (read every partition to its end).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub final_read: bool,
    /// A poll or commit by a consumer-group member (`group` workload).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub group: bool,
    /// The error, for fail and info.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Reads a JSON-lines history.
///
/// # Errors
/// IO errors and malformed lines (with the line number).
pub fn read_jsonl(path: &Path) -> anyhow::Result<Vec<Op>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut ops = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        ops.push(serde_json::from_str(&line).with_context(|| format!("{}:{}", path.display(), i + 1))?);
    }
    Ok(ops)
}

/// Writes a JSON-lines history.
///
/// # Errors
/// IO errors.
pub fn write_jsonl(path: &Path, ops: &[Op]) -> anyhow::Result<()> {
    let mut w = BufWriter::new(std::fs::File::create(path)?);
    for op in ops {
        serde_json::to_writer(&mut w, op)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    Ok(())
}

/// Collects operations from concurrent clients, numbering them in order of
/// completion and timing them against one clock. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Recorder {
    start: Instant,
    ops: Arc<Mutex<Vec<Op>>>,
}

/// An operation in progress: its invoke time.
#[derive(Debug, Clone, Copy)]
pub struct Invocation {
    /// The process running it.
    pub process: u32,
    /// The invoke time, ns since start.
    pub invoke_ns: u64,
}

impl Recorder {
    /// A recorder whose clock starts now.
    pub fn new() -> Self {
        Self::starting_at(Instant::now())
    }

    /// A recorder whose clock started at `start`.
    pub fn starting_at(start: Instant) -> Self {
        Recorder { start, ops: Arc::new(Mutex::new(Vec::new())) }
    }

    /// The clock's zero.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// Nanoseconds since the start.
    pub fn now_ns(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Starts an operation of `process`.
    pub fn invoke(&self, process: u32) -> Invocation {
        Invocation { process, invoke_ns: self.now_ns() }
    }

    /// Completes an operation and records it.
    pub fn complete(
        &self,
        inv: Invocation,
        op_type: OpType,
        outcome: Outcome,
        msgs: Vec<Msg>,
        error: Option<String>,
    ) {
        self.push(Op {
            index: 0,
            process: inv.process,
            op_type,
            outcome,
            invoke_ns: inv.invoke_ns,
            complete_ns: self.now_ns(),
            msgs,
            reset: false,
            final_read: false,
            group: false,
            error,
        });
    }

    /// Records a fully formed operation (its index is assigned here).
    pub fn push(&self, mut op: Op) {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        op.index = ops.len() as u64;
        ops.push(op);
    }

    /// Every operation recorded so far.
    pub fn snapshot(&self) -> Vec<Op> {
        self.ops.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many operations were recorded.
    pub fn len(&self) -> usize {
        self.ops.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_round_trip() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("ferrolog-jepsen-history-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("h.jsonl");
        let r = Recorder::new();
        let inv = r.invoke(3);
        r.complete(inv, OpType::Send, Outcome::Ok, vec![Msg::at(1, 7, 0), Msg::at(1, 8, 1)], None);
        let inv = r.invoke(4);
        r.complete(inv, OpType::Send, Outcome::Info, vec![Msg::unacked(2, 9)], Some("timeout".into()));
        let ops = r.snapshot();
        write_jsonl(&path, &ops)?;
        let text = std::fs::read_to_string(&path)?;
        assert!(
            text.lines()
                .next()
                .is_some_and(|l| l.contains(r#""type":"send""#) && l.contains(r#""outcome":"ok""#))
        );
        assert_eq!(read_jsonl(&path)?, ops);
        assert_eq!(ops[1].index, 1);
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}

//! Input of `ferrolog produce`: lines or CSV rows from stdin, a file, or
//! the one CSV inside a `.zip`, read on a thread of its own and handed to
//! the async side through a bounded channel.
//!
//! - Line mode: each line (without `\n` / `\r\n`) is a record value.
//! - CSV mode: the first row is the header; each later row is a record
//!   whose value is the row's raw text, with its key and timestamp taken
//!   from named fields. One `csv::Reader` parses the whole input (a quoted
//!   field may span lines, RFC 4180); the raw text of a row is cut from a
//!   copy of the input between its start and the next row's start.

use std::cell::RefCell;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, bail};
use bytes::Bytes;

use crate::timefmt::parse_timestamp_ms;

/// Where records come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Standard input.
    Stdin,
    /// A file: plain text, CSV, or a `.zip` holding one CSV.
    File(PathBuf),
}

/// How to read the input.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Treat the input as CSV even without a `.csv` name.
    pub csv: bool,
    /// CSV field holding the record key.
    pub key_field: Option<String>,
    /// CSV field holding the record timestamp.
    pub timestamp_field: Option<String>,
}

impl Options {
    fn forces_csv(&self) -> bool {
        self.csv || self.key_field.is_some() || self.timestamp_field.is_some()
    }
}

/// One input record, or why an input row could not become one.
#[derive(Debug, PartialEq, Eq)]
pub enum Item {
    /// A record to send; `line` is its first line number in the input (1-based).
    Record {
        /// First line of the record.
        line: u64,
        /// Key, from the key field.
        key: Option<Bytes>,
        /// Value: the line or raw CSV row.
        value: Bytes,
        /// From the timestamp field; 0 lets the broker stamp it.
        timestamp_ms: i64,
    },
    /// A row that could not be read as a record.
    Bad {
        /// First line of the row.
        line: u64,
        /// What is wrong.
        message: String,
    },
}

/// Bytes read so far and the input's size (0 when unknown), for progress.
#[derive(Debug, Default)]
pub struct Progress {
    /// Bytes consumed from the input (uncompressed for a zip).
    pub read_bytes: AtomicU64,
    /// Size of the input, bytes; 0 while unknown.
    pub total_bytes: AtomicU64,
}

/// Counts bytes as they are read.
struct Counting<R> {
    inner: R,
    progress: Arc<Progress>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.read_bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

fn has_extension(name: &str, ext: &str) -> bool {
    Path::new(name).extension().is_some_and(|e| e.eq_ignore_ascii_case(ext))
}

/// Starts the reader thread. It ends at the end of the input, when the
/// receiver is dropped, or with an error (unreadable file, bad header).
pub fn spawn_reader(
    source: Source,
    options: Options,
    tx: tokio::sync::mpsc::Sender<Item>,
    progress: Arc<Progress>,
) -> std::io::Result<std::thread::JoinHandle<anyhow::Result<()>>> {
    std::thread::Builder::new()
        .name("produce-input".into())
        .spawn(move || read_source(&source, &options, &tx, &progress))
}

fn read_source(
    source: &Source,
    options: &Options,
    tx: &tokio::sync::mpsc::Sender<Item>,
    progress: &Arc<Progress>,
) -> anyhow::Result<()> {
    let emit = |item| tx.blocking_send(item).is_ok();
    match source {
        Source::Stdin => {
            let reader = BufReader::new(Counting { inner: std::io::stdin(), progress: progress.clone() });
            read_records(reader, options.forces_csv(), options, emit)
        }
        Source::File(path) => {
            let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
            let name = path.to_string_lossy();
            if has_extension(&name, "zip") {
                let mut archive = zip::ZipArchive::new(file)
                    .with_context(|| format!("reading {} as a zip file", path.display()))?;
                let index =
                    choose_zip_entry(&mut archive).with_context(|| format!("in {}", path.display()))?;
                let entry = archive
                    .by_index(index)
                    .with_context(|| format!("opening entry {index} of {}", path.display()))?;
                let csv = options.forces_csv() || has_extension(entry.name(), "csv");
                progress.total_bytes.store(entry.size(), Ordering::Relaxed);
                let reader = BufReader::with_capacity(
                    256 << 10,
                    Counting { inner: entry, progress: progress.clone() },
                );
                read_records(reader, csv, options, emit).with_context(|| format!("in {}", path.display()))
            } else {
                let csv = options.forces_csv() || has_extension(&name, "csv");
                if let Ok(m) = file.metadata() {
                    progress.total_bytes.store(m.len(), Ordering::Relaxed);
                }
                let reader =
                    BufReader::with_capacity(256 << 10, Counting { inner: file, progress: progress.clone() });
                read_records(reader, csv, options, emit).with_context(|| format!("in {}", path.display()))
            }
        }
    }
}

/// The entry to read: the only file, or else the only `.csv` file.
fn choose_zip_entry<R: Read + std::io::Seek>(archive: &mut zip::ZipArchive<R>) -> anyhow::Result<usize> {
    let mut files = Vec::new();
    for i in 0..archive.len() {
        let entry = archive.by_index_raw(i)?;
        if entry.is_file() && !entry.name().starts_with("__MACOSX/") {
            files.push((i, entry.name().to_owned()));
        }
    }
    match files.as_slice() {
        [] => bail!("the zip file holds no file"),
        [(i, _)] => Ok(*i),
        many => {
            let csvs: Vec<_> = many.iter().filter(|(_, n)| has_extension(n, "csv")).collect();
            match csvs.as_slice() {
                [(i, _)] => Ok(*i),
                _ => bail!(
                    "the zip file holds {} files ({}); expected one CSV",
                    many.len(),
                    many.iter().map(|(_, n)| n.as_str()).collect::<Vec<_>>().join(", ")
                ),
            }
        }
    }
}

/// Reads every record of `reader`, handing each to `emit` until it returns
/// false (the receiver is gone).
fn read_records<R: BufRead>(
    reader: R,
    csv: bool,
    options: &Options,
    emit: impl FnMut(Item) -> bool,
) -> anyhow::Result<()> {
    if csv { read_csv(reader, options, emit) } else { read_lines(reader, emit) }
}

/// Line mode: each line, without its terminator, is a record value.
fn read_lines<R: BufRead>(mut reader: R, mut emit: impl FnMut(Item) -> bool) -> anyhow::Result<()> {
    let mut line = 0u64;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf)? == 0 {
            return Ok(());
        }
        line += 1;
        let value = trim_line_end(&buf);
        if !emit(Item::Record { line, key: None, value: Bytes::copy_from_slice(value), timestamp_ms: 0 }) {
            return Ok(());
        }
    }
}

fn trim_line_end(mut bytes: &[u8]) -> &[u8] {
    while let [rest @ .., b'\n' | b'\r'] = bytes {
        bytes = rest;
    }
    bytes
}

/// Every byte read through it, kept from `base` on, so the raw text of a
/// CSV row can be cut out once the CSV reader reports where the next row
/// starts.
#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    /// Input offset of `bytes[0]`.
    base: u64,
}

impl Captured {
    /// The text from input offset `start` to `end` (or to the end of what
    /// was read) without leading blank lines (the CSV reader counts blank
    /// lines before a row as part of it) or trailing line terminators, and
    /// the number of blank lines dropped.
    fn slice(&self, start: u64, end: Option<u64>) -> (u64, &[u8]) {
        let from = (start.saturating_sub(self.base) as usize).min(self.bytes.len());
        let to =
            end.map_or(self.bytes.len(), |e| (e.saturating_sub(self.base) as usize).min(self.bytes.len()));
        let mut text = &self.bytes[from..to.max(from)];
        let mut blank_lines = 0;
        while let [first @ (b'\n' | b'\r'), rest @ ..] = text {
            blank_lines += u64::from(*first == b'\n');
            text = rest;
        }
        (blank_lines, trim_line_end(text))
    }

    /// Forgets the text before input offset `offset`.
    fn discard_before(&mut self, offset: u64) {
        let n = (offset.saturating_sub(self.base) as usize).min(self.bytes.len());
        self.bytes.drain(..n);
        self.base += n as u64;
    }
}

struct Tee<R> {
    inner: R,
    captured: Rc<RefCell<Captured>>,
}

impl<R: Read> Read for Tee<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.captured.borrow_mut().bytes.extend_from_slice(&buf[..n]);
        Ok(n)
    }
}

/// CSV mode: one `csv::Reader` over the whole input (quoted fields may span
/// lines); each data row's raw text is cut from the captured input between
/// its start and the next row's start.
fn read_csv<R: Read>(reader: R, options: &Options, mut emit: impl FnMut(Item) -> bool) -> anyhow::Result<()> {
    let captured = Rc::new(RefCell::new(Captured::default()));
    let tee = Tee { inner: reader, captured: captured.clone() };
    let mut csv = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .buffer_capacity(64 << 10)
        .from_reader(tee);
    let mut row = csv::ByteRecord::new();
    if !csv.read_byte_record(&mut row).context("reading the CSV header")? {
        return Ok(());
    }
    let schema = CsvSchema::new(&row, options.key_field.as_deref(), options.timestamp_field.as_deref())?;
    // The row read last: its start offset, first line, and key and time.
    let mut pending: Option<(u64, u64, RowFields)> = None;
    loop {
        let more = match csv.read_byte_record(&mut row) {
            Ok(more) => more,
            Err(e) => match e.kind() {
                csv::ErrorKind::Io(_) => return Err(e).context("reading the input"),
                _ => {
                    let line = e.position().map_or(0, csv::Position::line);
                    if !emit(Item::Bad { line, message: format!("not valid CSV: {e}") }) {
                        return Ok(());
                    }
                    continue;
                }
            },
        };
        let start = row.position().map(csv::Position::byte);
        if let Some((prev_start, line, fields)) = pending.take() {
            let end = if more { start } else { None };
            let item = {
                let captured = captured.borrow();
                let (blank_lines, text) = captured.slice(prev_start, end);
                let (line, value) = (line + blank_lines, Bytes::copy_from_slice(text));
                match fields {
                    Ok((key, timestamp_ms)) => Item::Record { line, key, value, timestamp_ms },
                    Err(message) => Item::Bad { line, message },
                }
            };
            if !emit(item) {
                return Ok(());
            }
        }
        if !more {
            return Ok(());
        }
        let (start, line) = row.position().map_or((0, 0), |p| (p.byte(), p.line()));
        captured.borrow_mut().discard_before(start);
        pending = Some((start, line, schema.fields(&row)));
    }
}

/// A data row's key and timestamp, or why it has none.
type RowFields = Result<(Option<Bytes>, i64), String>;

/// The CSV header: which columns hold the key and the timestamp.
#[derive(Debug)]
pub struct CsvSchema {
    columns: usize,
    key: Option<(usize, String)>,
    timestamp: Option<(usize, String)>,
}

impl CsvSchema {
    /// Reads the header row and finds the named fields.
    ///
    /// # Errors
    /// A named field that is not in the header (the message lists the
    /// header's fields).
    pub fn new(
        header: &csv::ByteRecord,
        key_field: Option<&str>,
        timestamp_field: Option<&str>,
    ) -> anyhow::Result<Self> {
        let names: Vec<String> =
            header.iter().map(|f| String::from_utf8_lossy(f).trim().to_owned()).collect();
        let find = |wanted: Option<&str>, what: &str| -> anyhow::Result<Option<(usize, String)>> {
            let Some(wanted) = wanted else { return Ok(None) };
            match names.iter().position(|n| n == wanted) {
                Some(i) => Ok(Some((i, wanted.to_owned()))),
                None => bail!(
                    "{what} field {wanted:?} is not in the CSV header; the fields are: {}",
                    names.join(", ")
                ),
            }
        };
        Ok(CsvSchema {
            columns: names.len(),
            key: find(key_field, "key")?,
            timestamp: find(timestamp_field, "timestamp")?,
        })
    }

    /// The key and timestamp of a data row.
    ///
    /// # Errors
    /// A row that lacks a named field, or whose timestamp does not parse.
    pub fn fields(&self, row: &csv::ByteRecord) -> RowFields {
        let get = |(i, name): &(usize, String)| {
            row.get(*i).ok_or_else(|| {
                format!("the row has {} fields, the header {}: no {name:?} field", row.len(), self.columns)
            })
        };
        let key = match &self.key {
            Some(k) => Some(Bytes::copy_from_slice(get(k)?)),
            None => None,
        };
        let timestamp_ms = match &self.timestamp {
            Some(t) => {
                let text = String::from_utf8_lossy(get(t)?);
                parse_timestamp_ms(&text).map_err(|e| format!("field {:?}: {e}", t.1))?
            }
            None => 0,
        };
        Ok((key, timestamp_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str, csv: bool, options: &Options) -> anyhow::Result<Vec<Item>> {
        let mut items = Vec::new();
        read_records(text.as_bytes(), csv, options, |i| {
            items.push(i);
            true
        })?;
        Ok(items)
    }

    fn record(line: u64, key: Option<&str>, value: &str, timestamp_ms: i64) -> Item {
        Item::Record {
            line,
            key: key.map(|k| Bytes::copy_from_slice(k.as_bytes())),
            value: Bytes::copy_from_slice(value.as_bytes()),
            timestamp_ms,
        }
    }

    #[test]
    fn lines_become_values() {
        let items = read("a\r\nb\n\nlast", false, &Options::default()).expect("read");
        assert_eq!(
            items,
            vec![
                record(1, None, "a", 0),
                record(2, None, "b", 0),
                record(3, None, "", 0),
                record(4, None, "last", 0)
            ]
        );
    }

    #[test]
    fn csv_rows_keep_their_raw_text_and_take_key_and_time() {
        let options = Options {
            csv: true,
            key_field: Some("tailnum".into()),
            timestamp_field: Some("time_hour".into()),
        };
        let text = "\u{feff}year,tailnum,time_hour\n\
                    2013,N14228,2013-01-01T10:00:00Z\n\
                    \n\
                    2013,\"N2,\"\"4\"\"\n11\",2013-01-01 11:00:00\r\n\
                    2013,N1,1000\n\
                    2013,N2,NA\n\
                    2013\n";
        let items = read(text, true, &options).expect("read");
        assert_eq!(
            items[0],
            record(2, Some("N14228"), "2013,N14228,2013-01-01T10:00:00Z", 1_357_034_400_000)
        );
        assert_eq!(
            items[1],
            record(
                4,
                Some("N2,\"4\"\n11"),
                "2013,\"N2,\"\"4\"\"\n11\",2013-01-01 11:00:00",
                1_357_038_000_000
            ),
            "a quoted field spans lines"
        );
        assert_eq!(items[2], record(6, Some("N1"), "2013,N1,1000", 1000));
        assert!(
            matches!(&items[3], Item::Bad { line: 7, message } if message.contains("time_hour")),
            "{:?}",
            items[3]
        );
        assert!(
            matches!(&items[4], Item::Bad { line: 8, message } if message.contains("1 fields")),
            "{:?}",
            items[4]
        );
        assert_eq!(items.len(), 5);
    }

    #[test]
    fn a_byte_order_mark_is_not_part_of_the_first_field_name() {
        let options = Options { key_field: Some("k".into()), ..Options::default() };
        let items = read("\u{feff}k,v\nx,1\n", true, &options).expect("read");
        assert_eq!(items, vec![record(2, Some("x"), "x,1", 0)]);
    }

    #[test]
    fn unknown_fields_are_named() {
        let options = Options { key_field: Some("nope".into()), ..Options::default() };
        let e = read("a,b\n1,2\n", true, &options).expect_err("unknown field");
        assert!(e.to_string().contains("\"nope\"") && e.to_string().contains("a, b"), "{e}");
    }

    #[test]
    fn csv_without_fields_sends_rows_unkeyed() {
        let items = read("h1,h2\n1,2\n", true, &Options { csv: true, ..Options::default() }).expect("read");
        assert_eq!(items, vec![record(2, None, "1,2", 0)]);
    }

    #[test]
    fn reads_the_csv_inside_a_zip() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("ferrolog-cli-zip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("t.csv.zip");
        let mut w = zip::ZipWriter::new(File::create(&path).expect("create"));
        w.start_file(
            "t.csv",
            zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored),
        )
        .expect("start");
        w.write_all(b"k,v\nx,1\ny,2\n").expect("write");
        w.finish().expect("finish");
        let (tx, mut rx) = tokio::sync::mpsc::channel(10);
        let progress = Arc::new(Progress::default());
        let options = Options { key_field: Some("k".into()), ..Options::default() };
        read_source(&Source::File(path), &options, &tx, &progress).expect("read");
        drop(tx);
        let mut keys = Vec::new();
        while let Ok(Item::Record { key, .. }) = rx.try_recv() {
            keys.push(key.expect("key"));
        }
        assert_eq!(keys, vec![Bytes::from_static(b"x"), Bytes::from_static(b"y")]);
        assert_eq!(progress.total_bytes.load(Ordering::Relaxed), 12);
        std::fs::remove_dir_all(&dir).ok();
    }
}

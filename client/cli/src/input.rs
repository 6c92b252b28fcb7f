//! Input of `ferrolog produce`: lines or CSV rows from stdin, a file, or
//! the one CSV inside a `.zip`, read on a thread of its own and handed to
//! the async side through a bounded channel.
//!
//! - Line mode: each line (without `\n` / `\r\n`) is a record value.
//! - CSV mode: the first row is the header; each later row is a record
//!   whose value is the row's raw text, with its key and timestamp taken
//!   from named fields. A quoted field may span lines (RFC 4180): a row
//!   ends at a line end outside quotes, which is where the count of `"`
//!   characters is even.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
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

/// Reads one logical record: a line, or in CSV mode as many lines as it
/// takes to close every quote. Returns the first line's number, or `None`
/// at the end of the input. `buf` receives the text without its final line
/// terminator.
fn next_record<R: BufRead>(
    reader: &mut R,
    csv: bool,
    line: &mut u64,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<u64>> {
    buf.clear();
    let first = *line + 1;
    let mut quotes = 0usize;
    loop {
        let start = buf.len();
        let n = reader.read_until(b'\n', buf)?;
        if n == 0 {
            return Ok(if buf.is_empty() { None } else { Some(first) });
        }
        *line += 1;
        quotes += buf[start..].iter().filter(|b| **b == b'"').count();
        if !csv || quotes.is_multiple_of(2) {
            if buf.last() == Some(&b'\n') {
                buf.pop();
                if buf.last() == Some(&b'\r') {
                    buf.pop();
                }
            }
            return Ok(Some(first));
        }
    }
}

/// Reads every record of `reader`, handing each to `emit` until it returns
/// false (the receiver is gone).
fn read_records<R: BufRead>(
    mut reader: R,
    csv: bool,
    options: &Options,
    mut emit: impl FnMut(Item) -> bool,
) -> anyhow::Result<()> {
    let mut line = 0u64;
    let mut buf = Vec::new();
    let schema = if csv {
        if next_record(&mut reader, true, &mut line, &mut buf)?.is_none() {
            return Ok(());
        }
        let header = buf.strip_prefix(b"\xef\xbb\xbf".as_slice()).unwrap_or(&buf);
        Some(CsvSchema::new(header, options.key_field.as_deref(), options.timestamp_field.as_deref())?)
    } else {
        None
    };
    while let Some(first) = next_record(&mut reader, csv, &mut line, &mut buf)? {
        let item = match &schema {
            None => {
                Item::Record { line: first, key: None, value: Bytes::copy_from_slice(&buf), timestamp_ms: 0 }
            }
            Some(_) if buf.is_empty() => continue,
            Some(schema) => match schema.fields(&buf) {
                Ok((key, timestamp_ms)) => {
                    Item::Record { line: first, key, value: Bytes::copy_from_slice(&buf), timestamp_ms }
                }
                Err(message) => Item::Bad { line: first, message },
            },
        };
        if !emit(item) {
            break;
        }
    }
    Ok(())
}

/// The CSV header: which columns hold the key and the timestamp.
#[derive(Debug)]
pub struct CsvSchema {
    columns: usize,
    key: Option<(usize, String)>,
    timestamp: Option<(usize, String)>,
}

fn parse_row(raw: &[u8]) -> Result<csv::ByteRecord, String> {
    let mut reader = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(raw);
    let mut row = csv::ByteRecord::new();
    match reader.read_byte_record(&mut row) {
        Ok(true) => Ok(row),
        Ok(false) => Ok(csv::ByteRecord::new()),
        Err(e) => Err(format!("not valid CSV: {e}")),
    }
}

impl CsvSchema {
    /// Reads the header row and finds the named fields.
    ///
    /// # Errors
    /// A named field that is not in the header (the message lists the
    /// header's fields), or a header that is not CSV.
    pub fn new(
        header: &[u8],
        key_field: Option<&str>,
        timestamp_field: Option<&str>,
    ) -> anyhow::Result<Self> {
        let row = parse_row(header).map_err(|e| anyhow::anyhow!("CSV header: {e}"))?;
        let names: Vec<String> = row.iter().map(|f| String::from_utf8_lossy(f).trim().to_owned()).collect();
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
    /// A row that is not CSV, lacks a named field, or whose timestamp does
    /// not parse.
    pub fn fields(&self, raw: &[u8]) -> Result<(Option<Bytes>, i64), String> {
        if self.key.is_none() && self.timestamp.is_none() {
            return Ok((None, 0));
        }
        let row = parse_row(raw)?;
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

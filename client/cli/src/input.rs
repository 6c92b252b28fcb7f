//! Input of `ferrolog produce`: lines or CSV rows from stdin, a file, or
//! the one CSV inside a `.zip`, read on a thread of its own and handed to
//! the async side through a bounded channel.
//!
//! - Line mode: a line ends at `\n`; the line without it, and without one
//!   `\r` before it (`\r\n`), is a record value, byte for byte. An empty
//!   line is a record with an empty value; a last line without `\n` is a
//!   record too; a `\r` anywhere else is part of the value. Nothing in line
//!   mode is malformed.
//! - CSV mode: the first row is the header; each later row is a record
//!   whose value is the row's raw text (without its line ending), with its
//!   key and timestamp taken from named fields. One `csv::Reader` parses
//!   the whole input (RFC 4180: a quoted field may span lines; `\n`,
//!   `\r\n` and `\r` end rows; blank lines between rows are skipped); the
//!   raw text of a row is cut from a copy of the input between its start
//!   and the next row's start.
//! - Malformed CSV is reported as [`Item::Bad`] with its line number, never
//!   merged silently: a row whose field count differs from the header's,
//!   and a quoted field that is never closed (the CSV reader would take
//!   the rest of the input as that one field). After an unclosed quote,
//!   reading resumes on the line after the quote, so a consumer that skips
//!   bad rows loses only that one.

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
    /// Line mode: each line is `key SEPARATOR value`, cut at the first
    /// separator (Kafka's console producer `parse.key` / `key.separator`);
    /// a `.csv` file is then read as lines too.
    pub key_separator: Option<String>,
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
        /// The line where the row starts, or where the quote that is never
        /// closed opens (1-based).
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
                let csv = options.forces_csv()
                    || (options.key_separator.is_none() && has_extension(entry.name(), "csv"));
                progress.total_bytes.store(entry.size(), Ordering::Relaxed);
                let reader = BufReader::with_capacity(
                    256 << 10,
                    Counting { inner: entry, progress: progress.clone() },
                );
                read_records(reader, csv, options, emit).with_context(|| format!("in {}", path.display()))
            } else {
                let csv =
                    options.forces_csv() || (options.key_separator.is_none() && has_extension(&name, "csv"));
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
    if csv {
        read_csv(reader, options, emit)
    } else {
        read_lines(reader, options.key_separator.as_deref(), emit)
    }
}

/// Line mode: each line, without its terminator, is a record value; with
/// a key separator, the line up to its first separator is the key and the
/// rest the value (a line without one is bad input).
fn read_lines<R: BufRead>(
    mut reader: R,
    key_separator: Option<&str>,
    mut emit: impl FnMut(Item) -> bool,
) -> anyhow::Result<()> {
    let mut line = 0u64;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf)? == 0 {
            return Ok(());
        }
        line += 1;
        let text = line_value(&buf);
        let item = match key_separator.map(str::as_bytes) {
            None => Item::Record { line, key: None, value: Bytes::copy_from_slice(text), timestamp_ms: 0 },
            Some(sep) => match text.windows(sep.len()).position(|w| w == sep) {
                Some(at) => Item::Record {
                    line,
                    key: Some(Bytes::copy_from_slice(&text[..at])),
                    value: Bytes::copy_from_slice(&text[at + sep.len()..]),
                    timestamp_ms: 0,
                },
                None => Item::Bad {
                    line,
                    message: format!("no key separator {:?} in the line", String::from_utf8_lossy(sep)),
                },
            },
        };
        if !emit(item) {
            return Ok(());
        }
    }
}

/// A line without its terminator: `\n`, or `\r\n`; a last line without
/// `\n` is kept whole.
fn line_value(line: &[u8]) -> &[u8] {
    match line {
        [rest @ .., b'\r', b'\n'] | [rest @ .., b'\n'] => rest,
        whole => whole,
    }
}

/// A CSV row's text without the line terminators after it.
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

fn csv_reader<R: Read>(reader: R) -> csv::Reader<R> {
    csv::ReaderBuilder::new().has_headers(false).flexible(true).buffer_capacity(64 << 10).from_reader(reader)
}

/// CSV mode: one `csv::Reader` over the whole input (quoted fields may span
/// lines); each data row's raw text is cut from the captured input between
/// its start and the next row's start. After a quoted field that is never
/// closed, a new reader goes on over the rest of the input from the line
/// after the quote.
fn read_csv<R: Read>(reader: R, options: &Options, mut emit: impl FnMut(Item) -> bool) -> anyhow::Result<()> {
    let captured = Rc::new(RefCell::new(Captured::default()));
    let mut csv = csv_reader(Tee { inner: reader, captured: captured.clone() });
    let mut row = csv::ByteRecord::new();
    if !csv.read_byte_record(&mut row).context("reading the CSV header")? {
        return Ok(());
    }
    {
        // A header that opens a quote and never closes it runs to the end
        // of the input.
        let captured = captured.borrow();
        let end = (csv.position().byte() as usize).min(captured.bytes.len());
        let text = &captured.bytes[..end];
        let text = text.strip_prefix(b"\xef\xbb\xbf").unwrap_or(text);
        if let Some(at) = unclosed_quote(text) {
            bail!(
                "line {}: the CSV header opens a quoted field that is never closed",
                1 + newlines(&text[..at])
            );
        }
    }
    let schema = CsvSchema::new(&row, options.key_field.as_deref(), options.timestamp_field.as_deref())?;
    let mut rest = read_rows(&mut csv, &captured, &schema, 0, &mut emit)?;
    while let Some((text, line_base)) = rest {
        let captured = Rc::new(RefCell::new(Captured::default()));
        let mut csv = csv_reader(Tee { inner: text.as_slice(), captured: captured.clone() });
        rest = read_rows(&mut csv, &captured, &schema, line_base, &mut emit)?;
    }
    Ok(())
}

/// The input left after an unclosed quote, and the line number before its
/// first line.
type Resume = Option<(Vec<u8>, u64)>;

/// Reads data rows to the end of the input (or until `emit` returns
/// false), numbering lines from `line_base` + 1. A last row that ends
/// inside a quoted field is reported as [`Item::Bad`] and the input after
/// the quote's line returned, to be read on.
fn read_rows<R: Read>(
    csv: &mut csv::Reader<Tee<R>>,
    captured: &Rc<RefCell<Captured>>,
    schema: &CsvSchema,
    line_base: u64,
    emit: &mut impl FnMut(Item) -> bool,
) -> anyhow::Result<Resume> {
    let mut row = csv::ByteRecord::new();
    // The row read last: its start offset, first line, and key and time.
    let mut pending: Option<(u64, u64, RowFields)> = None;
    loop {
        let more = match csv.read_byte_record(&mut row) {
            Ok(more) => more,
            Err(e) => match e.kind() {
                csv::ErrorKind::Io(_) => return Err(e).context("reading the input"),
                _ => {
                    let line = line_base + e.position().map_or(0, csv::Position::line);
                    if !emit(Item::Bad { line, message: format!("not valid CSV: {e}") }) {
                        return Ok(None);
                    }
                    continue;
                }
            },
        };
        let start = row.position().map(csv::Position::byte);
        if let Some((prev_start, line, fields)) = pending.take() {
            let end = if more { start } else { None };
            let (item, resume) = {
                let captured = captured.borrow();
                let (blank_lines, text) = captured.slice(prev_start, end);
                let line = line_base + line + blank_lines;
                // Only the last row can end inside quotes: the CSV reader
                // ends a quoted field only at its closing quote or at the
                // end of the input.
                match (end, unclosed_quote(text)) {
                    (None, Some(at)) => {
                        let quote_line = line + newlines(&text[..at]);
                        let last_line = line + newlines(text);
                        let from = if line < quote_line {
                            format!(" (in the row from line {line})")
                        } else {
                            String::new()
                        };
                        let message = format!(
                            "a quoted field opened on this line{from} is never closed: lines \
                             {quote_line}-{last_line} would be read as one field"
                        );
                        let resume = text[at..]
                            .iter()
                            .position(|b| *b == b'\n')
                            .map(|nl| (text[at + nl + 1..].to_vec(), quote_line));
                        (Item::Bad { line: quote_line, message }, resume)
                    }
                    _ => {
                        let item = match fields {
                            Ok((key, timestamp_ms)) => {
                                Item::Record { line, key, value: Bytes::copy_from_slice(text), timestamp_ms }
                            }
                            Err(message) => {
                                let spans = newlines(text);
                                let message = if spans > 0 {
                                    format!("{message} (the row spans lines {line}-{})", line + spans)
                                } else {
                                    message
                                };
                                Item::Bad { line, message }
                            }
                        };
                        (item, None)
                    }
                }
            };
            if !emit(item) {
                return Ok(None);
            }
            if resume.is_some() {
                return Ok(resume);
            }
        }
        if !more {
            return Ok(None);
        }
        let (start, line) = row.position().map_or((0, 0), |p| (p.byte(), p.line()));
        captured.borrow_mut().discard_before(start);
        pending = Some((start, line, schema.fields(&row)));
    }
}

/// Number of `\n` in `text`.
fn newlines(text: &[u8]) -> u64 {
    text.iter().filter(|b| **b == b'\n').count() as u64
}

/// Where the quoted field that `text` (the raw text of CSV rows, from the
/// start of a row) ends inside opens, if it does: the quoting rules of the
/// `csv` crate (RFC 4180): a `"` opens a quoted field only at the start of
/// a field, `""` inside one is a quote, and the next single `"` closes it.
fn unclosed_quote(text: &[u8]) -> Option<usize> {
    #[derive(Clone, Copy)]
    enum State {
        FieldStart,
        Unquoted,
        Quoted(usize),
        QuoteInQuoted(usize),
    }
    let mut state = State::FieldStart;
    for (i, b) in text.iter().enumerate() {
        state = match (state, b) {
            (State::FieldStart, b'"') => State::Quoted(i),
            (State::Quoted(at), b'"') => State::QuoteInQuoted(at),
            (State::Quoted(at), _) | (State::QuoteInQuoted(at), b'"') => State::Quoted(at),
            (_, b',' | b'\n' | b'\r') => State::FieldStart,
            _ => State::Unquoted,
        };
    }
    match state {
        State::Quoted(at) => Some(at),
        _ => None,
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
    /// A row with more or fewer fields than the header, or whose timestamp
    /// does not parse.
    pub fn fields(&self, row: &csv::ByteRecord) -> RowFields {
        if row.len() != self.columns {
            return Err(format!("the row has {} fields, the header {}", row.len(), self.columns));
        }
        let get =
            |(i, name): &(usize, String)| row.get(*i).ok_or_else(|| format!("the row has no {name:?} field"));
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
    fn a_key_separator_cuts_each_line_at_its_first_one() {
        let options = Options { key_separator: Some("::".into()), ..Options::default() };
        let items = read("a::1\n::empty key\nb::\nc::x::y\nnone\n", false, &options).expect("read");
        assert_eq!(
            items,
            vec![
                record(1, Some("a"), "1", 0),
                record(2, Some(""), "empty key", 0),
                record(3, Some("b"), "", 0),
                record(4, Some("c"), "x::y", 0),
                Item::Bad { line: 5, message: "no key separator \"::\" in the line".into() },
            ]
        );
    }

    #[test]
    fn line_endings_are_newline_or_crlf_and_nothing_else() {
        let items = read("a\r\r\nb\rc\n\r\n\nlast\r", false, &Options::default()).expect("read");
        assert_eq!(
            items,
            vec![
                record(1, None, "a\r", 0),
                record(2, None, "b\rc", 0),
                record(3, None, "", 0),
                record(4, None, "", 0),
                record(5, None, "last\r", 0)
            ]
        );
        assert_eq!(read("", false, &Options::default()).expect("read"), vec![]);
        assert_eq!(read("\n", false, &Options::default()).expect("read"), vec![record(1, None, "", 0)]);
    }

    #[test]
    fn csv_line_endings_and_blank_lines() {
        let options = Options { csv: true, ..Options::default() };
        let items = read("h1,h2\r\n1,2\r\n\r\n3,4\r5,6\n\n7,8", true, &options).expect("read");
        assert_eq!(
            items,
            vec![
                record(2, None, "1,2", 0),
                record(4, None, "3,4", 0),
                record(4, None, "5,6", 0),
                record(6, None, "7,8", 0)
            ]
        );
    }

    #[test]
    fn an_unclosed_quote_is_reported_on_its_line_and_the_rows_after_it_are_read() {
        let options = Options { csv: true, ..Options::default() };
        let items =
            read("id,note\n1,\"two\nlines\"\n2,\"open\n3,after\n4,fine\n", true, &options).expect("read");
        assert_eq!(items.len(), 4, "{items:?}");
        assert_eq!(items[0], record(2, None, "1,\"two\nlines\"", 0));
        assert!(
            matches!(&items[1], Item::Bad { line: 4, message } if message.contains("never closed") && message.contains("4-6")),
            "{:?}",
            items[1]
        );
        assert_eq!(items[2], record(5, None, "3,after", 0));
        assert_eq!(items[3], record(6, None, "4,fine", 0));

        // Unclosed on the last line, without a line end.
        let items = read("a,b\n1,2\n\"x,y", true, &options).expect("read");
        assert!(matches!(items.as_slice(), [_, Item::Bad { line: 3, .. }]), "{items:?}");
        // In the header: nothing can be read.
        let e = read("a,\"b\n1,2\n", true, &options).expect_err("unclosed header");
        assert!(e.to_string().contains("line 1") && e.to_string().contains("never closed"), "{e}");
    }

    #[test]
    fn a_quote_closed_rows_later_is_a_row_with_the_wrong_field_count() {
        let options = Options { csv: true, ..Options::default() };
        let items = read("a,b\n1,\"x\n2,y\n3\",z\n4,w\n", true, &options).expect("read");
        assert_eq!(items.len(), 2, "{items:?}");
        assert!(
            matches!(&items[0], Item::Bad { line: 2, message } if message.contains("3 fields") && message.contains("lines 2-4")),
            "{:?}",
            items[0]
        );
        assert_eq!(items[1], record(5, None, "4,w", 0));
    }

    #[test]
    fn unclosed_quotes_follow_the_csv_quoting_rules() {
        assert_eq!(unclosed_quote(b"a,\"b"), Some(2));
        assert_eq!(unclosed_quote(b"a,\"b\"\"\n,c"), Some(2), "an escaped quote does not close");
        assert_eq!(unclosed_quote(b"a,\"b\"\"\""), None);
        assert_eq!(unclosed_quote(b"a,b\"c"), None, "a quote inside an unquoted field is text");
        assert_eq!(unclosed_quote(b"\"a\"b\"c,d"), None, "after the closing quote the field is unquoted");
        assert_eq!(unclosed_quote(b"x\n\"a"), Some(2));
    }

    #[test]
    fn csv_rows_keep_their_raw_text_and_take_key_and_time() {
        let options = Options {
            csv: true,
            key_field: Some("tailnum".into()),
            timestamp_field: Some("time_hour".into()),
            key_separator: None,
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

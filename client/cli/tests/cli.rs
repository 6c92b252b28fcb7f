//! The `ferrolog` command line against a real 3-broker cluster: brokers are
//! `ferrolog broker` processes on a loopback address of the test's own; every step runs the
//! binary as a user would and checks its exit code and output.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferrolog_client::partitioner::partition_for_key;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_ferrolog");

/// Three broker processes, killed when dropped.
struct Brokers {
    /// Broker id - 1 → its process.
    children: Vec<Child>,
    bootstrap: String,
    /// Kafka listener addresses of the founding brokers, index = id - 1.
    kafka: Vec<String>,
    /// Peer addresses of the brokers, index = id - 1 (for `--join`).
    peers: Vec<String>,
    /// The command line of each joined broker (id, args), to restart it.
    joined_args: Vec<(u32, Vec<String>)>,
    /// The command line of each founding broker (index = id - 1).
    founder_args: Vec<Vec<String>>,
    /// The config file every founding broker reads, if any.
    config_file: Option<PathBuf>,
    dir: tempfile::TempDir,
}

impl Drop for Brokers {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Brokers {
    fn start() -> Brokers {
        Self::start_with_config(None)
    }

    /// As [`Brokers::start`], every broker reading `config` (TOML) first.
    fn start_with_config(config: Option<&str>) -> Brokers {
        let mut dir = tempfile::tempdir().expect("temp dir");
        // FERROLOG_KEEP_DATA=1 keeps the data directories and logs.
        if std::env::var_os("FERROLOG_KEEP_DATA").is_some() {
            dir.disable_cleanup(true);
            eprintln!("data and logs kept in {}", dir.path().display());
        }
        let (ip, ports) = common::private_addrs(9);
        let (client, rest) = ports.split_at(3);
        let (peer, kafka) = rest.split_at(3);
        let initial = (0..3).map(|i| format!("{}={ip}:{}", i + 1, peer[i])).collect::<Vec<_>>().join(",");
        let config_file = config.map(|text| write(dir.path(), "broker.toml", text));
        let mut children = Vec::new();
        let mut founder_args = Vec::new();
        for i in 0..3 {
            let log = std::fs::File::create(dir.path().join(format!("broker-{}.log", i + 1))).expect("log");
            let args: Vec<String> = vec![
                "broker".into(),
                "run".into(),
                "--node-id".into(),
                (i + 1).to_string(),
                "--client-addr".into(),
                format!("{ip}:{}", client[i]),
                "--peer-addr".into(),
                format!("{ip}:{}", peer[i]),
                "--kafka-addr".into(),
                format!("{ip}:{}", kafka[i]),
                "--data-dir".into(),
                dir.path().join(format!("broker-{}", i + 1)).display().to_string(),
                "--initial-cluster".into(),
                initial.clone(),
            ];
            children.push(Self::spawn_founder(&args, config_file.as_deref(), log));
            founder_args.push(args);
        }
        let bootstrap = client.iter().map(|p| format!("{ip}:{p}")).collect::<Vec<_>>().join(",");
        let peers = peer.iter().map(|p| format!("{ip}:{p}")).collect();
        let kafka = kafka.iter().map(|p| format!("{ip}:{p}")).collect();
        let brokers = Brokers {
            children,
            bootstrap,
            kafka,
            peers,
            joined_args: Vec::new(),
            founder_args,
            config_file,
            dir,
        };
        brokers.wait_ready();
        brokers
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = self.run(&["cluster", "status"], None);
            let text = String::from_utf8_lossy(&out.stdout);
            let alive = text
                .lines()
                .filter(|l| l.starts_with(char::is_numeric) && l.split_whitespace().any(|w| w == "yes"))
                .count();
            if out.status.success() && alive == 3 && !text.contains("controller: unknown") {
                return;
            }
            assert!(Instant::now() < deadline, "cluster not ready:\n{text}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Starts a broker that joins the cluster (`broker run --join`, on an
    /// address of its own, without `--node-id`) and waits until `broker
    /// list` shows it alive; returns the id the cluster gave it.
    fn join(&mut self) -> u32 {
        let (ip, ports) = common::private_addrs(2);
        let n = self.children.len() + 1;
        let log = std::fs::File::create(self.dir.path().join(format!("broker-{n}.log"))).expect("log");
        let (client, peer) = (format!("{ip}:{}", ports[0]), format!("{ip}:{}", ports[1]));
        let data = self.dir.path().join(format!("broker-{n}")).display().to_string();
        let args: Vec<String> = [
            "broker",
            "run",
            "--client-addr",
            &client,
            "--peer-addr",
            &peer,
            "--data-dir",
            &data,
            "--kafka-addr",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain([format!("{ip}:0"), "--join".to_owned(), self.peers.join(",")])
        .collect();
        let child = Self::spawn_broker(&args, log);
        self.joined_args.push((n as u32, args));
        self.children.push(child);
        self.peers.push(peer);
        self.bootstrap = format!("{},{client}", self.bootstrap);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let rows = broker_rows(self);
            // It answers Metadata itself only once the metadata reached it.
            let own =
                Command::new(BIN).args(["--bootstrap", &client, "broker", "list"]).output().expect("run");
            if rows.len() == n && own.status.success() {
                let row = rows.last().expect("a row");
                if row.1 == "alive" {
                    return row.0;
                }
            }
            assert!(Instant::now() < deadline, "broker {n} did not join: {rows:?}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    fn spawn_founder(args: &[String], config: Option<&Path>, log: std::fs::File) -> Child {
        let mut command = Command::new(BIN);
        match config {
            Some(f) => command.env("FERROLOG_CONFIG", f),
            None => command.env_remove("FERROLOG_CONFIG"),
        };
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start a broker")
    }

    /// Starts founding broker `id` again (after [`Brokers::kill`]).
    fn restart_founder(&mut self, id: u32) {
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.path().join(format!("broker-{id}.log")))
            .expect("log");
        let args = self.founder_args[(id - 1) as usize].clone();
        self.children[(id - 1) as usize] = Self::spawn_founder(&args, self.config_file.as_deref(), log);
    }

    fn spawn_broker(args: &[String], log: std::fs::File) -> Child {
        Command::new(BIN)
            .args(args)
            .env_remove("FERROLOG_CONFIG")
            .env_remove("FERROLOG_NODE_ID")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start a joining broker")
    }

    /// Starts joined broker `id` again with the command line it first had.
    fn respawn(&mut self, id: u32) {
        let args = self.joined_args.iter().find(|(b, _)| *b == id).map(|(_, a)| a.clone()).expect("joined");
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.path().join(format!("broker-{id}.log")))
            .expect("log");
        self.children[(id - 1) as usize] = Self::spawn_broker(&args, log);
    }

    /// SIGKILLs broker `id`.
    fn kill(&mut self, id: u32) {
        let c = &mut self.children[(id - 1) as usize];
        let _ = c.kill();
        let _ = c.wait();
    }

    fn logs(&self) -> String {
        (1..=self.children.len())
            .map(|i| {
                let p = self.dir.path().join(format!("broker-{i}.log"));
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                format!("--- {}:\n{}", p.display(), tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A probe of group `g`'s committed offsets usable from another thread.
    fn probe(&self) -> impl Fn() -> Option<std::collections::BTreeMap<u32, u64>> + Send + 'static {
        let bootstrap = self.bootstrap.clone();
        move || {
            let out = Command::new(BIN)
                .args(["--bootstrap", &bootstrap, "group", "describe", "g"])
                .stdin(Stdio::null())
                .output()
                .ok()?;
            out.status.success().then(|| parse_committed(&String::from_utf8_lossy(&out.stdout)))
        }
    }

    /// Runs `ferrolog --bootstrap <cluster> args...`, feeding `stdin`.
    fn run(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut child = Command::new(BIN)
            .arg("--bootstrap")
            .arg(&self.bootstrap)
            .args(args)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run ferrolog");
        if let Some(text) = stdin {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write stdin");
        }
        child.wait_with_output().expect("wait for ferrolog")
    }

    /// Runs a command that must succeed; returns its stdout.
    fn ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.run(args, stdin);
        assert!(
            out.status.success(),
            "ferrolog {args:?} failed: {}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8 output")
    }

    /// Runs a command that must fail; returns its stderr.
    fn fails(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.run(args, stdin);
        assert!(
            !out.status.success(),
            "ferrolog {args:?} should fail: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stderr).expect("utf-8 output")
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p
}

fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

#[test]
fn topics_produce_and_consume_through_the_command_line() {
    let c = Brokers::start();

    // Topics.
    let out = c.ok(&["topic", "create", "readings", "--partitions", "2", "--replication-factor", "3"], None);
    assert!(out.contains("created topic readings: 2 partitions, replication factor 3"), "{out}");
    let err =
        c.fails(&["topic", "create", "readings", "--partitions", "2", "--replication-factor", "3"], None);
    assert!(err.contains("already exists"), "{err}");
    let err = c.fails(&["topic", "create", "wide", "--partitions", "1", "--replication-factor", "5"], None);
    assert!(err.contains("INVALID_REPLICATION_FACTOR"), "{err}");
    let out = c.ok(&["topic", "describe", "readings"], None);
    assert!(out.contains("topic readings: 2 partitions, replication factor 3"), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with(char::is_numeric)).count(), 2, "{out}");

    // CSV: keys and timestamps from fields, a quoted field over two lines,
    // one row whose time does not parse (skipped and counted, as asked).
    let csv = "id,note,ts\n\
               s1,cold,2013-01-01T10:00:00Z\n\
               s2,\"two\nlines, quoted\",2013-01-01 10:30:00\n\
               s3,warm,1357038000000\n\
               s1,bad time,yesterday\n\
               s2,late,2013-01-01T12:00:00+01:00\n";
    let file = write(c.dir.path(), "readings.csv", csv);
    let file = file.to_str().expect("utf-8 path");
    let out = c.run(
        &[
            "produce",
            "readings",
            "--file",
            file,
            "--key-field",
            "id",
            "--timestamp-field",
            "ts",
            "--skip-bad-input",
        ],
        None,
    );
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{err}");
    assert!(err.contains("warning: line 6: skipped bad input row 1") && err.contains("\"ts\""), "{err}");
    assert!(
        stdout.contains("4 records read: 4 stored, 0 refused, 0 unknown (may or may not be stored), 1 bad input rows skipped"),
        "{stdout}"
    );

    let records = json_lines(&c.ok(&["consume", "readings", "--output", "json"], None));
    assert_eq!(records.len(), 4, "{records:?}");
    for r in &records {
        let key = r["key"].as_str().expect("key");
        assert_eq!(r["partition"].as_u64(), Some(u64::from(partition_for_key(key.as_bytes(), 2))), "{r}");
    }
    let mut by_time: Vec<(i64, &str)> = records
        .iter()
        .map(|r| (r["timestamp"].as_i64().expect("ts"), r["value"].as_str().expect("value")))
        .collect();
    by_time.sort();
    assert_eq!(
        by_time,
        vec![
            (1_357_034_400_000, "s1,cold,2013-01-01T10:00:00Z"),
            (1_357_036_200_000, "s2,\"two\nlines, quoted\",2013-01-01 10:30:00"),
            (1_357_038_000_000, "s2,late,2013-01-01T12:00:00+01:00"),
            (1_357_038_000_000, "s3,warm,1357038000000"),
        ]
    );

    // Seeks: by time (RFC 3339), by offset, a partition at a time.
    let late = json_lines(
        &c.ok(&["consume", "readings", "--from", "2013-01-01T10:45:00Z", "--output", "json"], None),
    );
    assert_eq!(late.len(), 2, "{late:?}");
    assert!(late.iter().all(|r| r["timestamp"].as_i64() == Some(1_357_038_000_000)), "{late:?}");
    let p_s2 = partition_for_key(b"s2", 2);
    let in_p_s2 = records.iter().filter(|r| r["partition"].as_u64() == Some(u64::from(p_s2))).count();
    let from1 = json_lines(
        &c.ok(&["consume", "readings", "-p", &p_s2.to_string(), "--from", "1", "--output", "json"], None),
    );
    assert_eq!(from1.len(), in_p_s2 - 1, "{from1:?}");
    assert!(from1.iter().all(|r| r["offset"].as_u64() >= Some(1)), "{from1:?}");
    let one = json_lines(&c.ok(&["consume", "readings", "--max-records", "1", "--output", "json"], None));
    assert_eq!(one.len(), 1, "{one:?}");
    assert_eq!(c.ok(&["consume", "readings", "--from", "latest"], None), "");

    // Lines from stdin, keyless; values printed back as they were.
    let out = c.ok(&["produce", "readings"], Some("alpha\nbeta\r\n\ngamma"));
    assert!(out.starts_with("4 records read: 4 stored, 0 refused, 0 unknown"), "{out}");
    assert!(out.contains("4 records sent to readings"), "{out}");
    let values = c.ok(&["consume", "readings"], None);
    for v in ["alpha", "beta", "gamma"] {
        assert!(values.lines().any(|l| l == v), "{v} missing from {values}");
    }
    let all = json_lines(&c.ok(&["consume", "readings", "--output", "json"], None));
    assert_eq!(all.len(), 8, "{all:?}");
    assert_eq!(all.iter().filter(|r| r["key"].is_null()).count(), 4, "{all:?}");

    // Status, then deletion.
    let status = c.ok(&["cluster", "status"], None);
    assert!(status.contains("controller: broker"), "{status}");
    // Every broker reports its open files against its limit.
    let files = status.lines().filter(|l| l.starts_with(char::is_numeric) && l.contains("%)")).count();
    assert_eq!(files, 3, "open files of every broker:\n{status}");
    assert_eq!(status.lines().filter(|l| l.starts_with("readings")).count(), 2, "{status}");
    c.ok(&["topic", "delete", "readings"], None);
    // The deletion reaches brokers' metadata images one by one: a consumer
    // may still be told of the topic by one broker and then hear from
    // another that its id is gone (seen in CI). Either answer is final.
    let err = c.fails(&["consume", "readings"], None);
    assert!(err.contains("does not exist") || err.contains("it no longer exists"), "{err}");
    let err = c.fails(&["produce", "nothing-here"], Some("x\n"));
    assert!(err.contains("does not exist"), "{err}");
    assert!(!c.ok(&["topic", "list"], None).contains("readings"));
    // A reader that stops reading (`| head`): the command ends quietly
    // with 141 (128 + SIGPIPE), as Unix tools do, not with a panic.
    c.ok(&["topic", "create", "piped", "--partitions", "3", "--replication-factor", "3"], None);
    let mut child = Command::new(BIN)
        .args(["--bootstrap", &c.bootstrap, "topic", "describe", "piped"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ferrolog");
    drop(child.stdout.take()); // the pipe's reader is gone before anything is written
    let out = child.wait_with_output().expect("wait for ferrolog");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(141), "{err}");
}

/// Values of partition 0 of `topic`, in order, exactly as stored.
/// Records written with kcat (librdkafka) through the Kafka listener are
/// read by `ferrolog consume`, and records written with `ferrolog produce`
/// are read by kcat: keys, values, headers, null and empty kept apart
/// (issue 14).
#[test]
fn kcat_and_the_command_line_read_what_the_other_wrote() {
    let c = Brokers::start();
    let kcat = ferrolog_tests::kafka_tools::kcat().expect("kcat, installed when missing");
    let kafka = c.kafka.join(",");
    c.ok(&["topic", "create", "mixed", "--partitions", "1", "--replication-factor", "3"], None);
    let kcat_run = |args: &[&str], input: Option<&str>| -> String {
        let mut child = Command::new(&kcat)
            .args(["-b", &kafka])
            .args(args)
            .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kcat");
        if let Some(text) = input {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write stdin");
        }
        let out = child.wait_with_output().expect("wait for kcat");
        assert!(out.status.success(), "kcat {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8")
    };
    // kcat → the CLI: a key and value, a null value (-Z), an empty key.
    kcat_run(&["-P", "-t", "mixed", "-p", "0", "-K:", "-Z", "-H", "src=kcat"], Some("a:1\nb:\n:3\n"));
    let read = json_lines(&c.ok(&["consume", "mixed", "--output", "json"], None));
    assert_eq!(read.len(), 3, "{read:?}");
    let got: Vec<(serde_json::Value, serde_json::Value)> =
        read.iter().map(|r| (r["key"].clone(), r["value"].clone())).collect();
    assert_eq!(
        got,
        vec![
            ("a".into(), "1".into()),
            ("b".into(), serde_json::Value::Null),
            (serde_json::Value::Null, "3".into()),
        ],
        "{read:?}"
    );
    assert!(
        read.iter().all(|r| r["headers"] == serde_json::json!([{"key": "src", "value": "kcat"}])),
        "{read:?}"
    );
    // The CLI → kcat.
    c.ok(&["produce", "mixed"], Some("from-cli\n"));
    let out = kcat_run(
        &["-C", "-t", "mixed", "-p", "0", "-o", "beginning", "-e", "-q", "-Z", "-f", "%o %k=%s\n"],
        None,
    );
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        vec!["0 a=1", "1 b=NULL", "2 NULL=3", "3 NULL=from-cli"],
        "{out}"
    );
}

fn values(c: &Brokers, topic: &str) -> Vec<String> {
    json_lines(&c.ok(&["consume", topic, "-p", "0", "--output", "json"], None))
        .iter()
        .map(|r| r["value"].as_str().expect("a UTF-8 value").to_owned())
        .collect()
}

#[test]
fn bad_input_stops_produce_or_is_skipped_and_counted() {
    let c = Brokers::start();
    c.ok(&["topic", "create", "rows", "--partitions", "1", "--replication-factor", "3"], None);

    // The second data row opens a quote that is never closed: the command
    // stops there, naming the line, and nothing after it is merged or sent.
    let csv = write(c.dir.path(), "rows.csv", "id,v\n1,a\n2,\"open\n3,c\n");
    let csv = csv.to_str().expect("utf-8 path");
    let out = c.run(&["produce", "rows", "--file", csv], None);
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{stdout}\n{err}");
    assert!(
        err.contains("line 3:") && err.contains("never closed") && err.contains("--skip-bad-input"),
        "{err}"
    );
    assert!(stdout.contains("1 records read: 1 stored, 0 refused, 0 unknown"), "{stdout}");
    assert_eq!(values(&c, "rows"), vec!["1,a"]);

    // Asked to, it skips the row with a counted warning and reads on.
    let out = c.run(&["produce", "rows", "--file", csv, "--skip-bad-input"], None);
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{err}");
    assert!(
        err.contains("warning: line 3: skipped bad input row 1") && err.contains("never closed"),
        "{err}"
    );
    assert!(stdout.contains("2 records read: 2 stored, 0 refused, 0 unknown (may or may not be stored), 1 bad input rows skipped"), "{stdout}");
    assert_eq!(values(&c, "rows"), vec!["1,a", "1,a", "3,c"]);

    // A row with more fields than the header is bad input too.
    let wide = write(c.dir.path(), "wide.csv", "id,v\n4,d,extra\n");
    let err = c.fails(&["produce", "rows", "--file", wide.to_str().expect("utf-8 path")], None);
    assert!(err.contains("line 2:") && err.contains("3 fields, the header 2"), "{err}");
    assert_eq!(values(&c, "rows").len(), 3);

    // Lines: `\n` or `\r\n` end a line and nothing else; an empty line is
    // an empty record; a last line without `\n` is a record.
    let out = c.ok(&["produce", "rows"], Some("a\r\r\nb\rc\n\nlast"));
    assert!(out.starts_with("4 records read: 4 stored, 0 refused, 0 unknown"), "{out}");
    assert_eq!(values(&c, "rows")[3..], ["a\r", "b\rc", "", "last"]);

    // A line over max_record_bytes (1 MiB by default) is refused by name;
    // the lines around it are stored; the command fails and says so.
    let big = format!("before\n{}\nafter\n", "x".repeat(2 << 20));
    let out = c.run(&["produce", "rows"], Some(&big));
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{stdout}\n{err}");
    assert!(
        err.contains("line 2: not stored") && err.contains("max_record_bytes") && err.contains("2097152"),
        "{err}"
    );
    assert!(stdout.contains("3 records read: 2 stored, 1 refused, 0 unknown"), "{stdout}");
    assert_eq!(values(&c, "rows")[7..], ["before", "after"]);
}

/// Records sent to brokers that stopped answering (every broker SIGSTOPped
/// after the first five were stored) are counted "unknown", never "not
/// stored": their requests reached the brokers' sockets, and once the
/// brokers run again some may be stored. The log holds the stored records
/// and then at most the unknown ones, in order, each once.
#[test]
fn produce_counts_records_sent_to_brokers_that_stopped_answering_as_unknown() {
    use std::io::Write;
    let c = Brokers::start();
    c.ok(&["topic", "create", "fate", "--partitions", "1", "--replication-factor", "3"], None);
    let mut producer = Command::new(BIN)
        .args(["--bootstrap", &c.bootstrap, "produce", "fate", "--delivery-timeout-ms", "3000"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ferrolog produce");
    let mut stdin = producer.stdin.take().expect("stdin");
    let stored: Vec<String> = (0..5).map(|i| format!("stored-{i}")).collect();
    stdin.write_all(format!("{}\n", stored.join("\n")).as_bytes()).expect("write stdin");
    stdin.flush().expect("flush stdin");
    let deadline = Instant::now() + Duration::from_secs(30);
    while values(&c, "fate").len() < stored.len() {
        assert!(Instant::now() < deadline, "the first records were not stored: {:?}", values(&c, "fate"));
        std::thread::sleep(Duration::from_millis(200));
    }
    // Committed; give their acknowledgements time to reach the producer.
    std::thread::sleep(Duration::from_secs(1));

    for broker in &c.children {
        signal(broker, "-STOP");
    }
    let maybe: Vec<String> = (0..5).map(|i| format!("maybe-{i}")).collect();
    stdin.write_all(format!("{}\n", maybe.join("\n")).as_bytes()).expect("write stdin");
    drop(stdin);
    // It gives up on the records after the 3 s delivery timeout, requests
    // in flight included: not after the 30 s request timeout. A hang fails
    // the test instead of holding it (the brokers resume anyway).
    let deadline = Instant::now() + Duration::from_secs(20);
    while producer.try_wait().expect("poll ferrolog produce").is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let finished = producer.try_wait().expect("poll ferrolog produce").is_some();
    if !finished {
        let _ = producer.kill();
    }
    let out = producer.wait_with_output().expect("wait for ferrolog produce");
    for broker in &c.children {
        signal(broker, "-CONT");
    }
    assert!(finished, "ferrolog produce did not end within 20 s of its input's end, brokers stopped");
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "records of unknown outcome must fail the command\n{stdout}\n{err}");
    assert!(
        stdout.contains("10 records read: 5 stored, 0 refused, 5 unknown (may or may not be stored)"),
        "{stdout}\n{err}"
    );
    assert!(err.contains("maybe not stored") && !err.contains(": not stored"), "{err}");
    assert!(err.contains("0 records were refused and 5 have an unknown outcome"), "{err}");

    // Once the brokers run again and the log stops growing (requests the
    // stopped leader had queued are handled now): the stored records, then
    // a prefix of the unknown ones, each once.
    let mut got = values(&c, "fate");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        std::thread::sleep(Duration::from_secs(2));
        let again = values(&c, "fate");
        if again == got || Instant::now() > deadline {
            got = again;
            break;
        }
        got = again;
    }
    assert_eq!(got[..stored.len()], stored[..], "{got:?}");
    let rest = &got[stored.len()..];
    assert!(rest.len() <= maybe.len() && rest == &maybe[..rest.len()], "{got:?}");
}

/// Sends `sig` (`-STOP`, `-CONT`) to a child process (a `consume
/// --follow`, a broker) with `kill`.
fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill").args([sig, &child.id().to_string()]).status().expect("run kill");
    assert!(status.success(), "kill {sig}");
}

/// `ferrolog consume ... --follow` running, its stdout lines arriving on a
/// channel, its stderr collected.
fn follow(c: &Brokers, args: &[&str]) -> (Child, std::sync::mpsc::Receiver<String>) {
    let mut child = Command::new(BIN)
        .arg("--bootstrap")
        .arg(&c.bootstrap)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ferrolog consume");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (child, rx)
}

/// The next `n` lines, each within 30 s.
fn lines(rx: &std::sync::mpsc::Receiver<String>, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|e| panic!("line {i} of {n}: {e}")))
        .collect()
}

/// Deletes and re-creates `topic` with 1 partition, then produces `new-0`..`new-29`.
fn recreate_with_30(c: &Brokers, topic: &str) {
    c.ok(&["topic", "delete", topic], None);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = c.run(&["topic", "create", topic, "--partitions", "1", "--replication-factor", "3"], None);
        if out.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "create again: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(200));
    }
    let new: String = (0..30).map(|i| format!("new-{i}\n")).collect();
    c.ok(&["produce", topic], Some(&new));
}

/// Issue 9, item 3: a paused `consume --follow` whose topic is deleted and
/// re-created under it stops with an error naming the topic (it used to
/// print the new topic from offset 20 on, skipping its first 20 records);
/// with `--on-topic-recreated restart` it warns and prints every new record.
#[test]
fn consume_follow_never_carries_an_offset_into_a_recreated_topic() {
    let c = Brokers::start();
    c.ok(&["topic", "create", "t", "--partitions", "1", "--replication-factor", "3"], None);
    let id_line = |out: &str| out.lines().find(|l| l.starts_with("t ")).unwrap_or_default().to_owned();
    let listed = id_line(&c.ok(&["topic", "list"], None));
    let described = c.ok(&["topic", "describe", "t"], None);
    let id = described.split(", id ").nth(1).and_then(|s| s.lines().next()).expect("an id").to_owned();
    assert_eq!(id.len(), 36, "a UUID: {described}");
    assert!(listed.contains(&id), "topic list shows the id: {listed}");
    let old: String = (0..20).map(|i| format!("old-{i}\n")).collect();
    c.ok(&["produce", "t"], Some(&old));

    let (mut fail, fail_out) = follow(&c, &["consume", "t", "--from", "earliest", "--follow"]);
    let (mut restart, restart_out) =
        follow(&c, &["consume", "t", "--from", "earliest", "--follow", "--on-topic-recreated", "restart"]);
    assert_eq!(lines(&fail_out, 20).last().map(String::as_str), Some("old-19"));
    assert_eq!(lines(&restart_out, 20).last().map(String::as_str), Some("old-19"));
    signal(&fail, "-STOP");
    signal(&restart, "-STOP");
    recreate_with_30(&c, "t");
    let new_id = c.ok(&["topic", "describe", "t"], None);
    assert!(!new_id.contains(&id), "a new id: {new_id}");
    signal(&fail, "-CONT");
    signal(&restart, "-CONT");

    // fail (the default): exits non-zero naming the topic, printing nothing more.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = fail.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = fail.kill();
            let printed: Vec<String> = fail_out.try_iter().collect();
            panic!("consume --follow did not stop; it printed {printed:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut fail.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
    let printed: Vec<String> = fail_out.try_iter().collect();
    assert!(printed.is_empty(), "nothing of the new topic: {printed:?}");
    assert!(!status.success(), "exit status {status}");
    assert!(stderr.contains("topic \"t\" was deleted or re-created"), "{stderr}");

    // restart: every new record, from the first.
    let new = lines(&restart_out, 30);
    assert_eq!(new, (0..30).map(|i| format!("new-{i}")).collect::<Vec<_>>());
    let _ = restart.kill();
    let _ = restart.wait();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut restart.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
    assert!(stderr.contains("warning: topic t was deleted or re-created"), "{stderr}");
}

/// Partition 0's leader and replicas as `topic describe` prints them
/// (leader 0: none).
fn leader_and_replicas(c: &Brokers, topic: &str) -> (u32, Vec<u32>) {
    let out = c.ok(&["topic", "describe", topic], None);
    let row: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with("0 "))
        .expect("a row for partition 0")
        .split_whitespace()
        .collect();
    let leader = row[1].parse().unwrap_or(0);
    let replicas = row[row.len() - 2].split(',').map(|r| r.parse().expect("a broker id")).collect();
    (leader, replicas)
}

#[test]
fn partition_leadership_moves_on_request() {
    let c = Brokers::start();
    c.ok(&["topic", "create", "moves", "--partitions", "1", "--replication-factor", "3"], None);
    c.ok(&["produce", "moves"], Some("a\nb\n"));
    let (leader, replicas) = leader_and_replicas(&c, "moves");
    assert!(leader != 0 && replicas.len() == 3, "leader {leader}, replicas {replicas:?}");

    // To a named broker.
    let to = replicas.iter().copied().find(|b| *b != leader).expect("another replica");
    // Right after the start, the leader's broker may not have heard `to`'s
    // pings yet: PREFERRED_LEADER_NOT_AVAILABLE ("not alive") for a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    let out = loop {
        let out = c.run(&["partition", "transfer-leader", "moves", "0", "--to", &to.to_string()], None);
        let err = String::from_utf8_lossy(&out.stderr);
        if out.status.success()
            || !err.contains("PREFERRED_LEADER_NOT_AVAILABLE")
            || Instant::now() > deadline
        {
            break String::from_utf8_lossy(&out.stdout).into_owned() + &err;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(out.contains(&format!("moves-0: broker {to} leads now")), "{out}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while leader_and_replicas(&c, "moves").0 != to {
        assert!(Instant::now() < deadline, "the metadata never named broker {to} as the leader");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Asked again: nothing to do.
    let out = c.ok(&["partition", "transfer-leader", "moves", "0", "--to", &to.to_string()], None);
    assert!(out.contains("nothing to do") && out.contains("ELECTION_NOT_NEEDED"), "{out}");
    // A broker without a replica of it.
    let err = c.fails(&["partition", "transfer-leader", "moves", "0", "--to", "9"], None);
    assert!(err.contains("broker 9 holds no voting replica of moves-0"), "{err}");

    // Back to the preferred replica (the first assigned), by default.
    let preferred = replicas[0];
    let out = c.ok(&["partition", "transfer-leader", "moves", "0"], None);
    let expected =
        if preferred == to { "nothing to do".to_owned() } else { format!("broker {preferred} leads now") };
    assert!(out.contains(&expected), "{out}");

    // Nothing was lost on the way, and writes go on.
    c.ok(&["produce", "moves"], Some("c\n"));
    assert_eq!(values(&c, "moves"), vec!["a", "b", "c"]);

    // Not to a broker that is down: refused, and the leader keeps leading
    // and taking writes.
    let (leader, _) = leader_and_replicas(&c, "moves");
    let down = replicas.iter().copied().find(|b| *b != leader).expect("another replica");
    let mut c = c;
    let _ = c.children[(down - 1) as usize].kill();
    let _ = c.children[(down - 1) as usize].wait();
    // Once the leader's pings have found it gone (a refused connection
    // counts at once; pings go every 100 ms). Asked before that, the
    // hand-over begins and the leadership goes to the third replica
    // instead (`HandOver::transfer_to`). `broker list` shows when the
    // brokers' pings have; a second more for the leader's own.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while broker_rows(&c).iter().any(|r| r.0 == down && r.1 == "alive") {
        assert!(std::time::Instant::now() < deadline, "broker {down} still shown alive 20 s after its kill");
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(1));
    let err = c.fails(&["partition", "transfer-leader", "moves", "0", "--to", &down.to_string()], None);
    assert!(
        err.contains("PREFERRED_LEADER_NOT_AVAILABLE")
            && err.contains(&format!("broker {down} is not alive")),
        "{err}"
    );
    c.ok(&["produce", "moves"], Some("d\n"));
    assert_eq!(leader_and_replicas(&c, "moves").0, leader);
    assert_eq!(values(&c, "moves"), vec!["a", "b", "c", "d"]);
}

#[test]
fn partition_reassign_moves_a_replica_and_describe_shows_it() {
    let c = Brokers::start();
    c.ok(&["topic", "create", "shift", "--partitions", "1", "--replication-factor", "1"], None);
    c.ok(&["produce", "shift"], Some("a\nb\n"));
    let (_, replicas) = leader_and_replicas(&c, "shift");
    let from = replicas[0];
    let to = (1..=3).find(|b| *b != from).expect("another broker");

    // Refusals, with Kafka's codes and the reason.
    let err = c.fails(&["partition", "reassign", "shift", "0", "--replicas", "9"], None);
    assert!(
        err.contains("INVALID_REPLICA_ASSIGNMENT") && err.contains("broker 9 is not registered"),
        "{err}"
    );
    let err = c.fails(&["partition", "reassign", "shift", "0", "--replicas", &format!("{to},{to}")], None);
    assert!(err.contains("INVALID_REPLICA_ASSIGNMENT"), "{err}");
    let err = c.fails(&["partition", "reassign", "shift", "0", "--cancel"], None);
    assert!(err.contains("NO_REASSIGNMENT_IN_PROGRESS"), "{err}");

    // A move, waited for.
    let out =
        c.ok(&["partition", "reassign", "shift", "0", "--replicas", &to.to_string(), "--wait", "60"], None);
    assert!(out.contains(&format!("shift-0: moving to brokers {to}")) && out.contains("done"), "{out}");
    let out = c.ok(&["partition", "describe", "shift", "0"], None);
    assert!(out.contains(&format!("replicas: {to}\n")) && out.contains("reassignment: none"), "{out}");
    // `--wait` ends when the metadata shows the move done; the group's
    // voters follow the metadata a moment later, and with them the leader
    // (CI 48 saw the old replica still leading right after).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let out = c.ok(&["partition", "describe", "shift", "0"], None);
        if out.contains(&format!("leader: broker {to}")) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{out}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert_eq!(values(&c, "shift"), vec!["a", "b"], "the records moved with the replica");

    // A plan (Kafka's format) moving it back, with a bad entry beside it:
    // the good one is done, the bad one reported, the exit status non-zero.
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("plan.json");
    std::fs::write(
        &plan,
        format!(
            r#"{{"version":1,"partitions":[{{"topic":"shift","partition":0,"replicas":[{from}]}},
               {{"topic":"nope","partition":0,"replicas":[1]}}]}}"#
        ),
    )
    .expect("write the plan");
    let err = c.fails(&["partition", "reassign", "--plan", &plan.to_string_lossy(), "--wait", "60"], None);
    assert!(err.contains("1 of 2 reassignments refused"), "{err}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while leader_and_replicas(&c, "shift").1 != vec![from] {
        assert!(Instant::now() < deadline, "shift-0 never moved back to broker {from}");
        std::thread::sleep(Duration::from_millis(200));
    }
    c.ok(&["produce", "shift"], Some("c\n"));
    assert_eq!(values(&c, "shift"), vec!["a", "b", "c"]);
    let err = c.fails(&["partition", "reassign", "--plan", "/nonexistent/plan.json"], None);
    assert!(err.contains("reading /nonexistent/plan.json"), "{err}");
}

#[test]
fn topic_alter_adds_partitions_that_take_writes() {
    let c = Brokers::start();
    c.ok(&["topic", "create", "grow", "--partitions", "3", "--replication-factor", "3"], None);
    let err = c.fails(&["topic", "alter", "grow", "--partitions", "3"], None);
    assert!(err.contains("INVALID_PARTITIONS") && err.contains("can only grow"), "{err}");
    let err = c.fails(&["topic", "alter", "nope", "--partitions", "3"], None);
    assert!(err.contains("nope"), "{err}");
    let out = c.ok(&["topic", "alter", "grow", "--partitions", "6"], None);
    assert!(out.contains("now has 6 partitions") && out.contains("may map to another partition"), "{out}");
    // Every partition, old and new, has a leader.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = c.ok(&["topic", "describe", "grow"], None);
        // The partition table: the rows before the blank line that opens the config table.
        let rows: Vec<&str> = out.lines().skip(2).take_while(|l| !l.trim().is_empty()).collect();
        if out.contains("6 partitions") && rows.len() == 6 && rows.iter().all(|r| !r.contains("none")) {
            break;
        }
        assert!(Instant::now() < deadline, "not every partition got a leader:\n{out}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Keyed records spread over all six: the new partitions take writes.
    let mut csv = String::from("k,v\n");
    for i in 0..200 {
        csv.push_str(&format!("key-{i},{i}\n"));
    }
    let file = write(c.dir.path(), "keys.csv", &csv);
    c.ok(&["produce", "grow", "--csv", "--key-field", "k", "--file", file.to_str().expect("utf-8")], None);
    let mut total = 0;
    for p in 0..6 {
        let out = c.ok(&["consume", "grow", "-p", &p.to_string(), "--output", "json"], None);
        let n = json_lines(&out).len();
        assert!(n > 0, "partition {p} took no record of 200 keyed ones");
        total += n;
    }
    assert_eq!(total, 200);
}

/// `topic describe`'s config rows: key → (value, source).
fn config_rows(c: &Brokers, topic: &str) -> std::collections::BTreeMap<String, (String, String)> {
    let out = c.ok(&["topic", "describe", topic], None);
    let table = out.split("\nCONFIG").nth(1).unwrap_or_else(|| panic!("no config table:\n{out}"));
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(((*f.first()?).to_owned(), ((*f.get(1)?).to_owned(), f[2..].join(" "))))
        })
        .collect()
}

/// Asserts that every broker describes `topic` with `key` = `value` set on
/// the topic. A describe reads an image confirmed current with the
/// controller, so once each broker answered, each one's image holds the
/// value (a barrier before testing what the value does).
fn config_on_every_broker(c: &Brokers, topic: &str, key: &str, value: &str) {
    for addr in c.bootstrap.split(',') {
        let out =
            Command::new(BIN).args(["--bootstrap", addr, "topic", "describe", topic]).output().expect("run");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.lines().any(|l| l.split_whitespace().eq([key, value, "topic"])),
            "{addr}:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn topic_config_is_set_described_altered_and_enforced() {
    let c = Brokers::start();
    // Unknown keys and bad values are refused with the key named, and
    // nothing is created.
    let err = c.fails(&["topic", "create", "bad", "--config", "retention.hours=5"], None);
    assert!(err.contains("INVALID_CONFIG") && err.contains("retention.hours"), "{err}");
    let err = c.fails(&["topic", "create", "bad", "--config", "retention.ms=soon"], None);
    assert!(err.contains("INVALID_CONFIG") && err.contains("retention.ms"), "{err}");
    let err = c.fails(&["topic", "create", "bad", "--config", "retention.ms"], None);
    assert!(err.contains("KEY=VALUE"), "{err}");
    assert!(!c.ok(&["topic", "list"], None).contains("bad"), "a refused topic was created");

    c.ok(
        &[
            "topic",
            "create",
            "cfg",
            "--partitions",
            "1",
            "--config",
            "retention.ms=3600000",
            "--config",
            "max.message.bytes=1000",
            "--config",
            "cleanup.policy=delete, compact",
        ],
        None,
    );
    let rows = config_rows(&c, "cfg");
    assert_eq!(rows.len(), 12, "every key is listed: {rows:?}");
    assert_eq!(rows["compression.type"], ("producer".into(), "default".into()));
    assert_eq!(rows["retention.ms"], ("3600000".into(), "topic".into()));
    assert_eq!(rows["max.message.bytes"], ("1000".into(), "topic".into()));
    assert_eq!(rows["cleanup.policy"], ("compact,delete".into(), "topic".into()));
    assert_eq!(rows["retention.bytes"], ("-1".into(), "default".into()));
    assert_eq!(rows["segment.bytes"], ("1073741824".into(), "default".into()));

    // max.message.bytes is enforced on produce.
    let big = "x".repeat(2000);
    // (The topic compacts: its records need keys.)
    let keyed = ["produce", "cfg", "--key-separator", ":"];
    let err = c.fails(&keyed, Some(&format!("k2:{big}\n")));
    assert!(err.contains("RECORD_TOO_LARGE") || err.contains("too large"), "{err}");
    c.ok(&keyed, Some(&format!("k1:{}\n", "s".repeat(500))));

    // Alter: set, delete back to the default, and refuse a bad value.
    let out = c.ok(
        &["topic", "alter", "cfg", "--config", "max.message.bytes=4000", "--delete-config", "retention.ms"],
        None,
    );
    assert!(
        out.contains("max.message.bytes=4000") && out.contains("retention.ms back to the broker default"),
        "{out}"
    );
    let err = c.fails(&["topic", "alter", "cfg", "--config", "segment.bytes=12"], None);
    assert!(err.contains("INVALID_CONFIG") && err.contains("segment.bytes"), "{err}");
    let err = c.fails(&["topic", "alter", "nope", "--config", "retention.ms=1"], None);
    assert!(err.contains("nope"), "{err}");
    let rows = config_rows(&c, "cfg");
    assert_eq!(rows["max.message.bytes"], ("4000".into(), "topic".into()));
    assert_eq!(rows["retention.ms"], ("604800000".into(), "default".into()));
    assert_eq!(rows["cleanup.policy"], ("compact,delete".into(), "topic".into()), "kept through the alter");

    // Every broker answers with the altered configuration (it is in the
    // metadata log; describe reads an image confirmed with the controller).
    config_on_every_broker(&c, "cfg", "max.message.bytes", "4000");

    // The larger limit lets the record in now.
    c.ok(&keyed, Some(&format!("k2:{big}\n")));
    let got = values(&c, "cfg");
    assert_eq!(got.iter().map(String::len).collect::<Vec<_>>(), vec![500, 2000]);

    // message.timestamp.type: the producer's 2013 timestamps are kept with
    // CreateTime, replaced by the leader's clock with LogAppendTime.
    let csv = write(c.dir.path(), "stamped.csv", "id,ts\na,2013-01-01T10:00:00Z\n");
    let csv = csv.to_str().expect("utf-8 path");
    let produce = ["produce", "stamped", "--file", csv, "--timestamp-field", "ts"];
    c.ok(&["topic", "create", "stamped", "--partitions", "1"], None);
    c.ok(&produce, None);
    c.ok(&["topic", "alter", "stamped", "--config", "message.timestamp.type=LogAppendTime"], None);
    config_on_every_broker(&c, "stamped", "message.timestamp.type", "LogAppendTime");
    let before =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis();
    c.ok(&produce, None);
    let stamps: Vec<i64> = json_lines(&c.ok(&["consume", "stamped", "--output", "json"], None))
        .iter()
        .map(|r| r["timestamp"].as_i64().expect("timestamp"))
        .collect();
    assert_eq!(stamps.len(), 2, "{stamps:?}");
    assert_eq!(stamps[0], 1_357_034_400_000, "CreateTime keeps the producer's timestamp");
    // The leader's clock at append, give or take clock steps on this machine.
    assert!(
        i128::from(stamps[1]) >= before as i128 - 5_000,
        "LogAppendTime: {stamps:?}, produced after {before}"
    );
}

#[test]
fn retention_moves_the_log_start_and_consume_says_what_it_does() {
    let c = Brokers::start_with_config(Some("[retention]\ncheck_interval_ms = 200\n"));
    c.ok(
        &[
            "topic",
            "create",
            "ret",
            "--partitions",
            "1",
            "--config",
            "segment.bytes=4096",
            "--config",
            "retention.bytes=8192",
        ],
        None,
    );
    // 20 batches of about 5 KB, each over segment.bytes: one segment each.
    for round in 0..20 {
        let rows: String = (0..50).map(|i| format!("{:04}-{}\n", round * 50 + i, "r".repeat(90))).collect();
        c.ok(&["produce", "ret"], Some(&rows));
    }
    // Reading from offset 0 fails once retention moved the log start, and says how to go on.
    let deadline = Instant::now() + Duration::from_secs(30);
    let err = loop {
        let out = c.run(&["consume", "ret", "-p", "0", "--from", "0", "--max-records", "1"], None);
        if !out.status.success() {
            break String::from_utf8_lossy(&out.stderr).into_owned();
        }
        assert!(Instant::now() < deadline, "the log start never moved from 0");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(err.contains("out of range") && err.contains("--offset-reset earliest"), "{err}");

    // --offset-reset earliest warns and reads on from the log start, where
    // --from earliest starts too; offsets are those the records were written at.
    let out = c.run(
        &["consume", "ret", "-p", "0", "--from", "0", "--offset-reset", "earliest", "--output", "json"],
        None,
    );
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("reading on from") && stderr.contains("--offset-reset earliest"), "{stderr}");
    let reset = json_lines(&stdout);
    let start = reset.first().and_then(|r| r["offset"].as_u64()).expect("records after the log start");
    assert!(start > 0 && reset.len() as u64 == 1000 - start, "from {start}: {} records", reset.len());
    for r in &reset {
        let o = r["offset"].as_u64().expect("offset");
        assert!(r["value"].as_str().expect("value").starts_with(&format!("{o:04}-")), "{r}");
    }
    let earliest =
        json_lines(&c.ok(&["consume", "ret", "-p", "0", "--from", "earliest", "--output", "json"], None));
    assert!(
        earliest.first().and_then(|r| r["offset"].as_u64()).is_some_and(|o| o >= start),
        "{:?}",
        earliest.first()
    );
    // --offset-reset latest skips to the end: nothing left to read without --follow.
    let out = c.run(&["consume", "ret", "-p", "0", "--from", "0", "--offset-reset", "latest"], None);
    assert!(out.status.success() && out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Segment files of `topic`'s partition 0 on each broker, by broker.
fn segment_counts(c: &Brokers, topic: &str) -> Vec<usize> {
    (1..=3)
        .map(|b| {
            let root = c.dir.path().join(format!("broker-{b}")).join("partitions");
            let dir = std::fs::read_dir(&root)
                .expect("partitions dir")
                .filter_map(Result::ok)
                .find(|e| e.file_name().to_string_lossy().starts_with(&format!("{topic}-0.g")))
                .unwrap_or_else(|| panic!("no replica of {topic}-0 on broker {b}"))
                .path();
            std::fs::read_dir(dir.join("replica").join("log"))
                .expect("log dir")
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".seg"))
                .count()
        })
        .collect()
}

/// Waits until every replica of `topic`'s partition 0 has every entry
/// (`partition describe` shows lag 0 for all three).
fn wait_caught_up(c: &Brokers, topic: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = c.ok(&["partition", "describe", topic, "0"], None);
        let lags: Vec<String> = out
            .lines()
            .skip_while(|l| !l.starts_with("BROKER"))
            .skip(1)
            .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
            .collect();
        if lags.len() == 3 && lags.iter().all(|l| l == "0") {
            return;
        }
        assert!(Instant::now() < deadline, "{topic}-0 replicas never caught up:\n{out}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn topic_segment_bytes_rolls_every_replica_and_an_alter_changes_it() {
    let c = Brokers::start();
    c.ok(&["topic", "create", "seg", "--partitions", "1", "--config", "segment.bytes=4096"], None);
    // Each produce is one batch of about 20 KB: one Raft entry, over the
    // 4 KiB limit, so the active segment rolls before the next. A segment
    // rolls before an append, so a follower that receives several entries
    // in one append keeps them in one segment: each is let reach every
    // replica before the next.
    let big: String = (0..100).map(|i| format!("{i:03}-{}\n", "v".repeat(200))).collect();
    let mut produced = 0;
    for _ in 0..6 {
        c.ok(&["produce", "seg"], Some(&big));
        produced += 100;
        wait_caught_up(&c, "seg");
    }
    let mut last = segment_counts(&c, "seg");
    assert!(last.iter().all(|n| *n >= 6), "segment.bytes=4096 did not roll every replica: {last:?}");

    // Back to the broker default (1 GiB): once their brokers applied the
    // alter, no replica rolls any more. Rounds of about 2 KB: three in a
    // row without a new segment anywhere (6 KB) would have rolled each
    // replica at 4 KiB.
    c.ok(&["topic", "alter", "seg", "--delete-config", "segment.bytes"], None);
    let small: String = (0..10).map(|i| format!("{i:03}-{}\n", "w".repeat(200))).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut quiet_rounds = 0;
    while quiet_rounds < 3 {
        c.ok(&["produce", "seg"], Some(&small));
        produced += 10;
        wait_caught_up(&c, "seg");
        let now = segment_counts(&c, "seg");
        quiet_rounds = if now == last { quiet_rounds + 1 } else { 0 };
        assert!(
            Instant::now() < deadline,
            "replicas still roll at 4 KiB after the alter (segments per replica: {now:?})"
        );
        last = now;
    }
    let read = json_lines(&c.ok(&["consume", "seg", "-p", "0", "--output", "json"], None)).len();
    assert_eq!(read, produced, "every record reads back across the segments");
}

/// A `broker list` row: (id, state, quorum, replicas, preferred leaders).
type BrokerRow = (u32, String, String, usize, usize);

/// `broker list` rows.
fn broker_rows(c: &Brokers) -> Vec<BrokerRow> {
    let out = c.ok(&["broker", "list"], None);
    out.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let id = f.first()?.parse().ok()?;
            Some((id, f[2].to_owned(), f[3].to_owned(), f[4].parse().ok()?, f[5].parse().ok()?))
        })
        .collect()
}

#[test]
fn cluster_rebalance_evens_out_and_decommission_retires_a_broker() {
    let c = Brokers::start();
    c.ok(&["topic", "create", "even", "--partitions", "6", "--replication-factor", "1"], None);
    c.ok(&["produce", "even"], Some("a\nb\nc\n"));
    // Pile every partition onto broker 1.
    for p in 0..6 {
        c.ok(&["partition", "reassign", "even", &p.to_string(), "--replicas", "1", "--wait", "60"], None);
    }
    // Brokers apply the controller's records each at its own pace: poll.
    let until = |what: &str, ok: &dyn Fn(&[BrokerRow]) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let rows = broker_rows(&c);
            if ok(&rows) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {rows:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    until("all on broker 1", &|rows| rows.iter().any(|r| r.0 == 1 && r.3 == 6));

    // A dry run prints the plan and changes nothing.
    let plan = c.ok(&["cluster", "rebalance"], None);
    let plan: serde_json::Value = serde_json::from_str(plan.trim()).expect("a JSON plan on stdout");
    assert_eq!(plan["version"], 1);
    assert_eq!(plan["partitions"].as_array().map(Vec::len), Some(4), "4 of 6 move off broker 1: {plan}");
    assert_eq!(
        broker_rows(&c).iter().find(|r| r.0 == 1).map(|r| r.3),
        Some(6),
        "the dry run moved something"
    );
    // Executed: two replicas and two preferred leaderships each.
    c.ok(&["cluster", "rebalance", "--execute", "--wait", "60"], None);
    until("two replicas and leaders each", &|rows| {
        rows.len() == 3 && rows.iter().all(|r| r.3 == 2 && r.4 == 2)
    });
    let out = c.ok(&["cluster", "rebalance"], None);
    assert!(out.trim().is_empty(), "balanced, yet a plan: {out}");

    // Retire broker 3: its replicas move, it leaves the controller quorum.
    let out = c.ok(&["broker", "decommission", "3", "--wait", "60"], None);
    assert!(
        out.contains("broker 3 holds no replica, is decommissioned and out of the controller quorum"),
        "{out}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rows = broker_rows(&c);
        let three = rows.iter().find(|r| r.0 == 3).cloned().expect("broker 3 listed");
        if three.1 == "decommissioned" && three.2 == "-" && three.3 == 0 {
            assert!(rows.iter().filter(|r| r.0 != 3).all(|r| r.2 == "voter"), "{rows:?}");
            break;
        }
        assert!(Instant::now() < deadline, "broker 3 not retired: {rows:?}\n{}", c.logs());
        std::thread::sleep(Duration::from_millis(200));
    }
    let err = c.fails(&["partition", "reassign", "even", "0", "--replicas", "3"], None);
    assert!(err.contains("decommissioned"), "{err}");
    // Its process stopped, the cluster keeps working: new topics, old data.
    let mut c = c;
    let _ = c.children[2].kill();
    let _ = c.children[2].wait();
    c.ok(&["topic", "create", "after", "--partitions", "2", "--replication-factor", "2"], None);
    c.ok(&["produce", "after"], Some("x\n"));
    let mut all = Vec::new();
    for p in 0..6 {
        let out = c.ok(&["consume", "even", "-p", &p.to_string(), "--output", "json"], None);
        all.extend(json_lines(&out).iter().map(|r| r["value"].as_str().unwrap_or_default().to_owned()));
    }
    all.sort();
    assert_eq!(all, vec!["a", "b", "c"], "records lost or duplicated by the moves");
}

/// Leader of every partition of `topic` (`topic describe`; 0: none).
fn leaders(c: &Brokers, topic: &str) -> Vec<u32> {
    let out = c.ok(&["topic", "describe", topic], None);
    out.lines()
        .filter(|l| l.starts_with(char::is_numeric))
        .filter_map(|l| l.split_whitespace().nth(1).map(|x| x.parse().unwrap_or(0)))
        .collect()
}

/// Every value of `topic`'s `partitions` partitions, sorted.
fn all_values(c: &Brokers, topic: &str, partitions: u32) -> Vec<String> {
    let mut all = Vec::new();
    for p in 0..partitions {
        let out = c.ok(&["consume", topic, "-p", &p.to_string(), "--output", "json"], None);
        all.extend(json_lines(&out).iter().map(|r| r["value"].as_str().unwrap_or_default().to_owned()));
    }
    all.sort();
    all
}

#[test]
fn a_joined_broker_gets_an_id_and_rebalance_gives_it_its_share() {
    let mut c = Brokers::start();
    c.ok(&["topic", "create", "grow", "--partitions", "6", "--replication-factor", "2"], None);
    c.ok(&["produce", "grow"], Some("a\nb\nc\nd\ne\nf\n"));
    // Broker 4 joins through the founders' peer addresses, without an id.
    let four = c.join();
    assert_eq!(four, 4, "the cluster assigns the next free id");
    let rows = broker_rows(&c);
    assert_eq!(rows.iter().find(|r| r.0 == 4).map(|r| (r.2.as_str(), r.3)), Some(("-", 0)), "{rows:?}");
    // It follows the metadata: it answers for the topic itself.
    let four_addr = c.bootstrap.rsplit(',').next().expect("4's address").to_owned();
    let own = Command::new(BIN).args(["--bootstrap", &four_addr, "topic", "list"]).output().expect("run");
    assert!(
        String::from_utf8_lossy(&own.stdout).contains("grow"),
        "broker 4 does not know the topic: {own:?}"
    );

    c.ok(&["cluster", "rebalance", "--execute", "--wait", "120"], None);
    // 12 replicas and 6 preferred leaderships over 4 brokers: 3 each, and 1 or 2.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rows = broker_rows(&c);
        let ls = leaders(&c, "grow");
        let led = |b: u32| ls.iter().filter(|l| **l == b).count();
        let even = rows.len() == 4
            && rows.iter().all(|r| r.3 == 3 && (1..=2).contains(&r.4))
            && ls.len() == 6
            && (1..=4).all(|b| (1..=2).contains(&led(b)));
        if even {
            break;
        }
        assert!(Instant::now() < deadline, "not even: {rows:?}, leaders {ls:?}\n{}", c.logs());
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(all_values(&c, "grow", 6), ["a", "b", "c", "d", "e", "f"], "records lost or duplicated");
    // Restarted with the same command line, the joined broker keeps its id
    // (from its data directory): no fifth broker appears.
    c.kill(4);
    c.respawn(4);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let rows = broker_rows(&c);
        if rows.len() == 4 && rows.iter().all(|r| r.1 == "alive") {
            break;
        }
        assert!(Instant::now() < deadline, "broker 4 did not come back: {rows:?}\n{}", c.logs());
        std::thread::sleep(Duration::from_millis(300));
    }
    let log = std::fs::read_to_string(c.dir.path().join("broker-4.log")).expect("log");
    assert_eq!(log.matches("joined the cluster").count(), 1, "joined again on restart:\n{log}");
    assert_eq!(all_values(&c, "grow", 6), ["a", "b", "c", "d", "e", "f"]);
}

/// Runs `ferrolog produce probe` with one record every 300 ms until
/// `stop`: each run gets a producer id from the controller (a write to
/// the metadata log, which needs the controller quorum) and appends to
/// topic "probe". Returns (attempts, failures with their errors, values
/// acknowledged).
fn probe_controller(
    bootstrap: std::sync::Arc<std::sync::Mutex<String>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<(usize, Vec<String>, Vec<String>)> {
    std::thread::spawn(move || {
        let (mut attempts, mut failures, mut acked) = (0, Vec::new(), Vec::new());
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let b = bootstrap.lock().expect("lock").clone();
            let value = format!("p{attempts:04}");
            let mut child = Command::new(BIN)
                .args(["--bootstrap", &b, "produce", "probe"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run");
            {
                use std::io::Write;
                child.stdin.take().expect("stdin").write_all(format!("{value}\n").as_bytes()).expect("write");
            }
            let out = child.wait_with_output().expect("wait");
            if out.status.success() {
                acked.push(value);
            } else {
                failures.push(String::from_utf8_lossy(&out.stderr).into_owned());
            }
            attempts += 1;
            std::thread::sleep(Duration::from_millis(300));
        }
        (attempts, failures, acked)
    })
}

#[test]
fn founders_are_replaced_one_by_one_without_losing_the_controller_quorum() {
    let mut c = Brokers::start();
    c.ok(&["topic", "create", "keep", "--partitions", "3", "--replication-factor", "3"], None);
    c.ok(&["produce", "keep"], Some("1\n2\n3\n4\n5\n6\n"));
    c.ok(&["topic", "create", "probe", "--partitions", "1", "--replication-factor", "3"], None);
    let joined: Vec<u32> = (0..3).map(|_| c.join()).collect();
    assert_eq!(joined, [4, 5, 6]);
    let bootstrap = std::sync::Arc::new(std::sync::Mutex::new(c.bootstrap.clone()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = probe_controller(bootstrap.clone(), stop.clone());
    // The voters as every running broker shows them, once they all agree
    // (each follows the metadata group at its own pace; one that lags
    // must not pass a check for the others).
    let voters = |c: &Brokers| -> Vec<u32> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let views: Vec<Vec<u32>> = c
                .bootstrap
                .split(',')
                .map(|addr| {
                    let out = Command::new(BIN)
                        .args(["--bootstrap", addr, "broker", "list"])
                        .output()
                        .expect("run");
                    String::from_utf8_lossy(&out.stdout)
                        .lines()
                        .skip(1)
                        .filter(|l| l.split_whitespace().nth(3) == Some("voter"))
                        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
                        .collect()
                })
                .collect();
            if views.windows(2).all(|w| w[0] == w[1]) && !views[0].is_empty() {
                return views[0].clone();
            }
            assert!(Instant::now() < deadline, "the brokers disagree on the voters: {views:?}");
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    // Each founder in turn: a joined broker becomes a voter, then the
    // founder is drained and retired (leaving the quorum), then stopped.
    for (founder, new) in [(1, 4), (2, 5), (3, 6)] {
        let out = c.ok(&["controller", "add", &new.to_string()], None);
        assert!(out.contains("controller voters:"), "{out}");
        let out = c.ok(&["broker", "decommission", &founder.to_string(), "--wait", "120"], None);
        assert!(out.contains("out of the controller quorum"), "{out}");
        c.kill(founder);
        // The founders stopped so far are no longer asked.
        let live: Vec<String> = c.bootstrap.split(',').skip(1).map(str::to_owned).collect();
        c.bootstrap = live.join(",");
        *bootstrap.lock().expect("lock") = c.bootstrap.clone();
        let v = voters(&c);
        assert_eq!(v.len(), 3, "after replacing founder {founder}: voters {v:?}");
        assert!(v.contains(&new) && !v.contains(&founder), "{v:?}");
        let topic = format!("after-{founder}");
        c.ok(&["topic", "create", &topic, "--partitions", "2", "--replication-factor", "3"], None);
        c.ok(&["produce", &topic], Some("x\n"));
        assert_eq!(all_values(&c, &topic, 2), ["x"]);
    }
    assert_eq!(voters(&c), [4, 5, 6], "every founder replaced");
    // A voter can also leave the quorum and come back while staying a broker.
    let out = c.ok(&["controller", "remove", "6"], None);
    assert!(out.contains("controller voters: 4,5"), "{out}");
    assert_eq!(voters(&c), [4, 5]);
    let out = c.ok(&["controller", "add", "6"], None);
    assert!(out.contains("controller voters: 4,5,6"), "{out}");
    assert_eq!(voters(&c), [4, 5, 6]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (attempts, failures, acked) = prober.join().expect("prober");
    assert!(attempts >= 10, "only {attempts} controller probes ran");
    assert!(failures.is_empty(), "controller writes failed during the changes: {failures:#?}\n{}", c.logs());
    assert_eq!(all_values(&c, "keep", 3), ["1", "2", "3", "4", "5", "6"], "records lost or duplicated");
    assert_eq!(all_values(&c, "probe", 1), acked, "probe records lost or duplicated");
    println!("founders 1-3 replaced by joined brokers 4-6; {attempts} producer ids and appends, none failed");
}

/// `(offset, key, value)` of every record of `topic`-0 from earliest; a
/// null value (tombstone) is `None`.
fn compacted_view(c: &Brokers, topic: &str) -> Vec<(u64, String, Option<String>)> {
    json_lines(&c.ok(&["consume", topic, "-p", "0", "--from", "earliest", "--output", "json"], None))
        .iter()
        .map(|r| {
            let offset = r["offset"].as_u64().expect("offset");
            let key = r["key"].as_str().expect("a key").to_owned();
            (offset, key, r["value"].as_str().map(str::to_owned))
        })
        .collect()
}

#[test]
fn compaction_edge_logs_empty_values_and_keys_tombstones_and_an_empty_topic() {
    let c = Brokers::start_with_config(Some("[compaction]\ncheck_interval_ms = 200\n"));
    // segment.ms = 1: every produce below is one batch in a segment of its
    // own (the active segment rolls at the next append), so all but the
    // last are compactable at once.
    let compacted = [
        "--config",
        "cleanup.policy=compact",
        "--config",
        "segment.ms=1",
        "--config",
        "delete.retention.ms=0",
        // Every new sealed segment moves the target, whenever the checks fall.
        "--config",
        "min.cleanable.dirty.ratio=0",
    ];
    for topic in ["edge", "tombs", "empty"] {
        let mut args = vec!["topic", "create", topic, "--partitions", "1"];
        args.extend(compacted);
        c.ok(&args, None);
    }
    let send = |topic: &str, line: &str| {
        c.ok(
            &["produce", topic, "--key-separator", "::", "--null-marker", "NULL"],
            Some(&format!("{line}\n")),
        )
    };
    // A keyless record is refused with the reason, naming the topic's policy.
    let out = c.run(&["produce", "edge"], Some("no key\n"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("INVALID_RECORD") && stderr.contains("no key"),
        "{stderr}"
    );

    for line in ["a::1", "b::", "::k-empty", "e::", "a::2", "b::NULL", "last::NULL"] {
        send("edge", line);
    }
    for line in ["x::NULL", "y::NULL", "x::NULL", "z::NULL"] {
        send("tombs", line);
    }
    let s = |v: &str| Some(v.to_owned());
    // Every tombstone goes in the end (delete.retention.ms = 0), the last
    // one too: the control entries that carry the targets are appended
    // after it, and roll its segment (segment.ms = 1). A log of only
    // tombstones compacts to no record at all.
    let want_edge = vec![(2, String::new(), s("k-empty")), (3, "e".into(), s("")), (4, "a".into(), s("2"))];
    let want_tombs: Vec<(u64, String, Option<String>)> = vec![];
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (edge, tombs) = (compacted_view(&c, "edge"), compacted_view(&c, "tombs"));
        if edge == want_edge && tombs == want_tombs {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not compacted as expected:\nedge {edge:?}\nwant {want_edge:?}\ntombs {tombs:?}\nwant {want_tombs:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The empty topic: nothing to read, no error, and it takes records after compaction checks.
    assert!(compacted_view(&c, "empty").is_empty());
    send("empty", "k::v");
    assert_eq!(compacted_view(&c, "empty"), vec![(0, "k".to_owned(), s("v"))]);
    // Reading from inside a gap starts at the next record kept.
    let from_gap =
        json_lines(&c.ok(&["consume", "edge", "-p", "0", "--from", "1", "--output", "json"], None));
    assert_eq!(
        from_gap.iter().map(|r| r["offset"].as_u64().expect("offset")).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    // Past the last record kept, the consumer ends at the log end: nothing to read.
    let tail = c.run(&["consume", "edge", "-p", "0", "--from", "5", "--output", "json"], None);
    assert!(tail.status.success() && tail.stdout.is_empty(), "{}", String::from_utf8_lossy(&tail.stderr));
}

/// The row of `group describe` for `topic`'s `partition`: committed,
/// log end, lag.
fn group_row(out: &str, topic: &str, partition: u32) -> Option<(String, String, String)> {
    out.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        (w.len() >= 5 && w[0] == topic && w[1] == partition.to_string())
            .then(|| (w[2].to_owned(), w[3].to_owned(), w[4].to_owned()))
    })
}

#[test]
fn group_offsets_are_reset_by_dry_run_then_execute_described_with_lag_and_deleted() {
    // The default broker config: __consumer_offsets gets 50 partitions on
    // the first group call.
    let c = Brokers::start();
    c.ok(&["topic", "create", "events", "--partitions", "2", "--replication-factor", "3"], None);
    // Keyed lines: 10 records in partition 0, 3 in partition 1.
    let key_for = |p: u32| {
        (0..).map(|i| format!("k{i}")).find(|k| partition_for_key(k.as_bytes(), 2) == p).expect("a key")
    };
    let (k0, k1) = (key_for(0), key_for(1));
    let mut lines: String = (0..10).map(|i| format!("{k0}:e{i}\n")).collect();
    lines.extend((0..3).map(|i| format!("{k1}:f{i}\n")));
    c.ok(&["produce", "events", "--key-separator", ":"], Some(&lines));

    // A dry run prints the new offsets and commits nothing.
    let out = c.ok(&["group", "reset-offsets", "audit", "--topic", "events", "--to", "4"], None);
    assert!(out.contains("dry run: nothing committed"), "{out}");
    assert!(
        out.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["audit", "events", "0", "-", "4"]),
        "{out}"
    );
    let err = c.fails(&["group", "describe", "audit"], None);
    assert!(err.contains("GROUP_ID_NOT_FOUND"), "{err}");

    // Executed: committed, and described with the log end and the lag.
    let out = c.ok(&["group", "reset-offsets", "audit", "--topic", "events", "--to", "4", "--execute"], None);
    assert!(out.contains("committed 2 offsets"), "{out}");
    let out = c.ok(&["group", "describe", "audit"], None);
    assert!(out.contains("group audit: Empty"), "{out}");
    assert_eq!(group_row(&out, "events", 0), Some(("4".into(), "10".into(), "6".into())), "{out}");
    // Partition 1 has 3 records: offset 4 is past its end, so it became 3
    // (the end), with a warning.
    assert_eq!(group_row(&out, "events", 1), Some(("3".into(), "3".into(), "0".into())), "{out}");

    // To the earliest offset, of one partition only: going back is what a reset is for.
    let out = c.ok(
        &[
            "group",
            "reset-offsets",
            "audit",
            "--topic",
            "events",
            "--partitions",
            "0",
            "--to",
            "earliest",
            "--execute",
        ],
        None,
    );
    assert!(out.contains("committed 1 offsets"), "{out}");
    let out = c.ok(&["group", "describe", "audit"], None);
    assert_eq!(group_row(&out, "events", 0), Some(("0".into(), "10".into(), "10".into())), "{out}");
    let out =
        c.ok(&["group", "reset-offsets", "audit", "--topic", "events", "--to", "latest", "--execute"], None);
    assert!(out.contains("committed 2 offsets"), "{out}");
    let out = c.ok(&["group", "describe", "audit"], None);
    assert_eq!(group_row(&out, "events", 0), Some(("10".into(), "10".into(), "0".into())), "{out}");
    assert_eq!(group_row(&out, "events", 1), Some(("3".into(), "3".into(), "0".into())), "{out}");
    let err = c.fails(&["group", "reset-offsets", "audit", "--topic", "events", "--to", "soon"], None);
    assert!(err.contains("not earliest, latest, an offset or a time"), "{err}");

    // A member stopping at --max-records commits only what it printed: the
    // next one prints the rest, each record once.
    let first =
        c.ok(&["consume", "events", "--group", "readers", "--output", "json", "--max-records", "4"], None);
    let out = c.ok(&["group", "describe", "readers"], None);
    let committed: u64 = ["0", "1"]
        .iter()
        .filter_map(|p| group_row(&out, "events", p.parse().ok()?))
        .map(|r| r.0.parse::<u64>().unwrap_or(0))
        .sum();
    assert_eq!(committed, 4, "committed past the 4 records printed:\n{out}");
    let second =
        c.ok(&["consume", "events", "--group", "readers", "--output", "json", "--max-records", "9"], None);
    let mut values: Vec<String> = json_lines(&first)
        .into_iter()
        .chain(json_lines(&second))
        .filter_map(|v| v["value"].as_str().map(str::to_owned))
        .collect();
    values.sort();
    let mut all: Vec<String> =
        (0..10).map(|i| format!("e{i}")).chain((0..3).map(|i| format!("f{i}"))).collect();
    all.sort();
    assert_eq!(values, all, "each record printed once across the two members");

    // Listed; deleted; gone.
    let out = c.ok(&["group", "list"], None);
    assert!(out.lines().any(|l| l.starts_with("audit ") && l.contains("Empty")), "{out}");
    let out = c.ok(&["group", "delete", "audit"], None);
    assert!(out.contains("deleted group \"audit\""), "{out}");
    let err = c.fails(&["group", "describe", "audit"], None);
    assert!(err.contains("GROUP_ID_NOT_FOUND"), "{err}");
    let out = c.ok(&["group", "list"], None);
    assert!(!out.contains("audit"), "{out}");
}

/// A `ferrolog consume --group` process, its stdout (JSON lines) and
/// stderr (the group's events) in files.
struct GroupMember {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl GroupMember {
    fn start(c: &Brokers, name: &str, extra: &[&str]) -> GroupMember {
        let out = c.dir.path().join(format!("{name}.out"));
        let err = c.dir.path().join(format!("{name}.err"));
        let child = Command::new(BIN)
            .args(["--bootstrap", &c.bootstrap, "consume", "orders", "--group", "g", "--output", "json"])
            .args(if extra.contains(&"--session-timeout-ms") {
                &[][..]
            } else {
                &["--session-timeout-ms", "2000"][..]
            })
            .args(["--heartbeat-interval-ms", "300"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("out"))
            .stderr(std::fs::File::create(&err).expect("err"))
            .spawn()
            .expect("start a group member");
        GroupMember { child, out, err }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    fn values(&self) -> Vec<String> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["value"].as_str().map(str::to_owned))
            .collect()
    }

    /// This member's complete stderr lines from byte `from` on (a line
    /// still being written is left out).
    fn lines_from(&self, from: usize) -> Vec<String> {
        let text = self.stderr();
        let complete = &text[..text.rfind('\n').map_or(0, |n| n + 1)];
        complete.get(from..).unwrap_or_default().lines().map(str::to_owned).collect()
    }

    /// The partitions this member holds now, as (member id, generation,
    /// partitions): its last `assigned` line, unless a `revoked` or `lost`
    /// line came after it (the CLI prints each as it happens: a member
    /// that is rebalancing has printed its revocation). For the eager
    /// assignors, whose `assigned` lines each name the whole assignment.
    fn held(&self) -> Option<(String, i32, Vec<String>)> {
        let mut held = None;
        for line in self.lines_from(0) {
            let w: Vec<&str> = line.split_whitespace().collect();
            if w.len() < 7 || w[2] != "member" || w[4] != "generation" {
                continue;
            }
            match w[6] {
                "assigned" if w.len() == 8 => {
                    held = Some((
                        w[3].to_owned(),
                        w[5].parse().unwrap_or(-1),
                        w[7].split(',').map(str::to_owned).collect(),
                    ));
                }
                "revoked" | "lost" => held = None,
                _ => {}
            }
        }
        held
    }

    /// Waits (up to 60 s) until `members` hold the six partitions of
    /// `orders` between them, all in one generation, and the coordinator
    /// describes group `g` as stable in that generation with just them
    /// (not a rebalance under way that a member has not noticed yet).
    /// Every member must hold some partition.
    fn wait_for_one_generation(c: &Brokers, members: &[&GroupMember]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let held: Vec<Option<(String, i32, Vec<String>)>> = members.iter().map(|m| m.held()).collect();
            let gens: std::collections::BTreeSet<i32> = held.iter().flatten().map(|a| a.1).collect();
            let parts: std::collections::BTreeSet<&String> =
                held.iter().flatten().flat_map(|a| &a.2).collect();
            if held.iter().all(Option::is_some)
                && gens.len() == 1
                && parts.len() == 6
                && let Some(generation) = gens.first()
            {
                let described = c.run(&["group", "describe", "g"], None);
                let stable = format!("Stable, generation {generation}, {} members", members.len());
                if String::from_utf8_lossy(&described.stdout).contains(&stable) {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no stable generation: {held:?}\n{}\n{}",
                members.iter().map(|m| m.stderr()).collect::<Vec<_>>().join("\n"),
                c.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// (member id, generation, partitions) of each `assigned` line.
    fn assignments(&self) -> Vec<(String, i32, Vec<String>)> {
        self.lines_from(0)
            .iter()
            .filter_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                (w.len() == 8 && w[2] == "member" && w[4] == "generation" && w[6] == "assigned").then(|| {
                    (
                        w[3].to_owned(),
                        w[5].parse().unwrap_or(-1),
                        w[7].split(',').map(str::to_owned).collect(),
                    )
                })
            })
            .collect()
    }
}

impl Drop for GroupMember {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The committed offsets of topic `orders` in a `group describe` output.
fn parse_committed(text: &str) -> std::collections::BTreeMap<u32, u64> {
    text.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            if w.len() >= 5 && w[0] == "orders" {
                Some((w[1].parse().ok()?, w[2].parse().ok()?))
            } else {
                None
            }
        })
        .collect()
}

#[test]
fn group_members_share_partitions_through_a_kill_a_pause_and_a_coordinator_kill() {
    let c = Brokers::start_with_config(Some(
        "[groups]\nmin_session_timeout_ms = 500\ninitial_rebalance_delay_ms = 300\noffsets_topic_num_partitions = 3\n",
    ));
    c.ok(&["topic", "create", "orders", "--partitions", "6", "--replication-factor", "3"], None);
    let mut c = c;
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let groups = ferrolog_client::Groups::new(
        ferrolog_client::MetadataCache::new(ferrolog_client::ClientConfig::from_list(&c.bootstrap))
            .expect("meta"),
    );

    // Joins with bad timeouts are refused at once, and leave no group.
    let bad = |session: i32, rebalance: i32| ferrolog_client::group::JoinParams {
        member_id: String::new(),
        instance_id: None,
        client_id: "t".into(),
        session_timeout_ms: session,
        rebalance_timeout_ms: rebalance,
        protocol_type: "consumer".into(),
        protocols: vec![("range".into(), bytes::Bytes::new())],
    };
    for (session, rebalance, code) in [
        (10, 1_000, "INVALID_SESSION_TIMEOUT"),
        (2_000, 0, "INVALID_REQUEST"),
        (2_000, -1, "INVALID_REQUEST"),
    ] {
        let e = rt.block_on(groups.join("bad", &bad(session, rebalance))).unwrap_err();
        assert!(e.to_string().contains(code), "{session}/{rebalance}: {e}");
    }
    let err = c.fails(&["group", "describe", "bad"], None);
    assert!(err.contains("GROUP_ID_NOT_FOUND"), "{err}");

    let mut members: Vec<GroupMember> =
        (1..=3).map(|i| GroupMember::start(&c, &format!("m{i}"), &[])).collect();
    GroupMember::wait_for_one_generation(&c, &members.iter().collect::<Vec<_>>());

    // The producer runs throughout; an observer samples the committed offsets.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bootstrap = c.bootstrap.clone();
    let producer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut acked = Vec::new();
            let mut batch = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let lines: String = (0..30).map(|i| format!("k{i}:v{batch}-{i}\n")).collect();
                let mut child = Command::new(BIN)
                    .args(["--bootstrap", &bootstrap, "produce", "orders", "--key-separator", ":"])
                    .stdin(Stdio::piped())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("produce");
                use std::io::Write;
                child.stdin.take().expect("stdin").write_all(lines.as_bytes()).expect("write");
                if child.wait().expect("wait").success() {
                    acked.extend((0..30).map(|i| format!("v{batch}-{i}")));
                }
                batch += 1;
                std::thread::sleep(Duration::from_millis(150));
            }
            acked
        })
    };
    let observer = {
        let stop = stop.clone();
        let probe = Brokers::probe(&c);
        std::thread::spawn(move || {
            let mut seen: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
            let mut samples = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(now) = probe() {
                    for (p, o) in now {
                        let before = seen.insert(p, o).unwrap_or(0);
                        assert!(o >= before, "partition {p}'s committed offset went back: {before} -> {o}");
                    }
                    samples += 1;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            (samples, seen)
        })
    };

    // A member is SIGKILLed: its partitions move on after its session.
    std::thread::sleep(Duration::from_millis(1_500));
    members[0].child.kill().expect("kill");
    std::thread::sleep(Duration::from_millis(3_000));
    // A member joins, and the coordinator's broker is SIGKILLed during that rebalance.
    let coordinator = rt.block_on(groups.find_coordinator("g")).expect("coordinator").broker;
    members.push(GroupMember::start(&c, "m4", &[]));
    std::thread::sleep(Duration::from_millis(200));
    c.kill(coordinator);
    std::thread::sleep(Duration::from_millis(3_000));
    c.restart_founder(coordinator);
    // A member is paused past its session timeout, then resumed. It is
    // paused holding partitions, not in the middle of a rebalance (where it
    // would have revoked them already, and have nothing to lose).
    GroupMember::wait_for_one_generation(&c, &members[1..].iter().collect::<Vec<_>>());
    let before_pause = members[1].held().expect("m2 holds partitions");
    let printed_before_pause = members[1].stderr().len();
    signal(&members[1].child, "-STOP");
    std::thread::sleep(Duration::from_millis(4_000));
    signal(&members[1].child, "-CONT");
    std::thread::sleep(Duration::from_millis(3_000));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked = producer.join().expect("producer");
    let (samples, last_commits) = observer.join().expect("observer");
    assert!(acked.len() >= 300, "only {} records acknowledged", acked.len());
    assert!(samples >= 10 && last_commits.values().any(|o| *o > 0), "{samples} samples: {last_commits:?}");

    // The paused member's generation is over: a commit in it is refused,
    // and it joined again as a new member.
    let (old_member, old_generation, _) = before_pause;
    let old = ferrolog_client::group::MemberRef {
        generation: old_generation,
        member_id: old_member.clone(),
        instance_id: None,
    };
    let offsets = [ferrolog_client::group::OffsetToCommit {
        topic: "orders".into(),
        partition: 0,
        offset: 0,
        metadata: String::new(),
        topic_id: None,
    }];
    let e = rt.block_on(groups.commit_as("g", &old, &offsets, true)).unwrap_err();
    assert!(
        e.to_string().contains("UNKNOWN_MEMBER_ID") || e.to_string().contains("ILLEGAL_GENERATION"),
        "{e}"
    );
    // After the pause, m2 said so under its old id, then was given
    // partitions under a new one.
    let m2 = members[1].stderr();
    let after: Vec<Vec<String>> = members[1]
        .lines_from(printed_before_pause)
        .iter()
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect();
    let noticed = after
        .iter()
        .position(|w| {
            w.len() >= 7 && w[2] == "member" && w[3] == old_member && (w[6] == "lost" || w[4] == "commit")
        })
        .unwrap_or_else(|| panic!("m2 did not notice its eviction:\n{m2}"));
    assert!(
        after[noticed..].iter().any(|w| w.len() == 8 && w[6] == "assigned" && w[3] != old_member),
        "m2 did not rejoin under a new member id:\n{m2}"
    );

    // Every acknowledged record was processed by some member.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen: std::collections::BTreeSet<String> = members.iter().flat_map(GroupMember::values).collect();
        let missing: Vec<&String> = acked.iter().filter(|v| !seen.contains(*v)).collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} acknowledged records never processed, e.g. {:?}\n{}",
            missing.len(),
            acked.len(),
            &missing[..missing.len().min(5)],
            members.iter().map(GroupMember::stderr).collect::<Vec<_>>().join("\n")
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    // No partition was owned by two members in one generation.
    let mut owners: std::collections::BTreeMap<(i32, String), String> = std::collections::BTreeMap::new();
    let mut generations = std::collections::BTreeSet::new();
    for m in &members {
        for (member, generation, parts) in m.assignments() {
            generations.insert(generation);
            for p in parts {
                if let Some(other) = owners.insert((generation, p.clone()), member.clone()) {
                    assert_eq!(other, member, "{p} owned by two members in generation {generation}");
                }
            }
        }
    }
    assert!(generations.len() >= 4, "rebalances seen: {generations:?}");
    // Members stop cleanly on Ctrl-C, leaving the group.
    for m in members.iter().skip(1) {
        signal(&m.child, "-INT");
    }
    for m in members.iter_mut().skip(1) {
        let status = m.child.wait().expect("wait");
        assert!(status.success(), "a member exited with {status}:\n{}", m.stderr());
    }
}

#[test]
fn a_static_member_restarted_within_its_session_keeps_its_partitions_without_a_rebalance() {
    let c = Brokers::start_with_config(Some(
        "[groups]\nmin_session_timeout_ms = 500\ninitial_rebalance_delay_ms = 300\noffsets_topic_num_partitions = 3\n",
    ));
    c.ok(&["topic", "create", "orders", "--partitions", "4", "--replication-factor", "3"], None);
    let statik = ["--group-instance-id", "host-a", "--session-timeout-ms", "8000"];
    let mut a = GroupMember::start(&c, "a", &statik);
    let b = GroupMember::start(&c, "b", &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (generation, a_parts) = loop {
        let (la, lb) = (a.assignments().last().cloned(), b.assignments().last().cloned());
        if let (Some(la), Some(lb)) = (&la, &lb)
            && la.1 == lb.1
            && la.2.len() + lb.2.len() == 4
        {
            break (la.1, la.2.clone());
        }
        assert!(Instant::now() < deadline, "no stable generation: {la:?} {lb:?}\n{}", c.logs());
        std::thread::sleep(Duration::from_millis(200));
    };
    // SIGKILLed and started again at once with the same instance id.
    a.child.kill().expect("kill");
    let _ = a.child.wait();
    let a2 = GroupMember::start(&c, "a2", &statik);
    let deadline = Instant::now() + Duration::from_secs(30);
    let back = loop {
        if let Some(l) = a2.assignments().last().cloned() {
            break l;
        }
        assert!(Instant::now() < deadline, "the restarted member got nothing:\n{}", a2.stderr());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!((back.1, back.2.clone()), (generation, a_parts), "same generation, same partitions");
    std::thread::sleep(Duration::from_millis(2_000));
    assert_eq!(b.assignments().len(), 1, "the other member saw a rebalance:\n{}", b.stderr());
    let out = c.ok(&["group", "describe", "g"], None);
    assert!(out.contains(&format!("Stable, generation {generation}, 2 members")), "{out}");
    assert!(out.contains("host-a"), "{out}");
    // A group with members: offsets are not reset, the group not deleted.
    let err =
        c.fails(&["group", "reset-offsets", "g", "--topic", "orders", "--to", "earliest", "--execute"], None);
    assert!(err.contains("NON_EMPTY_GROUP") && err.contains("2 members"), "{err}");
    let err = c.fails(&["group", "delete", "g"], None);
    assert!(err.contains("NON_EMPTY_GROUP"), "{err}");
}

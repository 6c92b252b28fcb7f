//! Real Kafka clients for the tests of the Kafka listener: `kcat`
//! (librdkafka), `kafka-python` in a virtual environment and kafkajs (three
//! implementations of the protocol). Installed here when missing (Debian's
//! `kcat`; PyPI's `kafka-python` into `target/kafka-venv`; npm's kafkajs
//! into `target/kafka-node`), so `cargo test --workspace` needs nothing set up
//! by hand; a test that cannot get them fails, it never skips.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, bail};

static INSTALL: Mutex<()> = Mutex::new(());

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The `kcat` binary, installed with apt-get if missing.
///
/// # Errors
/// When it is missing and cannot be installed.
pub fn kcat() -> anyhow::Result<PathBuf> {
    let _g = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    let found = || Command::new("kcat").arg("-V").output().is_ok_and(|o| o.status.success());
    if !found() {
        let _ = run(Command::new("apt-get").args(["update", "-qq"]));
        run(Command::new("apt-get")
            .args(["install", "-y", "-qq", "kcat"])
            .env("DEBIAN_FRONTEND", "noninteractive"))
        .context("kcat is not installed and `apt-get install kcat` failed")?;
    }
    if !found() {
        bail!("kcat is still not on PATH after installing it");
    }
    Ok(PathBuf::from("kcat"))
}

/// A Python interpreter with `kafka-python` importable: a virtual
/// environment in the workspace's `target/kafka-venv`, made if missing.
///
/// # Errors
/// When it cannot be made.
pub fn kafka_python() -> anyhow::Result<PathBuf> {
    let _g = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    let venv = target_dir().join("kafka-venv");
    let python = venv.join("bin/python");
    // kafka-python 3 (its admin client's group calls); an older cached
    // environment is upgraded.
    let check = "import kafka, sys; sys.exit(int(kafka.__version__.split('.')[0]) < 3)";
    let ready = || Command::new(&python).args(["-c", check]).output().is_ok_and(|o| o.status.success());
    if !ready() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))
            .context("making the virtual environment")?;
        run(Command::new(&python).args(["-m", "pip", "install", "-q", "--upgrade", "kafka-python>=3.0,<4"]))
            .context("pip install kafka-python")?;
    }
    if !ready() {
        bail!("{} cannot import kafka after installing it", python.display());
    }
    Ok(python)
}

/// A `node_modules` folder holding kafkajs (a Kafka client written in
/// JavaScript, its own implementation of the protocol): the workspace's
/// `target/kafka-node`, filled with `npm install` if missing (or another
/// version is there). Node.js and
/// npm are installed with apt-get if missing. Run scripts with
/// `NODE_PATH` set to the returned folder.
///
/// # Errors
/// When Node.js or kafkajs is missing and cannot be installed.
pub fn kafkajs() -> anyhow::Result<PathBuf> {
    let _g = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    let has = |cmd: &str| Command::new(cmd).arg("--version").output().is_ok_and(|o| o.status.success());
    if !has("node") || !has("npm") {
        let _ = run(Command::new("apt-get").args(["update", "-qq"]));
        run(Command::new("apt-get")
            .args(["install", "-y", "-qq", "nodejs", "npm"])
            .env("DEBIAN_FRONTEND", "noninteractive"))
        .context("Node.js is not installed and `apt-get install nodejs npm` failed")?;
    }
    let prefix = target_dir().join("kafka-node");
    let modules = prefix.join("node_modules");
    let ready = || {
        Command::new("node")
            .args(["-e", "process.exit(require('kafkajs/package.json').version === '2.2.4' ? 0 : 1)"])
            .env("NODE_PATH", &modules)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !ready() {
        std::fs::create_dir_all(&prefix)?;
        // 2.2.4: the last release of kafkajs 2.
        run(Command::new("npm")
            .args(["install", "--silent", "--no-audit", "--no-fund", "--prefix"])
            .arg(&prefix)
            .arg("kafkajs@2.2.4"))
        .context("npm install kafkajs")?;
    }
    if !ready() {
        bail!("node cannot require kafkajs from {} after installing it", modules.display());
    }
    Ok(modules)
}

/// The workspace's target directory (`CARGO_TARGET_DIR` or `target/`).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

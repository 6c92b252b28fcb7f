//! Writes the seed corpus (`ferrolog_fuzz::seeds`) to
//! `fuzz/corpus/<target>/seed-<name>`: `cargo run --example seeds` in `fuzz/`.

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut n = 0;
    for (target, name, bytes) in ferrolog_fuzz::seeds::all() {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(format!("seed-{name}")), bytes)?;
        n += 1;
    }
    println!("{n} seeds written under {}", root.display());
    Ok(())
}

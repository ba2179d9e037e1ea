//! Re-runs the embedding of `migrations/` when it changes, generates the table of every
//! migration's `up.sql` (for the runner's checksums) and the table of
//! migrations that run outside a transaction (`metadata.toml` with `run_in_transaction = false`):
//! `agentloop_shared::db` runs those statement group by statement group (see
//! `migrations/README.md`), which diesel's own harness cannot do.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=../migrations");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect())
        .unwrap_or_default();
    dirs.sort();
    let mut table = String::from("&[\n");
    let mut all = String::from("&[\n");
    for dir in dirs {
        println!("cargo:rerun-if-changed={}", dir.display());
        let Some(name) = dir.file_name().and_then(|n| n.to_str()).map(str::to_owned) else { continue };
        let up = dir.join("up.sql");
        if up.is_file() {
            let up = up.canonicalize().expect("up.sql of a migration");
            writeln!(all, "    ({name:?}, include_str!({:?})),", up.display().to_string()).expect("write");
        }
        let metadata = std::fs::read_to_string(dir.join("metadata.toml")).unwrap_or_default();
        let outside = metadata
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").replace(' ', ""))
            .any(|l| l == "run_in_transaction=false");
        if !outside {
            continue;
        }
        let up = dir.join("up.sql").canonicalize().expect("up.sql of a migration");
        let down = dir.join("down.sql").canonicalize().expect("down.sql of a migration");
        writeln!(table, "    ({name:?}, include_str!({:?}), include_str!({:?})),", up.display().to_string(), down.display().to_string())
            .expect("write");
    }
    table.push(']');
    all.push(']');
    let out_dir = std::env::var("OUT_DIR").expect("OUT_DIR");
    let out = Path::new(&out_dir);
    std::fs::write(out.join("outside_transaction.rs"), table).expect("write outside_transaction.rs");
    std::fs::write(out.join("all_migrations.rs"), all).expect("write all_migrations.rs");
}

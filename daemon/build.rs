//! Build script: test switches only. A normal build sets nothing.
//!
//! `KVTIER_SEEDED_BUGS=1` compiles in the seeded bugs that the daemon's tests must catch
//! (`ci/bites.sh`), as the private cfg `kvtier_seeded_bugs` (declared under `[lints.rust]` in this
//! crate's Cargo.toml); the one planted is chosen at run time by `KVTIER_SEEDED_BUG=NAME`
//! (`src/seeded.rs`). The kvtier library reads the same two variables for its own. Never set them
//! outside that script.

fn main() {
    println!("cargo::rerun-if-env-changed=KVTIER_SEEDED_BUGS");
    if std::env::var("KVTIER_SEEDED_BUGS").is_ok_and(|v| v == "1") {
        println!("cargo::rustc-cfg=kvtier_seeded_bugs");
    }
}

//! Build script: model-checking switches only. A normal build sets nothing.
//!
//! `KVTIER_SEEDED_BUG=NAME` plants one of the seeded bugs that the CLI's tests must catch
//! (`ci/bites.sh`), as the private cfg `kvtier_seeded_bug = "NAME"` (its values are listed under
//! `[lints.rust]` in this crate's Cargo.toml); the kvtier library reads the same variable for its
//! own. Never set it outside that script.

fn main() {
    println!("cargo::rerun-if-env-changed=KVTIER_SEEDED_BUG");
    if let Ok(bug) = std::env::var("KVTIER_SEEDED_BUG") {
        if !bug.is_empty() {
            println!("cargo::rustc-cfg=kvtier_seeded_bug=\"{bug}\"");
        }
    }
}

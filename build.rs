//! Build script: model-checking switches only. A normal build sets nothing.
//!
//! `KVTIER_SEEDED_BUG=NAME` plants one of the seeded bugs that kvtier's loom models and state
//! machine must catch (`ci/loom.sh`, `ci/proptest.sh bites`), as the private cfg
//! `kvtier_seeded_bug = "NAME"` (its values are listed under `[lints.rust]` in Cargo.toml). It is an
//! environment variable rather than RUSTFLAGS so that only this crate is rebuilt for each bug, not
//! every dependency. Never set it outside those scripts.

fn main() {
    println!("cargo::rerun-if-env-changed=KVTIER_SEEDED_BUG");
    if let Ok(bug) = std::env::var("KVTIER_SEEDED_BUG") {
        if !bug.is_empty() {
            println!("cargo::rustc-cfg=kvtier_seeded_bug=\"{bug}\"");
            println!("cargo::warning=kvtier is built with the seeded bug `{bug}` (model checking only)");
        }
    }
}

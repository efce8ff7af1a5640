//! Build script: test switches only. A normal build sets nothing.
//!
//! `KVTIER_SEEDED_BUGS=1` compiles in every seeded bug that kvtier's regression tests, loom models
//! and state machine must catch (`ci/bites.sh`, `ci/loom.sh`, `ci/proptest.sh bites`), as the
//! private cfg `kvtier_seeded_bugs`; the bug planted is then chosen at run time by the environment
//! variable `KVTIER_SEEDED_BUG=NAME` (`src/seeded.rs`), so one build serves every bug. Never set it
//! outside those scripts.

fn main() {
    println!("cargo::rerun-if-env-changed=KVTIER_SEEDED_BUGS");
    if std::env::var("KVTIER_SEEDED_BUGS").is_ok_and(|v| v == "1") {
        println!("cargo::rustc-cfg=kvtier_seeded_bugs");
        println!(
            "cargo::warning=kvtier is built with its seeded bugs (KVTIER_SEEDED_BUG picks one at run time; tests only)"
        );
    }
}

//! Build script: test switches only. A normal build sets nothing.
//!
//! `KVTIER_PY_SEEDED_BUG=NAME` plants one of the seeded bugs that the Python test suite must
//! catch (`ci/python.sh bites`), as the private cfg `kvtier_py_seeded_bug = "NAME"`. It is its own
//! variable (not kvtier's `KVTIER_SEEDED_BUG`) so that only this crate is rebuilt for each bug.
//! Never set it outside that script.

const BUGS: &[&str] = &[
    "close-waits-holding-gil",
    "close-timeout-releases-tensors",
    "lease-drop-inline",
    "round-trip-holds-gil",
    "no-arena-check",
    "evict-count-usize",
    "rank-drop-holds-gil",
    "exceeds-memory-untyped",
    "ssd-stats-unmapped",
    "ssd-error-untyped",
];

fn main() {
    println!("cargo::rerun-if-env-changed=KVTIER_PY_SEEDED_BUG");
    let values: Vec<String> = BUGS.iter().map(|b| format!("\"{b}\"")).collect();
    println!("cargo::rustc-check-cfg=cfg(kvtier_py_seeded_bug, values({}))", values.join(", "));
    if let Ok(bug) = std::env::var("KVTIER_PY_SEEDED_BUG") {
        if !bug.is_empty() {
            assert!(BUGS.contains(&bug.as_str()), "unknown seeded bug `{bug}` (known: {BUGS:?})");
            println!("cargo::rustc-cfg=kvtier_py_seeded_bug=\"{bug}\"");
            println!("cargo::warning=kvtier-py is built with the seeded bug `{bug}` (tests only)");
        }
    }
}

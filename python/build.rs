//! Build script: test switches only. A normal build sets nothing.
//!
//! `KVTIER_PY_SEEDED_BUGS=1` compiles in every seeded bug that the Python test suite must catch
//! (`ci/python.sh bites`), as the private cfg `kvtier_py_seeded_bugs`; the one planted is chosen at
//! run time by `KVTIER_PY_SEEDED_BUG=NAME` (`src/seeded.rs`), so one wheel serves every bug. These
//! are their own variables (not kvtier's `KVTIER_SEEDED_BUGS`) so that only this crate is rebuilt.
//! Never set them outside that script: a wheel built so must not be published.

fn main() {
    println!("cargo::rerun-if-env-changed=KVTIER_PY_SEEDED_BUGS");
    println!("cargo::rustc-check-cfg=cfg(kvtier_py_seeded_bugs)");
    if std::env::var("KVTIER_PY_SEEDED_BUGS").is_ok_and(|v| v == "1") {
        println!("cargo::rustc-cfg=kvtier_py_seeded_bugs");
        println!("cargo::warning=kvtier-py is built with its seeded bugs (KVTIER_PY_SEEDED_BUG picks one at run time; tests only)");
    }
}

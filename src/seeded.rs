//! Seeded bugs: the branches in production code that break one invariant each, so that the
//! regression tests, loom models and state machine can be shown to catch them (`ci/bites.sh`,
//! `ci/loom.sh`, `ci/proptest.sh bites`).
//!
//! A normal build never has them: [`seeded`] is a `const fn` returning `false`, and every
//! `if seeded("name") { .. }` branch compiles away. Built with `KVTIER_SEEDED_BUGS=1` (read by the
//! build script, which then sets the private cfg `kvtier_seeded_bugs`), every seeded bug is compiled
//! in and the one named by the environment variable `KVTIER_SEEDED_BUG` at run time is planted, so
//! one build serves every bug. The names are checked by `ci/bites.sh` against the bite tables, not by
//! the compiler.

/// Whether the seeded bug `name` is planted. Always `false` unless kvtier is built with
/// `KVTIER_SEEDED_BUGS=1`; then `true` when the environment variable `KVTIER_SEEDED_BUG` equals
/// `name` (read once, on the first call).
#[cfg(not(kvtier_seeded_bugs))]
#[inline(always)]
pub(crate) const fn seeded(_name: &'static str) -> bool {
    false
}

/// Whether the seeded bug `name` is planted: the environment variable `KVTIER_SEEDED_BUG` (read
/// once, on the first call, and cached) equals `name`.
#[cfg(kvtier_seeded_bugs)]
pub(crate) fn seeded(name: &'static str) -> bool {
    // A std OnceLock, not a loom primitive: the variable is read outside any model's schedule.
    static PLANTED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PLANTED.get_or_init(|| std::env::var("KVTIER_SEEDED_BUG").ok().filter(|b| !b.is_empty())).as_deref() == Some(name)
}

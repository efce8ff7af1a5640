//! Seeded bugs of the tier daemon (`ci/bites.sh`): as kvtier's own (its `src/seeded.rs`), compiled
//! in only when built with `KVTIER_SEEDED_BUGS=1` (the private cfg `kvtier_seeded_bugs`, set by
//! build.rs) and planted at run time by `KVTIER_SEEDED_BUG=NAME`. A normal build has none.

/// Whether the seeded bug `name` is planted: always `false` in a normal build.
#[cfg(not(kvtier_seeded_bugs))]
#[inline(always)]
pub(crate) const fn seeded(_name: &'static str) -> bool {
    false
}

/// Whether the seeded bug `name` is planted: the environment variable `KVTIER_SEEDED_BUG` (read
/// once, on the first call) equals `name`.
#[cfg(kvtier_seeded_bugs)]
pub(crate) fn seeded(name: &'static str) -> bool {
    static PLANTED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PLANTED.get_or_init(|| std::env::var("KVTIER_SEEDED_BUG").ok().filter(|b| !b.is_empty())).as_deref() == Some(name)
}

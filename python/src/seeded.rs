//! Seeded bugs of the binding (`ci/python.sh bites`): compiled in only when built with
//! `KVTIER_PY_SEEDED_BUGS=1` (the private cfg `kvtier_py_seeded_bugs`, set by build.rs) and planted
//! at run time by the environment variable `KVTIER_PY_SEEDED_BUG=NAME`, so one wheel serves every
//! bug. A normal build (every published wheel) has none: [`seeded`] is then a `const fn` returning
//! `false` and the branches compile away.

/// Whether the seeded bug `name` is planted: always `false` in a normal build.
#[cfg(not(kvtier_py_seeded_bugs))]
#[inline(always)]
pub(crate) const fn seeded(_name: &'static str) -> bool {
    false
}

/// Whether the seeded bug `name` is planted: the environment variable `KVTIER_PY_SEEDED_BUG`
/// (read once, on the first call) equals `name`.
#[cfg(kvtier_py_seeded_bugs)]
pub(crate) fn seeded(name: &'static str) -> bool {
    static PLANTED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PLANTED.get_or_init(|| std::env::var("KVTIER_PY_SEEDED_BUG").ok().filter(|b| !b.is_empty())).as_deref()
        == Some(name)
}

/// The seeded bug planted for the Python code of the package (`kvtier/vllm/_seeded.py`): the
/// value of `KVTIER_PY_SEEDED_BUG` in a seeded build, always None in a normal build.
#[pyo3::pyfunction]
pub fn _seeded_bug() -> Option<String> {
    #[cfg(kvtier_py_seeded_bugs)]
    {
        std::env::var("KVTIER_PY_SEEDED_BUG").ok().filter(|b| !b.is_empty())
    }
    #[cfg(not(kvtier_py_seeded_bugs))]
    {
        None
    }
}

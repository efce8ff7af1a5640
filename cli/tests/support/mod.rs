//! Finding the `kvtier` binary and the repository's data files at run time, so the test binaries
//! also pass when they are copied with the repository to another machine (where the paths Cargo
//! compiled in do not exist).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The directory of the running test executable (`target/<profile>/deps`).
fn exe_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(Path::to_path_buf)
}

/// The `kvtier` binary: `$KVTIER_BIN` if set, else `kvtier` in the parent of the test executable's
/// directory (`target/<profile>/`, where Cargo puts it beside `deps/`), else the path Cargo compiled
/// in (`CARGO_BIN_EXE_kvtier`).
///
/// Panics, naming every place it looked, if none of them holds a file.
pub fn kvtier_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVTIER_BIN") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "KVTIER_BIN={} is not a file", p.display());
        return p;
    }
    let mut tried = Vec::new();
    if let Some(dir) = exe_dir() {
        if let Some(profile) = dir.parent() {
            tried.push(profile.join(format!("kvtier{}", std::env::consts::EXE_SUFFIX)));
        }
    }
    tried.push(PathBuf::from(env!("CARGO_BIN_EXE_kvtier")));
    match tried.iter().find(|p| p.is_file()) {
        Some(p) => p.clone(),
        None => panic!(
            "the kvtier binary is not in any of {tried:?}; build it (cargo build -p kvtier-cli) or set KVTIER_BIN"
        ),
    }
}

/// The file `name` of the repository's `data/` directory: `$KVTIER_DATA_DIR/name` if that variable
/// is set, else the first `data/name` found walking up from the test executable's directory, from
/// the current directory, and from this crate's source directory.
///
/// Panics, naming every place it looked, if the file is not found: a test never skips for want of
/// its input.
pub fn data_file(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("KVTIER_DATA_DIR") {
        let p = Path::new(&dir).join(name);
        assert!(p.is_file(), "KVTIER_DATA_DIR: {} is not a file", p.display());
        return p;
    }
    let starts = [exe_dir(), std::env::current_dir().ok(), Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")))];
    let mut tried = Vec::new();
    for start in starts.into_iter().flatten() {
        for dir in start.ancestors() {
            let p = dir.join("data").join(name);
            if p.is_file() {
                return p;
            }
            tried.push(p);
        }
    }
    panic!("data/{name} not found (looked at {tried:?}); it is part of the repository, or set KVTIER_DATA_DIR")
}

//! One host pool shared by engine processes: the tier daemon (`kvtierd`) and its clients
//! (feature `remote`).
//!
//! Engines such as vLLM, SGLang and TensorRT-LLM run one process per GPU rank. The daemon owns a
//! [`crate::HostTier`] whose pool lives in shared memory (a memfd, hugetlb-backed when 2 MiB pages
//! are reserved): the index, the slots, the free list, the leases and eviction, run by the very
//! code an in-process tier runs. Each engine process connects over a Unix socket
//! ([`crate::HostTier::connect`]), receives the pool's memfd (`SCM_RIGHTS`), maps it, binds it to
//! its copy backend once, and runs kvtier's copies between its own GPU memory and the pool; no GPU
//! memory crosses processes. The connected tier has the in-process tier's API.
//!
//! - `proto`: the wire protocol (versioned frames, postcard);
//! - `client`: the connected tier's side ([`crate::HostTier::connect`], [`ConnectOptions`], [`LeaseToken`]).
//!
//! Both sit below the tier: the tier's connected flavour (`tier/connected.rs`) calls the client.
//! The daemon's side, [`crate::server::Server`], sits above the tier, in `server/`.

pub(crate) mod client;
pub mod proto;

pub use client::{ConnectOptions, LeaseToken};

use std::path::{Path, PathBuf};

/// The socket path `kvtierd` listens on, and clients connect to, when none is given: a directory
/// only this user can reach, so no other uid can take the name first.
///
/// - `$XDG_RUNTIME_DIR/kvtierd.sock` when `XDG_RUNTIME_DIR` is set to an absolute path (the
///   per-user runtime directory, `0700`, made by the login manager);
/// - else `/run/kvtierd/kvtierd.sock` for root;
/// - else `/tmp/kvtierd-$UID/kvtierd.sock` (the daemon creates the directory `0700` and refuses to
///   use one it does not own or that others can write).
///
/// Pure: creates nothing (the daemon's [`crate::server::Server::bind`] makes the directory).
pub fn default_socket_path() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|d| d.is_absolute()) {
        return dir.join("kvtierd.sock");
    }
    // SAFETY: geteuid takes nothing and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        PathBuf::from("/run/kvtierd/kvtierd.sock")
    } else {
        per_user_tmp_dir(uid).join("kvtierd.sock")
    }
}

fn per_user_tmp_dir(uid: u32) -> PathBuf {
    PathBuf::from(format!("/tmp/kvtierd-{uid}"))
}

/// True if `dir` is the per-user fallback directory of this euid in `/tmp`.
pub(crate) fn is_per_user_tmp_dir(dir: &Path) -> bool {
    // SAFETY: geteuid takes nothing and cannot fail.
    dir == per_user_tmp_dir(unsafe { libc::geteuid() })
}

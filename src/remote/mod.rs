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
//! The daemon's side, [`crate::Server`], sits above the tier, in `server/`.

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
/// Pure: creates nothing (the daemon's [`crate::Server::bind`] makes the directory).
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

/// One client process of a tier daemon as the daemon counts it ([`crate::HostTier::clients`]):
/// its live sessions (connections that said hello) summed. Gauges are what its sessions hold now;
/// counters count from each session's start, and a session's counts leave with it. Block counts
/// are blocks (pages across all arenas); bytes are payload bytes (blocks x
/// [`crate::Geometry::block_bytes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ClientStats {
    /// The process id (`SO_PEERCRED`), `None` where the daemon could not learn it.
    pub pid: Option<u32>,
    /// Its sessions open now.
    pub sessions: u64,
    /// Milliseconds since its oldest open session began.
    pub connected_ms: u64,
    /// Lease handles it holds now.
    pub lease_handles: u64,
    /// Blocks over those handles (each handle counts its lease's blocks).
    pub leased_blocks: u64,
    /// Hints it holds now (given and not withdrawn; some may have expired in the tier).
    pub hints: u64,
    /// Saves and restores it has in flight or withheld now.
    pub copies_in_flight: u64,
    /// Queries it ran.
    pub queries: u64,
    /// Blocks its queries leased.
    pub hit_blocks: u64,
    /// Blocks its queries asked for and did not find.
    pub miss_blocks: u64,
    /// Blocks it saved (copies reported done).
    pub saved_blocks: u64,
    /// Bytes it saved (D2H).
    pub bytes_saved: u64,
    /// Blocks it restored (copies reported done).
    pub restored_blocks: u64,
    /// Bytes it restored (H2D).
    pub bytes_restored: u64,
    /// Hints it gave.
    pub hints_given: u64,
    /// Its requests refused over a bound ([`crate::TierError::LimitExceeded`]).
    pub refused: u64,
}

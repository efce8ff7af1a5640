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
//! - [`proto`]: the wire protocol (versioned frames, postcard);
//! - `client`: the connected tier's side ([`crate::HostTier::connect`], [`ConnectOptions`], [`LeaseToken`]);
//! - [`server`]: the daemon's side ([`Server`]), including what happens when an engine dies.

pub(crate) mod client;
pub mod proto;
pub mod server;

pub use client::{ConnectOptions, LeaseToken};
pub use server::Server;

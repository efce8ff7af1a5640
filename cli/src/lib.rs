//! # kvtier-cli
//!
//! The `kvtier` command line as a library: Mooncake-format request traces ([`trace`]), the byte-moving
//! replay through the host tier ([`replay`]), the policy simulation ([`simulate`]), synthetic traces
//! fitted to a real one ([`synth`]) or written from stated shapes ([`shapes`]), a running daemon's statistics ([`stats`]) and the size arguments ([`size`]). The binary (`kvtier replay`, `kvtier simulate`) is a thin layer
//! over these modules; the library crate an engine depends on is `kvtier`, which knows nothing of
//! traces, reports or command lines.
#![warn(missing_docs)]

pub mod error;
pub mod replay;
mod seeded;
pub mod shapes;
pub mod simulate;
pub mod size;
pub mod stats;
pub mod synth;
pub mod trace;

pub use error::{Error, ReplayError, TraceError};

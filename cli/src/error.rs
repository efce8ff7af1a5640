//! The command line's errors: the library's [`kvtier::Error`] plus traces ([`TraceError`]), replays
//! ([`ReplayError`]) and bad arguments.

use std::path::PathBuf;
use thiserror::Error;

/// A trace that cannot be read or a line that is malformed.
#[derive(Debug, Error)]
pub enum TraceError {
    /// The file could not be opened, read or decompressed.
    #[error("reading trace {path}: {source}")]
    Io {
        /// Trace path.
        path: PathBuf,
        /// The OS (or decompression) error.
        #[source]
        source: std::io::Error,
    },
    /// A line is not valid JSON or lacks a field.
    #[error("trace line {line}: {message}")]
    Malformed {
        /// 1-based line number (of the decompressed text).
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The trace has no request.
    #[error("trace {path} holds no request")]
    Empty {
        /// Trace path (or `<embedded sample>`).
        path: PathBuf,
    },
    /// The file is compressed in a format the reader does not decode (only zstd is).
    #[error("trace {path} is {format}-compressed; decompress it or recompress it with zstd (`zstd FILE`)")]
    UnsupportedCompression {
        /// Trace path.
        path: PathBuf,
        /// `gzip`, `xz` or `bzip2`.
        format: &'static str,
    },
}

/// A replay that cannot run as configured.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// A request has more full pages than the replay's GPU pages.
    #[error(
        "request {request} of the trace has {pages} pages but the replay has only {gpu_pages} GPU pages; \
         raise --gpu-pages to at least {pages}"
    )]
    RequestTooLarge {
        /// 1-based request number (after blank lines are skipped).
        request: usize,
        /// Full pages of the request.
        pages: usize,
        /// GPU pages available to the replay.
        gpu_pages: u64,
    },
    /// Nothing to replay (an empty trace or `--requests 0`).
    #[error("no request to replay")]
    NoRequests,
}

/// Any error of the command line.
#[derive(Debug, Error)]
pub enum Error {
    /// An error of the tier library (geometry, pool, copy, tier, verification).
    #[error(transparent)]
    Kvtier(#[from] kvtier::Error),
    /// See [`TraceError`].
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// See [`ReplayError`].
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// Invalid command-line input (a size, a policy list, a page size the trace cannot use).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An output file (e.g. `--plot`) could not be written.
    #[error("writing {path}: {source}")]
    Output {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The plot could not be drawn.
    #[error("drawing the plot: {0}")]
    Plot(String),
}

macro_rules! via_kvtier {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::Kvtier(e.into())
            }
        }
    )*};
}
via_kvtier!(kvtier::GeometryError, kvtier::PoolError, kvtier::CopyError, kvtier::TierError);

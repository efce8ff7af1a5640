//! The SSD tier's storage: preallocated files of fixed-size disk slots, each block followed by a
//! self-describing, checksummed trailer, so that a file reopened after a crash or a restart is
//! rebuilt from its trailers and never serves a byte that does not verify.
//!
//! - [`format`]: the file header and the slot trailer (layout, encoding, checks).
//! - [`batch`]: batched reads at a depth (io_uring, or `pread` on threads).
//! - [`error`]: [`DiskError`], what a disk slot file refuses or fails with.
//! - [`file`]: one file: create (`fallocate`) or reopen, write a slot, read one verified, scan.
//!
//! This is the tier's bottom layer only: demotion from the host pool, promotion on a query and
//! the disk slots' own eviction are built on it.

pub(crate) mod batch;
pub(crate) mod error;
pub(crate) mod file;
pub(crate) mod format;

pub use batch::{BatchEngine, BatchReport, ReadRequest};
pub use error::DiskError;
pub use file::{DiskFile, DiskFileConfig, IoCounts, IoMode, IoPreference, ScanReport, ScannedBlock};
pub use format::{slot_stride, FileHeader, FormatFault, SlotTrailer, DISK_PAGE, FORMAT_VERSION, TRAILER_BYTES};

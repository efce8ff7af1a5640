//! The disk slot files' errors.

use thiserror::Error;

use super::format::{FileHeader, FormatFault};
use crate::key::ContentKey;

/// A disk slot file (the SSD tier's storage) that cannot be made, opened, written or read, or a
/// slot that holds no verified copy of the block asked for.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DiskError {
    /// The file's configuration cannot be used (zero slots or payload bytes, a size overflow).
    #[error("disk slot file: {0}")]
    BadConfig(String),
    /// The filesystem has no room for the preallocated file; nothing was left behind.
    #[error("{}: no space for a disk slot file of {bytes} B", path.display())]
    NoSpace {
        /// The file asked for.
        path: std::path::PathBuf,
        /// Bytes the file needs.
        bytes: u64,
    },
    /// The path holds a file that is not a kvtier disk slot file (or whose header is torn).
    #[error("{}: not a kvtier disk slot file: its header is {fault}", path.display())]
    NotADiskFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with its header.
        fault: FormatFault,
    },
    /// A kvtier disk slot file made for another namespace, payload size or slot count.
    #[error("{}: a disk slot file of another geometry (found {found:?}, wanted {wanted:?})", path.display())]
    OtherGeometry {
        /// The file.
        path: std::path::PathBuf,
        /// What its header says.
        found: Box<FileHeader>,
        /// What was asked for.
        wanted: Box<FileHeader>,
    },
    /// The file is open in another tier (this process or another holds its lock): one file has
    /// one owner at a time.
    #[error("{}: the disk slot file is in use by another tier (it holds the file's lock)", path.display())]
    InUse {
        /// The file.
        path: std::path::PathBuf,
    },
    /// A disk slot id past the file's last slot.
    #[error("disk slot {slot} is out of range: the file has {slots} slots")]
    SlotOutOfRange {
        /// The slot asked for.
        slot: u64,
        /// Slots in the file.
        slots: u64,
    },
    /// A payload buffer that is not exactly one block.
    #[error("a {got} B buffer for a disk slot of {want} B payload")]
    PayloadSize {
        /// Bytes given.
        got: u64,
        /// The file's payload bytes.
        want: u64,
    },
    /// The slot holds no verified copy of the block: nothing was copied out.
    #[error("disk slot {slot} holds no verified copy of {key:?}: {why}")]
    Unverified {
        /// The slot read.
        slot: u64,
        /// The block asked for.
        key: ContentKey,
        /// Which check failed.
        why: String,
    },
    /// An I/O call failed.
    #[error("{}: {what}: {source}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The step that failed.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

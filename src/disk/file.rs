//! One preallocated disk slot file: create or reopen it, write a block into a slot, read one back
//! verified, and rebuild the map of what the file holds from its trailers.
//!
//! I/O is `pread`/`pwrite` on the file, with `O_DIRECT` where the filesystem takes it: offsets and
//! lengths are whole 4 KiB pages and each transfer goes through a 4 KiB-aligned staging buffer.
//! A filesystem that refuses `O_DIRECT` at open or on a transfer (or a file opened with
//! [`IoPreference::Buffered`]) gets the buffered
//! descriptor instead, and [`DiskFile::io_counts`] says how many transfers went which way.

use std::alloc::{self, Layout};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use xxhash_rust::xxh3::xxh3_64;

use super::error::DiskError;
use super::format::{slot_stride, FileHeader, FormatFault, SlotTrailer, DISK_PAGE, HEADER_BYTES, TRAILER_BYTES};
use crate::key::{ContentKey, Namespace};

/// What a disk slot file is made for: where it lives, whose blocks it holds and how many.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskFileConfig {
    /// The file's path; its directory must exist.
    pub path: PathBuf,
    /// The namespace (model and layout) of the blocks; a file of another namespace is refused.
    pub namespace: Namespace,
    /// Bytes of one block's payload (the host pool's slot size), at least 1.
    pub payload_bytes: u64,
    /// Number of slots, at least 1. The file takes `4096 + slots * stride` bytes, where
    /// `stride = align_up(payload_bytes + 96, 4096)`.
    pub slots: u64,
    /// Whether to try `O_DIRECT`.
    pub io: IoPreference,
}

/// How a disk slot file should do its transfers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IoPreference {
    /// `O_DIRECT` where the filesystem takes it, buffered where it refuses (the default).
    #[default]
    Direct,
    /// Always through the page cache (for a filesystem whose `O_DIRECT` is slow or unsafe).
    Buffered,
}

/// How the file's transfers are done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// `O_DIRECT`: no page cache, DMA straight from the staging buffer.
    Direct,
    /// Through the page cache: the filesystem refused `O_DIRECT` at open.
    Buffered,
}

/// Transfers done so far, by the way they went (counts, not bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoCounts {
    /// Reads and writes done with `O_DIRECT`.
    pub direct: u64,
    /// Reads and writes done through the page cache.
    pub buffered: u64,
}

/// A block the trailer scan found in a slot. Its payload is verified only when it is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScannedBlock {
    /// The disk slot.
    pub slot: u64,
    /// The block's content key.
    pub key: ContentKey,
    /// The generation the slot was written with.
    pub generation: u64,
}

/// What the trailer scan of a file found, slot by slot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Slots whose trailer is sound: a block of this namespace, written for this slot.
    pub blocks: Vec<ScannedBlock>,
    /// Slots never written, or cleared.
    pub blank: u64,
    /// Slots whose trailer is torn or corrupted (checksum, magic or version): free.
    pub torn: u64,
    /// Slots with a sound trailer that belongs elsewhere (another namespace, another slot, another
    /// payload size): free.
    pub foreign: u64,
    /// Slots (counted in `torn` too) that a file shorter than its header says no longer holds
    /// whole: free, and the file is extended again to its full size.
    pub truncated: u64,
}

/// A 4 KiB-aligned heap buffer for `O_DIRECT` transfers.
pub(super) struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Box<[u8]>); moving it to another
// thread moves that ownership.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, DISK_PAGE).expect("a stride that fits the file fits a layout")
    }

    fn new(len: usize) -> Self {
        assert!(len > 0 && len % DISK_PAGE == 0, "staging buffers are whole pages");
        // SAFETY: the layout has a non-zero size (asserted above).
        let raw = unsafe { alloc::alloc_zeroed(Self::layout(len)) };
        let ptr = std::ptr::NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(Self::layout(len)));
        AlignedBuf { ptr, len }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: ptr points to `len` initialised bytes (alloc_zeroed) owned by self; the shared
        // borrow of self keeps them alive and unaliased by a mutable borrow.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and the exclusive borrow of self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was returned by alloc_zeroed with exactly this layout and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

/// One preallocated file of fixed-size disk slots (the layout is in `docs/design.md`, "The SSD tier's disk slot files").
///
/// Methods take `&self` and may be called from several threads; two concurrent writes of the same
/// slot are the caller's to prevent (the tier owns each disk slot through its slot word).
pub struct DiskFile {
    path: PathBuf,
    header: FileHeader,
    /// The descriptor transfers use first (`O_DIRECT` when the open took it).
    primary: File,
    /// A buffered descriptor for transfers the filesystem refuses to do direct.
    buffered: File,
    mode: IoMode,
    staging: Mutex<Vec<AlignedBuf>>,
    /// Staging buffers taken and not given back (in use, or given up to a drive that never
    /// completed a transfer into them).
    staging_out: AtomicUsize,
    /// `io_uring_enter` failed during a batch: batches go on threads from then on.
    pub(super) ring_failed: AtomicBool,
    direct_ops: AtomicU64,
    buffered_ops: AtomicU64,
}

impl std::fmt::Debug for DiskFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskFile")
            .field("path", &self.path)
            .field("header", &self.header)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

fn io_error(path: &Path, what: &'static str, source: std::io::Error) -> DiskError {
    DiskError::Io { path: path.to_path_buf(), what, source }
}

impl DiskFile {
    /// Opens the file at `config.path`, creating and preallocating it (`fallocate`) when it does
    /// not exist, and returns it with the scan of its trailers (empty for a new file).
    ///
    /// # Errors
    /// - [`DiskError::BadConfig`]: zero slots or payload bytes, or a size that overflows.
    /// - [`DiskError::NoSpace`]: the filesystem cannot hold the file (`fallocate` said `ENOSPC`);
    ///   the partly made file is removed. Also for an existing file shorter than its header says
    ///   (truncated) that cannot be extended again; that file is left as it is.
    /// - [`DiskError::NotADiskFile`]: the path holds something that is not a kvtier disk slot file
    ///   (or its header is torn); the file is left as it is.
    /// - [`DiskError::OtherGeometry`]: a kvtier file of another namespace, payload size or slot
    ///   count; the file is left as it is.
    /// - [`DiskError::InUse`]: another open `DiskFile` (in this process or another) holds the file.
    /// - [`DiskError::Io`]: any other I/O failure, with the path and the step.
    ///
    /// A file this call creates is removed again when any later step fails: an error leaves
    /// nothing behind. An existing file that was truncated (shorter than its header says) keeps
    /// the slots it still holds whole: the others are counted in [`ScanReport::truncated`] and
    /// [`ScanReport::torn`], and the file is extended back to its full size (`fallocate`).
    pub fn open_or_create(config: &DiskFileConfig) -> Result<(DiskFile, ScanReport), DiskError> {
        let stride = slot_stride(config.payload_bytes).filter(|_| config.payload_bytes > 0);
        let header = match stride {
            Some(stride) if config.slots > 0 => FileHeader {
                namespace: config.namespace,
                payload_bytes: config.payload_bytes,
                stride,
                slots: config.slots,
            },
            _ => {
                return Err(DiskError::BadConfig(format!(
                    "a disk slot file needs at least one slot and one payload byte (got {} slots of {} B)",
                    config.slots, config.payload_bytes
                )))
            }
        };
        let file_bytes = header.file_bytes().ok_or_else(|| {
            DiskError::BadConfig(format!("{} slots of {} B overflow a file size", config.slots, header.stride))
        })?;
        let path = config.path.clone();
        let exists = path.try_exists().map_err(|e| io_error(&path, "looking for the file", e))?;
        if !exists {
            Self::create(&path, &header, file_bytes)?;
        }
        let opened = Self::open(&path, header, config.io).and_then(|file| {
            let found = file.read_header()?;
            if found != header {
                return Err(DiskError::OtherGeometry {
                    path: path.clone(),
                    found: Box::new(found),
                    wanted: Box::new(header),
                });
            }
            let scan = if exists {
                file.reopen(file_bytes)?
            } else {
                ScanReport { blank: header.slots, ..ScanReport::default() }
            };
            Ok((file, scan))
        });
        if opened.is_err() && !exists {
            // Made by this call and refused after all: nothing is left behind.
            let _ = std::fs::remove_file(&path);
        }
        opened
    }

    /// The scan of an existing file, which first finds how long the file is: a truncated one keeps
    /// the slots it still holds whole, and is extended back to `file_bytes`.
    fn reopen(&self, file_bytes: u64) -> Result<ScanReport, DiskError> {
        let len = self.buffered.metadata().map_err(|e| io_error(&self.path, "reading the file's length", e))?.len();
        // Seeded bug (tests only): the length is taken on trust, and a truncated file's scan fails
        // on the first slot past its end (the old refusal).
        if len >= file_bytes || crate::seeded::seeded("ssd-truncated-refused") {
            return self.scan();
        }
        // Slots whose last page (the trailer's) lies wholly in the file.
        let whole = (len.saturating_sub(HEADER_BYTES as u64) / self.header.stride).min(self.header.slots);
        let mut report = self.scan_first(whole)?;
        report.truncated = self.header.slots - whole;
        report.torn += report.truncated;
        tracing::warn!(
            path = %self.path.display(), length = len, expected = file_bytes, slots_lost = report.truncated,
            "a disk slot file was truncated: its whole slots are kept, the file is extended again"
        );
        let length = i64::try_from(file_bytes)
            .map_err(|_| DiskError::BadConfig(format!("a file of {file_bytes} B is larger than the OS takes")))?;
        nix::fcntl::fallocate(self.buffered.as_raw_fd(), nix::fcntl::FallocateFlags::empty(), 0, length).map_err(
            |errno| {
                if errno == nix::errno::Errno::ENOSPC {
                    DiskError::NoSpace { path: self.path.clone(), bytes: file_bytes }
                } else {
                    io_error(&self.path, "extending a truncated file (fallocate)", errno.into())
                }
            },
        )?;
        Ok(report)
    }

    fn create(path: &Path, header: &FileHeader, file_bytes: u64) -> Result<(), DiskError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| io_error(path, "creating the file", e))?;
        let length = i64::try_from(file_bytes)
            .map_err(|_| DiskError::BadConfig(format!("a file of {file_bytes} B is larger than the OS takes")))?;
        let allocated = nix::fcntl::fallocate(file.as_raw_fd(), nix::fcntl::FallocateFlags::empty(), 0, length);
        if let Err(errno) = allocated {
            drop(file);
            let _ = std::fs::remove_file(path);
            return Err(if errno == nix::errno::Errno::ENOSPC {
                DiskError::NoSpace { path: path.to_path_buf(), bytes: file_bytes }
            } else {
                io_error(path, "preallocating the file (fallocate)", errno.into())
            });
        }
        // The header goes last: a file whose creation was cut short has no header and is refused
        // at the next open rather than taken for an empty tier of some other geometry.
        let mut page = vec![0u8; HEADER_BYTES];
        header.encode(&mut page);
        if let Err(e) = file.write_all_at(&page, 0) {
            drop(file);
            let _ = std::fs::remove_file(path);
            return Err(io_error(path, "writing the file header", e));
        }
        Ok(())
    }

    fn open(path: &Path, header: FileHeader, io: IoPreference) -> Result<DiskFile, DiskError> {
        let buffered =
            OpenOptions::new().read(true).write(true).open(path).map_err(|e| io_error(path, "opening the file", e))?;
        // One owner at a time: two tiers writing one file would overwrite each other's slots (no
        // wrong byte would be served, the checksums see to that, but blocks would be lost). The
        // lock is the open file's and goes with it, also when the process dies.
        // (Seeded bug, tests only: `disk-file-unlocked` takes no lock.)
        if !crate::seeded::seeded("disk-file-unlocked") {
            // SAFETY: flock on a descriptor this function owns (`buffered`, open until the
            // DiskFile is dropped); no memory is passed.
            if unsafe { libc::flock(buffered.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                return Err(if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    DiskError::InUse { path: path.to_path_buf() }
                } else {
                    io_error(path, "locking the file (flock)", e)
                });
            }
        }
        let direct = match io {
            IoPreference::Direct => OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(path),
            IoPreference::Buffered => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
        };
        let (primary, mode) = match direct {
            Ok(file) => (file, IoMode::Direct),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let again = buffered.try_clone().map_err(|e| io_error(path, "opening the file", e))?;
                (again, IoMode::Buffered)
            }
            Err(e) => return Err(io_error(path, "opening the file with O_DIRECT", e)),
        };
        Ok(DiskFile {
            path: path.to_path_buf(),
            header,
            primary,
            buffered,
            mode,
            staging: Mutex::new(Vec::new()),
            staging_out: AtomicUsize::new(0),
            ring_failed: AtomicBool::new(false),
            direct_ops: AtomicU64::new(0),
            buffered_ops: AtomicU64::new(0),
        })
    }

    fn read_header(&self) -> Result<FileHeader, DiskError> {
        let mut page = vec![0u8; HEADER_BYTES];
        self.buffered.read_exact_at(&mut page, 0).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => {
                DiskError::NotADiskFile { path: self.path.clone(), fault: FormatFault::Blank }
            }
            _ => io_error(&self.path, "reading the file header", e),
        })?;
        FileHeader::decode(&page).map_err(|fault| DiskError::NotADiskFile { path: self.path.clone(), fault })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Staging buffers (one slot stride each) taken by transfers and not given back: 0 whenever no
    /// transfer is in progress, unless a drive never completed an io_uring transfer, whose buffer
    /// is then given up rather than freed under it (see [`DiskFile::read_batch`]).
    pub fn staging_in_use(&self) -> usize {
        self.staging_out.load(Ordering::Relaxed)
    }

    /// True once `io_uring_enter` failed during a batch of this file: its batches go on threads.
    pub fn ring_failed(&self) -> bool {
        self.ring_failed.load(Ordering::Relaxed)
    }

    /// The geometry the file was made for.
    pub fn header(&self) -> &FileHeader {
        &self.header
    }

    /// Whether transfers go `O_DIRECT` or through the page cache.
    pub fn mode(&self) -> IoMode {
        self.mode
    }

    /// The transfers done so far, by the way they went.
    pub fn io_counts(&self) -> IoCounts {
        IoCounts {
            direct: self.direct_ops.load(Ordering::Relaxed),
            buffered: self.buffered_ops.load(Ordering::Relaxed),
        }
    }

    pub(super) fn check_slot(&self, slot: u64) -> Result<(), DiskError> {
        if slot >= self.header.slots {
            return Err(DiskError::SlotOutOfRange { slot, slots: self.header.slots });
        }
        Ok(())
    }

    fn stride(&self) -> usize {
        usize::try_from(self.header.stride).expect("a stride that was preallocated fits in memory")
    }

    pub(super) fn take_staging(&self) -> AlignedBuf {
        let reuse = self.staging.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let buf = reuse.unwrap_or_else(|| AlignedBuf::new(self.stride()));
        self.staging_out.fetch_add(1, Ordering::Relaxed);
        buf
    }

    /// Leaks a staging buffer a transfer that never completed may still write (never freed, and
    /// still counted in [`DiskFile::staging_in_use`]).
    pub(super) fn give_up_staging(&self, buf: AlignedBuf) {
        std::mem::forget(buf);
    }

    pub(super) fn give_staging(&self, buf: AlignedBuf) {
        self.staging_out.fetch_sub(1, Ordering::Relaxed);
        let mut pool = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        // Keep a few for reuse; a burst of threads does not pin their buffers for good.
        if pool.len() < 8 {
            pool.push(buf);
        }
    }

    /// One transfer of whole pages at `offset`, direct first, buffered where the filesystem
    /// refuses the direct one (`EINVAL`).
    fn transfer(&self, offset: u64, buf: &mut [u8], write: bool, what: &'static str) -> Result<(), DiskError> {
        let run = |file: &File, buf: &mut [u8]| {
            if write {
                file.write_all_at(buf, offset)
            } else {
                file.read_exact_at(buf, offset)
            }
        };
        if self.mode == IoMode::Direct {
            match run(&self.primary, buf) {
                Ok(()) => {
                    self.direct_ops.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(io_error(&self.path, what, e)),
            }
        }
        run(&self.buffered, buf).map_err(|e| io_error(&self.path, what, e))?;
        self.buffered_ops.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Writes `payload` (exactly the file's payload bytes) into `slot` as the block `key`, with
    /// `generation` in its trailer. The payload and its trailer go in one transfer; a crash in the
    /// middle leaves a slot that fails its checks and is free, never a wrong block.
    ///
    /// # Errors
    /// [`DiskError::SlotOutOfRange`], [`DiskError::PayloadSize`], or [`DiskError::Io`] (a full
    /// disk, a failed drive).
    pub fn write(&self, slot: u64, key: ContentKey, generation: u64, payload: &[u8]) -> Result<(), DiskError> {
        self.check_slot(slot)?;
        if payload.len() as u64 != self.header.payload_bytes {
            return Err(DiskError::PayloadSize { got: payload.len() as u64, want: self.header.payload_bytes });
        }
        let mut buf = self.take_staging();
        let bytes = buf.bytes_mut();
        let stride = bytes.len();
        bytes[..payload.len()].copy_from_slice(payload);
        bytes[payload.len()..stride - TRAILER_BYTES].fill(0);
        let trailer = SlotTrailer {
            namespace: self.header.namespace,
            key,
            slot,
            generation,
            payload_bytes: self.header.payload_bytes,
            payload_xxh3: xxh3_64(payload),
        };
        trailer.encode(&mut bytes[stride - TRAILER_BYTES..]);
        let result = self.transfer(self.header.slot_offset(slot), buf.bytes_mut(), true, "writing a slot");
        self.give_staging(buf);
        result
    }

    /// Reads `slot` into `out` (exactly the file's payload bytes) if it holds the block `key` of
    /// generation `generation`, with its trailer and payload checksums sound. `out` is written
    /// only when every check passes.
    ///
    /// # Errors
    /// - [`DiskError::Unverified`]: the slot holds no sound copy of that block (blank, torn,
    ///   another key or generation, or a payload whose checksum does not match); the tier counts
    ///   it as a miss and frees the slot.
    /// - [`DiskError::SlotOutOfRange`], [`DiskError::PayloadSize`], [`DiskError::Io`].
    pub fn read(&self, slot: u64, key: ContentKey, generation: u64, out: &mut [u8]) -> Result<(), DiskError> {
        self.check_slot(slot)?;
        if out.len() as u64 != self.header.payload_bytes {
            return Err(DiskError::PayloadSize { got: out.len() as u64, want: self.header.payload_bytes });
        }
        let mut buf = self.take_staging();
        let result = self
            .transfer(self.header.slot_offset(slot), buf.bytes_mut(), false, "reading a slot")
            .and_then(|()| self.verify_into(slot, key, generation, buf.bytes(), out));
        self.give_staging(buf);
        result
    }

    /// Checks a slot's bytes as read (`stride`, the whole slot) and copies its payload into `out`
    /// only when the block is the one asked for and its checksums hold.
    pub(super) fn verify_into(
        &self,
        slot: u64,
        key: ContentKey,
        generation: u64,
        stride: &[u8],
        out: &mut [u8],
    ) -> Result<(), DiskError> {
        if out.len() as u64 != self.header.payload_bytes {
            return Err(DiskError::PayloadSize { got: out.len() as u64, want: self.header.payload_bytes });
        }
        self.verify(slot, key, generation, stride)?;
        out.copy_from_slice(&stride[..out.len()]);
        Ok(())
    }

    /// The descriptor batched transfers use (`O_DIRECT` in [`IoMode::Direct`]).
    pub(super) fn transfer_fd(&self) -> std::os::fd::RawFd {
        self.primary.as_raw_fd()
    }

    /// Counts one transfer done on [`DiskFile::transfer_fd`].
    pub(super) fn count_transfer(&self) {
        match self.mode {
            IoMode::Direct => self.direct_ops.fetch_add(1, Ordering::Relaxed),
            IoMode::Buffered => self.buffered_ops.fetch_add(1, Ordering::Relaxed),
        };
    }

    pub(super) fn io_error(&self, what: &'static str, source: std::io::Error) -> DiskError {
        io_error(&self.path, what, source)
    }

    fn verify(&self, slot: u64, key: ContentKey, generation: u64, stride: &[u8]) -> Result<(), DiskError> {
        let unverified = |why: String| DiskError::Unverified { slot, key, why };
        let trailer = SlotTrailer::decode(&stride[stride.len() - TRAILER_BYTES..])
            .map_err(|fault| unverified(format!("its trailer is {fault}")))?;
        self.classify(slot, &trailer).map_err(|why| unverified(why.to_string()))?;
        if trailer.key != key || trailer.generation != generation {
            return Err(unverified(format!(
                "it holds {:?} of generation {}, not generation {generation}",
                trailer.key, trailer.generation
            )));
        }
        let payload = &stride[..self.header.payload_bytes as usize];
        if !crate::seeded::seeded("disk-payload-unchecked") && xxh3_64(payload) != trailer.payload_xxh3 {
            return Err(unverified("its payload does not match the trailer's checksum".to_string()));
        }
        Ok(())
    }

    /// Why a sound trailer does not describe a block of this file's slot, if it does not.
    fn classify(&self, slot: u64, trailer: &SlotTrailer) -> Result<(), &'static str> {
        if trailer.namespace != self.header.namespace {
            Err("it belongs to another namespace")
        } else if trailer.slot != slot {
            Err("it was written for another slot")
        } else if trailer.payload_bytes != self.header.payload_bytes {
            Err("its payload size is not the file's")
        } else {
            Ok(())
        }
    }

    /// Reads every slot's trailer (the last page of each slot, not the payloads) and reports the
    /// blocks they name. A block found here is served only after [`DiskFile::read`] verifies it.
    ///
    /// # Errors
    /// [`DiskError::Io`] when a trailer page cannot be read (a slot past the end of a truncated
    /// file included; [`DiskFile::open_or_create`] scans only the slots such a file holds).
    pub fn scan(&self) -> Result<ScanReport, DiskError> {
        self.scan_first(self.header.slots)
    }

    /// The scan of the first `slots` slots.
    fn scan_first(&self, slots: u64) -> Result<ScanReport, DiskError> {
        let mut report = ScanReport::default();
        let mut page = AlignedBuf::new(DISK_PAGE);
        let last_page = self.header.stride - DISK_PAGE as u64;
        for slot in 0..slots {
            let offset = self.header.slot_offset(slot) + last_page;
            self.transfer(offset, page.bytes_mut(), false, "reading a slot trailer")?;
            let bytes = page.bytes();
            match SlotTrailer::decode(&bytes[DISK_PAGE - TRAILER_BYTES..]) {
                Err(FormatFault::Blank) => report.blank += 1,
                Err(_) => report.torn += 1,
                Ok(trailer) => match self.classify(slot, &trailer) {
                    Ok(()) => {
                        report.blocks.push(ScannedBlock { slot, key: trailer.key, generation: trailer.generation })
                    }
                    Err(_) => report.foreign += 1,
                },
            }
        }
        Ok(report)
    }

    /// Clears `slot`'s trailer, so that neither a scan nor a read finds its block again.
    ///
    /// # Errors
    /// [`DiskError::SlotOutOfRange`] or [`DiskError::Io`].
    pub fn clear(&self, slot: u64) -> Result<(), DiskError> {
        self.check_slot(slot)?;
        let mut page = AlignedBuf::new(DISK_PAGE);
        let offset = self.header.slot_offset(slot) + self.header.stride - DISK_PAGE as u64;
        self.transfer(offset, page.bytes_mut(), true, "clearing a slot trailer")
    }
}

//! The SSD tier under the host pool: blocks demoted from host slots to disk slots of preallocated
//! files, promoted back into host slots when a query's prefix continues on disk, and found again
//! after a restart from the files' trailers.
//!
//! ```text
//!   query ── host prefix (pins) ──> miss ──> disk prefix (disk pins) ──> read at depth into fresh
//!                                                                        WRITING host slots, verify,
//!                                                                        READY + the lease's pin
//!   hit / commit ── use count reaches the admission ──> demotion queue ──> demotion thread: pin the
//!                                                    host slot, write the disk slot, mark it clean
//! ```
//!
//! - **Demotion** is write-back off the save path: a block whose use count (its save, then one per
//!   query that leases it) reaches the admission threshold ([`SsdConfig::admit`]) is queued; one thread per tier pins
//!   the host slot, writes it to a disk slot ([`crate::disk`]: payload and checksummed trailer)
//!   and marks the host copy **clean**. A save never waits for it: a full queue drops the
//!   demotion (counted in [`SsdStats::demotions_dropped`]). Host eviction takes clean blocks
//!   before dirty ones (`Core::victim_class`).
//! - **Promotion** happens inside [`crate::HostTier::query`]: where the host prefix ends at a key
//!   the host does not hold, the query pins the run of following keys the SSD tier holds, takes
//!   host slots for them (free first, then eviction, as a save does), reserves them `WRITING`
//!   under their keys (so a save of the same key finds it in flight, and a key a save reserved
//!   first ends the run), reads them at [`SsdConfig::read_depth`] (io_uring), verifies each
//!   block's key, generation and XXH3, and commits the verified leading run `READY` with the
//!   lease's pin already taken. A block that fails verification is dropped, its slot's trailer
//!   cleared on disk (a restart does not find it again), and ends the run: never served. A block
//!   that could not be read (an I/O error) ends the run and stays. The run's disk pins are held by
//!   a guard: a panic anywhere in a promotion releases them.
//! - **Disk slots** ([`directory`]) use the host tier's slot words, free list and index, and an
//!   O(1) recency list for victims.
//! - **Restart**: opening an existing file scans its trailers; every sound block of this namespace
//!   is `READY` again, torn and foreign slots are free. A truncated file keeps the slots it still
//!   holds whole and is extended back to its size.
//! - **Drop**: when the tier's last handle ([`crate::HostTier`] or [`crate::Rank`]) goes, the
//!   demotion thread is stopped and joined before the drop returns; a tier whose configuration
//!   was refused after its files were made removes them.

pub(crate) mod admit;
#[cfg(not(loom))]
pub(crate) mod demote;
pub(crate) mod directory;
pub use directory::{DiskRef, DiskSlots, Recovered};
pub use promote::reserve_promotion;
#[cfg(not(loom))]
pub(crate) mod model;
pub(crate) mod promote;

use crate::disk::{DiskError, DiskFile, DiskFileConfig, IoPreference, ScanReport};
use crate::geometry::Geometry;
use crate::key::ContentKey;
use crate::slab::slot::SlotId;
use crate::tier::core::{Core, LowerTier};
use crate::tier::expiry::LeasedBlock;
use admit::{Admission, SsdAdmit};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One disk slot file of an SSD tier: its path and its size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsdFile {
    /// The file's path; its directory must exist. Created and preallocated (`fallocate`) if
    /// missing; an existing file is reopened and its blocks found again.
    pub path: PathBuf,
    /// Bytes the file may take, header included. It holds
    /// [`Geometry::disk_slots`]`(bytes)` blocks; the file itself is exactly
    /// `4096 + slots * Geometry::disk_slot_bytes()` bytes.
    pub bytes: u64,
}

/// SSD tier options ([`crate::TierConfig::with_ssd`]). Build with [`SsdConfig::new`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SsdConfig {
    /// The disk slot files, at least one (one per drive, to use several drives).
    pub files: Vec<SsdFile>,
    /// Which host blocks are demoted: at a fixed use ([`SsdAdmit::Uses`]: its save is the first
    /// use, each query that leases it one more; 1 demotes every saved block, 2 never writes a
    /// block seen once, which spares the drive's endurance), or after 1 or 2 uses decided online
    /// from the drive's ghost hits ([`SsdAdmit::Auto`]). Default: `Auto`.
    pub admit: SsdAdmit,
    /// Whether the files use `O_DIRECT` (default: where the filesystem takes it).
    pub io: IoPreference,
    /// Reads in flight during a promotion (io_uring queue depth, or `pread` threads). Default 8.
    pub read_depth: usize,
    /// Demotions that may wait for the demotion thread; more are dropped. Default 4,096.
    pub queue_capacity: usize,
}

impl SsdConfig {
    /// One file at `path` of `bytes` bytes, with the default options.
    pub fn new(path: impl Into<PathBuf>, bytes: u64) -> Self {
        SsdConfig {
            files: vec![SsdFile { path: path.into(), bytes }],
            admit: SsdAdmit::default(),
            io: IoPreference::Direct,
            read_depth: 8,
            queue_capacity: 4096,
        }
    }

    /// Adds another file (another drive).
    pub fn with_file(mut self, path: impl Into<PathBuf>, bytes: u64) -> Self {
        self.files.push(SsdFile { path: path.into(), bytes });
        self
    }

    /// Sets the uses a block needs before it is demoted ([`SsdAdmit::Uses`], see
    /// [`SsdConfig::admit`]); 0 is refused when the tier is built.
    pub fn with_admit_uses(mut self, uses: u32) -> Self {
        self.admit = SsdAdmit::Uses(uses);
        self
    }

    /// Sets how blocks are admitted to the drive (see [`SsdConfig::admit`]).
    pub fn with_admit(mut self, admit: SsdAdmit) -> Self {
        self.admit = admit;
        self
    }

    /// Sets how the files do their transfers.
    pub fn with_io(mut self, io: IoPreference) -> Self {
        self.io = io;
        self
    }

    /// Sets the reads in flight during a promotion.
    pub fn with_read_depth(mut self, depth: usize) -> Self {
        self.read_depth = depth;
        self
    }
}

/// What an SSD tier holds and has done ([`crate::HostTier::ssd_stats`]). Counts are blocks unless
/// named bytes. It travels on the daemon's wire field for field (`WireSsdStats`, the `SsdStats`
/// reply of the daemon protocol): a change to its fields is a protocol change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct SsdStats {
    /// Disk slots over every file.
    pub capacity: u64,
    /// Blocks on disk now.
    pub blocks: u64,
    /// Blocks found again by the trailer scans when the files were opened.
    pub recovered_blocks: u64,
    /// Slots the scans found torn or corrupted, or past the end of a truncated file (now free).
    pub recovered_torn: u64,
    /// Slots the scans found holding another namespace's or another slot's block (now free).
    pub recovered_foreign: u64,
    /// Host blocks written to disk.
    pub demoted_blocks: u64,
    /// Bytes written by demotions (payloads).
    pub bytes_demoted: u64,
    /// Queued demotions not done: the block was evicted or already on disk.
    pub demotions_skipped: u64,
    /// Demotions not queued because the queue was full (a save never waits for the SSD).
    pub demotions_dropped: u64,
    /// Demotions whose write failed (an I/O error); the block stays on the host only.
    pub demotion_failures: u64,
    /// Demotions still queued or being written.
    pub demotions_pending: u64,
    /// Blocks read back into host slots by queries.
    pub promoted_blocks: u64,
    /// Bytes read by promotions (payloads).
    pub bytes_promoted: u64,
    /// Blocks a promotion found unverified (checksum, key or generation: never served, dropped and
    /// cleared on disk), and reads that failed where a promotion's run stopped (an I/O error: the
    /// block stays on disk).
    pub promotion_failures: u64,
    /// Disk blocks evicted to make room for demotions.
    pub disk_evictions: u64,
    /// Transfers done with `O_DIRECT`.
    pub io_direct: u64,
    /// Transfers done through the page cache (the filesystem refused `O_DIRECT`, or buffered I/O
    /// was asked for).
    pub io_buffered: u64,
}

#[derive(Default)]
struct SsdCounters {
    demoted_blocks: AtomicU64,
    bytes_demoted: AtomicU64,
    demotions_skipped: AtomicU64,
    demotions_dropped: AtomicU64,
    demotion_failures: AtomicU64,
    promoted_blocks: AtomicU64,
    bytes_promoted: AtomicU64,
    promotion_failures: AtomicU64,
    disk_evictions: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A queued demotion: the host block (slot and generation) and its key.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Job {
    pub(crate) slot: SlotId,
    pub(crate) generation: u64,
    pub(crate) key: ContentKey,
}

impl Job {
    /// A demotion of the block of `key` in host `slot` at `generation`.
    pub fn new(slot: SlotId, generation: u64, key: ContentKey) -> Self {
        Job { slot, generation, key }
    }
}

/// A demotion's pin on its host block ([`pin_for_demotion`]); dropping it unpins.
#[derive(Debug)]
pub struct HostPin<'a> {
    core: &'a Core,
    slot: SlotId,
    pinned: bool,
}

impl Drop for HostPin<'_> {
    fn drop(&mut self) {
        if self.pinned {
            self.core.unpin(self.slot);
        }
    }
}

/// Pins the host block `job` names if it is still that block (`READY` at the job's generation,
/// holding its key), so it can be neither evicted nor rewritten while the demotion reads it.
/// `None` if it was evicted (or replaced) since it was queued.
pub fn pin_for_demotion<'a>(core: &'a Core, job: &Job) -> Option<HostPin<'a>> {
    // Seeded bug (model checking only): the block is checked, not pinned, so an evictor may take
    // and reuse the slot under the demotion's read.
    if crate::seeded::seeded("demotion-unpinned") {
        let w = core.control().load(job.slot);
        let ready = w.state() == crate::slab::slot::SlotState::Ready && w.generation() == job.generation;
        return (ready && core.slot_key(job.slot) == job.key).then_some(HostPin {
            core,
            slot: job.slot,
            pinned: false,
        });
    }
    core.pin(job.slot, job.generation).ok()?;
    let pin = HostPin { core, slot: job.slot, pinned: true };
    (core.slot_key(job.slot) == job.key).then_some(pin)
}

/// Takes a disk slot of `slots` for the block of `key` ([`DiskSlots::take`]) and tells `admission`
/// of the block evicted for it, if any: the demotion thread's step, and [`model::SsdModel`]'s.
#[cfg_attr(loom, allow(dead_code))]
pub(crate) fn take_disk_slot(
    slots: &DiskSlots,
    admission: &Admission,
    key: &ContentKey,
) -> Option<(DiskRef, Option<ContentKey>)> {
    let taken = slots.take(key)?;
    if let Some(old) = &taken.1 {
        admission.on_eviction(old);
    }
    Some(taken)
}

#[derive(Default)]
pub(crate) struct QueueState {
    pub(crate) jobs: VecDeque<Job>,
    /// The demotion thread is writing a job it popped.
    pub(crate) busy: bool,
    pub(crate) stop: bool,
}

/// The demotion queue, shared by the tier and its demotion thread (which holds no reference to
/// the tier while it waits, so a dropped tier is freed).
#[derive(Default)]
pub(crate) struct DemotionQueue {
    pub(crate) state: Mutex<QueueState>,
    /// Signalled when a job is queued or the tier stops.
    pub(crate) wake: Condvar,
    /// Signalled when the queue becomes empty and the thread idle.
    pub(crate) idle: Condvar,
}

/// Which host blocks have a copy on the drive ("clean"): per host slot, `generation + 1` of its
/// block if that block has a disk copy, else 0. The SSD tier's (and [`model::SsdModel`]'s): the
/// core ranks clean host blocks before dirty ones as victims ([`LowerTier::is_clean`]).
pub(crate) struct CleanMarks(Box<[AtomicU64]>);

impl CleanMarks {
    /// Marks for a host pool of `host_slots` slots, none clean.
    pub(crate) fn new(host_slots: u32) -> Self {
        CleanMarks(crate::sync::table(host_slots as usize, |_| AtomicU64::new(0)))
    }

    /// True if the block of host `slot` at `generation` has a disk copy.
    pub(crate) fn is_clean(&self, slot: SlotId, generation: u64) -> bool {
        self.0[slot.index()].load(Ordering::Acquire) == generation + 1
    }

    /// Records that the block of host `slot` at `generation` has a disk copy.
    pub(crate) fn mark(&self, slot: SlotId, generation: u64) {
        self.0[slot.index()].store(generation + 1, Ordering::Release);
    }

    /// Host `slot` holds a new block, without a disk copy.
    pub(crate) fn clear(&self, slot: SlotId) {
        self.0[slot.index()].store(0, Ordering::Release);
    }

    /// The disk copy of `key` was evicted: if the host holds `key`, its block is dirty again.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn forget(&self, core: &Core, key: &ContentKey) {
        if let Some(r) = core.index().get(key) {
            let _ = self.0[r.slot.index()].compare_exchange(r.generation + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}

/// An SSD tier: its files, its disk slots, the host blocks' use counts and clean marks, and the
/// demotion queue. Held by the host tier's core.
pub(crate) struct SsdTier {
    files: Vec<DiskFile>,
    /// The first global disk slot of each file.
    starts: Vec<u32>,
    pub(crate) slots: DiskSlots,
    pub(crate) admission: Admission,
    read_depth: usize,
    queue_capacity: usize,
    payload_bytes: u64,
    /// Uses of the block in each host slot (its save, then one per lease of it).
    host_uses: Box<[AtomicU32]>,
    /// Which host blocks have a disk copy.
    host_clean: CleanMarks,
    pub(crate) queue: Arc<DemotionQueue>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The files [`SsdTier::open`] created. Removed again when the tier is dropped before
    /// [`SsdTier::keep_files`] (the configuration was refused after they were made).
    created: Vec<PathBuf>,
    /// The tier was built whole: its files stay when it is dropped.
    keep: std::sync::atomic::AtomicBool,
    counters: SsdCounters,
    /// Blocks the trailer scans found again.
    recovered_blocks: u64,
    /// What the trailer scans found (`blocks` left empty).
    scan: ScanReport,
}

impl SsdTier {
    /// Opens (or creates) every file of `config` for blocks of `geometry` and rebuilds the disk
    /// index from their trailers; `host_slots` is the host pool's capacity.
    ///
    /// # Errors
    /// [`DiskError::BadConfig`] for no file, a file too small for one block, more than
    /// `u32::MAX - 1` disk slots in all, an admission after 0 uses, `read_depth` or `queue_capacity` of 0 (or a
    /// depth over 1,024); the errors of [`DiskFile::open_or_create`] (no space, a file of another
    /// geometry or namespace, not a kvtier file, I/O).
    pub(crate) fn open(config: &SsdConfig, geometry: &Geometry, host_slots: u32) -> Result<Self, DiskError> {
        if config.files.is_empty() {
            return Err(DiskError::BadConfig("an SSD tier needs at least one file".into()));
        }
        if config.admit == SsdAdmit::Uses(0) || config.queue_capacity == 0 || !(1..=1024).contains(&config.read_depth) {
            return Err(DiskError::BadConfig(format!(
                "admit_uses ({}) and queue_capacity ({}) must be at least 1 and read_depth ({}) 1 to 1,024",
                config.admit, config.queue_capacity, config.read_depth
            )));
        }
        let payload_bytes = geometry.slot_bytes();
        let mut files = Vec::with_capacity(config.files.len());
        let mut starts = Vec::with_capacity(config.files.len());
        let mut recovered = Vec::new();
        let mut scan = ScanReport::default();
        let mut total: u64 = 0;
        // Every size is checked before any file is made, so a refused configuration leaves nothing.
        let mut sizes = Vec::with_capacity(config.files.len());
        for f in &config.files {
            let slots = geometry.disk_slots(f.bytes);
            if slots == 0 {
                return Err(DiskError::BadConfig(format!(
                    "{}: {} B holds no block of {} B (a 4096 B header, then slots of {} B)",
                    f.path.display(),
                    f.bytes,
                    payload_bytes,
                    geometry.disk_slot_bytes()
                )));
            }
            if total + slots >= u64::from(u32::MAX) {
                return Err(DiskError::BadConfig(format!(
                    "the SSD tier's files hold {} disk slots; at most {} are supported",
                    total + slots,
                    u32::MAX - 1
                )));
            }
            sizes.push(slots);
            total += slots;
        }
        total = 0;
        // Files this call creates are removed again if a later one is refused.
        let mut created: Vec<PathBuf> = Vec::new();
        for (f, &slots) in config.files.iter().zip(&sizes) {
            let cfg = DiskFileConfig {
                path: f.path.clone(),
                namespace: geometry.namespace(),
                payload_bytes,
                slots,
                io: config.io,
            };
            let existed = f.path.try_exists().unwrap_or(true);
            let (file, report) = match DiskFile::open_or_create(&cfg) {
                Ok(opened) => opened,
                Err(e) => {
                    drop(files);
                    for path in &created {
                        let _ = std::fs::remove_file(path);
                    }
                    return Err(e);
                }
            };
            if !existed {
                created.push(f.path.clone());
            }
            for b in &report.blocks {
                recovered.push(Recovered { slot: (total + b.slot) as u32, key: b.key, file_generation: b.generation });
            }
            scan.blank += report.blank;
            scan.torn += report.torn;
            scan.foreign += report.foreign;
            scan.truncated += report.truncated;
            starts.push(total as u32);
            files.push(file);
            total += slots;
        }
        // Seeded bug (tests only): a reopened tier forgets what its files hold.
        if crate::seeded::seeded("ssd-restart-forgets") {
            recovered.clear();
        }
        let (slots, duplicates) = DiskSlots::new(total as u32, &recovered);
        scan.foreign += duplicates as u64;
        let recovered_blocks = slots.len() as u64;
        Ok(SsdTier {
            files,
            starts,
            slots,
            admission: Admission::new(config.admit, total as u32),
            read_depth: config.read_depth,
            queue_capacity: config.queue_capacity,
            payload_bytes,
            host_uses: crate::sync::table(host_slots as usize, |_| AtomicU32::new(0)),
            host_clean: CleanMarks::new(host_slots),
            queue: Arc::new(DemotionQueue::default()),
            worker: Mutex::new(None),
            created,
            keep: std::sync::atomic::AtomicBool::new(false),
            counters: SsdCounters::default(),
            recovered_blocks,
            scan,
        })
    }

    /// The file holding global disk slot `slot`, and the slot's number in it.
    pub(crate) fn locate(&self, slot: u32) -> (&DiskFile, u64) {
        let i = self.file_of(slot);
        (&self.files[i], u64::from(slot - self.starts[i]))
    }

    /// Index of the file holding global disk slot `slot`.
    pub(crate) fn file_of(&self, slot: u32) -> usize {
        self.starts.partition_point(|&s| s <= slot) - 1
    }

    pub(crate) fn file(&self, i: usize) -> &DiskFile {
        &self.files[i]
    }

    /// Bytes of one block.
    pub(crate) fn payload_bytes(&self) -> u64 {
        self.payload_bytes
    }

    pub(crate) fn read_depth(&self) -> usize {
        self.read_depth
    }

    /// True if the block of host `slot` at `generation` has a disk copy.
    pub(crate) fn is_clean(&self, slot: SlotId, generation: u64) -> bool {
        self.host_clean.is_clean(slot, generation)
    }

    /// Records that the block of host `slot` at `generation` has a disk copy.
    pub(crate) fn mark_clean(&self, slot: SlotId, generation: u64) {
        self.host_clean.mark(slot, generation);
    }

    /// The host slot `slot` was reserved for a new block: its use count is 1 (the save), and it
    /// has no disk copy yet.
    pub(crate) fn on_reserve(&self, slot: SlotId) {
        self.host_uses[slot.index()].store(1, Ordering::Relaxed);
        self.host_clean.clear(slot);
    }

    /// A host block became `READY` (a save, not a promotion): queued for demotion if its uses (1,
    /// or 2 for a key the admission saw saved lately) admit it.
    pub(crate) fn on_commit(&self, slot: SlotId, generation: u64, key: ContentKey) {
        let mut uses = 1;
        if self.admission.on_save(&key) > 1 {
            // A key the host saved lately is on its second use (the count of this stay follows).
            uses = self.host_uses[slot.index()].fetch_add(1, Ordering::Relaxed).saturating_add(1);
        }
        if self.admission.admits_save(uses) && !self.is_clean(slot, generation) {
            self.enqueue(Job { slot, generation, key });
        }
    }

    /// A query leased the host block: one more use; queued for demotion when the uses reach
    /// the admission threshold ([`SsdConfig::admit`]).
    pub(crate) fn on_hit(&self, slot: SlotId, generation: u64, key: ContentKey) {
        let uses = self.host_uses[slot.index()].fetch_add(1, Ordering::Relaxed).saturating_add(1);
        // Seeded bug (tests only): every use admits a block, not the threshold-th.
        let admitted =
            if crate::seeded::seeded("ssd-admits-every-use") { uses >= 1 } else { self.admission.admits(uses) };
        if admitted && !self.is_clean(slot, generation) {
            self.enqueue(Job { slot, generation, key });
        }
    }

    fn enqueue(&self, job: Job) {
        let mut q = lock(&self.queue.state);
        if q.jobs.len() >= self.queue_capacity {
            bump(&self.counters.demotions_dropped, 1);
            return;
        }
        q.jobs.push_back(job);
        drop(q);
        self.queue.wake.notify_one();
    }

    /// Blocks until every queued demotion is written (or skipped, or failed).
    pub(crate) fn flush(&self) {
        let mut q = lock(&self.queue.state);
        while (!q.jobs.is_empty() || q.busy) && !q.stop {
            q = self.queue.idle.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn set_worker(&self, handle: std::thread::JoinHandle<()>) {
        *lock(&self.worker) = Some(handle);
    }

    /// Stops the demotion thread and waits for it to end: the job it is writing is finished (a
    /// reference to the core it holds is dropped with it), the queued ones are abandoned. Called
    /// when the tier's last handle goes (`TierHandle`) and when the tier is dropped; a no-op the
    /// second time, and on the demotion thread itself.
    pub(crate) fn stop_worker(&self) {
        lock(&self.queue.state).stop = true;
        self.queue.wake.notify_all();
        self.queue.idle.notify_all();
        let mut worker = lock(&self.worker);
        if worker.as_ref().is_some_and(|h| h.thread().id() == std::thread::current().id()) {
            // The demotion thread dropping the tier (it held the last reference for a job): it
            // exits on its own once it sees `stop`.
            return;
        }
        if let Some(handle) = worker.take() {
            drop(worker);
            let _ = handle.join();
        }
    }

    /// The tier was built whole ([`crate::HostTier::new`]): the files it created stay when it is
    /// dropped. Until then a drop removes them (a configuration refused after they were made
    /// leaves nothing).
    pub(crate) fn keep_files(&self) {
        self.keep.store(true, Ordering::Release);
    }

    /// A snapshot of the counters.
    pub(crate) fn stats(&self) -> SsdStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (direct, buffered) = self.files.iter().fold((0, 0), |(d, b), f| {
            let n = f.io_counts();
            (d + n.direct, b + n.buffered)
        });
        let pending = {
            let q = lock(&self.queue.state);
            q.jobs.len() as u64 + u64::from(q.busy)
        };
        SsdStats {
            capacity: u64::from(self.slots.capacity()),
            blocks: self.slots.len() as u64,
            recovered_blocks: self.recovered_blocks,
            recovered_torn: self.scan.torn,
            recovered_foreign: self.scan.foreign,
            demoted_blocks: get(&c.demoted_blocks),
            bytes_demoted: get(&c.bytes_demoted),
            demotions_skipped: get(&c.demotions_skipped),
            demotions_dropped: get(&c.demotions_dropped),
            demotion_failures: get(&c.demotion_failures),
            demotions_pending: pending,
            promoted_blocks: get(&c.promoted_blocks),
            bytes_promoted: get(&c.bytes_promoted),
            promotion_failures: get(&c.promotion_failures),
            disk_evictions: get(&c.disk_evictions),
            io_direct: direct,
            io_buffered: buffered,
        }
    }
}

impl SsdTier {
    /// The SSD tier under `core`'s pool, if it has one.
    pub(crate) fn of(core: &Core) -> Option<&SsdTier> {
        core.ssd().and_then(|l| l.as_any().downcast_ref::<SsdTier>())
    }
}

impl LowerTier for SsdTier {
    fn on_reserve(&self, slot: SlotId) {
        SsdTier::on_reserve(self, slot)
    }
    fn on_commit(&self, slot: SlotId, generation: u64, key: ContentKey) {
        SsdTier::on_commit(self, slot, generation, key)
    }
    fn on_hit(&self, slot: SlotId, generation: u64, key: ContentKey) {
        SsdTier::on_hit(self, slot, generation, key)
    }
    fn is_clean(&self, slot: SlotId, generation: u64) -> bool {
        SsdTier::is_clean(self, slot, generation)
    }
    fn promote(&self, core: &crate::sync::Arc<Core>, keys: &[ContentKey], blocks: &mut Vec<LeasedBlock>) -> usize {
        SsdTier::promote(self, core, keys, blocks)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for SsdTier {
    fn drop(&mut self) {
        self.stop_worker();
        // Seeded bug (tests only): a refused configuration leaves the files it made.
        if !self.keep.load(Ordering::Acquire) && !crate::seeded::seeded("ssd-refusal-leaves-file") {
            // Closed (and unlocked) first, then removed.
            self.files.clear();
            for path in &self.created {
                if let Err(e) = std::fs::remove_file(path) {
                    tracing::warn!(error = %e, path = %path.display(), "an SSD tier file made for a refused configuration could not be removed");
                }
            }
        }
    }
}

impl std::fmt::Debug for SsdTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdTier").field("files", &self.files).field("slots", &self.slots.capacity()).finish()
    }
}

impl SsdTier {
    /// The disk copy of `key` was evicted: if the host holds `key`, its block is dirty again.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn forget_clean(&self, core: &Core, key: &ContentKey) {
        self.host_clean.forget(core, key);
    }

    pub(crate) fn count_promoted(&self, blocks: u64) {
        bump(&self.counters.promoted_blocks, blocks);
        bump(&self.counters.bytes_promoted, blocks * self.payload_bytes);
    }

    pub(crate) fn count_promotion_failure(&self) {
        bump(&self.counters.promotion_failures, 1);
    }
}

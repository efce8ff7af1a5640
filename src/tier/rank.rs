//! [`Rank`]: one engine rank's saves and restores through its copy backend, its completion threads
//! and its in-flight accounting.
//!
//! Each rank runs two completion threads (save, restore). They wait on the backend's completions in
//! submission order and *settle* each copy: commit or abort a save's reservation, drop a restore's
//! pins; then they record the counters and complete the handle. A backend that **panics** while
//! submitting a copy (`CopyBackend::save` / `restore`, which may have queued it) or while waiting
//! for it leaves the copy's outcome unknown: the caller gets (or the handle fails with)
//! [`CopyError::BackendPanicked`], the completion thread survives, and the copy's host slots are
//! quarantined (a save's slots stay `WRITING`, a restore's pins are kept; never reused, since the
//! copy may still be running) instead of being freed. No unwind between submission and completion
//! releases a slot or a pin: a submitted job dropped unfinished quarantines too.

use super::config::SaveOptions;
use super::Flavor;
use crate::copy::layers::copy_layers;
use crate::copy::{Completion, CopyBackend, CopyPair, Direction, WaitFor};
use crate::error::{CopyError, TierError};
use crate::key::{ContentKey, Namespace};
use crate::sync::{Arc, AtomicU64, Ordering};
use crate::tier::handle::{CopyHandle, HandleShared};
use crate::tier::lease::{Lease, LeaseOf};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub(crate) mod layers;
use layers::Launch;

/// What a save did.
#[derive(Debug)]
#[non_exhaustive]
#[must_use = "a save ticket holds the copy's handle: the GPU pages may not be rewritten before it completes"]
pub struct SaveTicket {
    /// Indices (into the keys given) of the blocks being copied, in order.
    pub saving: Vec<usize>,
    /// Keys already resident: nothing copied, recency refreshed.
    pub resident: usize,
    /// Keys another save holds (its copy is in flight): nothing copied.
    pub in_flight: usize,
    /// Keys repeated within this save: copied once.
    pub duplicates: usize,
    /// Missing keys not saved because they did not fit or the policy did not admit them (or one
    /// before them) ([`crate::Fit::Prefix`] only).
    pub dropped: usize,
    /// Completes when the copied blocks are committed and visible to queries.
    pub handle: CopyHandle,
}

/// How a copy ended, as its completion thread saw it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum CopyOutcome {
    /// The copy completed.
    Done,
    /// The copy failed; it is over.
    Failed,
    /// The backend panicked while waiting: the copy may still be running.
    Unknown,
    /// The backend panicked while submitting: it may have queued the copy (its slots and pins are
    /// quarantined as for [`CopyOutcome::Unknown`]), but the call failed, so a restore's lease use
    /// comes back (as for any backend error).
    SubmitPanicked,
}

/// Finalises a copy once its outcome is known, given its queue-to-completion time when the copy
/// ended ([`CopyOutcome::Done`], [`CopyOutcome::Failed`]). An error (a remote tier that could not
/// tell its daemon) fails the copy's handle even though the copy itself completed.
pub(crate) type Settle = Box<dyn FnOnce(CopyOutcome, Option<Duration>) -> Result<(), TierError> + Send>;

/// A submitted copy, until its completion thread has settled it. Once the backend has accepted a
/// copy, only [`Job::finish`] may release its slots: a job dropped unfinished (an unwind between
/// submission and completion, a channel that refused it) **quarantines** them instead
/// (`CopyOutcome::Unknown`) and never drops the completion, which may own buffers the copy uses.
///
/// A job dropped unfinished also completes its handle (`CopyError::BackendPanicked`) and leaves the
/// rank's in-flight accounting, so no waiter, `drain` or `close` waits for a copy nobody will finish.
struct Job {
    completion: Option<Box<dyn Completion>>,
    settle: Option<Settle>,
    dir: Direction,
    blocks: u64,
    bytes: u64,
    handle: std::sync::Arc<HandleShared>,
    /// The rank's in-flight accounting, which counts this job from its creation ([`Job::new`]).
    inflight: std::sync::Arc<InFlight>,
    /// When the copy was submitted: its queue-to-completion time (the copy latency histogram, the
    /// debug span) is measured from here to the backend's completion.
    submitted: Instant,
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(settle) = self.settle.take() {
            // Seeded bug (tests only): the old behaviour, an unwind drops the reservation or the
            // pins (frees the slots under a copy that may still run).
            if crate::seeded::seeded("submit-panic-releases") {
                drop(settle);
                return;
            }
            {
                tracing::error!(
                    "a submitted {:?} of {} blocks was dropped unfinished; its host slots are quarantined",
                    self.dir,
                    self.blocks
                );
                let _ = catch_unwind(AssertUnwindSafe(|| settle(CopyOutcome::Unknown, None)));
                if let Some(c) = self.completion.take() {
                    std::mem::forget(c);
                }
                // Seeded bug (tests only): the old behaviour, the handle and the load left as
                // they were, so its waiters and the rank's drain wait for ever.
                if crate::seeded::seeded("job-drop-leaves-waiters") {
                    return;
                }
                self.inflight.load(self.dir).fetch_sub(self.blocks, Ordering::Relaxed);
                self.inflight.end();
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    self.handle.complete(&Err(TierError::Copy(CopyError::BackendPanicked)))
                }));
            }
        }
    }
}

impl Job {
    /// A job for a submitted copy; it counts in the rank's in-flight accounting until it is
    /// finished or dropped.
    fn new(
        completion: Box<dyn Completion>,
        settle: Settle,
        dir: Direction,
        blocks: u64,
        bytes: u64,
        handle: std::sync::Arc<HandleShared>,
        inflight: &std::sync::Arc<InFlight>,
    ) -> Job {
        inflight.load(dir).fetch_add(blocks, Ordering::Relaxed);
        inflight.begin();
        Job {
            completion: Some(completion),
            settle: Some(settle),
            dir,
            blocks,
            bytes,
            handle,
            inflight: inflight.clone(),
            submitted: Instant::now(),
        }
    }

    /// Waits for the copy and settles it (on a completion thread, or on the submitting thread
    /// when the completion threads are gone).
    fn finish(mut self, tier: &Flavor, inflight: &InFlight) {
        let (dir, blocks, bytes, handle) = (self.dir, self.blocks, self.bytes, self.handle.clone());
        let span = tracing::debug_span!(
            "copy",
            dir = ?dir,
            blocks,
            bytes,
            outcome = tracing::field::Empty,
            seconds = tracing::field::Empty
        );
        let _entered = span.enter();
        let submitted = self.submitted;
        let mut completion = self.completion.take().expect("a job's completion is taken once");
        let waited = catch_unwind(AssertUnwindSafe(|| completion.wait()));
        // Queue to completion: from the submission to the backend's answer.
        let latency = submitted.elapsed();
        let mut completed = false;
        let result = match waited {
            Ok(r) => {
                let settle = self.settle.take().expect("a job is settled once");
                let outcome = if r.is_ok() { CopyOutcome::Done } else { CopyOutcome::Failed };
                // A panic while settling must not end this thread: the job's handle completes
                // (BackendPanicked) and the queued jobs behind it are still finished.
                let settled = catch_unwind(AssertUnwindSafe(|| settle(outcome, Some(latency)))).unwrap_or_else(|_| {
                    tracing::error!("settling a {dir:?} of {blocks} blocks panicked; the panic was contained");
                    Err(TierError::Copy(CopyError::BackendPanicked))
                });
                if let Err(e) = &r {
                    let _ = catch_unwind(AssertUnwindSafe(|| tracing::warn!("{dir:?} of {blocks} blocks failed: {e}")));
                }
                // A backend whose completion panics on drop must not stop this thread either.
                if catch_unwind(AssertUnwindSafe(move || drop(completion))).is_err() {
                    tracing::error!("a {dir:?} completion panicked when dropped; the panic was contained");
                }
                completed = r.is_ok();
                r.map_err(TierError::Copy).and(settled)
            }
            Err(_) => {
                tracing::error!(
                    "the copy backend panicked while waiting for a {dir:?} of {blocks} blocks; \
                     its host slots are quarantined"
                );
                if let Some(settle) = self.settle.take() {
                    // Seeded bug (tests only): `wait-panic-releases` settles the copy as failed
                    // (its slots freed, its pins dropped) although it may still be running.
                    let outcome = if crate::seeded::seeded("wait-panic-releases") {
                        CopyOutcome::Failed
                    } else {
                        CopyOutcome::Unknown
                    };
                    let _ = settle(outcome, None);
                }
                // It may own buffers the copy still uses: never drop it.
                std::mem::forget(completion);
                Err(TierError::Copy(CopyError::BackendPanicked))
            }
        };
        drop(self);
        span.record("outcome", if result.is_ok() { "done" } else { "failed" });
        span.record("seconds", latency.as_secs_f64());
        tracing::debug!("settled");
        tier.record_copy(dir, blocks, bytes, result.is_ok(), completed.then_some(latency));
        inflight.load(dir).fetch_sub(blocks, Ordering::Relaxed);
        // The batch leaves the rank's load before its handle completes, so a caller woken by the
        // handle sees `Rank::load` without it.
        inflight.end();
        handle.complete(&result);
    }
}

/// In-flight accounting of one rank.
#[derive(Default)]
struct InFlight {
    save_gpu_pages: AtomicU64,
    restore_slots: AtomicU64,
    batches: std::sync::Mutex<u64>,
    idle: std::sync::Condvar,
}

impl InFlight {
    /// GPU pages read by saves (save) or host slots pinned by restores (restore) in flight.
    fn load(&self, dir: Direction) -> &AtomicU64 {
        match dir {
            Direction::Save => &self.save_gpu_pages,
            Direction::Restore => &self.restore_slots,
        }
    }
    fn begin(&self) {
        *lock_std(&self.batches) += 1;
    }
    fn end(&self) {
        let mut b = lock_std(&self.batches);
        *b -= 1;
        if *b == 0 {
            self.idle.notify_all();
        }
    }
}

/// Live load of one rank, for admission control.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct RankLoad {
    /// GPU pages read by saves in flight: they must not be reused until their save completes.
    pub save_gpu_pages: u64,
    /// Host slots pinned by this rank's restores in flight.
    pub restore_slots: u64,
    /// Batches in flight (saves and restores).
    pub batches: u64,
}

/// One rank's handle: saves and restores through its copy backend. Dropping it drains its in-flight
/// copies first (blocking); use [`Rank::shutdown`] for a deadline.
pub struct Rank {
    /// The tier this rank copies for (its pool mapping, geometry and counters).
    pub(super) tier: Flavor,
    backend: std::sync::Arc<dyn CopyBackend>,
    id: u32,
    save_tx: std::sync::Mutex<Option<mpsc::Sender<Job>>>,
    restore_tx: std::sync::Mutex<Option<mpsc::Sender<Job>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    inflight: std::sync::Arc<InFlight>,
}

impl Rank {
    pub(super) fn start(tier: Flavor, backend: std::sync::Arc<dyn CopyBackend>, id: u32) -> Self {
        let inflight = std::sync::Arc::new(InFlight::default());
        let mut threads = Vec::new();
        let mut spawn = |what: &str| {
            let (tx, rx) = mpsc::channel::<Job>();
            let (inf, tier) = (inflight.clone(), tier.clone());
            let t = std::thread::Builder::new()
                .name(format!("kvtier-r{id}-{what}"))
                .spawn(move || {
                    // Completions of one direction finish in submission order (one stream each).
                    while let Ok(job) = rx.recv() {
                        if crate::seeded::seeded("waker-panic-kills-completion") {
                            job.finish(&tier, &inf);
                            continue;
                        }
                        // A backstop: nothing in `finish` may end the thread that later jobs wait on.
                        if catch_unwind(AssertUnwindSafe(|| job.finish(&tier, &inf))).is_err() {
                            tracing::error!("finishing a copy panicked; the completion thread goes on");
                        }
                    }
                })
                .expect("spawning a completion thread");
            threads.push(t);
            tx
        };
        let save_tx = spawn("save");
        let restore_tx = spawn("restore");
        Rank {
            tier,
            backend,
            id,
            save_tx: std::sync::Mutex::new(Some(save_tx)),
            restore_tx: std::sync::Mutex::new(Some(restore_tx)),
            threads,
            inflight,
        }
    }

    /// This rank's id (attach order, from 0).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The namespace of this rank's keys (its geometry's, which includes its tensor-parallel shard).
    pub fn namespace(&self) -> Namespace {
        self.backend.geometry().namespace()
    }

    /// GPU pages of the backend's arenas (the page ids a save or restore may name are below it).
    pub(crate) fn gpu_pages(&self) -> u64 {
        self.backend.geometry().pages()
    }

    /// The copy backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// What this rank has in flight now.
    pub fn load(&self) -> RankLoad {
        RankLoad {
            save_gpu_pages: self.inflight.save_gpu_pages.load(Ordering::Relaxed),
            restore_slots: self.inflight.restore_slots.load(Ordering::Relaxed),
            batches: *lock_std(&self.inflight.batches),
        }
    }

    fn check_open(&self) -> Result<(), TierError> {
        if self.tier.is_shutting_down() {
            Err(TierError::ShuttingDown)
        } else {
            Ok(())
        }
    }

    /// Submits `batch` to the backend in direction `dir` and queues its completion: when the copy
    /// has finished, the completion thread runs `settle` with the outcome (commit, abort or
    /// quarantine a save's reservation; drop or quarantine a restore's pins), records the counters
    /// and this rank's load, then completes the handle. If the submission fails, `settle` is
    /// dropped uncalled (a reservation then aborts, pins unpin: nothing was copied).
    ///
    /// # Safety
    /// The backend contract for `batch` ([`CopyBackend`]): `settle` must own the slots' reservation
    /// (save) or pins (restore), and the caller must own the GPU pages until the handle completes.
    pub(crate) unsafe fn launch(
        &self,
        dir: Direction,
        batch: &[CopyPair],
        how: Launch<'_>,
        settle: Settle,
    ) -> Result<CopyHandle, TierError> {
        let blocks = batch.len() as u64;
        let bytes = blocks * self.tier.geometry().block_bytes();
        let (wait, groups) = match how {
            Launch::Whole(wait) => (Some(wait), None),
            Launch::Layers(groups, waits) => (None, Some((groups, waits))),
        };
        // SAFETY: forwarded: the caller upholds the backend contract for `batch`.
        let submitted = catch_unwind(AssertUnwindSafe(|| unsafe {
            match (&groups, dir) {
                (Some((g, waits)), _) => copy_layers(&*self.backend, dir, batch, g, waits),
                (None, Direction::Save) => self.backend.save(batch, wait.unwrap_or(WaitFor::Nothing)),
                (None, Direction::Restore) => self.backend.restore(batch, wait.unwrap_or(WaitFor::Nothing)),
            }
        }));
        let completion = match submitted {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                self.tier.record_copy(dir, blocks, 0, false, None);
                return Err(e.into());
            }
            Err(panic) => {
                // The backend may have queued the copy before it panicked: its outcome is unknown,
                // so the slots are quarantined, never released (an unwind frees nothing).
                if crate::seeded::seeded("submit-panic-releases") {
                    std::panic::resume_unwind(panic);
                }
                {
                    drop(panic);
                    tracing::error!(
                        "the copy backend panicked submitting a {dir:?} of {blocks} blocks; its host slots are quarantined"
                    );
                    let _ = catch_unwind(AssertUnwindSafe(|| settle(CopyOutcome::SubmitPanicked, None)));
                    self.tier.record_copy(dir, blocks, 0, false, None);
                    return Err(TierError::Copy(CopyError::BackendPanicked));
                }
            }
        };
        // From here on the copy is submitted: `job` owns the settle step, and an unwind that drops
        // it unfinished quarantines the slots (see [`Job`]).
        let shared = catch_unwind(AssertUnwindSafe(|| completion.shared_event())).unwrap_or(None);
        let layers = match groups {
            Some((g, _)) => catch_unwind(AssertUnwindSafe(|| completion.layer_readiness()))
                .unwrap_or(None)
                .map(|r| (std::sync::Arc::new(g), r)),
            None => None,
        };
        let handle = HandleShared::with_layers(batch.len(), bytes, shared, layers);
        let job = Job::new(completion, settle, dir, blocks, bytes, handle.clone(), &self.inflight);
        let tx = if dir == Direction::Restore { &self.restore_tx } else { &self.save_tx };
        let sent = match lock_std(tx).as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        };
        if let Err(job) = sent {
            // The completion threads are gone (shutdown raced us): finish on this thread; the copy
            // was submitted, so it is waited for before anything is released.
            job.finish(&self.tier, &self.inflight);
        }
        Ok(CopyHandle::new(handle))
    }

    /// Saves with [`crate::Fit::AllOrNothing`]; see [`Rank::save_with`].
    ///
    /// # Errors
    /// As [`Rank::save_with`].
    ///
    /// # Examples
    ///
    /// ```
    /// # use kvtier::{MemcpyArenas, ArenaSpec, EngineArenas, Geometry, HostTier, TierConfig, WaitFor};
    /// # use std::sync::Arc;
    /// # let geometry = Geometry::new("doc", 16, vec![ArenaSpec::packed("kv", 4096, 8)])?;
    /// # let tier = HostTier::new(TierConfig::new(geometry.clone(), 1 << 20))?;
    /// # let arenas = Arc::new(MemcpyArenas::new(&geometry)?);
    /// # let rank = tier.attach(arenas.backend()?)?;
    /// let keys: Vec<_> = (0..4).map(|i| tier.namespace().trace_page_key(7, i)).collect();
    /// arenas.fill(&[0, 1, 2, 3], &keys)?; // "prefill": bytes derived from the keys
    /// let ticket = rank.save(&keys, &[0, 1, 2, 3], WaitFor::Nothing)?; // GPU -> host, one batch
    /// assert_eq!(ticket.saving.len(), 4);
    /// ticket.handle.wait()?; // the GPU pages may be reused once the copy completed
    /// assert!(tier.contains(&keys[3]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn save(&self, keys: &[ContentKey], gpu_pages: &[u64], wait: WaitFor) -> Result<SaveTicket, TierError> {
        self.save_with(keys, gpu_pages, wait, SaveOptions::default())
    }

    /// Saves the blocks in GPU pages `gpu_pages[i]` under `keys[i]` (GPU -> host, one batch, after
    /// `wait`). Resident keys are refreshed and skipped, keys another save holds and repeated keys
    /// are skipped; the ticket says which are copied. The GPU pages must not be rewritten until the
    /// ticket's handle completes ([`Rank::load`] counts them).
    ///
    /// The save is planned first (resident / in flight / duplicate / missing / refused by the
    /// policy), then fitted to the slots it can get: free slots first, then eviction of unpinned
    /// ready blocks, never of a pinned or half-written one.
    ///
    /// # Errors
    /// [`TierError::LengthMismatch`]; [`TierError::Copy`] with [`CopyError::PageOutOfRange`] for a
    /// page id outside the arenas (nothing saved); [`TierError::CannotFit`] ([`crate::Fit::AllOrNothing`]:
    /// nothing evicted) or [`TierError::PoolExhausted`] (the slots were pinned meanwhile; nothing
    /// evicted); [`TierError::ShuttingDown`]; backend errors (the reserved slots are released,
    /// nothing becomes visible); [`CopyError::BackendPanicked`] if the backend panicked submitting
    /// the copy (the slots are quarantined: the copy may have been queued).
    pub fn save_with(
        &self,
        keys: &[ContentKey],
        gpu_pages: &[u64],
        wait: WaitFor,
        opts: SaveOptions,
    ) -> Result<SaveTicket, TierError> {
        self.save_how(keys, gpu_pages, Launch::Whole(wait), opts)
    }

    /// [`Rank::save_with`] and [`Rank::save_layers`]: the save submitted as `how` says.
    pub(crate) fn save_how(
        &self,
        keys: &[ContentKey],
        gpu_pages: &[u64],
        how: Launch<'_>,
        opts: SaveOptions,
    ) -> Result<SaveTicket, TierError> {
        self.check_open()?;
        if keys.len() != gpu_pages.len() {
            return Err(TierError::LengthMismatch { keys: keys.len(), pages: gpu_pages.len() });
        }
        // The rank's own page count (a connected tier's geometry names no GPU pages).
        let pages = self.backend.geometry().pages();
        if let Some(&p) = gpu_pages.iter().find(|&&p| p >= pages) {
            return Err(CopyError::PageOutOfRange { page: p, pages }.into());
        }
        let core = match_flavor!(&self.tier,
            Flavor::InProcess(core) => core,
            Flavor::Connected(d) => return self.save_connected(d, keys, gpu_pages, how, opts),
        );
        let prepared = super::prepare::prepare_save(core, keys, &opts)?;
        let super::prepare::PreparedSave { saving, reservation, resident, in_flight, duplicates, dropped } = prepared;
        if saving.is_empty() {
            return Ok(SaveTicket { saving, resident, in_flight, duplicates, dropped, handle: CopyHandle::ready() });
        }
        let batch: Vec<CopyPair> =
            saving.iter().zip(reservation.entries()).map(|(&i, r)| CopyPair::new(gpu_pages[i], r.slot.0)).collect();
        // SAFETY: every slot in `batch` is WRITING and owned by `reservation`, which the settle
        // closure owns until the copy has finished (the reservation holds the core, so the pool
        // outlives the copy); GPU pages are the caller's, who may not rewrite them before the handle
        // completes.
        let handle = unsafe {
            self.launch(
                Direction::Save,
                &batch,
                how,
                Box::new(move |outcome, _latency| {
                    match outcome {
                        CopyOutcome::Done => reservation.commit(),
                        CopyOutcome::Failed => drop(reservation),
                        CopyOutcome::Unknown | CopyOutcome::SubmitPanicked => reservation.quarantine(),
                    }
                    Ok(())
                }),
            )
        }?;
        Ok(SaveTicket { saving, resident, in_flight, duplicates, dropped, handle })
    }

    /// Restores the first `gpu_pages.len()` blocks of `lease` into GPU pages `gpu_pages[i]` (host ->
    /// GPU, one batch, after `wait`) and uses up one restore of the lease. The copy holds its own
    /// pins, taken before the lease's use (see `crate::tier::lease`), so the lease may settle (or be
    /// dropped) while it runs. The GPU pages hold the bytes once the returned handle completes.
    ///
    /// An empty `gpu_pages` copies nothing and returns a completed handle (it still uses up one
    /// restore of an unsettled lease, and is not an error on a settled one).
    ///
    /// # Errors
    /// [`TierError::ForeignLease`]; [`TierError::LeaseTooShort`]; [`TierError::LeaseSettled`] if the
    /// lease has no use left; [`TierError::LeaseExpired`] if the tier expired it;
    /// [`TierError::TooManyPins`] if a slot's pin count is full; [`TierError::Copy`] for out-of-range
    /// or repeated GPU pages and backend errors (nothing copied, the lease keeps its use, and a
    /// retry is served even if another rank took the lease's last use meanwhile);
    /// [`CopyError::BackendPanicked`] if the backend panicked submitting the copy (its pins are
    /// kept for good, the lease keeps its use); [`TierError::ShuttingDown`].
    ///
    /// # Examples
    ///
    /// ```
    /// # use kvtier::{MemcpyArenas, ArenaSpec, EngineArenas, Geometry, HostTier, TierConfig, WaitFor};
    /// # use std::sync::Arc;
    /// # let geometry = Geometry::new("doc", 16, vec![ArenaSpec::packed("kv", 4096, 8)])?;
    /// # let tier = HostTier::new(TierConfig::new(geometry.clone(), 1 << 20))?;
    /// # let arenas = Arc::new(MemcpyArenas::new(&geometry)?);
    /// # let rank = tier.attach(arenas.backend()?)?;
    /// let keys: Vec<_> = (0..2).map(|i| tier.namespace().trace_page_key(7, i)).collect();
    /// arenas.fill(&[0, 1], &keys)?;
    /// rank.save(&keys, &[0, 1], WaitFor::Nothing)?.handle.wait()?;
    /// let lease = tier.query(&keys);
    /// rank.restore(&lease, &[5, 6], WaitFor::Nothing)?.wait()?; // host -> GPU pages 5 and 6
    /// arenas.verify(&[5, 6], &keys)?; // the same bytes again
    /// assert!(lease.is_settled()); // its one use is spent: its pins are gone
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn restore(&self, lease: &Lease, gpu_pages: &[u64], wait: WaitFor) -> Result<CopyHandle, TierError> {
        self.restore_how(lease, gpu_pages, Launch::Whole(wait))
    }

    /// [`Rank::restore`] and [`Rank::restore_layers`]: the restore submitted as `how` says.
    pub(crate) fn restore_how(
        &self,
        lease: &Lease,
        gpu_pages: &[u64],
        how: Launch<'_>,
    ) -> Result<CopyHandle, TierError> {
        self.check_open()?;
        // A lease restores on a rank of the tier it was leased from (a connected tier's: over the
        // same connection), nowhere else.
        let same_tier = match_flavor!((&self.tier, lease.of()),
            (Flavor::InProcess(core), LeaseOf::InProcess(l)) => Arc::ptr_eq(core, &l.core),
            (Flavor::Connected(d), LeaseOf::Connected { remote, .. }) => std::sync::Arc::ptr_eq(&d.conn, remote.conn()),
            // Seeded bug (tests only): a lease of one flavour restores on a rank of the other.
            _ => crate::seeded::seeded("lease-across-flavors"),
        );
        if !same_tier {
            return Err(TierError::ForeignLease);
        }
        let n = gpu_pages.len();
        if n > lease.len() {
            return Err(TierError::LeaseTooShort { asked: n, held: lease.len() });
        }
        match_flavor!(lease.of(),
            LeaseOf::InProcess(_) => (),
            LeaseOf::Connected { remote, .. } => return self.restore_connected(remote, gpu_pages, how),
        );
        if n == 0 {
            lease.consume_without_copy();
            return Ok(CopyHandle::ready());
        }
        let mut hold = lease.begin_restore(n)?;
        let batch: Vec<CopyPair> = gpu_pages.iter().zip(hold.slots()).map(|(&p, s)| CopyPair::new(p, s.0)).collect();
        let pins = hold.take_pins();
        // SAFETY: every slot in `batch` is READY and pinned by `pins`, which the settle closure owns
        // until the copy has finished; the caller owns the GPU pages until the handle completes.
        let handle = unsafe {
            self.launch(
                Direction::Restore,
                &batch,
                how,
                Box::new(move |outcome, _latency| {
                    match outcome {
                        CopyOutcome::Done | CopyOutcome::Failed => drop(pins),
                        CopyOutcome::Unknown | CopyOutcome::SubmitPanicked => pins.quarantine(),
                    }
                    Ok(())
                }),
            )
        }?;
        hold.submitted();
        Ok(handle)
    }

    /// Blocks until this rank has nothing in flight, or `timeout` passes (a `timeout` too long to
    /// be represented as a deadline, `Duration::MAX` included, waits without one).
    ///
    /// # Errors
    /// [`TierError::DrainTimeout`] with the batches still in flight.
    pub fn drain(&self, timeout: Duration) -> Result<(), TierError> {
        // A timeout too long to be represented (`Duration::MAX`) waits without a deadline.
        let deadline = Instant::now().checked_add(timeout);
        let mut b = lock_std(&self.inflight.batches);
        while *b > 0 {
            let wait = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(TierError::DrainTimeout { in_flight: *b });
                    }
                    d - now
                }
                None => Duration::from_secs(3600),
            };
            b = self.inflight.idle.wait_timeout(b, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
        Ok(())
    }

    /// Teardown in the safe order: stop accepting work on this rank, drain in-flight copies, then
    /// release the backend. If copies are still in flight at `timeout`, the rank's backend, its
    /// arenas and the tier's pool are deliberately leaked (never freed under a live copy) and
    /// [`TierError::DrainTimeout`] is returned.
    ///
    /// # Errors
    /// [`TierError::DrainTimeout`].
    pub fn shutdown(mut self, timeout: Duration) -> Result<(), TierError> {
        self.close();
        match self.drain(timeout) {
            Ok(()) => {
                self.join();
                Ok(())
            }
            Err(e) => {
                tracing::error!("rank {} teardown: {e}; leaking its backend and the pool", self.id);
                std::mem::forget(self.tier.clone());
                std::mem::forget(self.backend.clone());
                self.threads.clear(); // detach
                std::mem::forget(self);
                Err(e)
            }
        }
    }

    fn close(&self) {
        lock_std(&self.save_tx).take();
        lock_std(&self.restore_tx).take();
    }

    fn join(&mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.close();
        self.join();
    }
}

impl std::fmt::Debug for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rank").field("id", &self.id).field("backend", &self.backend.name()).finish()
    }
}

/// Locks one of the rank's std mutexes, recovering it from poisoning (see [`crate::sync::lock`]):
/// each guards a counter or a sender, updated in one step.
fn lock_std<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(all(test, not(loom)))]
mod job_tests {
    use super::{CopyOutcome, InFlight, Job};
    use crate::copy::{Completion, Direction};
    use crate::error::{CopyError, TierError};
    use crate::tier::handle::{CopyHandle, HandleShared};
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};

    /// A completion that never finishes (the copy's outcome stays unknown).
    struct Never;
    impl Completion for Never {
        fn poll(&mut self) -> Result<bool, CopyError> {
            Ok(false)
        }
        fn wait(&mut self) -> Result<(), CopyError> {
            unreachable!("a dropped job is never waited for")
        }
    }

    /// A job dropped before its completion thread finished it (a queue dropped by an unwind)
    /// quarantines its slots (`Unknown`), completes its handle with `BackendPanicked` and leaves
    /// the rank's in-flight accounting: no waiter or drain waits for a copy nobody will finish.
    #[test]
    fn a_job_dropped_unfinished_quarantines_completes_its_handle_and_leaves_the_load() {
        let inflight = Arc::new(InFlight::default());
        let settled = Arc::new(Mutex::new(None));
        let s = settled.clone();
        let handle = HandleShared::with_event(3, 3 * 4096, None);
        let job = Job::new(
            Box::new(Never),
            Box::new(move |o, _latency| {
                *s.lock().unwrap() = Some(o);
                Ok(())
            }),
            Direction::Restore,
            3,
            3 * 4096,
            handle.clone(),
            &inflight,
        );
        assert_eq!((inflight.restore_slots.load(Ordering::Relaxed), *inflight.batches.lock().unwrap()), (3, 1));
        drop(job);
        assert_eq!(*settled.lock().unwrap(), Some(CopyOutcome::Unknown), "the slots are quarantined, not freed");
        assert_eq!(
            (inflight.restore_slots.load(Ordering::Relaxed), *inflight.batches.lock().unwrap()),
            (0, 0),
            "the job left the rank's load"
        );
        let r = CopyHandle::new(handle).wait_timeout(std::time::Duration::ZERO).expect("the drop completed the handle");
        assert!(matches!(r, Err(TierError::Copy(CopyError::BackendPanicked))), "{r:?}");
    }
}

//! Batched reads of a disk slot file with several transfers in flight: io_uring where the kernel
//! allows it, `pread` on a few threads where it does not. One transfer at a time leaves most of a
//! drive idle; a promotion of a prefix reads its blocks at a depth.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

use super::error::DiskError;
use super::file::{AlignedBuf, DiskFile};
use crate::key::ContentKey;

/// One block of a batched read: the slot and the block it must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    /// The disk slot.
    pub slot: u64,
    /// The block's content key.
    pub key: ContentKey,
    /// The generation the slot was written with.
    pub generation: u64,
}

/// How a batched read moved its transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchEngine {
    /// One io_uring of the batch's depth, every transfer submitted from the calling thread.
    IoUring,
    /// `pread` on as many threads as the depth (the calling thread one of them): io_uring was
    /// refused (a seccomp filter, a container, `kernel.io_uring_disabled`), the ring failed during
    /// this batch or an earlier one of the file (see [`DiskFile::read_batch`]), or the caller
    /// asked for threads.
    Threads,
}

/// What a batched read did: one result per request, in the requests' order, and how.
#[derive(Debug)]
pub struct BatchReport {
    /// `Ok` where the block was read and verified into its buffer; the block's error otherwise
    /// (`DiskError::Unverified` for a slot that holds no sound copy).
    pub results: Vec<Result<(), DiskError>>,
    /// The way the transfers went: [`BatchEngine::IoUring`] only if the ring read every block;
    /// a batch whose ring failed part way reads the rest on threads and says
    /// [`BatchEngine::Threads`].
    pub engine: BatchEngine,
}

/// How long a batch whose ring failed, or that is unwinding from a panic, waits for the transfers
/// the kernel already took to land in their staging buffers before it gives those buffers up
/// (leaks them) rather than free memory a transfer may still write: the block layer's default
/// command timeout, after which the kernel has completed or failed every request.
const SETTLE_LIMIT: Duration = Duration::from_secs(30);

impl DiskFile {
    /// Reads `requests[i]` into `outs[i]` (each exactly the file's payload bytes) with up to
    /// `depth` transfers in flight, verifying each block as [`DiskFile::read`] does; a buffer is
    /// written only when its block verifies. `engine` asks for a way: io_uring falls back to
    /// threads when the kernel refuses a ring, and when `io_uring_enter` fails during a batch
    /// (any error but `EINTR` and `EBUSY`) the blocks the ring did not read are read on threads,
    /// and every later batch of this file goes on threads too ([`DiskFile::ring_failed`]). A ring
    /// that fails frees its staging buffers once the kernel has finished every transfer it took
    /// (waiting up to 30 s for a drive that does not answer; only then are they given up), and
    /// fails no block it did not read.
    ///
    /// # Errors
    /// [`DiskError::BadConfig`] when `requests` and `outs` differ in length or `depth` is 0 or
    /// over 1,024; each block's own failure is in [`BatchReport::results`].
    pub fn read_batch(
        &self,
        requests: &[ReadRequest],
        outs: &mut [&mut [u8]],
        depth: usize,
        engine: BatchEngine,
    ) -> Result<BatchReport, DiskError> {
        if requests.len() != outs.len() || depth == 0 || depth > 1024 {
            return Err(DiskError::BadConfig(format!(
                "a batched read of {} requests into {} buffers at depth {depth} (1 to 1024)",
                requests.len(),
                outs.len()
            )));
        }
        let depth = depth.min(requests.len().max(1));
        let mut results: Vec<Option<Result<(), DiskError>>> = (0..requests.len()).map(|_| None).collect();
        let mut used = BatchEngine::Threads;
        if engine == BatchEngine::IoUring && !self.ring_failed() {
            if let Ok(ring) = IoUring::new(depth as u32) {
                match self.read_ring(ring, requests, outs, depth, &mut results) {
                    Ok(()) => used = BatchEngine::IoUring,
                    Err(e) => {
                        if !self.ring_failed.swap(true, Ordering::Relaxed) {
                            tracing::warn!(
                                error = %e, path = %self.path().display(),
                                "io_uring_enter failed: this batch's remaining reads and every later batch of the file go on threads"
                            );
                        }
                    }
                }
            }
        }
        self.read_threads(requests, outs, depth, &mut results);
        Ok(BatchReport {
            results: results.into_iter().map(|r| r.expect("every request has its result")).collect(),
            engine: used,
        })
    }

    /// Reads the requests whose result is not set yet on up to `depth` threads (the calling one
    /// included: a thread the OS refuses leaves its share to the others).
    fn read_threads(
        &self,
        requests: &[ReadRequest],
        outs: &mut [&mut [u8]],
        depth: usize,
        results: &mut [Option<Result<(), DiskError>>],
    ) {
        // Per request left: its position, its destination and, once read, its outcome.
        type Cell<'o> = (usize, Mutex<(&'o mut [u8], Option<Result<(), DiskError>>)>);
        let cells: Vec<Cell<'_>> = outs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| results[*i].is_none())
            .map(|(i, out)| (i, Mutex::new((&mut **out, None))))
            .collect();
        if cells.is_empty() {
            return;
        }
        let next = AtomicUsize::new(0);
        // Copy (it borrows only): each thread gets its own.
        let work = || {
            while let Some((i, cell)) = cells.get(next.fetch_add(1, Ordering::Relaxed)) {
                let req = requests[*i];
                let mut cell = cell.lock().unwrap_or_else(|p| p.into_inner());
                let result = self.read(req.slot, req.key, req.generation, cell.0);
                cell.1 = Some(result);
            }
        };
        std::thread::scope(|scope| {
            for _ in 1..depth.min(cells.len()) {
                let spawned = std::thread::Builder::new().name("kvtier-disk-read".into()).spawn_scoped(scope, work);
                if spawned.is_err() {
                    break;
                }
            }
            work();
        });
        for (i, cell) in cells {
            results[i] = cell.into_inner().unwrap_or_else(|p| p.into_inner()).1;
        }
    }

    /// Reads the batch through `ring`, setting the result of every request it read (verified or
    /// not) or could not even send (a slot out of range). `Err` when `io_uring_enter` failed: the
    /// requests left without a result were not read, and the ring is given up.
    fn read_ring(
        &self,
        ring: IoUring,
        requests: &[ReadRequest],
        outs: &mut [&mut [u8]],
        depth: usize,
        results: &mut [Option<Result<(), DiskError>>],
    ) -> Result<(), std::io::Error> {
        let mut batch = RingBatch {
            file: self,
            ring,
            bufs: (0..depth).map(|_| Some(self.take_staging())).collect(),
            holding: vec![None; depth],
            pushed: 0,
            reaped: 0,
        };
        let mut idle: Vec<usize> = (0..depth).collect();
        let mut next = 0usize;
        let fd = types::Fd(self.transfer_fd());
        let stride = self.header().stride as u32;
        loop {
            while next < requests.len() && !idle.is_empty() {
                let req = requests[next];
                if let Err(e) = self.check_slot(req.slot) {
                    results[next] = Some(Err(e));
                    next += 1;
                    continue;
                }
                let b = idle.pop().expect("an idle buffer");
                let buf = batch.bufs[b].as_mut().expect("an idle buffer is held");
                let entry = opcode::Read::new(fd, buf.bytes_mut().as_mut_ptr(), stride)
                    .offset(self.header().slot_offset(req.slot))
                    .build()
                    .user_data(b as u64);
                // SAFETY: the buffer bufs[b] stays allocated and untouched until this entry's
                // completion is reaped: the loop reaps before it reuses a buffer, and every way out
                // of it, an error or a panic included, goes through `RingBatch`'s drop, which frees
                // the buffers only once every entry the kernel took has completed (and leaks them
                // if the kernel never completes). The fd is the file's own, open for as long as
                // `self`, which the batch borrows.
                let pushed = unsafe { batch.ring.submission().push(&entry) };
                if pushed.is_err() {
                    idle.push(b);
                    break; // the queue is full: reap first
                }
                batch.holding[b] = Some(next);
                batch.pushed += 1;
                next += 1;
            }
            if batch.pushed == batch.reaped {
                break;
            }
            match batch.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) => continue,
                Err(e) => {
                    // Seeded bug (tests only): the old way out, which forgot the staging buffers
                    // and failed every block not read yet as if the drive had failed it.
                    if crate::seeded::seeded("disk-ring-failure-leaks") {
                        for buf in batch.bufs.iter_mut().filter_map(Option::take) {
                            std::mem::forget(buf);
                        }
                        for result in results.iter_mut().filter(|r| r.is_none()) {
                            *result = Some(Err(self.io_error("waiting for io_uring completions", e.kind().into())));
                        }
                        return Ok(());
                    }
                    // The blocks in flight are read again on threads; `batch`'s drop waits for
                    // the kernel to finish with their buffers before it frees them.
                    return Err(e);
                }
            }
            let done: Vec<(usize, i32)> =
                batch.ring.completion().map(|c| (c.user_data() as usize, c.result())).collect();
            for (b, res) in done {
                batch.reaped += 1;
                let i = batch.holding[b].take().expect("a completion of a buffer in flight");
                let req = requests[i];
                let buf = batch.bufs[b].as_ref().expect("a buffer in flight is held");
                let result = if res == stride as i32 {
                    self.count_transfer();
                    if crate::seeded::seeded("disk-batch-unverified") && outs[i].len() <= buf.bytes().len() {
                        let n = outs[i].len();
                        outs[i].copy_from_slice(&buf.bytes()[..n]);
                        Ok(())
                    } else {
                        self.verify_into(req.slot, req.key, req.generation, buf.bytes(), outs[i])
                    }
                } else if res == -libc::EINVAL || (0..stride as i32).contains(&res) {
                    // O_DIRECT refused on this transfer, or a short read: read it the plain way.
                    self.read(req.slot, req.key, req.generation, outs[i])
                } else {
                    Err(self.io_error("reading a slot (io_uring)", std::io::Error::from_raw_os_error(-res)))
                };
                results[i] = Some(result);
                idle.push(b);
            }
        }
        Ok(())
    }
}

/// A batch's ring and its staging buffers. Dropping it (the batch done, failed or unwinding)
/// settles the ring first: it waits for every entry the kernel took to complete, then gives the
/// buffers back; entries the kernel never took are simply dropped with the ring.
struct RingBatch<'f> {
    file: &'f DiskFile,
    ring: IoUring,
    /// The staging buffers, one per transfer in flight (`None` once given up).
    bufs: Vec<Option<AlignedBuf>>,
    /// Which request each buffer holds while its transfer is in flight.
    holding: Vec<Option<usize>>,
    /// Entries pushed to the submission queue.
    pushed: u64,
    /// Completions reaped.
    reaped: u64,
}

impl RingBatch<'_> {
    /// Waits, up to `limit`, until every entry the kernel consumed has completed, polling the
    /// completion ring (shared memory: no `io_uring_enter`, which may be what failed; each sleep is
    /// a system call, on whose return the kernel runs the completions' task work). Returns whether
    /// nothing is in flight any more.
    fn settle(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let reaped = self.ring.completion().count() as u64;
            self.reaped += reaped;
            // Entries still in the submission queue were never taken by the kernel: they never run.
            let never_taken = self.ring.submission().len() as u64;
            if self.reaped + never_taken >= self.pushed {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

impl Drop for RingBatch<'_> {
    fn drop(&mut self) {
        let settled = self.pushed == self.reaped || self.settle(SETTLE_LIMIT);
        for buf in self.bufs.iter_mut().filter_map(Option::take) {
            if settled {
                self.file.give_staging(buf);
            } else {
                // The kernel may still write it: never free it.
                self.file.give_up_staging(buf);
            }
        }
        if !settled {
            tracing::error!(
                path = %self.file.path().display(),
                in_flight = self.pushed - self.reaped,
                "io_uring transfers did not complete: their staging buffers are given up (leaked)"
            );
        }
    }
}

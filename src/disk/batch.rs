//! Batched reads of a disk slot file with several transfers in flight: io_uring where the kernel
//! allows it, `pread` on a few threads where it does not. One transfer at a time leaves most of a
//! drive idle; a promotion of a prefix reads its blocks at a depth.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

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
    /// `pread` on as many threads as the depth: io_uring was refused (a seccomp filter, a
    /// container, `kernel.io_uring_disabled`), or the caller asked for threads.
    Threads,
}

/// What a batched read did: one result per request, in the requests' order, and how.
#[derive(Debug)]
pub struct BatchReport {
    /// `Ok` where the block was read and verified into its buffer; the block's error otherwise
    /// (`DiskError::Unverified` for a slot that holds no sound copy).
    pub results: Vec<Result<(), DiskError>>,
    /// The way the transfers went.
    pub engine: BatchEngine,
}

impl DiskFile {
    /// Reads `requests[i]` into `outs[i]` (each exactly the file's payload bytes) with up to
    /// `depth` transfers in flight, verifying each block as [`DiskFile::read`] does; a buffer is
    /// written only when its block verifies. `engine` asks for a way (io_uring falls back to
    /// threads when the kernel refuses a ring).
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
        if engine == BatchEngine::IoUring {
            if let Ok(ring) = IoUring::new(depth as u32) {
                return Ok(BatchReport { results: self.read_ring(ring, requests, outs, depth), engine });
            }
        }
        Ok(BatchReport { results: self.read_threads(requests, outs, depth), engine: BatchEngine::Threads })
    }

    fn read_threads(
        &self,
        requests: &[ReadRequest],
        outs: &mut [&mut [u8]],
        depth: usize,
    ) -> Vec<Result<(), DiskError>> {
        let next = AtomicUsize::new(0);
        // Per request: its destination and, once read, its outcome.
        type Slot<'o> = Mutex<(&'o mut [u8], Option<Result<(), DiskError>>)>;
        let slots: Vec<Slot<'_>> = outs.iter_mut().map(|out| Mutex::new((&mut **out, None))).collect();
        std::thread::scope(|scope| {
            for _ in 0..depth {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(req) = requests.get(i) else { break };
                    let mut cell = slots[i].lock().unwrap_or_else(|p| p.into_inner());
                    let result = self.read(req.slot, req.key, req.generation, cell.0);
                    cell.1 = Some(result);
                });
            }
        });
        slots
            .into_iter()
            .map(|cell| cell.into_inner().unwrap_or_else(|p| p.into_inner()).1.expect("every request was read"))
            .collect()
    }

    fn read_ring(
        &self,
        mut ring: IoUring,
        requests: &[ReadRequest],
        outs: &mut [&mut [u8]],
        depth: usize,
    ) -> Vec<Result<(), DiskError>> {
        let mut results: Vec<Option<Result<(), DiskError>>> = (0..requests.len()).map(|_| None).collect();
        let mut bufs: Vec<AlignedBuf> = (0..depth).map(|_| self.take_staging()).collect();
        // Which request each staging buffer holds while its transfer is in flight.
        let mut holding: Vec<Option<usize>> = vec![None; depth];
        let mut idle: Vec<usize> = (0..depth).collect();
        let mut next = 0usize;
        let mut in_flight = 0usize;
        let fd = types::Fd(self.transfer_fd());
        let stride = bufs[0].bytes().len() as u32;
        loop {
            while next < requests.len() && !idle.is_empty() {
                let req = requests[next];
                if let Err(e) = self.check_slot(req.slot) {
                    results[next] = Some(Err(e));
                    next += 1;
                    continue;
                }
                let b = idle.pop().expect("an idle buffer");
                let entry = opcode::Read::new(fd, bufs[b].bytes_mut().as_mut_ptr(), stride)
                    .offset(self.header().slot_offset(req.slot))
                    .build()
                    .user_data(b as u64);
                // SAFETY: the buffer bufs[b] stays allocated and untouched until this entry's
                // completion is reaped below (the loop does not return while any is in flight, and
                // an unrecoverable ring error leaks the buffers rather than freeing them); the fd
                // is the file's own, open for as long as `self`.
                let pushed = unsafe { ring.submission().push(&entry) };
                if pushed.is_err() {
                    idle.push(b);
                    break; // the queue is full: reap first
                }
                holding[b] = Some(next);
                in_flight += 1;
                next += 1;
            }
            if in_flight == 0 {
                break;
            }
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) => continue,
                Err(e) => {
                    // Transfers may still land in the buffers: leak them, never free memory the
                    // kernel may write, and fail what was in flight or not yet sent.
                    for buf in bufs.drain(..) {
                        std::mem::forget(buf);
                    }
                    let what = "waiting for io_uring completions";
                    for (i, result) in results.iter_mut().enumerate() {
                        if result.is_none() || holding.contains(&Some(i)) {
                            *result = Some(Err(self.io_error(what, std::io::Error::from(e.kind()))));
                        }
                    }
                    return results.into_iter().map(|r| r.expect("set above")).collect();
                }
            }
            let done: Vec<(usize, i32)> = ring.completion().map(|c| (c.user_data() as usize, c.result())).collect();
            for (b, res) in done {
                in_flight -= 1;
                let i = holding[b].take().expect("a completion of a buffer in flight");
                let req = requests[i];
                let result = if res == stride as i32 {
                    self.count_transfer();
                    if crate::seeded::seeded("disk-batch-unverified") && outs[i].len() <= bufs[b].bytes().len() {
                        let n = outs[i].len();
                        outs[i].copy_from_slice(&bufs[b].bytes()[..n]);
                        Ok(())
                    } else {
                        self.verify_into(req.slot, req.key, req.generation, bufs[b].bytes(), outs[i])
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
        for buf in bufs {
            self.give_staging(buf);
        }
        results.into_iter().map(|r| r.expect("every request has its result")).collect()
    }
}

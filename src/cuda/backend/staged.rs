//! The staged mode ([`CopyMode::Staged`](super::CopyMode::Staged)): a lane's HBM staging buffer ([`Staging`]) and the
//! pipeline that moves a batch through it in pieces ([`ramp`], [`pieces`]) while the copy engine
//! moves the previous piece.

use super::{BoundPool, CudaBackend};
use crate::copy::{CopyPair, Direction};
use crate::cuda::desc::{KvtCopyArgs, KvtPair, COPY_THREADS, FLAG_SLOT_IS_INDEX, INLINE_PAIRS};
use crate::cuda::device::{launch, CopyList, DeviceBuffer, Event, Stream};
use crate::error::CopyError;
use cudarc::driver::sys;

/// Splits `total` bytes into pieces of `first`, `2 * first`, `4 * first`, ... bytes, each at most
/// `max` (the last one holds the rest). Returns the piece sizes in order; empty for `total == 0`.
pub(super) fn ramp(total: u64, first: u64, max: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let (mut done, mut size) = (0u64, first.clamp(1, max.max(1)));
    while done < total {
        let s = size.min(total - done);
        out.push(s);
        done += s;
        size = size.saturating_mul(2).min(max.max(1));
    }
    out
}

/// Block geometry of a batch as the planner sees it: `seg_cum[s]` = data bytes of a block before
/// segment `s` (`spb` entries), `block` = data bytes of a block.
pub(super) struct ItemMap<'a> {
    pub(super) seg_cum: &'a [u64],
    pub(super) block: u64,
}

impl ItemMap<'_> {
    fn spb(&self) -> u64 {
        self.seg_cum.len() as u64
    }
    /// First item (`w` = segment `w % spb` of pair `w / spb`) starting at or after data byte `b`.
    pub(super) fn item_at(&self, b: u64) -> u64 {
        let (blk, rem) = (b / self.block, b % self.block);
        blk * self.spb() + self.seg_cum.partition_point(|&c| c < rem) as u64
    }
    /// Data bytes before item `w`.
    pub(super) fn byte_at(&self, w: u64) -> u64 {
        (w / self.spb()) * self.block + self.seg_cum[(w % self.spb()) as usize]
    }
}

/// The staged pipeline's pieces of items `[start, n * spb)` of a batch of `n` blocks as work-item
/// ranges `[begin, end)`, cut at segment boundaries: a [`ramp`] of sizes over those items' data
/// bytes, ascending for saves and descending for restores. Every range is non-empty and they tile
/// `[start, n * spb)` in order (empty when `start` is the end).
pub(super) fn pieces(n: u64, map: &ItemMap<'_>, start: u64, first: u64, max: u64, dir: Direction) -> Vec<(u64, u64)> {
    let end_item = n * map.spb();
    if start >= end_item {
        return Vec::new();
    }
    let b0 = map.byte_at(start);
    let mut sizes = ramp(n * map.block - b0, first, max);
    if dir == Direction::Restore {
        sizes.reverse();
    }
    let mut out = Vec::with_capacity(sizes.len());
    let (mut pos, mut begin) = (b0, start);
    for s in sizes {
        pos += s;
        let end = map.item_at(pos).min(end_item);
        if end > begin {
            out.push((begin, end));
            begin = end;
        }
    }
    if begin < end_item {
        match out.last_mut() {
            Some(l) => l.1 = end_item,
            None => out.push((start, end_item)),
        }
    }
    out
}

/// Staged-mode resources of one direction: the two-piece HBM buffer, the copy-engine stream and
/// the events that hand pieces between it and the kernel stream, and the head's zero-copy stream
/// with its two events (start after the batch's wait; the lane waits for its end).
pub(super) struct Staging {
    pub(super) buf: DeviceBuffer,
    pub(super) piece_slots: usize,
    pub(super) copy: Stream,
    pub(super) step: Event,
    pub(super) half_free: [Event; 2],
    pub(super) sync: Event,
    pub(super) head: Stream,
    pub(super) head_go: Event,
    pub(super) head_done: Event,
}

impl CudaBackend {
    /// The lane's staging resources, allocated at first use: two halves of
    /// `staged_piece_blocks + 2` slots of `slot_bytes` each, the copy-engine stream, the head's
    /// stream and the hand-over events.
    pub(super) fn staging<'a>(
        &self,
        staging: &'a mut Option<Staging>,
        slot_bytes: u64,
    ) -> Result<&'a Staging, CopyError> {
        let inner = &self.inner;
        if staging.is_none() {
            let dev = &inner.dev;
            // A piece of at most max_piece blocks (plus one segment of rounding) cut anywhere
            // spans at most max_piece + 2 pairs.
            let piece_slots = inner.options.staged_piece_blocks as usize + 2;
            *staging = Some(Staging {
                buf: DeviceBuffer::new(dev, (2 * piece_slots as u64 * slot_bytes) as usize)?,
                piece_slots,
                copy: inner.new_stream()?,
                step: Event::new(dev)?,
                half_free: [Event::new(dev)?, Event::new(dev)?],
                sync: Event::new(dev)?,
                head: inner.new_stream()?,
                head_go: Event::new(dev)?,
                head_done: Event::new(dev)?,
            });
        }
        Ok(staging.as_ref().expect("allocated"))
    }

    /// Staged mode: the head (the first [`CudaOptions::save_head_bytes`](super::CudaOptions::save_head_bytes) /
    /// [`CudaOptions::restore_head_bytes`](super::CudaOptions::restore_head_bytes), rounded up to a segment boundary) zero copy on the head
    /// stream, which starts after the lane's wait; then the rest in the pieces of [`pieces`],
    /// alternating between the two halves of the staging buffer (piece-relative pair `r` at slot
    /// `r` of the half). Save: the kernel stream gathers piece k into half k % 2 (after the copy of
    /// piece k - 2 out of that half), the copy stream then moves it to the host slots. Restore: the
    /// copy stream fills half k % 2 (after the scatter of piece k - 2 read it), then the kernel
    /// stream scatters it. The lane stream waits for the copy stream and the head stream at the
    /// end, so the completion event covers everything.
    ///
    /// A restore's copies into the staging buffer wait only for the scatters that last read the
    /// half they fill (also those of earlier batches), not for the whole lane: they touch no GPU
    /// page, so the batch's [`WaitFor`](crate::copy::WaitFor) and earlier batches' final scatters gate only the scatter
    /// kernels (on the lane stream) and the head, and back-to-back restores keep the copy engine
    /// busy while the previous batch's last scatter runs.
    pub(super) fn staged(
        &self,
        staging: &mut Option<Staging>,
        args: &KvtCopyArgs,
        batch: &[CopyPair],
        pool: BoundPool,
        dir: Direction,
        stream: sys::CUstream,
    ) -> Result<(), CopyError> {
        let inner = &self.inner;
        let o = &inner.options;
        let sb = pool.slot_bytes;
        let spb = inner.segs_per_block as u64;
        let max_piece = o.staged_piece_blocks as usize;
        let stg = self.staging(staging, sb)?;
        let map = ItemMap { seg_cum: &inner.seg_cum, block: inner.geometry.block_bytes() };
        let n_items = batch.len() as u64 * spb;
        let head_bytes = if dir == Direction::Save { o.save_head_bytes } else { o.restore_head_bytes };
        let head_items = if head_bytes == 0 { 0 } else { map.item_at(head_bytes).min(n_items) };
        if head_items > 0 {
            // The head reads or writes GPU pages: it starts after everything queued on the lane so
            // far (this batch's WaitFor, earlier batches).
            stg.head_go.record(stream)?;
            stg.head.wait_event(stg.head_go.raw)?;
            let mut a = *args;
            a.item_begin = 0;
            a.item_end = head_items;
            // SAFETY: as the zero-copy launch in `submit` (the same arguments, a prefix of the
            // items); the lane waits for head_done below before the batch's completion event.
            unsafe { self.launch_zero_copy(&a, dir, stg.head.raw)? };
            stg.head_done.record(stg.head.raw)?;
        }
        let plan =
            pieces(batch.len() as u64, &map, head_items, o.staged_first_piece_bytes, max_piece as u64 * map.block, dir);
        let k = &inner.dev.kernels;
        let u = if o.staged_unroll == 8 { 1 } else { 0 };
        let f = match dir {
            Direction::Save => k.save[u],
            Direction::Restore => k.restore[u],
        };
        let cs = stg.copy.raw;
        let mut list = CopyList::with_capacity(stg.piece_slots);
        if dir == Direction::Save && !plan.is_empty() {
            // Save copies start after everything queued on the lane so far (this batch's WaitFor,
            // earlier batches' gathers); each also waits for its own piece's gather below.
            stg.sync.record(stream)?;
            stg.copy.wait_event(stg.sync.raw)?;
        }
        for (pi, &(w0, w1)) in plan.iter().enumerate() {
            let (i0, i1) = ((w0 / spb) as usize, ((w1 - 1) / spb) as usize);
            let cnt = i1 - i0 + 1;
            assert!(cnt <= stg.piece_slots, "staged piece of {cnt} pairs exceeds the staging half");
            let half = pi % 2;
            let st = stg.buf.ptr + (half * stg.piece_slots) as u64 * sb;
            let mut a = *args;
            a.host_base = st;
            a.flags = FLAG_SLOT_IS_INDEX;
            a.item_begin = w0 - i0 as u64 * spb;
            a.item_end = w1 - i0 as u64 * spb;
            if args.pairs != 0 {
                a.pairs = args.pairs + (i0 * std::mem::size_of::<KvtPair>()) as u64;
            } else {
                a.inline_pairs = [KvtPair::default(); INLINE_PAIRS];
                a.inline_pairs[..cnt].copy_from_slice(&args.inline_pairs[i0..i0 + cnt]);
            }
            // Byte range of pair r's slot that the piece covers.
            let span = |r: usize| -> (u64, u64) {
                let lo = if r == 0 { inner.seg_span[(w0 % spb) as usize].0 } else { 0 };
                let hi = if r == cnt - 1 && w1 % spb != 0 { inner.seg_span[(w1 % spb) as usize - 1].1 } else { sb };
                (lo, hi)
            };
            let mut copies = || -> Result<(), CopyError> {
                let mut r = 0;
                while r < cnt {
                    let (lo, mut hi) = span(r);
                    let mut e = r + 1;
                    // Merge whole neighbouring slots that are consecutive on the host too.
                    while e < cnt && hi == sb && batch[i0 + e].slot == batch[i0 + e - 1].slot + 1 {
                        hi = span(e).1;
                        e += 1;
                    }
                    let len = (e - r - 1) as u64 * sb + hi - lo;
                    let host = pool.alias + batch[i0 + r].slot as u64 * sb + lo;
                    let dev = st + r as u64 * sb + lo;
                    let (dst, src) = if dir == Direction::Save { (host, dev) } else { (dev, host) };
                    list.push(dst, src, len as usize);
                    r = e;
                }
                // Copies between a device buffer and the pool's device alias (unified addressing
                // picks the direction), one driver call for the piece where the driver can.
                // SAFETY: every range lies inside the staging half (cnt <= piece_slots) and the
                // registered pool (ids validated); ordered with the kernels by the events around
                // this call.
                unsafe { list.submit(cs, o.batched_copies) }
            };
            if dir == Direction::Save {
                if pi >= 2 {
                    // A wait takes the event's state at the call, so re-recording it later is fine.
                    Stream::wait_raw(stream, stg.half_free[half].raw)?;
                }
                // SAFETY: as the zero-copy launch in `submit`; FLAG_SLOT_IS_INDEX with the
                // piece-relative pair list keeps every access below cnt <= piece_slots slots.
                unsafe { launch(f, o.staged_ctas, COPY_THREADS, stream, &a)? };
                stg.step.record(stream)?;
                stg.copy.wait_event(stg.step.raw)?;
                copies()?;
                stg.half_free[half].record(cs)?;
            } else {
                // The last scatter that read this half (this batch's piece k - 2 or an earlier
                // batch's; an event never recorded is no wait).
                stg.copy.wait_event(stg.half_free[half].raw)?;
                copies()?;
                stg.step.record(cs)?;
                Stream::wait_raw(stream, stg.step.raw)?;
                // SAFETY: as above.
                unsafe { launch(f, o.staged_ctas, COPY_THREADS, stream, &a)? };
                stg.half_free[half].record(stream)?;
            }
        }
        if head_items > 0 {
            Stream::wait_raw(stream, stg.head_done.raw)?;
        }
        if dir == Direction::Restore || plan.is_empty() {
            // The last scatter waited for the last copy: the lane already covers the pipeline.
            return Ok(());
        }
        stg.sync.record(cs)?;
        Stream::wait_raw(stream, stg.sync.raw)
    }
}

//! Layer-wise submission of the [`CudaBackend`] ([`LayerCopy`]): the batch moves one layer group at
//! a time, with one event per group recorded on the lane stream after the group's last kernel.
//!
//! A group is a contiguous range of arenas, so it is a contiguous range of the segment table
//! (segments are in arena order) and of every host slot (`[off0, off0 + span)`, padding included).
//! Zero copy: one launch per group over the group's sub-table. Staged: the pipeline of
//! [`CudaBackend::staged`] over the group's bytes, packed in the staging halves at a stride of
//! `span` per block (the kernel's host address `host_base + i * slot_bytes + slot_offset + offset`
//! with `host_base = half - off0` and `slot_bytes = span`), and the copy engine moves each run of
//! consecutive host slots with one 2-D copy (pitch: the slot on the host, `span` in HBM). The
//! halves alternate across groups, so the pipeline does not drain between groups; pieces are cut
//! at block boundaries of a group.

use super::{
    launch, ramp, BatchEvent, BoundPool, CudaBackend, CudaCompletion, Staging, COPY_THREADS, FLAG_SLOT_IS_INDEX,
    INLINE_PAIRS,
};
use crate::copy::layers::{LayerCopy, LayerGroups, LayerReadiness};
use crate::copy::{validate_batch, Completion, CopyPair, Direction, WaitFor};
use crate::cuda::desc::{KvtCopyArgs, KvtPair, KvtSeg, SEG_BYTES};
use crate::cuda::device::{ck, CopyList, Event, Stream};
use crate::error::CopyError;
use crate::geometry::Geometry;
use cudarc::driver::sys;
use std::sync::Arc;

/// One layer group as the kernels and the copy engine see it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct GroupView {
    /// First segment of the group in the segment table.
    pub seg0: u32,
    /// Segments of the group in one block.
    pub spb: u32,
    /// Offset of the group's first chunk in a host slot.
    pub off0: u64,
    /// Bytes of a host slot the group spans (its chunks and their alignment padding).
    pub span: u64,
}

/// The [`GroupView`] of every group of `groups` over `geometry` (whose slot is `slot_bytes`).
pub(super) fn group_views(geometry: &Geometry, groups: &LayerGroups) -> Vec<GroupView> {
    let arenas = geometry.arenas();
    let offs = geometry.chunk_offsets();
    let mut seg_first = Vec::with_capacity(arenas.len() + 1);
    let mut c = 0u32;
    for a in arenas {
        seg_first.push(c);
        c += a.bytes_per_page.div_ceil(SEG_BYTES) as u32;
    }
    seg_first.push(c);
    (0..groups.len())
        .map(|g| {
            let r = groups.arenas(g);
            let off0 = offs[r.start];
            let end = if r.end < arenas.len() { offs[r.end] } else { geometry.slot_bytes() };
            GroupView { seg0: seg_first[r.start], spb: seg_first[r.end] - seg_first[r.start], off0, span: end - off0 }
        })
        .collect()
}

/// The events of a layer-wise batch: event `g` is recorded after group `g`'s last kernel.
pub(super) struct GroupEvents(Vec<Event>);

impl LayerReadiness for GroupEvents {
    fn groups(&self) -> usize {
        self.0.len()
    }
    fn cuda_event(&self, g: usize) -> Option<u64> {
        Some(self.0[g].raw as u64)
    }
    fn stream_wait(&self, g: usize, stream: u64) -> Result<(), CopyError> {
        self.0[g].stream_wait(stream as sys::CUstream)
    }
    fn is_ready(&self, g: usize) -> Result<bool, CopyError> {
        self.0[g].query()
    }
}

impl LayerCopy for CudaBackend {
    unsafe fn copy_layers(
        &self,
        dir: Direction,
        batch: &[CopyPair],
        groups: &LayerGroups,
        waits: &[WaitFor],
    ) -> Result<Box<dyn Completion>, CopyError> {
        let pool = self.pool.ok_or(CopyError::PoolNotBound)?;
        let inner = &self.inner;
        groups.check(inner.geometry.arenas().len())?;
        groups.check_waits(waits)?;
        validate_batch(batch, inner.geometry.pages(), pool.capacity, dir)?;
        // Within a group the order of blocks is free (its event waits for all of them), so the
        // pairs go in host-slot order: scattered but near-contiguous slots (a pool after evictions)
        // become long runs, one 2-D copy each instead of one copy per block and group.
        let sorted = by_slot(batch);
        let batch = &sorted[..];
        inner.dev.bind()?;
        let lane = if dir == Direction::Save { &inner.save } else { &inner.restore };
        let event = Event::new(&inner.dev)?;
        let events = (0..groups.len()).map(|_| Event::new(&inner.dev)).collect::<Result<Vec<_>, _>>()?;
        let views = group_views(&inner.geometry, groups);
        debug_assert_eq!(views.iter().map(|v| v.spb).sum::<u32>(), inner.segs_per_block);
        let mut staging = lane.submit.lock().unwrap_or_else(|p| p.into_inner());
        let stream = lane.stream.raw;
        let per_group = waits.len() > 1;
        if !per_group {
            lane.stream.wait_for(waits[0])?;
        }
        let (args, desc) = self.upload_pairs(batch, pool, stream)?;
        let staged = self.is_staged(batch.len());
        let mut pieces = 0usize;
        let result = (|| -> Result<(), CopyError> {
            for (g, v) in views.iter().enumerate() {
                if per_group {
                    // Group g touches GPU pages only after its own wait (and the earlier ones).
                    lane.stream.wait_for(waits[g])?;
                }
                // Seeded bug: the group's readiness recorded before its copy.
                let early = crate::seeded::seeded("layer-ready-early");
                if early {
                    events[g].record(stream)?;
                }
                let mut a = args;
                a.segs = inner.seg_table.ptr + v.seg0 as u64 * std::mem::size_of::<KvtSeg>() as u64;
                a.segs_per_block = v.spb;
                a.item_begin = 0;
                a.item_end = batch.len() as u64 * v.spb as u64;
                if staged {
                    let edge = if dir == Direction::Save { g == 0 } else { g + 1 == views.len() };
                    self.staged_group(&mut staging, &a, batch, pool, dir, stream, v, edge, &mut pieces)?;
                } else {
                    // SAFETY: as the zero-copy launch in `submit`: the group's sub-table of the
                    // segment table (inside it: the views tile it), the batch's validated pairs
                    // over the pool alias, buffers alive in the completion.
                    unsafe { self.launch_zero_copy(&a, dir, stream)? };
                }
                if !early {
                    events[g].record(stream)?;
                }
            }
            if staged && dir == Direction::Save && pieces > 0 {
                let stg = staging.as_ref().expect("allocated by staged_group");
                stg.sync.record(stg.copy.raw)?;
                Stream::wait_raw(stream, stg.sync.raw)?;
            }
            event.record(stream)
        })();
        if result.is_err() {
            // Nothing may be released while queued work could still use it.
            lane.drain_after_failure(&staging);
        }
        drop(staging);
        if let Err(e) = result {
            if let Some(d) = desc {
                inner.give_desc(d);
            }
            return Err(e);
        }
        Ok(Box::new(CudaCompletion {
            event: Arc::new(BatchEvent(event)),
            desc,
            inner: self.inner.clone(),
            done: false,
            layers: Some(Arc::new(GroupEvents(events))),
        }))
    }
}

impl CudaBackend {
    /// The staged pipeline over one group `v` of every block of `batch` (arguments `args` already
    /// narrowed to the group's segments), continuing the alternation of staging halves at piece
    /// number `*pieces`. Pieces are whole blocks of the group, at most
    /// [`super::CudaOptions::staged_piece_blocks`] blocks' worth of bytes and one staging half;
    /// at the `edge` (a save's first group, a restore's last) they ramp from
    /// [`super::CudaOptions::staged_first_piece_bytes`] as in whole-block copies, so the exposed
    /// kernel at the start of a save (end of a restore) is short.
    #[allow(clippy::too_many_arguments)]
    fn staged_group(
        &self,
        staging: &mut Option<Staging>,
        args: &KvtCopyArgs,
        batch: &[CopyPair],
        pool: BoundPool,
        dir: Direction,
        stream: sys::CUstream,
        v: &GroupView,
        edge: bool,
        pieces: &mut usize,
    ) -> Result<(), CopyError> {
        let inner = &self.inner;
        let o = &inner.options;
        let sb = pool.slot_bytes;
        let stg = self.staging(staging, sb)?;
        let n = batch.len() as u64;
        let cap = (stg.piece_slots as u64 * sb / v.span).max(1);
        let max = (o.staged_piece_blocks as u64 * inner.geometry.block_bytes() / v.span).clamp(1, cap);
        let mut sizes =
            if edge { ramp(n, o.staged_first_piece_bytes.div_ceil(v.span), max) } else { ramp(n, max, max) };
        if dir == Direction::Restore {
            sizes.reverse();
        }
        let k = &inner.dev.kernels;
        let u = if o.staged_unroll == 8 { 1 } else { 0 };
        let f = if dir == Direction::Save { k.save[u] } else { k.restore[u] };
        let cs = stg.copy.raw;
        let mut list = CopyList::with_capacity(stg.piece_slots);
        if dir == Direction::Save && *pieces == 0 {
            // As in `staged`: the copies start after everything queued on the lane so far.
            stg.sync.record(stream)?;
            stg.copy.wait_event(stg.sync.raw)?;
        }
        let mut p0 = 0usize;
        for cnt in sizes {
            let cnt = cnt as usize;
            let half = *pieces % 2;
            let st = stg.buf.ptr + (half * stg.piece_slots) as u64 * sb;
            let mut a = *args;
            // Pair r's chunk of arena x lands at st + r * span + (slot_offset(x) - off0).
            a.host_base = st.wrapping_sub(v.off0);
            a.slot_bytes = v.span;
            a.flags = FLAG_SLOT_IS_INDEX;
            a.item_begin = 0;
            a.item_end = cnt as u64 * v.spb as u64;
            if args.pairs != 0 {
                a.pairs = args.pairs + (p0 * std::mem::size_of::<KvtPair>()) as u64;
            } else {
                a.inline_pairs = [KvtPair::default(); INLINE_PAIRS];
                a.inline_pairs[..cnt].copy_from_slice(&args.inline_pairs[p0..p0 + cnt]);
            }
            let mut copies = || copy_runs(&batch[p0..p0 + cnt], pool, v, st, dir, cs, &mut list, o.batched_copies);
            if dir == Direction::Save {
                if *pieces >= 2 {
                    Stream::wait_raw(stream, stg.half_free[half].raw)?;
                }
                // SAFETY: as the staged launches in `staged`; FLAG_SLOT_IS_INDEX with the
                // piece-relative pair list keeps every access below cnt * span <= one half.
                unsafe { launch(f, o.staged_ctas, COPY_THREADS, stream, &a)? };
                stg.step.record(stream)?;
                stg.copy.wait_event(stg.step.raw)?;
                copies()?;
                stg.half_free[half].record(cs)?;
            } else {
                stg.copy.wait_event(stg.half_free[half].raw)?;
                copies()?;
                stg.step.record(cs)?;
                Stream::wait_raw(stream, stg.step.raw)?;
                // SAFETY: as above.
                unsafe { launch(f, o.staged_ctas, COPY_THREADS, stream, &a)? };
                stg.half_free[half].record(stream)?;
            }
            *pieces += 1;
            p0 += cnt;
        }
        Ok(())
    }
}

/// `batch` ordered by host slot (validated batches have distinct slots for a save; a restore's
/// repeated slots stay together).
fn by_slot(batch: &[CopyPair]) -> Vec<CopyPair> {
    let mut v = batch.to_vec();
    v.sort_by_key(|p| p.slot);
    v
}

/// Queues on `cs` the copy-engine copies of group `v` of `pairs` between their host slots and the
/// packed staging half at `st` (pair `r` at `st + r * span`): one 2-D copy per run of consecutive
/// host slots (one 1-D copy when the group is the whole slot or the run is one slot). The 1-D
/// copies go through `list`, submitted at the end in one call where `batched` allows (the copies
/// of a piece touch disjoint bytes, so their order on the stream is free).
#[allow(clippy::too_many_arguments)]
fn copy_runs(
    pairs: &[CopyPair],
    pool: BoundPool,
    v: &GroupView,
    st: u64,
    dir: Direction,
    cs: sys::CUstream,
    list: &mut CopyList,
    batched: bool,
) -> Result<(), CopyError> {
    let sb = pool.slot_bytes;
    let mut r = 0;
    while r < pairs.len() {
        let mut e = r + 1;
        while e < pairs.len() && pairs[e].slot == pairs[e - 1].slot + 1 {
            e += 1;
        }
        let rows = (e - r) as u64;
        let host = pool.alias + pairs[r].slot as u64 * sb + v.off0;
        let dev = st + r as u64 * v.span;
        let (dst, src) = if dir == Direction::Save { (host, dev) } else { (dev, host) };
        if rows == 1 || v.span == sb {
            // The whole slot (off0 = 0): consecutive slots are contiguous on both sides.
            let len = if v.span == sb { rows * sb } else { v.span };
            list.push(dst, src, len as usize);
        } else {
            let (host_pitch, dev_pitch) = (sb as usize, v.span as usize);
            let (src_pitch, dst_pitch) =
                if dir == Direction::Save { (dev_pitch, host_pitch) } else { (host_pitch, dev_pitch) };
            let unified = sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED;
            let m = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: unified,
                srcHost: std::ptr::null(),
                srcDevice: src,
                srcArray: std::ptr::null_mut(),
                srcPitch: src_pitch,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: unified,
                dstHost: std::ptr::null_mut(),
                dstDevice: dst,
                dstArray: std::ptr::null_mut(),
                dstPitch: dst_pitch,
                WidthInBytes: v.span as usize,
                Height: rows as usize,
            };
            // A strided copy between the pool's device alias and a device buffer has no
            // `driver::result` wrapper.
            // SAFETY: `rows` rows of `span` bytes: on the host side inside consecutive slots of the
            // registered pool (ids validated), on the device side inside the staging half.
            ck("cuMemcpy2DAsync", unsafe { sys::cuMemcpy2DAsync_v2(&m, cs) })?;
        }
        r = e;
    }
    // SAFETY: every range lies inside the staging half (rows * span <= one half) and the
    // registered pool (slot ids validated); ordered with the kernels by the caller's events.
    unsafe { list.submit(cs, batched) }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn pairs_go_in_slot_order_keeping_each_page_with_its_slot() {
        let batch = [CopyPair::new(7, 12), CopyPair::new(3, 10), CopyPair::new(9, 11), CopyPair::new(1, 13)];
        let s = by_slot(&batch);
        assert_eq!(s.iter().map(|p| p.slot).collect::<Vec<_>>(), [10, 11, 12, 13]);
        assert_eq!(s.iter().map(|p| p.gpu_page).collect::<Vec<_>>(), [3, 9, 7, 1]);
    }

    #[test]
    fn group_views_tile_the_segment_table_and_the_slot() {
        for (preset, n) in [("glm52", 78u32), ("glm52", 8), ("glm52", 1), ("llama3-8b", 32), ("qwen3-4b", 5)] {
            let g = Geometry::preset(preset, 4).unwrap();
            let segs = crate::cuda::desc::segment_table(&g).unwrap();
            let groups = LayerGroups::new(&g, n).unwrap();
            let v = group_views(&g, &groups);
            assert_eq!(v.len(), groups.len());
            assert_eq!((v[0].seg0, v[0].off0), (0, 0));
            for w in v.windows(2) {
                assert_eq!(w[0].seg0 + w[0].spb, w[1].seg0);
                assert_eq!(w[0].off0 + w[0].span, w[1].off0);
            }
            let last = v.last().unwrap();
            assert_eq!(last.seg0 + last.spb, segs.len() as u32);
            assert_eq!(last.off0 + last.span, g.slot_bytes());
            // Every segment of a group belongs to one of the group's arenas.
            for (k, gv) in v.iter().enumerate() {
                let r = groups.arenas(k);
                for s in &segs[gv.seg0 as usize..(gv.seg0 + gv.spb) as usize] {
                    assert!(r.contains(&(s.arena as usize)), "{preset}/{n}: group {k}");
                }
            }
        }
        // GLM-5.2 layer 0: mla.L0 (41,984 B) and indexk.L0 (8,448 B), both multiples of 256 B.
        let g = Geometry::preset("glm52", 4).unwrap();
        let v = group_views(&g, &LayerGroups::new(&g, 78).unwrap());
        assert_eq!((v[0].spb, v[0].span), (14, 41_984 + 8_448));
    }
}

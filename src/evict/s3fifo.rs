//! S3-FIFO (see [`super::PolicyKind::S3Fifo`]).

use super::queue::{Fifo, InsertLog};
use super::{EvictionPolicy, InsertInfo, Residency};
use crate::slab::slot::SlotId;
use crate::sync::{AtomicU64, AtomicU8, Mutex, Ordering};

/// S3-FIFO: a small and a main FIFO, a ghost table of recently evicted key hashes, and a 2-bit
/// frequency per slot bumped by hits (lock-free). Queues and the ghost are private to the selector.
/// A proposed block leaves its queue; a cancelled proposal goes back (as the newest) to the queue it
/// came from, and the ghost learns a small-queue key only when its block is really evicted.
pub(crate) struct S3Fifo {
    freq: Box<[AtomicU8]>,
    key_hash: Box<[AtomicU64]>,
    residency: Residency,
    log: InsertLog,
    small_target: usize,
    state: Mutex<S3State>,
    /// The address of the ghost's first entry and its index mask, for prefetching an entry
    /// without the lock (the ghost is never resized; a prefetch reads nothing the program sees).
    ghost_at: usize,
    ghost_mask: usize,
}

struct S3State {
    small: Fifo,
    main: Fifo,
    /// Direct-mapped ghost of evicted key hashes (0 = empty), about `GHOST_FACTOR x capacity`.
    ghost: Vec<u64>,
    log_head: u64,
    /// For each proposed slot: whether it was proposed from the small FIFO.
    from_small: Vec<bool>,
}

impl S3Fifo {
    /// Ghost entries per slot (rounded up to a power of two).
    const GHOST_FACTOR: u64 = 4;

    /// An S3-FIFO for `capacity` slots (small FIFO: 10% of them, at least 1).
    pub(crate) fn new(capacity: u32) -> Self {
        let ghost_len = (Self::GHOST_FACTOR * capacity.max(1) as u64).next_power_of_two() as usize;
        let ghost = crate::sync::table(ghost_len, |_| 0u64).into_vec();
        S3Fifo {
            ghost_at: ghost.as_ptr() as usize,
            ghost_mask: ghost_len - 1,
            freq: crate::sync::table(capacity as usize, |_| AtomicU8::new(0)),
            key_hash: crate::sync::table(capacity as usize, |_| AtomicU64::new(0)),
            residency: Residency::new(capacity),
            log: InsertLog::new(capacity),
            small_target: (capacity as usize / 10).max(1),
            state: Mutex::new(S3State {
                small: Fifo::new(capacity),
                main: Fifo::new(capacity),
                ghost,
                log_head: 0,
                from_small: crate::sync::table(capacity as usize, |_| false).into_vec(),
            }),
        }
    }

    fn ghost_tag(&self, s: u32) -> u64 {
        self.key_hash[s as usize].load(Ordering::Relaxed).max(1)
    }

    /// Where in the ghost the tag `tag` (a key hash, at least 1) lives.
    fn ghost_index(&self, tag: u64) -> usize {
        tag as usize & self.ghost_mask
    }

    /// Starts loading the ghost entry of key hash `key_hash` into the caches.
    fn prefetch_ghost(&self, key_hash: u64) {
        let i = self.ghost_index(key_hash.max(1));
        crate::sync::prefetch_read((self.ghost_at as *const u64).wrapping_add(i));
    }
}

impl S3Fifo {
    /// Queues a newly resident slot: in main if the ghost remembers its key, else in small.
    fn enqueue(&self, st: &mut S3State, s: u32) {
        let tag = self.ghost_tag(s);
        let g = &mut st.ghost[self.ghost_index(tag)];
        if *g == tag {
            *g = 0;
            st.main.push_newest(s);
        } else {
            st.small.push_newest(s);
        }
    }

    /// The selection proper over the queued blocks; returns how many it proposed (at most `n`).
    fn walk(&self, st: &mut S3State, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) -> usize {
        let mut found = 0;
        // Blocks passed over because they are pinned, per queue, since that queue last made
        // progress: once a queue has been walked round with no progress, the other one is served,
        // so pinned blocks at the head of one queue never hide evictable blocks in the other.
        let (mut idle_small, mut idle_main) = (0usize, 0usize);
        while found < n {
            let small_live = st.small.len > 0 && idle_small < st.small.len;
            let main_live = st.main.len > 0 && idle_main < st.main.len;
            let from_small = match (small_live, main_live) {
                (false, false) => break,
                (true, false) => true,
                (false, true) => false,
                (true, true) => st.small.len >= self.small_target,
            };
            let s = if from_small { st.small.pop_oldest() } else { st.main.pop_oldest() }.expect("non-empty queue");
            let slot = SlotId(s);
            if !evictable(slot) {
                if from_small {
                    st.small.push_newest(s);
                    idle_small += 1;
                } else {
                    st.main.push_newest(s);
                    idle_main += 1;
                }
                continue;
            }
            // Every step below is progress: it lowers the sum over queued blocks of
            // (frequency + 1 if in the small FIFO + 1), so the loop ends.
            if from_small {
                idle_small = 0;
            } else {
                idle_main = 0;
            }
            let f = &self.freq[s as usize];
            let v = f.load(Ordering::Relaxed);
            if v > 0 {
                // Hit since it was queued: promote (small) or reinsert one step colder (main).
                f.store(if from_small { 0 } else { v - 1 }, Ordering::Relaxed);
                st.main.push_newest(s);
                idle_main = 0;
                continue;
            }
            self.residency.propose(slot);
            st.from_small[s as usize] = from_small;
            out.push(slot);
            found += 1;
        }
        found
    }
}

impl EvictionPolicy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }
    fn on_insert(&self, slot: SlotId, info: InsertInfo) {
        self.freq[slot.index()].store(0, Ordering::Relaxed);
        self.key_hash[slot.index()].store(info.key_hash, Ordering::Relaxed);
        self.residency.insert(slot);
        self.log.push(slot);
    }
    fn prefetch(&self, slot: SlotId, key_hash: u64) {
        crate::sync::prefetch_read(&self.freq[slot.index()]);
        crate::sync::prefetch_read(&self.key_hash[slot.index()]);
        self.residency.prefetch(slot);
        // Read when the next selection queues an inserted block, written when one is removed.
        self.prefetch_ghost(key_hash);
    }
    fn on_hit(&self, slot: SlotId) {
        // Racy saturating increment: a lost update only under-counts a concurrent hit.
        let f = &self.freq[slot.index()];
        let v = f.load(Ordering::Relaxed);
        if v < 3 {
            f.store(v + 1, Ordering::Relaxed);
        }
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        let mut guard = crate::sync::lock(&self.state);
        let st = &mut *guard;
        let residency = &self.residency;
        // A logged slot is queued unless it already is (found by a recovery) or is no longer
        // offerable (recovered, then proposed or evicted).
        let unqueued =
            |st: &S3State, s: u32| residency.offerable(SlotId(s)) && !st.small.contains(s) && !st.main.contains(s);
        let mut head = st.log_head;
        self.log.drain(&mut head, |s| {
            if unqueued(st, s) {
                self.enqueue(st, s);
            }
        });
        st.log_head = head;
        let mut found = self.walk(st, n, evictable, out);
        if found < n && self.log.behind(st.log_head) {
            let mut missed = Vec::new();
            self.log.recover(residency.capacity(), |s| unqueued(st, s), |s| missed.push(s));
            if !missed.is_empty() {
                for s in missed {
                    self.enqueue(st, s);
                }
                found += self.walk(st, n - found, evictable, out);
            }
        }
        let _ = found;
    }
    fn on_cancel(&self, slot: SlotId) {
        let mut st = crate::sync::lock(&self.state);
        self.residency.cancel(slot);
        if st.from_small[slot.index()] {
            st.small.push_newest(slot.0);
        } else {
            st.main.push_newest(slot.0);
        }
    }
    fn on_remove(&self, slot: SlotId) {
        let mut st = crate::sync::lock(&self.state);
        self.residency.remove(slot);
        if st.from_small[slot.index()] {
            let tag = self.ghost_tag(slot.0);
            st.ghost[self.ghost_index(tag)] = tag;
        }
    }
}

impl std::fmt::Debug for S3Fifo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Fifo").field("residency", &self.residency).field("small_target", &self.small_target).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::contract_tests::select_and_evict;
    use super::*;

    fn info(h: u64) -> InsertInfo {
        InsertInfo::new(h, None)
    }

    #[test]
    fn promotes_hit_blocks_and_admits_ghosts_to_main() {
        let p = S3Fifo::new(10); // small FIFO target: 1 slot
        for s in 0..5 {
            p.on_insert(SlotId(s), info(100 + s as u64));
        }
        p.on_hit(SlotId(1));
        assert_eq!(select_and_evict(&p, 1, &|_| true), vec![SlotId(0)], "oldest unhit small block");
        assert_eq!(select_and_evict(&p, 1, &|_| true), vec![SlotId(2)], "slot 1 was hit: moved to main");
        // Key 100 (evicted from slot 0) is in the ghost: it enters main directly.
        p.on_insert(SlotId(0), info(100));
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(3), SlotId(4)]);
        // Small is empty: main in FIFO order, slot 1 (promoted first), then slot 0.
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(1), SlotId(0)]);
    }

    #[test]
    fn main_reinserts_by_frequency() {
        let p = S3Fifo::new(10);
        for s in 0..3 {
            p.on_insert(SlotId(s), info(s as u64));
            p.on_hit(SlotId(s));
        }
        let mut out = vec![];
        p.select_victims(1, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(0)], "all promoted with frequency reset: slot 0 is main's oldest");
        p.on_remove(SlotId(0));
        p.on_hit(SlotId(1));
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(2), SlotId(1)]);
    }

    #[test]
    fn pinned_blocks_in_main_do_not_hide_evictable_blocks_in_small() {
        let p = S3Fifo::new(30); // small target 3
        for s in 0..4 {
            p.on_insert(SlotId(s), info(s as u64));
            p.on_hit(SlotId(s));
        }
        // All hit: the selection promotes 0..4 to main and proposes main's oldest; cancel it.
        let mut out = vec![];
        p.select_victims(1, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(0)]);
        p.on_cancel(SlotId(0));
        // Two unhit blocks in small (below its target of 3, so main is served first).
        p.on_insert(SlotId(4), info(4));
        p.on_insert(SlotId(5), info(5));
        // Main holds only pinned blocks: the small blocks must still be offered.
        assert_eq!(select_and_evict(&p, 2, &|s| s.0 >= 4), vec![SlotId(4), SlotId(5)]);
    }

    /// Issue 19 item 10: a commit half-way into the insert log (its position claimed, not yet
    /// written) must not hide a block committed after it: the selection recovers it. Seeded bug
    /// `insert-log-hole`.
    #[test]
    fn a_commit_half_way_into_the_log_does_not_hide_a_later_one() {
        let p = S3Fifo::new(4);
        p.on_insert(SlotId(0), info(0));
        // Another rank's commit of slot 1: resident, its log position claimed but not written.
        p.residency.insert(SlotId(1));
        let hole = p.log.claim_unwritten();
        p.on_insert(SlotId(2), info(2));
        let ready = |s: SlotId| s.0 != 1; // slot 1 is not ready yet
        assert_eq!(select_and_evict(&p, 2, &ready), vec![SlotId(0), SlotId(2)], "the block behind the hole is offered");
        // The late write lands: slot 1 is queued once, and nothing is queued twice.
        p.log.write_at(hole, SlotId(1));
        assert_eq!(select_and_evict(&p, 4, &|_| true), vec![SlotId(1)]);
    }
}

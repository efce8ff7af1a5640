//! Prefix-aware frequency-weighted recency (see [`super::PolicyKind::PrefixLfu`]) and its TinyLFU
//! doorkeeper variant ([`super::PolicyKind::PrefixTinyLfu`]).

use super::minisim::Tuner;
use super::order::VictimOrder;
use super::probation::Probation;
use super::{EvictionPolicy, InsertInfo, Ranking, Residency};
use crate::slab::slot::SlotId;
use crate::sync::{AtomicU64, AtomicU8, Mutex, Ordering};

/// Prefix-aware frequency-weighted recency (see [`super::PolicyKind::PrefixLfu`]). Inserts and hits take
/// a tick (one `fetch_add`, as LRU) and bump the key's count in a count-min history (two 4-bit
/// counters per key in a byte table of `256 x capacity` entries, conservative update); all
/// lock-free. Ageing halves every counter once per `64 x capacity` references **lazily**: a
/// selection only advances the history's epoch; each counter byte carries, in its high 4 bits, the
/// epoch its count was last written at, and is read halved once per epoch since (see
/// [`PrefixLfu::read_cell`]); a sweep driven by the references reads a bounded run of counters
/// every 64 references (the whole table once per 4 ageing periods) and re-tags those 4 epochs old
/// or more, so a tag stays within 8 epochs of the present and never near the 16 its 4 bits tell
/// apart; a tag up to 3 epochs *ahead* (written by a thread that read the epoch after the reader
/// did) reads as current. No ageing step touches the table under a lock. Selection pops the
/// lowest scores from a [`VictimOrder`] with one bucket per history count (the score is
/// `tick - 2 x depth` plus the count times the weight, which the tuner may change: each bucket's
/// order does not depend on it). With the doorkeeper ([`PrefixLfu::with_doorkeeper`],
/// [`super::PolicyKind::PrefixTinyLfu`]) admission reads the key's two
/// history counters and, for a refused key, bumps them: also lock-free. The adaptive variant
/// ([`PrefixLfu::adaptive`]) keeps a [`Probation`] (one byte per slot, two counters) and refuses
/// the pages of a prefix save past [`Probation::room`] (see [`super::probation`]).
pub(crate) struct PrefixLfu {
    /// Per slot, packed so a selection reads one word: last touch tick (high 44 bits), prompt depth
    /// (16 bits, saturated) and the key's history count as of that touch (low 4 bits).
    meta: Box<[AtomicU64]>,
    key_hash: Box<[AtomicU64]>,
    clock: AtomicU64,
    /// The count-min history: per counter byte, the epoch of its last write (mod 16, high 4 bits)
    /// and its count then (low 4 bits).
    history: Box<[AtomicU8]>,
    history_mask: u64,
    /// Ageings so far: the history's epoch (every counter reads halved once per epoch since its
    /// tag). Advanced by a selection once per `age_period` references (of selections running at
    /// once, the one whose swap of `aged_at` wins).
    epoch: AtomicU64,
    /// Clock value at the last ageing (the clock counts references: one tick per insert or hit).
    aged_at: AtomicU64,
    age_period: u64,
    /// The next history counter the sweep re-tags (wraps over the table).
    sweep_next: AtomicU64,
    /// Counters the sweep reads every [`PrefixLfu::SWEEP_EVERY`] references: a whole table per
    /// [`PrefixLfu::SWEEP_LAP`] ageing periods' worth of references.
    sweep_run: u64,
    /// Ticks one reference of history is worth (tuned by `tuner` when there is one).
    weight: AtomicU64,
    /// Mini caches that tune `weight` ([`super::PolicyKind::AdaptiveLfu`]).
    tuner: Option<Mutex<Tuner>>,
    /// Keys sampled by the tuner (see [`Tuner::sampled`]).
    sample_threshold: u64,
    /// Clock value when the tuner last chose a weight.
    tuned_at: AtomicU64,
    /// Refuse keys without history ([`super::PolicyKind::PrefixTinyLfu`]).
    doorkeeper: bool,
    /// Probationary admission ([`super::probation`]; the default, [`super::PolicyKind::AdaptiveLfu`]).
    probation: Option<Probation>,
    residency: Residency,
    pub(super) order: VictimOrder,
}

impl PrefixLfu {
    /// Largest count kept per key (4 bits).
    const MAX_COUNT: u8 = 15;
    /// History bytes per slot. The history must tell apart the keys of many more blocks than the
    /// pool holds (the conversation trace has 1.46 M distinct pages): at 16 per slot collisions
    /// cost a third of the hits (0.065 against 0.091 at 9,952 slots), 256 per slot is 2.5 MiB for
    /// a 32 GiB GLM-5.2 pool.
    const HISTORY_PER_SLOT: u64 = 256;
    /// References between two steps of the history sweep (each step reads `sweep_run` counters).
    const SWEEP_EVERY: u64 = 64;
    /// Ageing periods' worth of references per lap of the sweep over the whole table. A counter
    /// visited at an age below [`PrefixLfu::SWEEP_AGE`] is left; the next visit comes at most
    /// `SWEEP_LAP + 1` ageings later (ageings come at most once per period), so no tag is more
    /// than `SWEEP_AGE - 1 + SWEEP_LAP + 1 = 8` epochs old while the sweep keeps pace. The ages
    /// from 9 to 12 are slack for a sweep step that stalls (a thread descheduled inside it): ages
    /// from [`PrefixLfu::AHEAD_FROM`] on are read as tags ahead of the reader.
    const SWEEP_LAP: u64 = 4;
    /// The age (in epochs) from which the sweep re-tags a counter. From 4 on, a 4-bit count has
    /// been halved to 0 (to 1 with the doorkeeper's rounding up), so a re-tag writes that.
    const SWEEP_AGE: u8 = 4;
    /// Ages from 13 to 15 mean a tag 3 to 1 epochs *ahead* of the reader's epoch: a bump that read
    /// the epoch after an ageing wrote it while this reader held the epoch from before. Such a
    /// counter reads as current (its count), neither wiped nor re-tagged.
    const AHEAD_FROM: u8 = 13;

    /// Whether a prefix save of `missing` pages floods the pool: more than 3/4 of its slots.
    /// Probationary admission limits only such saves. (Chosen on the generated shapes of the
    /// policy table, `docs/benchmarks.md`: from 5/8 a burst over a long document loses hits to
    /// SIEVE at 1,244 slots; from 7/8 the agentic shape loses to 2Q there.)
    fn floods(&self, missing: usize) -> bool {
        let cap = self.meta.len();
        // (Seeded bug, tests only: `probation-floods-always` limits every save, as 2Q does.)
        missing > cap - cap / 4 || crate::seeded::seeded("probation-floods-always")
    }

    /// A prefix-aware LFU for `capacity` slots.
    pub(crate) fn new(capacity: u32) -> Self {
        let c = capacity.max(1) as u64;
        let hist = (Self::HISTORY_PER_SLOT * c).next_power_of_two();
        PrefixLfu {
            meta: crate::sync::table(capacity as usize, |_| AtomicU64::new(0)),
            key_hash: crate::sync::table(capacity as usize, |_| AtomicU64::new(0)),
            clock: AtomicU64::new(1),
            history: crate::sync::table(hist as usize, |_| AtomicU8::new(0)),
            history_mask: hist - 1,
            epoch: AtomicU64::new(0),
            aged_at: AtomicU64::new(0),
            age_period: 64 * c,
            sweep_next: AtomicU64::new(0),
            sweep_run: (hist * Self::SWEEP_EVERY).div_ceil(Self::SWEEP_LAP * 64 * c),
            weight: AtomicU64::new(8 * c),
            tuner: None,
            sample_threshold: 0,
            tuned_at: AtomicU64::new(0),
            doorkeeper: false,
            probation: None,
            residency: Residency::new(capacity),
            order: VictimOrder::new(capacity, Self::MAX_COUNT as usize + 1),
        }
    }

    /// A prefix-aware LFU for `capacity` slots that admits only keys with a history reference
    /// (see [`super::PolicyKind::PrefixTinyLfu`]).
    pub(crate) fn with_doorkeeper(capacity: u32) -> Self {
        PrefixLfu { doorkeeper: true, ..Self::new(capacity) }
    }

    /// A prefix-aware LFU for `capacity` slots whose weight is tuned online by miniature
    /// simulations, with probationary admission (see [`super::PolicyKind::AdaptiveLfu`]); it
    /// starts as LRU (weight 0).
    pub(crate) fn adaptive(capacity: u32) -> Self {
        let tuner = Tuner::new(capacity);
        PrefixLfu {
            weight: AtomicU64::new(0),
            sample_threshold: tuner.threshold(),
            tuner: Some(Mutex::new(tuner)),
            probation: Some(Probation::new(capacity)),
            ..Self::new(capacity)
        }
    }

    /// Replays a reference of key hash `h`, whose history count is now `count`, through the
    /// tuner's mini caches if the key is sampled. Never waits: a reference that finds the mini
    /// caches busy is not replayed.
    fn sample(&self, h: u64, count: u8) {
        let Some(t) = &self.tuner else { return };
        if Tuner::sampled(self.sample_threshold, h) {
            if let Ok(mut t) = t.try_lock() {
                t.reference(h, count);
            }
        }
    }

    fn cells(&self, h: u64) -> [usize; 2] {
        [(h & self.history_mask) as usize, (h.rotate_right(32) & self.history_mask) as usize]
    }

    /// The count a history byte `v` holds at epoch `epoch`: its count halved once per epoch since
    /// its tag (rounded down; rounded up with the doorkeeper, so a key once seen stays seen). Equal
    /// to halving the whole table at every ageing: `floor(floor(c / 2) / 2) = floor(c / 4)`, and
    /// the same for `ceil`. A tag at most 12 epochs old is read exactly (the sweep keeps every tag
    /// within 8 epochs of the present); one 1 to 3 epochs ahead of `epoch` reads as current
    /// ([`PrefixLfu::AHEAD_FROM`]).
    #[inline(always)]
    fn read_cell(&self, v: u8, epoch: u64) -> u8 {
        let count = v & 15;
        let age = Self::age(v, epoch);
        // Seeded bugs (tests only): `history-age-ignored` reads the count as written, unhalved;
        // `history-ahead-wiped` reads a tag ahead of the reader as 13 to 15 epochs old.
        if age == 0
            || (age >= Self::AHEAD_FROM && !crate::seeded::seeded("history-ahead-wiped"))
            || crate::seeded::seeded("history-age-ignored")
        {
            return count;
        }
        match (self.doorkeeper, age) {
            (false, 0..=3) => count >> age,
            (false, _) => 0,
            (true, 0..=3) => (count + (1 << age) - 1) >> age,
            (true, _) => count.min(1),
        }
    }

    /// Epochs from the tag of history byte `v` to `epoch`, mod 16 (13 to 15: a tag ahead).
    #[inline(always)]
    fn age(v: u8, epoch: u64) -> u8 {
        (epoch as u8).wrapping_sub(v >> 4) & 15
    }

    /// The history byte for `count` written at `epoch`.
    #[inline]
    fn cell_value(epoch: u64, count: u8) -> u8 {
        (((epoch & 15) as u8) << 4) | (count & 15)
    }

    /// Key hash `h`'s two counters at epoch `e`: their cells and the counts they read.
    #[inline(always)]
    fn counters(&self, h: u64, e: u64) -> ([usize; 2], [u8; 2]) {
        let [i0, i1] = self.cells(h);
        let r0 = self.read_cell(self.history[i0].load(Ordering::Relaxed), e);
        let r1 = self.read_cell(self.history[i1].load(Ordering::Relaxed), e);
        ([i0, i1], [r0, r1])
    }

    /// The key's reference count (the smaller of its two counters).
    fn count(&self, h: u64) -> u8 {
        let (_, [r0, r1]) = self.counters(h, self.epoch.load(Ordering::Relaxed));
        r0.min(r1)
    }

    /// Counts one reference of key hash `h` (conservative update: only the counters at the
    /// minimum grow; racy increments may be lost, which only under-counts: a bump holding the
    /// epoch from before an ageing tags its write one epoch old, so it reads halved once more).
    /// Returns the key's new count.
    fn bump(&self, h: u64) -> u8 {
        let e = self.epoch.load(Ordering::Relaxed);
        let ([i0, i1], [r0, r1]) = self.counters(h, e);
        let m = r0.min(r1);
        if m >= Self::MAX_COUNT {
            return m;
        }
        let v = Self::cell_value(e, m + 1);
        if r0 == m {
            self.history[i0].store(v, Ordering::Relaxed);
        }
        if r1 == m {
            self.history[i1].store(v, Ordering::Relaxed);
        }
        m + 1
    }

    /// One step of the history sweep, taken by every [`PrefixLfu::SWEEP_EVERY`]-th reference
    /// (out of line: the reference path stays short): reads the next `sweep_run` counters and
    /// re-tags with the present epoch each that is [`PrefixLfu::SWEEP_AGE`] epochs old or more
    /// (and not ahead of this step's epoch, [`PrefixLfu::AHEAD_FROM`]: a step holding an epoch
    /// from before an ageing leaves a counter a newer bump wrote), rewritten with the count it
    /// reads now (a compare-exchange: a counter a bump wrote meanwhile is fresh already and kept).
    /// Counters holding zero are left alone (a zero reads zero at any age). Lock-free; one or two
    /// counter reads per reference, and a write only for a counter no reference has written for 4
    /// ageing periods.
    #[cold]
    #[inline(never)]
    fn sweep_step(&self) {
        if crate::seeded::seeded("history-sweep-skipped") {
            return;
        }
        let e = self.epoch.load(Ordering::Relaxed);
        let start = self.sweep_next.fetch_add(self.sweep_run, Ordering::Relaxed);
        for i in start..start + self.sweep_run {
            let cell = &self.history[(i & self.history_mask) as usize];
            let v = cell.load(Ordering::Relaxed);
            let age = Self::age(v, e);
            if v & 15 == 0 || !(Self::SWEEP_AGE..Self::AHEAD_FROM).contains(&age) {
                continue;
            }
            let fresh = Self::cell_value(e, self.read_cell(v, e));
            let _ = cell.compare_exchange(v, fresh, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// Records a touch of `slot` now: its depth (`None`: keep the recorded one) and count.
    /// Returns true if the slot's count fell (its score may be below its victim-order entry's).
    fn touch(&self, slot: SlotId, depth: Option<u32>, count: u8) -> bool {
        let t = self.clock.fetch_add(1, Ordering::Relaxed);
        if t % Self::SWEEP_EVERY == 0 {
            self.sweep_step();
        }
        let cell = &self.meta[slot.index()];
        let old = cell.load(Ordering::Relaxed);
        let d = match depth {
            Some(d) => d.min(0xffff) as u64,
            None => (old >> 4) & 0xffff,
        };
        // A concurrent touch of the same slot may win: either leaves a valid recent word.
        cell.store(((t & ((1 << 44) - 1)) << 20) | (d << 4) | (count & 15) as u64, Ordering::Relaxed);
        count & 15 < (old & 15) as u8
    }

    /// The victim-order place of `s`: its bucket (history count) and its key within the bucket.
    #[inline]
    fn place(&self, s: usize) -> (u8, i64) {
        let m = self.meta[s].load(Ordering::Relaxed);
        let (t, d, c) = ((m >> 20) as i64, ((m >> 4) & 0xffff) as i64, (m & 15) as u8);
        (c, t - 2 * d)
    }

    /// The eviction score: lower goes first.
    #[inline]
    fn score(&self, weight: i64, s: usize) -> i64 {
        let m = self.meta[s].load(Ordering::Relaxed);
        let (t, d, c) = ((m >> 20) as i64, ((m >> 4) & 0xffff) as i64, (m & 15) as i64);
        t + weight * c - 2 * d
    }
}

impl EvictionPolicy for PrefixLfu {
    fn name(&self) -> &'static str {
        if self.tuner.is_some() {
            "adaptive-lfu"
        } else if self.doorkeeper {
            "prefix-tinylfu"
        } else {
            "prefix-lfu"
        }
    }
    fn admit(&self, info: InsertInfo) -> bool {
        if let Some(p) = &self.probation {
            // Probationary admission: a page of a prefix save that floods the pool, past the room
            // probation leaves, is refused, whatever its history (a page seen before is as likely
            // to belong to a request larger than the pool again), and counted, so it ranks as seen
            // when it comes back.
            let Some(pos) = Probation::position(info.depth, info.resumed_at) else { return true };
            // A save into which most of the pool would go is limited; a smaller one is not (a
            // document a burst of requests reads at once is worth its slots).
            let missing = info.save_missing.map_or(usize::MAX, |m| m as usize);
            if pos < p.room() || !self.floods(missing) {
                return true;
            }
            self.bump(info.key_hash);
            return false;
        }
        if !self.doorkeeper || self.count(info.key_hash) > 0 {
            return true;
        }
        // First sighting: remember it (so the next one is admitted) but do not take a slot.
        self.bump(info.key_hash);
        false
    }
    fn on_insert(&self, slot: SlotId, info: InsertInfo) {
        self.key_hash[slot.index()].store(info.key_hash, Ordering::Relaxed);
        let count = self.bump(info.key_hash);
        self.sample(info.key_hash, count);
        self.touch(slot, Some(info.depth.unwrap_or(0)), count);
        if let Some(p) = &self.probation {
            p.insert(slot, count > 1);
        }
        self.residency.insert(slot);
        self.order.mark(slot);
    }
    fn prefetch(&self, slot: SlotId, key_hash: u64) {
        // The two history counters (the table is 256 B a slot: far beyond the caches of a large
        // pool) and the slot's metadata words.
        for i in self.cells(key_hash) {
            crate::sync::prefetch_read(&self.history[i]);
        }
        crate::sync::prefetch_read(&self.meta[slot.index()]);
        crate::sync::prefetch_read(&self.key_hash[slot.index()]);
        if let Some(p) = &self.probation {
            p.prefetch(slot);
        }
        self.residency.prefetch(slot);
    }
    fn on_hit(&self, slot: SlotId) {
        let h = self.key_hash[slot.index()].load(Ordering::Relaxed);
        let c = self.bump(h);
        self.sample(h, c);
        if let Some(p) = &self.probation {
            p.hit(slot);
        }
        // A count that fell (the history was halved since the last touch) lowers the score below
        // the slot's victim-order entry: re-placed at the next selection.
        // (Seeded bug, tests only: `victim-order-count-fall-lost` forgets to say so.)
        if self.touch(slot, None, c) && !crate::seeded::seeded("victim-order-count-fall-lost") {
            self.order.mark(slot);
        }
    }
    fn concurrent_selection(&self) -> bool {
        // The victim order's shards let selections run at once (see `VictimOrder::select`).
        true
    }
    fn on_cancel(&self, slot: SlotId) {
        self.residency.cancel(slot);
        self.order.mark(slot);
    }
    fn on_reclass(&self, slot: SlotId) {
        self.order.mark(slot);
    }
    fn on_remove(&self, slot: SlotId) {
        if let Some(p) = &self.probation {
            p.remove(slot);
        }
        self.residency.remove(slot);
    }
    fn file_pending(&self, ranking: &Ranking<'_>) {
        self.order.file_marks(ranking, &self.residency, |s| self.place(s));
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        self.select_ranked(n, &Ranking::plain(&|s| evictable(s).then_some(0)), out);
    }
    fn select_ranked(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>) {
        self.select_with(n, ranking, out, false);
    }
}

impl PrefixLfu {
    /// The selection by a scan of every slot (what the victim order replaces): the reference the
    /// order's tests compare it with (same tuning and ageing steps).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn select_by_scan(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>) {
        self.select_with(n, ranking, out, true);
    }

    fn select_with(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>, scan: bool) {
        if n == 0 {
            return;
        }
        if let Some(t) = &self.tuner {
            let cap = self.meta.len() as u64;
            if self.turn_due(&self.tuned_at, cap.max(1)) {
                let w = crate::sync::lock(t).choose();
                self.weight.store(w * cap, Ordering::Relaxed);
            }
        }
        // Ageing: every counter now reads halved once more, so old popularity fades
        // (`read_cell`); nothing in the table is written here. With the doorkeeper, halving rounds
        // up: a key seen once stays seen (else a first sighting just before an ageing would be
        // refused again at its second).
        if self.turn_due(&self.aged_at, self.age_period) {
            self.epoch.fetch_add(1, Ordering::Relaxed);
        }
        // The score already puts a chain's deeper blocks first (its depth term), so the chain view
        // is not used: only the tier's classes (orphans first, hinted blocks last) are.
        let ranking = Ranking { chain: None, ..*ranking };
        let weight = self.weight.load(Ordering::Relaxed) as i64;
        if scan {
            return self.residency.propose_lowest_ranked(n, &ranking, |s| self.score(weight, s), out);
        }
        self.order.select(n, &ranking, &self.residency, |s| self.place(s), |c| weight * c as i64, out);
    }

    /// True if this selection takes the periodic step (tuning, ageing) whose last run the clock
    /// value `mark` records: `period` references have passed since, and of the selections running
    /// at once this one's swap moved the mark to the clock's present value (it only ever moves
    /// forward).
    fn turn_due(&self, mark: &AtomicU64, period: u64) -> bool {
        let now = self.clock.load(Ordering::Relaxed);
        let at = mark.load(Ordering::Relaxed);
        elapsed(now, at) >= period && mark.compare_exchange(at, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }
}

/// References from the mark `at` (the last tuning or ageing) to `now`: 0 when another selection
/// running at once moved the mark past this one's `now` (so the swap that follows only ever moves
/// a mark forward). (Seeded bug, tests only: `selection-mark-underflows` subtracts with wrapping,
/// so a mark ahead reads as a long time ago and is moved back.)
fn elapsed(now: u64, at: u64) -> u64 {
    if crate::seeded::seeded("selection-mark-underflows") {
        return now.wrapping_sub(at);
    }
    now.saturating_sub(at)
}

impl std::fmt::Debug for PrefixLfu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixLfu").field("doorkeeper", &self.doorkeeper).field("residency", &self.residency).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::contract_tests::select_and_evict;
    use super::super::PolicyKind;
    use super::*;

    fn info(key_hash: u64, depth: Option<u32>) -> InsertInfo {
        InsertInfo::new(key_hash, depth)
    }

    #[test]
    fn drops_a_chain_tail_first_and_keeps_keys_seen_again() {
        let p = PrefixLfu::new(4);
        for s in 0..4 {
            p.on_insert(SlotId(s), info(10 + s as u64, Some(s)));
        }
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(3), SlotId(2)]);

        let p = PrefixLfu::new(4);
        p.on_insert(SlotId(0), info(1, None));
        p.on_insert(SlotId(1), info(2, None));
        assert_eq!(select_and_evict(&p, 1, &|s| s.0 == 0), vec![SlotId(0)]);
        p.on_insert(SlotId(0), info(1, None)); // key 1 again: its history says 2 references
        p.on_insert(SlotId(2), info(3, None));
        assert_eq!(select_and_evict(&p, 3, &|s| s.0 < 3), vec![SlotId(1), SlotId(2), SlotId(0)]);
    }

    #[test]
    fn tinylfu_admits_a_key_on_its_second_sighting_and_ranks_by_history() {
        let p = PrefixLfu::with_doorkeeper(4);
        assert_eq!(p.name(), "prefix-tinylfu");
        // Key 7 was never seen: refused, but counted.
        assert!(!p.admit(info(7, Some(0))));
        assert!(p.admit(info(7, Some(0))), "seen once before: admitted");
        p.on_insert(SlotId(0), info(7, Some(0))); // history: 2 references
                                                  // Keys 8 and 9 inserted without admission (a plain save): 1 reference each.
        p.on_insert(SlotId(1), info(8, Some(1)));
        p.on_insert(SlotId(2), info(9, Some(2)));
        assert!(p.admit(info(8, Some(1))), "inserted keys have history");
        // Scores: slot 0 = tick 1 + 2 x 32, slot 1 = 2 + 32 - 2, slot 2 = 3 + 32 - 4 (weight 8 x 4).
        assert_eq!(select_and_evict(&p, 3, &|s| s.0 < 3), vec![SlotId(2), SlotId(1), SlotId(0)]);

        // Without the doorkeeper everything is admitted and nothing is counted.
        let q = PrefixLfu::new(4);
        assert!(q.admit(info(7, Some(0))));
        assert_eq!(q.count(7), 0);
    }

    /// Ageing through the production path (references, then a selection once a period has
    /// passed): a key referenced 15 times and never again reads halved once per period (rounded
    /// up with the doorkeeper), exactly as if the whole table were halved at every ageing, for 20
    /// periods: past the 13 from which a tag reads as ahead of the reader (and the 16 its 4 bits
    /// tell apart), so the sweep must have re-tagged it.
    #[test]
    fn ageing_halves_every_count_once_per_period_and_no_tag_wraps() {
        // Keys whose two counters are distinct cells of the 1,024-cell table of a 4-slot policy.
        let (a, busy) = (0x0000_0005_0000_0001u64, 0x0000_0007_0000_0002u64);
        for doorkeeper in [false, true] {
            let p = if doorkeeper { PrefixLfu::with_doorkeeper(4) } else { PrefixLfu::new(4) };
            p.on_insert(SlotId(0), info(a, Some(0)));
            for _ in 0..14 {
                p.on_hit(SlotId(0));
            }
            assert_eq!(p.count(a), 15);
            p.on_insert(SlotId(1), info(busy, Some(0)));
            let (mut want, mut out) = (15u8, vec![]);
            for period in 1..=20 {
                // A period of references to another key, then a selection (which takes nothing).
                for _ in 0..p.age_period {
                    p.on_hit(SlotId(1));
                }
                p.select_victims(1, &|_| false, &mut out);
                want = if doorkeeper { want.div_ceil(2) } else { want / 2 };
                assert_eq!(p.count(a), want, "doorkeeper {doorkeeper}: after {period} ageings");
            }
            assert!(out.is_empty());
        }
    }

    /// A counter written by a bump that read the epoch after an ageing, read by a thread (or swept
    /// by a step) still holding the epoch from before it: its tag is one epoch ahead, which must
    /// read as the count written, not as 15 epochs old (wiped). Seeded bug `history-ahead-wiped`.
    #[test]
    fn a_counter_tagged_ahead_of_the_reader_keeps_its_count() {
        let a = 0x0000_0005_0000_0001u64;
        for doorkeeper in [false, true] {
            let p = if doorkeeper { PrefixLfu::with_doorkeeper(4) } else { PrefixLfu::new(4) };
            p.epoch.store(5, Ordering::Relaxed);
            p.on_insert(SlotId(0), info(a, Some(0)));
            for _ in 0..6 {
                p.on_hit(SlotId(0));
            }
            // The reader's epoch, loaded before the ageing to 5.
            p.epoch.store(4, Ordering::Relaxed);
            assert_eq!(p.count(a), 7, "doorkeeper {doorkeeper}: read at the epoch before");
            // A whole lap of sweep steps at that epoch leaves it.
            for _ in 0..(p.history_mask + 1).div_ceil(p.sweep_run) {
                p.sweep_step();
            }
            p.epoch.store(5, Ordering::Relaxed);
            assert_eq!(p.count(a), 7, "doorkeeper {doorkeeper}: after a sweep at the epoch before");
        }
    }

    #[test]
    fn only_prefix_tinylfu_refuses_admission_without_a_save() {
        // A page shown without the save it belongs to (no resume depth): only the doorkeeper
        // refuses it. Probationary admission limits the pages of a save (the next test).
        for &kind in PolicyKind::ALL {
            let p = kind.build(8);
            assert_eq!(p.admit(info(42, Some(3))), kind != PolicyKind::PrefixTinyLfu, "{kind}");
        }
    }

    /// The default's probationary admission: a save of more than 3/4 of the pool places at most
    /// the free slots plus the blocks on probation (at least the 10% target); the pages past that
    /// are refused and counted. A smaller save is placed whole. Seeded bugs
    /// `probation-room-ignores-free`, `probation-floods-always`.
    #[test]
    fn the_default_limits_only_a_save_that_floods_the_pool() {
        let p = PrefixLfu::adaptive(20); // target 2; a save of more than 15 pages floods
        let page = |key: u64, pos: u32, missing: u32| {
            InsertInfo::new(key, Some(50 + pos)).resumed_at(Some(50)).save_missing(Some(missing))
        };
        // Empty: 20 free slots and the target.
        assert!(p.admit(page(1, 21, 30)), "an empty pool has room for 22 pages");
        assert!(!p.admit(page(1, 22, 30)));
        for s in 0..20 {
            p.on_insert(SlotId(s), info(1000 + s as u64, Some(s)));
        }
        for s in 0..15 {
            p.on_hit(SlotId(s)); // used again: 15 protected, 5 on probation
        }
        assert!(p.admit(page(7, 4, 16)));
        assert!(!p.admit(page(8, 5, 16)), "the sixth page of a flooding save would take a protected block");
        assert_eq!(p.count(8), 1, "a refused page is counted");
        assert!(!p.admit(page(8, 5, 16)), "and refused again: its history does not matter");
        assert!(p.admit(page(9, 14, 15)), "a save of 3/4 of the pool is placed whole");
        assert!(p.admit(InsertInfo::new(10, Some(90))), "a page shown without its save is not limited");
        // The other variants admit everything.
        let q = PrefixLfu::new(20);
        assert!(q.admit(page(8, 19, 100)));
    }

    /// A selection that reads the clock, then finds the tuning and ageing marks moved past it by
    /// another selection running at once, neither tunes nor ages again, nor moves a mark back.
    /// Seeded bug `selection-mark-underflows`.
    #[test]
    fn a_mark_moved_past_a_selections_clock_stays_where_it_is() {
        let p = PrefixLfu::adaptive(8);
        for s in 0..8 {
            p.on_insert(SlotId(s), info(s as u64, Some(0)));
        }
        let now = p.clock.load(Ordering::Relaxed);
        // Another selection tuned and aged at a later clock value than this one will read.
        p.tuned_at.store(now + 1000, Ordering::Relaxed);
        p.aged_at.store(now + 1000, Ordering::Relaxed);
        let epoch = p.epoch.load(Ordering::Relaxed);
        let mut out = vec![];
        p.select_ranked(1, &Ranking::plain(&|_| Some(0)), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(p.tuned_at.load(Ordering::Relaxed), now + 1000, "the tuning mark was moved back");
        assert_eq!(p.aged_at.load(Ordering::Relaxed), now + 1000, "the ageing mark was moved back");
        assert_eq!(p.epoch.load(Ordering::Relaxed), epoch, "an extra ageing");
    }
}

//! Scheduler hints ([`crate::HostTier::hint`]): keys that queued requests will look up soon.
//! Eviction does not take a hinted block while an unhinted one is evictable (the hinted blocks form
//! the last preference classes, so they remain evictable when nothing else is: liveness holds).
//!
//! A hint is a set of keys with a deadline, named by a [`HintId`]; the engine withdraws it when the
//! request is admitted (or dropped), and a hint nobody withdraws stops protecting anything at its
//! deadline. Several hints may name one key (requests sharing a prefix): the key stays hinted until
//! the last of them is withdrawn or expires.
//!
//! State: a table (under one mutex, touched only by `hint`, `withdraw` and by saves while any hint
//! is live) from key to the hints naming it, and one word per slot, `tag(generation) << 32 |
//! deadline`, that the selector reads without a lock: a mark left by a block that was evicted
//! names an old generation and is ignored, so a reused slot never inherits a hint. Deadlines are
//! milliseconds since the tier was built, odd (so a mark is never 0), compared with wrapping
//! arithmetic: hints longer than [`MAX_HINT_TTL`] are cut to it.
//!
//! Memory: the table is charged [`HINT_BYTES`] a hint and [`HINTED_KEY_BYTES`] a key each hint
//! names (an upper bound of what its entries take, growth headroom included); a hint that would
//! take the charge past the tier's budget ([`Hints::set_budget`]; unbounded unless set, the daemon
//! sets `Limits::hint_bytes`) is refused with [`Limit::HintBytes`] and changes nothing. When hints go,
//! the tables shrink once they hold a quarter of their capacity, and a shrink that gave back at
//! least [`TRIM_AFTER`] bytes asks the allocator to return its free pages to the system.

use crate::error::{Limit, TierError};
use crate::index::SlotRef;
use crate::key::ContentKey;
use crate::slab::slot::{SlotControl, SlotId};
use crate::sync::{AtomicU64, AtomicUsize, Mutex, Ordering};
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// The longest a hint protects its keys (about 12 days: deadlines are compared in 31 bits of ms).
pub const MAX_HINT_TTL: Duration = Duration::from_millis(i32::MAX as u64 / 2);

/// A hint given to [`crate::HostTier::hint`]; withdraw it with [`crate::HostTier::withdraw_hint`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[must_use = "a hint is withdrawn only by its id (or when its time-to-live runs out)"]
pub struct HintId(u64);

impl HintId {
    /// The id whose number ([`HintId::get`]) is `n`: for ids that crossed a process or language
    /// boundary (the tier daemon, the Python binding). An id no `hint` returned withdraws nothing.
    pub fn from_number(n: u64) -> Self {
        HintId(n)
    }

    /// The id's number (ids are handed out in increasing order from 1, per tier).
    pub fn get(self) -> u64 {
        self.0
    }
}

/// The hints naming one key and their deadlines: one inline (most keys: no allocation of its
/// own), more on the heap.
enum Holders {
    One(u64, u64),
    Many(Vec<(u64, u64)>),
}

impl Holders {
    fn names(&self, id: u64) -> bool {
        match self {
            Holders::One(h, _) => *h == id,
            Holders::Many(v) => v.iter().any(|&(h, _)| h == id),
        }
    }

    fn push(&mut self, id: u64, deadline: u64) {
        match self {
            Holders::One(h, d) => *self = Holders::Many(vec![(*h, *d), (id, deadline)]),
            Holders::Many(v) => v.push((id, deadline)),
        }
    }

    /// Drops hint `id`; false once no hint is left.
    fn remove(&mut self, id: u64) -> bool {
        match self {
            Holders::One(h, _) => *h != id,
            Holders::Many(v) => {
                v.retain(|&(h, _)| h != id);
                let last = match v[..] {
                    [] => return false,
                    [(h, d)] => Some((h, d)),
                    _ => None,
                };
                if let Some((h, d)) = last {
                    *self = Holders::One(h, d);
                }
                true
            }
        }
    }

    /// The latest deadline.
    fn deadline(&self) -> Option<u64> {
        match self {
            Holders::One(_, d) => Some(*d),
            Holders::Many(v) => v.iter().map(|&(_, d)| d).max(),
        }
    }
}

/// Bytes the table is charged per hint: its entry in `hints` and in `by_deadline` (a B-tree's
/// share), with growth headroom.
pub const HINT_BYTES: usize = 256;
/// Bytes the table is charged per key a hint names: the key in the hint's own list, the key's
/// entry in the per-key map at twice its size (a hash table's growth headroom and control byte),
/// and one more holder on the heap (a key several hints name).
pub const HINTED_KEY_BYTES: usize = std::mem::size_of::<ContentKey>()
    + 2 * (std::mem::size_of::<(ContentKey, Holders)>() + 1)
    + std::mem::size_of::<(u64, u64)>();
/// A shrink of the tables that gives back at least this many bytes (by the charge) asks the
/// allocator to return its free pages to the system (`malloc_trim`, glibc).
pub(crate) const TRIM_AFTER: usize = 16 << 20;

#[derive(Default)]
struct Table {
    next: u64,
    /// Live hints: their keys and deadline.
    hints: HashMap<u64, (Vec<ContentKey>, u64)>,
    /// Per key, the live hints naming it and their deadlines.
    keys: HashMap<ContentKey, Holders>,
    /// Live hints by deadline, to drop expired ones.
    by_deadline: BTreeSet<(u64, u64)>,
    /// The charge of the live hints, bytes ([`HINT_BYTES`], [`HINTED_KEY_BYTES`]).
    bytes: usize,
    /// The charge when the tables last shrank (or grew from empty), bytes.
    bytes_at_shrink: usize,
}

/// The tier's hints (see the module docs).
pub(crate) struct Hints {
    epoch: Instant,
    marks: Box<[AtomicU64]>,
    table: Mutex<Table>,
    /// Live hints (a save looks at the table only when some exist).
    live: AtomicUsize,
    /// The most the table may be charged, bytes (see the module docs; `usize::MAX`: unbounded).
    budget: AtomicUsize,
}

#[inline]
fn tag(generation: u64) -> u64 {
    generation & 0xffff_ffff
}

impl Hints {
    pub(crate) fn new(capacity: u32) -> Self {
        Hints {
            epoch: Instant::now(),
            marks: crate::sync::table(capacity as usize, |_| AtomicU64::new(0)),
            table: Mutex::new(Table { next: 1, ..Table::default() }),
            live: AtomicUsize::new(0),
            budget: AtomicUsize::new(usize::MAX),
        }
    }

    /// Bounds what the live hints may be charged, bytes (see the module docs); hints already
    /// given are kept.
    pub(crate) fn set_budget(&self, bytes: usize) {
        self.budget.store(bytes, Ordering::Relaxed);
    }

    /// What the live hints are charged now, bytes, and the budget.
    pub(crate) fn bytes(&self) -> (usize, usize) {
        let t = crate::sync::lock(&self.table);
        (t.bytes, self.budget.load(Ordering::Relaxed))
    }

    /// The capacity of the per-key table, entries (tests: the table shrinks when hints go).
    pub(crate) fn key_capacity(&self) -> usize {
        crate::sync::lock(&self.table).keys.capacity()
    }

    /// Shrinks the tables once they are mostly empty; true if the charge fell by [`TRIM_AFTER`]
    /// or more since the last shrink (the caller trims the allocator once the lock is released).
    fn shrink(t: &mut Table) -> bool {
        // Seeded bug (tests only): `hint-tables-kept` keeps the tables at their largest.
        if crate::seeded::seeded("hint-tables-kept") {
            return false;
        }
        let sparse = |cap: usize, len: usize| cap > 1024 && cap / 4 > len;
        if !sparse(t.keys.capacity(), t.keys.len()) && !sparse(t.hints.capacity(), t.hints.len()) {
            return false;
        }
        t.keys.shrink_to_fit();
        t.hints.shrink_to_fit();
        let freed = t.bytes_at_shrink.saturating_sub(t.bytes);
        t.bytes_at_shrink = t.bytes;
        freed >= TRIM_AFTER
    }

    /// Asks the allocator to return its free pages to the system (glibc's `malloc_trim`; nothing
    /// elsewhere): the hash tables and key lists of large hints are freed into its arenas, which
    /// otherwise keep them resident.
    fn trim() {
        #[cfg(all(target_os = "linux", target_env = "gnu", not(loom)))]
        // SAFETY: malloc_trim takes a size and touches only the allocator's own state, under its
        // locks.
        unsafe {
            libc::malloc_trim(0);
        }
    }

    /// Milliseconds since the tier was built.
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The time stamp the selector compares marks with (see [`Hints::hinted`]).
    pub(crate) fn now(&self) -> u32 {
        self.now_ms() as u32
    }

    /// True while some hint is live (the selector skips the marks otherwise).
    pub(crate) fn any(&self) -> bool {
        self.live.load(Ordering::Relaxed) > 0
    }

    /// Live hints.
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// True if `slot`, holding `generation`, carries a mark that is live at `now`.
    #[inline]
    pub(crate) fn hinted(&self, slot: SlotId, generation: u64, now: u32) -> bool {
        let m = self.marks[slot.index()].load(Ordering::Relaxed);
        m != 0 && m >> 32 == tag(generation) && (m as u32).wrapping_sub(now) as i32 > 0
    }

    /// Sets (or clears) the mark of `r`'s block. A mark of another generation that is still the
    /// slot's (a lookup that raced an eviction and a reuse) is left alone.
    /// Returns true if it cleared a live mark of `r`'s block (the block's victim class fell).
    fn mark(&self, control: &SlotControl, r: SlotRef, deadline: Option<u64>) -> bool {
        let m = deadline.map_or(0, |d| (tag(r.generation) << 32) | (d as u32 | 1) as u64);
        let cell = &self.marks[r.slot.index()];
        let mut cur = cell.load(Ordering::Relaxed);
        loop {
            if cur != 0 && cur >> 32 != tag(r.generation) && cur >> 32 == tag(control.load(r.slot).generation()) {
                return false;
            }
            match cell.compare_exchange_weak(cur, m, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return m == 0 && cur != 0,
                Err(now) => cur = now,
            }
            crate::sync::spin_loop();
        }
    }

    /// Adds a hint on `keys` for `ttl`; `find` gives a key's block (ready or being written), if any.
    pub(crate) fn add(
        &self,
        control: &SlotControl,
        keys: &[ContentKey],
        ttl: Duration,
        find: impl Fn(&ContentKey) -> Option<SlotRef>,
        lowered: &dyn Fn(SlotId),
    ) -> Result<HintId, TierError> {
        let now = self.now_ms();
        let deadline = now + ttl.min(MAX_HINT_TTL).as_millis() as u64;
        let mut t = crate::sync::lock(&self.table);
        self.expire(control, &mut t, now, &find, lowered);
        if Self::shrink(&mut t) {
            drop(t);
            Self::trim();
            t = crate::sync::lock(&self.table);
        }
        let budget = self.budget.load(Ordering::Relaxed);
        let asked = t.bytes.saturating_add(HINT_BYTES.saturating_add(keys.len().saturating_mul(HINTED_KEY_BYTES)));
        // Seeded bug (tests only): `hint-bytes-unbounded` takes every hint whatever it costs.
        if asked > budget && !crate::seeded::seeded("hint-bytes-unbounded") {
            return Err(TierError::LimitExceeded { limit: Limit::HintBytes, asked: asked as u64, max: budget as u64 });
        }
        // Announce the hint before looking its keys up, with a read-modify-write of `live` (see
        // `on_reserve`): a save reserving one of the keys now either is seen by the lookups below,
        // or sees a live hint and waits for this table lock, then finds the key in the table.
        if !crate::seeded::seeded("hint-race") {
            self.live.swap(t.hints.len() + 1, Ordering::AcqRel);
        }
        let id = t.next;
        t.next += 1;
        let mut own: Vec<ContentKey> = Vec::with_capacity(keys.len());
        for k in keys {
            let d = match t.keys.entry(*k) {
                std::collections::hash_map::Entry::Occupied(mut e) => {
                    if e.get().names(id) {
                        continue; // a key named twice in one hint
                    }
                    e.get_mut().push(id, deadline);
                    e.get().deadline()
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(Holders::One(id, deadline));
                    Some(deadline)
                }
            };
            own.push(*k);
            if let Some(r) = find(k) {
                self.mark(control, r, d);
            }
        }
        t.bytes += HINT_BYTES + own.len() * HINTED_KEY_BYTES;
        t.bytes_at_shrink = t.bytes_at_shrink.max(t.bytes);
        t.hints.insert(id, (own, deadline));
        t.by_deadline.insert((deadline, id));
        self.live.store(t.hints.len(), Ordering::Release);
        Ok(HintId(id))
    }

    /// Withdraws hint `id`; false if it was withdrawn already or had expired.
    pub(crate) fn withdraw(
        &self,
        control: &SlotControl,
        id: HintId,
        find: impl Fn(&ContentKey) -> Option<SlotRef>,
        lowered: &dyn Fn(SlotId),
    ) -> bool {
        let now = self.now_ms();
        let mut t = crate::sync::lock(&self.table);
        self.expire(control, &mut t, now, &find, lowered);
        let found = self.remove(control, &mut t, id.0, &find, lowered);
        self.live.store(t.hints.len(), Ordering::Relaxed);
        let trim = Self::shrink(&mut t);
        drop(t);
        if trim {
            Self::trim();
        }
        found
    }

    /// Drops every hint whose deadline has passed.
    fn expire(
        &self,
        control: &SlotControl,
        t: &mut Table,
        now: u64,
        find: &impl Fn(&ContentKey) -> Option<SlotRef>,
        lowered: &dyn Fn(SlotId),
    ) {
        while let Some(&(d, id)) = t.by_deadline.first() {
            if d > now {
                break;
            }
            self.remove(control, t, id, find, lowered);
        }
    }

    fn remove(
        &self,
        control: &SlotControl,
        t: &mut Table,
        id: u64,
        find: &impl Fn(&ContentKey) -> Option<SlotRef>,
        lowered: &dyn Fn(SlotId),
    ) -> bool {
        let Some((keys, deadline)) = t.hints.remove(&id) else { return false };
        t.by_deadline.remove(&(deadline, id));
        t.bytes = t.bytes.saturating_sub(HINT_BYTES + keys.len() * HINTED_KEY_BYTES);
        for k in keys {
            let Some(holders) = t.keys.get_mut(&k) else { continue };
            let d = if holders.remove(id) { holders.deadline() } else { None };
            if d.is_none() {
                t.keys.remove(&k);
            }
            if let Some(r) = find(&k) {
                // The block's last hint is gone: a policy that files candidates by class is told.
                // (Seeded bug, tests only: `unhint-not-reclassed` keeps that news from it.)
                if self.mark(control, r, d) && !crate::seeded::seeded("unhint-not-reclassed") {
                    lowered(r.slot);
                }
            }
        }
        true
    }

    /// A save reserved `r` for `key`: the slot carries the key's hint, if any (its previous
    /// occupant's mark names another generation either way).
    ///
    /// Called after the index entry was inserted. The read of `live` is a read-modify-write, so
    /// it is ordered with the one of a concurrent [`Hints::add`]: either this reads the hint's
    /// announcement (then the table lock below waits for that hint's keys), or the hint's swap reads
    /// this one's value and its lookups see the index entry, so the hint marks the slot itself.
    /// Either way a hint given while its key's save is reserving is not lost.
    pub(crate) fn on_reserve(&self, control: &SlotControl, key: &ContentKey, r: SlotRef) {
        // Seeded bug (model checking only): a plain load, which may miss a hint being added.
        let live = if crate::seeded::seeded("hint-race") {
            self.live.load(Ordering::Relaxed)
        } else {
            self.live.fetch_add(0, Ordering::AcqRel)
        };
        if live == 0 {
            return;
        }
        let t = crate::sync::lock(&self.table);
        if let Some(d) = t.keys.get(key).and_then(Holders::deadline) {
            self.mark(control, r, Some(d));
        }
    }
}

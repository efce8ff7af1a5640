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

#[derive(Default)]
struct Table {
    next: u64,
    /// Live hints: their keys and deadline.
    hints: HashMap<u64, (Vec<ContentKey>, u64)>,
    /// Per key, the live hints naming it and their deadlines.
    keys: HashMap<ContentKey, Vec<(u64, u64)>>,
    /// Live hints by deadline, to drop expired ones.
    by_deadline: BTreeSet<(u64, u64)>,
}

/// The tier's hints (see the module docs).
pub(crate) struct Hints {
    epoch: Instant,
    marks: Box<[AtomicU64]>,
    table: Mutex<Table>,
    /// Live hints (a save looks at the table only when some exist).
    live: AtomicUsize,
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
    ) -> HintId {
        let now = self.now_ms();
        let deadline = now + ttl.min(MAX_HINT_TTL).as_millis() as u64;
        let mut t = crate::sync::lock(&self.table);
        self.expire(control, &mut t, now, &find, lowered);
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
            let holders = t.keys.entry(*k).or_default();
            if holders.iter().any(|&(h, _)| h == id) {
                continue; // a key named twice in one hint
            }
            holders.push((id, deadline));
            let d = holders.iter().map(|&(_, d)| d).max();
            own.push(*k);
            if let Some(r) = find(k) {
                self.mark(control, r, d);
            }
        }
        t.hints.insert(id, (own, deadline));
        t.by_deadline.insert((deadline, id));
        self.live.store(t.hints.len(), Ordering::Release);
        HintId(id)
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
        for k in keys {
            let Some(holders) = t.keys.get_mut(&k) else { continue };
            holders.retain(|&(h, _)| h != id);
            let d = holders.iter().map(|&(_, d)| d).max();
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
        if let Some(d) = t.keys.get(key).and_then(|h| h.iter().map(|&(_, d)| d).max()) {
            self.mark(control, r, Some(d));
        }
    }
}
